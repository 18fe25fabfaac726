//! devicelet's AMD GPU module: the GPUs of a node as AMD's device plugin sees them.
//!
//! Every PCI device of vendor `0x1002` whose class is a display controller (`0x03`) or a
//! processing accelerator (`0x12`) is one device, its ID the PCI address (`0000:03:00.0`), with
//! its NUMA node, its PCI device ID and, where sysfs has them (MI300), its compute and memory
//! partition modes as attributes. A container gets `/dev/kfd` and the GPU's DRM nodes
//! (`/dev/dri/card*`, `/dev/dri/renderD*`). A GPU is Unhealthy while `/dev/kfd` or its render
//! node is missing, and when its PCI device vanishes (fallen off the bus) it stays listed as
//! Unhealthy for as long as this instance runs, so the kubelet stops placing pods on it rather
//! than seeing it silently go. Sharing, preferred allocation (NUMA-aware) and CDI are the host's.
//!
//! Registry entry:
//!
//! ```toml
//! [[module]]
//! name = "amd-gpu"
//! path = "amd_gpu.wasm"
//! resource-domain = "amd.com"
//!
//! [module.grants]
//! sysfs = ["/sys/bus/pci/devices/*"]
//! dev = ["/dev/kfd", "/dev/dri/*"]
//!
//! [module.config]
//! resource = "gpu"   # the default
//! ```

use devicelet_sdk::pci::{self, Filter};
use devicelet_sdk::{
    ContainerEdits, Device, Health, Plugin, PluginError, ResourceInfo, Vanished, devnodes,
    export_plugin, serves,
};
use serde::Deserialize;

const AMD: u16 = 0x1002;
const KFD: &str = "/dev/kfd";
/// Partition modes MI300-class GPUs show in sysfs, reported as attributes.
const PARTITIONS: [&str; 2] = ["current_compute_partition", "current_memory_partition"];

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Config {
    #[serde(default = "default_resource")]
    resource: String,
}

fn default_resource() -> String {
    "gpu".into()
}

/// One instance's state: the GPUs it has seen, so one that vanishes is reported Unhealthy.
pub struct AmdGpu {
    resource: String,
    vanished: Vanished,
}

impl Plugin for AmdGpu {
    fn init(config: &str) -> Result<(Self, Vec<ResourceInfo>), PluginError> {
        let config: Config =
            serde_json::from_str(config).map_err(|e| PluginError::InvalidConfig(e.to_string()))?;
        let info = ResourceInfo::new(config.resource.clone());
        let vanished = Vanished::default();
        let resource = config.resource;
        Ok((AmdGpu { resource, vanished }, vec![info]))
    }

    fn enumerate(&mut self, resource: &str) -> Result<Vec<Device>, PluginError> {
        serves(resource, &self.resource)?;
        let kfd = devnodes::exists(KFD);
        let mut devices = Vec::new();
        for gpu in pci::scan(&Filter::any().vendor(AMD).class(0x03).class(0x12))? {
            let render = gpu
                .render_node()
                .is_some_and(|node| devnodes::exists(&node));
            let health = if kfd && render {
                Health::Healthy
            } else {
                Health::Unhealthy
            };
            devices.push(gpu.attributes_onto(gpu.device(health), &PARTITIONS));
        }
        self.vanished.keep(&mut devices, "its PCI device is gone");
        Ok(devices)
    }

    fn allocate(&mut self, resource: &str, ids: &[String]) -> Result<ContainerEdits, PluginError> {
        serves(resource, &self.resource)?;
        let mut edits = ContainerEdits::default().device(KFD, KFD, "rw");
        for id in ids {
            let gpu = pci::read(id).map_err(|e| PluginError::Failed(format!("GPU {id}: {e}")))?;
            let nodes = gpu.drm_nodes();
            if nodes.is_empty() {
                return Err(PluginError::Failed(format!(
                    "GPU {id} has no DRM nodes (is the amdgpu driver bound?)"
                )));
            }
            edits = edits.nodes(nodes, "rw");
        }
        Ok(edits)
    }
}

export_plugin!(AmdGpu);

#[cfg(test)]
mod tests;
