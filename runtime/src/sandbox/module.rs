//! A running module: its two lanes of cells, the calls the host makes into it, and the checks
//! on every answer.
//!
//! Kubelet calls (Allocate, prestart) and health work (enumerate) go to two separate instances,
//! each in a cell of its own, so an Allocate never queues behind an enumeration and a host call
//! stuck in one lane never blocks the other. A module that offers preferred allocation answers it
//! from a third instance: the kubelet asks it just before an Allocate, and its answer (from what
//! the instance learnt at init) must not wait behind an Allocate stuck in a vendor library. The
//! price is that a module must not rely on state shared between its calls; the SDK says so.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use wasmtime::{Store, StoreLimitsBuilder};

use super::bindings::Plugin;
use super::budget::Budget;
use super::cell::{Factory, Failure, Fate, Lane, LocalBoxFuture};
use super::checks;
use super::error::{CallError, CallKind, LoadError};
use super::host::HostState;
use super::loader::{LoadedModule, ModuleInterface};
use crate::config::Grants;
use crate::device::{
    ContainerEdits, InitContext, Inventory, ModuleInfo, PluginError, Prepared, Request,
    ResourceInfo,
};

#[derive(Default)]
struct Counters {
    traps: AtomicU64,
    deadlines: AtomicU64,
    violations: AtomicU64,
    errors: AtomicU64,
    unavailable: AtomicU64,
    allocate_calls: AtomicU64,
}

/// How often calls into a module failed, by kind.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ModuleStats {
    pub traps: u64,
    pub deadlines: u64,
    /// Answers refused because they broke a rule (see [`super::checks`]).
    pub violations: u64,
    /// Errors the module reported itself.
    pub errors: u64,
    /// Calls refused while the module was down (crashed, backing off, failed).
    pub unavailable: u64,
    /// Cells abandoned because a call was stuck in a host call past its deadline.
    #[serde(default)]
    pub abandoned_cells: u64,
    /// Instances made again after the previous one in the same cell trapped or failed.
    #[serde(default)]
    pub restarts: u64,
    /// Log lines (stdout, stderr, `log`) dropped over the rate limit since it was loaded.
    #[serde(default)]
    pub log_lines_dropped: u64,
    /// Calls made to its `allocate`, answers prepared ahead of time included: a single-device
    /// Allocate answered from a prepared answer makes none.
    #[serde(default)]
    pub allocate_calls: u64,
}

/// How a call into a module ended, as metrics count it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Outcome {
    Ok,
    /// The module reported an error itself.
    Error,
    Trap,
    Deadline,
    /// Its answer broke a rule and was refused.
    Violation,
    /// Refused without calling it: the module was down.
    Unavailable,
    /// Its caller stopped waiting (the kubelet gave up, the agent stopped).
    Cancelled,
}

impl Outcome {
    pub fn of<T>(result: &Result<T, CallError>) -> Outcome {
        match result {
            Ok(_) => Outcome::Ok,
            Err(e) => Outcome::of_error(e),
        }
    }

    fn of_error(e: &CallError) -> Outcome {
        match e {
            CallError::Plugin { .. } => Outcome::Error,
            CallError::Trap { .. } => Outcome::Trap,
            CallError::Deadline { .. } | CallError::Overran { .. } | CallError::Stalled { .. } => {
                Outcome::Deadline
            }
            CallError::InvalidOutput { .. } => Outcome::Violation,
            CallError::Unavailable { .. } => Outcome::Unavailable,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Error => "error",
            Outcome::Trap => "trap",
            Outcome::Deadline => "deadline",
            Outcome::Violation => "violation",
            Outcome::Unavailable => "unavailable",
            Outcome::Cancelled => "cancelled",
        }
    }
}

/// Told of every call the host makes into a module, how it ended and how long it took (waiting
/// for the cell included: that is what the kubelet waits). Set by the agent for its metrics;
/// kept outside the sandbox so the sandbox knows nothing of Prometheus.
pub type CallObserver = Arc<dyn Fn(CallKind, Outcome, Duration) + Send + Sync>;

/// One call being timed for the observer.
struct Observed {
    observer: Option<CallObserver>,
    kind: CallKind,
    started: std::time::Instant,
}

