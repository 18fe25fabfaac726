//! Publishing one driver's devices as ResourceSlices: one pool per driver per node (named after
//! the node), sharded at the API's 128 devices per slice, the pool's generation bumped on every
//! change, each slice owned by the Node (so it goes with the node) and placed on it
//! (`spec.nodeName`).
//!
//! An unhealthy device stays in its slice with the host's health taint (`taints`), so the
//! scheduler gives it to no new claim but one that tolerates the taint; on an API server that
//! drops taints (the DRADeviceTaints feature off: before 1.36 by default) the publisher sees its
//! taints gone from what it wrote, says so once, and withdraws unhealthy devices from the pool
//! instead. A device a container still holds through the device-plugin front end (a node moving
//! the resource to DRA) is left out: it joins the pool once that container ends. Typed attributes and
//! capacities come from the module (WIT 0.2); names that are not the API's C identifiers
//! (`pci-address`) are published with `-` and `.` as `_` (`pci_address`), and a PCI address also
//! as the standard `resource.kubernetes.io/pciBusID`.
//!
//! The publisher compares what the API server holds with what it should on every device change
//! and every resync interval, so slices wiped by a starting kubelet, or deleted or edited by
//! someone, come back within one interval. Errors (API down, conflicts) are retried with backoff;
//! nothing else waits on them.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use k8s_openapi::api::resource::v1::{
    CounterSet as ApiCounterSet, Device as ApiDevice, DeviceAttribute, DeviceCapacity,
    ResourcePool, ResourceSlice, ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use tokio::sync::watch;

use super::HeldElsewhere;
use super::api::{ApiClient, ApiError};
use super::events::{DraEvent, DraEvents};
use super::names::device_name;
use super::units::units;
use crate::backoff::Backoff;
use crate::device::{AttributeValue, Device};
use crate::resource::snapshot::Snapshot;

/// `ResourceSliceMaxDevices`.
pub const MAX_DEVICES_PER_SLICE: usize = 128;
/// `ResourceSliceMaxDevicesWithAdvancedFeatures`: a slice in which any device has taints.
pub const MAX_TAINTED_DEVICES_PER_SLICE: usize = 64;
/// The standard attribute for a device's PCI address (KEP-4381).
pub const PCI_BUS_ID: &str = "resource.kubernetes.io/pciBusID";
/// The standard attribute for the PCIe root complex a device is under (`pci0000:00`), so a
/// claim can `matchAttribute` devices of different drivers under one root.
pub const PCIE_ROOT: &str = "resource.kubernetes.io/pcieRoot";
/// The standard attribute for a device's NUMA node (KEP-6072; the scalar form, which needs no
/// feature gate), so a claim can `matchAttribute` devices of different drivers on one node.
pub const NUMA_NODE: &str = "resource.kubernetes.io/numaNode";

/// What the publisher has done, for status and metrics.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Published {
    /// The pool's generation last written (or found current).
    pub generation: i64,
    pub slices: usize,
    pub devices: usize,
    /// Writes made to the API server (creates, updates, deletes).
    pub writes: u64,
    /// API errors met.
    pub errors: u64,
    /// The last error, until a sync succeeds.
    pub last_error: Option<String>,
    /// The API server dropped the health taints the publisher wrote (DRADeviceTaints off), so
    /// unhealthy devices are withdrawn from the pool instead, until the driver starts again.
    pub taints_dropped: bool,
    /// The API server dropped the counters partitions consume (DRAPartitionableDevices off),
    /// so devices that consume counters are withdrawn, until the driver starts again: published
    /// without them, overlapping partitions would be allocated together.
    pub counters_dropped: bool,
    /// The API server dropped `allowMultipleAllocations` (DRAConsumableCapacity off), so
    /// devices shared by capacity are published whole, one claim each, until the driver starts
    /// again: left as written, every resync would find them changed and write them again.
    pub shared_dropped: bool,
}

/// What the publisher leaves out because the API server dropped it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Features {
    /// Device taints are kept: unhealthy devices stay, tainted.
    pub taints: bool,
    /// Counters are kept: partitions are published.
    pub counters: bool,
    /// Multiple allocations are kept: devices shared by capacity are published shared.
    pub shared: bool,
}

impl Default for Features {
    fn default() -> Self {
        Features {
            taints: true,
            counters: true,
            shared: true,
        }
    }
}

