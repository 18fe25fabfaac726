//! The agent: loads every module in the registry and serves each resource it declares, keeps
//! doing so across kubelet restarts, module crashes and registry edits, and keeps the ledger.
//!
//! A module that fails to load is reported and skipped; the others are served regardless, so one
//! broken vendor module never takes the node's other device types down.

mod dev_watch;
pub mod front_ends;
mod ledger_sync;
mod modules;
mod pending;
mod probes;
mod reload;
pub mod status;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use tokio::sync::watch;
use tokio::task::JoinSet;
use wasmtime::Engine;

use crate::config::{ModuleSpec, Registry};
use crate::kubelet::route::Route;
use crate::ledger::Ledger;
use crate::metrics::Metrics;
use crate::nvml::Libraries;
use crate::sandbox::cache::{CacheStats, CompileCache};
use crate::sandbox::engine;

pub use crate::kubelet::resource::{ServedResource, qualify};
use crate::kubelet::{resource, restart_watch};
pub use modules::{plan, start_module};
pub use pending::PendingStatus;

/// Where the agent serves, what it serves and where it keeps its state.
#[derive(Debug, Clone)]
pub struct AgentOptions {
    pub registry: Registry,
    /// The kubelet's device-plugin directory: our sockets go here, next to `kubelet.sock`.
    pub plugin_dir: PathBuf,
    /// Holds the ledger checkpoint and the status socket. None keeps the ledger in memory and
    /// serves no status (the demo, most tests).
    pub state_dir: Option<PathBuf>,
    /// The kubelet's PodResources socket; None disables reconciliation.
    pub pod_resources: Option<PathBuf>,
    pub reconcile_interval: Duration,
    /// How long a fresh allocation may be missing from PodResources before it counts as ended.
    pub reconcile_grace: Duration,
    /// Apply edits of the registry file and replaced module files without a restart.
    pub hot_reload: bool,
    /// Where compiled modules are kept between starts (created 0700); None compiles every time.
    pub cache_dir: Option<PathBuf>,
    /// Modules compiled ahead of time (an image's), looked in on a cache miss when it exists.
    pub precompiled_dir: Option<PathBuf>,
    /// Where CDI spec files are written, for resources whose strategy uses CDI.
    pub cdi_dir: PathBuf,
    /// Where vendor libraries (NVML) are loaded from, for modules granted them.
    pub libraries: Libraries,
    /// How resources register with the kubelet.
    pub registration: Route,
    /// Where `/metrics`, `/healthz` and `/readyz` are served; None serves none.
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// The DRA front end's settings; None serves no module with `front-end = "dra"`.
    pub dra: Option<crate::dra::driver::DraOptions>,
    /// A front end of the embedder's own that serves every module instead of the one the
    /// registry names (how a new front end is tried before it has a `front-end` value).
    pub front_end: Option<CustomFrontEnd>,
    /// How registries are reached for modules with a `source`: TLS roots, insecure ones,
    /// credentials.
    pub registry_access: crate::oci::access::Access,
}

impl AgentOptions {
    pub fn new(registry: Registry, plugin_dir: PathBuf) -> AgentOptions {
        AgentOptions {
            registry,
            plugin_dir,
            state_dir: None,
            pod_resources: None,
            reconcile_interval: Duration::from_secs(30),
            reconcile_grace: Duration::from_secs(60),
            hot_reload: true,
            cache_dir: None,
            precompiled_dir: None,
            cdi_dir: PathBuf::from(crate::cdi::DEFAULT_DIR),
            libraries: Libraries::default(),
            registration: Route::default(),
            metrics_addr: None,
            dra: None,
            front_end: None,
            registry_access: Default::default(),
        }
    }
}

/// A front end given to the agent ([`AgentOptions::front_end`]).
#[derive(Clone)]
pub struct CustomFrontEnd(pub Arc<dyn front_ends::FrontEndKind>);

impl std::fmt::Debug for CustomFrontEnd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CustomFrontEnd")
    }
}

