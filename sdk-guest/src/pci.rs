//! PCI devices from sysfs: the scan GPU, accelerator and NIC modules all start with.
//!
//! Reads `/sys/bus/pci/devices/<address>/` (grant it with `sysfs = ["/sys/bus/pci/devices/*"]`;
//! the grant covers what those links point to): `vendor`, `device`, `class`, `numa_node`, the
//! DRM nodes a GPU's driver made (`drm/card0`, `drm/renderD128` → `/dev/dri/...`), and what
//! passthrough modules need: the bound driver, the IOMMU group, and SR-IOV's `physfn`/`virtfn`
//! links. [`bound_to`] lists a driver's devices from `/sys/bus/pci/drivers/<driver>/` (grant
//! `/sys/bus/pci/drivers/*` for it).

use crate::{Device, FsError, Health, sysfs};

/// Where the kernel lists PCI devices.
pub const DEVICES: &str = "/sys/bus/pci/devices";
/// Where the kernel lists PCI drivers, each with links to the devices bound to it.
pub const DRIVERS: &str = "/sys/bus/pci/drivers";

/// Which PCI devices a scan keeps.
#[derive(Debug, Clone, Default)]
pub struct Filter {
    vendor: Option<u16>,
    classes: Vec<u8>,
    ids: Vec<(u16, u16)>,
    drivers: Vec<String>,
}

impl Filter {
    /// Every PCI device.
    pub fn any() -> Filter {
        Filter::default()
    }

    /// Only this vendor (`0x1002` AMD, `0x10de` NVIDIA, `0x8086` Intel).
    pub fn vendor(mut self, vendor: u16) -> Filter {
        self.vendor = Some(vendor);
        self
    }

    /// Only these base classes, the class code's top byte (`0x03` display controllers, `0x12`
    /// processing accelerators, `0x02` network controllers); several calls add classes.
    pub fn class(mut self, base: u8) -> Filter {
        self.classes.push(base);
        self
    }

    /// Only these vendor:device pairs (`0x8086, 0x154c`: an Intel X710 VF); several calls add
    /// pairs.
    pub fn id(mut self, vendor: u16, device: u16) -> Filter {
        self.ids.push((vendor, device));
        self
    }

    /// Only devices bound to this driver (`vfio-pci`); several calls add drivers. A device with
    /// no driver is kept by no driver filter.
    pub fn driver(mut self, name: &str) -> Filter {
        self.drivers.push(name.to_owned());
        self
    }

    fn keeps(&self, device: &PciDevice) -> bool {
        self.vendor.is_none_or(|v| v == device.vendor)
            && (self.classes.is_empty() || self.classes.contains(&((device.class >> 16) as u8)))
            && (self.ids.is_empty() || self.ids.contains(&(device.vendor, device.device)))
            && (self.drivers.is_empty()
                || device.driver().is_some_and(|d| self.drivers.contains(&d)))
    }
}

/// The last component of a sysfs link's target (`../../../bus/pci/drivers/vfio-pci`:
/// `vfio-pci`).
fn link_name(path: &str) -> Option<String> {
    let target = sysfs::read_link(path).ok()?;
    target
        .trim_end_matches('/')
        .rsplit('/')
        .next()
        .filter(|name| !name.is_empty())
        .map(str::to_owned)
}

/// One PCI device as sysfs shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PciDevice {
    /// `0000:03:00.0`: stable across reboots for a slot, which makes it a good device ID.
    pub address: String,
    /// The vendor ID (`0x1002`).
    pub vendor: u16,
    /// The vendor's device ID (`0x740f`: MI210).
    pub device: u16,
    /// The 24-bit class code (`0x030000` VGA, `0x038000` display controller).
    pub class: u32,
    /// The NUMA node, or None where sysfs says `-1` (no affinity) or has no `numa_node`.
    pub numa_node: Option<i64>,
}

impl PciDevice {
    /// The device's directory in sysfs.
    pub fn path(&self) -> String {
        format!("{DEVICES}/{}", self.address)
    }

    /// One of its attributes as text, trimmed (`current_compute_partition`, `mem_info_vram_total`).
    pub fn attribute(&self, name: &str) -> Result<String, FsError> {
        sysfs::read_to_string(&format!("{}/{name}", self.path()))
    }

    /// The devicelet device for it, with `health`: its ID the PCI address, its NUMA node, and
    /// the attributes every PCI module publishes (`pci-address`, which the agent also reads
    /// for topology, and `device-id` as `0x740f`). Add your own with [`Device::attribute`] or
    /// [`PciDevice::attributes_onto`].
    pub fn device(&self, health: Health) -> Device {
        let mut device = Device::new(self.address.clone(), health)
            .attribute("pci-address", self.address.clone())
            .attribute("device-id", format!("{:#06x}", self.device));
        if let Some(node) = self.numa_node {
            device = device.numa_node(node);
        }
        device
    }

