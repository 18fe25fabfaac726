//! devicelet's NVIDIA GPU module: the GPUs of a node as NVIDIA's device plugin serves them,
//! read through NVML (the agent's `nvml` interface), with health that recovers.
//!
//! - **Devices.** Each GPU by UUID (or by index), with its NUMA node, name, memory and PCI
//!   address. With `mig-strategy = "single"` a GPU in MIG mode is served as its MIG devices under
//!   the same resource; with `"mixed"` each MIG profile is a resource of its own (`mig-1g.10gb`).
//!   With `"dynamic"` (Dynamic Resource Allocation only; grants `libraries = ["nvml",
//!   "nvml-mig"]`) a GPU in MIG mode is every placement of every profile, each consuming the
//!   GPU's memory slices and compute slices from its counter set, and a claim's `prepare` makes
//!   the instance (its UUID in the claim's status) that `unprepare` destroys (`dynamic.rs`).
//!   With `dra-memory-sharing = true` whole GPUs are shared by their memory through DRA, each
//!   claim choosing time-slicing or MPS in NVIDIA's `GpuConfig` (`sharing.rs`).
//! - **Allocate.** `NVIDIA_VISIBLE_DEVICES` (the default) or CDI names for the specs NVIDIA's
//!   container toolkit generates (`nvidia.com/gpu=<id>`), the device nodes (`/dev/nvidia<minor>`,
//!   and those of `nvidiactl`, `nvidia-uvm`, `nvidia-uvm-tools` and `nvidia-modeset` present, and
//!   the `nvidia-caps` nodes of a MIG device, without which its Allocate fails),
//!   and with MPS the pipe directory, mounted.
//! - **Health.** XID errors and double-bit ECC events make a GPU Unhealthy at once (the agent
//!   wakes `enumerate` when one arrives), except the XIDs in `ignored-xids` (application errors
//!   by default). Unlike NVIDIA's plugin, a GPU is Healthy again once NVML answers for it and no
//!   critical event arrived for `quiet-period`. A GPU NVML reports lost (XID 79, fallen off the
//!   bus) stays listed as Unhealthy, under the ID it had.
//! - **Preferred allocation.** GPUs joined by the most NVLinks, then the nearest on PCIe.
//!   Time-slicing is the agent's sharing (`[module.sharing]`), which calls this with physical IDs.
//!
//! Registry entry:
//!
//! ```toml
//! [[module]]
//! name = "nvidia-gpu"
//! path = "nvidia_gpu.wasm"
//! resource-domain = "nvidia.com"
//!
//! [module.grants]
//! dev = ["/dev/nvidia*", "/dev/nvidia-caps/*"]
//! libraries = ["nvml"]                  # ["nvml", "nvml-mig"] with mig-strategy = "dynamic"
//! mounts = ["/run/nvidia/mps"]          # only with mps-pipe-directory
//!
//! [module.config]
//! resource = "gpu"                      # the default
//! device-id-strategy = "uuid"           # or "index"
//! visible-devices = "envvar"            # or "cdi"
//! cdi-kind = "nvidia.com/gpu"           # names for visible-devices = "cdi"
//! mig-strategy = "none"                 # or "single", "mixed", "dynamic" (DRA)
//! ignored-xids = [13, 31, 43, 45, 68, 109]
//! quiet-period = "5m"                   # Healthy again after this long without a critical event
//! mps-pipe-directory = "/run/nvidia/mps"  # optional: containers share GPUs through MPS
//! mps-shm-directory = "/run/nvidia/mps/shm"  # optional: the MPS daemon's /dev/shm
//! dra-memory-sharing = false            # DRA: whole GPUs shared by memory, per claim
//! ```

mod config;
mod dynamic;
mod preferred;
mod sharing;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant};

use devicelet_sdk::mig::{self, MigLayout};
use devicelet_sdk::nvml::{self, EventKind, Gpu, MigDevice, NvmlError};
use devicelet_sdk::{
    ContainerEdits, CounterSet, Device, DeviceStatus, Health, Plugin, PluginError, Prepared,
    Request, RequestPolicy, ResourceInfo, devnodes, export_plugin,
};

use dynamic::Partition;

use config::{Config, MigStrategy, Visible};

/// The driver's control nodes, handed to every container that has them. Each is optional, as in
/// NVIDIA's plugin: a node without `nvidia-modeset` (no display driver) or, briefly, without
/// `nvidia-uvm` still serves CUDA.
const CONTROL_NODES: [&str; 4] = [
    "/dev/nvidiactl",
    "/dev/nvidia-uvm",
    "/dev/nvidia-uvm-tools",
    "/dev/nvidia-modeset",
];