/// What the agent's background tasks share.
pub(crate) struct Shared {
    engine: Engine,
    /// None without a cache directory; `Err` says why the one given is not used.
    cache: Option<Result<Arc<CompileCache>, String>>,
    instance: String,
    plugin_dir: PathBuf,
    route: Route,
    cdi_dir: PathBuf,
    libraries: Libraries,
    ledger: Ledger,
    kubelet_events: watch::Receiver<u64>,
    modules: Mutex<BTreeMap<String, modules::RunningModule>>,
    /// Held while a module claims its resource names.
    claiming: tokio::sync::Mutex<()>,
    /// What the last start of each module reported, by module.
    load_errors: Mutex<BTreeMap<String, Vec<String>>>,
    /// Starts the registry loop has under way, by module (see [`EditStart`]).
    edit_starts: Mutex<BTreeMap<String, EditStart>>,
    edit_generation: std::sync::atomic::AtomicU64,
    reload_error: Mutex<Option<String>>,
    /// How many times a change made the agent read the registry again.
    reloads: std::sync::atomic::AtomicU64,
    metrics: Metrics,
    /// The agent's own loops, by name: `/healthz` fails when one ended before shutdown.
    loops: Mutex<Vec<(&'static str, tokio::task::AbortHandle)>>,
    stopping: std::sync::atomic::AtomicBool,
    /// Module starts and upgrades under way: a module is out of `modules` while it loads, so
    /// readiness must not be judged from that map meanwhile.
    starting: std::sync::atomic::AtomicUsize,
    /// Modules waiting for NVML to answer before they are started again (one waiter each).
    nvml_waiters: Mutex<std::collections::BTreeSet<String>>,
    /// The registry's module files being read at start-up, by module: each start takes its
    /// own, and what is left is dropped once the first starts are done.
    read_ahead: Mutex<BTreeMap<String, modules::ReadAhead>>,
    /// Where and for which node modules with `front-end = "dra"` are served; None: not at all.
    dra: Option<crate::dra::driver::DraOptions>,
    front_end: Option<Arc<dyn front_ends::FrontEndKind>>,
    /// Fetches modules with a `source` into the module store; None without a state directory.
    fetcher: Option<crate::oci::Fetcher>,
    /// Modules whose registry entry waits for a pull, by name.
    pending: Mutex<BTreeMap<String, pending::Pending>>,
    /// What a background pull, or the start after it, reported, by module: kept apart from
    /// `load_errors`, which each registry read replaces.
    pull_errors: Mutex<BTreeMap<String, Vec<String>>>,
}

/// A module start a registry edit asked for, running on its own so that a slow one (a compile
/// that takes minutes) delays neither the next edit nor any other module. It is installed only
/// while it is still its module's latest: a later edit that changes or removes the entry wins,
/// and one that wants exactly what is loading does not load it again.
#[derive(Debug, Clone, PartialEq)]
struct EditStart {
    generation: u64,
    spec: ModuleSpec,
    host_root: PathBuf,
    /// The module file's digest when the edit was read (None for a module from a registry).
    digest: Option<String>,
}

/// Which start [`Shared::start_module_if`] goes on with, once the module is loaded.
#[derive(Clone, Copy)]
enum Over<'a> {
    /// Any: a start from the registry.
    Any,
    /// Only while this registry entry still runs (a restart of the same entry).
    Running(&'a ModuleSpec),
    /// Only while this entry still waits for its pull (the pull's own start).
    Pending(&'a ModuleSpec),
    /// Only while this start is still its module's latest from a registry edit.
    Edit(u64),
}

impl Shared {
    fn serving(&self) -> resource::Serving<'_> {
        resource::Serving {
            plugin_dir: &self.plugin_dir,
            route: &self.route,
            instance: &self.instance,
            kubelet_events: &self.kubelet_events,
            ledger: &self.ledger,
            cdi_dir: &self.cdi_dir,
        }
    }

    fn usable_cache(&self) -> Option<Arc<CompileCache>> {
        self.cache.clone().and_then(Result::ok)
    }

    fn lock_modules(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, modules::RunningModule>> {
        self.modules.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn set_load_errors(&self, module: &str, errors: Vec<String>) {
        let mut all = self.load_errors.lock().unwrap_or_else(|p| p.into_inner());
        if errors.is_empty() {
            all.remove(module);
        } else {
            all.insert(module.to_owned(), errors);
        }
    }

    /// The module starts' load errors and what background pulls reported since.
    fn all_load_errors(&self) -> Vec<String> {
        let mut all: Vec<String> = self
            .load_errors
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .flatten()
            .cloned()
            .collect();
        let pulls = self.pull_errors.lock().unwrap_or_else(|p| p.into_inner());
        for e in pulls.values().flatten() {
            if !all.contains(e) {
                all.push(e.clone());
            }
        }
        all.sort();
        all
    }

    /// The resources served through the device-plugin API.
    fn resources(&self) -> Vec<ServedResource> {
        self.lock_modules()
            .values()
            .flat_map(|m| {
                m.front_end::<front_ends::device_plugin::Served>()
                    .flat_map(|f| f.resources.iter().map(|r| r.served.clone()))
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    /// The resources served as DRA drivers.
    fn dra_resources(&self) -> Vec<String> {
        self.lock_modules()
            .values()
            .flat_map(|m| {
                m.front_end::<front_ends::dra::Drivers>()
                    .flat_map(|f| f.drivers.iter().map(|d| d.name.clone()))
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    /// Has every DRA driver compare its pool with its devices now.
    fn republish_drivers(&self) {
        for m in self.lock_modules().values() {
            for d in m
                .front_end::<front_ends::dra::Drivers>()
                .flat_map(|f| &f.drivers)
            {
                d.republish.notify_one();
            }
        }
    }

    /// Every served name (and key of a front end's own kind), with the module serving it.
    fn served_names(&self) -> BTreeMap<String, String> {
        let mut names = BTreeMap::new();
        for m in self.lock_modules().values() {
            for name in m.front_ends.iter().flat_map(|f| f.names()) {
                names.insert(name, m.spec.name.clone());
            }
        }
        names
    }

    /// Starts the given modules, or upgrades them when they run already: the new instance is
    /// loaded and initialised first, and only then replaces the old one, so a broken new file
    /// leaves the old module serving. Modules start in parallel and each serves (and registers)
    /// as soon as it is ready, so a slow or hung one delays nobody else. Each module's problems
    /// become its load errors.
    async fn start_modules(self: &Arc<Self>, registry: &Registry, names: &[String]) {
        let _starting = Starting::new(&self.starting);
        let mut starting = JoinSet::new();
        let mut tasks = BTreeMap::new();
        for spec in registry.modules.iter().filter(|m| names.contains(&m.name)) {
            let (shared, spec, root) = (self.clone(), spec.clone(), registry.host_root.clone());
            let name = spec.name.clone();
            let task = starting.spawn(async move { shared.start_module(&spec, &root).await });
            tasks.insert(task.id(), name);
        }
        while let Some(done) = starting.join_next_with_id().await {
            let (id, errors) = match done {
                Ok((id, problems)) => (id, problems),
                Err(e) => {
                    let module = tasks.get(&e.id()).map_or("?", String::as_str);
                    let error = format!("module `{module}`: starting it failed: {e}");
                    (e.id(), vec![error])
                }
            };
            for e in &errors {
                tracing::error!("{e}");
            }
            if let Some(module) = tasks.get(&id) {
                self.set_load_errors(module, errors);
            }
        }
    }

    /// Starts (or upgrades) `spec` as a registry edit asks, in a task of its own; see
    /// [`EditStart`]. Its errors replace the module's when it ends, unless a later edit took
    /// over meanwhile.
    fn start_for_edit(
        self: &Arc<Self>,
        spec: ModuleSpec,
        host_root: PathBuf,
        digest: Option<String>,
    ) {
        let generation = self
            .edit_generation
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let start = EditStart {
            generation,
            spec: spec.clone(),
            host_root: host_root.clone(),
            digest,
        };
        self.lock_edit_starts().insert(spec.name.clone(), start);
        self.set_load_errors(&spec.name, Vec::new());
        // Counted from now, not from when the task first runs: readiness must see it at once.
        self.starting
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let shared = self.clone();
        tokio::spawn(async move {
            // Until its errors are recorded: ready means what loaded has said how it went.
            let _starting = Starting(&shared.starting);
            let errors = shared
                .start_module_if(&spec, &host_root, Over::Edit(generation))
                .await;
            let mut starts = shared.lock_edit_starts();
            if starts
                .get(&spec.name)
                .is_some_and(|s| s.generation == generation)
            {
                starts.remove(&spec.name);
                drop(starts);
                for e in &errors {
                    tracing::error!("{e}");
                }
                shared.set_load_errors(&spec.name, errors);
            }
        });
    }

    /// Whether a start of exactly this entry and file is under way already.
    fn starting_already(&self, spec: &ModuleSpec, host_root: &Path, digest: Option<&str>) -> bool {
        self.lock_edit_starts().get(&spec.name).is_some_and(|s| {
            s.spec == *spec && s.host_root == host_root && s.digest.as_deref() == digest
        })
    }

    /// Keeps only the starts under way whose module's new entry (`wanted`: spec, host root,
    /// file digest; None when the module left) is exactly what they load; the others are never
    /// installed, and their modules' load errors go with them.
    fn keep_edit_starts<'a>(
        &self,
        wanted: impl Fn(&str) -> Option<(&'a ModuleSpec, &'a Path, Option<&'a str>)>,
    ) {
        let dropped: Vec<String> = {
            let mut starts = self.lock_edit_starts();
            let stale: Vec<String> = starts
                .iter()
                .filter(|(name, s)| {
                    wanted(name).is_none_or(|(spec, root, digest)| {
                        s.spec != *spec || s.host_root != root || s.digest.as_deref() != digest
                    })
                })
                .map(|(name, _)| name.clone())
                .collect();
            for name in &stale {
                starts.remove(name);
            }
            stale
        };
        for name in dropped {
            self.set_load_errors(&name, Vec::new());
        }
    }

    fn lock_edit_starts(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, EditStart>> {
        self.edit_starts.lock().unwrap_or_else(|p| p.into_inner())
    }

    async fn start_module(self: &Arc<Self>, spec: &ModuleSpec, host_root: &Path) -> Vec<String> {
        self.start_module_if(spec, host_root, Over::Any).await
    }

    /// The file a module loads from: its own, or for a module from a registry its module
    /// store entry. None: the entry is not in the store yet, and the module now waits for its
    /// pull in the background ([`pend`](Self::pend)). Err: why it cannot load.
    async fn module_file(
        self: &Arc<Self>,
        spec: &ModuleSpec,
        host_root: &Path,
    ) -> Result<Option<ModuleSpec>, String> {
        let Some(source) = &spec.source else {
            return Ok(Some(spec.clone()));
        };
        let Some(fetcher) = self.fetcher.clone() else {
            return Err(format!(
                "module `{}`: it comes from {source}, but the agent has no state directory for \
                 its module store (--state-dir)",
                spec.name
            ));
        };
        let (pinned, wanted) = (source.clone(), spec.clone());
        let stored = tokio::task::spawn_blocking(move || fetcher.stored(&pinned, &wanted))
            .await
            .ok()
            .flatten();
        let Some((path, sha256)) = stored else {
            self.pend(spec, host_root);
            return Ok(None);
        };
        // The loader refuses the bytes unless they hash to the entry's name.
        Ok(Some(ModuleSpec {
            path,
            source: None,
            sha256: Some(sha256),
            ..spec.clone()
        }))
    }

    /// [`start_module`](Self::start_module), unless `over` says otherwise (checked once the
    /// new version is loaded, under the claim, so a reload meanwhile wins).
    async fn start_module_if(
        self: &Arc<Self>,
        spec: &ModuleSpec,
        host_root: &Path,
        over: Over<'_>,
    ) -> Vec<String> {
        let file = match self.module_file(spec, host_root).await {
            Ok(Some(file)) => file,
            Ok(None) => return Vec::new(),
            Err(e) => return vec![e],
        };
        let ahead = self
            .read_ahead
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&spec.name);
        let handle = match modules::start_module(
            &self.engine,
            self.usable_cache(),
            &file,
            host_root,
            (&self.libraries, None),
            ahead,
        )
        .await
        {
            Ok(handle) => {
                handle.observe_calls(self.metrics.observer(&spec.name));
                handle
            }
            Err(crate::sandbox::LoadError::Digest { path, .. }) if spec.source.is_some() => {
                // A module store entry whose bytes no longer match its name: deleted, and
                // pulled again.
                tracing::warn!(
                    module = spec.name,
                    entry = %path.display(),
                    "a module store entry no longer matches its digest: deleted, to be pulled again"
                );
                let _ = tokio::fs::remove_file(&path).await;
                // A fresh pull, even when this start is a pull's own (it has nothing left to do).
                self.drop_pending_unless(|pending| pending != spec);
                self.pend(spec, host_root);
                return Vec::new();
            }
            Err(e) => {
                return vec![if self.lock_modules().contains_key(&spec.name) {
                    format!("{e}; the running version keeps serving")
                } else {
                    e.to_string()
                }];
            }
        };
        // Claiming resource names and serving them is quick (the first enumeration runs in each
        // resource's own task) and done one module at a time, so two modules can never both
        // claim a name. An upgrade swaps the new version in behind the running resources.
        let _claiming = self.claiming.lock().await;
        let stopping = self.stopping.load(std::sync::atomic::Ordering::Relaxed);
        let go = match over {
            Over::Any => {
                // A pull of the same entry that landed meanwhile has nothing left to start.
                self.take_pending(spec);
                true
            }
            Over::Running(expected) => {
                !stopping
                    && self
                        .lock_modules()
                        .get(&spec.name)
                        .is_some_and(|m| m.spec == *expected)
            }
            Over::Pending(expected) => !stopping && self.take_own_pending(expected),
            Over::Edit(generation) => {
                let latest = self
                    .lock_edit_starts()
                    .get(&spec.name)
                    .is_some_and(|s| s.generation == generation);
                if latest {
                    self.take_pending(spec);
                }
                !stopping && latest
            }
        };
        if !go {
            return Vec::new();
        }
        let old = self.lock_modules().remove(&spec.name);
        let taken = self.served_names();
        let (running, errors) = match old {
            Some(old) => {
                let front = (self.dra.as_ref(), self.front_end.as_ref());
                modules::upgrade(old, handle, spec, host_root, &self.serving(), &taken, front).await
            }
            None => {
                let front = (self.dra.as_ref(), self.front_end.as_ref());
                modules::serve_all(handle, spec, host_root, &self.serving(), &taken, front).await
            }
        };
        let version = running.handle().version().to_owned();
        // Said as each module is served, not once every module is: one module's slow start
        // (an NVML init, a pull) holds back no other module's line.
        let sockets: BTreeMap<String, PathBuf> = running
            .front_end::<front_ends::device_plugin::Served>()
            .flat_map(|f| f.resources.iter())
            .map(|r| (r.served.name.clone(), r.served.socket.clone()))
            .collect();
        for resource in running.front_ends.iter().flat_map(|f| f.resources()) {
            match sockets.get(&resource) {
                Some(socket) => {
                    let socket = socket.display();
                    tracing::info!(module = spec.name, version, resource, %socket, "serving");
                }
                None => tracing::info!(module = spec.name, version, resource, "serving"),
            }
        }
        let without_nvml = running
            .handle()
            .nvml()
            .filter(|_| running.handle().started_without_nvml())
            .cloned();
        self.lock_modules().insert(spec.name.clone(), running);
        self.clear_pull_error(&spec.name);
        if let Some(nvml) = without_nvml {
            self.start_again_when_nvml_answers(&nvml, &spec.name, host_root);
        }
        errors
    }

    /// A module granted NVML that initialised while NVML was missing or stuck declared its
    /// resources without it (MIG profiles, under `mig-strategy = "mixed"`): when NVML next
    /// answers one of its queries, it is started again, as an upgrade to the same file is, so its
    /// resources are what the GPUs say without a registry edit or a restart. Its running
    /// resources keep serving meanwhile. One waiter per module.
    fn start_again_when_nvml_answers(
        self: &Arc<Self>,
        nvml: &Arc<crate::nvml::NvmlNode>,
        name: &str,
        host_root: &Path,
    ) {
        let fresh = self
            .nvml_waiters
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(name.to_owned());
        if !fresh {
            return;
        }
        let mut answered = nvml.answered();
        answered.borrow_and_update();
        let (shared, name, root) = (self.clone(), name.to_owned(), host_root.to_owned());
        tokio::spawn(async move {
            let heard = answered.changed().await.is_ok();
            shared
                .nvml_waiters
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&name);
            if !heard || shared.stopping.load(std::sync::atomic::Ordering::Relaxed) {
                return;
            }
            // Whatever version runs now, if it too started without NVML.
            let spec = shared
                .lock_modules()
                .get(&name)
                .filter(|m| m.handle().started_without_nvml())
                .map(|m| m.spec.clone());
            let Some(spec) = spec else { return };
            tracing::info!(
                module = name,
                "NVML answers now: starting the module again so it sees the GPUs at init"
            );
            let errors = Box::pin(shared.start_module_if(&spec, &root, Over::Running(&spec))).await;
            for e in &errors {
                tracing::error!("{e}");
            }
        });
    }

    fn watch_loop(&self, name: &'static str, task: tokio::task::AbortHandle) {
        self.loops
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((name, task));
    }

    /// Waits until every served resource has its first snapshot (each is bounded by its
    /// module's health deadline, and they are taken in parallel).
    async fn first_snapshots(&self) {
        let mut ready: Vec<_> = self.resources().into_iter().map(|r| r.ready).collect();
        for r in &mut ready {
            let _ = r.wait_for(|r| *r).await;
        }
    }

    /// Stops a module's resources; `retire` when it left the registry (not when the agent
    /// stops), so their CDI specs go too.
    async fn stop_module(&self, name: &str, retire: bool) {
        let running = self.lock_modules().remove(name);
        if let Some(running) = running {
            running.stop(retire).await;
        }
    }
}

/// A running agent. Stop it with [`Agent::shutdown`].
pub struct Agent {
    shared: Arc<Shared>,
    stop: watch::Sender<bool>,
    tasks: JoinSet<()>,
    _kubelet_watch: restart_watch::KubeletWatch,
    metrics_addr: Option<std::net::SocketAddr>,
}

impl Agent {
    /// Loads the modules and starts serving; registration with the kubelet proceeds in the
    /// background (and is retried) so a kubelet that is not up yet does not stop the agent.
    pub async fn start(options: AgentOptions) -> anyhow::Result<Agent> {
        // Each module's file is read and hashed meanwhile, on threads of their own.
        let read_ahead: BTreeMap<String, modules::ReadAhead> = options
            .registry
            .modules
            .iter()
            .filter(|m| m.source.is_none())
            .map(|m| (m.name.clone(), modules::ReadAhead::start(m)))
            .collect();
        let engine = engine::new_engine().map_err(|e| anyhow::anyhow!("{e:#}"))?;
        let instance = instance_id();
        // Bound first: a port in use is a configuration error worth stopping for, and the
        // probes must answer while modules compile.
        let metrics_listener = match options.metrics_addr {
            Some(addr) => Some(
                tokio::net::TcpListener::bind(addr)
                    .await
                    .with_context(|| format!("serving metrics on {addr}"))?,
            ),
            None => None,
        };
        let metrics_addr = match &metrics_listener {
            Some(l) => Some(l.local_addr().context("the metrics address")?),
            None => None,
        };
        let socket_dir = options.registration.socket_dir(&options.plugin_dir);
        resource::check_socket_dir(socket_dir, &instance).map_err(anyhow::Error::msg)?;
        for dir in [&options.plugin_dir, socket_dir] {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        remove_stale_sockets(socket_dir, &instance);
        // Our sockets' directory: on the kubelet.sock route also where a restarted kubelet
        // shows itself.
        let kubelet_watch = restart_watch::watch_plugin_dir(socket_dir)
            .with_context(|| format!("watching {}", socket_dir.display()))?;
        if let Some(dir) = &options.state_dir {
            // What is kept there is trusted because of where it is: the ledger, the compile
            // cache (machine code) and the status socket.
            crate::trust::private_dir(dir).map_err(|e| {
                anyhow::anyhow!(
                    "the state directory {} cannot be trusted: {e}; whoever can change it could \
                     swap the ledger, the status socket or precompiled modules ({})",
                    dir.display(),
                    e.fix()
                )
            })?;
        }
        let metrics = Metrics::default();
        let ledger = match &options.state_dir {
            Some(dir) => Ledger::open(dir).context("opening the allocation ledger")?,
            None => Ledger::in_memory(),
        };
        // Only saves time: a cache that cannot be used is reported, not fatal.
        let cache = options.cache_dir.as_deref().map(|dir| {
            CompileCache::open_with_precompiled(dir, options.precompiled_dir.as_deref(), &|e| {
                tracing::error!("{e}")
            })
            .map(Arc::new)
        });
        let shared = Arc::new(Shared {
            engine,
            cache,
            instance,
            plugin_dir: options.plugin_dir.clone(),
            route: options.registration.clone(),
            cdi_dir: options.cdi_dir.clone(),
            libraries: options.libraries.clone(),
            ledger,
            kubelet_events: kubelet_watch.events.clone(),
            modules: Mutex::new(BTreeMap::new()),
            claiming: tokio::sync::Mutex::new(()),
            load_errors: Mutex::new(BTreeMap::new()),
            edit_starts: Mutex::new(BTreeMap::new()),
            edit_generation: Default::default(),
            reload_error: Mutex::new(None),
            reloads: Default::default(),
            metrics: metrics.clone(),
            loops: Mutex::new(Vec::new()),
            stopping: Default::default(),
            starting: Default::default(),
            nvml_waiters: Default::default(),
            read_ahead: Mutex::new(read_ahead),
            fetcher: options.state_dir.as_ref().map(|dir| crate::oci::Fetcher {
                store: crate::oci::store::Store::under(dir),
                access: options.registry_access.clone(),
            }),
            pending: Mutex::new(BTreeMap::new()),
            pull_errors: Mutex::new(BTreeMap::new()),
            front_end: options.front_end.clone().map(|f| f.0),
            dra: options.dra.clone().map(|mut dra| {
                dra.events = metrics.dra_events();
                dra
            }),
        });
        // Counted from before the metrics endpoint answers, so that it never reports ready
        // before the first modules are in.
        let loading = Starting::new(&shared.starting);
        let (stop, stopped) = watch::channel(false);
        let mut tasks = JoinSet::new();
        if let Some(listener) = metrics_listener {
            let endpoints = Arc::new(probes::AgentEndpoints(shared.clone()));
            let serving = tasks.spawn(crate::metrics::http::serve(
                listener,
                endpoints,
                stopped.clone(),
            ));
            shared.watch_loop("metrics", serving);
        }
        let names: Vec<String> = options
            .registry
            .modules
            .iter()
            .map(|m| m.name.clone())
            .collect();
        shared.start_modules(&options.registry, &names).await;
        // Any left (a module whose start ended before loading) are for no one now.
        shared
            .read_ahead
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
        drop(loading);
        shared.first_snapshots().await;
        // Specs of resources that went away, or stopped using CDI, while no agent ran: their
        // names would still resolve, with old edits. The served ones stay until their writers
        // replace them.
        let keep: Vec<PathBuf> = shared
            .resources()
            .into_iter()
            .filter_map(|r| r.cdi.map(|c| c.path))
            .collect();
        let dir = options.cdi_dir.clone();
        let _ = tokio::task::spawn_blocking(move || crate::cdi::remove_stale(&dir, &keep)).await;

        if options.hot_reload {
            let watcher = reload::RegistryWatch::new(&options.registry)
                .context("watching the registry for edits")?;
            let task = tasks.spawn(reload::run(
                shared.clone(),
                options.registry.clone(),
                watcher,
                stopped.clone(),
            ));
            shared.watch_loop("registry reload", task);
        }
        if options.state_dir.is_some() {
            let task = tasks.spawn(shared.ledger.clone().run_writer(stopped.clone()));
            shared.watch_loop("ledger writer", task);
        }
        if let Some(socket) = options.pod_resources.clone() {
            let task = tasks.spawn(ledger_sync::run(
                shared.clone(),
                socket,
                options.reconcile_interval,
                options.reconcile_grace,
                stopped.clone(),
            ));
            shared.watch_loop("reconcile", task);
        }
        if let Some(dir) = &options.state_dir {
            let listener = status::bind(dir)?;
            let socket = dir.join(status::STATUS_SOCKET);
            let task = tasks.spawn(status::serve(
                shared.clone(),
                listener,
                socket,
                stopped.clone(),
            ));
            shared.watch_loop("status", task);
        }
        Ok(Agent {
            shared,
            stop,
            tasks,
            _kubelet_watch: kubelet_watch,
            metrics_addr,
        })
    }

    /// Every resource currently served.
    pub fn resources(&self) -> Vec<ServedResource> {
        self.shared.resources()
    }

    /// The served resource called `name`, if any.
    pub fn resource(&self, name: &str) -> Option<ServedResource> {
        self.resources().into_iter().find(|r| r.name == name)
    }

    /// Why modules (or their resources) of the current registry are not served; each names the
    /// module.
    pub fn load_errors(&self) -> Vec<String> {
        self.shared.all_load_errors()
    }

    /// How many times a change in the registry's or the modules' files made the agent read the
    /// registry again.
    /// Modules waiting for a pull from their registry, and how it goes.
    pub fn pending(&self) -> Vec<PendingStatus> {
        self.shared.pending_status()
    }

    pub fn reloads(&self) -> u64 {
        self.shared
            .reloads
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Why the last registry edit was refused, if it was.
    pub fn reload_error(&self) -> Option<String> {
        self.shared
            .reload_error
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// What the compile cache did since start; None without one.
    pub fn cache_stats(&self) -> Option<CacheStats> {
        self.shared.usable_cache().map(|c| c.stats())
    }

    pub fn ledger(&self) -> &Ledger {
        &self.shared.ledger
    }

    /// What `devicelet status` shows.
    pub fn status(&self) -> status::Status {
        status::collect(&self.shared)
    }

    /// What `/readyz` answers: Ok once every loaded module serves and every resource is
    /// registered with the kubelet.
    pub fn ready(&self) -> Result<(), String> {
        probes::ready(&self.shared)
    }

    /// Resolves when the agent is first [ready](Self::ready), or after `limit` if it is not by
    /// then (a kubelet that is not up, a pull that keeps failing): the end of start-up. Asks
    /// readiness as the kubelet's probe does: at 20 ms (a warm start is ready in about 10),
    /// then ever less often, up to once a second, so an agent left unready idles.
    pub fn started_up(&self, limit: Duration) -> impl Future<Output = ()> + Send + 'static {
        let shared = self.shared.clone();
        async move {
            let deadline = tokio::time::Instant::now() + limit;
            let mut wait = Duration::from_millis(20);
            while probes::ready(&shared).is_err() && tokio::time::Instant::now() < deadline {
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(Duration::from_secs(1));
            }
        }
    }

    /// Where `/metrics`, `/healthz` and `/readyz` are served (the port chosen, for `:0`).
    pub fn metrics_addr(&self) -> Option<std::net::SocketAddr> {
        self.metrics_addr
    }

    /// What `/metrics` answers.
    pub fn metrics(&self) -> String {
        probes::metrics(&self.shared)
    }

    /// Ends the ListAndWatch streams, stops serving, removes our sockets and flushes the ledger.
    pub async fn shutdown(mut self) {
        self.shared
            .stopping
            .store(true, std::sync::atomic::Ordering::Relaxed);
        let _ = self.stop.send(true);
        self.shared.drop_pending_unless(|_| false);
        while self.tasks.join_next().await.is_some() {}
        // Under the claim: a background pull's start in progress finishes first (and is
        // stopped here), and any later one sees `stopping`.
        let _claim = self.shared.claiming.lock().await;
        let names: Vec<String> = self.shared.lock_modules().keys().cloned().collect();
        for name in names {
            self.shared.stop_module(&name, false).await;
        }
        if let Some(dra) = &self.shared.dra {
            dra.retirees.stop_all().await;
        }
        let ledger = self.shared.ledger.clone();
        match tokio::task::spawn_blocking(move || ledger.flush()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::error!("flushing the ledger: {e}"),
            Err(e) => tracing::error!("flushing the ledger: {e}"),
        }
    }
}

/// Counts a start of modules as under way until dropped.
struct Starting<'a>(&'a std::sync::atomic::AtomicUsize);

impl<'a> Starting<'a> {
    fn new(count: &'a std::sync::atomic::AtomicUsize) -> Self {
        count.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Starting(count)
    }
}

impl Drop for Starting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

fn instance_id() -> String {
    let millis = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or_default();
    format!("{millis}-{}", std::process::id())
}

/// Sockets left by an earlier agent that was killed before it could clean up. A socket still
/// answering belongs to a live agent (a rolling update with surge, a second DaemonSet): that
/// one is left alone.
fn remove_stale_sockets(plugin_dir: &Path, instance: &str) {
    let Ok(entries) = std::fs::read_dir(plugin_dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if !name.starts_with("devicelet-") || !name.ends_with(".sock") || name.contains(instance) {
            continue;
        }
        let refused = matches!(
            std::os::unix::net::UnixStream::connect(entry.path()),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused
        );
        if !refused {
            continue;
        }
        match std::fs::remove_file(entry.path()) {
            Ok(()) => tracing::info!("removed stale socket {name} of an earlier agent"),
            Err(e) => tracing::warn!("cannot remove stale socket {name}: {e}"),
        }
    }
}
