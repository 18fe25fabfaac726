//! One `[[module]]` entry of the registry: which component to run, under which limits, with which
//! grants and configuration.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::error::RegistryError;
use super::grants::{self, Grants};
use super::json;
use super::limits::{
    CALL_DEADLINE_MAX, CALL_DEADLINE_MIN, DEFAULT_CALL_DEADLINE, DEFAULT_HEALTH_INTERVAL,
    DEFAULT_HOST_MEMORY, DEFAULT_MEMORY_LIMIT, HEALTH_DEADLINE_MAX, HEALTH_INTERVAL_MAX,
    HEALTH_INTERVAL_MIN, HOST_MEMORY_MAX, HOST_MEMORY_MIN, MEMORY_LIMIT_MAX, MEMORY_LIMIT_MIN,
};
use super::names;
use super::units;
use super::value::Node;

/// A validated `[[module]]` entry, with every default applied and every path resolved, so that
/// nothing downstream needs to know the registry's syntax or its location.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModuleSpec {
    /// Unique within the registry; names the module in logs, errors, sockets and metrics.
    pub name: String,
    /// The component file. Resolved against the registry file's directory when written relative,
    /// so a registry and its modules can be moved together. Not checked for existence here.
    /// The module file; for a module with `source`, empty until the agent resolves it to its
    /// entry in the module store.
    pub path: PathBuf,
    /// Where the module comes from when not a file: an OCI registry, pinned by digest.
    pub source: Option<super::OciSource>,
    /// The vendor key a `source` must be signed with (cosign keyed signing), read when the
    /// registry is: a changed key file takes effect at the next registry read.
    pub verify_key: Option<super::VerifyKey>,
    /// Domain for the module's bare resource names: its own `resource-domain`, else the
    /// registry's.
    pub resource_domain: String,
    /// How often the module's health is polled.
    pub health_interval: Duration,
    /// How long any one call into the module may run before it is interrupted.
    pub call_deadline: Duration,
    /// The work a module may do per health cycle: how long one re-enumeration of a resource may
    /// run. Defaults to `call_deadline`; set it lower to keep slow health checks from queueing
    /// ahead of admissions.
    pub health_deadline: Duration,
    /// Bytes of linear memory the module may grow to.
    pub memory_limit: u64,
    /// Bytes of the agent's own memory the module's answers may hold (its device snapshots, with
    /// attributes): an answer that would exceed it is refused like any broken rule.
    pub host_memory: u64,
    /// Expected SHA-256 of the module file, lowercase hex; when set, a file that does not match
    /// is refused, so a swapped binary cannot run under another module's grants.
    pub sha256: Option<String>,
    /// Whether the host asks the module's `allocate` for each healthy device alone ahead of time
    /// and answers the kubelet's single-device Allocates from those answers while the device is
    /// unchanged (`resource::prepared`). Off: every Allocate calls the module.
    pub allocate_ahead: bool,
    /// Who answers GetPreferredAllocation for the module's resources.
    pub allocation_policy: super::AllocationPolicy,
    /// How many containers may share each device of its resources (`[module.sharing]`).
    pub sharing: super::Sharing,
    /// How Allocate names devices to the runtime; a CDI strategy also has the host write a CDI
    /// spec per resource (`crate::cdi`).
    pub device_list_strategy: super::DeviceListStrategy,
    /// What the module may read from the host.
    pub grants: Grants,
    /// The vendor's own settings, verbatim: a JSON object, `{}` when absent.
    pub config: serde_json::Value,
    /// `file:line` of the `[module.config]` table (of the `[[module]]` entry when there is
    /// none), so a module refusing its config sends the operator to the right line.
    pub config_at: String,
    /// `file:line` of the `[[module]]` entry: errors about the entry as a whole point there.
    pub entry_at: String,
    /// Which kubelet API serves the module's resources.
    pub front_end: FrontEnd,
}