/// One schedulable unit: a whole GPU, one MIG device of it, or (`dynamic`) one placement a
/// MIG instance can be made at.
#[derive(Debug, Clone)]
struct Unit {
    id: String,
    resource: String,
    gpu: Gpu,
    mig: Option<MigDevice>,
    partition: Option<Partition>,
    /// NVML could not answer for its GPU (lost); listed from what was seen before.
    lost: bool,
}

impl Unit {
    fn uuid(&self) -> &str {
        self.mig.as_ref().map_or(&self.gpu.uuid, |m| &m.uuid)
    }

    /// The product name as NVML gives it for the unit: a MIG device's is its GPU's with the
    /// profile (`NVIDIA A100-SXM4-80GB MIG 1g.10gb`).
    fn name(&self) -> String {
        match (&self.mig, &self.partition) {
            (Some(mig), _) => format!("{} MIG {}", self.gpu.name, mig.profile),
            (None, Some(p)) => format!("{} MIG {}", self.gpu.name, p.profile),
            (None, None) => self.gpu.name.clone(),
        }
    }
}

pub struct NvidiaGpu {
    config: Config,
    quiet: Duration,
    resources: Vec<String>,
    /// The last answer NVML gave for each GPU index, and its MIG devices: a GPU that is lost
    /// later is still listed, as Unhealthy, under the same IDs.
    seen: BTreeMap<u32, (Gpu, Vec<MigDevice>)>,
    /// With `mig-strategy = "dynamic"`, each MIG GPU's geometry and placements, as last read.
    layouts: BTreeMap<u32, (MigLayout, Vec<Partition>)>,
    /// The GPU indexes the last scan found lost: Allocate refuses them without asking NVML.
    lost: BTreeSet<u32>,
    /// Where the next event read starts.
    cursor: u64,
    /// Until when each GPU (by UUID), or one MIG instance of it, counts as sick: its last
    /// critical event plus the quiet period. Kept as an end, computed from the event's age,
    /// because an instance's clock starts when the instance does and cannot express times before
    /// it.
    critical: HashMap<(String, Scope), Sick>,
    /// NVLink/PCIe scores between GPU indexes, read once per instance for `preferred` (at init
    /// when NVML answers then), so that the kubelet's GetPreferredAllocation needs no NVML call.
    links: Option<preferred::Scores>,
}

/// Until when a GPU (or one MIG instance) counts as sick, and why: its last critical sign.
#[derive(Debug, Clone)]
struct Sick {
    until: Instant,
    why: String,
}

/// How a critical event is reported as the reason a device is unhealthy (and so the value of
/// its DRA taint): `XID 79`, `double-bit ECC error`.
fn event_reason(kind: &EventKind) -> String {
    match kind {
        EventKind::Xid(code) => format!("XID {code}"),
        EventKind::DoubleBitEcc => "double-bit ECC error".to_owned(),
    }
}

/// A GPU NVML never answered for: only its index is known.
fn unknown_gpu(index: u32) -> Gpu {
    Gpu {
        index,
        uuid: String::new(),
        name: String::new(),
        minor: u32::MAX,
        pci_bus_id: String::new(),
        memory_bytes: 0,
        numa_node: None,
        cpu_affinity: Vec::new(),
        mig_enabled: false,
    }
}

/// What a critical event concerns: the whole GPU (None), or one MIG instance of it, as (GPU
/// instance ID, compute instance ID); a compute instance ID of [`ANY_COMPUTE_INSTANCE`] means
/// every compute instance of the GPU instance.
type Scope = Option<(u32, u32)>;

/// NVML's 0xFFFFFFFF: no particular compute instance.
const ANY_COMPUTE_INSTANCE: u32 = u32::MAX;

/// Whether a critical event of `scope` concerns the unit with this MIG device (None: a whole GPU).
fn concerns(scope: Scope, mig: Option<&MigDevice>) -> bool {
    match (scope, mig) {
        (None, _) => true,
        // A whole GPU is sick when any part of it is.
        (Some(_), None) => true,
        (Some((gi, ci)), Some(mig)) => {
            gi == mig.gpu_instance_id
                && (ci == ANY_COMPUTE_INSTANCE || ci == mig.compute_instance_id)
        }
    }
}

fn failed(what: &str, e: NvmlError) -> PluginError {
    match e {
        NvmlError::Unavailable(why) => PluginError::Failed(format!("no NVML on this node: {why}")),
        other => PluginError::Failed(format!("{what}: {other:?}")),
    }
}

