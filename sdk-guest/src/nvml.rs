//! NVIDIA's management library (NVML), through typed host queries.
//!
//! Needs the registry grant `libraries = ["nvml"]`; using any function here makes the component
//! import the `nvml` interface (WIT 0.1.2; [`event_instance`] is new in 0.1.2), which an agent refuses to link without that grant. Every query runs NVML on the
//! agent's side, waited for until a little before the call's deadline: when NVML hangs, the
//! query fails with [`NvmlError::Failed`] (`NVML did not answer …`) in time for the module to
//! return, the agent counts the call as having missed its deadline (a stall, not the module's
//! fault: its answer is not used, its instance is kept), and an `enumerate` that stalls leaves
//! the last snapshot standing.
//!
//! Critical events (XID errors, double-bit ECC) are buffered by the agent, which also wakes the
//! module's health check (`enumerate`) as soon as one arrives. Read them with [`events`], keeping
//! the returned `next` for the following call; a fresh instance starts from 0 and sees everything
//! still buffered, so health state rebuilt from the buffer survives an instance restart.

pub use crate::bindings::devicelet::plugin::nvml::{
    Event, EventBatch, EventKind, Gpu, Link, MigDevice, MigInstance, NvmlError, TopologyLevel,
};

/// The agent's `nvml` interface in a component; the test kit's fake host elsewhere.
mod host {
    #[cfg(target_arch = "wasm32")]
    pub use crate::bindings::devicelet::plugin::nvml::{
        device, device_count, event_instance, events, mig_devices, topology,
    };

    #[cfg(not(target_arch = "wasm32"))]
    pub fn event_instance(seq: u64) -> Option<MigInstance> {
        crate::testing::current_nvml(|n| Ok(n.event_instance(seq)))
            .ok()
            .flatten()
    }

    #[cfg(not(target_arch = "wasm32"))]
    use super::*;

    #[cfg(not(target_arch = "wasm32"))]
    pub fn device_count() -> Result<u32, NvmlError> {
        crate::testing::current_nvml(|n| n.device_count())
    }

    #[cfg(not(target_arch = "wasm32"))]
    pub fn device(index: u32) -> Result<Gpu, NvmlError> {
        crate::testing::current_nvml(|n| n.device(index))
    }

    #[cfg(not(target_arch = "wasm32"))]
    pub fn mig_devices(index: u32) -> Result<Vec<MigDevice>, NvmlError> {
        crate::testing::current_nvml(|n| n.mig_devices(index))
    }

    #[cfg(not(target_arch = "wasm32"))]
    pub fn topology(a: u32, b: u32) -> Result<Link, NvmlError> {
        crate::testing::current_nvml(|n| n.topology(a, b))
    }

    #[cfg(not(target_arch = "wasm32"))]
    pub fn events(after: u64) -> EventBatch {
        crate::testing::current_nvml(|n| Ok(n.events(after))).unwrap_or(EventBatch {
            events: Vec::new(),
            next: after,
            missed: 0,
        })
    }
}

/// How many GPUs NVML sees (indexes `0..count`).
pub fn device_count() -> Result<u32, NvmlError> {
    host::device_count()
}

/// The GPU with this index. [`NvmlError::GpuLost`] means it fell off the bus (XID 79).
pub fn device(index: u32) -> Result<Gpu, NvmlError> {
    host::device(index)
}

/// The MIG devices of the GPU with this index, with the profile names and the
/// `/dev/nvidia-caps` minors a container needs; empty when MIG is disabled.
pub fn mig_devices(index: u32) -> Result<Vec<MigDevice>, NvmlError> {
    host::mig_devices(index)
}

/// How the GPUs with these indexes are connected: their nearest common PCIe ancestor and the
/// NVLinks between them.
pub fn topology(a: u32, b: u32) -> Result<Link, NvmlError> {
    host::topology(a, b)
}

/// Critical events with a sequence number above `after`, oldest first. Never blocks.
pub fn events(after: u64) -> EventBatch {
    host::events(after)
}

/// The MIG instance event `seq` was raised in, when NVML attributed it to one (an XID inside
/// one MIG device: NVIDIA's plugin then marks only that MIG device Unhealthy); None for an
/// event about the whole GPU. Ask while the event is buffered (right after [`events`]).
pub fn event_instance(seq: u64) -> Option<MigInstance> {
    host::event_instance(seq)
}