/// The kubelet API a module is served through. One per module: a module served through both
/// would advertise each device twice (as an extended resource and in a ResourceSlice), and the
/// scheduler would hand the same device to two pods; that stays refused until one ledger
/// arbitrates both front ends.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum FrontEnd {
    /// The device-plugin API (`Registration`, `DevicePlugin`): extended resources.
    #[default]
    DevicePlugin,
    /// Dynamic Resource Allocation as this driver, or, when `None`, as the driver named after the
    /// module's resource (`dra::names::default_driver`).
    Dra { driver: Option<String> },
}

pub(super) const KEYS: &[&str] = &[
    "name",
    "path",
    "source",
    "verify-key",
    "resource-domain",
    "health-interval",
    "call-deadline",
    "health-deadline",
    "memory-limit",
    "host-memory",
    "sha256",
    "allocate-ahead",
    "allocation-policy",
    "sharing",
    "device-list-strategy",
    "grants",
    "config",
    "front-end",
    "dra-driver",
];

/// Keys that tune the device-plugin front end only: each is refused beside `front-end = "dra"`,
/// with what DRA does instead, rather than silently ignored.
const DEVICE_PLUGIN_ONLY: &[(&str, &str)] = &[
    (
        "sharing",
        "DRA shares a device by a ResourceClaim that several pods reference, not by replicas",
    ),
    (
        "allocation-policy",
        "under DRA the scheduler picks the devices; there is no GetPreferredAllocation",
    ),
    (
        "device-list-strategy",
        "the DRA front end always answers with CDI devices, one per claim and device",
    ),
    (
        "allocate-ahead",
        "the DRA front end asks the module when a claim is prepared, with the claim's config",
    ),
];

/// A module as read, with where its name was written, for reporting duplicates.
pub(super) struct Parsed {
    pub(super) spec: ModuleSpec,
    pub(super) name_span: Range<usize>,
}

