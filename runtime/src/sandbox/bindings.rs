//! The host/guest seam: the WIT world's generated bindings, and the conversions between them and
//! the host's own types. A new WIT major version gets a sibling module here and nothing else in
//! the host changes.

/// Bindings for `devicelet:plugin@0.1`, generated from the frozen copy in `wit/v0.1/`.
pub mod v0_1 {
    wasmtime::component::bindgen!({
        path: "../wit/v0.1",
        world: "device-plugin",
        exports: { default: async },
    });

    pub use self::devicelet::plugin::types as wit;
    pub use self::exports::devicelet::plugin::plugin as guest;
}

use v0_1::wit;

use crate::device::{ContainerEdits, Device, DeviceNode, Health, Mount, PluginError, ResourceInfo};

/// The interfaces a v0.1 module may import, each linked only when granted. A module built
/// against any `0.1.x` matches them: a minor version only adds, and wasmtime's linker resolves
/// `@0.1.x` imports to the host's `@0.1.1` definitions by semver compatibility.
pub mod imports {
    /// The export every module must have.
    pub const PLUGIN: &str = "devicelet:plugin/plugin@0.1.1";
    /// The interface versions this host implements: `0.1.x`.
    pub const COMPATIBLE: &str = "0.1.";

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Interface {
        Log,
        Types,
        Sysfs,
        Devnodes,
        /// Added in 0.1.1.
        Nvml,
    }

    /// Which of our interfaces `import` names: None when it is not a `devicelet:plugin`
    /// import at all, `Err` when it is one this host does not provide (an unknown interface, or
    /// a version other than 0.1.x).
    pub fn ours(import: &str) -> Option<Result<Interface, ()>> {
        let rest = import.strip_prefix("devicelet:plugin/")?;
        let (interface, version) = rest.split_once('@').unwrap_or((rest, ""));
        if !version.starts_with(COMPATIBLE) {
            return Some(Err(()));
        }
        Some(match interface {
            "log" => Ok(Interface::Log),
            "types" => Ok(Interface::Types),
            "sysfs" => Ok(Interface::Sysfs),
            "devnodes" => Ok(Interface::Devnodes),
            "nvml" => Ok(Interface::Nvml),
            _ => Err(()),
        })
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn any_0_1_x_import_matches_and_nothing_else() {
            assert_eq!(ours("devicelet:plugin/log@0.1.0"), Some(Ok(Interface::Log)));
            assert_eq!(
                ours("devicelet:plugin/sysfs@0.1.7"),
                Some(Ok(Interface::Sysfs))
            );
            assert_eq!(ours("devicelet:plugin/sysfs@0.2.0"), Some(Err(())));
            assert_eq!(ours("devicelet:plugin/sysfs@1.0.0"), Some(Err(())));
            assert_eq!(
                ours("devicelet:plugin/nvml@0.1.1"),
                Some(Ok(Interface::Nvml))
            );
            assert_eq!(ours("devicelet:plugin/gpio@0.1.1"), Some(Err(())));
            assert_eq!(ours("wasi:io/streams@0.2.0"), None);
        }
    }
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
                    file: None,
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
