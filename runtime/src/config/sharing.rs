//! `[module.sharing]`: how many containers may share each device of a module's resources.
//!
//! ```toml
//! [module.sharing]
//! replicas = 2                          # every device of every resource, twice
//! rename = false                        # serve shared resources as `<name>.shared`
//! fail-requests-greater-than-one = false
//!
//! [module.sharing.resources.gpu]        # a resource of the module, by the name it declares
//! replicas = 4
//! devices = { "gpu-0" = 1 }             # per device: this one is not shared
//! ```

use std::collections::BTreeMap;

use super::error::RegistryError;
use super::value::Node;

/// Most replicas of one device.
pub const MAX_REPLICAS: u32 = 256;

/// How one resource's devices are shared.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShareRule {
    /// Times each device is advertised (1: not shared).
    pub replicas: u32,
    /// Serve the resource as `<name>.shared` while any device has replicas, so pods can tell.
    pub rename: bool,
    /// Refuse an Allocate of more than one replica (a container asking for two is asking for two
    /// physical devices, which sharing cannot promise).
    pub fail_requests_greater_than_one: bool,
    /// Replicas per device ID, over `replicas`.
    pub devices: BTreeMap<String, u32>,
}

impl Default for ShareRule {
    fn default() -> Self {
        ShareRule {
            replicas: 1,
            rename: false,
            fail_requests_greater_than_one: false,
            devices: BTreeMap::new(),
        }
    }
}

impl ShareRule {
    /// Replicas of the device with this (physical) ID.
    pub fn replicas_of(&self, id: &str) -> u32 {
        self.devices.get(id).copied().unwrap_or(self.replicas)
    }

    /// Whether any device can have more than one replica.
    pub fn shares(&self) -> bool {
        self.replicas > 1 || self.devices.values().any(|&r| r > 1)
    }
}

/// A module's sharing: the rule for each resource it declares.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Sharing {
    /// For resources without a rule of their own.
    pub default: ShareRule,
    /// By the resource name the module declares.
    pub resources: BTreeMap<String, ShareRule>,
}

impl Sharing {
    /// The rule for the resource the module declared as `name`.
    pub fn rule(&self, name: &str) -> &ShareRule {
        self.resources.get(name).unwrap_or(&self.default)
    }
}

pub(super) const KEYS: &[&str] = &[
    "replicas",
    "rename",
    "fail-requests-greater-than-one",
    "resources",
];
pub(super) const RESOURCE_KEYS: &[&str] = &[
    "replicas",
    "rename",
    "fail-requests-greater-than-one",
    "devices",
];

/// Reads a `[module.sharing]` table.
pub(super) fn parse(node: &Node<'_>) -> Result<Sharing, RegistryError> {
    let table = node.table("a table, e.g. { replicas = 2 }")?;
    let mut sharing = Sharing::default();
    let mut resources = Vec::new();
    for entry in table.entries() {
        match entry.name {
            "resources" => resources.push(entry.node),
            name => {
                if !rule_key(&mut sharing.default, name, &entry.node)? {
                    return Err(entry.unknown(KEYS));
                }
            }
        }
    }
    for node in resources {
        let table = node.table("a table of resources, e.g. { gpu = { replicas = 4 } }")?;
        for entry in table.entries() {
            let mut rule = ShareRule {
                devices: BTreeMap::new(),
                ..sharing.default.clone()
            };
            let fields = entry.node.table("a table, e.g. { replicas = 4 }")?;
            for field in fields.entries() {
                if field.name == "devices" {
                    rule.devices = devices(&field.node)?;
                } else if !rule_key(&mut rule, field.name, &field.node)? {
                    return Err(field.unknown(RESOURCE_KEYS));
                }
            }
            sharing.resources.insert(entry.name.to_owned(), rule);
        }
    }
    Ok(sharing)
}

/// Sets `name` on `rule`; false when `name` is no rule key.
fn rule_key(rule: &mut ShareRule, name: &str, node: &Node<'_>) -> Result<bool, RegistryError> {
    match name {
        "replicas" => rule.replicas = replicas(node)?,
        "rename" => rule.rename = boolean(node)?,
        "fail-requests-greater-than-one" => rule.fail_requests_greater_than_one = boolean(node)?,
        _ => return Ok(false),
    }
    Ok(true)
}

fn devices(node: &Node<'_>) -> Result<BTreeMap<String, u32>, RegistryError> {
    let table = node.table("a table of device IDs to replicas, e.g. { \"gpu-0\" = 1 }")?;
    let mut devices = BTreeMap::new();
    for entry in table.entries() {
        if entry.name.contains("::") {
            return Err(entry
                .node
                .error("a device ID with `::` cannot be shared: `::` separates replica numbers"));
        }
        devices.insert(entry.name.to_owned(), replicas(&entry.node)?);
    }
    Ok(devices)
}

fn replicas(node: &Node<'_>) -> Result<u32, RegistryError> {
    let n = node
        .get()
        .as_integer()
        .ok_or_else(|| node.type_error("a number of replicas"))?;
    u32::from_str_radix(n.as_str(), n.radix())
        .ok()
        .filter(|r| (1..=MAX_REPLICAS).contains(r))
        .ok_or_else(|| {
            node.error(format!(
                "replicas out of range: expected 1 to {MAX_REPLICAS}"
            ))
        })
}

fn boolean(node: &Node<'_>) -> Result<bool, RegistryError> {
    node.get()
        .as_bool()
        .ok_or_else(|| node.type_error("true or false"))
}
