//! MIG instances made and destroyed through NVML's API, on GPUs whose fixture lists profiles:
//! placements, overlap refused as NVML refuses it (`INSUFFICIENT_RESOURCES`), a GPU instance
//! that cannot be destroyed while it has a compute instance (`IN_USE`).
//!
//! Real MIG instances outlive the process that made them (they live in the GPU until destroyed
//! or the GPU resets), so the fake keeps them in a file beside the fixture (`nvml.mig.json` for
//! `nvml.json`), written on every change and read when the library initialises: an agent killed
//! after making an instance finds it again when it restarts, as on a node, and a test can read
//! what a GPU holds.

// The exports keep nvml.h's names.
#![allow(non_snake_case)]

use std::ffi::c_uint;
use std::path::{Path, PathBuf};

use nvml_wrapper_sys::bindings::*;
use serde::{Deserialize, Serialize};

use crate::fixture::{Fixture, MigDevice, Profile};
use crate::state::{Dev, Out, Result, State, code, device_call};

/// Compute slices of each `NVML_COMPUTE_INSTANCE_PROFILE_*` index (7, REV1, is not modelled).
const CI_SLICES: [u32; 7] = [1, 2, 3, 4, 7, 8, 6];
/// GPU instance handles: `GI_BASE + gpu * STRIDE + gi`; compute instance handles:
/// `CI_BASE + (gpu * STRIDE + gi) * 16 + ci`. Both above every device and event-set handle.
const GI_BASE: usize = 0x20_0000;
const CI_BASE: usize = 0x40_0000;
const STRIDE: usize = 0x100;
/// GPU instance IDs handed out, as on an A100/H100.
const GI_IDS: std::ops::RangeInclusive<u32> = 1..=14;

/// Each GPU's instances, and the file they are kept in.
#[derive(Debug, Default)]
pub struct Instances {
    gpus: Vec<Vec<MigDevice>>,
    /// Instances made so far, across processes: part of each new MIG device's UUID.
    serial: u64,
    file: Option<PathBuf>,
}

#[derive(Serialize, Deserialize)]
struct Saved {
    serial: u64,
    gpus: Vec<Vec<MigDevice>>,
}

impl Instances {
    /// What the GPUs held when the last process left them, else what the fixture says.
    pub fn load(fixture_path: Option<&Path>, fixture: &Fixture) -> Instances {
        let file = fixture_path.map(|p| p.with_extension("mig.json"));
        let saved = file
            .as_ref()
            .and_then(|p| std::fs::read(p).ok())
            .and_then(|bytes| serde_json::from_slice::<Saved>(&bytes).ok())
            .filter(|s| s.gpus.len() == fixture.gpus.len());
        match saved {
            Some(saved) => Instances {
                gpus: saved.gpus,
                serial: saved.serial,
                file,
            },
            None => Instances {
                gpus: fixture
                    .gpus
                    .iter()
                    .map(|g| g.mig.as_ref().map_or(Vec::new(), |m| m.devices.clone()))
                    .collect(),
                serial: 0,
                file,
            },
        }
    }

    pub fn of(&self, gpu: usize) -> &[MigDevice] {
        self.gpus.get(gpu).map_or(&[], Vec::as_slice)
    }

    /// Writes the instances to their file (atomically: a reader sees the old or the new set).
    fn save(&self) {
        let Some(file) = &self.file else { return };
        let saved = Saved {
            serial: self.serial,
            gpus: self.gpus.clone(),
        };
        let Ok(text) = serde_json::to_vec_pretty(&saved) else {
            return;
        };
        let tmp = file.with_extension("tmp");
        if std::fs::write(&tmp, text).is_ok() {
            let _ = std::fs::rename(&tmp, file);
        }
    }
}

impl State {
    /// The profile with this ID on the GPU `dev`: `NOT_SUPPORTED` without MIG mode,
    /// `INVALID_ARGUMENT` for a profile the GPU does not have.
    fn profile(&self, dev: Dev, id: c_uint) -> Result<Profile> {
        let mig = self.gpu(dev).mig.as_ref().ok_or(code::NOT_SUPPORTED)?;
        if !mig.enabled {
            return Err(code::NOT_SUPPORTED);
        }
        mig.profiles
            .iter()
            .find(|p| p.id == id)
            .cloned()
            .ok_or(code::INVALID_ARGUMENT)
    }

