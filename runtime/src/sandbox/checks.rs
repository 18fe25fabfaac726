//! What a module returns is untrusted. Each answer is checked before anything reaches the
//! kubelet: device IDs the kubelet can use, device nodes and mounts inside the module's grants,
//! names the container runtime accepts, and sizes that cannot exhaust the agent.
//!
//! A violation fails the call with the rule it broke; `ModuleHandle` counts it per module.

use std::collections::HashSet;

use std::path::Path;

use cap_std::fs::{FileTypeExt, MetadataExt};

use super::host::paths::{granted, granted_exactly, real_path, real_path_and_metadata};
use crate::config::Grants;
use crate::device::{ContainerEdits, Device, Inventory, NodeFile, NodeKind, ValidAmounts};

pub use crate::device::{MAX_DEVICES, MAX_ID};
const MAX_NUMA_NODES: usize = 64;
const MAX_ATTRIBUTES: usize = 64;
const MAX_ATTRIBUTE: usize = 1024;
const MAX_EDIT_ENTRIES: usize = 256;
/// Longest single value (env value, path, annotation value) a module may return.
const MAX_VALUE: usize = 32 * 1024;

/// A broken rule, stated so the vendor knows what to fix.
pub type Violation = String;

/// Device IDs travel through the kubelet's checkpoint, PodResources and env vars: keep them to
/// 1–128 characters of `[A-Za-z0-9._:/-]`. `/` is there for legacy MIG IDs
/// (`MIG-GPU-<uuid>/<gi>/<ci>`), but only between non-empty parts other than `.` and `..`.
pub fn device_id(id: &str) -> Result<(), Violation> {
    let ok = !id.is_empty()
        && id.len() <= MAX_ID
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'-' | b'/'))
        && id
            .split('/')
            .all(|part| !part.is_empty() && part != "." && part != "..");
    if ok {
        Ok(())
    } else {
        Err(format!(
            "device ID {:?} must be 1-{MAX_ID} characters of [A-Za-z0-9._:/-], with no empty, `.` or `..` parts",
            truncate(id)
        ))
    }
}

pub fn devices(devices: &[Device]) -> Result<(), Violation> {
    if devices.len() > MAX_DEVICES {
        return Err(format!(
            "{} devices listed; at most {MAX_DEVICES} allowed",
            devices.len()
        ));
    }
    let mut seen = HashSet::with_capacity(devices.len());
    for d in devices {
        device_id(&d.id)?;
        if !seen.insert(d.id.as_str()) {
            return Err(format!("device ID {:?} listed twice", d.id));
        }
        if d.numa_nodes.len() > MAX_NUMA_NODES
            || d.numa_nodes.iter().any(|&n| !(0..1024).contains(&n))
        {
            return Err(format!("device {:?} has invalid NUMA nodes", d.id));
        }
        if d.attributes.len() > MAX_ATTRIBUTES
            || d.attributes
                .iter()
                .any(|(k, v)| k.len() > 63 || v.bytes() > MAX_ATTRIBUTE)
        {
            return Err(format!(
                "device {:?} has too many or too long attributes (at most {MAX_ATTRIBUTES}, keys 63 and values {MAX_ATTRIBUTE} bytes)",
                d.id
            ));
        }
        if d.capacities.len() > MAX_ATTRIBUTES
            || d.capacities
                .iter()
                .any(|(k, v)| k.len() > 63 || !is_quantity(v))
        {
            return Err(format!(
                "device {:?} has too many capacities, a name over 63 bytes, or a value that is not a Kubernetes quantity (`80Gi`, `1500m`, `4`)",
                d.id
            ));
        }
        if d.health_reason
            .as_ref()
            .is_some_and(|r| r.len() > MAX_ATTRIBUTE)
            || d.group
                .as_ref()
                .is_some_and(|g| g.is_empty() || g.len() > MAX_ID)
        {
            return Err(format!(
                "device {:?} has a health reason over {MAX_ATTRIBUTE} bytes or a group name that is empty or over {MAX_ID}",
                d.id
            ));
        }
        advanced(d)?;
    }
    Ok(())
}

