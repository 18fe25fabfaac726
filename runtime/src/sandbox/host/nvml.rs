//! `devicelet:plugin/nvml`: typed NVML queries for modules granted `libraries = ["nvml"]`.
//!
//! Each query runs on the node's NVML thread and is waited for only until the current call's
//! deadline (less a margin for the module to return): a GPU that hangs NVML makes the query fail
//! with `failed("NVML did not answer …")`, the call is reported as having missed its deadline
//! (a stall, not the module's fault: its instance is kept), and the module's thread is never
//! held past the deadline. The conversions between [`crate::nvml`]'s types and the WIT ones live
//! here and nowhere else.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use wasmtime::component::{HasSelf, Linker};

use crate::nvml::{self, NvmlError as E};
use crate::sandbox::bindings::v0_1::devicelet::plugin::nvml::{
    self as wit, Event, EventBatch, EventKind, Gpu, Host, Link, MigDevice, MigInstance, NvmlError,
    TopologyLevel,
};

/// Most events one read returns; the log itself holds at most this many.
const MAX_EVENTS: usize = nvml::events::CAPACITY;
/// How long before its call's deadline a query stops waiting for NVML (a quarter of the deadline
/// when that is shorter), so the module can still return in time and keep its instance.
const RETURN_MARGIN: Duration = Duration::from_millis(50);

fn error(e: E) -> NvmlError {
    match e {
        E::Unavailable(why) => NvmlError::Unavailable(why),
        E::GpuLost => NvmlError::GpuLost,
        E::NotFound => NvmlError::NotFound,
        E::NotSupported => NvmlError::NotSupported,
        E::Failed(why) => NvmlError::Failed(why),
        stalled @ E::Stalled { .. } => NvmlError::Failed(stalled.to_string()),
    }
}

pub(super) fn mig_device(m: nvml::MigDevice) -> MigDevice {
    MigDevice {
        index: m.index,
        uuid: m.uuid,
        gpu_instance_id: m.gpu_instance_id,
        compute_instance_id: m.compute_instance_id,
        profile: m.profile,
        memory_bytes: m.memory_bytes,
        caps_minors: m.caps_minors,
    }
}

/// Everything `nvml` can touch: the node's NVML (present only for a module granted it), and the
/// host root, where MIG devices' caps nodes are looked up.
pub struct Nvml {
    pub(super) host_root: Arc<PathBuf>,
    node: Option<Arc<nvml::NvmlNode>>,
    /// Queries made during the current call wait for NVML until then at most.
    until: Instant,
    /// Set when a query of the current call stalled: what NVML did.
    stalled: Option<String>,
    /// Whether `mig`'s calls (which change a GPU) are granted (`"nvml-mig"`).
    pub(super) mig_granted: bool,
    /// The export being called: `mig.create` only in `claims.prepare`, `mig.destroy` there and
    /// in `claims.unprepare`, the only calls the host keeps a record of and undoes.
    pub(super) calling: Option<crate::sandbox::error::CallKind>,
}

impl Nvml {
    pub(super) fn new(
        host_root: Arc<PathBuf>,
        node: Option<Arc<nvml::NvmlNode>>,
        mig_granted: bool,
    ) -> Self {
        Nvml {
            host_root,
            node,
            until: Instant::now(),
            stalled: None,
            mig_granted,
            calling: None,
        }
    }

    /// The export the next call is to: what `mig` allows depends on it.
    pub fn calling(&mut self, kind: crate::sandbox::error::CallKind) {
        self.calling = Some(kind);
    }

    /// A call into the module starts that must end by `end`: its queries wait for NVML until a
    /// little before, so the module has time to return what it makes of the failure.
    pub fn call_ends_at(&mut self, end: Instant, deadline: Duration) {
        self.until = end
            .checked_sub((deadline / 4).min(RETURN_MARGIN))
            .unwrap_or(end);
        self.stalled = None;
    }

    /// Whether NVML stalled during the call (and how), once per call.
    pub fn take_stall(&mut self) -> Option<String> {
        self.stalled.take()
    }

