//! devicelet's reference module: serves the `/dev` nodes matching configured globs as devices,
//! the generic-device-plugin / smarter-device-manager use case (FUSE, TUN, serial adapters,
//! sound cards, video capture...).
//!
//! It only needs `/dev` grants: the component imports `devicelet:plugin/devnodes` and `log`,
//! never `sysfs`.
//!
//! # Config
//!
//! The registry's `[module.config]` table; unknown keys are refused:
//!
//! ```toml
//! [module.config]
//! groups = [
//!   { name = "fuse", paths = ["/dev/fuse"], permissions = "rw" },
//!   { name = "serial", paths = ["/dev/ttyUSB*", "/dev/ttyACM*"], prestart-check = true },
//! ]
//! ```
//!
//! Sharing a node between containers (FUSE, TUN) and choosing among nodes are the agent's:
//! `[module.sharing]` advertises each node several times (`replicas = 10`), and the agent's
//! preferred allocation (`allocation-policy`, NUMA-aware) picks. The module's own `count` and
//! `preferred` of 0.1 are gone; a config that still has them is refused with that hint.
//!
//! Each group is one resource:
//!
//! - `name` (required): the resource name suffix (the host prefixes the resource domain), a DNS
//!   label-like `[a-z0-9]([-a-z0-9.]*[a-z0-9])?` of at most 63 characters, unique among groups.
//! - `paths` (required, non-empty): glob patterns under `/dev/` (`*`, `?`, `[...]`). Every
//!   matching node that is a character or block device is one physical device. Nodes appear and
//!   disappear with the node: each enumeration globs again.
//! - `permissions` (default `"rw"`): the device cgroup permissions, a non-empty combination of
//!   `r`, `w` and `m` without repeats.
//! - `prestart-check` (default false): asks the kubelet for prestart calls, which fail when an
//!   allocated node has disappeared since allocation.
//! - `own-edits` (default false): each device carries its own edits (its node), so the agent
//!   answers Allocate from them without calling the module (WIT 0.2).
//! - `exclusive` (default false): the devices are never shared; the agent refuses a
//!   `[module.sharing]` rule that would give them replicas (WIT 0.2).
//! - `together` (default false): all the group's nodes are allocated together or not at all (one
//!   device group, WIT 0.2): the agent refuses a request for part of them.
//! - `capacity` (WIT 0.3): `{ name = "bandwidth", value = "10G", default = "1G", step = "1G" }`
//!   makes each node an amount of something several Dynamic Resource Allocation claims share
//!   (shared by capacity): each claim holds part of `value` (`default` when it asks nothing,
//!   rounded up to a multiple of `step` from `min`, default `step`), the scheduler and the agent
//!   keep the count, and the container gets `GENERIC_DEV_<NAME>` (upper case, `-` as `_`) set to
//!   `<device>=<amount held>` for each of its devices. Not with `exclusive`, `together` or
//!   `own-edits`.
//!
//! # Device IDs
//!
//! A node's ID is its path without `/dev/`, with `/` replaced by `-` and any other character
//! outside `[A-Za-z0-9._-]` by `_`: `/dev/ttyUSB0` → `ttyUSB0`, `/dev/net/tun` → `net-tun`.
//! Two nodes mapping to the same ID (`/dev/a b` and `/dev/a_b`) cannot both be served: the first
//! in glob order wins and the other is skipped with a warning.

use std::collections::{BTreeMap, BTreeSet};

use devicelet_sdk::{
    ContainerEdits, Device, FsError, Plugin, PluginError, Request, RequestPolicy, ResourceInfo,
    devnodes, export_plugin,
};
use serde::Deserialize;

