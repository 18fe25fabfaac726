//! One long-lived instance per module, owned by one task and fed by a channel.
//!
//! Every call carries a deadline. A call that traps or misses its deadline poisons the instance
//! (wasmtime will not re-enter it), so the actor drops the store and instantiates afresh for the
//! next call. Callers never wait past their deadline, even when queued behind a stuck call.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use wasmtime::{Store, StoreLimitsBuilder};

use super::bindings::v0_1::{DevicePlugin, wit};
use super::error::{CallError, CallKind, LoadError};
use super::host::HostState;
use super::loader::{LoadedModule, ModuleInterface};
use super::types::{ContainerEdits, Device, Health, PluginError, ResourceInfo};
use super::validate;
use crate::config::Grants;

#[derive(Default)]
struct Counters {
    traps: AtomicU64,
    deadlines: AtomicU64,
    violations: AtomicU64,
    errors: AtomicU64,
    unavailable: AtomicU64,
}

/// How often calls into a module failed, by kind.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ModuleStats {
    pub traps: u64,
    pub deadlines: u64,
    /// Answers refused because they broke a rule (see [`super::validate`]).
    pub violations: u64,
    /// Errors the module reported itself.
    pub errors: u64,
    /// Calls refused while the module was down (crashed, backing off).
    pub unavailable: u64,
}

const MAX_TABLE_ELEMENTS: usize = 100_000;
const MAX_INSTANCES: usize = 64;
const MAX_MEMORIES: usize = 8;
const MAX_TABLES: usize = 64;

/// Calls queued per module before callers are told it is busy.
const QUEUE: usize = 64;

struct Instance {
    store: Store<HostState>,
    plugin: DevicePlugin,
}

type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A unit of work for the actor. Returns whether the instance must be discarded.
type Work = Box<dyn for<'a> FnOnce(&'a mut Instance) -> BoxFuture<'a, bool> + Send>;

struct Job {
    /// When the caller stops waiting; a job still queued then is dropped unrun.
    due: Instant,
    /// How long the job may run once started. A job started late (queued behind a slow call)
    /// still gets its whole budget, so a module that is merely busy is never poisoned; only one
    /// that overruns its own deadline is.
    budget: Duration,
    work: Work,
    /// Answers the caller without running `work`.
    refuse: Box<dyn FnOnce(String) + Send>,
}

impl Job {
    fn refuse(self, reason: String) {
        (self.refuse)(reason)
    }
}

/// How a call failed inside the instance.
enum Failure {
    Plugin(PluginError),
    Trap(String),
    /// The instance is down (crashed, backing off); the call never reached the module.
    Unavailable(String),
}

/// A cheap handle to a running module. Clones share the module's actor.
#[derive(Clone)]
pub struct ModuleHandle {
    name: Arc<str>,
    digest: Arc<str>,
    health_deadline: Duration,
    grants: Arc<Grants>,
    interface: Arc<ModuleInterface>,
    stats: Arc<Counters>,
    deadline: Duration,
    resources: Arc<[ResourceInfo]>,
    jobs: mpsc::Sender<Job>,
}