/// Reads one `[[module]]` table. `base` is the registry file's directory; `default_domain` the
/// registry-wide resource domain.
pub(super) fn parse(
    node: &Node<'_>,
    base: &Path,
    default_domain: &str,
) -> Result<Parsed, RegistryError> {
    let table = node.table("a table, written [[module]]")?;
    let mut name = None;
    let mut path = None;
    let mut source = None;
    let mut verify_key = None;
    let mut resource_domain = None;
    let mut health_interval = DEFAULT_HEALTH_INTERVAL;
    let mut call_deadline = DEFAULT_CALL_DEADLINE;
    let mut health_deadline = None;
    let mut memory_limit = DEFAULT_MEMORY_LIMIT;
    let mut host_memory = DEFAULT_HOST_MEMORY;
    let mut sha256 = None;
    let mut allocate_ahead = true;
    let mut allocation_policy = super::AllocationPolicy::default();
    let mut sharing = super::Sharing::default();
    let mut device_list_strategy = super::DeviceListStrategy::default();
    // CDI specs are built from the answers prepared ahead: reported at the strategy's line.
    let mut needs_allocate_ahead = None;
    let mut grants = Grants::default();
    let mut config = serde_json::Value::Object(serde_json::Map::new());
    let entry_at = node.location();
    let mut config_at = entry_at.clone();
    let mut front_end = None;
    let mut dra_driver = None;
    // Device-plugin-only keys seen, by line, to refuse beside `front-end = "dra"`.
    let mut device_plugin_keys = Vec::new();

    for entry in table.entries() {
        let node = &entry.node;
        if let Some((_, why)) = DEVICE_PLUGIN_ONLY.iter().find(|(k, _)| *k == entry.name) {
            device_plugin_keys.push(node.error(format!(
                "`{}` applies to the device-plugin front end only, and this module has `front-end = \"dra\"`: {why}",
                entry.name
            )));
        }
        match entry.name {
            "name" => {
                let text = node.str()?;
                names::check_module_name(text)
                    .map_err(|(index, message)| node.error_in_str(index, message))?;
                name = Some((text.to_string(), node.span()));
            }
            "path" => path = Some(module_path(node, base)?),
            "source" => {
                let text = node.str()?;
                source = Some(super::oci_source::parse(text).map_err(|e| node.error(e))?);
            }
            "verify-key" => {
                let text = node.str()?;
                let key = super::VerifyKey::read(&base.join(text))
                    .map_err(|e| node.error(format!("`verify-key`: {e}")))?;
                verify_key = Some((key, node.error(
                    "`verify-key` checks the signature of a module from a registry (`source`); a \
                     `path` is pinned by `sha256`",
                )));
            }
            "resource-domain" => resource_domain = Some(resource_domain_of(node)?),
            "health-interval" => {
                health_interval = duration(node, HEALTH_INTERVAL_MIN, HEALTH_INTERVAL_MAX)?
            }
            "call-deadline" => {
                call_deadline = duration(node, CALL_DEADLINE_MIN, CALL_DEADLINE_MAX)?
            }
            "health-deadline" => {
                health_deadline = Some(duration(node, CALL_DEADLINE_MIN, HEALTH_DEADLINE_MAX)?)
            }
            "memory-limit" => memory_limit = size(node, MEMORY_LIMIT_MIN, MEMORY_LIMIT_MAX)?,
            "host-memory" => host_memory = size(node, HOST_MEMORY_MIN, HOST_MEMORY_MAX)?,
            "sha256" => {
                let text = node.str()?;
                let digest = names::normalize_sha256(text)
                    .map_err(|(index, message)| node.error_in_str(index, message))?;
                sha256 = Some(digest);
            }
            "allocate-ahead" => {
                allocate_ahead = node
                    .get()
                    .as_bool()
                    .ok_or_else(|| node.type_error("true or false"))?
            }
            "allocation-policy" => allocation_policy = policy(node)?,
            "sharing" => sharing = super::sharing::parse(node)?,
            "device-list-strategy" => {
                device_list_strategy = strategy(node)?;
                needs_allocate_ahead = device_list_strategy.uses_cdi().then(|| {
                    node.error(
                        "a CDI device-list strategy needs `allocate-ahead = true`: the CDI spec is built from the answers prepared for each device",
                    )
                });
            }
            "grants" => grants = grants::parse(node)?,
            "config" => {
                config = json::config(node)?;
                config_at = node.location();
            }
            "front-end" => front_end = Some(front_end_of(node)?),
            "dra-driver" => {
                let text = node.str()?;
                if !devicelet_api::names::is_dra_driver_name(text) {
                    return Err(node.error(format!(
                        "`dra-driver` {text:?} is not a DNS subdomain of at most 63 characters \
                         (lowercase letters, digits, `-` and `.`, each part starting and ending \
                         with a letter or digit), e.g. \"gpu.example.com\""
                    )));
                }
                dra_driver = Some((text.to_string(), node.error(
                    "`dra-driver` names the module's DRA driver, and this module has no `front-end = \"dra\"`",
                )));
            }
            _ => return Err(entry.unknown(KEYS)),
        }
    }
    let front_end = match (front_end, dra_driver) {
        (Some(true), driver) => {
            if let Some(error) = device_plugin_keys.into_iter().next() {
                return Err(error);
            }
            FrontEnd::Dra {
                driver: driver.map(|(name, _)| name),
            }
        }
        (_, Some((_, not_dra))) => return Err(not_dra),
        (_, None) => FrontEnd::DevicePlugin,
    };

    if let (Some(error), false) = (needs_allocate_ahead, allocate_ahead) {
        return Err(error);
    }
    let (name, name_span) = name.ok_or_else(|| table.missing("name"))?;
    let path = match (path, &source) {
        (Some(_), Some(_)) => {
            return Err(table.error(
                "`path` and `source` both name the module's file; give one: `path` for a file \
                 on the node, `source` for oci://…@sha256:… from a registry",
            ));
        }
        (Some(path), None) => path,
        (None, Some(_)) if sha256.is_some() => {
            return Err(table
                .error("`sha256` pins a `path`; a `source` is pinned by its own digest already"));
        }
        (None, Some(_)) => PathBuf::new(),
        // `path` is the usual one; the message says the other exists.
        (None, None) => {
            return Err(table.missing_because(
                "path",
                "missing required key `path` (a .wasm file), or `source` (oci://…@sha256:…)",
            ));
        }
    };
    let verify_key = match (verify_key, &source) {
        (Some((_, not_source)), None) => return Err(not_source),
        (key, _) => key.map(|(key, _)| key),
    };
    Ok(Parsed {
        spec: ModuleSpec {
            name,
            path,
            source,
            verify_key,
            resource_domain: resource_domain.unwrap_or_else(|| default_domain.to_string()),
            health_interval,
            call_deadline,
            health_deadline: health_deadline.unwrap_or(call_deadline),
            memory_limit,
            host_memory,
            sha256,
            allocate_ahead,
            allocation_policy,
            sharing,
            device_list_strategy,
            grants,
            config,
            config_at,
            entry_at,
            front_end,
        },
        name_span,
    })
}

