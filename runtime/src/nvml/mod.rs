//! NVML on this node, for the modules the registry grants `libraries = ["nvml"]`.
//!
//! The library is opened once per process and path ([`open`]), on a thread of its own that keeps
//! trying until NVML answers, so a missing driver or a half-initialised one that never answers is
//! a clear state ([`Availability::Unavailable`], with why) rather than a crash or a hung agent,
//! and a driver installed later is picked up. Queries
//! ([`NvmlNode::gpu`] and friends) are plain blocking calls, which the `nvml` host interface
//! hands to the node's query thread ([`asker`]) and waits for only until the asking call's
//! deadline: a GPU that hangs NVML makes calls fail at their deadlines, and never holds a
//! module's thread past them. One event thread per node buffers critical events ([`events`]) and wakes the granted
//! modules' health checks.
//!
//! Nothing here knows wasmtime: `sandbox::host::nvml` turns these types into the WIT ones.

mod asker;
mod caps;
pub mod events;
mod mig;
mod profile;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use nvml_wrapper::Nvml;
use nvml_wrapper::enum_wrappers::device::TopologyLevel as NvTopology;
use nvml_wrapper::error::NvmlError as Nv;

pub use events::{Event, EventKind, Events, Subscription};
pub use mig::{Layout, Placement};

/// Where NVML is loaded from unless `--nvml-library` says otherwise: the dynamic loader finds it
/// where the NVIDIA driver installed it (or where the container toolkit mounted it).
pub const DEFAULT_LIBRARY: &str = "libnvidia-ml.so.1";

/// How long `nvmlInit` may take. A healthy driver answers in well under a second; one wedged by
/// a sick GPU may never answer, and the agent must still serve every other module.
const INIT_LIMIT: Duration = Duration::from_secs(10);
/// The longest wait between two attempts to open NVML.
const RETRY: Duration = Duration::from_secs(30);

/// The vendor libraries the agent opens for modules, by where to find them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Libraries {
    /// The NVML shared library (a path, or a file name the dynamic loader searches for).
    pub nvml: PathBuf,
}

impl Default for Libraries {
    fn default() -> Self {
        Libraries {
            nvml: PathBuf::from(DEFAULT_LIBRARY),
        }
    }
}

/// Why an NVML query failed, in the terms a module can act on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NvmlError {
    #[error("no NVML on this node: {0}")]
    Unavailable(String),
    #[error("the GPU is lost (fell off the bus or otherwise inaccessible)")]
    GpuLost,
    #[error("no such GPU or MIG device")]
    NotFound,
    #[error("not supported by this GPU or driver")]
    NotSupported,
    #[error("{0}")]
    Failed(String),
    /// NVML did not answer before the asking call's deadline; `stuck_for`: how long the query
    /// NVML is busy with has been running, when it is busy.
    #[error("{}", stall_message(*.waited, *.stuck_for))]
    Stalled {
        waited: Duration,
        stuck_for: Option<Duration>,
    },
}

fn stall_message(waited: Duration, stuck_for: Option<Duration>) -> String {
    let mut message = format!("NVML did not answer within {waited:.1?}");
    if let Some(stuck) = stuck_for {
        message.push_str(&format!(
            " (one query has been waiting on it for {stuck:.1?})"
        ));
    }
    message
}

impl From<Nv> for NvmlError {
    fn from(e: Nv) -> Self {
        match e {
            Nv::GpuLost => NvmlError::GpuLost,
            Nv::NotFound | Nv::InvalidArg => NvmlError::NotFound,
            Nv::NotSupported | Nv::FailedToLoadSymbol(_) => NvmlError::NotSupported,
            Nv::Uninitialized
            | Nv::DriverNotLoaded
            | Nv::LibloadingError(_)
            | Nv::LibraryNotFound => NvmlError::Unavailable(e.to_string()),
            other => NvmlError::Failed(other.to_string()),
        }
    }
}

/// Whether NVML answered on this node.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Availability {
    /// Initialised: the driver version and how many GPUs NVML saw then.
    Ready { driver: String, gpus: u32 },
    /// Not usable, and why (library missing, init failed or did not return in time).
    Unavailable(String),
}

/// One physical GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gpu {
    pub index: u32,
    pub uuid: String,
    pub name: String,
    pub minor: u32,
    pub pci_bus_id: String,
    pub memory_bytes: u64,
    pub numa_node: Option<i64>,
    pub cpu_affinity: Vec<u32>,
    pub mig_enabled: bool,
}

/// One MIG device of a GPU in MIG mode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigDevice {
    pub index: u32,
    pub uuid: String,
    pub gpu_instance_id: u32,
    pub compute_instance_id: u32,
    pub profile: String,
    pub memory_bytes: u64,
    pub caps_minors: Vec<u32>,
}

