//! NUMA nodes for devices whose module reports none, read from sysfs under the host root.
//!
//! The kubelet's topology manager can only align devices that carry topology, and most simple
//! modules (generic-dev among them) know device nodes, not NUMA nodes. The kernel does: a PCI
//! device's `numa_node`, and a character device's through `/sys/dev/char/<major>:<minor>/device`.
//! So a device with no NUMA node whose attributes name a PCI address (`pci-address`, e.g.
//! `0000:3b:00.0`) or a character device (`dev`, `<major>:<minor>`) gets the node sysfs gives
//! (`-1`, a missing file or anything unreadable: none). A PCI device also gets the PCIe root
//! complex its sysfs link goes through (`../../../devices/pci0000:00/…` → `pci0000:00`), which
//! DRA publishes as `resource.kubernetes.io/pcieRoot`. The attribute values are checked before
//! they become paths, so a module cannot point the host at any other file.

use std::collections::HashMap;
use std::io::Read;
use std::path::Path;
use std::sync::Mutex;

use crate::device::Device;

/// The attribute naming a device's PCI address.
pub const PCI_ADDRESS: &str = "pci-address";
/// The attribute naming a device's character device node, as `<major>:<minor>`.
pub const CHAR_DEV: &str = "dev";

/// Most sysfs answers remembered per module; a NUMA node never changes while the machine runs.
const MAX_REMEMBERED: usize = 16_384;

/// The nodes sysfs gave, by file, so each is read once.
#[derive(Debug, Default)]
pub struct TopologyCache {
    known: Mutex<HashMap<String, Option<i64>>>,
    /// PCIe roots by PCI address, once found.
    roots: Mutex<HashMap<String, String>>,
}

impl TopologyCache {
    /// Gives every device without NUMA nodes the node sysfs names for it, if any.
    pub fn fill(&self, devices: &mut [Device], host_root: &Path) {
        for device in devices.iter_mut() {
            device.pcie_root = pci_address(device).and_then(|a| self.root(&a, host_root));
        }
        for device in devices.iter_mut().filter(|d| d.numa_nodes.is_empty()) {
            let Some(file) = sysfs_file(device) else {
                continue;
            };
            let node = self.node(&file, host_root);
            device.numa_nodes.extend(node);
        }
    }

    /// The PCIe root complex of the PCI device at `address`, from its sysfs link.
    fn root(&self, address: &str, host_root: &Path) -> Option<String> {
        let roots = || {
            self.roots
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
        };
        if let Some(root) = roots().get(address) {
            return Some(root.clone());
        }
        let link = host_root.join("sys/bus/pci/devices").join(address);
        let root = pcie_root_of(&std::fs::read_link(link).ok()?)?;
        let mut known = roots();
        if known.len() < MAX_REMEMBERED {
            known.insert(address.to_owned(), root.clone());
        }
        Some(root)
    }

    fn known(&self) -> std::sync::MutexGuard<'_, HashMap<String, Option<i64>>> {
        self.known
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn node(&self, file: &str, host_root: &Path) -> Option<i64> {
        if let Some(node) = self.known().get(file) {
            return *node;
        }
        // Read without the lock: a slow file delays only the device that names it.
        let read = read_node(&host_root.join(file.trim_start_matches('/')));
        // A missing file may appear later (a driver still binding): only answers are kept,
        // `-1` among them.
        let mut known = self.known();
        if let Some(node) = read
            && known.len() < MAX_REMEMBERED
        {
            known.insert(file.to_owned(), node);
        }
        read.flatten()
    }
}

