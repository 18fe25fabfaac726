//! The node a test describes: the GPUs the fake reports, read from the JSON file named by
//! `DEVICELET_FAKE_NVML` whenever the library goes from uninitialised to initialised.

use std::path::Path;

use serde::Deserialize;

/// More MIG devices than an A100/H100 can be partitioned into; also what
/// `nvmlDeviceGetMaxMigDeviceCount` reports.
pub const MAX_MIG_DEVICES: usize = 7;
/// Keeps every encoded device handle below the event-set handle range (see `state.rs`).
pub const MAX_GPUS: usize = 64;
/// `NVML_NVLINK_MAX_LINKS`.
pub const MAX_NVLINKS: usize = 18;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct Fixture {
    pub driver_version: String,
    /// How `nvmlInit` behaves on this node.
    #[serde(default)]
    pub init: InitMode,
    /// How long a successful `nvmlInit` takes, as with a driver still settling.
    #[serde(default)]
    pub init_delay_ms: u64,
    #[serde(default)]
    pub gpus: Vec<Gpu>,
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum InitMode {
    #[default]
    Ok,
    DriverNotLoaded,
    NoPermission,
    /// `nvmlInit` never returns, as with a half-initialised driver.
    Hang,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct Gpu {
    pub uuid: String,
    pub name: String,
    pub minor: u32,
    /// `dddddddd:bb:dd.f`, as NVML writes `busId`.
    pub pci_bus_id: String,
    pub memory_mib: u64,
    /// Absent: the platform reports no NUMA affinity (`NOT_SUPPORTED`).
    pub numa_node: Option<u32>,
    /// CPU indexes in the GPU's affinity mask.
    #[serde(default)]
    pub cpus: Vec<u32>,
    /// GPUs on one board (a dual-GPU card) are `NVML_TOPOLOGY_INTERNAL` to each other.
    pub board: Option<String>,
    /// GPUs behind one PCIe switch are `NVML_TOPOLOGY_SINGLE` to each other.
    pub switch: Option<String>,
    /// Remote PCI bus id of each active NVLink; link `i` is `nvlinks[i]`.
    #[serde(default)]
    pub nvlinks: Vec<String>,
    /// Absent: the GPU does not support MIG.
    pub mig: Option<Mig>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct Mig {
    pub enabled: bool,
    #[serde(default)]
    pub devices: Vec<MigDevice>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct MigDevice {
    pub uuid: String,
    pub gi: u32,
    pub ci: u32,
    pub gi_slices: u32,
    pub ci_slices: u32,
    pub memory_mib: u64,
}

impl Fixture {
    /// The fixture at `path`, or `None` when it is missing or not one: the caller reports a
    /// node without a driver, silently, as real NVML does.
    pub fn load(path: &Path) -> Option<Fixture> {
        let text = std::fs::read(path).ok()?;
        let fixture: Fixture = serde_json::from_slice(&text).ok()?;
        fixture.fits().then_some(fixture)
    }

    /// Whether every GPU fits the handle encoding and NVML's own limits.
    fn fits(&self) -> bool {
        self.gpus.len() <= MAX_GPUS
            && self.gpus.iter().all(|g| {
                g.nvlinks.len() <= MAX_NVLINKS
                    && g.mig
                        .as_ref()
                        .is_none_or(|m| m.devices.len() <= MAX_MIG_DEVICES)
            })
    }
}

impl Gpu {
    /// The MIG devices NVML exposes: none unless MIG mode is enabled.
    pub fn mig_devices(&self) -> &[MigDevice] {
        match &self.mig {
            Some(mig) if mig.enabled => &mig.devices,
            _ => &[],
        }
    }
}

/// The parts of a PCI bus id NVML reports as numbers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BusId {
    pub domain: u32,
    pub bus: u32,
    pub device: u32,
}

/// Parses `dddddddd:bb:dd.f` (any hex widths); `None` when it is not one.
pub fn parse_bus_id(id: &str) -> Option<BusId> {
    let hex = |s: &str| {
        (!s.is_empty() && s.len() <= 8)
            .then(|| u32::from_str_radix(s, 16).ok())
            .flatten()
    };
    let (domain, rest) = id.split_once(':')?;
    let (bus, rest) = rest.split_once(':')?;
    let (device, function) = rest.split_once('.')?;
    hex(function)?;
    Some(BusId {
        domain: hex(domain)?,
        bus: hex(bus)?,
        device: hex(device)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bus_ids() {
        assert_eq!(
            parse_bus_id("00000000:07:00.0"),
            Some(BusId {
                domain: 0,
                bus: 7,
                device: 0
            })
        );
        assert_eq!(
            parse_bus_id("0001:8a:1f.3").map(|b| (b.domain, b.bus, b.device)),
            Some((1, 0x8a, 0x1f))
        );
        for bad in ["", "07:00.0", "0000:07:00", "0000:zz:00.0", "0000::00.0"] {
            assert_eq!(parse_bus_id(bad), None, "{bad:?}");
        }
    }
}
