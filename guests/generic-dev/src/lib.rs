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
//!   { name = "fuse", paths = ["/dev/fuse"], count = 10, permissions = "rw" },
//!   { name = "serial", paths = ["/dev/ttyUSB*", "/dev/ttyACM*"], preferred = "spread", prestart-check = true },
//! ]
//! ```
//!
//! Each group is one resource:
//!
//! - `name` (required): the resource name suffix (the host prefixes the resource domain), a DNS
//!   label-like `[a-z0-9]([-a-z0-9.]*[a-z0-9])?` of at most 63 characters, unique among groups.
//! - `paths` (required, non-empty): glob patterns under `/dev/` (`*`, `?`, `[...]`). Every
//!   matching node that is a character or block device is one physical device. Nodes appear and
//!   disappear with the node: each enumeration globs again.
//! - `count` (default 1, 1..=1000): how many times each node is advertised, so that many
//!   containers can share it.
//! - `permissions` (default `"rw"`): the device cgroup permissions, a non-empty combination of
//!   `r`, `w` and `m` without repeats.
//! - `preferred` (default none): `"spread"` asks the kubelet for preferred-allocation calls and
//!   spreads a request over as many physical nodes as possible; `"pack"` fills one node's
//!   replicas first.
//! - `prestart-check` (default false): asks the kubelet for prestart calls, which fail when an
//!   allocated node has disappeared since allocation.
//! - `own-edits` (default false): each device carries its own edits (its node), so the agent
//!   answers Allocate from them without calling the module (WIT 0.2).
//! - `exclusive` (default false): the devices are never shared; the agent refuses a
//!   `[module.sharing]` rule that would give them replicas (WIT 0.2).
//! - `together` (default false): all the group's nodes are allocated together or not at all (one
//!   device group, WIT 0.2): the agent refuses a request for part of them.
//!
//! # Device IDs
//!
//! A node's ID is its path without `/dev/`, with `/` replaced by `-` and any other character
//! outside `[A-Za-z0-9._-]` by `_`: `/dev/ttyUSB0` → `ttyUSB0`, `/dev/net/tun` → `net-tun`.
//! With `count` > 1 each replica gets `-<i>` appended, `i` in `0..count`: `fuse-0` .. `fuse-9`.
//! Two nodes mapping to the same ID (`/dev/a b` and `/dev/a_b`) cannot both be served: the first
//! in glob order wins and the other is skipped with a warning.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};

use devicelet_sdk::{
    ContainerEdits, Device, FsError, Plugin, PluginError, ResourceInfo, devnodes, export_plugin,
};
use serde::Deserialize;

/// Most replicas of one node.
const MAX_COUNT: u32 = 1000;
/// Longest resource name suffix.
const MAX_NAME_LEN: usize = 63;

/// How `preferred` chooses among the available devices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
enum Policy {
    /// Over as many physical nodes as possible.
    Spread,
    /// Fill one physical node's replicas before the next.
    Pack,
}

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
    #[serde(default = "default_count")]
    count: u32,
    #[serde(default = "default_permissions")]
    permissions: String,
    #[serde(default)]
    preferred: Option<Policy>,
    #[serde(default)]
    prestart_check: bool,
    #[serde(default)]
    own_edits: bool,
    #[serde(default)]
    exclusive: bool,
    #[serde(default)]
    together: bool,
}

fn default_count() -> u32 {
    1
}

fn default_permissions() -> String {
    "rw".to_string()
}

/// One validated group: one resource.
#[derive(Debug, Clone, PartialEq, Eq)]
struct GroupSpec {
    name: String,
    paths: Vec<String>,
    count: u32,
    permissions: String,
    preferred: Option<Policy>,
    prestart_check: bool,
    /// Each device carries its own edits (WIT 0.2): the agent answers Allocate without calling
    /// `allocate`.
    own_edits: bool,
    /// Never shared (WIT 0.2).
    exclusive: bool,
    /// Every node of the group is one device group: allocated together or not at all.
    together: bool,
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
        if !(1..=MAX_COUNT).contains(&group.count) {
            return Err(format!(
                "{at}.count: {} is out of range 1..={MAX_COUNT}",
                group.count
            ));
        }
        validate_permissions(&group.permissions).map_err(|e| format!("{at}.permissions: {e}"))?;
        if group.count > 1 && (group.exclusive || group.together) {
            return Err(format!(
                "{at}: `count` shares each node, which `exclusive` and `together` forbid"
            ));
        }
        specs.push(GroupSpec {
            name: group.name,
            paths: group.paths,
            count: group.count,
            permissions: group.permissions,
            preferred: group.preferred,
            prestart_check: group.prestart_check,
            own_edits: group.own_edits,
            exclusive: group.exclusive,
            together: group.together,
        });
    }
    Ok(specs)
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

