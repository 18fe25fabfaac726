//! `devicelet:plugin@0.2`: bindings generated from `wit/v0.2.0/`, and the conversions between
//! them and the host's types (0.3's additions left empty: no taints, shares or counters). The host interfaces are 0.1.2's, unchanged, so they are not
//! generated again: the host defines them once, under both lines' names.

wasmtime::component::bindgen!({
    path: "../wit/v0.2.0",
    world: "device-plugin",
    exports: { default: async },
    with: {
        "devicelet:plugin/log": super::v0_1::devicelet::plugin::log,
        "devicelet:plugin/sysfs": super::v0_1::devicelet::plugin::sysfs,
        "devicelet:plugin/devnodes": super::v0_1::devicelet::plugin::devnodes,
        "devicelet:plugin/nvml": super::v0_1::devicelet::plugin::nvml,
        "devicelet:plugin/schedule": super::v0_1::devicelet::plugin::schedule,
    },
});

pub use self::devicelet::plugin::types as wit;

use crate::device::{
    AttributeValue, ContainerEdits, Device, Health, InitContext, ModuleInfo, Request, ResourceInfo,
};

/// The optional exports' names.
pub const RELEASE: &str = "devicelet:plugin/release@0.2.0";
pub const CONFIG: &str = "devicelet:plugin/config@0.2.0";

impl From<wit::ModuleInfo> for ModuleInfo {
    fn from(m: wit::ModuleInfo) -> Self {
        ModuleInfo {
            version: super::printable_version(m.version),
            resources: m
                .resources
                .into_iter()
                .map(|r| ResourceInfo {
                    name: r.name,
                    prestart: r.prestart,
                    preferred_allocation: r.preferred_allocation,
                    one_share_per_container: false,
                    prepares_claims: false,
                })
                .collect(),
        }
    }
}

impl From<&InitContext> for wit::InitContext {
    fn from(c: &InitContext) -> Self {
        wit::InitContext {
            config: c.config.clone(),
            resource_domain: c.resource_domain.clone(),
            served_as: c.served_as.clone(),
        }
    }
}

impl From<&Request> for wit::Request {
    fn from(r: &Request) -> Self {
        wit::Request {
            resource_name: r.resource.clone(),
            ids: r.ids.clone(),
            config: r.config.clone(),
            key: r.key.clone(),
        }
    }
}

impl From<wit::AttributeValue> for AttributeValue {
    fn from(v: wit::AttributeValue) -> Self {
        match v {
            wit::AttributeValue::Int(n) => AttributeValue::Int(n),
            wit::AttributeValue::Boolean(b) => AttributeValue::Bool(b),
            wit::AttributeValue::Text(t) => AttributeValue::Text(t),
            wit::AttributeValue::Version(v) => AttributeValue::Version(v),
        }
    }
}

impl From<wit::Device> for Device {
    fn from(d: wit::Device) -> Self {
        let health = match d.health {
            wit::Health::Healthy => Health::Healthy,
            wit::Health::Unhealthy => Health::Unhealthy,
        };
        Device {
            health,
            health_reason: d.health_reason.filter(|_| health == Health::Unhealthy),
            numa_nodes: d.numa_nodes,
            attributes: d
                .attributes
                .into_iter()
                .map(|a| (a.name, a.value.into()))
                .collect(),
            capacities: d
                .capacities
                .into_iter()
                .map(|c| (c.name, c.value))
                .collect(),
            group: d.group,
            exclusive: d.exclusive,
            edits: d.edits.map(ContainerEdits::from),
            ..Device::new(d.id, health)
        }
    }
}

// Container edits and errors are the same in every line.
edits_and_errors_from!(wit);
