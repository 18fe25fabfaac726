//! MIG instances made and unmade through NVML (`libraries = ["nvml-mig"]`): a GPU's profiles and
//! their placements, a GPU instance at one placement with a compute instance filling it, and
//! its destruction, compute instances first. `nvml-wrapper` wraps none of this, so the calls go
//! through the symbols it loaded (`Nvml::lib`), checked for presence like its own.

use std::ffi::c_uint;
use std::path::Path;

use nvml_wrapper::Nvml;
use nvml_wrapper::error::{NvmlError as Nv, nvml_sym, nvml_try};
use nvml_wrapper_sys::bindings::*;

use super::{MigDevice, NvmlError, NvmlNode, profile};

/// Where a GPU instance of one profile can be made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    pub profile: String,
    pub start: u32,
    pub size: u32,
    pub compute_slices: u32,
    pub memory_bytes: u64,
}

/// A GPU's MIG geometry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    pub memory_slices: u32,
    pub compute_slices: u32,
    pub placements: Vec<Placement>,
}

/// One profile NVML offers on a GPU: its name, NVML's ID and what it says of it.
struct Profile {
    name: String,
    info: nvmlGpuInstanceProfileInfo_t,
}

/// Far more placements than any profile has (seven 1g slices on an A100/H100): a driver
/// answering more is refused rather than trusted with a buffer.
const MAX_PLACEMENTS: usize = 64;
/// More instances of one profile than a GPU can hold.
const MAX_INSTANCES: usize = 16;

/// How NVIDIA names the profile variants that share a slice count and memory size with the
/// plain one (`nvidia-smi mig -lgip`).
fn suffix(index: u32) -> &'static str {
    match index {
        NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1 | NVML_GPU_INSTANCE_PROFILE_2_SLICE_REV1 => "+me",
        NVML_GPU_INSTANCE_PROFILE_1_SLICE_ALL_ME | NVML_GPU_INSTANCE_PROFILE_2_SLICE_ALL_ME => {
            "+me.all"
        }
        NVML_GPU_INSTANCE_PROFILE_1_SLICE_NO_ME | NVML_GPU_INSTANCE_PROFILE_2_SLICE_NO_ME => "-me",
        NVML_GPU_INSTANCE_PROFILE_1_SLICE_GFX
        | NVML_GPU_INSTANCE_PROFILE_2_SLICE_GFX
        | NVML_GPU_INSTANCE_PROFILE_4_SLICE_GFX => "+gfx",
        _ => "",
    }
}

/// The array NVML fills with a profile's instances: its `instanceCount`, which a real GPU keeps
/// small; a driver answering more is refused rather than trusted with a buffer.
fn instances_room(count: c_uint) -> Result<usize, NvmlError> {
    match count as usize {
        0 => Ok(1),
        n if n <= MAX_INSTANCES => Ok(n),
        n => Err(NvmlError::Failed(format!(
            "NVML says a MIG profile has {n} instances; more than {MAX_INSTANCES} is not a GPU's"
        ))),
    }
}

/// The compute instance profile of `slices` slices (`NVML_COMPUTE_INSTANCE_PROFILE_*`).
fn compute_profile(slices: u32) -> Option<c_uint> {
    Some(match slices {
        1 => NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE,
        2 => NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE,
        3 => NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE,
        4 => NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE,
        6 => NVML_COMPUTE_INSTANCE_PROFILE_6_SLICE,
        7 => NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE,
        8 => NVML_COMPUTE_INSTANCE_PROFILE_8_SLICE,
        _ => return None,
    })
}

/// NVML's error, in a module's terms: slices already taken become words a module can show.
fn mig_error(e: Nv) -> NvmlError {
    match e {
        Nv::UnexpectedVariant(code)
            if code == nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_RESOURCES =>
        {
            NvmlError::Failed(
                "insufficient resources: the placement's slices are taken by another instance"
                    .into(),
            )
        }
        Nv::InUse => NvmlError::Failed("in use: the instance is busy".into()),
        other => other.into(),
    }
}

