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

use std::collections::BTreeMap;

use devicelet_sdk::pci::{self, Filter, PciDevice};
use devicelet_sdk::{
    ContainerEdits, Device, Health, Plugin, PluginError, ResourceInfo, devnodes, export_plugin,
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
    seen: BTreeMap<String, Option<i64>>,
}

fn gpus() -> Result<Vec<PciDevice>, PluginError> {
    Ok(pci::scan(
        &Filter::any().vendor(AMD).class(0x03).class(0x12),
    )?)
}

impl AmdGpu {
    fn check(&self, resource: &str) -> Result<(), PluginError> {
        if resource == self.resource {
            Ok(())
        } else {
            Err(PluginError::UnknownResource(resource.into()))
        }
    }
}

impl Plugin for AmdGpu {
    fn init(config: &str) -> Result<(Self, Vec<ResourceInfo>), PluginError> {
        let config: Config =
            serde_json::from_str(config).map_err(|e| PluginError::InvalidConfig(e.to_string()))?;
        let info = ResourceInfo::new(config.resource.clone());
        let plugin = AmdGpu {
            resource: config.resource,
            seen: BTreeMap::new(),
        };
        Ok((plugin, vec![info]))
    }

    fn enumerate(&mut self, resource: &str) -> Result<Vec<Device>, PluginError> {
        self.check(resource)?;
        let kfd = devnodes::stat(KFD).is_ok();
        let mut devices = Vec::new();
        for gpu in gpus()? {
            let render = gpu.render_node();
            let usable = kfd && render.is_some_and(|node| devnodes::stat(&node).is_ok());
            let health = if usable {
                Health::Healthy
            } else {
                Health::Unhealthy
            };
            let mut device = Device::new(gpu.address.clone(), health)
                .attribute("pci-address", gpu.address.clone())
                .attribute("device-id", format!("{:#06x}", gpu.device));
            for name in PARTITIONS {
                if let Ok(mode) = gpu.attribute(name) {
                    device = device.attribute(name.replace('_', "-"), mode);
                }
            }
            if let Some(node) = gpu.numa_node {
                device = device.numa_node(node);
            }
            self.seen.insert(gpu.address, gpu.numa_node);
            devices.push(device);
        }
        for (address, node) in &self.seen {
            if !devices.iter().any(|d| d.id == *address) {
                let mut gone =
                    Device::unhealthy(address.clone()).attribute("pci-address", address.clone());
                if let Some(node) = node {
                    gone = gone.numa_node(*node);
                }
                devices.push(gone);
            }
        }
        Ok(devices)
    }

    fn allocate(&mut self, resource: &str, ids: &[String]) -> Result<ContainerEdits, PluginError> {
        self.check(resource)?;
        let mut edits = ContainerEdits::default().device(KFD, KFD, "rw");
        for id in ids {
            let gpu = pci::read(id).map_err(|e| PluginError::Failed(format!("GPU {id}: {e}")))?;
            let nodes = gpu.drm_nodes();
            if nodes.is_empty() {
                return Err(PluginError::Failed(format!(
                    "GPU {id} has no DRM nodes (is the amdgpu driver bound?)"
                )));
            }
            for node in nodes {
                edits = edits.device(node.clone(), node, "rw");
            }
        }
        Ok(edits)
    }
}

export_plugin!(AmdGpu);

#[cfg(test)]
mod tests;
