//! devicelet's VFIO passthrough module: PCI functions bound to `vfio-pci` (SR-IOV virtual
//! functions, GPUs for virtual machines) handed to containers and KubeVirt VMs, one IOMMU group
//! at a time. Vendors' variant VFIO drivers (`mlx5_vfio_pci`, `nvgrace_gpu_vfio_pci`...) count
//! as `vfio-pci`.
//!
//! Each configured resource selects functions by `vendor:device` (and, with `vfs-only`, only
//! SR-IOV virtual functions). A selected function bound to `vfio-pci` is a device, its ID its PCI
//! address. The container gets `/dev/vfio/vfio` and `/dev/vfio/<group>` for each IOMMU group of
//! its functions, and `PCIDEVICE_<RESOURCE>` and `PCI_RESOURCE_<RESOURCE>` (the variables the
//! SR-IOV network device plugin and KubeVirt read) listing the addresses, comma-separated.
//!
//! What the host does with what the module reports (WIT 0.2):
//!
//! - every device is **exclusive**: a second pod opening the same group could reach the first
//!   one's device, so the agent refuses any sharing rule for the resource;
//! - functions of one resource in one IOMMU group form a **device group** (`iommu-<n>`): the
//!   kernel hands out a group whole, so the agent allocates it whole (its preferred allocation
//!   keeps it together, a request that splits it is refused with `InvalidArgument`);
//! - a function that stops being usable is **Unhealthy, with the reason**: unbound from
//!   `vfio-pci` (or bound to another driver), gone from the bus, no IOMMU group, its
//!   `/dev/vfio/<group>` node or `/dev/vfio/vfio` missing, its group not viable (another member
//!   bound to a host driver), or its group shared with another resource of this module.
//!
//! Registry entry:
//!
//! ```toml
//! [[module]]
//! name = "vfio-pci"
//! path = "vfio_pci.wasm"
//! resource-domain = "intel.com"
//!
//! [module.grants]
//! sysfs = ["/sys/bus/pci/devices/*", "/sys/kernel/iommu_groups/*"]
//! dev = ["/dev/vfio/*"]
//!
//! [[module.config.resources]]
//! name = "x710-vf"          # served as intel.com/x710-vf
//! ids = ["8086:154c"]       # vendor:device, as KubeVirt's pciVendorSelector
//! vfs-only = true           # SR-IOV virtual functions only (default false)
//! ```
//!
//! Resources are served under the entry's `resource-domain`; for another vendor's functions add
//! a second `[[module]]` entry with the same `path`. A function belongs to one resource, and
//! functions of one IOMMU group should not be selected by two resources: the module marks a
//! group it finds split between two of its resources Unhealthy (it cannot see other entries).
//! A group member no resource selects goes along with the group's node: for KubeVirt GPU
//! passthrough select only the GPU's ID, and its audio function (on `vfio-pci` too) comes
//! with it, so one GPU is one device, as a VM's `gpus` entry asks.

use std::collections::{BTreeMap, BTreeSet};

use devicelet_sdk::pci::{self, Filter, PciDevice};
use devicelet_sdk::{
    ContainerEdits, Device, FsError, Plugin, PluginError, ResourceInfo, context, devnodes,
    export_plugin, sysfs,
};
use serde::Deserialize;

/// The generic VFIO driver.
const VFIO: &str = "vfio-pci";
/// The VFIO container node every user of a group opens first.
const CONTAINER: &str = "/dev/vfio/vfio";
/// Where the kernel lists each IOMMU group's members.
const IOMMU_GROUPS: &str = "/sys/kernel/iommu_groups";
/// Whether `driver` is a VFIO driver: `vfio-pci`, or a vendor's variant of it
/// (`mlx5_vfio_pci`, `hisi_acc_vfio_pci`, `nvgrace_gpu_vfio_pci`...), which also makes
/// `/dev/vfio/<group>` and hands the function to userspace.
fn is_vfio(driver: &str) -> bool {
    driver == VFIO || driver.ends_with("_vfio_pci")
}