/// Longest resource name suffix.
const MAX_NAME_LEN: usize = 63;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct RawConfig {
    groups: Vec<RawGroup>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct RawGroup {
    name: String,
    paths: Vec<String>,
    /// 0.1's own sharing, refused with a hint.
    #[serde(default)]
    count: Option<serde_json::Value>,
    #[serde(default = "default_permissions")]
    permissions: String,
    /// 0.1's own preferred allocation, refused with a hint.
    #[serde(default)]
    preferred: Option<serde_json::Value>,
    #[serde(default)]
    prestart_check: bool,
    #[serde(default)]
    own_edits: bool,
    #[serde(default)]
    exclusive: bool,
    #[serde(default)]
    together: bool,
    #[serde(default)]
    capacity: Option<SharedCapacity>,
}

/// An amount each node has, which claims share (WIT 0.3 shared by capacity).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct SharedCapacity {
    /// A DNS label: `bandwidth`.
    name: String,
    /// A Kubernetes quantity: `10G`.
    value: String,
    /// What a claim that asks nothing holds.
    default: String,
    /// Claims hold multiples of it (from `min`).
    step: String,
    /// The least a claim holds; default `step`.
    #[serde(default)]
    min: Option<String>,
}

fn default_permissions() -> String {
    "rw".to_string()
}

/// One validated group: one resource.
#[derive(Debug, Clone, PartialEq, Eq)]
struct GroupSpec {
    name: String,
    paths: Vec<String>,
    permissions: String,
    prestart_check: bool,
    /// Each device carries its own edits (WIT 0.2): the agent answers Allocate without calling
    /// `allocate`.
    own_edits: bool,
    /// Never shared (WIT 0.2).
    exclusive: bool,
    /// Every node of the group is one device group: allocated together or not at all.
    together: bool,
    /// Each node shared by capacity (WIT 0.3).
    capacity: Option<SharedCapacity>,
}

/// Parses and validates the module's config JSON.
fn parse_config(config: &str) -> Result<Vec<GroupSpec>, String> {
    let raw: RawConfig = serde_json::from_str(config).map_err(|e| e.to_string())?;
    if raw.groups.is_empty() {
        return Err("`groups` is empty; give at least one group, e.g. \
                    {\"name\": \"fuse\", \"paths\": [\"/dev/fuse\"]}"
            .to_string());
    }
    let mut names = BTreeSet::new();
    let mut specs = Vec::with_capacity(raw.groups.len());
    for (i, group) in raw.groups.into_iter().enumerate() {
        let at = format!("groups[{i}]");
        validate_name(&group.name).map_err(|e| format!("{at}.name: {e}"))?;
        let at = format!("{at} ({:?})", group.name);
        if !names.insert(group.name.clone()) {
            return Err(format!("{at}: the name is used by an earlier group"));
        }
        if group.paths.is_empty() {
            return Err(format!(
                "{at}.paths is empty; give at least one pattern under /dev/"
            ));
        }
        for pattern in &group.paths {
            validate_pattern(pattern).map_err(|e| format!("{at}.paths: {e}"))?;
        }
        if group.count.is_some() {
            return Err(format!(
                "{at}.count: generic-dev no longer shares nodes itself; advertise each node N \
                 times with the registry's [module.sharing] replicas = N"
            ));
        }
        if group.preferred.is_some() {
            return Err(format!(
                "{at}.preferred: generic-dev no longer chooses devices itself; the agent's \
                 preferred allocation does (registry key `allocation-policy`)"
            ));
        }
        validate_permissions(&group.permissions).map_err(|e| format!("{at}.permissions: {e}"))?;
        if let Some(c) = &group.capacity {
            validate_capacity(c).map_err(|e| format!("{at}.capacity: {e}"))?;
            if group.exclusive || group.together || group.own_edits {
                return Err(format!(
                    "{at}.capacity: a node shared by capacity cannot be `exclusive`, \
                     `together` or have `own-edits`"
                ));
            }
        }
        specs.push(GroupSpec {
            name: group.name,
            paths: group.paths,
            permissions: group.permissions,
            prestart_check: group.prestart_check,
            own_edits: group.own_edits,
            exclusive: group.exclusive,
            together: group.together,
            capacity: group.capacity,
        });
    }
    Ok(specs)
}

