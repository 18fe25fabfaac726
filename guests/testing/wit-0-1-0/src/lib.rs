//! A module exactly as a vendor wrote one against `devicelet:plugin@0.1.0`, before the SDK spoke
//! 0.1.1: bindings straight from the frozen `wit/v0.1.0/` text, no SDK. It serves `/dev/fuse`
//! (through the 0.1.0 `devnodes` import) as the resource `legacy`, so a scenario can check that
//! an agent speaking a newer 0.1.x still loads, enumerates and allocates it.

// What `wit_bindgen::generate!` would expand to for `wit/v0.1.0/`, written by `sdk-guest/bindgen`.
include!("bindings.rs");

use devicelet::plugin::types::{
    ContainerEdits, Device, DeviceNode, Health, PluginError, ResourceInfo,
};
use devicelet::plugin::{devnodes, log};
use exports::devicelet::plugin::plugin::Guest;

struct Legacy;

fn failed(e: impl std::fmt::Debug) -> PluginError {
    PluginError::Failed(format!("{e:?}"))
}

impl Guest for Legacy {
    fn init(_config: String) -> Result<Vec<ResourceInfo>, PluginError> {
        log::log(log::Level::Info, "built against devicelet:plugin@0.1.0");
        Ok(vec![ResourceInfo {
            name: "legacy".into(),
            prestart: false,
            preferred_allocation: false,
        }])
    }

    fn enumerate(_resource: String) -> Result<Vec<Device>, PluginError> {
        let mut devices = Vec::new();
        for path in devnodes::glob("/dev/fuse").map_err(failed)? {
            let node = devnodes::stat(&path).map_err(failed)?;
            devices.push(Device {
                id: path.trim_start_matches("/dev/").replace('/', "-"),
                health: Health::Healthy,
                numa_nodes: Vec::new(),
                attributes: vec![("dev".into(), format!("{}:{}", node.major, node.minor))],
            });
        }
        Ok(devices)
    }

    fn allocate(_resource: String, ids: Vec<String>) -> Result<ContainerEdits, PluginError> {
        Ok(ContainerEdits {
            envs: vec![("LEGACY_DEVICES".into(), ids.join(","))],
            mounts: Vec::new(),
            devices: ids
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
        must_include: Vec<String>,
        size: u32,
    ) -> Result<Vec<String>, PluginError> {
        let mut chosen = must_include;
        for id in available {
            if chosen.len() >= size as usize {
                break;
            }
            if !chosen.contains(&id) {
                chosen.push(id);
            }
        }
        Ok(chosen)
    }
}

export!(Legacy);