impl NvmlNode {
    /// The MIG geometry of GPU `index`: `NotSupported` when it has no MIG mode enabled.
    pub fn mig_layout(&self, index: u32) -> Result<Layout, NvmlError> {
        let nvml = self.nvml()?;
        let device = nvml.device_by_index(index)?;
        let parent_bytes = device.memory_info()?.total;
        // SAFETY: a live handle of this library (NVML handles stay valid until shutdown, which
        // never comes: the library is leaked), used only for the calls below.
        let handle = unsafe { device.handle() };
        let profiles = profiles(nvml, handle, parent_bytes)?;
        let mut layout = Layout {
            memory_slices: 0,
            compute_slices: 0,
            placements: Vec::new(),
        };
        for p in &profiles {
            layout.compute_slices = layout.compute_slices.max(p.info.sliceCount);
            for placement in placements(nvml, handle, p.info.id)? {
                layout.memory_slices = layout
                    .memory_slices
                    .max(placement.start.saturating_add(placement.size));
                layout.placements.push(Placement {
                    profile: p.name.clone(),
                    start: placement.start,
                    size: placement.size,
                    compute_slices: p.info.sliceCount,
                    memory_bytes: p.info.memorySizeMB.saturating_mul(1 << 20),
                });
            }
        }
        Ok(layout)
    }

    /// Makes a GPU instance of `profile` at `start` on GPU `index` and a compute instance
    /// filling it; answers its MIG device (`host_root` as for [`NvmlNode::mig_devices`]). A
    /// compute instance that cannot be made takes its GPU instance with it.
    pub fn mig_create(
        &self,
        index: u32,
        profile: &str,
        start: u32,
        host_root: &Path,
    ) -> Result<MigDevice, NvmlError> {
        let nvml = self.nvml()?;
        let device = nvml.device_by_index(index)?;
        let parent_bytes = device.memory_info()?.total;
        // SAFETY: as in `mig_layout`.
        let handle = unsafe { device.handle() };
        let p = named(nvml, handle, parent_bytes, profile)?;
        let placement = placements(nvml, handle, p.info.id)?
            .into_iter()
            .find(|pl| pl.start == start)
            .ok_or(NvmlError::NotFound)?;
        let lib = nvml.lib();
        let mut gi: nvmlGpuInstance_t = std::ptr::null_mut();
        // SAFETY: a live device handle of this library; `placement` and `gi` outlive the call.
        nvml_try(unsafe {
            nvml_sym(lib.nvmlDeviceCreateGpuInstanceWithPlacement.as_ref())?(
                handle, p.info.id, &placement, &mut gi,
            )
        })
        .map_err(mig_error)?;
        let made = compute_instance(nvml, gi, p.info.sliceCount);
        let (gi_id, ci_id) = match made {
            Ok(ids) => ids,
            Err(e) => {
                // Whatever was made goes, compute instances first (NVML refuses to destroy a
                // GPU instance that has one); what cannot go is the module's `unprepare`'s to
                // retry, by placement.
                let undone = destroy_compute_instances(nvml, gi).and_then(|()| {
                    // SAFETY: the GPU instance just made, its compute instances gone.
                    nvml_try(unsafe { nvml_sym(lib.nvmlGpuInstanceDestroy.as_ref())?(gi) })
                        .map_err(mig_error)
                });
                if let Err(undo) = undone {
                    tracing::warn!(
                        gpu = index,
                        profile,
                        start,
                        "a MIG instance half made could not be destroyed: {undo}"
                    );
                }
                return Err(e);
            }
        };
        self.mig_devices(index, host_root)?
            .into_iter()
            .find(|m| m.gpu_instance_id == gi_id && m.compute_instance_id == ci_id)
            .ok_or_else(|| {
                NvmlError::Failed(format!(
                    "made GPU instance {gi_id} (compute instance {ci_id}), but NVML lists no \
                     MIG device for it"
                ))
            })
    }

