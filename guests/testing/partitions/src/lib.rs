//! A synthetic accelerator `acc-0` with 4 slices, published as partitions that draw on them
//! (WIT 0.3 counter sets), as MIG publishes a GPU: four `1s`, two `2s` and one `4s` partition,
//! each consuming its size in slices, so the scheduler never allocates two that overlap. Its
//! resource prepares its claims (`prepares-claims`): `prepare` "creates an instance" (logs
//! `created instance <key> on <ids>`), answers `ACC_INSTANCE=<key>` and the claim's status
//! `{"instance": "<key>"}`; `unprepare` logs `destroyed instance <key>`. A request whose config
//! is `{"slow":true}` spins in `prepare` after the log line, so a test can stop the agent
//! between the creation and the record of it. It needs no grants.

use devicelet_sdk::{
    ContainerEdits, CounterSet, Device, DeviceStatus, Plugin, PluginError, Prepared, Request,
    ResourceInfo, export_plugin,
};

struct Partitions;

const SLOW: &str = r#"{"slow":true}"#;

impl Plugin for Partitions {
    fn init(_config: &str) -> Result<(Self, Vec<ResourceInfo>), PluginError> {
        Ok((
            Partitions,
            vec![ResourceInfo::new("acc").with_prepares_claims(true)],
        ))
    }

    fn enumerate(&mut self, _resource: &str) -> Result<Vec<Device>, PluginError> {
        let mut devices = Vec::new();
        for (size, starts) in [(1, &[0, 1, 2, 3][..]), (2, &[0, 2]), (4, &[0])] {
            for start in starts {
                let slices = size.to_string();
                devices.push(
                    Device::healthy(format!("acc-0-{size}s-{start}"))
                        .attribute("profile", format!("{size}s"))
                        .consumes("acc-0", &[("slices", slices.as_str())]),
                );
            }
        }
        Ok(devices)
    }

    fn counter_sets(&mut self, _resource: &str) -> Result<Vec<CounterSet>, PluginError> {
        Ok(vec![CounterSet::new("acc-0", &[("slices", "4")])])
    }

    fn validate_config(&mut self, _resource: &str, config: &str) -> Result<(), PluginError> {
        match config.trim() {
            "" | SLOW => Ok(()),
            other => Err(PluginError::InvalidConfig(format!(
                "expected no config or {SLOW}, got {other}"
            ))),
        }
    }

    fn prepare(&mut self, request: &Request) -> Result<Prepared, PluginError> {
        let key = &request.key;
        devicelet_sdk::info!("created instance {key} on {}", request.ids.join(","));
        if request.config.trim() == SLOW {
            loop {
                std::hint::spin_loop();
            }
        }
        Ok(Prepared {
            edits: ContainerEdits::default().env("ACC_INSTANCE", key.clone()),
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

    fn unprepare(&mut self, request: &Request) -> Result<(), PluginError> {
        devicelet_sdk::info!("destroyed instance {}", request.key);
        Ok(())
    }
}

export_plugin!(Partitions);