impl Observed {
    fn done<T>(mut self, result: Result<T, CallError>) -> Result<T, CallError> {
        if let Some(observe) = self.observer.take() {
            observe(self.kind, Outcome::of(&result), self.started.elapsed());
        }
        result
    }
}

impl Drop for Observed {
    fn drop(&mut self) {
        if let Some(observe) = self.observer.take() {
            observe(self.kind, Outcome::Cancelled, self.started.elapsed());
        }
    }
}

/// A resource's devices' own edits, by device ID.
type OwnEdits = std::collections::HashMap<String, ContainerEdits>;
/// Per resource.
type AllOwnEdits = std::collections::HashMap<String, Arc<OwnEdits>>;

const MAX_TABLE_ELEMENTS: usize = 100_000;
const MAX_INSTANCES: usize = 64;
const MAX_MEMORIES: usize = 8;
const MAX_TABLES: usize = 64;

/// One instance of the module, owned by one cell.
pub struct Instance {
    store: Store<HostState>,
    plugin: Plugin,
    info: ModuleInfo,
    /// NVML did not answer during its `init`.
    nvml_stalled_at_init: bool,
}

impl Instance {
    /// The guest's `allocate` alone: no cell, deadline or checks. For measuring what those cost
    /// (the benchmarks); the agent never calls it.
    pub async fn allocate_bare(
        &mut self,
        resource: &str,
        ids: &[String],
    ) -> anyhow::Result<ContainerEdits> {
        let _ticking = super::engine::ticking();
        let request = Request::without_config(resource, ids.to_vec());
        let answer = self.plugin.allocate(&mut self.store, &request).await?;
        answer.map_err(|e| anyhow::anyhow!("allocate: {e}"))
    }
}

/// A cheap handle to a running module. Clones share its cells.
#[derive(Clone)]
pub struct ModuleHandle {
    name: Arc<str>,
    digest: Arc<str>,
    health_deadline: Duration,
    grants: Arc<Grants>,
    host_root: Arc<PathBuf>,
    /// NUMA nodes read from sysfs for devices the module gives none.
    topology: Arc<crate::policy::topology::TopologyCache>,
    interface: Arc<ModuleInterface>,
    stats: Arc<Counters>,
    deadline: Duration,
    resources: Arc<[ResourceInfo]>,
    /// The module's own version, as its `init` said (empty for a 0.1 module).
    version: Arc<str>,
    /// It exports `release` (0.2).
    has_release: bool,
    /// Allocate and prestart (and preferred, for a module that offers none).
    kubelet: Lane<Instance>,
    /// Preferred allocation, for a module that offers it for some resource.
    preferred: Option<Lane<Instance>>,
    /// Enumeration for the device watchers.
    health: Lane<Instance>,
    fate: Arc<Fate>,
    budget: Arc<Budget>,
    output: Arc<super::host::OutputAllowance>,
    nvml: Option<Arc<crate::nvml::NvmlNode>>,
    observer: Arc<std::sync::OnceLock<CallObserver>>,
    /// Per resource: the edits its devices carried in the last `enumerate` (WIT 0.2), by ID.
    own_edits: Arc<std::sync::Mutex<AllOwnEdits>>,
    /// Per resource: how soon its last `enumerate` asked to be called again (WIT `schedule`).
    rechecks: Arc<std::sync::Mutex<std::collections::HashMap<String, Duration>>>,
    /// Granted NVML, whether it answered when `init` ran (what the module declared may depend
    /// on it: MIG profiles).
    nvml_at_init: bool,
}

