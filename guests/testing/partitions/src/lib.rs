//! A synthetic accelerator `acc-0` with 4 slices, published as partitions that draw on them
//! (WIT 0.3 counter sets), as MIG publishes a GPU: four `1s`, two `2s` and one `4s` partition,
//! each consuming its size in slices, so the scheduler never allocates two that overlap. Its
//! resource prepares its claims (`prepares-claims`): `prepare` "creates an instance" (logs
//! `created instance <key> on <ids>`), answers `ACC_INSTANCE=<key>` and the claim's status
//! `{"instance": "<key>"}`; `unprepare` logs `destroyed instance <key>`. A request whose config
//! is `{"slow":true}` spins in `prepare` after the log line, so a test can stop the agent
//! between the creation and the record of it; one whose config is `{"stuck":true}` fails its
//! first `unprepare` (in this instance), as an instance busy a little longer. A registry config
//! `{ taint = "<device>" }` gives that device the module's own taint
//! `example.com/maintenance:NoExecute`. It needs no grants.
//!
//! Built straight from the frozen `wit/v0.3.0/` text (no SDK), as SDK 0.3.0 built modules: the
//! scenarios that use it prove that today's agent, whose 0.3 bindings come from 0.3.1, still
//! finds and calls a 0.3.0 module's `claims` export and its counter sets.

// What `wit_bindgen::generate!` would expand to for `wit/v0.3.0/`, written by `sdk-guest/bindgen`.
include!("bindings.rs");

use devicelet::plugin::log::{Level, log};
use devicelet::plugin::types::{
    Amount, ContainerEdits, CounterSet, CounterUse, Device, DeviceStatus, Health, InitContext,
    Inventory, ModuleInfo, PluginError, Prepared, Request, ResourceInfo, Taint, TaintEffect,
};
use exports::devicelet::plugin::{claims, config, plugin, release};

struct Partitions;

const SLOW: &str = r#"{"slow":true}"#;
const STUCK: &str = r#"{"stuck":true}"#;

/// The device the registry's config taints, if any (`{"taint":"acc-0-4s-0"}`).
static TAINTED: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// Whether a `{"stuck":true}` unprepare has failed once already.
static REFUSED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

fn amount(name: &str, value: &str) -> Amount {
    Amount {
        name: name.into(),
        value: value.into(),
    }
}

impl plugin::Guest for Partitions {
    fn init(context: InitContext) -> Result<ModuleInfo, PluginError> {
        let config = context.config.trim();
        if !config.is_empty() && config != "{}" {
            let device = config
                .strip_prefix("{\"taint\":\"")
                .and_then(|r| r.strip_suffix("\"}"))
                .ok_or_else(|| {
                    PluginError::InvalidConfig(format!(
                        "expected {{ taint = \"<device>\" }}: {config}"
                    ))
                })?;
            let _ = TAINTED.set(device.to_owned());
        }
        Ok(ModuleInfo {
            version: "0.3.0-built".into(),
            resources: vec![ResourceInfo {
                name: "acc".into(),
                prestart: false,
                preferred_allocation: false,
                one_share_per_container: false,
                prepares_claims: true,
            }],
        })
    }

    fn enumerate(_resource: String) -> Result<Inventory, PluginError> {
        let mut devices = Vec::new();
        for (size, starts) in [(1, &[0, 1, 2, 3][..]), (2, &[0, 2]), (4, &[0])] {
            for start in starts {
                devices.push(Device {
                    id: format!("acc-0-{size}s-{start}"),
                    health: Health::Healthy,
                    health_reason: None,
                    numa_nodes: Vec::new(),
                    attributes: vec![devicelet::plugin::types::Attribute {
                        name: "profile".into(),
                        value: devicelet::plugin::types::AttributeValue::Text(format!("{size}s")),
                    }],
                    capacities: Vec::new(),
                    group: None,
                    exclusive: false,
                    edits: None,
                    taints: if TAINTED.get().map(String::as_str)
                        == Some(format!("acc-0-{size}s-{start}").as_str())
                    {
                        vec![Taint {
                            key: "example.com/maintenance".into(),
                            value: String::new(),
                            effect: TaintEffect::NoExecute,
                        }]
                    } else {
                        Vec::new()
                    },
                    shared_by_capacity: false,
                    consumes: vec![CounterUse {
                        counter_set: "acc-0".into(),
                        counters: vec![amount("slices", &size.to_string())],
                    }],
                });
            }
        }
        Ok(Inventory {
            devices,
            counter_sets: vec![CounterSet {
                name: "acc-0".into(),
                counters: vec![amount("slices", "4")],
            }],
        })
    }

    fn allocate(_request: Request) -> Result<ContainerEdits, PluginError> {
        Err(PluginError::Failed(
            "acc is prepared per claim (claims.prepare)".into(),
        ))
    }

    fn prestart(_resource: String, _ids: Vec<String>) -> Result<(), PluginError> {
        Ok(())
    }

    fn preferred(
        _resource: String,
        available: Vec<String>,
        _must_include: Vec<String>,
        size: u32,
    ) -> Result<Vec<String>, PluginError> {
        Ok(available.into_iter().take(size as usize).collect())
    }
}

impl config::Guest for Partitions {
    fn validate_config(_resource: String, config: String) -> Result<(), PluginError> {
        match config.trim() {
            "" | SLOW | STUCK => Ok(()),
            other => Err(PluginError::InvalidConfig(format!(
                "expected no config, {SLOW} or {STUCK}, got {other}"
            ))),
        }
    }
}

impl release::Guest for Partitions {
    fn release(_request: Request) -> Result<(), PluginError> {
        Ok(())
    }
}

impl claims::Guest for Partitions {
    fn prepare(request: Request) -> Result<Prepared, PluginError> {
        let key = &request.key;
        log(
            Level::Info,
            &format!("created instance {key} on {}", request.ids.join(",")),
        );
        if request.config.trim() == SLOW {
            loop {
                std::hint::spin_loop();
            }
        }
        Ok(Prepared {
            edits: ContainerEdits {
                envs: vec![("ACC_INSTANCE".into(), key.clone())],
                mounts: Vec::new(),
                devices: Vec::new(),
                annotations: Vec::new(),
                cdi_devices: Vec::new(),
            },
            status: request
                .ids
                .iter()
                .map(|id| DeviceStatus {
                    id: id.clone(),
                    data: format!(r#"{{"instance":"{key}"}}"#),
                })
                .collect(),
        })
    }

    fn unprepare(request: Request) -> Result<(), PluginError> {
        if request.config.trim() == STUCK
            && !REFUSED.swap(true, std::sync::atomic::Ordering::SeqCst)
        {
            return Err(PluginError::Failed(format!(
                "instance {} is busy; not destroyed yet",
                request.key
            )));
        }
        log(Level::Info, &format!("destroyed instance {}", request.key));
        Ok(())
    }
}

export!(Partitions);