    /// `device` with each of these sysfs attributes the PCI device has, as text attributes
    /// named with `-` for `_` (`current_compute_partition` → `current-compute-partition`); one
    /// the device lacks is left out.
    pub fn attributes_onto(&self, mut device: Device, names: &[&str]) -> Device {
        for name in names {
            if let Ok(value) = self.attribute(name) {
                device = device.attribute(name.replace('_', "-"), value);
            }
        }
        device
    }

    /// Whether the device is still there (a GPU that fell off the bus is not).
    pub fn present(&self) -> bool {
        sysfs::read(&format!("{}/vendor", self.path())).is_ok()
    }

    /// The device nodes its driver made in one class: the entries of `<device>/<class>/` in
    /// sysfs, as paths under `dev_dir`. `nodes("accel", "/dev/accel")` gives
    /// `["/dev/accel/accel0"]` for a compute accelerator; sorted, empty when there are none.
    pub fn nodes(&self, class: &str, dev_dir: &str) -> Vec<String> {
        sysfs::list(&format!("{}/{class}", self.path()))
            .unwrap_or_default()
            .into_iter()
            .map(|name| format!("{dev_dir}/{name}"))
            .collect()
    }

    /// The DRM nodes its driver made, as `/dev/dri/...` paths (`card0`, `renderD128`), sorted;
    /// empty when it has none (no driver bound, or not a GPU).
    pub fn drm_nodes(&self) -> Vec<String> {
        self.nodes("drm", "/dev/dri")
            .into_iter()
            .filter(|n| n.starts_with("/dev/dri/card") || n.starts_with("/dev/dri/renderD"))
            .collect()
    }

    /// The driver bound to it (`vfio-pci`, `amdgpu`), from its `driver` link; None when unbound.
    pub fn driver(&self) -> Option<String> {
        link_name(&format!("{}/driver", self.path()))
    }

    /// Its IOMMU group, from its `iommu_group` link: devices in one group can only be handed to
    /// a container (or VM) together, as `/dev/vfio/<group>`. None without an IOMMU.
    pub fn iommu_group(&self) -> Option<u32> {
        link_name(&format!("{}/iommu_group", self.path()))?
            .parse()
            .ok()
    }

    /// For an SR-IOV virtual function: its physical function's address, from `physfn`.
    pub fn physfn(&self) -> Option<String> {
        link_name(&format!("{}/physfn", self.path()))
    }

    /// Whether it is an SR-IOV virtual function.
    pub fn is_virtual_function(&self) -> bool {
        self.physfn().is_some()
    }

    /// For an SR-IOV physical function: its virtual functions' addresses, in `virtfn<N>` order;
    /// empty when it has none.
    pub fn virtfns(&self) -> Vec<String> {
        let mut numbered: Vec<(u32, String)> = sysfs::list(&self.path())
            .unwrap_or_default()
            .into_iter()
            .filter_map(|name| {
                let n = name.strip_prefix("virtfn")?.parse().ok()?;
                Some((n, link_name(&format!("{}/{name}", self.path()))?))
            })
            .collect();
        numbered.sort();
        numbered.into_iter().map(|(_, address)| address).collect()
    }

    /// Its render node (`/dev/dri/renderD128`), what compute work opens.
    pub fn render_node(&self) -> Option<String> {
        self.drm_nodes()
            .into_iter()
            .find(|n| n.starts_with("/dev/dri/renderD"))
    }
}

/// The PCI devices the filter keeps, by address. A device whose attributes cannot be read
/// (gone mid-scan) is skipped.
pub fn scan(filter: &Filter) -> Result<Vec<PciDevice>, FsError> {
    let mut found = Vec::new();
    for address in sysfs::list(DEVICES)? {
        let Ok(device) = read(&address) else { continue };
        if filter.keeps(&device) {
            found.push(device);
        }
    }
    Ok(found)
}

/// The addresses of the devices bound to `driver` (the PCI-address entries of
/// `/sys/bus/pci/drivers/<driver>/`), sorted; empty when the driver is not loaded. Needs
/// `sysfs = ["/sys/bus/pci/drivers/*"]`.
pub fn bound_to(driver: &str) -> Vec<String> {
    let mut addresses: Vec<String> = sysfs::list(&format!("{DRIVERS}/{driver}"))
        .unwrap_or_default()
        .into_iter()
        .filter(|name| is_address(name))
        .collect();
    addresses.sort();
    addresses
}

/// `dddd:bb:dd.f`, hexadecimal.
fn is_address(name: &str) -> bool {
    let hex = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_hexdigit());
    let mut parts = name.split([':', '.']);
    matches!(
        (parts.next(), parts.next(), parts.next(), parts.next(), parts.next()),
        (Some(d), Some(b), Some(s), Some(f), None)
            if hex(d, 4) && hex(b, 2) && hex(s, 2) && f.len() == 1 && f.bytes().all(|c| (b'0'..=b'7').contains(&c))
    )
}