/// The root complex a PCI device's sysfs link goes through: the `pci<domain>:<bus>` directory
/// under `devices/` (`../../../devices/pci0000:00/0000:00:01.0/0000:03:00.0` → `pci0000:00`).
fn pcie_root_of(link: &Path) -> Option<String> {
    let text = link.to_str()?;
    let rest = &text[text.find("devices/")? + "devices/".len()..];
    let root = rest.split('/').next()?;
    let (domain, bus) = root.strip_prefix("pci")?.split_once(':')?;
    let hex = |s: &str, len: std::ops::RangeInclusive<usize>| {
        len.contains(&s.len()) && s.bytes().all(|b| b.is_ascii_hexdigit())
    };
    (hex(domain, 4..=8) && hex(bus, 2..=2)).then(|| root.to_owned())
}

/// A device's well-formed `pci-address`.
fn pci_address(device: &Device) -> Option<String> {
    device
        .attributes
        .iter()
        .find(|(k, _)| k == PCI_ADDRESS)
        .and_then(|(_, v)| match v {
            crate::device::AttributeValue::Text(t) if is_pci_address(t) => Some(t.clone()),
            _ => None,
        })
}

/// The sysfs `numa_node` file a device's attributes point at, when they are well formed.
fn sysfs_file(device: &Device) -> Option<String> {
    let attribute = |key: &str| {
        device
            .attributes
            .iter()
            .find(|(k, _)| k == key)
            .and_then(|(_, v)| match v {
                crate::device::AttributeValue::Text(t) => Some(t.as_str()),
                _ => None,
            })
    };
    if let Some(address) = attribute(PCI_ADDRESS).filter(|a| is_pci_address(a)) {
        return Some(format!("/sys/bus/pci/devices/{address}/numa_node"));
    }
    let dev = attribute(CHAR_DEV)?;
    let (major, minor) = dev.split_once(':')?;
    let number = |s: &str| !s.is_empty() && s.len() <= 10 && s.bytes().all(|b| b.is_ascii_digit());
    (number(major) && number(minor))
        .then(|| format!("/sys/dev/char/{major}:{minor}/device/numa_node"))
}

/// `dddd:bb:dd.f` in hex: a domain of 4 to 8 digits (VMD domains have 5), bus, device,
/// function.
pub(crate) fn is_pci_address(a: &str) -> bool {
    let hex = |s: &str, len: std::ops::RangeInclusive<usize>| {
        len.contains(&s.len()) && s.bytes().all(|b| b.is_ascii_hexdigit())
    };
    let mut parts = a.split(':');
    let (Some(domain), Some(bus), Some(slot), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return false;
    };
    let Some((device, function)) = slot.split_once('.') else {
        return false;
    };
    hex(domain, 4..=8)
        && hex(bus, 2..=2)
        && hex(device, 2..=2)
        && function.len() == 1
        && (b'0'..=b'7').contains(&function.as_bytes()[0])
}