impl NvidiaGpu {
    /// Every unit NVML shows now, in index order; lost GPUs from what was seen before.
    fn scan(&mut self) -> Result<Vec<Unit>, PluginError> {
        let count = nvml::device_count().map_err(|e| failed("counting GPUs", e))?;
        let mut units = Vec::new();
        let indexes: BTreeSet<u32> = (0..count).chain(self.seen.keys().copied()).collect();
        for index in indexes {
            let (gpu, migs, lost) = match nvml::device(index) {
                Ok(gpu) => {
                    let listed = match self.config.mig_strategy {
                        MigStrategy::Dynamic if gpu.mig_enabled => {
                            dynamic::partitions(&gpu).map(|layout| {
                                self.layouts.insert(index, layout);
                                Vec::new()
                            })
                        }
                        MigStrategy::None => Ok(Vec::new()),
                        _ if gpu.mig_enabled => nvml::mig_devices(index),
                        _ => Ok(Vec::new()),
                    };
                    match listed {
                        // Without the grant to make instances, dynamic MIG cannot serve at all:
                        // said at once, naming the grant, rather than as a sick GPU.
                        Err(NvmlError::Unavailable(why))
                            if self.config.mig_strategy == MigStrategy::Dynamic =>
                        {
                            return Err(PluginError::Failed(format!(
                                "mig-strategy \"dynamic\": {why}"
                            )));
                        }
                        Ok(migs) => {
                            self.seen.insert(index, (gpu.clone(), migs.clone()));
                            (gpu, migs, false)
                        }
                        // A GPU whose MIG devices cannot be listed is sick, not the node.
                        Err(e) => {
                            devicelet_sdk::warn!("GPU {index} ({}): MIG devices: {e:?}", gpu.uuid);
                            let migs = self.seen.get(&index).map(|(_, m)| m.clone());
                            (gpu, migs.unwrap_or_default(), true)
                        }
                    }
                }
                Err(e) => match self.seen.get(&index) {
                    Some((gpu, migs)) => {
                        devicelet_sdk::warn!("GPU {} ({}): {e:?}", index, gpu.uuid);
                        (gpu.clone(), migs.clone(), true)
                    }
                    // Lost before NVML ever answered for it: listed (Unhealthy) by its index,
                    // so the node's capacity still counts it, until it answers with its UUID.
                    None if matches!(e, NvmlError::GpuLost) => {
                        units.push(Unit {
                            id: self.config.lost_id(index),
                            resource: self.config.resource.clone(),
                            gpu: unknown_gpu(index),
                            mig: None,
                            partition: None,
                            lost: true,
                        });
                        continue;
                    }
                    // Not answering now (NVML stalled): nothing to name it by yet.
                    None => continue,
                },
            };
            if lost {
                self.lost.insert(index);
            } else {
                self.lost.remove(&index);
            }
            self.push_units(&mut units, gpu, migs, lost);
        }
        Ok(units)
    }

    /// The units one GPU is served as: itself, or its MIG devices.
    fn push_units(&self, units: &mut Vec<Unit>, gpu: Gpu, migs: Vec<MigDevice>, lost: bool) {
        if gpu.mig_enabled && self.config.mig_strategy == MigStrategy::Dynamic {
            let partitions = self.layouts.get(&gpu.index).map(|(_, p)| p.as_slice());
            for p in partitions.unwrap_or_default() {
                units.push(Unit {
                    id: p.id(),
                    resource: self.config.resource.clone(),
                    gpu: gpu.clone(),
                    mig: None,
                    partition: Some(p.clone()),
                    lost,
                });
            }
            return;
        }
        let mig_mode = gpu.mig_enabled && self.config.mig_strategy != MigStrategy::None;
        if !mig_mode {
            units.push(Unit {
                id: self.config.id(&gpu, None),
                resource: self.config.resource.clone(),
                gpu,
                mig: None,
                partition: None,
                lost,
            });
            return;
        }
        for mig in migs {
            let resource = match self.config.mig_strategy {
                MigStrategy::Mixed => format!("mig-{}", mig.profile),
                _ => self.config.resource.clone(),
            };
            units.push(Unit {
                id: self.config.id(&gpu, Some(&mig)),
                resource,
                gpu: gpu.clone(),
                mig: Some(mig),
                partition: None,
                lost,
            });
        }
    }

    /// The units of `resource` as this instance last saw them (lost ones as the last scan found
    /// them), with no NVML query: what Allocate needs (IDs, device minors, memory) does not
    /// change while the GPU is there, and
    /// NVIDIA's own Allocate asks NVML nothing, so a stalled NVML must not hold it. Empty
    /// before this instance has seen any GPU.
    fn seen_units(&self, resource: &str) -> Vec<Unit> {
        let mut units = Vec::new();
        for (index, (gpu, migs)) in &self.seen {
            let lost = self.lost.contains(index);
            self.push_units(&mut units, gpu.clone(), migs.clone(), lost);
        }
        units.retain(|u| u.resource == resource);
        units
    }