/// The devices of `snapshot` as the API publishes them, by name: units (a device, or a whole
/// group) no member of which a container holds through the device-plugin front end (`held`,
/// module IDs); an unhealthy one with the health taint after the module's own, or (without the
/// `taints` feature) not at all; a partition (consuming counters) only with the `counters`
/// feature.
pub fn api_devices(
    snapshot: &[Device],
    held: &BTreeSet<String>,
    features: Features,
) -> Vec<ApiDevice> {
    let mut devices: Vec<ApiDevice> = units(snapshot)
        .iter()
        .filter(|u| {
            // Without taints, a device the module taints is withdrawn as an unhealthy one is:
            // published untainted it would be allocated to claims that do not tolerate it.
            (features.taints || (u.healthy() && u.members.iter().all(|d| d.taints.is_empty())))
                && (features.counters || u.first.consumes.is_empty())
                && !u.members.iter().any(|d| held.contains(&d.id))
        })
        .map(|u| {
            let mut device = api_device(u.first);
            // A group is published as its first member: it carries every member's taints.
            for member in u.members.iter().skip(1) {
                for taint in super::advanced::own_taints(member) {
                    let taints = device.taints.get_or_insert_with(Vec::new);
                    if !taints.contains(&taint) {
                        taints.push(taint);
                    }
                }
            }
            if !features.shared {
                device.allow_multiple_allocations = None;
                for capacity in device.capacity.iter_mut().flat_map(|c| c.values_mut()) {
                    capacity.request_policy = None;
                }
            }
            if !u.healthy() {
                device
                    .taints
                    .get_or_insert_with(Vec::new)
                    .push(super::taints::health_taint(u.reason().as_deref()));
            }
            device
        })
        .collect();
    devices.sort_by(|a, b| a.name.cmp(&b.name));
    // Two IDs on one name would get the whole slice refused: neither is published (an
    // 8-hex-digit digest collision, in practice never).
    let mut i = 0;
    while i + 1 < devices.len() {
        if devices[i].name == devices[i + 1].name {
            let name = devices[i].name.clone();
            tracing::warn!("two devices map to the DRA device name {name}; neither is published");
            devices.retain(|d| d.name != name);
        } else {
            i += 1;
        }
    }
    devices
}

/// A Kubernetes quantity's value, to compare quantities as the API server does: it stores them
/// in canonical form (`1024Mi` comes back as `1Gi`). None for what is not a quantity.
pub fn quantity_value(q: &str) -> Option<f64> {
    let end = q
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '-' || c == '+'))
        .unwrap_or(q.len());
    let (number, suffix) = q.split_at(end);
    let number: f64 = number.parse().ok()?;
    let scale = match suffix {
        "" => 1.0,
        "n" => 1e-9,
        "u" => 1e-6,
        "m" => 1e-3,
        "k" => 1e3,
        "M" => 1e6,
        "G" => 1e9,
        "T" => 1e12,
        "P" => 1e15,
        "E" => 1e18,
        "Ki" => 1024.0,
        "Mi" => 1024f64.powi(2),
        "Gi" => 1024f64.powi(3),
        "Ti" => 1024f64.powi(4),
        "Pi" => 1024f64.powi(5),
        "Ei" => 1024f64.powi(6),
        s if s.starts_with(['e', 'E']) => 10f64.powi(s[1..].parse().ok()?),
        _ => return None,
    };
    Some(number * scale)
}

/// Whether the API server's copy of a device is what we would publish: equal but for how
/// quantities are spelled.
fn same_device(have: &ApiDevice, want: &ApiDevice) -> bool {
    let capacities = |d: &ApiDevice| -> Vec<(String, Option<f64>)> {
        d.capacity
            .iter()
            .flatten()
            .map(|(k, v)| (k.clone(), quantity_value(&v.value.0)))
            .collect()
    };
    have.name == want.name
        && have.attributes.as_ref().filter(|a| !a.is_empty())
            == want.attributes.as_ref().filter(|a| !a.is_empty())
        && capacities(have) == capacities(want)
        && same_taints(have, want)
        && have.allow_multiple_allocations.unwrap_or(false)
            == want.allow_multiple_allocations.unwrap_or(false)
        && policies(have) == policies(want)
        && consumed(have) == consumed(want)
}

/// A quantity by value, as the server may spell it otherwise.
fn value_of(q: &Quantity) -> Option<f64> {
    quantity_value(&q.0)
}

/// Each capacity's request policy, by value.
type PolicyValues = (Option<f64>, Option<[Option<f64>; 3]>, Vec<Option<f64>>);

fn policies(d: &ApiDevice) -> Vec<(String, PolicyValues)> {
    d.capacity
        .iter()
        .flatten()
        .filter_map(|(name, c)| {
            let p = c.request_policy.as_ref()?;
            let range = p.valid_range.as_ref().map(|r| {
                [
                    value_of(&r.min),
                    r.max.as_ref().and_then(value_of),
                    r.step.as_ref().and_then(value_of),
                ]
            });
            let values = p.valid_values.iter().flatten().map(value_of).collect();
            Some((
                name.clone(),
                (p.default.as_ref().and_then(value_of), range, values),
            ))
        })
        .collect()
}

/// Named counter sets (consumed or shared), their counters by value.
type CountersByValue = Vec<(String, Vec<(String, Option<f64>)>)>;

/// One set's counters by value.
fn by_value(
    name: &str,
    counters: &BTreeMap<String, k8s_openapi::api::resource::v1::Counter>,
) -> (String, Vec<(String, Option<f64>)>) {
    let values = counters
        .iter()
        .map(|(n, v)| (n.clone(), value_of(&v.value)))
        .collect();
    (name.to_owned(), values)
}