impl ModuleHandle {
    /// Starts the module's cells, instantiates it and calls `init` with its config (in its
    /// kubelet cell, under its call deadline). The health cell makes its instance meanwhile,
    /// in the background (the first enumeration runs there).
    ///
    /// `served_as` names the resources a module declared as the agent will serve them: a 0.2
    /// module is told those names at init, so its first instance (which declared them) is
    /// replaced by one that knows them before any call.
    pub async fn start(
        module: LoadedModule,
        served_as: impl Fn(&ResourceInfo) -> Option<String>,
    ) -> Result<ModuleHandle, LoadError> {
        let name = module.name.clone();
        let deadline = module.spec.call_deadline;
        let budget = Arc::new(Budget::new(module.spec.host_memory));
        let module = Arc::new(module);
        let context = Arc::new(std::sync::Mutex::new(Arc::new(InitContext {
            config: module.spec.config.to_string(),
            resource_domain: module.spec.resource_domain.clone(),
            served_as: Vec::new(),
        })));
        let factory: Factory<Instance> = {
            let (module, context) = (module.clone(), context.clone());
            Arc::new(move || {
                let module = module.clone();
                let context = context.lock().unwrap_or_else(|p| p.into_inner()).clone();
                Box::pin(async move { instantiate(&module, &context).await })
            })
        };
        let fate = Arc::new(Fate::default());
        let lane = |label| {
            Lane::new(name.clone(), label, factory.clone(), deadline, fate.clone()).map_err(|e| {
                LoadError::Invalid {
                    module: name.to_string(),
                    message: format!("cannot start a cell: {e}"),
                }
            })
        };
        let nvml_at_init = module
            .nvml
            .as_ref()
            .is_some_and(|n| matches!(n.availability(), crate::nvml::Availability::Ready { .. }));
        let first = lane("kubelet")?;
        let (mut info, mut stalled) = first_init(&first, &module, deadline).await?;
        let served: Vec<(String, String)> = info
            .resources
            .iter()
            .filter_map(|r| served_as(r).map(|s| (r.name.clone(), s)))
            .collect();
        let tell = module.pre.tells_served_names() && !served.is_empty();
        if tell {
            let mut context = context.lock().unwrap_or_else(|p| p.into_inner());
            let mut told = InitContext::clone(&context);
            told.served_as = served;
            *context = Arc::new(told);
        }
        // The first enumeration runs in the health cell: its instance is made now, on a thread
        // of its own, while the kubelet cell's is (re)made, rather than after it.
        let health = lane("health")?;
        warm(&health, deadline);
        let kubelet = if tell {
            // Its cell ends now rather than when start returns: one instance fewer meanwhile.
            drop(first);
            let kubelet = lane("kubelet")?;
            (info, stalled) = first_init(&kubelet, &module, deadline).await?;
            kubelet
        } else {
            first
        };
        let resources = info.resources;
        if let Some(r) = resources
            .iter()
            .find(|r| r.prepares_claims && !module.pre.has_claims())
        {
            return Err(LoadError::Invalid {
                module: name.to_string(),
                message: format!(
                    "resource {} prepares its claims through `claims`, which the module does \
                     not export",
                    r.name
                ),
            });
        }
        let preferred = if resources.iter().any(|r| r.preferred_allocation) {
            let lane = lane("preferred")?;
            // Made now, so the first GetPreferredAllocation finds it ready.
            warm(&lane, deadline);
            Some(lane)
        } else {
            None
        };
        Ok(ModuleHandle {
            name,
            digest: module.digest.as_str().into(),
            health_deadline: module.spec.health_deadline,
            grants: module.grants.clone(),
            host_root: module.host_root.clone(),
            topology: Arc::default(),
            interface: Arc::new(module.interface.clone()),
            stats: Arc::default(),
            deadline,
            resources: resources.into(),
            version: info.version.into(),
            has_release: module.pre.has_release(),
            kubelet,
            preferred,
            health,
            fate,
            budget,
            output: module.output.clone(),
            nvml: module.nvml.clone(),
            observer: Arc::default(),
            own_edits: Arc::default(),
            rechecks: Arc::default(),
            nvml_at_init: nvml_at_init && !stalled,
        })
    }

    /// Has `observer` told of every call from now on; the first observer set stays.
    pub fn observe_calls(&self, observer: CallObserver) {
        let _ = self.observer.set(observer);
    }