    /// Decodes a GPU instance handle into (GPU, position in its instances).
    fn gpu_instance(&self, handle: nvmlGpuInstance_t) -> Result<(Dev, usize)> {
        let offset = handle
            .addr()
            .checked_sub(GI_BASE)
            .filter(|&o| o < CI_BASE - GI_BASE)
            .ok_or(code::INVALID_ARGUMENT)?;
        let (gpu, gi) = (offset / STRIDE, (offset % STRIDE) as u32);
        if gpu >= self.count() {
            return Err(code::INVALID_ARGUMENT);
        }
        let dev = self.by_index(gpu)?;
        let at = self
            .migs
            .of(gpu)
            .iter()
            .position(|m| m.gi == gi)
            .ok_or(code::INVALID_ARGUMENT)?;
        Ok((dev, at))
    }

    /// Decodes a compute instance handle into (GPU, position of its GPU instance).
    fn compute_instance(&self, handle: nvmlComputeInstance_t) -> Result<(Dev, usize)> {
        let offset = handle
            .addr()
            .checked_sub(CI_BASE)
            .ok_or(code::INVALID_ARGUMENT)?;
        let (outer, ci) = (offset / 16, (offset % 16) as u32);
        let gi = gi_handle(outer / STRIDE, (outer % STRIDE) as u32);
        let (dev, at) = self.gpu_instance(gi)?;
        let m = &self.migs.of(dev.gpu)[at];
        if m.bare || m.ci != ci {
            return Err(code::INVALID_ARGUMENT);
        }
        Ok((dev, at))
    }

    /// The profile an instance was made with, else the first with its slice count.
    fn profile_of(&self, dev: Dev, m: &MigDevice) -> Option<Profile> {
        let profiles = &self.gpu(dev).mig.as_ref()?.profiles;
        profiles
            .iter()
            .find(|p| Some(p.id) == m.profile)
            .or_else(|| profiles.iter().find(|p| p.slices == m.gi_slices))
            .cloned()
    }
}

fn gi_handle(gpu: usize, gi: u32) -> nvmlGpuInstance_t {
    std::ptr::without_provenance_mut(GI_BASE + gpu * STRIDE + gi as usize)
}

fn ci_handle(gpu: usize, gi: u32, ci: u32) -> nvmlComputeInstance_t {
    std::ptr::without_provenance_mut(CI_BASE + (gpu * STRIDE + gi as usize) * 16 + ci as usize)
}