/// What a device consumes, by value.
fn consumed(d: &ApiDevice) -> CountersByValue {
    d.consumes_counters
        .iter()
        .flatten()
        .map(|c| by_value(&c.counter_set, &c.counters))
        .collect()
}

/// The same counter sets, by value.
fn same_counters(have: &ResourceSliceSpec, want: &ResourceSliceSpec) -> bool {
    let sets = |s: &ResourceSliceSpec| -> CountersByValue {
        s.shared_counters
            .iter()
            .flatten()
            .map(|c| by_value(&c.name, &c.counters))
            .collect()
    };
    sets(have) == sets(want)
}

/// Whether any of `devices` consumes counters.
fn partitioned(devices: &[ApiDevice]) -> bool {
    devices
        .iter()
        .any(|d| d.consumes_counters.as_ref().is_some_and(|c| !c.is_empty()))
}

/// The same taints in the same order, whenever the server says they were added.
fn same_taints(have: &ApiDevice, want: &ApiDevice) -> bool {
    let (h, w) = (
        have.taints.as_deref().unwrap_or_default(),
        want.taints.as_deref().unwrap_or_default(),
    );
    h.len() == w.len() && h.iter().zip(w).all(|(h, w)| super::taints::same(h, w))
}

/// Whether any of `devices` has a taint: such a slice holds at most 64 devices.
fn shared(devices: &[ApiDevice]) -> bool {
    devices
        .iter()
        .any(|d| d.allow_multiple_allocations == Some(true))
}

fn tainted(devices: &[ApiDevice]) -> bool {
    devices
        .iter()
        .any(|d| d.taints.as_ref().is_some_and(|t| !t.is_empty()))
}

/// How many devices one slice of `devices` holds.
pub fn per_slice(devices: &[ApiDevice]) -> usize {
    if tainted(devices) || partitioned(devices) {
        MAX_TAINTED_DEVICES_PER_SLICE
    } else {
        MAX_DEVICES_PER_SLICE
    }
}

/// The domain whose attributes the host publishes (`pciBusID`), never a module.
const HOST_DOMAIN: &str = "resource.kubernetes.io/";
/// The API's limit on a device's attributes and capacities together.
const MAX_ATTRIBUTES: usize = 32;

/// The name a module's attribute or capacity is published under, or why it cannot be.
fn published_name(name: &str) -> Result<String, String> {
    let published = attribute_name(name).ok_or_else(|| {
        "not a name the API takes (at most 32 bytes of letters, digits and `_`, not starting \
         with a digit, after an optional DNS-subdomain domain and `/`; `-` and `.` become `_`)"
            .to_owned()
    })?;
    if published.starts_with(HOST_DOMAIN) {
        return Err(format!(
            "names in {HOST_DOMAIN} are the host's to publish, not a module's"
        ));
    }
    Ok(published)
}

/// The attribute as the API holds it, or why it cannot be published.
fn api_attribute(value: &AttributeValue) -> Result<DeviceAttribute, &'static str> {
    Ok(match value {
        AttributeValue::Int(i) => DeviceAttribute {
            int: Some(*i),
            ..DeviceAttribute::default()
        },
        AttributeValue::Bool(b) => DeviceAttribute {
            bool: Some(*b),
            ..DeviceAttribute::default()
        },
        AttributeValue::Text(t) if t.len() <= 64 => DeviceAttribute {
            string: Some(t.clone()),
            ..DeviceAttribute::default()
        },
        // The API refuses the whole slice for one version that is not semver.
        AttributeValue::Version(v) if v.len() <= 64 && semver::Version::parse(v).is_ok() => {
            DeviceAttribute {
                version: Some(v.clone()),
                ..DeviceAttribute::default()
            }
        }
        AttributeValue::Version(_) => {
            return Err("a version that is not semantic (MAJOR.MINOR.PATCH), or over 64 bytes");
        }
        AttributeValue::Text(_) => return Err("a string of more than 64 bytes"),
    })
}

/// What of `d`'s attributes and capacities is left out of its slice, each (name, why): logged
/// once per driver by the publisher and shown by `validate`, so a vendor learns why.
pub fn dropped(d: &Device) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut kept = 0usize;
    for (name, value) in &d.attributes {
        match published_name(name).and_then(|_| api_attribute(value).map_err(str::to_owned)) {
            Ok(_) => kept += 1,
            Err(why) => out.push((name.clone(), why)),
        }
    }
    for (name, _) in &d.capacities {
        match published_name(name) {
            Ok(_) => kept += 1,
            Err(why) => out.push((name.clone(), why)),
        }
    }
    if kept > MAX_ATTRIBUTES {
        out.push((
            format!("{} of them", kept - MAX_ATTRIBUTES),
            format!("past the API's {MAX_ATTRIBUTES} attributes and capacities of a device"),
        ));
    }
    out
}