    /// Reads the events since the last read and notes the critical ones.
    fn read_events(&mut self) {
        let batch = nvml::events(self.cursor);
        let first = self.cursor == 0;
        self.cursor = batch.next;
        let now = Instant::now();
        // A fresh instance reads the whole buffer: what it missed before the oldest event still
        // held matters only if that event is itself within the quiet period.
        let recent = |age_ms: u64| Duration::from_millis(age_ms) < self.quiet;
        let relevant = !first || batch.events.first().is_some_and(|e| recent(e.age_ms));
        if batch.missed > 0 && relevant {
            devicelet_sdk::warn!("missed {} NVML events: every GPU is suspect", batch.missed);
            for (gpu, _) in self.seen.values() {
                let sick = Sick {
                    until: now + self.quiet,
                    why: "NVML events missed".to_owned(),
                };
                self.critical.insert((gpu.uuid.clone(), None), sick);
            }
        }
        for event in batch.events {
            if let EventKind::Xid(code) = event.kind
                && self.config.ignored_xids.contains(&code)
            {
                devicelet_sdk::info!("GPU {}: XID {code} ignored", event.gpu_uuid);
                continue;
            }
            // As NVIDIA's plugin: an XID NVML attributes to one MIG instance makes only that MIG
            // device sick; one about the whole GPU, every unit of it.
            let scope =
                nvml::event_instance(event.seq).map(|m| (m.gpu_instance_id, m.compute_instance_id));
            match scope {
                Some((gi, ci)) => devicelet_sdk::warn!(
                    "GPU {}: critical event {:?} in MIG GPU instance {gi}, compute instance {ci}",
                    event.gpu_uuid,
                    event.kind
                ),
                None => {
                    devicelet_sdk::warn!("GPU {}: critical event {:?}", event.gpu_uuid, event.kind)
                }
            }
            let sick = Sick {
                until: now
                    + self
                        .quiet
                        .saturating_sub(Duration::from_millis(event.age_ms)),
                why: event_reason(&event.kind),
            };
            let last = self
                .critical
                .entry((event.gpu_uuid, scope))
                .or_insert_with(|| sick.clone());
            if sick.until >= last.until {
                *last = sick;
            }
        }
    }

    /// The unit's health, and why it is unhealthy: the latest critical sign still within its
    /// quiet period.
    fn health(&mut self, unit: &Unit) -> (Health, Option<String>) {
        const LOST: &str = "lost: NVML cannot reach it (fallen off the bus)";
        if unit.lost {
            if !unit.gpu.uuid.is_empty() {
                let sick = Sick {
                    until: Instant::now() + self.quiet,
                    why: LOST.to_owned(),
                };
                self.critical.insert((unit.gpu.uuid.clone(), None), sick);
            }
            return (Health::Unhealthy, Some(LOST.to_owned()));
        }
        let now = Instant::now();
        let sick = self
            .critical
            .iter()
            .filter(|((uuid, scope), sick)| {
                *uuid == unit.gpu.uuid && now < sick.until && concerns(*scope, unit.mig.as_ref())
            })
            .max_by_key(|(_, sick)| sick.until);
        match sick {
            Some((_, sick)) => (Health::Unhealthy, Some(sick.why.clone())),
            None => (Health::Healthy, None),
        }
    }

    /// Asks the host to enumerate again when the next quiet period ends, so a GPU is Healthy
    /// again then rather than at the next health interval.
    fn recheck_when_quiet(&mut self) {
        let now = Instant::now();
        self.critical.retain(|_, sick| sick.until > now);
        if let Some(next) = self.critical.values().map(|sick| sick.until).min() {
            // A millisecond past the end, so the next look finds it over.
            devicelet_sdk::schedule::recheck_after(next - now + Duration::from_millis(1));
        }
    }

    /// Reads the links between the GPUs seen, keeping them when every pair answered; returns
    /// them when some did not (to use once, and read again next time).
    fn read_links(&mut self) -> Option<preferred::Scores> {
        if self.seen.is_empty() {
            return None;
        }
        let indexes: Vec<u32> = self.seen.keys().copied().collect();
        let (scores, complete) = preferred::Scores::read(&indexes);
        if complete {
            self.links = Some(scores);
            None
        } else {
            Some(scores)
        }
    }

    /// The units of `resource` with these IDs, as this instance last saw them when it saw them
    /// all there (the kubelet's path asks NVML nothing then), else as NVML shows them now.
    fn chosen(&mut self, resource: &str, ids: &[String]) -> Result<Vec<Unit>, PluginError> {
        // Asked again only for a GPU this instance never saw, or one it last saw lost (it may
        // be back: the instance that watches health is another one).
        let seen = self.seen_units(resource);
        let known = ids
            .iter()
            .all(|id| seen.iter().any(|u| &u.id == id && !u.lost));
        let units = if known {
            seen
        } else {
            self.units_of(resource)?
        };
        let mut chosen = Vec::new();
        for id in ids {
            let unit = units
                .iter()
                .find(|u| &u.id == id)
                .ok_or_else(|| PluginError::UnknownDevice(id.clone()))?;
            if unit.lost {
                return Err(PluginError::Failed(format!("GPU {id} is lost")));
            }
            chosen.push(unit.clone());
        }
        Ok(chosen)
    }