/// What a `numa_node` file says: None when it cannot be read (missing, not a file);
/// Some(None) for `-1` or anything but a node number.
fn read_node(path: &Path) -> Option<Option<i64>> {
    let file = std::fs::File::open(path).ok()?;
    if !file.metadata().ok()?.is_file() {
        return None;
    }
    let mut text = String::new();
    file.take(32).read_to_string(&mut text).ok()?;
    Some(text.trim().parse::<i64>().ok().filter(|n| *n >= 0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::Health;

    fn device(attributes: &[(&str, &str)], numa: &[i64]) -> Device {
        Device {
            id: "d".into(),
            health: Health::Healthy,
            numa_nodes: numa.to_vec(),
            attributes: attributes
                .iter()
                .map(|(k, v)| (k.to_string(), (*v).into()))
                .collect(),
            ..crate::device::Device::new("", crate::device::Health::Healthy)
        }
    }

    fn write(root: &Path, file: &str, text: &str) {
        let path = root.join(file);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    }

    #[test]
    fn devices_get_the_node_sysfs_gives_their_pci_address_or_device_node() {
        let root = tempfile::tempdir().unwrap();
        write(
            root.path(),
            "sys/bus/pci/devices/0000:3b:00.0/numa_node",
            "1\n",
        );
        write(root.path(), "sys/dev/char/10:229/device/numa_node", "0\n");
        write(root.path(), "sys/dev/char/10:200/device/numa_node", "-1\n");
        write(
            root.path(),
            "sys/bus/pci/devices/10000:01:00.0/numa_node",
            "0\n",
        );
        let mut devices = vec![
            device(&[(PCI_ADDRESS, "0000:3b:00.0")], &[]),
            device(&[(CHAR_DEV, "10:229")], &[]),
            device(&[(CHAR_DEV, "10:200")], &[]),
            device(&[(CHAR_DEV, "10:229")], &[3]),
            device(&[(PCI_ADDRESS, "0000:3b:00.0/../../..")], &[]),
            device(&[(PCI_ADDRESS, "10000:01:00.0")], &[]),
            device(&[(CHAR_DEV, "../10:229")], &[]),
            device(&[], &[]),
        ];
        TopologyCache::default().fill(&mut devices, root.path());
        let nodes: Vec<Vec<i64>> = devices.into_iter().map(|d| d.numa_nodes).collect();
        assert_eq!(
            nodes,
            [
                vec![1],
                vec![0],
                vec![],
                vec![3],
                vec![],
                vec![0],
                vec![],
                vec![]
            ],
            "-1 is none; a module's own node wins; malformed attributes are no paths"
        );
    }

    #[test]
    fn a_node_is_read_once_and_a_missing_file_again() {
        let root = tempfile::tempdir().unwrap();
        write(root.path(), "sys/dev/char/1:2/device/numa_node", "1");
        let cache = TopologyCache::default();
        let mut devices = vec![device(&[(CHAR_DEV, "1:2")], &[])];
        cache.fill(&mut devices, root.path());
        write(root.path(), "sys/dev/char/1:2/device/numa_node", "0");
        let mut again = vec![device(&[(CHAR_DEV, "1:2")], &[])];
        cache.fill(&mut again, root.path());
        assert_eq!(again[0].numa_nodes, [1]);

        let mut late = vec![device(&[(CHAR_DEV, "3:4")], &[])];
        cache.fill(&mut late, root.path());
        assert!(late[0].numa_nodes.is_empty());
        write(root.path(), "sys/dev/char/3:4/device/numa_node", "0");
        cache.fill(&mut late, root.path());
        assert_eq!(late[0].numa_nodes, [0], "a driver bound since");
    }

    #[test]
    fn a_pci_device_gets_the_pcie_root_its_sysfs_link_goes_through() {
        let root = tempfile::tempdir().unwrap();
        let devices_dir = root.path().join("sys/bus/pci/devices");
        std::fs::create_dir_all(&devices_dir).unwrap();
        let link = |address: &str, target: &str| {
            std::os::unix::fs::symlink(target, devices_dir.join(address)).unwrap();
        };
        link(
            "0000:03:00.0",
            "../../../devices/pci0000:00/0000:00:01.0/0000:03:00.0",
        );
        link(
            "10000:e1:00.0",
            "../../../devices/pci10000:e0/10000:e0:01.0/10000:e1:00.0",
        );
        link("0000:04:00.0", "../../../devices/platform/odd/0000:04:00.0");
        let mut devices = vec![
            device(&[(PCI_ADDRESS, "0000:03:00.0")], &[0]),
            device(&[(PCI_ADDRESS, "10000:e1:00.0")], &[]),
            device(&[(PCI_ADDRESS, "0000:04:00.0")], &[]),
            device(&[(PCI_ADDRESS, "0000:05:00.0")], &[]),
            device(&[(CHAR_DEV, "10:229")], &[]),
        ];
        TopologyCache::default().fill(&mut devices, root.path());
        let roots: Vec<Option<&str>> = devices.iter().map(|d| d.pcie_root.as_deref()).collect();
        assert_eq!(
            roots,
            [Some("pci0000:00"), Some("pci10000:e0"), None, None, None],
            "a VMD domain's root too; none without a root complex or a link"
        );
    }
}