/// DRA's limits on what a pool publishes (`resource.k8s.io/v1` validation), and the WIT's.
const MAX_COUNTER_SETS: usize = 8;
const MAX_COUNTERS: usize = 32;
const MAX_CONSUMED_SETS: usize = 2;
/// The API allows 4 taints a device (1.34), and the host may add its health taint.
const MAX_OWN_TAINTS: usize = 3;
const MAX_VALID_VALUES: usize = 10;
/// `AllocatedDeviceStatus.data`'s limit.
const MAX_STATUS_DATA: usize = 10 * 1024;

/// An enumeration's answer: its devices ([`devices`]), its counter sets, and what the devices
/// take from them (WIT 0.3).
pub fn inventory(inventory: &Inventory) -> Result<(), Violation> {
    devices(inventory)?;
    let sets = &inventory.counter_sets;
    if sets.len() > MAX_COUNTER_SETS {
        return Err(format!(
            "{} counter sets; at most {MAX_COUNTER_SETS} allowed",
            sets.len()
        ));
    }
    let mut names = HashSet::new();
    for set in sets {
        if !devicelet_api::names::is_dns1123_label(&set.name) || !names.insert(set.name.as_str()) {
            return Err(format!(
                "counter set {:?} must be a DNS label, and unique",
                truncate(&set.name)
            ));
        }
        amounts(&format!("counter set {:?}", set.name), &set.counters)?;
    }
    for d in inventory.iter() {
        let at = format!("device {:?}", d.id);
        if d.consumes.len() > MAX_CONSUMED_SETS {
            return Err(format!(
                "{at} consumes from {} counter sets; at most {MAX_CONSUMED_SETS}",
                d.consumes.len()
            ));
        }
        for used in &d.consumes {
            let Some(set) = sets.iter().find(|s| s.name == used.counter_set) else {
                return Err(format!(
                    "{at} consumes from counter set {:?}, which the inventory does not have",
                    truncate(&used.counter_set)
                ));
            };
            amounts(&at, &used.counters)?;
            if let Some((name, _)) = used
                .counters
                .iter()
                .find(|(name, _)| !set.counters.iter().any(|(n, _)| n == name))
            {
                return Err(format!(
                    "{at} consumes counter {:?}, which counter set {:?} does not have",
                    truncate(name),
                    set.name
                ));
            }
        }
    }
    Ok(())
}

/// Named quantities: counters, or what a claim consumed.
fn amounts(at: &str, amounts: &[(String, String)]) -> Result<(), Violation> {
    if amounts.len() > MAX_COUNTERS {
        return Err(format!(
            "{at} has {} counters; at most {MAX_COUNTERS}",
            amounts.len()
        ));
    }
    let mut seen = HashSet::new();
    for (name, value) in amounts {
        if !devicelet_api::names::is_dns1123_label(name) || !seen.insert(name.as_str()) {
            return Err(format!(
                "{at}: counter name {:?} must be a DNS label, and unique",
                truncate(name)
            ));
        }
        if !is_quantity(value) {
            return Err(format!(
                "{at}: counter {name} = {:?} is not a Kubernetes quantity",
                truncate(value)
            ));
        }
    }
    Ok(())
}