fn api_device(d: &Device) -> ApiDevice {
    let mut attributes = BTreeMap::new();
    for (name, value) in &d.attributes {
        let (Ok(name), Ok(attribute)) = (published_name(name), api_attribute(value)) else {
            continue;
        };
        attributes.insert(name, attribute);
    }
    if let Some(address) = d
        .attribute("pci-address")
        .or_else(|| d.attribute("pciBusID"))
        .filter(|a| crate::policy::topology::is_pci_address(a))
    {
        attributes.insert(
            PCI_BUS_ID.to_string(),
            DeviceAttribute {
                string: Some(address),
                ..DeviceAttribute::default()
            },
        );
    }
    if let Some(root) = &d.pcie_root {
        attributes.insert(
            PCIE_ROOT.to_string(),
            DeviceAttribute {
                string: Some(root.clone()),
                ..DeviceAttribute::default()
            },
        );
    }
    // Its one NUMA node (the module's, or the one sysfs gives): none for a device without
    // affinity, nor for one spanning several (the scalar form cannot say that).
    if let [node] = d.numa_nodes[..]
        && node >= 0
    {
        attributes.insert(
            NUMA_NODE.to_string(),
            DeviceAttribute {
                int: Some(node),
                ..DeviceAttribute::default()
            },
        );
    }
    let capacity: BTreeMap<String, DeviceCapacity> = d
        .capacities
        .iter()
        .filter_map(|(name, quantity)| {
            Some((
                published_name(name).ok()?,
                DeviceCapacity {
                    value: Quantity(quantity.clone()),
                    request_policy: super::advanced::request_policy(d, name),
                },
            ))
        })
        .collect();
    // The API's limit on attributes and capacities together; the module's own first.
    let mut room = MAX_ATTRIBUTES;
    let attributes: BTreeMap<_, _> = attributes
        .into_iter()
        .take(room)
        .inspect(|_| room -= 1)
        .collect();
    let capacity: BTreeMap<_, _> = capacity.into_iter().take(room).collect();
    let taints = super::advanced::own_taints(d);
    ApiDevice {
        name: device_name(&d.id),
        attributes: (!attributes.is_empty()).then_some(attributes),
        capacity: (!capacity.is_empty()).then_some(capacity),
        allow_multiple_allocations: d.shared.is_some().then_some(true),
        consumes_counters: super::advanced::consumes(d),
        taints: (!taints.is_empty()).then_some(taints),
        ..ApiDevice::default()
    }
}

/// An attribute or capacity name the API takes: an optional domain and `/`, then a C identifier
/// of at most 32 bytes; `-` and `.` in the identifier become `_`. None when it cannot be one.
pub fn attribute_name(name: &str) -> Option<String> {
    let (domain, id) = match name.rsplit_once('/') {
        Some((domain, id)) => (Some(domain), id),
        None => (None, name),
    };
    let id: String = id
        .chars()
        .map(|c| if c == '-' || c == '.' { '_' } else { c })
        .collect();
    let identifier = id
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && id.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        && id.len() <= 32;
    let domain_ok =
        domain.is_none_or(|d| d.len() <= 63 && devicelet_api::names::is_dns1123_subdomain(d));
    (identifier && domain_ok).then(|| match domain {
        Some(d) => format!("{d}/{id}"),
        None => id,
    })
}

/// Who the slices are for.
#[derive(Debug, Clone)]
pub struct Pool {
    pub driver: String,
    pub node: String,
}

impl Pool {
    /// The slices the pool should have for `devices` and `counters` (the counter sets in a
    /// slice of their own, last), at `generation`, owned by the Node.
    pub fn slices(
        &self,
        (devices, counters): (&[ApiDevice], &[ApiCounterSet]),
        generation: i64,
        node_uid: &str,
    ) -> Vec<ResourceSlice> {
        let chunks: Vec<&[ApiDevice]> = if devices.is_empty() {
            vec![&[]]
        } else {
            devices.chunks(per_slice(devices)).collect()
        };
        let count = (chunks.len() + usize::from(!counters.is_empty())) as i64;
        let mut slices: Vec<ResourceSlice> = chunks
            .into_iter()
            .map(|chunk| ResourceSlice {
                metadata: ObjectMeta {
                    generate_name: Some(format!("{}-{}-", self.node, self.driver)),
                    owner_references: Some(vec![OwnerReference {
                        api_version: "v1".into(),
                        kind: "Node".into(),
                        name: self.node.clone(),
                        uid: node_uid.to_owned(),
                        controller: Some(true),
                        block_owner_deletion: None,
                    }]),
                    ..ObjectMeta::default()
                },
                spec: ResourceSliceSpec {
                    driver: self.driver.clone(),
                    node_name: Some(self.node.clone()),
                    pool: ResourcePool {
                        name: self.node.clone(),
                        generation,
                        resource_slice_count: count,
                    },
                    devices: Some(chunk.to_vec()),
                    ..ResourceSliceSpec::default()
                },
            })
            .collect();
        if let Some(first) = slices.first().cloned()
            && !counters.is_empty()
        {
            slices.push(ResourceSlice {
                spec: ResourceSliceSpec {
                    devices: None,
                    shared_counters: Some(counters.to_vec()),
                    ..first.spec
                },
                ..first
            });
        }
        slices
    }
}