/// Whether the kernel lets a group member on `driver` stay while VFIO opens the group: VFIO
/// drivers and `pci-stub` (which claims a function without driving it). A member with no driver
/// is fine too, and so is a bridge whatever its driver.
fn keeps_group_viable(driver: &str) -> bool {
    is_vfio(driver) || driver == "pci-stub"
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Config {
    resources: Vec<ResourceConfig>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct ResourceConfig {
    name: String,
    ids: Vec<String>,
    #[serde(default)]
    vfs_only: bool,
}

/// One resource: which functions it serves.
#[derive(Debug)]
struct Selector {
    name: String,
    ids: Vec<(u16, u16)>,
    vfs_only: bool,
}

impl Selector {
    fn matches(&self, function: &PciDevice) -> bool {
        self.ids.contains(&(function.vendor, function.device))
            && (!self.vfs_only || function.is_virtual_function())
    }
}

/// `8086:154c` (hex, either case, as `lspci -nn` and KubeVirt's `pciVendorSelector` write it).
fn parse_id(text: &str) -> Result<(u16, u16), String> {
    let hex = |s: &str| {
        (s.len() == 4)
            .then(|| u16::from_str_radix(s, 16).ok())
            .flatten()
    };
    text.split_once(':')
        .and_then(|(vendor, device)| Some((hex(vendor)?, hex(device)?)))
        .ok_or_else(|| format!("{text:?} is not a vendor:device pair such as \"8086:154c\""))
}

fn parse_config(text: &str) -> Result<Vec<Selector>, String> {
    let config: Config = serde_json::from_str(text).map_err(|e| e.to_string())?;
    if config.resources.is_empty() {
        return Err(
            "name at least one resource: [[module.config.resources]] with `name` and \
                    `ids = [\"vendor:device\"]`"
                .into(),
        );
    }
    let mut selectors: Vec<Selector> = Vec::new();
    for resource in config.resources {
        if selectors.iter().any(|s| s.name == resource.name) {
            return Err(format!("resource {:?} is named twice", resource.name));
        }
        if resource.ids.is_empty() {
            return Err(format!("resource {:?} selects no `ids`", resource.name));
        }
        let ids = resource
            .ids
            .iter()
            .map(|id| parse_id(id))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("resource {:?}: {e}", resource.name))?;
        for (vendor, device) in &ids {
            if let Some(other) = selectors
                .iter()
                .find(|s| s.ids.contains(&(*vendor, *device)))
            {
                return Err(format!(
                    "{vendor:04x}:{device:04x} is selected by both {:?} and {:?}: a function \
                     belongs to one resource",
                    other.name, resource.name
                ));
            }
        }
        selectors.push(Selector {
            name: resource.name,
            ids,
            vfs_only: resource.vfs_only,
        });
    }
    Ok(selectors)
}

/// `PCIDEVICE_<this>`: the served name upper-cased with `/` and `.` as `_`, as the SR-IOV
/// network device plugin and KubeVirt spell it (`intel.com/x710-vf` → `INTEL_COM_X710-VF`).
fn env_suffix(served_as: &str) -> String {
    served_as
        .chars()
        .map(|c| match c {
            '/' | '.' => '_',
            c => c.to_ascii_uppercase(),
        })
        .collect()
}

/// Whether a function is a PCI-to-PCI bridge (class `0x0604`, or `0x0609` subtractive decode),
/// which the kernel lets share a group with VFIO devices whatever its driver (`pcieport`). The
/// kernel goes by the header type, which sysfs shows only in config space; the class is what a
/// bridge reports.
fn is_bridge(function: &PciDevice) -> bool {
    matches!(function.class >> 8, 0x0604 | 0x0609)
}

/// One instance's state: the functions each resource has served, so one that is unbound or
/// vanishes is reported Unhealthy (with why) rather than silently dropped.
pub struct VfioPci {
    selectors: Vec<Selector>,
    seen: BTreeMap<String, BTreeSet<String>>,
}

impl VfioPci {
    fn selector(&self, resource: &str) -> Result<&Selector, PluginError> {
        self.selectors
            .iter()
            .find(|s| s.name == resource)
            .ok_or_else(|| PluginError::UnknownResource(resource.into()))
    }

    /// Why the functions on VFIO in IOMMU group `group` cannot be handed out, or None when they
    /// can: the same for every member (a member on VFIO keeps its group viable, and no other
    /// resource selects it), so an enumeration judges each group once.
    fn group_trouble(
        &self,
        resource: &str,
        group: u32,
        container_present: bool,
        all: &BTreeMap<String, PciDevice>,
    ) -> Result<Option<String>, PluginError> {
        if !container_present {
            return Ok(Some(format!(
                "{CONTAINER} is missing (is the vfio module loaded?)"
            )));
        }
        let node = format!("/dev/vfio/{group}");
        if devnodes::stat(&node).is_err() {
            return Ok(Some(format!("{node} is missing")));
        }
        let members = match sysfs::list(&format!("{IOMMU_GROUPS}/{group}/devices")) {
            Ok(members) => members,
            Err(FsError::Denied(why)) => {
                return Err(PluginError::Failed(format!(
                    "cannot list IOMMU group {group}'s members (grant sysfs \
                     \"{IOMMU_GROUPS}/*\"): {why}"
                )));
            }
            Err(e) => {
                let e = PluginError::from(e);
                return Ok(Some(format!("IOMMU group {group} cannot be listed: {e}")));
            }
        };
        for address in &members {
            let read;
            let member = match all.get(address) {
                Some(member) => member,
                None => match pci::read(address) {
                    Ok(found) => {
                        read = found;
                        &read
                    }
                    Err(e) => {
                        let e = PluginError::from(e);
                        return Ok(Some(format!(
                            "IOMMU group {group} cannot be checked: its member {address} \
                             cannot be read ({e})"
                        )));
                    }
                },
            };
            let driver = member.driver();
            if let Some(driver) = &driver
                && !keeps_group_viable(driver)
                && !is_bridge(member)
            {
                return Ok(Some(format!(
                    "IOMMU group {group} is not viable: {address} is bound to {driver}"
                )));
            }
            let other = self
                .selectors
                .iter()
                .find(|s| s.name != resource && s.matches(member));
            if let Some(other) = other
                && driver.as_deref().is_some_and(is_vfio)
            {
                return Ok(Some(format!(
                    "IOMMU group {group} is split between resources {resource} and {} \
                     ({address}): select both functions in one resource",
                    other.name
                )));
            }
        }
        Ok(None)
    }
}

impl Plugin for VfioPci {
    fn init(config: &str) -> Result<(Self, Vec<ResourceInfo>), PluginError> {
        let selectors = parse_config(config).map_err(PluginError::InvalidConfig)?;
        let resources = selectors
            .iter()
            .map(|s| ResourceInfo::new(s.name.clone()))
            .collect();
        Ok((
            VfioPci {
                selectors,
                seen: BTreeMap::new(),
            },
            resources,
        ))
    }

    fn enumerate(&mut self, resource: &str) -> Result<Vec<Device>, PluginError> {
        let selector = self.selector(resource)?;
        let all: BTreeMap<String, PciDevice> = pci::scan(&Filter::any())?
            .into_iter()
            .map(|f| (f.address.clone(), f))
            .collect();
        let seen = self.seen.get(resource).cloned().unwrap_or_default();
        let container_present = devnodes::stat(CONTAINER).is_ok();
        let mut verdicts: BTreeMap<u32, Option<String>> = BTreeMap::new();
        let mut served = BTreeSet::new();
        let mut devices = Vec::new();
        for function in all.values().filter(|f| selector.matches(f)) {
            let driver = function.driver();
            let on_vfio = driver.as_deref().is_some_and(is_vfio);
            let mut device = if on_vfio {
                let trouble = match function.iommu_group() {
                    None => Some(
                        "no IOMMU group: the IOMMU is off (boot with intel_iommu=on or \
                         amd_iommu=on)"
                            .to_owned(),
                    ),
                    Some(group) => match verdicts.get(&group) {
                        Some(verdict) => verdict.clone(),
                        None => {
                            let verdict =
                                self.group_trouble(resource, group, container_present, &all)?;
                            verdicts.insert(group, verdict.clone());
                            verdict
                        }
                    },
                };
                match trouble {
                    None => Device::healthy(function.address.clone()),
                    Some(why) => Device::unhealthy_because(function.address.clone(), why),
                }
            } else if seen.contains(&function.address) {
                let why = match driver {
                    Some(other) => format!("bound to {other}, not {VFIO}"),
                    None => format!("unbound from {VFIO}"),
                };
                Device::unhealthy_because(function.address.clone(), why)
            } else {
                continue;
            };
            device = device
                .exclusive()
                .attribute("pci-address", function.address.clone())
                .attribute("vendorID", format!("{:04x}", function.vendor))
                .attribute("deviceID", format!("{:04x}", function.device))
                .attribute("virtualFunction", function.is_virtual_function());
            if let Some(pf) = function.physfn() {
                device = device.attribute("physfn", pf);
            }
            if let Some(group) = function.iommu_group() {
                device = device.attribute("iommuGroup", i64::from(group));
            }
            if let Some(node) = function.numa_node {
                device = device.numa_node(node);
            }
            served.insert(function.address.clone());
            // Only functions on VFIO form groups: one unbound stays listed (Unhealthy), but
            // the kubelet never offers it, so grouping it would make its partners impossible to
            // allocate. (Its group stays viable without a driver: the rest go without it.)
            devices.push((device, function.iommu_group().filter(|_| on_vfio)));
        }
        for gone in seen.difference(&served) {
            let device = Device::unhealthy_because(gone.clone(), "gone from the PCI bus")
                .exclusive()
                .attribute("pci-address", gone.clone());
            devices.push((device, None));
        }
        let mut per_group: BTreeMap<u32, usize> = BTreeMap::new();
        for group in devices.iter().filter_map(|(_, g)| *g) {
            *per_group.entry(group).or_default() += 1;
        }
        self.seen
            .entry(resource.to_owned())
            .or_default()
            .extend(served);
        Ok(devices
            .into_iter()
            .map(|(device, group)| match group {
                Some(g) if per_group.get(&g).is_some_and(|n| *n > 1) => {
                    device.group(format!("iommu-{g}"))
                }
                _ => device,
            })
            .collect())
    }

    fn allocate(&mut self, resource: &str, ids: &[String]) -> Result<ContainerEdits, PluginError> {
        let selector = self.selector(resource)?;
        let mut groups = BTreeSet::new();
        for id in ids {
            let function = pci::read(id).map_err(|e| {
                PluginError::UnknownDevice(format!("{id}: {}", PluginError::from(e)))
            })?;
            if !selector.matches(&function) {
                return Err(PluginError::UnknownDevice(format!(
                    "{id} is not one of {resource}'s functions"
                )));
            }
            match function.driver() {
                Some(driver) if is_vfio(&driver) => {}
                Some(driver) => {
                    return Err(PluginError::Failed(format!(
                        "{id} is bound to {driver}, not {VFIO}"
                    )));
                }
                None => return Err(PluginError::Failed(format!("{id} is unbound"))),
            }
            let group = function
                .iommu_group()
                .ok_or_else(|| PluginError::Failed(format!("{id} has no IOMMU group")))?;
            groups.insert(group);
        }
        let mut edits = ContainerEdits::default().device(CONTAINER, CONTAINER, "rw");
        for group in groups {
            let node = format!("/dev/vfio/{group}");
            edits = edits.device(node.clone(), node, "rw");
        }
        let served_as = context::served_as(resource)
            .unwrap_or_else(|| format!("{}/{resource}", context::resource_domain()));
        let suffix = env_suffix(&served_as);
        let addresses = ids.join(",");
        Ok(edits
            .env(format!("PCIDEVICE_{suffix}"), addresses.clone())
            .env(format!("PCI_RESOURCE_{suffix}"), addresses))
    }
}

export_plugin!(VfioPci);

#[cfg(test)]
mod tests;
