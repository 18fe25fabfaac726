//! The node a test describes: the GPUs the fake reports, read from the JSON file named by
//! `DEVICELET_FAKE_NVML` whenever the library goes from uninitialised to initialised.

use std::path::Path;

use serde::{Deserialize, Serialize};

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
    /// The instances the GPU has when the fake first starts (see `mig.rs` for how created ones
    /// outlive the process).
    #[serde(default)]
    pub devices: Vec<MigDevice>,
    /// The GPU instance profiles NVML offers (an H100's `1g.10gb` ... `7g.80gb`); without any,
    /// creating instances is not supported.
    #[serde(default)]
    pub profiles: Vec<Profile>,
}

/// One GPU instance profile, as `nvmlDeviceGetGpuInstanceProfileInfo` and
/// `nvmlDeviceGetGpuInstancePossiblePlacements_v2` report it.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct Profile {
    /// `NVML_GPU_INSTANCE_PROFILE_*`, what it is asked for by (0: one slice, 1: two, 2: three,
    /// 3: four, 4: seven, 9: one slice with two memory slices, ...).
    pub index: u32,
    /// The ID NVML answers for it and takes everywhere else (`nvidia-smi mig -lgip`'s: 19 for
    /// an H100's `1g.10gb`).
    pub id: u32,
    /// Compute slices (`sliceCount`).
    pub slices: u32,
    pub memory_mib: u64,
    /// Memory slices each placement takes.
    pub size: u32,
    /// The memory slices its placements start at.
    pub starts: Vec<u32>,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct MigDevice {
    pub uuid: String,
    pub gi: u32,
    pub ci: u32,
    pub gi_slices: u32,
    pub ci_slices: u32,
    pub memory_mib: u64,
    /// The GPU instance's profile and placement, for instances made through the API (and
    /// fixture ones that say): only these count when placements are checked for overlap.
    #[serde(default)]
    pub profile: Option<u32>,
    #[serde(default)]
    pub start: Option<u32>,
    /// A GPU instance whose compute instance is not made yet (or was destroyed): no MIG device.
    #[serde(default)]
    pub bare: bool,
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
    /// Whether MIG mode is enabled now.
    pub fn mig_enabled(&self) -> bool {
        self.mig.as_ref().is_some_and(|m| m.enabled)
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