/// A DNS-label name and Kubernetes quantities (digits, an optional `.`, a suffix).
fn validate_capacity(c: &SharedCapacity) -> Result<(), String> {
    let label = !c.name.is_empty()
        && c.name.len() <= 63
        && c.name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !c.name.starts_with('-')
        && !c.name.ends_with('-');
    if !label {
        return Err(format!("name {:?} must be a DNS label", c.name));
    }
    let quantity = |q: &str| {
        let end = q
            .find(|ch: char| !(ch.is_ascii_digit() || ch == '.'))
            .unwrap_or(q.len());
        let (number, suffix) = q.split_at(end);
        number.bytes().any(|b| b.is_ascii_digit())
            && [
                "", "m", "k", "M", "G", "T", "P", "E", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei",
            ]
            .contains(&suffix)
    };
    for (key, q) in [
        ("value", c.value.as_str()),
        ("default", c.default.as_str()),
        ("step", c.step.as_str()),
        ("min", c.min.as_deref().unwrap_or("1")),
    ] {
        if !quantity(q) {
            return Err(format!(
                "{key} {q:?} is not a Kubernetes quantity (`10G`, `500m`)"
            ));
        }
    }
    Ok(())
}

/// `[a-z0-9]([-a-z0-9.]*[a-z0-9])?`, at most 63 characters.
fn validate_name(name: &str) -> Result<(), String> {
    let edge = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit();
    let inner = |c: char| edge(c) || c == '-' || c == '.';
    let valid = name.len() <= MAX_NAME_LEN
        && name.starts_with(edge)
        && name.ends_with(edge)
        && name.chars().all(inner);
    if valid {
        Ok(())
    } else {
        Err(format!(
            "{name:?} is not a valid resource name: use at most {MAX_NAME_LEN} lowercase letters, \
             digits, '-' and '.', starting and ending with a letter or digit, e.g. \"fuse\""
        ))
    }
}

/// An absolute pattern under `/dev/` without `..` components.
fn validate_pattern(pattern: &str) -> Result<(), String> {
    let Some(rest) = pattern.strip_prefix("/dev/") else {
        return Err(format!("{pattern:?} is not under /dev/"));
    };
    if rest.is_empty()
        || rest
            .split('/')
            .any(|c| c.is_empty() || c == "." || c == "..")
    {
        return Err(format!(
            "{pattern:?} is not a plain path pattern (empty, `.` or `..` components)"
        ));
    }
    Ok(())
}

/// A non-empty combination of `r`, `w` and `m` without repeats.
fn validate_permissions(permissions: &str) -> Result<(), String> {
    let mut seen = BTreeSet::new();
    let valid = !permissions.is_empty()
        && permissions
            .chars()
            .all(|c| matches!(c, 'r' | 'w' | 'm') && seen.insert(c));
    if valid {
        Ok(())
    } else {
        Err(format!(
            "{permissions:?} is not a non-empty combination of 'r', 'w' and 'm' without repeats"
        ))
    }
}

/// A node's base ID: the path without `/dev/`, `/` → `-`, other characters outside
/// `[A-Za-z0-9._-]` → `_`.
fn node_id(path: &str) -> String {
    let rest = path
        .strip_prefix("/dev/")
        .unwrap_or_else(|| path.trim_start_matches('/'));
    rest.chars()
        .map(|c| match c {
            '/' => '-',
            c if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') => c,
            _ => '_',
        })
        .collect()
}

/// A node that currently matches a group's patterns.
struct Node {
    path: String,
    base: String,
    major: u32,
    minor: u32,
}

/// One group at run time.
struct Group {
    spec: GroupSpec,
    /// Base ID → node path of every node seen since init, present or not, so allocate and
    /// prestart can say which node a vanished device was.
    known: BTreeMap<String, String>,
    /// Paths already warned about for an ID collision.
    collisions: BTreeSet<String>,
}

