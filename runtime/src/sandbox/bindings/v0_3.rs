//! `devicelet:plugin@0.3`: bindings generated from the line's newest frozen copy,
//! `wit/v0.3.1/` (a 0.3.0 module links against them by semver), and the conversions between
//! them and the host's types. The host interfaces but `mig` (0.3.1's) are 0.1.2's, unchanged,
//! so they are not generated again: the host defines them once, under every line's names.

wasmtime::component::bindgen!({
    path: "../wit/v0.3.1",
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
    AttributeValue, ContainerEdits, CounterSet, CounterUse, Device, Health, InitContext, Inventory,
    ModuleInfo, Prepared, Request, RequestPolicy, ResourceInfo, Shared, Taint, TaintEffect,
    ValidAmounts,
};

/// The optional exports' names (a 0.3.0 module's are found under them by semver).
pub const RELEASE: &str = "devicelet:plugin/release@0.3.1";
pub const CONFIG: &str = "devicelet:plugin/config@0.3.1";
pub const CLAIMS: &str = "devicelet:plugin/claims@0.3.1";

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
                    one_share_per_container: r.one_share_per_container,
                    prepares_claims: r.prepares_claims,
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

fn amounts(list: &[(String, String)]) -> Vec<wit::Amount> {
    list.iter()
        .map(|(name, value)| wit::Amount {
            name: name.clone(),
            value: value.clone(),
        })
        .collect()
}

fn pairs(list: Vec<wit::Amount>) -> Vec<(String, String)> {
    list.into_iter().map(|a| (a.name, a.value)).collect()
}

impl From<&Request> for wit::Request {
    fn from(r: &Request) -> Self {
        wit::Request {
            resource_name: r.resource.clone(),
            ids: r.ids.clone(),
            config: r.config.clone(),
            key: r.key.clone(),
            shares: r
                .shares
                .iter()
                .map(|s| wit::Share {
                    id: s.id.clone(),
                    share_id: s.share_id.clone(),
                    consumed: amounts(&s.consumed),
                })
                .collect(),
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

impl From<wit::RequestPolicy> for RequestPolicy {
    fn from(p: wit::RequestPolicy) -> Self {
        RequestPolicy {
            default: p.default,
            valid: match p.valid {
                wit::ValidAmounts::Any => ValidAmounts::Any,
                wit::ValidAmounts::Range(r) => ValidAmounts::Range {
                    min: r.min,
                    max: r.max,
                    step: r.step,
                },
                wit::ValidAmounts::Values(v) => ValidAmounts::Values(v),
            },
        }
    }
}

impl From<wit::Device> for Device {
    fn from(d: wit::Device) -> Self {
        let health = match d.health {
            wit::Health::Healthy => Health::Healthy,
            wit::Health::Unhealthy => Health::Unhealthy,
        };
        let mut policies = Vec::new();
        let capacities = d
            .capacities
            .into_iter()
            .map(|c| {
                if let Some(p) = c.request_policy {
                    policies.push((c.name.clone(), p.into()));
                }
                (c.name, c.value)
            })
            .collect();
        Device {
            id: d.id,
            health,
            health_reason: d.health_reason.filter(|_| health == Health::Unhealthy),
            numa_nodes: d.numa_nodes,
            attributes: d
                .attributes
                .into_iter()
                .map(|a| (a.name, a.value.into()))
                .collect(),
            capacities,
            group: d.group,
            exclusive: d.exclusive,
            edits: d.edits.map(ContainerEdits::from),
            pcie_root: None,
            taints: d
                .taints
                .into_iter()
                .map(|t| Taint {
                    key: t.key,
                    value: t.value,
                    effect: match t.effect {
                        wit::TaintEffect::NoSchedule => TaintEffect::NoSchedule,
                        wit::TaintEffect::NoExecute => TaintEffect::NoExecute,
                        wit::TaintEffect::None => TaintEffect::None,
                    },
                })
                .collect(),
            // Policies of a device not shared mean nothing, and are dropped.
            shared: d.shared_by_capacity.then_some(Shared { policies }),
            consumes: d
                .consumes
                .into_iter()
                .map(|u| CounterUse {
                    counter_set: u.counter_set,
                    counters: pairs(u.counters),
                })
                .collect(),
        }
    }
}

impl From<wit::Inventory> for Inventory {
    fn from(i: wit::Inventory) -> Self {
        Inventory {
            devices: i.devices.into_iter().map(Device::from).collect(),
            counter_sets: i
                .counter_sets
                .into_iter()
                .map(|c| CounterSet {
                    name: c.name,
                    counters: pairs(c.counters),
                })
                .collect(),
        }
    }
}

impl From<wit::Prepared> for Prepared {
    fn from(p: wit::Prepared) -> Self {
        Prepared {
            edits: p.edits.into(),
            status: p.status.into_iter().map(|s| (s.id, s.data)).collect(),
        }
    }
}

// Container edits and errors are the same in every line.
edits_and_errors_from!(wit);
