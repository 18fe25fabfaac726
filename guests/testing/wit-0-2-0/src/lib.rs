//! A module exactly as SDK 0.2 built them, against `devicelet:plugin@0.2.0`: bindings straight
//! from the frozen `wit/v0.2.0/` text, no SDK, every optional export (`release`, `config`). It
//! serves `/dev/fuse` as the resource `fuse02`, with a typed attribute and a capacity, takes a
//! request config `{"tag": "..."}` and puts it in the container's env, so a scenario can check
//! that an agent speaking 0.3 still serves it through both kubelet APIs.

// What `wit_bindgen::generate!` would expand to for `wit/v0.2.0/`, written by `sdk-guest/bindgen`.
include!("bindings.rs");

use devicelet::plugin::devnodes;
use devicelet::plugin::types::{
    Attribute, AttributeValue, Capacity, ContainerEdits, Device, DeviceNode, Health, InitContext,
    ModuleInfo, PluginError, Request, ResourceInfo,
};
use exports::devicelet::plugin::{config, plugin, release};

struct Module;

fn failed(e: impl std::fmt::Debug) -> PluginError {
    PluginError::Failed(format!("{e:?}"))
}

/// `{"tag": "x"}` gives `x`; no config gives `none`.
fn tag(config: &str) -> Result<String, PluginError> {
    let config = config.trim();
    if config.is_empty() {
        return Ok("none".into());
    }
    let rest = config
        .strip_prefix("{\"tag\":\"")
        .and_then(|r| r.strip_suffix("\"}"))
        .filter(|t| t.bytes().all(|b| b.is_ascii_alphanumeric()));
    rest.map(str::to_owned).ok_or_else(|| {
        PluginError::InvalidConfig(format!("expected {{\"tag\":\"<alnum>\"}}, got {config}"))
    })
}

impl plugin::Guest for Module {
    fn init(_context: InitContext) -> Result<ModuleInfo, PluginError> {
        Ok(ModuleInfo {
            version: "0.2.0-built".into(),
            resources: vec![ResourceInfo {
                name: "fuse02".into(),
                prestart: false,
                preferred_allocation: false,
            }],
        })
    }

    fn enumerate(_resource: String) -> Result<Vec<Device>, PluginError> {
        let mut devices = Vec::new();
        for path in devnodes::glob("/dev/fuse").map_err(failed)? {
            let node = devnodes::stat(&path).map_err(failed)?;
            devices.push(Device {
                id: path.trim_start_matches("/dev/").replace('/', "-"),
                health: Health::Healthy,
                health_reason: None,
                numa_nodes: Vec::new(),
                attributes: vec![
                    Attribute {
                        name: "dev".into(),
                        value: AttributeValue::Text(format!("{}:{}", node.major, node.minor)),
                    },
                    Attribute {
                        name: "generation".into(),
                        value: AttributeValue::Int(2),
                    },
                ],
                capacities: vec![Capacity {
                    name: "streams".into(),
                    value: "4".into(),
                }],
                group: None,
                exclusive: false,
                edits: None,
            });
        }
        Ok(devices)
    }

    fn allocate(request: Request) -> Result<ContainerEdits, PluginError> {
        let tag = tag(&request.config)?;
        Ok(ContainerEdits {
            envs: vec![("FUSE02_TAG".into(), tag)],
            mounts: Vec::new(),
            devices: request
                .ids
                .iter()
                .map(|id| DeviceNode {
                    container_path: format!("/dev/{id}"),
                    host_path: format!("/dev/{id}"),
                    permissions: "rw".into(),
                })
                .collect(),
            annotations: Vec::new(),
            cdi_devices: Vec::new(),
        })
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

impl release::Guest for Module {
    fn release(_request: Request) -> Result<(), PluginError> {
        Ok(())
    }
}

impl config::Guest for Module {
    fn validate_config(_resource: String, config: String) -> Result<(), PluginError> {
        tag(&config).map(|_| ())
    }
}

export!(Module);