/// What 0.3 adds to a device: its own taints, its sharing by capacity.
fn advanced(d: &Device) -> Result<(), Violation> {
    let at = format!("device {:?}", d.id);
    if d.taints.len() > MAX_OWN_TAINTS {
        return Err(format!(
            "{at} has {} taints; at most {MAX_OWN_TAINTS}",
            d.taints.len()
        ));
    }
    for t in &d.taints {
        if !devicelet_api::names::is_qualified_name(&t.key) || t.key.starts_with("devicelet.io/") {
            return Err(format!(
                "{at}: taint key {:?} must be a label key outside devicelet.io/ (the host's)",
                truncate(&t.key)
            ));
        }
        if !devicelet_api::names::is_label_value(&t.value) {
            return Err(format!(
                "{at}: taint value {:?} must be a label value (63 characters of [A-Za-z0-9._-])",
                truncate(&t.value)
            ));
        }
    }
    let Some(shared) = &d.shared else {
        return Ok(());
    };
    if d.exclusive || d.group.is_some() {
        return Err(format!(
            "{at} is shared by capacity, which an exclusive or grouped device cannot be"
        ));
    }
    for (name, policy) in &shared.policies {
        if !d.capacities.iter().any(|(n, _)| n == name) {
            return Err(format!(
                "{at}: request policy for {name:?}, which is not one of its capacities"
            ));
        }
        let mut quantities: Vec<&String> = policy.default.iter().collect();
        match &policy.valid {
            ValidAmounts::Any => {}
            ValidAmounts::Range { min, max, step } => {
                quantities.push(min);
                quantities.extend(max.iter().chain(step));
            }
            ValidAmounts::Values(values) => {
                if values.is_empty() || values.len() > MAX_VALID_VALUES {
                    return Err(format!(
                        "{at}: capacity {name} lists {} valid values; 1 to {MAX_VALID_VALUES}",
                        values.len()
                    ));
                }
                quantities.extend(values);
            }
        }
        if let Some(bad) = quantities.into_iter().find(|q| !is_quantity(q)) {
            return Err(format!(
                "{at}: capacity {name}'s request policy has {:?}, not a Kubernetes quantity",
                truncate(bad)
            ));
        }
    }
    Ok(())
}

/// What `prepare` says for a claim's status: per device of the request at most once, a JSON
/// object of at most 10 KiB.
pub fn claim_status(status: &[(String, String)], ids: &[String]) -> Result<(), Violation> {
    let mut seen = HashSet::new();
    for (id, data) in status {
        if !ids.contains(id) || !seen.insert(id.as_str()) {
            return Err(format!(
                "status for device {:?}, which the request does not hold or which is given twice",
                truncate(id)
            ));
        }
        if data.len() > MAX_STATUS_DATA
            || !serde_json::from_str::<serde_json::Value>(data).is_ok_and(|v| v.is_object())
        {
            return Err(format!(
                "status data of device {:?} must be a JSON object of at most {MAX_STATUS_DATA} bytes",
                truncate(id)
            ));
        }
    }
    Ok(())
}

/// A Kubernetes quantity as a module may write one: digits (with at most one `.`), then an
/// optional suffix (`m`, `k`, `M`, `G`, `T`, `P`, `E`, `Ki` .. `Ei`).
fn is_quantity(text: &str) -> bool {
    const SUFFIXES: [&str; 14] = [
        "", "m", "k", "M", "G", "T", "P", "E", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei",
    ];
    let number_end = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, suffix) = text.split_at(number_end);
    text.len() <= 64
        && number.bytes().any(|b| b.is_ascii_digit())
        && number.matches('.').count() <= 1
        && SUFFIXES.contains(&suffix)
}

/// IDs the module answers with must be among those it was asked about.
pub fn chosen_ids(chosen: &[String], allowed: &[String], size: usize) -> Result<(), Violation> {
    if chosen.len() > size {
        return Err(format!(
            "{} devices preferred for a request of {size}",
            chosen.len()
        ));
    }
    let mut seen = HashSet::new();
    for id in chosen {
        if !allowed.contains(id) {
            return Err(format!(
                "preferred device {:?} was not offered",
                truncate(id)
            ));
        }
        if !seen.insert(id) {
            return Err(format!("preferred device {id:?} named twice"));
        }
    }
    Ok(())
}

fn is_normal_absolute(path: &str) -> bool {
    path.len() <= 4096 && devicelet_rules::grants::normal(path).is_ok()
}

/// Kubernetes' own rule for a container's variable names (`IsEnvVarName`): letters, digits, `_`,
/// `-` and `.`, not starting with a digit. The dash matters: the SR-IOV network device plugin
/// and KubeVirt name variables after resources (`PCIDEVICE_INTEL_COM_X710-VF`).
fn is_env_name(name: &str) -> bool {
    let allowed = |b: u8| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.');
    name.bytes().next().is_some_and(|b| !b.is_ascii_digit())
        && name.bytes().all(allowed)
        && name.len() <= 256
}

/// Annotation keys are Kubernetes qualified names.
fn is_annotation_key(key: &str) -> bool {
    devicelet_api::names::is_qualified_name(key)
}

