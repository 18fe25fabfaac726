//! A fake NVML for module tests: GPUs, MIG devices and links as the test describes them, and
//! events and lost GPUs injected between calls, answering as the agent's `nvml` interface does.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

use crate::mig::{MigLayout, MigPlacement};
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
    /// Each GPU's MIG geometry, for [`crate::mig`]; a GPU without one cannot make instances.
    layouts: BTreeMap<u32, MigLayout>,
    /// Instances made through [`crate::mig::create`]: (GPU, placement) by GPU instance ID.
    made: BTreeMap<(u32, u32), MigPlacement>,
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

    /// Lets the GPU with index `gpu` make MIG instances through [`crate::mig`], with this
    /// geometry. Made instances appear among its MIG devices (it should have `mig_enabled`);
    /// one overlapping another's memory slices, or more compute slices than the GPU has, fails
    /// as NVML does.
    pub fn with_mig_layout(mut self, gpu: u32, layout: MigLayout) -> FakeNvml {
        self.layouts.insert(gpu, layout);
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

    pub(crate) fn mig_layout(&self, index: u32) -> Result<MigLayout, NvmlError> {
        if !self.check(index)?.mig_enabled {
            return Err(NvmlError::NotSupported);
        }
        self.layouts
            .get(&index)
            .cloned()
            .ok_or(NvmlError::NotSupported)
    }

    pub(crate) fn mig_create(
        &mut self,
        index: u32,
        profile: &str,
        start: u32,
    ) -> Result<MigDevice, NvmlError> {
        let layout = self.mig_layout(index)?;
        let placement = layout
            .placements
            .iter()
            .find(|p| p.profile == profile && p.start == start)
            .cloned()
            .ok_or(NvmlError::NotFound)?;
        let mine: Vec<(&u32, &MigPlacement)> = self
            .made
            .iter()
            .filter(|((gpu, _), _)| *gpu == index)
            .map(|((_, gi), p)| (gi, p))
            .collect();
        let overlaps = mine.iter().any(|(_, p)| {
            p.start < placement.start + placement.size && placement.start < p.start + p.size
        });
        let compute: u32 = mine.iter().map(|(_, p)| p.compute_slices).sum();
        if overlaps || compute + placement.compute_slices > layout.compute_slices {
            return Err(NvmlError::Failed(
                "insufficient resources: the placement's slices are taken by another instance"
                    .into(),
            ));
        }
        let gi = (1..)
            .find(|gi| !mine.iter().any(|(used, _)| *used == gi))
            .unwrap_or(1);
        let device = MigDevice {
            index: self.mig.get(&index).map_or(0, |m| m.len() as u32),
            uuid: format!("MIG-{index:08x}-{gi:04x}-4000-8000-{start:012x}"),
            gpu_instance_id: gi,
            compute_instance_id: 0,
            profile: placement.profile.clone(),
            memory_bytes: placement.memory_bytes,
            caps_minors: vec![gi * 10 + 1, gi * 10 + 2],
        };
        self.made.insert((index, gi), placement);
        self.mig.entry(index).or_default().push(device.clone());
        Ok(device)
    }

    pub(crate) fn mig_destroy(
        &mut self,
        index: u32,
        profile: &str,
        start: u32,
    ) -> Result<bool, NvmlError> {
        self.mig_layout(index)?;
        let found = self
            .made
            .iter()
            .find(|((gpu, _), p)| *gpu == index && p.profile == profile && p.start == start)
            .map(|(key, _)| *key);
        let Some((gpu, gi)) = found else {
            return Ok(false);
        };
        self.made.remove(&(gpu, gi));
        if let Some(devices) = self.mig.get_mut(&gpu) {
            devices.retain(|d| d.gpu_instance_id != gi);
        }
        Ok(true)
    }

    pub(crate) fn made_instances(&self, index: u32) -> Vec<MigPlacement> {
        self.made
            .iter()
            .filter(|((gpu, _), _)| *gpu == index)
            .map(|(_, p)| p.clone())
            .collect()
    }

    pub(crate) fn set_lost(&mut self, index: u32, lost: bool) {
        if lost {
            self.lost.insert(index);
        } else {
            self.lost.remove(&index);
        }
    }
}