    fn mps_dirs(&self) -> sharing::MpsDirs<'_> {
        sharing::MpsDirs {
            pipe: self.config.mps_pipe_directory.as_deref(),
            shm: self.config.mps_shm_directory.as_deref(),
        }
    }

    /// What a container needs for these devices (never a MIG placement: its instance is made
    /// at prepare), and the units they are.
    fn allocate_units(
        &mut self,
        resource: &str,
        ids: &[String],
    ) -> Result<(ContainerEdits, Vec<Unit>), PluginError> {
        let units = self.chosen(resource, ids)?;
        if let Some(p) = units.iter().find_map(|u| u.partition.as_ref()) {
            return Err(PluginError::Failed(format!(
                "{} is a MIG placement (mig-strategy \"dynamic\"): its instance is made when a \
                 Dynamic Resource Allocation claim is prepared, which the device-plugin API \
                 cannot do",
                p.id()
            )));
        }
        let chosen: Vec<&Unit> = units.iter().collect();
        let edits = self.edits(ids.to_vec(), &chosen)?;
        Ok((edits, units))
    }

    /// What a container needs for these units, named to the NVIDIA stack as `names` (their
    /// IDs, or a made MIG instance's UUID).
    fn edits(&self, names: Vec<String>, chosen: &[&Unit]) -> Result<ContainerEdits, PluginError> {
        let mut edits = ContainerEdits::default();
        match self.config.visible {
            Visible::Envvar => {
                edits = edits.env("NVIDIA_VISIBLE_DEVICES", names.join(","));
                edits = device_nodes(edits, chosen)?;
            }
            Visible::Cdi => {
                for name in &names {
                    edits = edits.cdi(format!("{}={name}", self.config.cdi_kind));
                }
            }
        }
        if let Some(dir) = &self.config.mps_pipe_directory {
            edits = edits
                .env("CUDA_MPS_PIPE_DIRECTORY", dir.clone())
                .mount(dir, dir, false);
            // The container's share, as NVIDIA's MPS daemon sets it for each client: the
            // client's own limits, which MPS enforces (the GPU is device 0 in the container).
            if let (Some(replicas), Some(unit)) = (self.config.mps_replicas, chosen.first()) {
                let memory_mib = unit
                    .mig
                    .as_ref()
                    .map_or(unit.gpu.memory_bytes, |m| m.memory_bytes)
                    >> 20;
                edits = edits
                    .env(
                        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
                        (100 / replicas).max(1).to_string(),
                    )
                    .env(
                        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
                        format!("0={}M", memory_mib / u64::from(replicas)),
                    );
            }
        }
        if let Some(shm) = &self.config.mps_shm_directory {
            // The MPS daemon's shared memory, where its clients expect it.
            edits = edits.mount(shm, "/dev/shm", false);
        }
        Ok(edits)
    }

    fn units_of(&mut self, resource: &str) -> Result<Vec<Unit>, PluginError> {
        if !self.resources.iter().any(|r| r == resource) {
            return Err(PluginError::UnknownResource(resource.into()));
        }
        // Before NVML has ever answered (the driver is not installed yet), there are no GPUs to
        // list; the agent keeps trying and wakes `enumerate` when NVML is ready.
        if self.seen.is_empty()
            && let Err(NvmlError::Unavailable(_)) = nvml::device_count()
        {
            return Ok(Vec::new());
        }
        Ok(self
            .scan()?
            .into_iter()
            .filter(|u| u.resource == resource)
            .collect())
    }
}

