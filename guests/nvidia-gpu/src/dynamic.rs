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
    pub gpu: u32,
    pub profile: String,
    pub start: u32,
    pub size: u32,
    pub compute_slices: u32,
    pub memory_bytes: u64,
}

impl Partition {
    /// A DNS label, as DRA device names must be: `gpu-0-mig-1g-10gb-3`.
    pub fn id(&self) -> String {
        let profile: String = self
            .profile
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() {
                    c.to_ascii_lowercase()
                } else {
                    '-'
                }
            })
            .collect();
        format!("gpu-{}-mig-{profile}-{}", self.gpu, self.start)
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

/// Every placement of every profile of GPU `index`, by NVML.
pub fn partitions(index: u32) -> Result<(MigLayout, Vec<Partition>), NvmlError> {
    let layout = mig::layout(index)?;
    let partitions = layout
        .placements
        .iter()
        .map(|p| Partition {
            gpu: index,
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

/// The GPU index an ID names, if it is a partition's: what to ask NVML's layout of.
pub fn gpu_of(id: &str) -> Option<u32> {
    let rest = id.strip_prefix("gpu-")?;
    let (index, rest) = rest.split_once('-')?;
    rest.starts_with("mig-").then(|| index.parse().ok())?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partition_ids_are_dns_labels_naming_their_gpu() {
        let p = Partition {
            gpu: 3,
            profile: "1g.10gb+me".into(),
            start: 6,
            size: 1,
            compute_slices: 1,
            memory_bytes: 0,
        };
        assert_eq!(p.id(), "gpu-3-mig-1g-10gb-me-6");
        assert_eq!(gpu_of(&p.id()), Some(3));
        assert_eq!(gpu_of("GPU-6c4a5f2e-0000"), None);
        assert_eq!(gpu_of("gpu-x-mig-1g-10gb-0"), None);
    }
}