    /// Destroys the GPU instance of `profile` at `start` on GPU `index`, its compute instances
    /// first; `false` when there is none.
    pub fn mig_destroy(&self, index: u32, profile: &str, start: u32) -> Result<bool, NvmlError> {
        let nvml = self.nvml()?;
        let device = nvml.device_by_index(index)?;
        let parent_bytes = device.memory_info()?.total;
        // SAFETY: as in `mig_layout`.
        let handle = unsafe { device.handle() };
        // A GPU that no longer offers the profile (MIG mode turned off) holds none of it.
        let p = match named(nvml, handle, parent_bytes, profile) {
            Ok(p) => p,
            Err(NvmlError::NotFound | NvmlError::NotSupported) => return Ok(false),
            Err(e) => return Err(e),
        };
        let lib = nvml.lib();
        // NVML fills as many as the profile can have (`instanceCount`); `count` says how many.
        let room = instances_room(p.info.instanceCount)?;
        let mut found = vec![std::ptr::null_mut(); room];
        let mut count: c_uint = 0;
        // SAFETY: the array holds the profile's `instanceCount`, as nvml.h asks.
        nvml_try(unsafe {
            nvml_sym(lib.nvmlDeviceGetGpuInstances.as_ref())?(
                handle,
                p.info.id,
                found.as_mut_ptr(),
                &mut count,
            )
        })?;
        for &gi in found.iter().take((count as usize).min(room)) {
            let mut info: nvmlGpuInstanceInfo_t = unsafe { std::mem::zeroed() };
            // SAFETY: a GPU instance handle NVML just listed; `info` outlives the call.
            nvml_try(unsafe { nvml_sym(lib.nvmlGpuInstanceGetInfo.as_ref())?(gi, &mut info) })?;
            if info.placement.start != start {
                continue;
            }
            destroy_compute_instances(nvml, gi)?;
            // SAFETY: as above; its compute instances are gone.
            nvml_try(unsafe { nvml_sym(lib.nvmlGpuInstanceDestroy.as_ref())?(gi) })
                .map_err(mig_error)?;
            return Ok(true);
        }
        Ok(false)
    }
}

/// Every GPU instance profile GPU `device` offers; `NotSupported` when it offers none (no MIG,
/// or MIG mode disabled).
fn profiles(nvml: &Nvml, device: nvmlDevice_t, parent_bytes: u64) -> Result<Vec<Profile>, Nv> {
    let call = nvml_sym(nvml.lib().nvmlDeviceGetGpuInstanceProfileInfo.as_ref())?;
    let mut found = Vec::new();
    for index in 0..NVML_GPU_INSTANCE_PROFILE_COUNT {
        let mut info: nvmlGpuInstanceProfileInfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: a live device handle; `info` outlives the call.
        match nvml_try(unsafe { call(device, index, &mut info) }) {
            Ok(()) => found.push(Profile {
                name: format!(
                    "{}{}",
                    profile::name(
                        info.sliceCount,
                        info.sliceCount,
                        info.memorySizeMB,
                        parent_bytes
                    ),
                    suffix(index)
                ),
                info,
            }),
            Err(Nv::NotSupported | Nv::InvalidArg | Nv::NotFound) => {}
            Err(e) => return Err(e),
        }
    }
    if found.is_empty() {
        return Err(Nv::NotSupported);
    }
    Ok(found)
}

/// The profile named `name` on GPU `device`; `NotFound` when it has none of that name.
fn named(
    nvml: &Nvml,
    device: nvmlDevice_t,
    parent_bytes: u64,
    name: &str,
) -> Result<Profile, NvmlError> {
    profiles(nvml, device, parent_bytes)?
        .into_iter()
        .find(|p| p.name == name)
        .ok_or(NvmlError::NotFound)
}

fn placements(
    nvml: &Nvml,
    device: nvmlDevice_t,
    profile_id: c_uint,
) -> Result<Vec<nvmlGpuInstancePlacement_t>, Nv> {
    let call = nvml_sym(
        nvml.lib()
            .nvmlDeviceGetGpuInstancePossiblePlacements_v2
            .as_ref(),
    )?;
    // First how many (a null array asks only that), then that many.
    let mut count: c_uint = 0;
    // SAFETY: a live device handle; with a null array NVML only writes `count`.
    nvml_try(unsafe { call(device, profile_id, std::ptr::null_mut(), &mut count) })?;
    let room = count as usize;
    if room > MAX_PLACEMENTS {
        return Err(Nv::Unknown);
    }
    let mut found = vec![nvmlGpuInstancePlacement_t { start: 0, size: 0 }; room];
    let mut count = room as c_uint;
    // SAFETY: the array holds `count` placements; both outlive the call.
    nvml_try(unsafe { call(device, profile_id, found.as_mut_ptr(), &mut count) })?;
    found.truncate((count as usize).min(room));
    Ok(found)
}