    /// Times a call until [`Observed::done`]; a call dropped before (its caller cancelled,
    /// e.g. the kubelet gave up) is counted as cancelled.
    fn observe(&self, kind: CallKind) -> Observed {
        Observed {
            observer: self.observer.get().cloned(),
            kind,
            started: std::time::Instant::now(),
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// sha256 of the module file this instance was compiled from.
    pub fn digest(&self) -> &str {
        &self.digest
    }

    /// Granted NVML, but initialised while NVML was missing or stuck: what it declared (its
    /// resources) may change once NVML answers, so the agent starts it again then.
    pub fn started_without_nvml(&self) -> bool {
        self.nvml.is_some() && !self.nvml_at_init
    }

    /// NVML as the module sees it, when granted: its events wake the module's health checks.
    pub fn nvml(&self) -> Option<&Arc<crate::nvml::NvmlNode>> {
        self.nvml.as_ref()
    }

    /// The WIT version and imports of the module's component.
    pub fn interface(&self) -> &ModuleInterface {
        &self.interface
    }

    /// The module's own version, as its `init` said; empty for a 0.1 module.
    pub fn version(&self) -> &str {
        &self.version
    }

    /// Whether the module wants to be told when an allocation ends (it exports `release`).
    pub fn has_release(&self) -> bool {
        self.has_release
    }

    /// Tells the module an allocation ended (its `release`), in its kubelet lane.
    pub async fn release(&self, request: Request) -> Result<(), CallError> {
        let call = self.observe(CallKind::Release);
        let result = self
            .call(
                &self.kubelet,
                CallKind::Release,
                self.deadline,
                move |i| Box::pin(async move { i.plugin.release(&mut i.store, &request).await }),
                Ok,
            )
            .await;
        call.done(result)
    }

    /// Checks a request's config (a DRA claim's parameters) with the module's
    /// `validate-config`, in its kubelet lane; a module without that export takes no config.
    pub async fn validate_config(&self, resource: &str, config: &str) -> Result<(), CallError> {
        let call = self.observe(CallKind::ValidateConfig);
        let (resource, config) = (resource.to_owned(), config.to_owned());
        let result = self
            .call(
                &self.kubelet,
                CallKind::ValidateConfig,
                self.deadline,
                move |i| {
                    Box::pin(async move {
                        i.plugin
                            .validate_config(&mut i.store, &resource, &config)
                            .await
                    })
                },
                Ok,
            )
            .await;
        call.done(result)
    }

    /// Whether the resource's DRA claims are prepared through the module's `claims` export.
    pub fn prepares_claims(&self, resource: &str) -> bool {
        self.resources
            .iter()
            .any(|r| r.name == resource && r.prepares_claims)
    }

    /// A DRA claim's request prepared by the module's `claims.prepare`, in its kubelet lane:
    /// its edits checked against the grants as `allocate`'s, its status data bounded.
    pub async fn prepare(&self, request: Request) -> Result<Prepared, CallError> {
        let call = self.observe(CallKind::Prepare);
        let (grants, root) = (self.grants.clone(), self.host_root.clone());
        let ids = request.ids.clone();
        let result = self
            .call(
                &self.kubelet,
                CallKind::Prepare,
                self.deadline,
                move |i| Box::pin(async move { i.plugin.prepare(&mut i.store, &request).await }),
                move |mut prepared: Prepared| {
                    checks::edits(&prepared.edits, &grants)?;
                    checks::resolve_edits(&mut prepared.edits, &grants, &root)?;
                    checks::claim_status(&prepared.status, &ids)?;
                    Ok(prepared)
                },
            )
            .await;
        call.done(result)
    }

    /// Undoes a DRA claim's request (`claims.unprepare`), in the kubelet lane.
    pub async fn unprepare(&self, request: Request) -> Result<(), CallError> {
        let call = self.observe(CallKind::Unprepare);
        let result = self
            .call(
                &self.kubelet,
                CallKind::Unprepare,
                self.deadline,
                move |i| Box::pin(async move { i.plugin.unprepare(&mut i.store, &request).await }),
                Ok,
            )
            .await;
        call.done(result)
    }

    /// The resources the module declared at `init`.
    pub fn resources(&self) -> &[ResourceInfo] {
        &self.resources
    }

    /// The resource's devices, checked and charged to the module's host-memory budget (the
    /// snapshot the host keeps is what it costs).
    pub async fn enumerate(&self, resource: &str) -> Result<Inventory, CallError> {
        let call = self.observe(CallKind::Enumerate);
        call.done(self.enumerate_checked(resource).await)
    }

    async fn enumerate_checked(&self, resource: &str) -> Result<Inventory, CallError> {
        let owned = resource.to_owned();
        let (topology, root) = (self.topology.clone(), self.host_root.clone());
        let answer = self
            .call(
                &self.health,
                CallKind::Enumerate,
                self.health_deadline,
                move |i| {
                    Box::pin(async move {
                        let found = i.plugin.enumerate(&mut i.store, &owned).await;
                        let recheck = i.store.data_mut().schedule.take();
                        found.map(|found| found.map(|devices| (devices, recheck)))
                    })
                },
                // Reading sysfs is file-system work: it runs in the cell.
                move |(found, recheck)| {
                    let mut devices = found;
                    checks::inventory(&devices)?;
                    topology.fill(&mut devices, &root);
                    Ok((devices, recheck))
                },
            )
            .await;
        // Only an answer asks for a recheck; a failed call forgets the last one.
        let recheck = answer.as_ref().ok().and_then(|(_, recheck)| *recheck);
        {
            let mut rechecks = self.rechecks.lock().unwrap_or_else(|p| p.into_inner());
            match recheck {
                Some(after) => rechecks.insert(resource.to_owned(), after),
                None => rechecks.remove(resource),
            };
        }
        let (devices, _) = answer?;
        self.check(
            CallKind::Enumerate,
            self.budget.charge(
                resource,
                super::budget::Kept::Devices,
                super::budget::cost(&devices),
            ),
        )?;
        // Only an answer the host keeps gives Allocate its devices' edits.
        let own: OwnEdits = devices
            .iter()
            .filter_map(|d| Some((d.id.clone(), d.edits.clone()?)))
            .collect();
        let mut all = self.own_edits.lock().unwrap_or_else(|p| p.into_inner());
        if own.is_empty() {
            all.remove(resource);
        } else {
            all.insert(resource.to_owned(), Arc::new(own));
        }
        drop(all);
        Ok(devices)
    }

    /// How soon the resource's last `enumerate` asked to be called again, if it did.
    pub fn recheck_after(&self, resource: &str) -> Option<Duration> {
        self.rechecks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(resource)
            .copied()
    }

    /// Charges `bytes` of Allocate answers prepared for `resource` (their new total) to the
    /// module's host-memory budget; refused, changing nothing, when over it.
    pub fn keep_answers(&self, resource: &str, bytes: usize) -> Result<(), String> {
        self.budget
            .charge(resource, super::budget::Kept::Answers, Ok(bytes))
            .map_err(|message| format!("module `{}`: {message}", self.name))
    }

    /// Forgets what the host keeps for `resource` (it is no longer served).
    pub fn forget(&self, resource: &str) {
        self.own_edits
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(resource);
        self.budget.release(resource);
    }

    /// What a container needs for the request's devices: the union of the devices' own edits
    /// when every one of them carried some in the last enumeration and the request has no config
    /// (checked as an answer is; the module is not called), else the module's `allocate`.
    pub async fn allocate(&self, request: Request) -> Result<ContainerEdits, CallError> {
        if let Some(own) = self.own_edits_of(&request) {
            let (grants, root) = (self.grants.clone(), self.host_root.clone());
            let ids = request.ids;
            let checked = tokio::task::spawn_blocking(move || {
                let mut edits = ContainerEdits::union(ids.iter().filter_map(|id| own.get(id)));
                checks::edits(&edits, &grants)?;
                checks::resolve_edits(&mut edits, &grants, &root)?;
                Ok(edits)
            })
            .await
            .unwrap_or_else(|e| Err(format!("checking the devices' edits failed: {e}")));
            return checked.map_err(|message| {
                self.stats.violations.fetch_add(1, Ordering::Relaxed);
                CallError::InvalidOutput {
                    module: self.name.to_string(),
                    call: CallKind::Enumerate,
                    message: format!("the devices' own edits: {message}"),
                }
            });
        }
        self.allocate_by_module(request).await
    }

    /// The resource's devices' own edits, if each device of the request has them and the
    /// request has no config.
    fn own_edits_of(&self, request: &Request) -> Option<Arc<OwnEdits>> {
        if !request.config.is_empty() || request.ids.is_empty() {
            return None;
        }
        let all = self.own_edits.lock().unwrap_or_else(|p| p.into_inner());
        let own = all.get(&request.resource)?;
        request
            .ids
            .iter()
            .all(|id| own.contains_key(id))
            .then(|| own.clone())
    }

    /// Takes over `old`'s devices' edits (an upgrade): they hold for the snapshot the kubelet
    /// still has until this version's first enumeration replaces them.
    pub fn inherit_own_edits(&self, old: &ModuleHandle) {
        let inherited = old
            .own_edits
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        *self.own_edits.lock().unwrap_or_else(|p| p.into_inner()) = inherited;
    }

    async fn allocate_by_module(&self, request: Request) -> Result<ContainerEdits, CallError> {
        self.stats.allocate_calls.fetch_add(1, Ordering::Relaxed);
        let call = self.observe(CallKind::Allocate);
        let (grants, root) = (self.grants.clone(), self.host_root.clone());
        let result = self
            .call(
                &self.kubelet,
                CallKind::Allocate,
                self.deadline,
                move |i| Box::pin(async move { i.plugin.allocate(&mut i.store, &request).await }),
                // Resolving device nodes and mount sources is file-system work: it runs in the cell.
                move |mut edits| {
                    checks::edits(&edits, &grants)?;
                    checks::resolve_edits(&mut edits, &grants, &root)?;
                    Ok(edits)
                },
            )
            .await;
        call.done(result)
    }

    pub async fn prestart(&self, resource: &str, ids: Vec<String>) -> Result<(), CallError> {
        let call = self.observe(CallKind::Prestart);
        let resource = resource.to_owned();
        let result = self
            .call(
                &self.kubelet,
                CallKind::Prestart,
                self.deadline,
                move |i| {
                    Box::pin(async move { i.plugin.prestart(&mut i.store, &resource, &ids).await })
                },
                Ok,
            )
            .await;
        call.done(result)
    }

    pub async fn preferred(
        &self,
        resource: &str,
        available: Vec<String>,
        must_include: Vec<String>,
        size: u32,
    ) -> Result<Vec<String>, CallError> {
        let call = self.observe(CallKind::Preferred);
        let resource = resource.to_owned();
        let offered = available.clone();
        let size_limit = usize::try_from(size).unwrap_or(usize::MAX);
        let lane = self.preferred.as_ref().unwrap_or(&self.kubelet);
        let result = self
            .call(
                lane,
                CallKind::Preferred,
                self.deadline,
                move |i| {
                    Box::pin(async move {
                        i.plugin
                            .preferred(&mut i.store, &resource, &available, &must_include, size)
                            .await
                    })
                },
                move |chosen| checks::chosen_ids(&chosen, &offered, size_limit).map(|()| chosen),
            )
            .await;
        call.done(result)
    }

    /// What went wrong with this module so far, for status and metrics.
    pub fn stats(&self) -> ModuleStats {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        ModuleStats {
            traps: get(&self.stats.traps),
            deadlines: get(&self.stats.deadlines),
            violations: get(&self.stats.violations),
            errors: get(&self.stats.errors),
            unavailable: get(&self.stats.unavailable),
            abandoned_cells: u64::from(self.fate.abandoned()),
            restarts: self.fate.restarts(),
            log_lines_dropped: self.output.dropped(),
            allocate_calls: get(&self.stats.allocate_calls),
        }
    }

    /// Why the module no longer runs at all (too many cells stuck in host calls); it stays so
    /// until its file or its registry entry changes.
    pub fn failure(&self) -> Option<String> {
        self.fate.failed()
    }

    /// Bytes of host memory its answers hold now, and its budget.
    pub fn host_memory(&self) -> (usize, usize) {
        (self.budget.used(), self.budget.limit())
    }

    /// Turns a broken rule into a counted, logged call error.
    fn check(
        &self,
        call: CallKind,
        verdict: Result<(), checks::Violation>,
    ) -> Result<(), CallError> {
        verdict.map_err(|message| {
            self.stats.violations.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(module = &*self.name, %call, "refused the module's answer: {message}");
            CallError::InvalidOutput {
                module: self.name.to_string(),
                call,
                message,
            }
        })
    }

    fn count(&self, e: &CallError) {
        let counter = match Outcome::of_error(e) {
            Outcome::Error => &self.stats.errors,
            Outcome::Trap => &self.stats.traps,
            Outcome::Deadline => &self.stats.deadlines,
            Outcome::Violation => &self.stats.violations,
            Outcome::Unavailable => &self.stats.unavailable,
            Outcome::Ok | Outcome::Cancelled => return,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// Runs `f` in `lane`'s cell, then `check` on its answer there too (the checks that touch the
    /// file system must not run on the agent's workers), and waits, never past the deadline.
    async fn call<T, U, F, C>(
        &self,
        lane: &Lane<Instance>,
        kind: CallKind,
        deadline: Duration,
        f: F,
        check: C,
    ) -> Result<U, CallError>
    where
        T: 'static,
        U: Send + 'static,
        F: for<'a> FnOnce(&'a mut Instance) -> LocalBoxFuture<'a, super::bindings::Answer<T>>
            + Send
            + 'static,
        C: FnOnce(T) -> Result<U, checks::Violation> + Send + 'static,
    {
        let end = std::time::Instant::now() + deadline;
        // `--log module=NAME:LEVEL` filters on this span.
        let span = tracing::info_span!("module", name = %self.name);
        let answer = lane
            .call(deadline, move |i| {
                Box::pin(async move {
                    i.store.data_mut().nvml.call_ends_at(end, deadline);
                    i.store.data_mut().nvml.calling(kind);
                    // A recheck counts only when asked during this call.
                    i.store.data_mut().schedule.take();
                    let answer = tracing::Instrument::instrument(f(i), span).await;
                    // What the module made of a vendor library that stopped answering is not
                    // its answer: the call missed its deadline.
                    if let Some(stall) = i.store.data_mut().nvml.take_stall() {
                        return Err(Failure::Stalled(stall));
                    }
                    match answer {
                        Ok(Ok(v)) => check(v).map_err(Failure::Violation),
                        Ok(Err(e)) => Err(Failure::Plugin(e)),
                        Err(trap) => Err(Failure::Trap(format!("{trap:#}"))),
                    }
                })
            })
            .await;
        let module = self.name.to_string();
        let result = answer.map_err(|failure| match failure {
            Failure::Plugin(error) => CallError::Plugin {
                module,
                call: kind,
                error,
            },
            Failure::Trap(message) => CallError::Trap {
                module,
                call: kind,
                message,
            },
            Failure::Deadline => CallError::Deadline {
                module,
                call: kind,
                deadline,
            },
            Failure::Overran => CallError::Overran {
                module,
                call: kind,
                deadline,
            },
            Failure::Stalled(message) => CallError::Stalled {
                module,
                call: kind,
                deadline,
                message,
            },
            Failure::Unavailable(reason) => CallError::Unavailable { module, reason },
            Failure::Violation(message) => {
                tracing::warn!(module, %kind, "refused the module's answer: {message}");
                CallError::InvalidOutput {
                    module,
                    call: kind,
                    message,
                }
            }
            instantiate @ Failure::Instantiate { .. } => CallError::Unavailable {
                module,
                reason: format!("re-instantiation failed: {}", failure_message(instantiate)),
            },
        });
        if let Err(e) = &result {
            self.count(e);
        }
        result
    }
}

/// Has `lane` make its instance now, in the background: its first real call then finds it ready.
fn warm(lane: &Lane<Instance>, deadline: Duration) {
    let lane = lane.clone();
    tokio::spawn(async move {
        let _ = lane
            .call(deadline * 2, |_: &mut Instance| Box::pin(async { Ok(()) }))
            .await;
    });
}

/// The lane's first instance, made within twice the call deadline (its init has the whole
/// deadline, as every later re-instantiation does, and the call its own after that): what its
/// `init` answered, and whether NVML stalled meanwhile.
async fn first_init(
    lane: &Lane<Instance>,
    module: &LoadedModule,
    deadline: Duration,
) -> Result<(ModuleInfo, bool), LoadError> {
    let name = &module.name;
    lane.call(deadline * 2, |i: &mut Instance| {
        let answer = (i.info.clone(), i.nvml_stalled_at_init);
        Box::pin(async move { Ok(answer) })
    })
    .await
    .map_err(|failure| {
        LoadError::Init(match failure {
            Failure::Instantiate {
                init_error: Some(PluginError::InvalidConfig(message)),
                ..
            } => {
                return LoadError::Config {
                    module: name.to_string(),
                    at: module.spec.config_at.clone(),
                    message: without_json_position(&message).to_owned(),
                };
            }
            Failure::Instantiate {
                init_error: Some(error),
                ..
            } => CallError::Plugin {
                module: name.to_string(),
                call: CallKind::Init,
                error,
            },
            Failure::Deadline => CallError::Deadline {
                module: name.to_string(),
                call: CallKind::Init,
                deadline,
            },
            other => CallError::Trap {
                module: name.to_string(),
                call: CallKind::Init,
                message: failure_message(other),
            },
        })
    })
}

fn failure_message(failure: Failure) -> String {
    match failure {
        Failure::Plugin(e) => e.to_string(),
        Failure::Trap(m)
        | Failure::Unavailable(m)
        | Failure::Violation(m)
        | Failure::Stalled(m) => m,
        Failure::Instantiate { message, .. } => message,
        Failure::Deadline => "missed its deadline".into(),
        Failure::Overran => "missed its deadline and was not stopped in time".into(),
    }
}

/// `message` without a trailing serde_json position (` at line 1 column 7`): the host hands the
/// module its config as one line of JSON, so the position means nothing to whoever edits the
/// TOML; the registry location is given instead.
fn without_json_position(message: &str) -> &str {
    let Some((head, tail)) = message.rsplit_once(" at line ") else {
        return message;
    };
    let position = tail.split_once(" column ").is_some_and(|(line, column)| {
        [line, column]
            .iter()
            .all(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
    });
    if position { head } else { message }
}

/// A fresh store and instance with the module's limits, initialised with its config. Runs in a
/// cell; the cell bounds it by the module's call deadline.
pub async fn instantiate(
    module: &LoadedModule,
    context: &InitContext,
) -> Result<Instance, Failure> {
    // The memory limit applies to each linear memory, so the number of memories, tables and
    // instances is bounded too; tables are capped far above what compiled Rust needs.
    let limits = StoreLimitsBuilder::new()
        .memory_size(usize::try_from(module.spec.memory_limit).unwrap_or(usize::MAX))
        .table_elements(MAX_TABLE_ELEMENTS)
        .instances(MAX_INSTANCES)
        .memories(MAX_MEMORIES)
        .tables(MAX_TABLES)
        .trap_on_grow_failure(true)
        .build();
    let state = HostState::new(
        module.name.clone(),
        module.host_root.clone(),
        module.grants.clone(),
        limits,
        module.output.clone(),
        module.nvml.clone(),
    );
    let mut store = Store::new(module.pre.engine(), state);
    let deadline = module.spec.call_deadline;
    store
        .data_mut()
        .nvml
        .call_ends_at(std::time::Instant::now() + deadline, deadline);
    store.limiter(|s| &mut s.limits);
    // Yield to the cell's runtime at every epoch tick, so the deadline can fire.
    store.set_epoch_deadline(1);
    store.epoch_deadline_async_yield_and_update(1);
    // `--log module=NAME:LEVEL` filters on this span.
    let span = tracing::info_span!("module", name = %module.name);
    tracing::Instrument::instrument(init(module, context, store), span).await
}

/// Instantiates the module in `store` and calls its `init`.
async fn init(
    module: &LoadedModule,
    context: &InitContext,
    mut store: Store<HostState>,
) -> Result<Instance, Failure> {
    let trapped = |e: wasmtime::Error| Failure::Instantiate {
        message: format!("{e:#}"),
        init_error: None,
    };
    let plugin = module.pre.instantiate(&mut store).await.map_err(trapped)?;
    match plugin.init(&mut store, context).await.map_err(trapped)? {
        Err(error) => Err(Failure::Instantiate {
            message: error.to_string(),
            init_error: Some(error),
        }),
        Ok(info) => Ok(Instance {
            nvml_stalled_at_init: store.data_mut().nvml.take_stall().is_some(),
            store,
            plugin,
            info,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_positions_are_cut_from_config_errors() {
        assert_eq!(
            without_json_position("unknown field `pathz`, expected `groups` at line 1 column 7"),
            "unknown field `pathz`, expected `groups`"
        );
        assert_eq!(
            without_json_position("at line 3 of the manual"),
            "at line 3 of the manual"
        );
        assert_eq!(without_json_position("no GPU"), "no GPU");
    }
}