/// How directly two GPUs are connected, nearest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum TopologyLevel {
    Internal,
    Single,
    Multiple,
    HostBridge,
    Node,
    System,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Link {
    pub level: TopologyLevel,
    pub nvlinks: u32,
}

/// NVML as opened from one library path: ready with its event log, or not yet, with why.
pub struct NvmlNode {
    library: PathBuf,
    /// Set once, when an init succeeds; never unset (the library stays loaded for the process).
    nvml: OnceLock<&'static Nvml>,
    /// Why the last attempt failed, until one succeeds.
    availability: Mutex<Availability>,
    events: Arc<events::EventLog>,
    asker: asker::Asker,
}

/// Opens NVML from `library`, once per process and path; later calls return the same node. The
/// node keeps trying on a thread of its own until NVML answers: a library missing or failing
/// (the GPU Operator's driver container installs it after the agent started) is tried again
/// after 1 s, doubling to [`RETRY`]; an init that does not return is waited for as long as it
/// takes, never started twice at once. When NVML becomes ready, the granted modules' health
/// checks are woken, so their devices appear at once. Blocks up to [`INIT_LIMIT`] for the first
/// attempt: call it from a blocking thread.
pub fn open(library: &Path) -> Arc<NvmlNode> {
    static NODES: OnceLock<Mutex<HashMap<PathBuf, Arc<NvmlNode>>>> = OnceLock::new();
    let nodes = NODES.get_or_init(Default::default);
    // Held while the first attempt runs: a second module asking for the same library waits for
    // its answer instead of reading "not tried yet".
    let mut nodes = nodes.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(node) = nodes.get(library) {
        return node.clone();
    }
    let node = Arc::new(NvmlNode {
        library: library.to_owned(),
        nvml: OnceLock::new(),
        availability: Mutex::new(Availability::Unavailable("not opened yet".into())),
        events: Arc::default(),
        asker: asker::Asker::new(),
    });
    let (tx, rx) = mpsc::channel();
    let opener = node.clone();
    let spawned = std::thread::Builder::new()
        .name("nvml-open".into())
        .spawn(move || opener.keep_opening(tx));
    match spawned {
        Err(e) => node.set_unavailable(format!("cannot start the NVML thread: {e}")),
        Ok(_) => {
            if rx.recv_timeout(INIT_LIMIT).is_err() {
                node.set_unavailable(format!(
                    "nvmlInit in {} did not return within {}s (the driver may be wedged); still \
                     waiting for it",
                    library.display(),
                    INIT_LIMIT.as_secs()
                ));
            }
        }
    }
    nodes.insert(library.to_owned(), node.clone());
    node
}

impl NvmlNode {
    /// Tries to initialise NVML until it works; tells `first` after the first attempt.
    fn keep_opening(self: Arc<Self>, first: mpsc::Sender<()>) {
        let mut waits = crate::backoff::Backoff::new(Duration::from_secs(1), RETRY);
        let mut first = Some(first);
        let mut said = String::new();
        loop {
            let attempt = Nvml::builder()
                .lib_path(self.library.as_os_str())
                .init()
                .map(|nvml| {
                    let driver = nvml.sys_driver_version().unwrap_or_default();
                    let gpus = nvml.device_count().unwrap_or(0);
                    (nvml, driver, gpus)
                });
            match attempt {
                Ok((nvml, driver, gpus)) => {
                    let nvml: &'static Nvml = Box::leak(Box::new(nvml));
                    let _ = self.nvml.set(nvml);
                    events::start(nvml, self.events.clone());
                    tracing::info!(library = %self.library.display(), driver, gpus, "NVML ready");
                    *self.availability.lock().unwrap_or_else(|p| p.into_inner()) =
                        Availability::Ready { driver, gpus };
                    if let Some(first) = first.take() {
                        let _ = first.send(());
                    }
                    // Modules that asked while it was not ready look again now.
                    self.events.wake();
                    return;
                }
                Err(e) => {
                    let why = describe_init_error(&self.library, e);
                    if why != said {
                        tracing::warn!("no NVML on this node yet: {why}; trying again");
                        said = why.clone();
                    }
                    self.set_unavailable(why);
                    if let Some(first) = first.take() {
                        let _ = first.send(());
                    }
                    std::thread::sleep(waits.failed());
                }
            }
        }
    }

    fn set_unavailable(&self, why: String) {
        *self.availability.lock().unwrap_or_else(|p| p.into_inner()) =
            Availability::Unavailable(why);
    }

    pub fn library(&self) -> &Path {
        &self.library
    }