/// A fully qualified CDI device name, `vendor.com/class=name`, by the CDI grammar.
fn is_cdi_name(name: &str) -> bool {
    name.len() <= MAX_VALUE && crate::cdi::spec::check_qualified_name(name).is_ok()
}

/// Container edits: device nodes inside the module's /dev grants, mounts inside its grants,
/// valid names everywhere, bounded sizes.
pub fn edits(edits: &ContainerEdits, grants: &Grants) -> Result<(), Violation> {
    let counts = [
        edits.envs.len(),
        edits.mounts.len(),
        edits.devices.len(),
        edits.annotations.len(),
        edits.cdi_devices.len(),
    ];
    if counts.iter().any(|&n| n > MAX_EDIT_ENTRIES) {
        return Err(format!(
            "more than {MAX_EDIT_ENTRIES} entries in one kind of container edit"
        ));
    }
    if let Some((name, first, second)) = devicelet_rules::edits::env_set_twice(&edits.envs) {
        return Err(format!(
            "env {} is set twice, to {:?} and {:?} (devices' own edits must not disagree)",
            truncate(name),
            truncate(first),
            truncate(second)
        ));
    }
    for (name, value) in &edits.envs {
        if !is_env_name(name) {
            return Err(format!(
                "env name {:?} is not a valid variable name",
                truncate(name)
            ));
        }
        if value.len() > MAX_VALUE {
            return Err(format!(
                "env {name} is {} bytes; at most {MAX_VALUE} allowed",
                value.len()
            ));
        }
    }
    for d in &edits.devices {
        if !is_normal_absolute(&d.host_path) || !granted(&grants.dev, &d.host_path) {
            return Err(format!(
                "device node {:?} is not under the module's /dev grants",
                truncate(&d.host_path)
            ));
        }
        if !is_normal_absolute(&d.container_path) {
            return Err(format!(
                "container path {:?} is not absolute and normal",
                truncate(&d.container_path)
            ));
        }
        let p = d.permissions.as_bytes();
        let ok = !p.is_empty()
            && p.iter().all(|b| b"rwm".contains(b))
            && p.iter().collect::<HashSet<_>>().len() == p.len();
        if !ok {
            return Err(format!(
                "device permissions {:?} must combine r, w and m",
                truncate(&d.permissions)
            ));
        }
    }
    for m in &edits.mounts {
        let in_sysfs = granted(&grants.sysfs, &m.host_path);
        let inside =
            granted(&grants.dev, &m.host_path) || in_sysfs || granted(&grants.mounts, &m.host_path);
        if !is_normal_absolute(&m.host_path) || !inside {
            return Err(format!(
                "mount of {:?} is not under the module's grants",
                truncate(&m.host_path)
            ));
        }
        // A sysfs grant is read access: the container must not get to write `remove`, `reset`
        // or `sriov_numvfs` through it.
        if in_sysfs && !m.read_only {
            return Err(format!(
                "mount of {:?} must be read-only: sysfs grants are read-only",
                truncate(&m.host_path)
            ));
        }
        writable_mount(m, grants, &m.host_path)?;
        if !is_normal_absolute(&m.container_path) {
            return Err(format!(
                "mount target {:?} is not absolute and normal",
                truncate(&m.container_path)
            ));
        }
    }
    for (key, value) in &edits.annotations {
        if !is_annotation_key(key) {
            return Err(format!(
                "annotation key {:?} is not a qualified name",
                truncate(key)
            ));
        }
        if value.len() > MAX_VALUE {
            return Err(format!(
                "annotation {key} is {} bytes; at most {MAX_VALUE} allowed",
                value.len()
            ));
        }
    }
    for name in &edits.cdi_devices {
        if !is_cdi_name(name) {
            return Err(format!(
                "CDI device {:?} is not of the form vendor.com/class=name",
                truncate(name)
            ));
        }
    }
    Ok(())
}