/// Makes the compute instance filling GPU instance `gi` of `slices` slices; answers the GPU
/// and compute instance IDs.
fn compute_instance(
    nvml: &Nvml,
    gi: nvmlGpuInstance_t,
    slices: u32,
) -> Result<(u32, u32), NvmlError> {
    let lib = nvml.lib();
    let profile = compute_profile(slices).ok_or(NvmlError::NotSupported)?;
    let mut info: nvmlComputeInstanceProfileInfo_t = unsafe { std::mem::zeroed() };
    // SAFETY: a GPU instance NVML just made; `info` outlives the call.
    nvml_try(unsafe {
        nvml_sym(lib.nvmlGpuInstanceGetComputeInstanceProfileInfo.as_ref())?(
            gi,
            profile,
            NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED,
            &mut info,
        )
    })?;
    let mut ci: nvmlComputeInstance_t = std::ptr::null_mut();
    // SAFETY: as above; `ci` outlives the call.
    nvml_try(unsafe {
        nvml_sym(lib.nvmlGpuInstanceCreateComputeInstance.as_ref())?(gi, info.id, &mut ci)
    })
    .map_err(mig_error)?;
    let mut gi_info: nvmlGpuInstanceInfo_t = unsafe { std::mem::zeroed() };
    let mut ci_info: nvmlComputeInstanceInfo_t = unsafe { std::mem::zeroed() };
    // SAFETY: the instances NVML just made; the infos outlive the calls.
    unsafe {
        nvml_try(nvml_sym(lib.nvmlGpuInstanceGetInfo.as_ref())?(
            gi,
            &mut gi_info,
        ))?;
        nvml_try(nvml_sym(lib.nvmlComputeInstanceGetInfo_v2.as_ref())?(
            ci,
            &mut ci_info,
        ))?;
    }
    Ok((gi_info.id, ci_info.id))
}

/// Destroys every compute instance of GPU instance `gi`, of every profile.
fn destroy_compute_instances(nvml: &Nvml, gi: nvmlGpuInstance_t) -> Result<(), NvmlError> {
    let lib = nvml.lib();
    for profile in 0..NVML_COMPUTE_INSTANCE_PROFILE_COUNT {
        let mut info: nvmlComputeInstanceProfileInfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: a GPU instance NVML listed; `info` outlives the call.
        let offered = nvml_try(unsafe {
            nvml_sym(lib.nvmlGpuInstanceGetComputeInstanceProfileInfo.as_ref())?(
                gi,
                profile,
                NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED,
                &mut info,
            )
        });
        match offered {
            Ok(()) => {}
            Err(Nv::NotSupported | Nv::InvalidArg | Nv::NotFound) => continue,
            Err(e) => return Err(e.into()),
        }
        let room = instances_room(info.instanceCount)?;
        let mut found = vec![std::ptr::null_mut(); room];
        let mut count: c_uint = 0;
        // SAFETY: the array holds the profile's `instanceCount`, as nvml.h asks.
        nvml_try(unsafe {
            nvml_sym(lib.nvmlGpuInstanceGetComputeInstances.as_ref())?(
                gi,
                info.id,
                found.as_mut_ptr(),
                &mut count,
            )
        })?;
        for &ci in found.iter().take((count as usize).min(room)) {
            // SAFETY: a compute instance NVML just listed.
            nvml_try(unsafe { nvml_sym(lib.nvmlComputeInstanceDestroy.as_ref())?(ci) })
                .map_err(mig_error)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn profile_variants_are_named_as_nvidia_smi_lists_them() {
        assert_eq!(suffix(NVML_GPU_INSTANCE_PROFILE_1_SLICE), "");
        assert_eq!(suffix(NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1), "+me");
        assert_eq!(suffix(NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2), "");
        assert_eq!(
            compute_profile(7),
            Some(NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE)
        );
        assert_eq!(compute_profile(5), None);
    }
}
