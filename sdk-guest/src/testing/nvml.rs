//! A fake NVML for module tests: GPUs, MIG devices and links as the test describes them, and
//! events and lost GPUs injected between calls, answering as the agent's `nvml` interface does.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

use crate::nvml::{
    Event, EventBatch, EventKind, Gpu, Link, MigDevice, MigInstance, NvmlError, TopologyLevel,
};

/// What [`super::FakeHost::grant_nvml`] serves. GPUs get indexes in the order they are added.
#[derive(Debug, Clone, Default)]
pub struct FakeNvml {
    gpus: Vec<Gpu>,
    mig: BTreeMap<u32, Vec<MigDevice>>,
    links: BTreeMap<(u32, u32), Link>,
    events: Vec<(Event, Instant)>,
    /// The MIG instance of events raised in one, by sequence number.
    instances: BTreeMap<u64, MigInstance>,
    lost: BTreeSet<u32>,
}

impl FakeNvml {
    /// NVML with no GPUs.
    pub fn new() -> FakeNvml {
        FakeNvml::default()
    }

    /// Adds a GPU; its `index` is set to its position.
    pub fn with_gpu(mut self, mut gpu: Gpu) -> FakeNvml {
        gpu.index = self.gpus.len() as u32;
        self.gpus.push(gpu);
        self
    }

    /// Makes every query on the GPU with this index fail with `GpuLost` from the start, as a
    /// GPU that fell off the bus before the module started (see
    /// [`super::FakeHost::set_gpu_lost`] for one lost later).
    pub fn with_lost_gpu(mut self, index: u32) -> FakeNvml {
        self.set_lost(index, true);
        self
    }

    /// Adds a MIG device to the GPU with index `gpu` (which should have `mig_enabled`).
    pub fn with_mig_device(mut self, gpu: u32, device: MigDevice) -> FakeNvml {
        self.mig.entry(gpu).or_default().push(device);
        self
    }

    /// Says how GPUs `a` and `b` are connected, both ways. Pairs not described are connected
    /// across NUMA nodes (`System`) without NVLink.
    pub fn with_link(mut self, a: u32, b: u32, link: Link) -> FakeNvml {
        self.links.insert((a, b), link);
        self.links.insert((b, a), link);
        self
    }

    pub(crate) fn device_count(&self) -> Result<u32, NvmlError> {
        Ok(self.gpus.len() as u32)
    }

    fn check(&self, index: u32) -> Result<&Gpu, NvmlError> {
        let gpu = self.gpus.get(index as usize).ok_or(NvmlError::NotFound)?;
        if self.lost.contains(&index) {
            return Err(NvmlError::GpuLost);
        }
        Ok(gpu)
    }

    pub(crate) fn device(&self, index: u32) -> Result<Gpu, NvmlError> {
        self.check(index).cloned()
    }

    pub(crate) fn mig_devices(&self, index: u32) -> Result<Vec<MigDevice>, NvmlError> {
        if !self.check(index)?.mig_enabled {
            return Ok(Vec::new());
        }
        Ok(self.mig.get(&index).cloned().unwrap_or_default())
    }

    pub(crate) fn topology(&self, a: u32, b: u32) -> Result<Link, NvmlError> {
        self.check(a)?;
        self.check(b)?;
        if a == b {
            return Ok(Link {
                level: TopologyLevel::Internal,
                nvlinks: 0,
            });
        }
        Ok(self.links.get(&(a, b)).copied().unwrap_or(Link {
            level: TopologyLevel::System,
            nvlinks: 0,
        }))
    }

    pub(crate) fn events(&self, after: u64) -> EventBatch {
        let now = Instant::now();
        EventBatch {
            events: self
                .events
                .iter()
                .filter(|(e, _)| e.seq > after)
                .map(|(e, at)| Event {
                    age_ms: now.duration_since(*at).as_millis() as u64,
                    ..e.clone()
                })
                .collect(),
            next: self.events.len() as u64,
            missed: 0,
        }
    }

    pub(crate) fn event_instance(&self, seq: u64) -> Option<MigInstance> {
        self.instances.get(&seq).copied()
    }

    pub(crate) fn push_mig_event(
        &mut self,
        gpu_uuid: &str,
        kind: EventKind,
        instance: MigInstance,
    ) {
        self.push_event(gpu_uuid, kind);
        self.instances.insert(self.events.len() as u64, instance);
    }

    pub(crate) fn push_event(&mut self, gpu_uuid: &str, kind: EventKind) {
        let seq = self.events.len() as u64 + 1;
        let event = Event {
            seq,
            gpu_uuid: gpu_uuid.to_owned(),
            kind,
            age_ms: 0,
        };
        self.events.push((event, Instant::now()));
    }

    pub(crate) fn set_lost(&mut self, index: u32, lost: bool) {
        if lost {
            self.lost.insert(index);
        } else {
            self.lost.remove(&index);
        }
    }
}