impl Plugin for NvidiaGpu {
    fn init(config: &str) -> Result<(Self, Vec<ResourceInfo>), PluginError> {
        let config = Config::parse(config)?;
        let quiet = config.quiet_period()?;
        let mut module = NvidiaGpu {
            config,
            quiet,
            resources: Vec::new(),
            seen: BTreeMap::new(),
            layouts: BTreeMap::new(),
            lost: BTreeSet::new(),
            cursor: 0,
            critical: HashMap::new(),
            links: None,
        };
        // Without NVML yet, serve the GPU resource with no devices: the agent keeps opening NVML
        // and wakes `enumerate` when it answers. MIG profiles (mixed) are known only then, so
        // their resources appear when the module next starts.
        let units = match nvml::device_count() {
            Err(NvmlError::Unavailable(why)) => {
                devicelet_sdk::warn!(
                    "no NVML yet ({why}): serving {} with no GPUs until it answers",
                    module.config.resource
                );
                Vec::new()
            }
            // NVML too slow to answer now (a driver busy or recovering): the GPUs appear at the
            // first enumeration it answers.
            Err(e) => {
                devicelet_sdk::warn!(
                    "NVML did not answer at start ({e:?}): serving {} with no GPUs until it does",
                    module.config.resource
                );
                Vec::new()
            }
            Ok(_) => module.scan()?,
        };
        let _ = module.read_links();
        let mut resources = vec![module.config.resource.clone()];
        let profiles: BTreeSet<&str> = units
            .iter()
            .filter_map(|u| u.mig.as_ref().map(|m| m.profile.as_str()))
            .collect();
        // A GPU lost before NVML ever answered says nothing about MIG: not counted.
        let whole = units
            .iter()
            .filter(|u| u.mig.is_none() && !u.gpu.uuid.is_empty())
            .count();
        match module.config.mig_strategy {
            MigStrategy::Single if !profiles.is_empty() && whole > 0 => {
                return Err(PluginError::Failed(format!(
                    "mig-strategy \"single\" needs every GPU in MIG mode, as NVIDIA's plugin \
                     does; {whole} GPU(s) here are not: use \"mixed\""
                )));
            }
            MigStrategy::Single if profiles.len() > 1 => {
                return Err(PluginError::Failed(format!(
                    "mig-strategy \"single\" needs every MIG device to have one profile; this node \
                     has {}: use \"mixed\"",
                    profiles.into_iter().collect::<Vec<_>>().join(", ")
                )));
            }
            MigStrategy::Mixed => resources.extend(profiles.iter().map(|p| format!("mig-{p}"))),
            _ => {}
        }
        module.resources = resources.clone();
        // Once per load: the agent's other instances run `init` again right after.
        if devicelet_sdk::context::first_instance() {
            devicelet_sdk::info!(
                "serving {} GPU unit(s) as {}",
                units.len(),
                resources.join(", ")
            );
        }
        // NVLink-aware choice for whole GPUs; MIG devices are left to the agent's NUMA policy.
        let whole_gpus = module.config.mig_strategy != MigStrategy::Single || profiles.is_empty();
        let infos = resources
            .into_iter()
            .map(|name| {
                let preferred = whole_gpus && name == module.config.resource;
                // As NVIDIA's plugin: under MPS a container is one client of one GPU, so
                // never two shares of one GPU (the agent refuses them before asking).
                let mps = module.config.mps_pipe_directory.is_some();
                // Dynamic MIG makes each instance when its claim is prepared.
                let dynamic = module.config.mig_strategy == MigStrategy::Dynamic;
                ResourceInfo::new(name)
                    .with_preferred_allocation(preferred)
                    .with_one_share_per_container(mps)
                    .with_prepares_claims(dynamic)
            })
            .collect();
        Ok((module, infos))
    }

    fn enumerate(&mut self, resource: &str) -> Result<Vec<Device>, PluginError> {
        self.read_events();
        let units = self.units_of(resource)?;
        let devices = units
            .iter()
            .map(|unit| {
                if unit.gpu.uuid.is_empty() {
                    return Device::unhealthy_because(
                        unit.id.clone(),
                        "lost: NVML never answered for it",
                    )
                    .attribute("index", unit.gpu.index.to_string())
                    .attribute("lost", "true");
                }
                let (health, why) = self.health(unit);
                if let Some(p) = &unit.partition {
                    let mut device = p.device(&unit.gpu, Device::new(unit.id.clone(), health));
                    device.health_reason = why;
                    device = device.attribute("name", unit.name());
                    if let Some(node) = unit.gpu.numa_node {
                        device = device.numa_node(node);
                    }
                    return device;
                }
                let mut device = Device::new(unit.id.clone(), health)
                    .attribute("uuid", unit.uuid())
                    .attribute("index", unit.gpu.index.to_string())
                    .attribute("name", unit.name())
                    .attribute("pci-address", short_bus_id(&unit.gpu.pci_bus_id));
                device.health_reason = why;
                match &unit.mig {
                    None => {
                        let memory_mib = unit.gpu.memory_bytes >> 20;
                        device = device
                            .attribute("memory-mib", memory_mib.to_string())
                            .attribute("mig-enabled", unit.gpu.mig_enabled.to_string());
                        if self.config.dra_memory_sharing {
                            // Any amount; a claim that asks none holds it all.
                            device = device.shared_by_capacity().shared_capacity(
                                sharing::MEMORY,
                                format!("{memory_mib}Mi"),
                                RequestPolicy::any(None),
                            );
                        }
                    }
                    Some(mig) => {
                        device = device
                            .attribute("memory-mib", (mig.memory_bytes >> 20).to_string())
                            .attribute("profile", mig.profile.clone())
                            .attribute("parent", unit.gpu.uuid.clone());
                    }
                }
                if let Some(node) = unit.gpu.numa_node {
                    device = device.numa_node(node);
                }
                device
            })
            .collect();
        self.recheck_when_quiet();
        Ok(devices)
    }

