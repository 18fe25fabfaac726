//! The host/guest seam: the WIT world's generated bindings, and the conversions between them and
//! the host's own types. A new WIT major version gets a sibling module here and nothing else in
//! the host changes.

/// Bindings for `devicelet:plugin@0.1.0`.
pub mod v0_1 {
    wasmtime::component::bindgen!({
        path: "../wit",
        world: "device-plugin",
        exports: { default: async },
    });

    pub use self::devicelet::plugin::types as wit;
    pub use self::exports::devicelet::plugin::plugin as guest;
}

use v0_1::wit;

use super::types::{ContainerEdits, Device, DeviceNode, Health, Mount, PluginError, ResourceInfo};

/// The interface names a v0.1 module may import, each linked only when granted.
pub mod imports {
    pub const LOG: &str = "devicelet:plugin/log@0.1.0";
    pub const SYSFS: &str = "devicelet:plugin/sysfs@0.1.0";
    pub const DEVNODES: &str = "devicelet:plugin/devnodes@0.1.0";
    pub const TYPES: &str = "devicelet:plugin/types@0.1.0";
    /// The export every module must have.
    pub const PLUGIN: &str = "devicelet:plugin/plugin@0.1.0";
}

impl From<wit::ResourceInfo> for ResourceInfo {
    fn from(r: wit::ResourceInfo) -> Self {
        ResourceInfo {
            name: r.name,
            prestart: r.prestart,
            preferred_allocation: r.preferred_allocation,
        }
    }
}

impl From<wit::Health> for Health {
    fn from(h: wit::Health) -> Self {
        match h {
            wit::Health::Healthy => Health::Healthy,
            wit::Health::Unhealthy => Health::Unhealthy,
        }
    }
}

impl From<wit::Device> for Device {
    fn from(d: wit::Device) -> Self {
        Device {
            id: d.id,
            health: d.health.into(),
            numa_nodes: d.numa_nodes,
            attributes: d.attributes,
        }
    }
}

impl From<wit::ContainerEdits> for ContainerEdits {
    fn from(e: wit::ContainerEdits) -> Self {
        ContainerEdits {
            envs: e.envs,
            mounts: e
                .mounts
                .into_iter()
                .map(|m| Mount {
                    container_path: m.container_path,
                    host_path: m.host_path,
                    read_only: m.read_only,
                })
                .collect(),
            devices: e
                .devices
                .into_iter()
                .map(|d| DeviceNode {
                    container_path: d.container_path,
                    host_path: d.host_path,
                    permissions: d.permissions,
                })
                .collect(),
            annotations: e.annotations,
            cdi_devices: e.cdi_devices,
        }
    }
}

impl From<wit::PluginError> for PluginError {
    fn from(e: wit::PluginError) -> Self {
        match e {
            wit::PluginError::InvalidConfig(m) => PluginError::InvalidConfig(m),
            wit::PluginError::UnknownResource(m) => PluginError::UnknownResource(m),
            wit::PluginError::UnknownDevice(m) => PluginError::UnknownDevice(m),
            wit::PluginError::Failed(m) => PluginError::Failed(m),
        }
    }
}