/// The IDs one node is advertised under: the base ID alone, or `<base>-<i>` for each replica.
fn device_ids(base: &str, count: u32) -> Vec<String> {
    if count <= 1 {
        vec![base.to_string()]
    } else {
        (0..count).map(|i| format!("{base}-{i}")).collect()
    }
}

/// The base ID of a device ID, if `id` is well-formed for `count` replicas (`<base>-<i>` with a
/// canonical `i` < `count`, or just `<base>` when `count` is 1).
fn base_of(id: &str, count: u32) -> Option<&str> {
    if count <= 1 {
        return (!id.is_empty()).then_some(id);
    }
    let (base, replica) = id.rsplit_once('-')?;
    let index: u32 = replica.parse().ok()?;
    (!base.is_empty() && index < count && index.to_string() == replica).then_some(base)
}

/// `size` IDs out of `available` (all of `must_include` first) under `policy`.
///
/// `node_of` names the physical node behind an ID; IDs it does not know count as their own node.
/// Spread takes each next device from the node with the fewest chosen so far, pack from the node
/// with the most (among nodes with devices left); ties go to the node first seen in `available`.
fn choose(
    policy: Policy,
    available: &[String],
    must_include: &[String],
    size: usize,
    node_of: impl Fn(&str) -> Option<String>,
) -> Vec<String> {
    let node = |id: &str| node_of(id).unwrap_or_else(|| id.to_string());
    let mut chosen: Vec<String> = Vec::new();
    let mut seen: BTreeSet<&str> = BTreeSet::new();
    let mut load: HashMap<String, usize> = HashMap::new();
    for id in must_include {
        if seen.insert(id.as_str()) {
            chosen.push(id.clone());
            *load.entry(node(id)).or_default() += 1;
        }
    }
    // Remaining candidates per node, nodes in order of first appearance.
    let mut order: Vec<String> = Vec::new();
    let mut left: HashMap<String, VecDeque<&String>> = HashMap::new();
    for id in available {
        if !seen.insert(id.as_str()) {
            continue;
        }
        let key = node(id);
        if !left.contains_key(&key) {
            order.push(key.clone());
        }
        left.entry(key).or_default().push_back(id);
    }
    while chosen.len() < size {
        let mut best: Option<(&String, usize)> = None;
        for key in &order {
            if left.get(key).is_none_or(VecDeque::is_empty) {
                continue;
            }
            let n = load.get(key).copied().unwrap_or(0);
            let better = match (best, policy) {
                (None, _) => true,
                (Some((_, b)), Policy::Spread) => n < b,
                (Some((_, b)), Policy::Pack) => n > b,
            };
            if better {
                best = Some((key, n));
            }
        }
        let Some((key, _)) = best else { break };
        let Some(id) = left.get_mut(key).and_then(VecDeque::pop_front) else {
            break;
        };
        chosen.push(id.clone());
        *load.entry(key.clone()).or_default() += 1;
    }
    chosen
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
                .map(|id| {
                    base_of(id, group.spec.count)
                        .and_then(|base| group.known.get(base))
                        .cloned()
                        .ok_or_else(|| id.clone())
                })
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
        let mut served = Vec::with_capacity(groups.len());
        for group in &mut groups {
            let spec = &group.spec;
            let mut line = format!(
                "{} ({} ×{}, permissions {}",
                spec.name,
                spec.paths.join(" "),
                spec.count,
                spec.permissions
            );
            if let Some(policy) = spec.preferred {
                line.push_str(&format!(", preferred {policy:?}").to_lowercase());
            }
            if spec.prestart_check {
                line.push_str(", prestart check");
            }
            match group.scan() {
                Ok(nodes) => line.push_str(&format!("): {} node(s) now", nodes.len())),
                Err(PluginError::Failed(why)) => line.push_str(&format!("): not scanned: {why}")),
                Err(_) => line.push_str("): not scanned"),
            }
            served.push(line);
        }
        devicelet_sdk::info!("generic-dev serving {}", served.join("; "));
        let resources = groups
            .iter()
            .map(|g| {
                ResourceInfo::new(g.spec.name.clone())
                    .with_prestart(g.spec.prestart_check)
                    .with_preferred_allocation(g.spec.preferred.is_some())
            })
            .collect();
        Ok((GenericDev { groups }, resources))
    }

    fn enumerate(&mut self, resource: &str) -> Result<Vec<Device>, PluginError> {
        let group = self.group(resource)?;
        let spec = group.spec.clone();
        let nodes = group.scan()?;
        Ok(nodes
            .iter()
            .flat_map(|node| {
                device_ids(&node.base, spec.count).into_iter().map(|id| {
                    let mut device = Device::healthy(id)
                        .attribute("path", node.path.clone())
                        .attribute("dev", format!("{}:{}", node.major, node.minor));
                    if spec.own_edits {
                        device = device.edits(ContainerEdits::default().device(
                            node.path.clone(),
                            node.path.clone(),
                            spec.permissions.clone(),
                        ));
                    }
                    if spec.exclusive {
                        device = device.exclusive();
                    }
                    if spec.together {
                        device = device.group(spec.name.clone());
                    }
                    device
                })
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

    fn preferred(
        &mut self,
        resource: &str,
        available: &[String],
        must_include: &[String],
        size: usize,
    ) -> Result<Vec<String>, PluginError> {
        let group = self.group(resource)?;
        let count = group.spec.count;
        let Some(policy) = group.spec.preferred else {
            return Ok(devicelet_sdk::default_preferred(
                available,
                must_include,
                size,
            ));
        };
        Ok(choose(policy, available, must_include, size, |id| {
            base_of(id, count).map(str::to_string)
        }))
    }
}

export_plugin!(GenericDev);

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    fn bases(count: u32) -> impl Fn(&str) -> Option<String> {
        move |id| base_of(id, count).map(str::to_string)
    }

    #[test]
    fn parses_the_documented_example() {
        let groups = parse_config(
            r#"{"groups": [
                {"name": "fuse", "paths": ["/dev/fuse"], "count": 10, "permissions": "rw"},
                {"name": "serial", "paths": ["/dev/ttyUSB*", "/dev/ttyACM*"],
                 "preferred": "spread", "prestart-check": true}
            ]}"#,
        )
        .unwrap();
        assert_eq!(groups.len(), 2);
        assert_eq!(groups[0].count, 10);
        assert_eq!(groups[0].preferred, None);
        assert!(!groups[0].prestart_check);
        assert_eq!(groups[1].count, 1);
        assert_eq!(groups[1].permissions, "rw");
        assert_eq!(groups[1].preferred, Some(Policy::Spread));
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
                r#"{"groups": [{"name": "a", "paths": ["/dev/a"], "count": 0}]}"#,
                "out of range",
            ),
            (
                r#"{"groups": [{"name": "a", "paths": ["/dev/a"], "count": 1001}]}"#,
                "out of range",
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
                r#"{"groups": [{"name": "a", "paths": ["/dev/a"], "preferred": "x"}]}"#,
                "variant",
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
        assert_eq!(device_ids("fuse", 1), ids(&["fuse"]));
        assert_eq!(device_ids("fuse", 3), ids(&["fuse-0", "fuse-1", "fuse-2"]));
        assert_eq!(base_of("fuse", 1), Some("fuse"));
        assert_eq!(base_of("net-tun-2", 3), Some("net-tun"));
        assert_eq!(base_of("fuse-3", 3), None);
        assert_eq!(base_of("fuse-01", 3), None);
        assert_eq!(base_of("fuse", 3), None);
    }

    #[test]
    fn spread_and_pack() {
        let available = ids(&["A-0", "A-1", "B-0", "B-1"]);
        let got = choose(Policy::Spread, &available, &[], 2, bases(2));
        assert_eq!(got, ids(&["A-0", "B-0"]));
        let got = choose(Policy::Pack, &available, &[], 2, bases(2));
        assert_eq!(got, ids(&["A-0", "A-1"]));
        let got = choose(Policy::Spread, &available, &ids(&["A-1"]), 3, bases(2));
        assert_eq!(got, ids(&["A-1", "B-0", "A-0"]));
        let got = choose(Policy::Pack, &available, &ids(&["B-1"]), 2, bases(2));
        assert_eq!(got, ids(&["B-1", "B-0"]));
        let got = choose(Policy::Spread, &available, &[], 10, bases(2));
        assert_eq!(got, ids(&["A-0", "B-0", "A-1", "B-1"]));
        let three = ids(&["a-0", "a-1", "a-2", "b-0", "b-1", "b-2", "c-0"]);
        let got = choose(Policy::Spread, &three, &[], 4, bases(3));
        assert_eq!(got, ids(&["a-0", "b-0", "c-0", "a-1"]));
    }
}

/// The module end to end on the host, against the SDK's fake node.
#[cfg(test)]
mod kit_tests {
    use super::GenericDev;
    use devicelet_sdk::testing::{FakeHost, Harness};

    const CONFIG: &str = r#"{"groups": [
        {"name": "fuse", "paths": ["/dev/fuse"], "count": 2},
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
        assert_eq!(ids, ["fuse-0", "fuse-1"]);
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