impl Group {
    /// Globs the patterns and keeps the character and block devices, in pattern order and then
    /// glob (sorted) order.
    fn scan(&mut self) -> Result<Vec<Node>, PluginError> {
        let mut nodes: Vec<Node> = Vec::new();
        let mut by_base: BTreeMap<String, String> = BTreeMap::new();
        let mut seen: BTreeSet<String> = BTreeSet::new();
        for pattern in &self.spec.paths {
            let paths = devnodes::glob(pattern)
                .map_err(|e| PluginError::Failed(format!("glob {pattern}: {}", fs_text(&e))))?;
            for path in paths {
                if !seen.insert(path.clone()) {
                    continue;
                }
                let info = match devnodes::stat(&path) {
                    Ok(info) if info.is_device() => info,
                    Ok(_) | Err(FsError::NotFound) => continue,
                    Err(e) => {
                        devicelet_sdk::debug!("skipping {path}: {}", fs_text(&e));
                        continue;
                    }
                };
                let base = node_id(&path);
                if base.is_empty() {
                    continue;
                }
                if let Some(first) = by_base.get(&base) {
                    if self.collisions.insert(path.clone()) {
                        devicelet_sdk::warn!(
                            "{}: skipping {path}: its ID {base:?} is already {first}'s",
                            self.spec.name
                        );
                    }
                    continue;
                }
                by_base.insert(base.clone(), path.clone());
                nodes.push(Node {
                    path,
                    base,
                    major: info.major,
                    minor: info.minor,
                });
            }
        }
        for node in &nodes {
            self.known.insert(node.base.clone(), node.path.clone());
        }
        Ok(nodes)
    }

    /// The node path behind each ID, from the nodes seen so far or, when some ID is unknown, a
    /// fresh scan; `Err(id)` for an ID no node maps to.
    fn resolve(&mut self, ids: &[String]) -> Result<Vec<Result<String, String>>, PluginError> {
        let lookup = |group: &Self| -> Vec<Result<String, String>> {
            ids.iter()
                .map(|id| group.known.get(id).cloned().ok_or_else(|| id.clone()))
                .collect()
        };
        let found = lookup(self);
        if found.iter().all(Result::is_ok) {
            return Ok(found);
        }
        self.scan()?;
        Ok(lookup(self))
    }

    /// The distinct node paths behind `ids`, in order; unknown IDs are an error.
    fn nodes_of(&mut self, ids: &[String]) -> Result<Vec<String>, PluginError> {
        let mut paths: Vec<String> = Vec::new();
        for found in self.resolve(ids)? {
            let path = found.map_err(PluginError::UnknownDevice)?;
            if !paths.contains(&path) {
                paths.push(path);
            }
        }
        Ok(paths)
    }

    /// Fails unless `path` still exists and is a character or block device.
    fn check_present(path: &str) -> Result<(), PluginError> {
        match devnodes::stat(path) {
            Ok(info) if info.is_device() => Ok(()),
            Ok(_) => Err(PluginError::Failed(format!(
                "{path} is no longer a device node"
            ))),
            Err(FsError::NotFound) => Err(PluginError::Failed(format!("{path} is gone"))),
            Err(e) => Err(PluginError::Failed(format!("{path}: {}", fs_text(&e)))),
        }
    }
}

fn fs_text(err: &FsError) -> String {
    match err {
        FsError::NotFound => "not found".to_string(),
        FsError::Denied(why) => format!("denied: {why}"),
        FsError::Io(why) => format!("I/O error: {why}"),
    }
}

struct GenericDev {
    groups: Vec<Group>,
}

impl GenericDev {
    fn group(&mut self, resource: &str) -> Result<&mut Group, PluginError> {
        self.groups
            .iter_mut()
            .find(|g| g.spec.name == resource)
            .ok_or_else(|| PluginError::UnknownResource(resource.to_string()))
    }
}

/// Logs each group with the nodes it has now.
fn announce(groups: &mut [Group]) {
    let served: Vec<String> = groups
        .iter_mut()
        .map(|group| {
            let spec = &group.spec;
            let mut line = format!(
                "{} ({}, permissions {}",
                spec.name,
                spec.paths.join(" "),
                spec.permissions
            );
            if spec.prestart_check {
                line.push_str(", prestart check");
            }
            match group.scan() {
                Ok(nodes) => line.push_str(&format!("): {} node(s) now", nodes.len())),
                Err(PluginError::Failed(why)) => line.push_str(&format!("): not scanned: {why}")),
                Err(_) => line.push_str("): not scanned"),
            }
            line
        })
        .collect();
    devicelet_sdk::info!("generic-dev serving {}", served.join("; "));
}

