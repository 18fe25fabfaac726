//! PCI devices from sysfs: the scan GPU, accelerator and NIC modules all start with.
//!
//! Reads `/sys/bus/pci/devices/<address>/` (grant it with `sysfs = ["/sys/bus/pci/devices/*"]`;
//! the grant covers what those links point to): `vendor`, `device`, `class`, `numa_node`, and the
//! DRM nodes a GPU's driver made (`drm/card0`, `drm/renderD128` → `/dev/dri/...`).

use crate::{FsError, sysfs};

/// Where the kernel lists PCI devices.
pub const DEVICES: &str = "/sys/bus/pci/devices";

/// Which PCI devices a scan keeps.
#[derive(Debug, Clone, Default)]
pub struct Filter {
    vendor: Option<u16>,
    classes: Vec<u8>,
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

    fn keeps(&self, vendor: u16, class: u32) -> bool {
        self.vendor.is_none_or(|v| v == vendor)
            && (self.classes.is_empty() || self.classes.contains(&((class >> 16) as u8)))
    }
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
        if filter.keeps(device.vendor, device.class) {
            found.push(device);
        }
    }
    Ok(found)
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