    fn counter_sets(&mut self, resource: &str) -> Result<Vec<CounterSet>, PluginError> {
        if self.config.mig_strategy != MigStrategy::Dynamic || resource != self.config.resource {
            return Ok(Vec::new());
        }
        // Every MIG GPU's, lost ones too: their partitions stay listed (Unhealthy).
        Ok(self
            .layouts
            .iter()
            .filter(|(index, _)| self.seen.get(index).is_some_and(|(g, _)| g.mig_enabled))
            .map(|(index, (layout, _))| dynamic::counters(*index, layout))
            .collect())
    }

    fn allocate(&mut self, resource: &str, ids: &[String]) -> Result<ContainerEdits, PluginError> {
        // As NVIDIA's plugin forces for MPS: a container is one MPS client of one GPU.
        if self.config.mps_pipe_directory.is_some() && ids.len() > 1 {
            return Err(PluginError::Failed(format!(
                "with MPS a container gets one share of one GPU, not {} (as NVIDIA's plugin, \
                 which refuses requests for more than one replica under MPS)",
                ids.len()
            )));
        }
        self.allocate_units(resource, ids).map(|(edits, _)| edits)
    }

    fn allocate_request(&mut self, request: &Request) -> Result<ContainerEdits, PluginError> {
        // The device-plugin front end's requests carry no key: its Allocate, MPS settings and
        // all.
        if request.key.is_empty() {
            return self.allocate(&request.resource_name, &request.ids);
        }
        let claim = sharing::ClaimConfig::parse(&request.config)?;
        let (edits, units) = self.allocate_units(&request.resource_name, &request.ids)?;
        let (gpus, partitions) = whole_gpus(&units);
        sharing::edits(edits, &claim, request, gpus, partitions, self.mps_dirs())
    }

    fn validate_config(&mut self, _resource: &str, config: &str) -> Result<(), PluginError> {
        sharing::ClaimConfig::parse(config).map(|_| ())
    }

    fn prepare(&mut self, request: &Request) -> Result<Prepared, PluginError> {
        let claim = sharing::ClaimConfig::parse(&request.config)?;
        let resource = &request.resource_name;
        let units = self.chosen(resource, &request.ids)?;
        let mut names = Vec::new();
        let mut made_units = Vec::new();
        let mut status = Vec::new();
        for unit in units {
            let Some(p) = &unit.partition else {
                names.push(unit.id.clone());
                made_units.push(unit);
                continue;
            };
            // Made here, destroyed by `unprepare`: the agent calls it after a failed prepare
            // too, and after a restart, so an instance made before a failure is not leaked.
            let made = mig::create(p.gpu, &p.profile, p.start).map_err(|e| {
                failed(
                    &format!("making MIG instance {} on GPU {}", p.profile, p.gpu),
                    e,
                )
            })?;
            devicelet_sdk::info!(
                "made MIG instance {} ({}) at slice {} of GPU {} for {}",
                made.uuid,
                p.profile,
                p.start,
                p.gpu,
                request.key
            );
            status.push(DeviceStatus {
                id: unit.id.clone(),
                data: p.status(&made, &unit.gpu),
            });
            names.push(made.uuid.clone());
            made_units.push(Unit {
                mig: Some(made),
                ..unit
            });
        }
        let chosen: Vec<&Unit> = made_units.iter().collect();
        let edits = self.edits(names, &chosen)?;
        let (gpus, partitions) = whole_gpus(&made_units);
        Ok(Prepared {
            edits: sharing::edits(edits, &claim, request, gpus, partitions, self.mps_dirs())?,
            status,
        })
    }

