//! A fake NVML (`libnvidia-ml.so.1`) for tests and demos: the agent dlopens this library
//! through `nvml-wrapper` exactly as it would the real one, so CI runs the same loading and
//! query paths without a GPU.
//!
//! The node is described by a JSON fixture (`DEVICELET_FAKE_NVML`, see [`fixture`]) and changed
//! while running through an append-only control file (`DEVICELET_FAKE_NVML_CONTROL`, see
//! [`control`]). The fake answers like real NVML, failures included: uninitialised calls,
//! invalid handles, null pointers, short buffers, lost GPUs, a hung driver.
//!
//! Only the entry points the agent uses are exported; `nvml-wrapper` resolves symbols lazily,
//! so any other call fails with its `FailedToLoadSymbol` error.

// The exports keep nvml.h's names.
#![allow(non_snake_case)]
// Every export's safety contract is nvml.h's for the same function: pointers are null or valid
// for the documented reads and writes, handles are ones this library handed out.
#![allow(clippy::missing_safety_doc)]

mod control;
mod fixture;
mod mig;
mod state;

use std::ffi::{CStr, c_char, c_uint, c_ulong, c_ulonglong};
use std::time::{Duration, Instant};

use nvml_wrapper_sys::bindings::*;

use crate::fixture::MAX_MIG_DEVICES;
use crate::state::{Out, OutStr, SUPPORTED_EVENTS, call, code, device_call, pci_info};

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlInit_v2() -> nvmlReturn_t {
    state::init()
}

/// Flags (`NO_GPUS`, `NO_ATTACH`) change nothing here.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlInitWithFlags(_flags: c_uint) -> nvmlReturn_t {
    state::init()
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlShutdown() -> nvmlReturn_t {
    state::shutdown()
}

/// Static strings, like NVML's; callable at any time.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlErrorString(result: nvmlReturn_t) -> *const c_char {
    let text = match result {
        code::SUCCESS => c"Success",
        code::UNINITIALIZED => c"Uninitialized",
        code::INVALID_ARGUMENT => c"Invalid Argument",
        code::NOT_SUPPORTED => c"Not Supported",
        code::NO_PERMISSION => c"Insufficient Permissions",
        code::NOT_FOUND => c"Not Found",
        code::INSUFFICIENT_SIZE => c"Insufficient Size",
        code::DRIVER_NOT_LOADED => c"Driver Not Loaded",
        code::TIMEOUT => c"Timeout",
        code::GPU_IS_LOST => c"GPU is lost",
        code::ARGUMENT_VERSION_MISMATCH => c"Argument version mismatch",
        code::IN_USE => c"In use by another client",
        code::INSUFFICIENT_RESOURCES => c"Insufficient resources",
        _ => c"Unknown Error",
    };
    text.as_ptr()
}