    /// Ready, or why not (yet): the node keeps trying until NVML answers.
    pub fn availability(&self) -> Availability {
        self.availability
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Changes whenever NVML answers a module's query: a module whose init found NVML missing
    /// or stuck can be started again then.
    pub fn answered(&self) -> tokio::sync::watch::Receiver<u64> {
        self.asker.answered()
    }

    /// GPUs the event thread is watching for critical events (0 until it has registered them).
    pub fn watched_gpus(&self) -> u32 {
        self.events.watched()
    }

    fn nvml(&self) -> Result<&'static Nvml, NvmlError> {
        match self.nvml.get() {
            Some(nvml) => Ok(nvml),
            None => Err(NvmlError::Unavailable(match self.availability() {
                Availability::Unavailable(why) => why,
                Availability::Ready { .. } => "not opened yet".into(),
            })),
        }
    }

    /// Runs `query` on the node's query thread, waiting for it until `until` at most.
    pub fn ask<T, F>(self: &Arc<Self>, until: Instant, query: F) -> Result<T, NvmlError>
    where
        T: Send + 'static,
        F: FnOnce(&NvmlNode) -> Result<T, NvmlError> + Send + 'static,
    {
        // Not ready: answered here, without a trip to the thread.
        self.nvml()?;
        let node = self.clone();
        self.asker.ask(until, move || query(&node))
    }

    pub fn device_count(&self) -> Result<u32, NvmlError> {
        Ok(self.nvml()?.device_count()?)
    }

    pub fn gpu(&self, index: u32) -> Result<Gpu, NvmlError> {
        let device = self.nvml()?.device_by_index(index)?;
        let numa_node = optional(device.numa_node_id())?.map(i64::from);
        let cpu_affinity = optional(device.cpu_affinity(CPU_WORDS))?
            .map(|words| cpus_of(&words))
            .unwrap_or_default();
        let mig_enabled =
            optional(device.mig_mode())?.is_some_and(|mode| mode.current == MIG_ENABLED);
        Ok(Gpu {
            index,
            uuid: device.uuid()?,
            name: device.name()?,
            minor: device.minor_number()?,
            pci_bus_id: device.pci_info()?.bus_id,
            memory_bytes: device.memory_info()?.total,
            numa_node,
            cpu_affinity,
            mig_enabled,
        })
    }

    /// The MIG devices of GPU `index`; `host_root` is where `/proc/driver/nvidia-caps` is read
    /// from (`/` on a node, a fixture tree in tests).
    pub fn mig_devices(&self, index: u32, host_root: &Path) -> Result<Vec<MigDevice>, NvmlError> {
        let nvml = self.nvml()?;
        let parent = nvml.device_by_index(index)?;
        let enabled = optional(parent.mig_mode())?.is_some_and(|mode| mode.current == MIG_ENABLED);
        if !enabled {
            return Ok(Vec::new());
        }
        let minor = parent.minor_number()?;
        let parent_memory = parent.memory_info()?.total;
        let caps = caps::MigMinors::read(host_root);
        let mut found = Vec::new();
        for slot in 0..parent.mig_device_count()?.min(MAX_MIG_DEVICES) {
            let mig = match parent.mig_device_by_index(slot) {
                Ok(mig) => mig,
                Err(Nv::NotFound | Nv::InvalidArg) => continue,
                Err(e) => return Err(e.into()),
            };
            let gi = instance_id(nvml, &mig, Instance::Gpu)?;
            let ci = instance_id(nvml, &mig, Instance::Compute)?;
            let attributes = mig.attributes()?;
            found.push(MigDevice {
                index: slot,
                uuid: mig.uuid()?,
                gpu_instance_id: gi,
                compute_instance_id: ci,
                profile: profile::name(
                    attributes.gpu_instance_slice_count,
                    attributes.compute_instance_slice_count,
                    attributes.memory_size_mb,
                    parent_memory,
                ),
                memory_bytes: attributes.memory_size_mb.saturating_mul(1 << 20),
                caps_minors: caps.for_instance(minor, gi, ci),
            });
        }
        Ok(found)
    }

    /// How GPUs `a` and `b` are connected: their common PCIe ancestor and the NVLinks between
    /// them.
    pub fn topology(&self, a: u32, b: u32) -> Result<Link, NvmlError> {
        let nvml = self.nvml()?;
        let (da, db) = (nvml.device_by_index(a)?, nvml.device_by_index(b)?);
        let level = if a == b {
            TopologyLevel::Internal
        } else {
            match nvml.topology_common_ancestor(&da, &db)? {
                NvTopology::Internal => TopologyLevel::Internal,
                NvTopology::Single => TopologyLevel::Single,
                NvTopology::Multiple => TopologyLevel::Multiple,
                NvTopology::HostBridge => TopologyLevel::HostBridge,
                NvTopology::Node => TopologyLevel::Node,
                NvTopology::System => TopologyLevel::System,
            }
        };
        let remote = db.pci_info()?.bus_id;
        let mut nvlinks = 0;
        if a != b {
            for link in 0..MAX_NVLINKS {
                let link = da.link_wrapper_for(link);
                // A link that is absent, down or unsupported simply does not count.
                if link.is_active().unwrap_or(false)
                    && link
                        .remote_pci_info()
                        .is_ok_and(|pci| pci.bus_id.eq_ignore_ascii_case(&remote))
                {
                    nvlinks += 1;
                }
            }
        }
        Ok(Link { level, nvlinks })
    }

