//! `devicelet:plugin@0.1`: bindings generated from the line's newest frozen copy,
//! `wit/v0.1.2/` (a module built against an older 0.1.x links against them by semver), and the
//! conversions between them and the host's types. The host interfaces' Rust types come from here
//! for both lines: 0.2 kept them unchanged.

wasmtime::component::bindgen!({
    path: "../wit/v0.1.2",
    world: "device-plugin",
    exports: { default: async },
});

pub use self::devicelet::plugin::types as wit;
pub use self::exports::devicelet::plugin::plugin as guest;

use crate::device::{AttributeValue, Device, Health, ResourceInfo};

impl From<wit::ResourceInfo> for ResourceInfo {
    fn from(r: wit::ResourceInfo) -> Self {
        ResourceInfo {
            name: r.name,
            prestart: r.prestart,
            preferred_allocation: r.preferred_allocation,
            one_share_per_container: false,
            prepares_claims: false,
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

/// A 0.1 device: text attributes, no reason, group, capacity or edits of its own.
impl From<wit::Device> for Device {
    fn from(d: wit::Device) -> Self {
        Device {
            numa_nodes: d.numa_nodes,
            attributes: d
                .attributes
                .into_iter()
                .map(|(k, v)| (k, AttributeValue::Text(v)))
                .collect(),
            ..Device::new(d.id, d.health.into())
        }
    }
}

// Container edits and errors are the same in every line.
edits_and_errors_from!(wit);