impl Pool {
    /// Whether `slice` is one this pool publishes: its driver, node and pool, owned by the Node
    /// of that name. Whatever a list answers, only these are updated or deleted: a server that
    /// ignores the field selector must not make the agent delete another driver's slices.
    pub fn owns(&self, slice: &ResourceSlice) -> bool {
        slice.spec.driver == self.driver
            && slice.spec.node_name.as_deref() == Some(self.node.as_str())
            && slice.spec.pool.name == self.node
            && slice
                .metadata
                .owner_references
                .iter()
                .flatten()
                .any(|o| o.kind == "Node" && o.name == self.node)
    }

    /// This pool's slices, as the API server lists them.
    async fn listed(&self, api: &ApiClient) -> Result<Vec<ResourceSlice>, ApiError> {
        let mut listed = api.slices(&self.driver, &self.node).await?;
        let all = listed.len();
        listed.retain(|s| self.owns(s));
        if listed.len() < all {
            tracing::debug!(
                driver = self.driver,
                "the API server listed {} slices that are not this pool's; left alone",
                all - listed.len()
            );
        }
        Ok(listed)
    }
}

/// What one sync did.
#[derive(Debug, Default, PartialEq, Eq)]
struct Synced {
    writes: u64,
    /// A slice written with taints came back without them: the server drops the field.
    taints_dropped: bool,
    /// A slice written with counters (consumed or shared) came back without them.
    counters_dropped: bool,
    /// A slice written with shared devices came back without `allowMultipleAllocations`.
    shared_dropped: bool,
}

/// Makes the API server hold the pool for `devices`.
async fn sync(
    api: &ApiClient,
    pool: &Pool,
    node_uid: &str,
    devices: (&[ApiDevice], &[ApiCounterSet]),
    last_generation: &mut i64,
) -> Result<Synced, ApiError> {
    let mut existing = pool.listed(api).await?;
    existing.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    let found_generation = existing
        .iter()
        .map(|s| s.spec.pool.generation)
        .max()
        .unwrap_or(0);
    let current = (*last_generation).max(found_generation);
    let want = pool.slices(devices, current, node_uid);
    let owner = |s: &ResourceSlice| {
        s.metadata
            .owner_references
            .iter()
            .flatten()
            .map(|o| o.uid.clone())
            .collect::<Vec<_>>()
    };
    let same = existing.len() == want.len()
        && existing.iter().zip(&want).all(|(have, want)| {
            let (h, w) = (
                have.spec.devices.as_deref().unwrap_or(&[]),
                want.spec.devices.as_deref().unwrap_or(&[]),
            );
            have.spec.pool == want.spec.pool
                && h.len() == w.len()
                && h.iter().zip(w).all(|(h, w)| same_device(h, w))
                && same_counters(&have.spec, &want.spec)
                && have.spec.node_name == want.spec.node_name
                && owner(have) == owner(want)
        });
    if same {
        *last_generation = current;
        return Ok(Synced::default());
    }
    let generation = current + 1;
    let want = pool.slices(devices, generation, node_uid);
    let keep = want.len();
    let mut synced = Synced::default();
    for (i, mut slice) in want.into_iter().enumerate() {
        keep_taint_times(&mut slice, &existing);
        let stored = match existing.get(i) {
            Some(have) => {
                slice.metadata.name = have.metadata.name.clone();
                slice.metadata.generate_name = None;
                slice.metadata.resource_version = have.metadata.resource_version.clone();
                api.replace_slice(&slice).await?
            }
            None => api.create_slice(&slice).await?,
        };
        let sent = slice.spec.devices.as_deref().unwrap_or_default();
        let kept = stored.spec.devices.as_deref().unwrap_or_default();
        synced.taints_dropped |= tainted(sent) && !tainted(kept);
        let sets = |s: &ResourceSlice| {
            s.spec
                .shared_counters
                .as_ref()
                .is_some_and(|c| !c.is_empty())
        };
        synced.counters_dropped |=
            (partitioned(sent) && !partitioned(kept)) || (sets(&slice) && !sets(&stored));
        synced.shared_dropped |= shared(sent) && !shared(kept);
        synced.writes += 1;
    }
    for extra in existing.iter().skip(keep) {
        api.delete_slice(extra).await?;
        synced.writes += 1;
    }
    *last_generation = generation;
    Ok(synced)
}

/// A taint the pool already carries keeps the `timeAdded` the server gave it: rewriting a
/// slice for another device's sake does not make an old taint look new.
fn keep_taint_times(slice: &mut ResourceSlice, existing: &[ResourceSlice]) {
    let old: Vec<&ApiDevice> = existing
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten())
        .collect();
    for device in slice.spec.devices.iter_mut().flatten() {
        let Some(had) = old.iter().find(|d| d.name == device.name) else {
            continue;
        };
        for taint in device.taints.iter_mut().flatten() {
            if let Some(same) = had
                .taints
                .iter()
                .flatten()
                .find(|t| super::taints::same(t, taint))
            {
                taint.time_added = same.time_added.clone();
            }
        }
    }
}