impl Plugin for GenericDev {
    fn init(config: &str) -> Result<(Self, Vec<ResourceInfo>), PluginError> {
        let specs = parse_config(config).map_err(PluginError::InvalidConfig)?;
        let mut groups: Vec<Group> = specs
            .into_iter()
            .map(|spec| Group {
                spec,
                known: BTreeMap::new(),
                collisions: BTreeSet::new(),
            })
            .collect();
        // What the module serves is said once per load, by the first instance: the agent's
        // others, made right after it, find their devices when first asked.
        if devicelet_sdk::context::first_instance() {
            announce(&mut groups);
        }
        let resources = groups
            .iter()
            .map(|g| ResourceInfo::new(g.spec.name.clone()).with_prestart(g.spec.prestart_check))
            .collect();
        Ok((GenericDev { groups }, resources))
    }

    fn enumerate(&mut self, resource: &str) -> Result<Vec<Device>, PluginError> {
        let group = self.group(resource)?;
        let spec = group.spec.clone();
        let nodes = group.scan()?;
        Ok(nodes
            .into_iter()
            .map(|node| {
                let mut device = Device::healthy(node.base)
                    .attribute("path", node.path.clone())
                    .attribute("dev", format!("{}:{}", node.major, node.minor));
                if spec.own_edits {
                    device = device.edits(ContainerEdits::default().device(
                        node.path.clone(),
                        node.path,
                        spec.permissions.clone(),
                    ));
                }
                if spec.exclusive {
                    device = device.exclusive();
                }
                if spec.together {
                    device = device.group(spec.name.clone());
                }
                if let Some(c) = &spec.capacity {
                    let min = c.min.as_deref().unwrap_or(&c.step);
                    device = device.shared_by_capacity().shared_capacity(
                        c.name.clone(),
                        c.value.clone(),
                        RequestPolicy::range(&c.default, min, Some(&c.step), Some(&c.value)),
                    );
                }
                device
            })
            .collect())
    }

    fn allocate(&mut self, resource: &str, ids: &[String]) -> Result<ContainerEdits, PluginError> {
        let group = self.group(resource)?;
        let mut edits = ContainerEdits::default();
        for path in group.nodes_of(ids)? {
            Group::check_present(&path)?;
            edits = edits.device(path.clone(), path, group.spec.permissions.clone());
        }
        Ok(edits)
    }

    /// With a shared capacity, the container also learns how much of each device it holds.
    fn allocate_request(&mut self, request: &Request) -> Result<ContainerEdits, PluginError> {
        let edits =
            self.allocate_with_config(&request.resource_name, &request.ids, &request.config)?;
        let Some(c) = self.group(&request.resource_name)?.spec.capacity.clone() else {
            return Ok(edits);
        };
        let held: Vec<String> = request
            .ids
            .iter()
            .filter_map(|id| Some(format!("{id}={}", request.consumed(id, &c.name)?)))
            .collect();
        if held.is_empty() {
            return Ok(edits);
        }
        let key = format!("GENERIC_DEV_{}", c.name.to_uppercase().replace('-', "_"));
        Ok(edits.env(key, held.join(",")))
    }

    fn prestart(&mut self, resource: &str, ids: &[String]) -> Result<(), PluginError> {
        let group = self.group(resource)?;
        let mut checked: Vec<String> = Vec::new();
        for found in group.resolve(ids)? {
            match found {
                Ok(path) if !checked.contains(&path) => {
                    Group::check_present(&path)?;
                    checked.push(path);
                }
                Ok(_) => {}
                // The kubelet only passes IDs this module listed, so an ID no node maps to now
                // (in this instance's memory or a fresh scan) belongs to a node that is gone.
                Err(id) => {
                    return Err(PluginError::Failed(format!(
                        "the device node of {id} is gone: nothing matching {} has that ID",
                        group.spec.paths.join(" ")
                    )));
                }
            }
        }
        Ok(())
    }
}