impl ModuleHandle {
    /// Instantiates the module, calls `init` with its config and starts its actor.
    pub async fn start(module: LoadedModule) -> Result<ModuleHandle, LoadError> {
        let name = module.name.clone();
        let digest = module.digest.as_str().into();
        let grants = module.grants.clone();
        let health_deadline = module.spec.health_deadline;
        let interface = Arc::new(module.interface.clone());
        let deadline = module.spec.call_deadline;
        let config = module.spec.config.to_string();
        let (instance, resources) = instantiate(&module, &config).await.map_err(|e| match e {
            Failure::Plugin(error) => LoadError::Init {
                module: name.to_string(),
                source: CallError::Plugin {
                    module: name.to_string(),
                    call: CallKind::Init,
                    error,
                },
            },
            Failure::Trap(message) | Failure::Unavailable(message) => LoadError::Init {
                module: name.to_string(),
                source: CallError::Trap {
                    module: name.to_string(),
                    call: CallKind::Init,
                    message,
                },
            },
        })?;
        let (jobs, rx) = mpsc::channel(QUEUE);
        tokio::spawn(run(module, config, Some(instance), rx));
        Ok(ModuleHandle {
            name,
            digest,
            health_deadline,
            grants,
            interface,
            stats: Arc::default(),
            deadline,
            resources: resources.into(),
            jobs,
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// sha256 of the module file this instance was compiled from.
    pub fn digest(&self) -> &str {
        &self.digest
    }

    /// The WIT version and imports of the module's component.
    pub fn interface(&self) -> &ModuleInterface {
        &self.interface
    }

    /// The resources the module declared at `init`.
    pub fn resources(&self) -> &[ResourceInfo] {
        &self.resources
    }

    pub async fn enumerate(&self, resource: &str) -> Result<Vec<Device>, CallError> {
        let resource = resource.to_owned();
        self.call(CallKind::Enumerate, self.health_deadline, move |i| {
            Box::pin(async move {
                let r = i.plugin.devicelet_plugin_plugin();
                r.call_enumerate(&mut i.store, &resource).await
            })
        })
        .await
        .map(|d| d.into_iter().map(Device::from).collect::<Vec<_>>())
        .and_then(|d| {
            self.check(CallKind::Enumerate, validate::devices(&d))
                .map(|()| d)
        })
    }

    pub async fn health(
        &self,
        resource: &str,
        ids: Vec<String>,
    ) -> Result<Vec<(String, Health)>, CallError> {
        let resource = resource.to_owned();
        let asked = ids.clone();
        let answer = self
            .call(CallKind::Health, self.deadline, move |i| {
                Box::pin(async move {
                    let r = i.plugin.devicelet_plugin_plugin();
                    r.call_health(&mut i.store, &resource, &ids).await
                })
            })
            .await?;
        let unasked = answer.iter().find(|d| !asked.contains(&d.id));
        let verdict = match unasked {
            Some(d) => Err(format!(
                "health reported for device {:?}, which was not asked about",
                d.id
            )),
            None => Ok(()),
        };
        self.check(CallKind::Health, verdict)?;
        Ok(answer
            .into_iter()
            .map(|d| (d.id, d.health.into()))
            .collect())
    }

    pub async fn allocate(
        &self,
        resource: &str,
        ids: Vec<String>,
    ) -> Result<ContainerEdits, CallError> {
        let resource = resource.to_owned();
        self.call(CallKind::Allocate, self.deadline, move |i| {
            Box::pin(async move {
                let r = i.plugin.devicelet_plugin_plugin();
                r.call_allocate(&mut i.store, &resource, &ids).await
            })
        })
        .await
        .map(ContainerEdits::from)
        .and_then(|e| {
            self.check(CallKind::Allocate, validate::edits(&e, &self.grants))
                .map(|()| e)
        })
    }

    pub async fn prestart(&self, resource: &str, ids: Vec<String>) -> Result<(), CallError> {
        let resource = resource.to_owned();
        self.call(CallKind::Prestart, self.deadline, move |i| {
            Box::pin(async move {
                let r = i.plugin.devicelet_plugin_plugin();
                r.call_prestart(&mut i.store, &resource, &ids).await
            })
        })
        .await
    }

    pub async fn preferred(
        &self,
        resource: &str,
        available: Vec<String>,
        must_include: Vec<String>,
        size: u32,
    ) -> Result<Vec<String>, CallError> {
        let resource = resource.to_owned();
        let offered = available.clone();
        let chosen = self
            .call(CallKind::Preferred, self.deadline, move |i| {
                Box::pin(async move {
                    let r = i.plugin.devicelet_plugin_plugin();
                    r.call_preferred(&mut i.store, &resource, &available, &must_include, size)
                        .await
                })
            })
            .await?;
        let size = usize::try_from(size).unwrap_or(usize::MAX);
        self.check(
            CallKind::Preferred,
            validate::chosen_ids(&chosen, &offered, size),
        )?;
        Ok(chosen)
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
        }
    }

    /// Turns a broken rule into a counted, logged call error.
    fn check(
        &self,
        call: CallKind,
        verdict: Result<(), validate::Violation>,
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
        let counter = match e {
            CallError::Plugin { .. } => &self.stats.errors,
            CallError::Trap { .. } => &self.stats.traps,
            CallError::Deadline { .. } => &self.stats.deadlines,
            CallError::InvalidOutput { .. } => &self.stats.violations,
            CallError::Unavailable { .. } => &self.stats.unavailable,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// Queues `f` on the actor and waits for its answer, never longer than the deadline.
    async fn call<T, F>(&self, kind: CallKind, deadline: Duration, f: F) -> Result<T, CallError>
    where
        T: Send + 'static,
        F: for<'a> FnOnce(
                &'a mut Instance,
            )
                -> BoxFuture<'a, wasmtime::Result<Result<T, wit::PluginError>>>
            + Send
            + 'static,
    {
        let due = Instant::now() + deadline;
        let (tx, rx) = oneshot::channel::<Result<T, Failure>>();
        // Whichever of `work` and `refuse` the actor runs answers the caller.
        let reply = Arc::new(std::sync::Mutex::new(Some(tx)));
        let refuse_reply = reply.clone();
        let refuse = Box::new(move |reason: String| {
            if let Some(tx) = refuse_reply.lock().ok().and_then(|mut tx| tx.take()) {
                let _ = tx.send(Err(Failure::Unavailable(reason)));
            }
        });
        let work: Work = Box::new(move |instance| {
            Box::pin(async move {
                let (result, poisoned) = match f(instance).await {
                    Ok(Ok(v)) => (Ok(v), false),
                    Ok(Err(e)) => (Err(Failure::Plugin(e.into())), false),
                    Err(trap) => (Err(Failure::Trap(format!("{trap:#}"))), true),
                };
                if let Some(tx) = reply.lock().ok().and_then(|mut tx| tx.take()) {
                    let _ = tx.send(result);
                }
                poisoned
            })
        });
        let module = self.name.to_string();
        let deadline_error = || CallError::Deadline {
            module: module.clone(),
            call: kind,
            deadline,
        };
        let sent = tokio::time::timeout_at(
            due,
            self.jobs.send(Job {
                due,
                budget: deadline,
                work,
                refuse,
            }),
        )
        .await;
        match sent {
            Err(_) => return Err(deadline_error()),
            Ok(Err(_)) => {
                return Err(CallError::Unavailable {
                    module,
                    reason: "its actor has stopped".into(),
                });
            }
            Ok(Ok(())) => {}
        }
        let result = match tokio::time::timeout_at(due, rx).await {
            Err(_) | Ok(Err(_)) => Err(deadline_error()),
            Ok(Ok(Ok(v))) => Ok(v),
            Ok(Ok(Err(Failure::Plugin(error)))) => Err(CallError::Plugin {
                module,
                call: kind,
                error,
            }),
            Ok(Ok(Err(Failure::Trap(message)))) => Err(CallError::Trap {
                module,
                call: kind,
                message,
            }),
            Ok(Ok(Err(Failure::Unavailable(reason)))) => {
                Err(CallError::Unavailable { module, reason })
            }
        };
        if let Err(e) = &result {
            self.count(e);
        }
        result
    }
}

/// A fresh store and instance with the module's limits, initialised with its config.
async fn instantiate(
    module: &LoadedModule,
    config: &str,
) -> Result<(Instance, Vec<ResourceInfo>), Failure> {
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
    );
    let mut store = Store::new(module.pre.engine(), state);
    store.limiter(|s| &mut s.limits);
    // Yield to the runtime at every epoch tick, so the deadline below can fire.
    store.set_epoch_deadline(1);
    store.epoch_deadline_async_yield_and_update(1);
    let deadline = module.spec.call_deadline;
    let init = async {
        let plugin = module.pre.instantiate_async(&mut store).await?;
        let resources = plugin
            .devicelet_plugin_plugin()
            .call_init(&mut store, config)
            .await?;
        Ok::<_, wasmtime::Error>((plugin, resources))
    };
    match tokio::time::timeout(deadline, init).await {
        Err(_) => Err(Failure::Trap(format!(
            "init missed its {deadline:?} deadline"
        ))),
        Ok(Err(trap)) => Err(Failure::Trap(format!("{trap:#}"))),
        Ok(Ok((_, Err(e)))) => Err(Failure::Plugin(e.into())),
        Ok(Ok((plugin, Ok(resources)))) => Ok((
            Instance { store, plugin },
            resources.into_iter().map(ResourceInfo::from).collect(),
        )),
    }
}

/// First wait before re-instantiating a crashed module; doubles on every crash in a row.
const FIRST_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(10);

/// When a crashed module may be instantiated again, and how long the next wait will be.
struct Backoff {
    retry_at: Option<Instant>,
    next: Duration,
}

impl Backoff {
    fn crashed(&mut self) {
        self.retry_at = Some(Instant::now() + self.next);
        self.next = (self.next * 2).min(MAX_BACKOFF);
    }

    fn succeeded(&mut self) {
        self.retry_at = None;
        self.next = FIRST_BACKOFF;
    }
}

async fn run(
    module: LoadedModule,
    config: String,
    mut instance: Option<Instance>,
    mut jobs: mpsc::Receiver<Job>,
) {
    let name = &*module.name;
    let mut backoff = Backoff {
        retry_at: None,
        next: FIRST_BACKOFF,
    };
    while let Some(job) = jobs.recv().await {
        if Instant::now() >= job.due {
            continue;
        }
        if instance.is_none() {
            if let Some(at) = backoff.retry_at.filter(|at| Instant::now() < *at) {
                job.refuse(format!(
                    "restarting after a crash; next attempt in {:?}",
                    at - Instant::now()
                ));
                continue;
            }
            match instantiate(&module, &config).await {
                Ok((fresh, _)) => {
                    tracing::info!(module = name, "module re-instantiated");
                    instance = Some(fresh);
                }
                Err(Failure::Plugin(e)) => {
                    tracing::warn!(module = name, "re-instantiation failed: {e}");
                    backoff.crashed();
                    job.refuse(format!("re-instantiation failed: {e}"));
                    continue;
                }
                Err(Failure::Trap(m) | Failure::Unavailable(m)) => {
                    tracing::warn!(module = name, "re-instantiation failed: {m}");
                    backoff.crashed();
                    job.refuse(format!("re-instantiation failed: {m}"));
                    continue;
                }
            }
        }
        let Some(running) = instance.as_mut() else {
            continue;
        };
        let poisoned = match tokio::time::timeout(job.budget, (job.work)(running)).await {
            Ok(poisoned) => poisoned,
            Err(_) => {
                tracing::warn!(
                    module = name,
                    "call missed its deadline; instance discarded"
                );
                true
            }
        };
        if poisoned {
            instance = None;
            backoff.crashed();
        } else {
            backoff.succeeded();
        }
    }
}