/// Keeps the pool published until `stop`, from the first enumeration on (`ready`): after every
/// device change, every `resync`, when woken by `republish`, and with backoff after an error.
/// Devices `held` by device-plugin containers join it at the first of those after they are
/// freed (the agent wakes it when a reconciliation frees ledger entries).
#[allow(clippy::too_many_arguments)]
pub async fn publish(
    api: ApiClient,
    pool: Pool,
    mut devices: watch::Receiver<Snapshot>,
    (held, republish): (HeldElsewhere, std::sync::Arc<tokio::sync::Notify>),
    events: DraEvents,
    mut ready: watch::Receiver<bool>,
    resync: Duration,
    published: watch::Sender<Published>,
    mut stop: watch::Receiver<bool>,
) {
    // Nothing before the first enumeration: an empty pool would only be replaced at once.
    tokio::select! {
        _ = ready.wait_for(|r| *r) => {}
        _ = stop.wait_for(|s| *s) => return,
    }
    let mut generation = 0i64;
    let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(30));
    let mut logged = BTreeSet::new();
    let mut features = Features::default();
    loop {
        let held = held();
        let (want, counters) = {
            let snapshot = devices.borrow_and_update();
            log_dropped(&pool.driver, &snapshot, &mut logged);
            let counters = if features.counters {
                super::advanced::counter_sets(&snapshot.counter_sets)
            } else {
                Vec::new()
            };
            (api_devices(&snapshot, &held, features), counters)
        };
        // The Node's UID each time: a Node deleted and made again has a new one, and slices
        // owned by the old one are garbage collected.
        let result = async {
            let uid = api.node_uid(&pool.node).await?;
            sync(&api, &pool, &uid, (&want, &counters), &mut generation).await
        };
        let result = tokio::select! {
            result = result => result,
            _ = stop.wait_for(|s| *s) => return,
        };
        let pause = match result {
            Ok(Synced {
                writes,
                taints_dropped,
                counters_dropped,
                shared_dropped,
            }) => {
                backoff.reset();
                if writes > 0 {
                    events.emit(&pool.driver, DraEvent::SliceWrites(writes));
                }
                if taints_dropped {
                    tracing::warn!(
                        driver = pool.driver,
                        "the API server dropped the devices' taints (its DRADeviceTaints feature \
                         is off); unhealthy devices are withdrawn from the pool instead"
                    );
                    features.taints = false;
                }
                if counters_dropped {
                    tracing::warn!(
                        driver = pool.driver,
                        "the API server dropped the devices' counters (its \
                         DRAPartitionableDevices feature is off); devices that consume counters \
                         are withdrawn from the pool instead"
                    );
                    features.counters = false;
                }
                if shared_dropped {
                    tracing::warn!(
                        driver = pool.driver,
                        "the API server dropped the devices' allowMultipleAllocations (its \
                         DRAConsumableCapacity feature is off); devices shared by capacity are \
                         published whole instead, one claim each"
                    );
                    features.shared = false;
                }
                published.send_modify(|p| {
                    p.generation = generation;
                    p.devices = want.len();
                    p.slices = want.len().div_ceil(per_slice(&want)).max(1)
                        + usize::from(!counters.is_empty());
                    p.writes += writes;
                    p.last_error = None;
                    p.taints_dropped |= taints_dropped;
                    p.counters_dropped |= counters_dropped;
                    p.shared_dropped |= shared_dropped;
                });
                if taints_dropped || counters_dropped || shared_dropped {
                    // Written again at once, without the sick devices.
                    continue;
                }
                resync
            }
            Err(e) => {
                tracing::warn!(
                    driver = pool.driver,
                    "publishing ResourceSlices: {e}; retrying"
                );
                events.emit(&pool.driver, DraEvent::ApiError);
                published.send_modify(|p| {
                    p.errors += 1;
                    p.last_error = Some(e.to_string());
                });
                backoff.failed()
            }
        };
        tokio::select! {
            changed = devices.changed() => if changed.is_err() { return },
            () = republish.notified() => {}
            () = tokio::time::sleep(pause) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
    }
}

/// Logs each attribute the module's devices carry that is left out of the slice, once per
/// (name, reason) for the driver's life: a vendor learns why an attribute is missing without
/// a line per device or per resync.
fn log_dropped(driver: &str, devices: &[Device], logged: &mut BTreeSet<(String, String)>) {
    for (name, why) in devices.iter().flat_map(dropped) {
        if logged.len() < 256 && !logged.contains(&(name.clone(), why.clone())) {
            tracing::warn!(
                driver,
                attribute = crate::text::cut(&name, 64),
                "a device attribute or capacity is not published: {why} (logged once)"
            );
            logged.insert((name, why));
        }
    }
}