/// The PCI device at `address` (`0000:03:00.0`).
pub fn read(address: &str) -> Result<PciDevice, FsError> {
    let at = format!("{DEVICES}/{address}");
    let number = |name: &str| sysfs::read_i64(&format!("{at}/{name}"));
    let numa_node = match number("numa_node") {
        Ok(n) if n >= 0 => Some(n),
        Ok(_) | Err(FsError::NotFound) => None,
        Err(e) => return Err(e),
    };
    Ok(PciDevice {
        address: address.to_owned(),
        vendor: u16::try_from(number("vendor")?).map_err(|_| bad(&at, "vendor"))?,
        device: u16::try_from(number("device")?).map_err(|_| bad(&at, "device"))?,
        class: u32::try_from(number("class")?).map_err(|_| bad(&at, "class"))?,
        numa_node,
    })
}

fn bad(at: &str, what: &str) -> FsError {
    FsError::Io(format!("{at}/{what} is out of range"))
}

#[cfg(all(test, not(target_arch = "wasm32")))]
mod tests {
    use super::*;
    use crate::testing::{FakeHost, with_host};
    use std::rc::Rc;

    /// A NIC's physical function with two VFs bound to vfio-pci, in IOMMU groups 40 and 41, a
    /// decoy on another driver, and one unbound device: links relative, as sysfs makes them.
    fn sriov_node() -> Rc<FakeHost> {
        let mut host = FakeHost::new()
            .grant_sysfs("/sys/bus/pci/devices/*")
            .grant_sysfs("/sys/bus/pci/drivers/*");
        let devices = [
            ("0000:3b:00.0", "0x1572", "ice", None),
            ("0000:3b:02.0", "0x154c", "vfio-pci", Some(40)),
            ("0000:3b:02.1", "0x154c", "vfio-pci", Some(41)),
            ("0000:3b:02.2", "0x154c", "iavf", Some(42)),
            ("0000:5e:00.0", "0x154c", "", None),
        ];
        for (address, device, driver, group) in devices {
            let real = format!("/sys/devices/pci0000:3a/{address}");
            host = host
                .symlink(
                    &format!("{DEVICES}/{address}"),
                    &format!("../../../devices/pci0000:3a/{address}"),
                )
                .file(&format!("{real}/vendor"), "0x8086\n")
                .file(&format!("{real}/device"), format!("{device}\n"))
                .file(&format!("{real}/class"), "0x020000\n")
                .file(&format!("{real}/numa_node"), "0\n");
            if !driver.is_empty() {
                host = host
                    .symlink(
                        &format!("{real}/driver"),
                        &format!("../../../bus/pci/drivers/{driver}"),
                    )
                    .symlink(
                        &format!("{DRIVERS}/{driver}/{address}"),
                        &format!("../../../../devices/pci0000:3a/{address}"),
                    );
            }
            if let Some(group) = group {
                host = host.symlink(
                    &format!("{real}/iommu_group"),
                    &format!("../../../kernel/iommu_groups/{group}"),
                );
            }
        }
        let pf = "/sys/devices/pci0000:3a/0000:3b:00.0";
        for (n, vf) in ["0000:3b:02.0", "0000:3b:02.1", "0000:3b:02.2"]
            .iter()
            .enumerate()
        {
            host = host
                .symlink(&format!("{pf}/virtfn{n}"), &format!("../{vf}"))
                .symlink(
                    &format!("/sys/devices/pci0000:3a/{vf}/physfn"),
                    "../0000:3b:00.0",
                );
        }
        host = host.file(&format!("{DRIVERS}/vfio-pci/new_id"), "");
        Rc::new(host)
    }

    #[test]
    fn passthrough_scans_filter_by_id_and_driver_and_read_groups_and_sriov_links() {
        with_host(&sriov_node(), || {
            let vfs: Vec<String> = scan(&Filter::any().id(0x8086, 0x154c).driver("vfio-pci"))
                .unwrap()
                .into_iter()
                .map(|d| d.address)
                .collect();
            assert_eq!(vfs, ["0000:3b:02.0", "0000:3b:02.1"]);
            let vf = read("0000:3b:02.1").unwrap();
            assert_eq!(vf.driver().as_deref(), Some("vfio-pci"));
            assert_eq!(vf.iommu_group(), Some(41));
            assert!(vf.is_virtual_function());
            assert_eq!(vf.physfn().as_deref(), Some("0000:3b:00.0"));
            let pf = read("0000:3b:00.0").unwrap();
            assert!(!pf.is_virtual_function());
            assert_eq!(
                pf.virtfns(),
                ["0000:3b:02.0", "0000:3b:02.1", "0000:3b:02.2"]
            );
            let unbound = read("0000:5e:00.0").unwrap();
            assert_eq!(unbound.driver(), None);
            assert_eq!(unbound.iommu_group(), None);
            assert_eq!(bound_to("vfio-pci"), ["0000:3b:02.0", "0000:3b:02.1"]);
            assert!(bound_to("nvme").is_empty());
        });
    }

    #[test]
    fn pci_addresses_are_told_from_other_entries() {
        assert!(is_address("0000:3b:02.1"));
        for not in [
            "new_id",
            "bind",
            "module",
            "0000:3b:02",
            "0000:3b:02.8",
            "000:3b:02.1",
        ] {
            assert!(!is_address(not), "{not}");
        }
    }
}