fn ci_profile(slices: u32) -> c_uint {
    CI_SLICES
        .iter()
        .position(|&s| s == slices)
        .map_or(c_uint::MAX, |p| p as c_uint)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceProfileInfo(
    device: nvmlDevice_t,
    profile: c_uint,
    info: *mut nvmlGpuInstanceProfileInfo_t,
) -> nvmlReturn_t {
    device_call(|s| {
        let out = unsafe { Out::new(info) }?;
        let dev = s.physical(device, code::INVALID_ARGUMENT)?;
        if profile >= NVML_GPU_INSTANCE_PROFILE_COUNT {
            return Err(code::INVALID_ARGUMENT);
        }
        let mig = s.gpu(dev).mig.as_ref().ok_or(code::NOT_SUPPORTED)?;
        // A profile this GPU lacks: NOT_SUPPORTED, as NVML answers for it.
        let p = mig
            .profiles
            .iter()
            .find(|p| p.index == profile && mig.enabled)
            .ok_or(code::NOT_SUPPORTED)?;
        out.set(nvmlGpuInstanceProfileInfo_t {
            id: p.id,
            isP2pSupported: 0,
            sliceCount: p.slices,
            instanceCount: p.starts.len() as c_uint,
            multiprocessorCount: p.slices * 16,
            copyEngineCount: p.slices,
            decoderCount: 0,
            encoderCount: 0,
            jpegCount: 0,
            ofaCount: 0,
            memorySizeMB: p.memory_mib,
        })
    })
}

/// With `placements` null, only the count; a `count` too small for them: `INSUFFICIENT_SIZE`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstancePossiblePlacements_v2(
    device: nvmlDevice_t,
    profile_id: c_uint,
    placements: *mut nvmlGpuInstancePlacement_t,
    count: *mut c_uint,
) -> nvmlReturn_t {
    device_call(|s| {
        let count = unsafe { Out::new(count) }?;
        let dev = s.physical(device, code::INVALID_ARGUMENT)?;
        let p = s.profile(dev, profile_id)?;
        let n = p.starts.len() as c_uint;
        if placements.is_null() {
            return count.set(n);
        }
        if count.get() < n {
            count.set(n)?;
            return Err(code::INSUFFICIENT_SIZE);
        }
        for (i, &start) in p.starts.iter().enumerate() {
            // SAFETY: the caller said the array holds `count` placements, and i < n <= count.
            unsafe {
                placements.add(i).write(nvmlGpuInstancePlacement_t {
                    start,
                    size: p.size,
                })
            };
        }
        count.set(n)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceCreateGpuInstanceWithPlacement(
    device: nvmlDevice_t,
    profile_id: c_uint,
    placement: *const nvmlGpuInstancePlacement_t,
    gpu_instance: *mut nvmlGpuInstance_t,
) -> nvmlReturn_t {
    device_call(|s| {
        let out = unsafe { Out::new(gpu_instance) }?;
        if placement.is_null() {
            return Err(code::INVALID_ARGUMENT);
        }
        // SAFETY: non-null, and valid for a read per nvml.h.
        let placement = unsafe { placement.read() };
        let dev = s.physical(device, code::INVALID_ARGUMENT)?;
        let p = s.profile(dev, profile_id)?;
        if placement.size != p.size || !p.starts.contains(&placement.start) {
            return Err(code::INVALID_ARGUMENT);
        }
        let new = placement.start..placement.start + p.size;
        let all_slices = s.gpu(dev).mig.as_ref().map_or(0, |m| {
            m.profiles.iter().map(|p| p.slices).max().unwrap_or(0)
        });
        let mut used_slices = p.slices;
        for m in s.migs.of(dev.gpu) {
            used_slices += m.gi_slices;
            let (Some(start), Some(other)) = (m.start, s.profile_of(dev, m)) else {
                continue;
            };
            if start < new.end && new.start < start + other.size {
                return Err(code::INSUFFICIENT_RESOURCES);
            }
        }
        if used_slices > all_slices {
            return Err(code::INSUFFICIENT_RESOURCES);
        }
        let used: Vec<u32> = s.migs.of(dev.gpu).iter().map(|m| m.gi).collect();
        let gi = GI_IDS
            .clone()
            .find(|id| !used.contains(id))
            .ok_or(code::INSUFFICIENT_RESOURCES)?;
        s.migs.gpus[dev.gpu].push(MigDevice {
            uuid: String::new(),
            gi,
            ci: 0,
            gi_slices: p.slices,
            ci_slices: 0,
            memory_mib: p.memory_mib,
            profile: Some(p.id),
            start: Some(placement.start),
            bare: true,
        });
        s.migs.save();
        out.set(gi_handle(dev.gpu, gi))
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetInfo(
    gpu_instance: nvmlGpuInstance_t,
    info: *mut nvmlGpuInstanceInfo_t,
) -> nvmlReturn_t {
    device_call(|s| {
        let out = unsafe { Out::new(info) }?;
        let (dev, at) = s.gpu_instance(gpu_instance)?;
        let m = &s.migs.of(dev.gpu)[at];
        let profile = s.profile_of(dev, m);
        out.set(nvmlGpuInstanceInfo_t {
            device: dev.handle(),
            id: m.gi,
            profileId: profile.as_ref().map_or(c_uint::MAX, |p| p.id),
            placement: nvmlGpuInstancePlacement_t {
                start: m.start.unwrap_or(0),
                size: profile.map_or(m.gi_slices, |p| p.size),
            },
        })
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstances(
    device: nvmlDevice_t,
    profile_id: c_uint,
    gpu_instances: *mut nvmlGpuInstance_t,
    count: *mut c_uint,
) -> nvmlReturn_t {
    device_call(|s| {
        let count = unsafe { Out::new(count) }?;
        if gpu_instances.is_null() {
            return Err(code::INVALID_ARGUMENT);
        }
        let dev = s.physical(device, code::INVALID_ARGUMENT)?;
        let p = s.profile(dev, profile_id)?;
        let found: Vec<u32> = s
            .migs
            .of(dev.gpu)
            .iter()
            .filter(|m| s.profile_of(dev, m).is_some_and(|q| q.id == p.id))
            .map(|m| m.gi)
            .collect();
        for (i, gi) in found.iter().enumerate() {
            // SAFETY: nvml.h: the array holds the profile's `instanceCount` (its placements),
            // and no more instances of a profile exist than it has placements.
            unsafe { gpu_instances.add(i).write(gi_handle(dev.gpu, *gi)) };
        }
        count.set(found.len() as c_uint)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstanceProfileInfo(
    gpu_instance: nvmlGpuInstance_t,
    profile: c_uint,
    eng_profile: c_uint,
    info: *mut nvmlComputeInstanceProfileInfo_t,
) -> nvmlReturn_t {
    device_call(|s| {
        let out = unsafe { Out::new(info) }?;
        let (dev, at) = s.gpu_instance(gpu_instance)?;
        if eng_profile != NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
            || profile >= NVML_COMPUTE_INSTANCE_PROFILE_COUNT
        {
            return Err(code::INVALID_ARGUMENT);
        }
        let gi_slices = s.migs.of(dev.gpu)[at].gi_slices;
        let slices = *CI_SLICES
            .get(profile as usize)
            .filter(|&&n| n <= gi_slices)
            .ok_or(code::NOT_SUPPORTED)?;
        out.set(nvmlComputeInstanceProfileInfo_t {
            id: profile,
            sliceCount: slices,
            instanceCount: gi_slices / slices,
            multiprocessorCount: slices * 16,
            sharedCopyEngineCount: 0,
            sharedDecoderCount: 0,
            sharedEncoderCount: 0,
            sharedJpegCount: 0,
            sharedOfaCount: 0,
        })
    })
}

/// One compute instance per GPU instance here (a second: `INSUFFICIENT_RESOURCES`). While
/// `hang-after-create` is in force, returns only at `create-returns`, the instance made.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceCreateComputeInstance(
    gpu_instance: nvmlGpuInstance_t,
    profile_id: c_uint,
    compute_instance: *mut nvmlComputeInstance_t,
) -> nvmlReturn_t {
    let made = device_call(|s| {
        let out = unsafe { Out::new(compute_instance) }?;
        let (dev, at) = s.gpu_instance(gpu_instance)?;
        let gi_slices = s.migs.of(dev.gpu)[at].gi_slices;
        let slices = *CI_SLICES
            .get(profile_id as usize)
            .filter(|&&n| n <= gi_slices)
            .ok_or(code::INVALID_ARGUMENT)?;
        if !s.migs.of(dev.gpu)[at].bare {
            return Err(code::INSUFFICIENT_RESOURCES);
        }
        s.migs.serial += 1;
        let serial = s.migs.serial;
        let m = &mut s.migs.gpus[dev.gpu][at];
        m.bare = false;
        m.ci = 0;
        m.ci_slices = slices;
        m.uuid = format!(
            "MIG-{:08x}-{:04x}-4000-8000-{serial:012x}",
            dev.gpu as u32, m.gi
        );
        let handle = ci_handle(dev.gpu, m.gi, 0);
        s.migs.save();
        out.set(handle)
    });
    if made == code::SUCCESS {
        crate::state::wait_while(|s| s.hang_after_create);
    }
    made
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlComputeInstanceGetInfo_v2(
    compute_instance: nvmlComputeInstance_t,
    info: *mut nvmlComputeInstanceInfo_t,
) -> nvmlReturn_t {
    device_call(|s| {
        let out = unsafe { Out::new(info) }?;
        let (dev, at) = s.compute_instance(compute_instance)?;
        let m = &s.migs.of(dev.gpu)[at];
        out.set(nvmlComputeInstanceInfo_t {
            device: dev.handle(),
            gpuInstance: gi_handle(dev.gpu, m.gi),
            id: m.ci,
            profileId: ci_profile(m.ci_slices),
            placement: nvmlComputeInstancePlacement_t {
                start: 0,
                size: m.ci_slices,
            },
        })
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstances(
    gpu_instance: nvmlGpuInstance_t,
    profile_id: c_uint,
    compute_instances: *mut nvmlComputeInstance_t,
    count: *mut c_uint,
) -> nvmlReturn_t {
    device_call(|s| {
        let count = unsafe { Out::new(count) }?;
        if compute_instances.is_null() {
            return Err(code::INVALID_ARGUMENT);
        }
        let (dev, at) = s.gpu_instance(gpu_instance)?;
        let m = &s.migs.of(dev.gpu)[at];
        if m.bare || ci_profile(m.ci_slices) != profile_id {
            return count.set(0);
        }
        // SAFETY: nvml.h: the array holds the profile's `instanceCount`, at least one.
        unsafe { compute_instances.write(ci_handle(dev.gpu, m.gi, m.ci)) };
        count.set(1)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlComputeInstanceDestroy(
    compute_instance: nvmlComputeInstance_t,
) -> nvmlReturn_t {
    device_call(|s| {
        let (dev, at) = s.compute_instance(compute_instance)?;
        let m = &mut s.migs.gpus[dev.gpu][at];
        m.bare = true;
        m.ci_slices = 0;
        m.uuid.clear();
        s.migs.save();
        Ok(())
    })
}

/// `IN_USE` while it has a compute instance, as NVML.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceDestroy(gpu_instance: nvmlGpuInstance_t) -> nvmlReturn_t {
    device_call(|s| {
        let (dev, at) = s.gpu_instance(gpu_instance)?;
        if !s.migs.of(dev.gpu)[at].bare {
            return Err(code::IN_USE);
        }
        s.migs.gpus[dev.gpu].remove(at);
        s.migs.save();
        Ok(())
    })
}