/// Device nodes and mount sources as they really are, after symlinks: a device node must
/// resolve beneath the host root's `/dev` to a character or block device that is itself under the
/// module's `/dev` grants (a granted symlink to `/dev/mem` is no grant of `/dev/mem`); a mount
/// source must resolve inside its tree and inside the grants. Each host path is then replaced by
/// the path it resolved to, so the kubelet is handed exactly what was checked, whatever happens
/// to the link afterwards. This touches the file system, so it runs in the module's cell.
pub fn resolve_edits(
    edits: &mut ContainerEdits,
    grants: &Grants,
    root: &Path,
) -> Result<(), Violation> {
    for d in &mut edits.devices {
        // The tree is opened once for both the resolution and the type: this is on Allocate's path.
        let (real, meta) = real_path_and_metadata(root, &d.host_path).map_err(|e| {
            format!(
                "device node {:?} does not resolve inside /dev: {e}",
                truncate(&d.host_path)
            )
        })?;
        if !granted(&grants.dev, &real) {
            return Err(format!(
                "device node {:?} resolves to {:?}, which is not under the module's /dev grants",
                truncate(&d.host_path),
                truncate(&real)
            ));
        }
        let kind = meta.file_type();
        let kind = if kind.is_char_device() {
            NodeKind::Char
        } else if kind.is_block_device() {
            NodeKind::Block
        } else {
            return Err(format!(
                "device node {:?} is not a character or block device",
                truncate(&d.host_path)
            ));
        };
        d.file = Some(NodeFile::new(
            kind,
            meta.rdev(),
            meta.mode(),
            meta.uid(),
            meta.gid(),
        ));
        d.host_path = real;
    }
    for m in &mut edits.mounts {
        let real = real_path(root, &m.host_path).map_err(|e| {
            format!(
                "mount of {:?} does not resolve inside its tree: {e}",
                truncate(&m.host_path)
            )
        })?;
        if !(granted(&grants.dev, &real)
            || granted(&grants.sysfs, &real)
            || granted(&grants.mounts, &real))
        {
            return Err(format!(
                "mount of {:?} resolves to {:?}, which is not under the module's grants",
                truncate(&m.host_path),
                truncate(&real)
            ));
        }
        // What only a `mounts` grant allows must stay clear of the forbidden trees, as the grant
        // itself had to (sysfs and /dev have grants of their own).
        let device_tree = granted(&grants.dev, &real) || granted(&grants.sysfs, &real);
        if let Some(tree) = crate::config::forbidden_by_path(&real)
            .filter(|_| !device_tree)
            .or_else(|| {
                (!device_tree)
                    .then(|| forbidden_as_resolved(root, &real))
                    .flatten()
            })
        {
            return Err(format!(
                "mount of {:?} resolves to {:?}, in or above {tree}, which no module may hand to \
                 a container",
                truncate(&m.host_path),
                truncate(&real)
            ));
        }
        writable_mount(m, grants, &real)?;
        m.host_path = real;
    }
    Ok(())
}

/// The forbidden tree `real` (a resolved logical path) lies in or above once the trees themselves
/// are resolved under `root`: a node whose `/var/lib/kubelet` is a symlink to `/data/kubelet`
/// must not hand out `/data`.
fn forbidden_as_resolved(root: &Path, real: &str) -> Option<&'static str> {
    crate::config::FORBIDDEN_MOUNTS
        .iter()
        .copied()
        .find(|tree| {
            std::fs::canonicalize(root.join(tree.trim_start_matches('/')))
                .ok()
                .and_then(|p| {
                    p.strip_prefix(root)
                        .ok()
                        .and_then(|p| p.to_str())
                        .map(|p| format!("/{p}"))
                })
                .is_some_and(|resolved| {
                    resolved != *tree && crate::config::forbidden_by_path_in(real, &resolved)
                })
        })
}

/// A writable mount reached only through a `mounts` grant must be a granted directory itself: a
/// container writing below it could otherwise swap a subdirectory for a symlink between this
/// check and the runtime's bind mount.
fn writable_mount(m: &crate::device::Mount, grants: &Grants, path: &str) -> Result<(), Violation> {
    let other = granted(&grants.dev, path) || granted(&grants.sysfs, path);
    if m.read_only || other || granted_exactly(&grants.mounts, path) {
        return Ok(());
    }
    Err(format!(
        "writable mount of {:?} must be a directory the mounts grant names, not a path below it",
        truncate(path)
    ))
}