export_plugin!(GenericDev);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_documented_example() {
        let groups = parse_config(
            r#"{"groups": [
                {"name": "fuse", "paths": ["/dev/fuse"], "permissions": "rw"},
                {"name": "serial", "paths": ["/dev/ttyUSB*", "/dev/ttyACM*"],
                 "prestart-check": true}
            ]}"#,
        )
        .unwrap();
        assert_eq!(groups.len(), 2);
        assert!(!groups[0].prestart_check);
        assert_eq!(groups[1].permissions, "rw");
        assert!(groups[1].prestart_check);
    }

    #[test]
    fn rejects_bad_configs() {
        let cases = [
            (r#"{"groups": [], "extra": 1}"#, "extra"),
            (
                r#"{"groups": [{"name": "a", "paths": ["/dev/a"], "cont": 2}]}"#,
                "cont",
            ),
            (r#"{"groups": []}"#, "empty"),
            (r#"{}"#, "groups"),
            (
                r#"{"groups": [{"name": "A", "paths": ["/dev/a"]}]}"#,
                "resource name",
            ),
            (
                r#"{"groups": [{"name": "a-", "paths": ["/dev/a"]}]}"#,
                "resource name",
            ),
            (
                r#"{"groups": [{"name": "a", "paths": []}]}"#,
                "paths is empty",
            ),
            (
                r#"{"groups": [{"name": "a", "paths": ["/tmp/a"]}]}"#,
                "not under /dev/",
            ),
            (
                r#"{"groups": [{"name": "a", "paths": ["/dev/../a"]}]}"#,
                "components",
            ),
            (
                r#"{"groups": [{"name": "a", "paths": ["/dev/a"], "count": 2}]}"#,
                "[module.sharing] replicas = N",
            ),
            (
                r#"{"groups": [{"name": "a", "paths": ["/dev/a"], "permissions": "rr"}]}"#,
                "repeats",
            ),
            (
                r#"{"groups": [{"name": "a", "paths": ["/dev/a"], "permissions": ""}]}"#,
                "repeats",
            ),
            (
                r#"{"groups": [{"name": "a", "paths": ["/dev/a"], "preferred": "spread"}]}"#,
                "allocation-policy",
            ),
            (
                r#"{"groups": [{"name": "a", "paths": ["/dev/a"]}, {"name": "a", "paths": ["/dev/b"]}]}"#,
                "earlier group",
            ),
        ];
        for (config, needle) in cases {
            let err = parse_config(config).unwrap_err();
            assert!(err.contains(needle), "{config}: {err}");
        }
        assert!(validate_name(&"a".repeat(63)).is_ok());
        assert!(validate_name(&"a".repeat(64)).is_err());
        assert!(validate_name("a.b-0").is_ok());
        assert!(validate_permissions("mwr").is_ok());
    }

    #[test]
    fn derives_ids() {
        assert_eq!(node_id("/dev/ttyUSB0"), "ttyUSB0");
        assert_eq!(node_id("/dev/net/tun"), "net-tun");
        assert_eq!(node_id("/dev/snd/pcmC0D0p"), "snd-pcmC0D0p");
        assert_eq!(node_id("/dev/a b:c"), "a_b_c");
    }

    #[test]
    fn a_shared_capacity_makes_each_node_shared_with_a_range_policy() {
        let config = r#"{"groups": [{"name": "fuse", "paths": ["/dev/fuse"],
            "capacity": {"name": "bandwidth", "value": "10G", "default": "1G", "step": "1G"}}]}"#;
        let groups = parse_config(config).expect("valid");
        assert_eq!(
            groups[0].capacity.as_ref().map(|c| c.name.as_str()),
            Some("bandwidth")
        );
        for (bad, says) in [
            (
                r#""name": "Band width", "value": "10G", "default": "1G", "step": "1G""#,
                "DNS label",
            ),
            (
                r#""name": "bandwidth", "value": "lots", "default": "1G", "step": "1G""#,
                "not a Kubernetes quantity",
            ),
        ] {
            let config = format!(
                r#"{{"groups": [{{"name": "fuse", "paths": ["/dev/fuse"], "capacity": {{{bad}}}}}]}}"#
            );
            let e = parse_config(&config).unwrap_err();
            assert!(e.contains(says), "{e}");
        }
        let config = r#"{"groups": [{"name": "fuse", "paths": ["/dev/fuse"], "exclusive": true,
            "capacity": {"name": "bandwidth", "value": "10G", "default": "1G", "step": "1G"}}]}"#;
        assert!(
            parse_config(config)
                .unwrap_err()
                .contains("cannot be `exclusive`")
        );
    }
}

/// The module end to end on the host, against the SDK's fake node.
#[cfg(test)]
mod kit_tests {
    use super::GenericDev;
    use devicelet_sdk::testing::{FakeHost, Harness};