    fn unprepare(&mut self, request: &Request) -> Result<(), PluginError> {
        for id in &request.ids {
            let Some(bus) = dynamic::bus_of(id) else {
                continue;
            };
            // The GPU at that address now: a GPU that is not there holds no instance; one NVML
            // cannot read is asked again at the kubelet's next try.
            let count = nvml::device_count().map_err(|e| failed("counting GPUs", e))?;
            let mut gpu = None;
            for index in 0..count {
                let found =
                    nvml::device(index).map_err(|e| failed(&format!("reading GPU {index}"), e))?;
                if dynamic::bus_label(&found) == bus {
                    gpu = Some(found);
                    break;
                }
            }
            let Some(gpu) = gpu else {
                devicelet_sdk::warn!("{id}: no GPU at {bus} now; nothing of it to destroy");
                continue;
            };
            let partitions = match dynamic::partitions(&gpu) {
                Ok((_, partitions)) => partitions,
                // No MIG mode any more: no instance either.
                Err(NvmlError::NotSupported | NvmlError::NotFound) => continue,
                Err(e) => {
                    return Err(failed(
                        &format!("reading GPU {}'s MIG placements", gpu.index),
                        e,
                    ));
                }
            };
            let Some(p) = partitions.iter().find(|p| &p.id() == id) else {
                continue;
            };
            let destroyed = mig::destroy(p.gpu, &p.profile, p.start).map_err(|e| {
                failed(
                    &format!("destroying MIG instance {} on GPU {}", p.profile, p.gpu),
                    e,
                )
            })?;
            if destroyed {
                devicelet_sdk::info!(
                    "destroyed MIG instance {} at slice {} of GPU {} for {}",
                    p.profile,
                    p.start,
                    p.gpu,
                    request.key
                );
            }
        }
        Ok(())
    }

    fn preferred(
        &mut self,
        resource: &str,
        available: &[String],
        must_include: &[String],
        size: usize,
    ) -> Result<Vec<String>, PluginError> {
        if !self.resources.iter().any(|r| r == resource) {
            return Err(PluginError::UnknownResource(resource.into()));
        }
        // The kubelet's path: no NVML calls once this instance has seen the GPUs and their links.
        if self.seen.is_empty() {
            self.scan()?;
        }
        let partial = match self.links {
            Some(_) => None,
            None => self.read_links(),
        };
        let empty = preferred::Scores::default();
        let scores = self.links.as_ref().or(partial.as_ref()).unwrap_or(&empty);
        let index_of: HashMap<String, u32> = self
            .seen
            .values()
            .map(|(gpu, _)| (self.config.id(gpu, None), gpu.index))
            .collect();
        Ok(preferred::choose(
            available,
            must_include,
            size,
            |a, b| match (index_of.get(a), index_of.get(b)) {
                (Some(&a), Some(&b)) => scores.between(a, b),
                _ => 0,
            },
        ))
    }
}

/// The whole GPUs among `units` (what a claim sharing one may hold of it), and whether any of
/// `units` is a MIG device.
fn whole_gpus(units: &[Unit]) -> (Vec<sharing::WholeGpu>, bool) {
    let whole = units
        .iter()
        .filter(|u| u.mig.is_none() && u.partition.is_none())
        .map(|u| sharing::WholeGpu {
            id: u.id.clone(),
            memory_mib: u.gpu.memory_bytes >> 20,
            bus: short_bus_id(&u.gpu.pci_bus_id),
        })
        .collect();
    (whole, units.iter().any(|u| u.mig.is_some()))
}

/// The device nodes a container needs for these units: the control nodes, each GPU's own, and a
/// MIG device's capability nodes.
fn device_nodes(mut edits: ContainerEdits, units: &[&Unit]) -> Result<ContainerEdits, PluginError> {
    for path in CONTROL_NODES {
        if devnodes::stat(path).is_ok() {
            edits = edits.device(path, path, "rw");
        }
    }
    let mut paths = BTreeSet::new();
    for unit in units {
        paths.insert(format!("/dev/nvidia{}", unit.gpu.minor));
        if let Some(mig) = &unit.mig {
            // Without its capability nodes a MIG device cannot be opened in the container: fail
            // the allocation, as NVIDIA's plugin does, rather than hand over a device that looks
            // allocated and does not work.
            if mig.caps_minors.is_empty() {
                return Err(PluginError::Failed(format!(
                    "MIG device {} has no nvidia-caps minors: the host read none from \
                     /proc/driver/nvidia-caps/mig-minors (is the driver's MIG support loaded, and \
                     is /proc/driver/nvidia-caps visible to the agent?)",
                    mig.uuid
                )));
            }
            for minor in &mig.caps_minors {
                paths.insert(format!("/dev/nvidia-caps/nvidia-cap{minor}"));
            }
        }
    }
    for path in paths {
        edits = edits.device(&path, &path, "rw");
    }
    Ok(edits)
}

/// NVML's `00000000:07:00.0` as sysfs names it, `0000:07:00.0`, lowercase.
pub(crate) fn short_bus_id(bus_id: &str) -> String {
    let id = bus_id.to_ascii_lowercase();
    match id.split_once(':') {
        Some((domain, rest)) if domain.len() > 4 => {
            format!("{}:{rest}", &domain[domain.len() - 4..])
        }
        _ => id,
    }
}

export_plugin!(NvidiaGpu);

#[cfg(test)]
mod tests;