/// Long hostile strings are cut in messages so an error cannot carry the payload.
fn truncate(s: &str) -> String {
    crate::text::cut(s, 64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::{DeviceNode, Health, Mount};

    fn grants() -> Grants {
        Grants {
            sysfs: vec![glob::Pattern::new("/sys/class/net").unwrap()],
            dev: vec![
                glob::Pattern::new("/dev/fuse").unwrap(),
                glob::Pattern::new("/dev/ttyUSB*").unwrap(),
            ],
            mounts: vec![glob::Pattern::new("/run/nvidia/mps").unwrap()],
            libraries: Vec::new(),
        }
    }

    fn device(id: &str) -> Device {
        Device {
            id: id.into(),
            health: Health::Healthy,
            numa_nodes: vec![],
            attributes: vec![],
            ..crate::device::Device::new("", crate::device::Health::Healthy)
        }
    }

    #[test]
    fn ids_the_kubelet_can_use() {
        for good in [
            "fuse-0",
            "GPU-6f5e:1",
            "net-tun",
            "a.b_c",
            "MIG-GPU-6f5e/1/0",
        ] {
            assert!(device_id(good).is_ok(), "{good}");
        }
        for bad in [
            "",
            "bad id",
            "../../etc",
            "/a",
            "a//b",
            "a/./b",
            &"x".repeat(129),
        ] {
            assert!(device_id(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn duplicate_and_too_many_devices_are_refused() {
        assert!(
            devices(&[device("a"), device("a")])
                .unwrap_err()
                .contains("twice")
        );
        let many: Vec<_> = (0..MAX_DEVICES + 1)
            .map(|i| device(&format!("d-{i}")))
            .collect();
        assert!(devices(&many).unwrap_err().contains("at most"));
    }

    #[test]
    fn device_nodes_and_mounts_must_be_granted() {
        let node = |p: &str| ContainerEdits {
            devices: vec![DeviceNode {
                container_path: p.into(),
                host_path: p.into(),
                permissions: "rw".into(),
                file: None,
            }],
            ..Default::default()
        };
        assert!(edits(&node("/dev/fuse"), &grants()).is_ok());
        assert!(edits(&node("/dev/ttyUSB3"), &grants()).is_ok());
        assert!(
            edits(&node("/dev/mem"), &grants())
                .unwrap_err()
                .contains("/dev/mem")
        );
        assert!(edits(&node("/dev/../dev/mem"), &grants()).is_err());
        let mount = |p: &str| ContainerEdits {
            mounts: vec![Mount {
                container_path: "/host".into(),
                host_path: p.into(),
                read_only: false,
            }],
            ..Default::default()
        };
        assert!(edits(&mount("/"), &grants()).unwrap_err().contains("mount"));
        assert!(
            edits(&mount("/sys/class/net"), &grants())
                .unwrap_err()
                .contains("read-only")
        );
        let mut read_only = mount("/sys/class/net");
        read_only.mounts[0].read_only = true;
        assert!(edits(&read_only, &grants()).is_ok());
        // A mount grant may be mounted writable (an MPS pipe directory), and covers what is below.
        assert!(edits(&mount("/run/nvidia/mps"), &grants()).is_ok());
        assert!(edits(&mount("/run/nvidia/mps/pipe"), &grants()).is_err());
        let mut below = mount("/run/nvidia/mps/pipe");
        below.mounts[0].read_only = true;
        assert!(edits(&below, &grants()).is_ok());
        assert!(edits(&mount("/run/nvidia"), &grants()).is_err());
        assert!(edits(&mount("/run/nvidia/mps/../../secrets"), &grants()).is_err());
    }

    #[test]
    fn a_mount_that_resolves_in_or_above_a_forbidden_tree_is_refused() {
        // Grants as no registry would pass them: this is the check behind that one.
        let root = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(root.path().join("var/lib/kubelet/pods")).unwrap();
        std::fs::create_dir_all(root.path().join("var/lib/nvidia")).unwrap();
        std::os::unix::fs::symlink("kubelet", root.path().join("var/lib/link")).unwrap();
        let grants = Grants {
            mounts: vec![glob::Pattern::new("/var/lib/*").unwrap()],
            ..Grants::default()
        };
        let mount = |p: &str| ContainerEdits {
            mounts: vec![Mount {
                container_path: "/host".into(),
                host_path: p.into(),
                read_only: true,
            }],
            ..Default::default()
        };
        for path in ["/var/lib/kubelet", "/var/lib/link", "/var/lib/kubelet/pods"] {
            let e = resolve_edits(&mut mount(path), &grants, root.path()).unwrap_err();
            assert!(e.contains("in or above /var/lib/kubelet"), "{path}: {e}");
        }
        let mut fine = mount("/var/lib/nvidia");
        resolve_edits(&mut fine, &grants, root.path()).unwrap();

        // A kubelet directory that is a symlink elsewhere: what it leads to is forbidden too.
        let other = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(other.path().join("var/lib")).unwrap();
        std::fs::create_dir_all(other.path().join("data/kubelet")).unwrap();
        std::os::unix::fs::symlink("../../data/kubelet", other.path().join("var/lib/kubelet"))
            .unwrap();
        let data = Grants {
            mounts: vec![glob::Pattern::new("/data").unwrap()],
            ..Grants::default()
        };
        let e = resolve_edits(&mut mount("/data"), &data, other.path()).unwrap_err();
        assert!(e.contains("in or above /var/lib/kubelet"), "{e}");

        // sysfs and /dev have grants of their own: a read-only sysfs mount is fine.
        std::fs::create_dir_all(root.path().join("sys/class/net")).unwrap();
        let sysfs = Grants {
            sysfs: vec![glob::Pattern::new("/sys/class/net").unwrap()],
            ..Grants::default()
        };
        resolve_edits(&mut mount("/sys/class/net"), &sysfs, root.path()).unwrap();
    }

    #[test]
    fn names_and_sizes_are_checked() {
        let env = |k: &str, v: &str| ContainerEdits {
            envs: vec![(k.into(), v.into())],
            ..Default::default()
        };
        assert!(edits(&env("NVIDIA_VISIBLE_DEVICES", "GPU-1"), &grants()).is_ok());
        assert!(edits(&env("1BAD", "x"), &grants()).is_err());
        assert!(edits(&env("BAD=NAME", "x"), &grants()).is_err());
        assert!(edits(&env("PCIDEVICE_INTEL_COM_X710-VF", "x"), &grants()).is_ok());
        let twice = ContainerEdits {
            envs: vec![("A".into(), "1".into()), ("A".into(), "2".into())],
            ..ContainerEdits::default()
        };
        let e = edits(&twice, &grants()).unwrap_err();
        assert!(e.contains("env A is set twice"), "{e}");
        assert!(edits(&env("BIG", &"x".repeat(MAX_VALUE + 1)), &grants()).is_err());
        let cdi = |n: &str| ContainerEdits {
            cdi_devices: vec![n.into()],
            ..Default::default()
        };
        assert!(edits(&cdi("nvidia.com/gpu=0"), &grants()).is_ok());
        assert!(edits(&cdi("not-qualified"), &grants()).is_err());
        // Checked by the CDI spec's own grammar (this copy once let a vendor start with a digit).
        assert!(edits(&cdi("1vendor.com/gpu=0"), &grants()).is_err());
        let ann = |k: &str| ContainerEdits {
            annotations: vec![(k.into(), "v".into())],
            ..Default::default()
        };
        assert!(edits(&ann("devicelet.io/holder"), &grants()).is_ok());
        assert!(edits(&ann("not a key!"), &grants()).is_err());
        // Kubernetes' qualified-name rule (this copy once skipped the label-edge check).
        assert!(edits(&ann("-x.io/key"), &grants()).is_err());
    }

    #[test]
    fn preferred_ids_must_come_from_the_offer() {
        let offer = vec!["a".to_string(), "b".to_string()];
        assert!(chosen_ids(&["b".into()], &offer, 1).is_ok());
        assert!(chosen_ids(&["c".into()], &offer, 1).is_err());
        assert!(chosen_ids(&["a".into(), "a".into()], &offer, 2).is_err());
        assert!(chosen_ids(&["a".into(), "b".into()], &offer, 1).is_err());
    }
}