/// Not a device query: answers while the node is hung.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetDriverVersion(
    version: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    call(|s| {
        let out = unsafe { OutStr::new(version, length) }?;
        out.set(s.driver_version())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCount_v2(count: *mut c_uint) -> nvmlReturn_t {
    device_call(|s| {
        let out = unsafe { Out::new(count) }?;
        out.set(s.count() as c_uint)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex_v2(
    index: c_uint,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    device_call(|s| {
        let out = unsafe { Out::new(device) }?;
        out.set(s.by_index(index as usize)?.handle())
    })
}

/// Finds GPUs and, like NVML, MIG devices by their UUIDs.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByUUID(
    uuid: *const c_char,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    device_call(|s| {
        let out = unsafe { Out::new(device) }?;
        if uuid.is_null() {
            return Err(code::INVALID_ARGUMENT);
        }
        // SAFETY: a NUL-terminated string, per nvml.h.
        let uuid = unsafe { CStr::from_ptr(uuid) };
        let uuid = uuid.to_str().map_err(|_| code::NOT_FOUND)?;
        out.set(s.by_uuid(uuid)?.handle())
    })
}

/// A MIG device answers with its parent's index.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetIndex(
    device: nvmlDevice_t,
    index: *mut c_uint,
) -> nvmlReturn_t {
    device_call(|s| {
        let out = unsafe { Out::new(index) }?;
        out.set(s.device(device)?.gpu as c_uint)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetUUID(
    device: nvmlDevice_t,
    uuid: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    device_call(|s| {
        let out = unsafe { OutStr::new(uuid, length) }?;
        let dev = s.device(device)?;
        match s.mig(dev) {
            Some(mig) => out.set(&mig.uuid),
            None => out.set(&s.gpu(dev).uuid),
        }
    })
}

/// A MIG device answers with its parent's name.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetName(
    device: nvmlDevice_t,
    name: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    device_call(|s| {
        let out = unsafe { OutStr::new(name, length) }?;
        out.set(&s.gpu(s.device(device)?).name)
    })
}

/// MIG devices have no `/dev/nvidiaN` of their own: `NOT_SUPPORTED`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMinorNumber(
    device: nvmlDevice_t,
    minor: *mut c_uint,
) -> nvmlReturn_t {
    device_call(|s| {
        let out = unsafe { Out::new(minor) }?;
        let dev = s.physical(device, code::NOT_SUPPORTED)?;
        out.set(s.gpu(dev).minor)
    })
}

/// A MIG device answers with its parent's PCI info.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPciInfo_v3(
    device: nvmlDevice_t,
    pci: *mut nvmlPciInfo_t,
) -> nvmlReturn_t {
    device_call(|s| {
        let out = unsafe { Out::new(pci) }?;
        out.set(pci_info(&s.gpu(s.device(device)?).pci_bus_id)?)
    })
}

/// The caller sets `version` (`NVML_STRUCT_VERSION(Memory, 2)`); NVML rejects any other. All
/// memory is free.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(
    device: nvmlDevice_t,
    memory: *mut nvmlMemory_v2_t,
) -> nvmlReturn_t {
    const VERSION: c_uint = (size_of::<nvmlMemory_v2_t>() | 2 << 24) as c_uint;
    device_call(|s| {
        let out = unsafe { Out::new(memory) }?;
        let dev = s.device(device)?;
        if out.get().version != VERSION {
            return Err(code::ARGUMENT_VERSION_MISMATCH);
        }
        let mib = s.mig(dev).map_or(s.gpu(dev).memory_mib, |m| m.memory_mib);
        let total = mib.saturating_mul(1 << 20);
        out.set(nvmlMemory_v2_t {
            version: VERSION,
            total,
            reserved: 0,
            free: total,
            used: 0,
        })
    })
}

/// Fills the first `size` words of the CPU bitmask; CPUs beyond them are cut off, as NVML does.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCpuAffinity(
    device: nvmlDevice_t,
    size: c_uint,
    cpu_set: *mut c_ulong,
) -> nvmlReturn_t {
    device_call(|s| {
        if cpu_set.is_null() || size == 0 {
            return Err(code::INVALID_ARGUMENT);
        }
        // SAFETY: `size` words, per nvml.h.
        let words = unsafe { std::slice::from_raw_parts_mut(cpu_set, size as usize) };
        let dev = s.device(device)?;
        words.fill(0);
        for &cpu in &s.gpu(dev).cpus {
            let (word, bit) = (cpu / c_ulong::BITS, cpu % c_ulong::BITS);
            if let Some(word) = words.get_mut(word as usize) {
                *word |= 1 << bit;
            }
        }
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNumaNodeId(
    device: nvmlDevice_t,
    node: *mut c_uint,
) -> nvmlReturn_t {
    device_call(|s| {
        let out = unsafe { Out::new(node) }?;
        let numa = s.gpu(s.device(device)?).numa_node;
        out.set(numa.ok_or(code::NOT_SUPPORTED)?)
    })
}

/// `NOT_SUPPORTED` on GPUs without MIG (no `mig` in the fixture) and on MIG devices.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMigMode(
    device: nvmlDevice_t,
    current: *mut c_uint,
    pending: *mut c_uint,
) -> nvmlReturn_t {
    device_call(|s| {
        let (current, pending) = unsafe { (Out::new(current)?, Out::new(pending)?) };
        let dev = s.physical(device, code::NOT_SUPPORTED)?;
        let mig = s.gpu(dev).mig.as_ref().ok_or(code::NOT_SUPPORTED)?;
        let mode = if mig.enabled {
            NVML_DEVICE_MIG_ENABLE
        } else {
            NVML_DEVICE_MIG_DISABLE
        };
        current.set(mode)?;
        pending.set(mode)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMaxMigDeviceCount(
    device: nvmlDevice_t,
    count: *mut c_uint,
) -> nvmlReturn_t {
    device_call(|s| {
        let out = unsafe { Out::new(count) }?;
        let dev = s.physical(device, code::NOT_SUPPORTED)?;
        s.gpu(dev).mig.as_ref().ok_or(code::NOT_SUPPORTED)?;
        out.set(MAX_MIG_DEVICES as c_uint)
    })
}

/// `NOT_FOUND` for an empty slot (fewer MIG devices than the maximum, or MIG disabled);
/// `INVALID_ARGUMENT` beyond the maximum.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMigDeviceHandleByIndex(
    device: nvmlDevice_t,
    index: c_uint,
    mig_device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    device_call(|s| {
        let out = unsafe { Out::new(mig_device) }?;
        let dev = s.physical(device, code::INVALID_ARGUMENT)?;
        s.gpu(dev).mig.as_ref().ok_or(code::NOT_SUPPORTED)?;
        let index = index as usize;
        if index >= MAX_MIG_DEVICES {
            return Err(code::INVALID_ARGUMENT);
        }
        if index >= s.mig_devices(dev.gpu).count() {
            return Err(code::NOT_FOUND);
        }
        let mig = state::Dev {
            mig: Some(index),
            ..dev
        };
        out.set(mig.handle())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceIsMigDeviceHandle(
    device: nvmlDevice_t,
    is_mig: *mut c_uint,
) -> nvmlReturn_t {
    device_call(|s| {
        let out = unsafe { Out::new(is_mig) }?;
        out.set(c_uint::from(s.device(device)?.mig.is_some()))
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetDeviceHandleFromMigDeviceHandle(
    mig_device: nvmlDevice_t,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    device_call(|s| {
        let out = unsafe { Out::new(device) }?;
        let dev = s.device(mig_device)?;
        if dev.mig.is_none() {
            return Err(code::INVALID_ARGUMENT);
        }
        out.set(state::Dev { mig: None, ..dev }.handle())
    })
}

/// `INVALID_ARGUMENT` on a full GPU, as NVML.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceId(
    device: nvmlDevice_t,
    id: *mut c_uint,
) -> nvmlReturn_t {
    device_call(|s| {
        let out = unsafe { Out::new(id) }?;
        let mig = s.mig(s.device(device)?).ok_or(code::INVALID_ARGUMENT)?;
        out.set(mig.gi)
    })
}

/// `INVALID_ARGUMENT` on a full GPU, as NVML.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeInstanceId(
    device: nvmlDevice_t,
    id: *mut c_uint,
) -> nvmlReturn_t {
    device_call(|s| {
        let out = unsafe { Out::new(id) }?;
        let mig = s.mig(s.device(device)?).ok_or(code::INVALID_ARGUMENT)?;
        out.set(mig.ci)
    })
}

/// MIG devices only (NVML: "currently only supports MIG device handles"); engine counts are 0.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetAttributes_v2(
    device: nvmlDevice_t,
    attributes: *mut nvmlDeviceAttributes_t,
) -> nvmlReturn_t {
    device_call(|s| {
        let out = unsafe { Out::new(attributes) }?;
        let mig = s.mig(s.device(device)?).ok_or(code::NOT_SUPPORTED)?;
        out.set(nvmlDeviceAttributes_t {
            multiprocessorCount: 0,
            sharedCopyEngineCount: 0,
            sharedDecoderCount: 0,
            sharedEncoderCount: 0,
            sharedJpegCount: 0,
            sharedOfaCount: 0,
            gpuInstanceSliceCount: mig.gi_slices,
            computeInstanceSliceCount: mig.ci_slices,
            memorySizeMB: mig.memory_mib,
        })
    })
}

/// Same board → INTERNAL, same switch → SINGLE, same NUMA node → NODE, else SYSTEM.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetTopologyCommonAncestor(
    device1: nvmlDevice_t,
    device2: nvmlDevice_t,
    path_info: *mut nvmlGpuTopologyLevel_t,
) -> nvmlReturn_t {
    device_call(|s| {
        let out = unsafe { Out::new(path_info) }?;
        let a = s.physical(device1, code::NOT_SUPPORTED)?;
        let b = s.physical(device2, code::NOT_SUPPORTED)?;
        let (ga, gb) = (s.gpu(a), s.gpu(b));
        let shared = |x: &Option<String>, y: &Option<String>| x.is_some() && x == y;
        let level = if a == b || shared(&ga.board, &gb.board) {
            nvmlGpuLevel_enum_NVML_TOPOLOGY_INTERNAL
        } else if shared(&ga.switch, &gb.switch) {
            nvmlGpuLevel_enum_NVML_TOPOLOGY_SINGLE
        } else if ga.numa_node.is_some() && ga.numa_node == gb.numa_node {
            nvmlGpuLevel_enum_NVML_TOPOLOGY_NODE
        } else {
            nvmlGpuLevel_enum_NVML_TOPOLOGY_SYSTEM
        };
        out.set(level)
    })
}

/// The fixture's remote bus id of an active `link`, or `NOT_SUPPORTED`; `INVALID_ARGUMENT`
/// past `NVML_NVLINK_MAX_LINKS`.
fn nvlink(s: &state::State, device: nvmlDevice_t, link: c_uint) -> state::Result<&str> {
    let dev = s.physical(device, code::NOT_SUPPORTED)?;
    if link >= NVML_NVLINK_MAX_LINKS {
        return Err(code::INVALID_ARGUMENT);
    }
    let remote = s.gpu(dev).nvlinks.get(link as usize);
    remote.map(String::as_str).ok_or(code::NOT_SUPPORTED)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNvLinkState(
    device: nvmlDevice_t,
    link: c_uint,
    is_active: *mut nvmlEnableState_t,
) -> nvmlReturn_t {
    device_call(|s| {
        let out = unsafe { Out::new(is_active) }?;
        nvlink(s, device, link)?;
        out.set(nvmlEnableState_enum_NVML_FEATURE_ENABLED)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNvLinkRemotePciInfo_v2(
    device: nvmlDevice_t,
    link: c_uint,
    pci: *mut nvmlPciInfo_t,
) -> nvmlReturn_t {
    device_call(|s| {
        let out = unsafe { Out::new(pci) }?;
        out.set(pci_info(nvlink(s, device, link)?)?)
    })
}

/// Not a device query: answers while the node is hung.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetCreate(set: *mut nvmlEventSet_t) -> nvmlReturn_t {
    call(|s| {
        let out = unsafe { Out::new(set) }?;
        out.set(s.create_set())
    })
}

/// Full GPUs only; types other than XID, single- and double-bit ECC are `NOT_SUPPORTED`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceRegisterEvents(
    device: nvmlDevice_t,
    event_types: c_ulonglong,
    set: nvmlEventSet_t,
) -> nvmlReturn_t {
    device_call(|s| {
        let dev = s.physical(device, code::NOT_SUPPORTED)?;
        if event_types & !SUPPORTED_EVENTS != 0 {
            return Err(code::NOT_SUPPORTED);
        }
        s.register(dev, event_types, set)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetSupportedEventTypes(
    device: nvmlDevice_t,
    event_types: *mut c_ulonglong,
) -> nvmlReturn_t {
    device_call(|s| {
        let out = unsafe { Out::new(event_types) }?;
        s.physical(device, code::NOT_SUPPORTED)?;
        out.set(SUPPORTED_EVENTS)
    })
}

/// Delivers the set's next event, waiting up to `timeout_ms` (reading the control file every
/// few milliseconds, without holding the lock), else `TIMEOUT`. Answers while the node is hung,
/// and for lost GPUs: the XID that reports a GPU gone arrives before it is, and once delivered,
/// a set watching a lost GPU fails every wait with `GPU_IS_LOST`, as NVML's does.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetWait_v2(
    set: nvmlEventSet_t,
    data: *mut nvmlEventData_t,
    timeout_ms: c_uint,
) -> nvmlReturn_t {
    let deadline = Instant::now() + Duration::from_millis(timeout_ms.into());
    loop {
        let mut delivered = false;
        let status = call(|s| {
            let out = unsafe { Out::new(data) }?;
            let Some(event) = s.next_event(set)? else {
                return Ok(());
            };
            delivered = true;
            let gpu = state::Dev {
                gpu: event.gpu,
                mig: None,
            };
            out.set(nvmlEventData_t {
                device: gpu.handle(),
                eventType: event.kind,
                eventData: event.data,
                // NVML's 0xFFFFFFFF: not attributed to a MIG instance.
                gpuInstanceId: event.instance.map_or(u32::MAX, |(gi, _)| gi),
                computeInstanceId: event.instance.map_or(u32::MAX, |(_, ci)| ci),
            })
        });
        if delivered || status != code::SUCCESS {
            return status;
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return code::TIMEOUT;
        }
        std::thread::sleep(left.min(state::POLL));
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetFree(set: nvmlEventSet_t) -> nvmlReturn_t {
    call(|s| s.free_set(set))
}