    /// Runs `query` on the NVML thread under the call's deadline.
    pub(super) fn ask<T, F>(&mut self, query: F) -> Result<T, NvmlError>
    where
        T: Send + 'static,
        F: FnOnce(&nvml::NvmlNode) -> Result<T, E> + Send + 'static,
    {
        let node = self.nvml()?.clone();
        match node.ask(self.until, query) {
            Err(stalled @ E::Stalled { .. }) => {
                let message = stalled.to_string();
                self.stalled.get_or_insert_with(|| message.clone());
                Err(NvmlError::Failed(message))
            }
            other => other.map_err(error),
        }
    }

    /// Linked only for a module granted `libraries = ["nvml"]`.
    pub fn add_to_linker<T: Send + 'static>(
        linker: &mut Linker<T>,
        view: fn(&mut T) -> &mut Nvml,
    ) -> wasmtime::Result<()> {
        // Under every line's name: the interface is the same in each.
        for name in crate::sandbox::bindings::imports::host_names("nvml") {
            wit::add_to_linker_instance::<T, HasSelf<Nvml>>(&mut linker.instance(&name)?, view)?;
        }
        Ok(())
    }

    fn nvml(&self) -> Result<&Arc<nvml::NvmlNode>, NvmlError> {
        // Only linked when granted, and a granted module always has a node; this is the belt.
        self.node
            .as_ref()
            .ok_or_else(|| NvmlError::Unavailable("nvml is not granted to this module".into()))
    }
}

impl Host for Nvml {
    fn device_count(&mut self) -> Result<u32, NvmlError> {
        self.ask(|n| n.device_count())
    }

    fn device(&mut self, index: u32) -> Result<Gpu, NvmlError> {
        let g = self.ask(move |n| n.gpu(index))?;
        Ok(Gpu {
            index: g.index,
            uuid: g.uuid,
            name: g.name,
            minor: g.minor,
            pci_bus_id: g.pci_bus_id,
            memory_bytes: g.memory_bytes,
            numa_node: g.numa_node,
            cpu_affinity: g.cpu_affinity,
            mig_enabled: g.mig_enabled,
        })
    }

    fn mig_devices(&mut self, index: u32) -> Result<Vec<MigDevice>, NvmlError> {
        let root = self.host_root.clone();
        Ok(self
            .ask(move |n| n.mig_devices(index, &root))?
            .into_iter()
            .map(mig_device)
            .collect())
    }

    fn topology(&mut self, a: u32, b: u32) -> Result<Link, NvmlError> {
        let link = self.ask(move |n| n.topology(a, b))?;
        Ok(Link {
            level: match link.level {
                nvml::TopologyLevel::Internal => TopologyLevel::Internal,
                nvml::TopologyLevel::Single => TopologyLevel::Single,
                nvml::TopologyLevel::Multiple => TopologyLevel::Multiple,
                nvml::TopologyLevel::HostBridge => TopologyLevel::HostBridge,
                nvml::TopologyLevel::Node => TopologyLevel::Node,
                nvml::TopologyLevel::System => TopologyLevel::System,
            },
            nvlinks: link.nvlinks,
        })
    }

    fn event_instance(&mut self, seq: u64) -> Option<MigInstance> {
        let (gpu_instance_id, compute_instance_id) = self.node.as_ref()?.event_instance(seq)?;
        Some(MigInstance {
            gpu_instance_id,
            compute_instance_id,
        })
    }

    fn events(&mut self, after: u64) -> EventBatch {
        let Ok(node) = self.nvml() else {
            return EventBatch {
                events: Vec::new(),
                next: after,
                missed: 0,
            };
        };
        let read = node.events(after);
        EventBatch {
            events: read
                .events
                .into_iter()
                .take(MAX_EVENTS)
                .map(|e| Event {
                    seq: e.seq,
                    gpu_uuid: e.gpu_uuid,
                    kind: match e.kind {
                        nvml::EventKind::Xid(code) => EventKind::Xid(code),
                        nvml::EventKind::DoubleBitEcc => EventKind::DoubleBitEcc,
                    },
                    age_ms: u64::try_from(e.age.as_millis()).unwrap_or(u64::MAX),
                })
                .collect(),
            next: read.next,
            missed: read.missed,
        }
    }
}