fn module_path(node: &Node<'_>, base: &Path) -> Result<PathBuf, RegistryError> {
    let text = node.str()?;
    if text.is_empty() {
        return Err(node
            .error("the module path is empty; expected a .wasm file, e.g. \"generic_dev.wasm\""));
    }
    Ok(base.join(text))
}

/// A `resource-domain` value; shared with the registry's top level.
pub(super) fn resource_domain_of(node: &Node<'_>) -> Result<String, RegistryError> {
    let text = node.str()?;
    names::check_resource_domain(text)
        .map_err(|(index, message)| node.error_in_str(index, message))?;
    Ok(text.to_string())
}

/// `front-end`: true for DRA. A list of both is the double-advertising case, refused by name.
fn front_end_of(node: &Node<'_>) -> Result<bool, RegistryError> {
    if node.get().as_array().is_some() {
        return Err(node.error(
            "one front end per module: serving a module through the device plugin and DRA at once \
             would advertise every device twice (as an extended resource and in a ResourceSlice), \
             and the scheduler could give one device to two pods; run it under one front end per \
             node (docs/dra.md)",
        ));
    }
    match node.str()? {
        "device-plugin" => Ok(false),
        "dra" => Ok(true),
        other => Err(node.error(format!(
            "unknown front end {other:?}: expected \"device-plugin\" (the default) or \"dra\""
        ))),
    }
}

fn policy(node: &Node<'_>) -> Result<super::AllocationPolicy, RegistryError> {
    use super::AllocationPolicy;
    let text = node.str()?;
    Ok(match text {
        "module" => AllocationPolicy::Module,
        "packed" => AllocationPolicy::Packed,
        "distributed" => AllocationPolicy::Distributed,
        "none" => AllocationPolicy::None,
        _ => {
            return Err(node.error(format!(
                "unknown allocation policy {text:?}: expected \"module\", \"packed\", \"distributed\" or \"none\""
            )));
        }
    })
}

/// `device-list-strategy`: one name, or a list of them.
fn strategy(node: &Node<'_>) -> Result<super::DeviceListStrategy, RegistryError> {
    let names = match node.get().as_str() {
        Some(name) => vec![name],
        None => node
            .array("a strategy name such as \"cdi-cri\", or a list of them")?
            .iter()
            .map(|n| n.str())
            .collect::<Result<Vec<_>, _>>()?,
    };
    super::DeviceListStrategy::parse(names).map_err(|message| node.error(message))
}

fn duration(node: &Node<'_>, min: Duration, max: Duration) -> Result<Duration, RegistryError> {
    let text = node
        .get()
        .as_str()
        .ok_or_else(|| node.type_error("a duration string such as \"5s\" or \"500ms\""))?;
    let value = units::parse_duration(text).map_err(|message| node.error(message))?;
    if value < min || value > max {
        return Err(node.error(format!(
            "duration {text:?} is out of range: expected {} to {}",
            units::format_duration(min),
            units::format_duration(max)
        )));
    }
    Ok(value)
}

fn size(node: &Node<'_>, min: u64, max: u64) -> Result<u64, RegistryError> {
    let text = node
        .get()
        .as_str()
        .ok_or_else(|| node.type_error("a size string such as \"64MiB\""))?;
    let value = units::parse_size(text).map_err(|message| node.error(message))?;
    if value < min || value > max {
        return Err(node.error(format!(
            "size {text:?} is out of range: expected {} to {}",
            units::format_size(min),
            units::format_size(max)
        )));
    }
    Ok(value)
}