    const CONFIG: &str = r#"{"groups": [
        {"name": "fuse", "paths": ["/dev/fuse"]},
        {"name": "serial", "paths": ["/dev/ttyUSB*"], "permissions": "rwm", "prestart-check": true}
    ]}"#;

    fn node() -> FakeHost {
        FakeHost::new()
            .grant_dev("/dev/fuse")
            .grant_dev("/dev/ttyUSB*")
            .char_device("/dev/fuse", 10, 229)
            .char_device("/dev/ttyUSB0", 188, 0)
            .char_device("/dev/ttyUSB1", 188, 1)
            // Not a device node: never served.
            .file("/dev/ttyUSB9", "")
    }

    #[test]
    fn each_granted_node_is_a_device_with_its_numbers() {
        let mut module = Harness::<GenericDev>::init(node(), CONFIG).unwrap();
        let names: Vec<&str> = module.resources().iter().map(|r| r.name.as_str()).collect();
        assert_eq!(names, ["fuse", "serial"]);
        let fuse = module.enumerate("fuse").unwrap();
        let ids: Vec<&str> = fuse.iter().map(|d| d.id.as_str()).collect();
        assert_eq!(ids, ["fuse"]);
        assert_eq!(fuse[0].text("dev"), Some("10:229"));
        let serial = module.enumerate("serial").unwrap();
        let ids: Vec<&str> = serial.iter().map(|d| d.id.as_str()).collect();
        assert_eq!(ids, ["ttyUSB0", "ttyUSB1"]);
    }

    #[test]
    fn own_edits_exclusive_and_together_are_on_every_device() {
        let config = r#"{"groups": [{"name": "serial", "paths": ["/dev/ttyUSB*"],
            "own-edits": true, "exclusive": true, "together": true}]}"#;
        let mut module = Harness::<GenericDev>::init(node(), config).unwrap();
        let serial = module.enumerate("serial").unwrap();
        assert_eq!(serial.len(), 2);
        for d in &serial {
            assert!(d.exclusive, "{d:?}");
            assert_eq!(d.group.as_deref(), Some("serial"));
            let node = &d.edits.as_ref().expect("own edits").devices[0];
            assert_eq!(node.host_path, format!("/dev/{}", d.id));
        }
        // As the agent answers: the union of the devices' own edits.
        let edits = module.allocate("serial", &["ttyUSB0", "ttyUSB1"]).unwrap();
        let paths: Vec<&str> = edits.devices.iter().map(|d| d.host_path.as_str()).collect();
        assert_eq!(paths, ["/dev/ttyUSB0", "/dev/ttyUSB1"]);
    }

    #[test]
    fn what_it_serves_is_logged_by_the_first_instance_alone() {
        let enumerating = Harness::<GenericDev>::init(node(), CONFIG).unwrap();
        let _kubelet = enumerating.another(CONFIG).unwrap();
        let serving: Vec<String> = enumerating
            .host()
            .logs()
            .into_iter()
            .map(|(_, line)| line)
            .filter(|line| line.starts_with("generic-dev serving"))
            .collect();
        assert_eq!(
            serving,
            [
                "generic-dev serving fuse (/dev/fuse, permissions rw): 1 node(s) now; serial \
              (/dev/ttyUSB*, permissions rwm, prestart check): 2 node(s) now"
            ]
        );
    }

    #[test]
    fn a_fresh_instance_allocates_and_prestart_notices_an_unplugged_node() {
        let enumerating = Harness::<GenericDev>::init(node(), CONFIG).unwrap();
        let mut kubelet = enumerating.another(CONFIG).unwrap();
        let edits = kubelet.allocate("serial", &["ttyUSB1"]).unwrap();
        assert_eq!(edits.devices.len(), 1);
        assert_eq!(edits.devices[0].host_path, "/dev/ttyUSB1");
        assert_eq!(edits.devices[0].permissions, "rwm");
        kubelet.prestart("serial", &["ttyUSB1"]).unwrap();
        kubelet.host().remove("/dev/ttyUSB1");
        assert!(kubelet.prestart("serial", &["ttyUSB1"]).is_err());
    }
}