    /// Buffered critical events with a sequence number above `after`; never blocks.
    pub fn events(&self, after: u64) -> Events {
        self.events.since(after)
    }

    /// The MIG instance buffered event `seq` was raised in, if NVML attributed it to one.
    pub fn event_instance(&self, seq: u64) -> Option<events::MigInstance> {
        self.events.instance_of(seq)
    }

    /// Pokes each of `pokes` whenever a critical event arrives, until the subscription drops.
    pub fn subscribe(&self, pokes: Vec<Arc<tokio::sync::Notify>>) -> Subscription {
        self.events.subscribe(pokes)
    }
}

/// NVML's `NVML_DEVICE_MIG_ENABLE`.
const MIG_ENABLED: u32 = 1;
/// `c_ulong` words of CPU affinity asked for: 1024 CPUs.
const CPU_WORDS: usize = 16;
/// NVML's `NVML_NVLINK_MAX_LINKS`.
const MAX_NVLINKS: u32 = 18;
/// NVML's most MIG devices per GPU is 7; a bound in case a driver says more.
const MAX_MIG_DEVICES: u32 = 64;

enum Instance {
    Gpu,
    Compute,
}

/// The GPU or compute instance ID of a MIG device, which `nvml-wrapper` does not wrap.
fn instance_id(
    nvml: &Nvml,
    device: &nvml_wrapper::Device<'_>,
    which: Instance,
) -> Result<u32, NvmlError> {
    let lib = nvml.lib();
    let symbol = match which {
        Instance::Gpu => &lib.nvmlDeviceGetGpuInstanceId,
        Instance::Compute => &lib.nvmlDeviceGetComputeInstanceId,
    };
    let call = nvml_wrapper::error::nvml_sym(symbol.as_ref())?;
    let mut id: std::ffi::c_uint = 0;
    // SAFETY: the handle comes from this library and is live (NVML handles stay valid until
    // shutdown, which never happens: the library is leaked), and `id` outlives the call.
    nvml_wrapper::error::nvml_try(unsafe { call(device.handle(), &mut id) })?;
    Ok(id)
}

/// A query that a GPU or driver may not support: `None` then, rather than an error.
fn optional<T>(result: Result<T, Nv>) -> Result<Option<T>, NvmlError> {
    match result {
        Ok(value) => Ok(Some(value)),
        Err(Nv::NotSupported | Nv::FailedToLoadSymbol(_) | Nv::FunctionNotFound) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

fn cpus_of(words: &[std::ffi::c_ulong]) -> Vec<u32> {
    let bits = std::ffi::c_ulong::BITS;
    let mut cpus = Vec::new();
    for (w, word) in words.iter().enumerate() {
        for bit in 0..bits {
            if word & (1 << bit) != 0 {
                cpus.push(w as u32 * bits + bit);
            }
        }
    }
    cpus
}

fn describe_init_error(library: &Path, e: Nv) -> String {
    match e {
        Nv::LibloadingError(e) => format!("cannot load {}: {e}", library.display()),
        Nv::DriverNotLoaded => format!(
            "{} loaded, but the NVIDIA driver is not (nvmlInit: driver not loaded)",
            library.display()
        ),
        other => format!("nvmlInit in {} failed: {other}", library.display()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn affinity_words_become_cpu_indexes() {
        let bits = std::ffi::c_ulong::BITS;
        assert_eq!(cpus_of(&[0b1011, 1]), vec![0, 1, 3, bits]);
        assert!(cpus_of(&[0, 0]).is_empty());
    }

    #[test]
    fn a_missing_library_is_a_clear_state() {
        let node = open(Path::new("/nonexistent/libnvidia-ml.so.1"));
        let Availability::Unavailable(why) = node.availability() else {
            panic!("loaded a library that does not exist");
        };
        assert!(why.contains("/nonexistent/libnvidia-ml.so.1"), "{why}");
        assert!(matches!(node.gpu(0), Err(NvmlError::Unavailable(_))));
        assert_eq!(node.events(0).events.len(), 0);
    }
}