/// Deletes every slice of the pool (the driver goes away for good); errors are logged and
/// counted.
pub async fn withdraw(api: &ApiClient, pool: &Pool, events: &DraEvents) {
    match pool.listed(api).await {
        Ok(slices) => {
            let mut deleted = 0;
            for slice in slices {
                match api.delete_slice(&slice).await {
                    Ok(()) => deleted += 1,
                    Err(e) => {
                        events.emit(&pool.driver, DraEvent::ApiError);
                        tracing::warn!(driver = pool.driver, "removing ResourceSlices: {e}");
                    }
                }
            }
            if deleted > 0 {
                events.emit(&pool.driver, DraEvent::SliceWrites(deleted));
            }
        }
        Err(e) => {
            events.emit(&pool.driver, DraEvent::ApiError);
            tracing::warn!(driver = pool.driver, "removing ResourceSlices: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::Health;

    #[test]
    fn without_consumable_capacity_a_shared_device_is_published_whole() {
        let mut gpu = Device::new("gpu-0", Health::Healthy);
        gpu.capacities = vec![("memory".into(), "80Gi".into())];
        gpu.shared = Some(crate::device::Shared {
            policies: vec![("memory".into(), crate::device::RequestPolicy::default())],
        });
        let policy = |d: &ApiDevice| {
            d.capacity
                .as_ref()
                .and_then(|c| c["memory"].request_policy.clone())
        };
        let shared = api_devices(
            std::slice::from_ref(&gpu),
            &BTreeSet::new(),
            Features::default(),
        );
        assert_eq!(shared[0].allow_multiple_allocations, Some(true));
        assert!(policy(&shared[0]).is_some());
        let whole = api_devices(
            &[gpu],
            &BTreeSet::new(),
            Features {
                shared: false,
                ..Features::default()
            },
        );
        assert_eq!(whole[0].allow_multiple_allocations, None);
        assert!(policy(&whole[0]).is_none());
    }

    #[test]
    fn typed_attributes_and_capacities_keep_their_kinds_and_names_become_identifiers() {
        let mut gpu = Device::new("0000:3b:00.0", Health::Healthy);
        gpu.attributes = vec![
            (
                "pci-address".into(),
                AttributeValue::Text("0000:3b:00.0".into()),
            ),
            ("cores".into(), AttributeValue::Int(96)),
            ("mig".into(), AttributeValue::Bool(true)),
            (
                "driverVersion".into(),
                AttributeValue::Version("550.54.15".into()),
            ),
            ("bad name!".into(), AttributeValue::Text("x".into())),
        ];
        gpu.capacities = vec![("memory".into(), "80Gi".into())];
        gpu.numa_nodes = vec![1];
        gpu.pcie_root = Some("pci0000:3a".into());
        let mut sick = Device::new("gpu-1", Health::Unhealthy);
        sick.health_reason = Some("XID 79".into());
        let both = [gpu, sick];
        let devices = api_devices(
            &both,
            &BTreeSet::new(),
            Features {
                taints: false,
                ..Features::default()
            },
        );
        assert_eq!(
            devices.len(),
            1,
            "without taints only healthy devices are published"
        );
        let tainted = api_devices(&both, &BTreeSet::new(), Features::default());
        assert_eq!(tainted.len(), 2, "with taints the sick one stays");
        let taints: Vec<_> = tainted.iter().map(|d| d.taints.clone()).collect();
        assert_eq!(taints[0], None);
        assert_eq!(
            taints[1],
            Some(vec![super::super::taints::health_taint(Some("XID 79"))])
        );
        assert_eq!(
            taints[1].as_ref().unwrap()[0].value.as_deref(),
            Some("XID-79")
        );
        let d = &devices[0];
        assert_eq!(d.name, device_name("0000:3b:00.0"));
        let attributes = d.attributes.as_ref().unwrap();
        assert_eq!(
            attributes["pci_address"].string.as_deref(),
            Some("0000:3b:00.0")
        );
        assert_eq!(
            attributes[PCI_BUS_ID].string.as_deref(),
            Some("0000:3b:00.0")
        );
        assert_eq!(attributes[NUMA_NODE].int, Some(1));
        assert_eq!(attributes[PCIE_ROOT].string.as_deref(), Some("pci0000:3a"));
        assert_eq!(attributes["cores"].int, Some(96));
        assert_eq!(attributes["mig"].bool, Some(true));
        assert_eq!(
            attributes["driverVersion"].version.as_deref(),
            Some("550.54.15")
        );
        assert!(!attributes.keys().any(|k| k.contains("bad")));
        assert_eq!(d.capacity.as_ref().unwrap()["memory"].value.0, "80Gi");
    }

    #[test]
    fn the_numa_node_is_published_only_when_there_is_exactly_one() {
        let numa = |nodes: &[i64]| {
            let mut d = Device::new("d", Health::Healthy);
            d.numa_nodes = nodes.to_vec();
            api_device(&d)
                .attributes
                .and_then(|a| a.get(NUMA_NODE).and_then(|v| v.int))
        };
        assert_eq!(numa(&[0]), Some(0));
        assert_eq!(numa(&[3]), Some(3));
        assert_eq!(numa(&[]), None, "no affinity");
        assert_eq!(numa(&[-1]), None, "no affinity, as sysfs says it");
        assert_eq!(
            numa(&[0, 1]),
            None,
            "two nodes: the scalar form cannot say it"
        );
    }

    #[test]
    fn what_is_left_out_of_a_slice_is_named_with_why_and_the_host_s_domain_is_the_host_s() {
        let mut d = Device::new("gpu-0", Health::Healthy);
        let text = |t: &str| AttributeValue::Text(t.into());
        d.attributes = vec![
            ("model".into(), text("A100")),
            ("".into(), text("x")),
            ("has space".into(), text("x")),
            ("9lives".into(), text("x")),
            ("a".repeat(33), text("x")),
            ("long".into(), text(&"y".repeat(65))),
            ("driver".into(), AttributeValue::Version("1.2".into())),
            (PCI_BUS_ID.into(), text("0000:00:01.0")),
        ];
        d.capacities = vec![("resource.kubernetes.io/memory".into(), "1Gi".into())];
        let dropped = dropped(&d);
        let names: Vec<&str> = dropped.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "",
                "has space",
                "9lives",
                &"a".repeat(33),
                "long",
                "driver",
                PCI_BUS_ID,
                "resource.kubernetes.io/memory"
            ]
        );
        assert!(
            dropped[0].1.contains("not a name the API takes"),
            "{dropped:?}"
        );
        assert!(dropped[4].1.contains("more than 64 bytes"), "{dropped:?}");
        assert!(dropped[5].1.contains("not semantic"), "{dropped:?}");
        assert!(
            dropped[6].1.contains("the host's to publish"),
            "{dropped:?}"
        );
        let published = api_device(&d);
        let attributes = published.attributes.unwrap_or_default();
        assert_eq!(attributes.keys().collect::<Vec<_>>(), ["model"]);
        assert!(published.capacity.is_none());
    }

    #[test]
    fn quantities_compare_by_value_as_the_api_server_stores_them() {
        assert_eq!(quantity_value("1024Mi"), quantity_value("1Gi"));
        assert_eq!(quantity_value("1000m"), quantity_value("1"));
        assert_eq!(quantity_value("1.5G"), quantity_value("1500M"));
        assert_eq!(quantity_value("80Gi"), Some(80.0 * 1024f64.powi(3)));
        assert_eq!(quantity_value("12 GB"), None);
        let mut gpu = Device::new("gpu-0", Health::Healthy);
        gpu.capacities = vec![("memory".into(), "1024Mi".into())];
        gpu.attributes = vec![
            (
                "driverVersion".into(),
                AttributeValue::Version("12.4".into()),
            ),
            ("cuda".into(), AttributeValue::Version("12.4.0".into())),
        ];
        let ours = api_devices(&[gpu], &BTreeSet::new(), Features::default());
        let attributes = ours[0].attributes.as_ref().unwrap();
        assert!(
            !attributes.contains_key("driverVersion"),
            "not semver: left out"
        );
        assert!(attributes.contains_key("cuda"));
        let mut stored = ours[0].clone();
        stored
            .capacity
            .as_mut()
            .unwrap()
            .get_mut("memory")
            .unwrap()
            .value = Quantity("1Gi".into());
        assert!(same_device(&stored, &ours[0]));
    }

    #[test]
    fn a_pool_is_sharded_at_the_api_limit_and_every_slice_counts_them_all() {
        let pool = Pool {
            driver: "fuse.devicelet.io".into(),
            node: "node-a".into(),
        };
        let snapshot: Vec<Device> = (0..300)
            .map(|i| Device::new(format!("fuse-{i:03}"), Health::Healthy))
            .collect();
        let slices = pool.slices(
            (
                &api_devices(&snapshot, &BTreeSet::new(), Features::default()),
                &[],
            ),
            4,
            "uid-1",
        );
        assert_eq!(slices.len(), 3);
        let sizes: Vec<usize> = slices
            .iter()
            .map(|s| s.spec.devices.as_ref().unwrap().len())
            .collect();
        assert_eq!(sizes, [128, 128, 44]);
        // One tainted device anywhere: 64 a slice (the API's limit with taints).
        let mut sick = snapshot.clone();
        sick[7].health = Health::Unhealthy;
        let tainted = pool.slices(
            (
                &api_devices(&sick, &BTreeSet::new(), Features::default()),
                &[],
            ),
            4,
            "uid-1",
        );
        let sizes: Vec<usize> = tainted
            .iter()
            .map(|s| s.spec.devices.as_ref().unwrap().len())
            .collect();
        assert_eq!(sizes, [64, 64, 64, 64, 44]);
        assert!(slices.iter().all(|s| s.spec.pool.resource_slice_count == 3
            && s.spec.pool.generation == 4
            && s.metadata.owner_references.as_ref().unwrap()[0].uid == "uid-1"));
        // No devices still publishes the pool, empty, so consumers see it is there.
        assert_eq!(pool.slices((&[], &[]), 1, "uid-1").len(), 1);
    }
}
