//! `mig-strategy = "dynamic"`, for Dynamic Resource Allocation: a GPU in MIG mode is published as
//! every placement of every MIG profile, each a device that consumes what it would take of the
//! GPU (one counter per memory slice, so overlapping placements conflict, and its compute
//! slices), so the scheduler chooses among overlapping partitions itself. The instance is made
//! when a claim is prepared and destroyed when it ends (`prepare`/`unprepare`, through the
//! agent's `mig` interface), as NVIDIA's DRA driver does.

use devicelet_sdk::mig::{self, MigLayout};
use devicelet_sdk::nvml::{Gpu, NvmlError};
use devicelet_sdk::{CounterSet, Device};

/// The compute-slice counter of a GPU's counter set.
const COMPUTE: &str = "compute-slices";

/// One placement of one profile on one GPU: a device until a claim makes it an instance.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Partition {
    /// The GPU's NVML index now.
    pub gpu: u32,
    /// The GPU's PCI address as a label (`0000-07-00-0`): what its partitions are named by,
    /// since an index can shift when a GPU drops off the bus, and a claim recorded before a
    /// restart must undo its instance on the same GPU.
    pub bus: String,
    pub profile: String,
    pub start: u32,
    pub size: u32,
    pub compute_slices: u32,
    pub memory_bytes: u64,
}

impl Partition {
    /// A DNS label, as DRA device names must be: `mig-0000-07-00-0-1g-10gb-3`, the profile's
    /// `+` spelled `-plus-` so `1g.10gb+me` and `1g.10gb-me` stay apart.
    pub fn id(&self) -> String {
        let mut profile = String::new();
        for c in self.profile.chars() {
            match c {
                '+' => profile.push_str("-plus-"),
                c if c.is_ascii_alphanumeric() => profile.push(c.to_ascii_lowercase()),
                _ => profile.push('-'),
            }
        }
        format!("mig-{}-{profile}-{}", self.bus, self.start)
    }

    /// The partition as a device of the resource, drawing on its GPU's counter set.
    pub fn device(&self, gpu: &Gpu, device: Device) -> Device {
        let slices: Vec<String> = (self.start..self.start + self.size)
            .map(memory_counter)
            .collect();
        let compute = self.compute_slices.to_string();
        let mut counters: Vec<(&str, &str)> = slices.iter().map(|s| (s.as_str(), "1")).collect();
        counters.push((COMPUTE, &compute));
        device
            .attribute("profile", self.profile.clone())
            .attribute("index", gpu.index.to_string())
            .attribute("parent", gpu.uuid.clone())
            .attribute("memory-mib", (self.memory_bytes >> 20).to_string())
            .attribute("placement-start", self.start.to_string())
            .attribute("placement-size", self.size.to_string())
            .consumes(counter_set(gpu.index), &counters)
    }

    /// What the claim's status says of the instance made for it.
    pub fn status(&self, made: &devicelet_sdk::nvml::MigDevice, gpu: &Gpu) -> String {
        serde_json::json!({
            "uuid": made.uuid,
            "profile": self.profile,
            "parent": gpu.uuid,
            "gpuInstance": made.gpu_instance_id,
            "computeInstance": made.compute_instance_id,
            "placement": {"start": self.start, "size": self.size},
        })
        .to_string()
    }
}

fn memory_counter(slice: u32) -> String {
    format!("memory-slice-{slice}")
}

/// The counter set of GPU `index`: `gpu-0`.
pub fn counter_set(index: u32) -> String {
    format!("gpu-{index}")
}

/// A GPU's PCI address as a label: `0000-07-00-0`.
pub fn bus_label(gpu: &Gpu) -> String {
    crate::short_bus_id(&gpu.pci_bus_id).replace([':', '.'], "-")
}

/// Every placement of every profile of `gpu`, by NVML.
pub fn partitions(gpu: &Gpu) -> Result<(MigLayout, Vec<Partition>), NvmlError> {
    let layout = mig::layout(gpu.index)?;
    let bus = bus_label(gpu);
    let partitions = layout
        .placements
        .iter()
        .map(|p| Partition {
            gpu: gpu.index,
            bus: bus.clone(),
            profile: p.profile.clone(),
            start: p.start,
            size: p.size,
            compute_slices: p.compute_slices,
            memory_bytes: p.memory_bytes,
        })
        .collect();
    Ok((layout, partitions))
}

/// The GPU's budget: each memory slice once, and its compute slices.
pub fn counters(index: u32, layout: &MigLayout) -> CounterSet {
    let slices: Vec<String> = (0..layout.memory_slices).map(memory_counter).collect();
    let compute = layout.compute_slices.to_string();
    let mut counters: Vec<(&str, &str)> = slices.iter().map(|s| (s.as_str(), "1")).collect();
    counters.push((COMPUTE, &compute));
    CounterSet::new(counter_set(index), &counters)
}

/// The GPU bus label an ID names, if it is a partition's: which GPU to ask NVML's layout of.
pub fn bus_of(id: &str) -> Option<&str> {
    let bus = id.strip_prefix("mig-")?.get(..12)?;
    bus.bytes()
        .all(|b| b == b'-' || b.is_ascii_hexdigit())
        .then_some(bus)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partition_ids_are_dns_labels_naming_their_gpu() {
        let p = |profile: &str| Partition {
            gpu: 3,
            bus: "0000-8a-00-0".into(),
            profile: profile.into(),
            start: 6,
            size: 1,
            compute_slices: 1,
            memory_bytes: 0,
        };
        assert_eq!(p("1g.10gb+me").id(), "mig-0000-8a-00-0-1g-10gb-plus-me-6");
        assert_eq!(p("1g.10gb-me").id(), "mig-0000-8a-00-0-1g-10gb-me-6");
        assert_eq!(
            p("1g.10gb+me.all").id(),
            "mig-0000-8a-00-0-1g-10gb-plus-me-all-6"
        );
        assert_eq!(bus_of(&p("1g.10gb").id()), Some("0000-8a-00-0"));
        assert_eq!(bus_of("GPU-6c4a5f2e-0000"), None);
        assert_eq!(bus_of("mig-zzzz-07-00-0-1g-10gb-0"), None);
    }
}
