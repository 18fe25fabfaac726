//! The set of running modules, keyed by name: starting one (load, init, serve its resources)
//! and stopping one (end its streams, remove its sockets).

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use wasmtime::Engine;

use crate::config::ModuleSpec;
use crate::config::{MAX_RESOURCES, MAX_RESOURCES_PER_MODULE};
use crate::device::ResourceInfo;
use crate::kubelet::resource::{self, Owner, RunningResource, Serving};
use crate::nvml::Libraries;
use crate::policy::sharing::Replicated;
use crate::resource::backend::Upkeep;
use crate::sandbox::cache::CompileCache;
use crate::sandbox::loader::load;
use crate::sandbox::slot::ModuleSlot;
use crate::sandbox::{LoadError, ModuleHandle};

pub struct RunningModule {
    pub spec: ModuleSpec,
    /// The module version answering, swapped in place by an upgrade.
    pub slot: ModuleSlot,
    pub resources: Vec<RunningResource>,
    /// Pokes the resources' device watchers when nodes under the /dev grants change.
    _dev_watch: Option<notify::RecommendedWatcher>,
    /// Pokes them when NVML reports a critical event, for a module granted NVML.
    _nvml_events: Option<crate::nvml::Subscription>,
}

impl RunningModule {
    /// The module version answering now.
    pub fn handle(&self) -> Arc<ModuleHandle> {
        self.slot.current()
    }

    /// Stops serving its resources; `retire`: for good (the module left the registry), so
    /// their CDI specs go too.
    pub async fn stop(self, retire: bool) {
        stop_resources(self.resources, &self.slot, retire).await;
    }
}

async fn stop_resources(resources: Vec<RunningResource>, slot: &ModuleSlot, retire: bool) {
    for r in &resources {
        if retire {
            r.retire();
        }
        r.signal_stop();
    }
    for r in resources {
        r.stop(slot).await;
    }
}

/// Compiles (on a blocking thread, or loads it precompiled from `cache`), instantiates and
/// initialises one module.
pub async fn start_module(
    engine: &Engine,
    cache: Option<Arc<CompileCache>>,
    spec: &ModuleSpec,
    host_root: &Path,
    libraries: &Libraries,
) -> Result<ModuleHandle, LoadError> {
    let (engine, spec_owned, root) = (engine.clone(), spec.clone(), host_root.to_owned());
    let libraries = libraries.clone();
    let loaded = tokio::task::spawn_blocking(move || {
        load(&engine, cache.as_deref(), &spec_owned, &root, &libraries)
    })
    .await
    .map_err(|e| LoadError::Invalid {
        module: spec.name.clone(),
        message: format!("loader panicked: {e}"),
    })??;
    ModuleHandle::start(loaded, |info| {
        resource::served_name(&spec.resource_domain, info, spec.sharing.rule(&info.name)).ok()
    })
    .await
}

/// Which of a module's declared resources `run` serves, under which names, and why the others
/// are not (each error names the module). `validate` shows the same plan.
pub fn plan(
    spec: &ModuleSpec,
    declared: &[ResourceInfo],
    taken: &BTreeMap<String, String>,
) -> (Vec<(String, ResourceInfo)>, Vec<String>) {
    let mut served: Vec<(String, ResourceInfo)> = Vec::new();
    let mut errors = Vec::new();
    if let crate::config::FrontEnd::Dra { driver } = &spec.front_end {
        let drivers: Vec<String> = match driver {
            Some(driver) => vec![driver.clone()],
            None => declared
                .iter()
                .filter_map(|info| {
                    let name = resource::served_name(
                        &spec.resource_domain,
                        info,
                        spec.sharing.rule(&info.name),
                    )
                    .ok()?;
                    crate::dra::names::default_driver(&name).ok()
                })
                .collect(),
        };
        errors.push(format!(
            "module `{}` has `front-end = \"dra\"` (driver {}), which this build does not serve \
             yet: the DRA front end is still being built (README \"DRA\"); its resources are not \
             served. Serve it with the device-plugin front end (the default) for now",
            spec.name,
            if drivers.is_empty() {
                "none".to_string()
            } else {
                drivers.join(", ")
            }
        ));
        return (served, errors);
    }
    if declared.len() > MAX_RESOURCES_PER_MODULE {
        errors.push(format!(
            "module `{}` declared {} resources; at most {MAX_RESOURCES_PER_MODULE} are served",
            spec.name,
            declared.len()
        ));
    }
    for name in spec.sharing.resources.keys() {
        if !declared.iter().any(|info| info.name == *name) {
            let names: Vec<&str> = declared.iter().map(|i| i.name.as_str()).collect();
            errors.push(format!(
                "module `{}`: [module.sharing.resources.{name}] names no resource it declares \
                 (it declares: {})",
                spec.name,
                names.join(", ")
            ));
        }
    }
    for info in declared.iter().take(MAX_RESOURCES_PER_MODULE) {
        let share = spec.sharing.rule(&info.name);
        let name = match resource::served_name(&spec.resource_domain, info, share) {
            Ok(name) => name,
            Err(message) => {
                errors.push(
                    LoadError::Invalid {
                        module: spec.name.clone(),
                        message,
                    }
                    .to_string(),
                );
                continue;
            }
        };
        if taken.len() + served.len() >= MAX_RESOURCES {
            errors.push(format!(
                "module `{}`: {name} is not served: the agent serves at most {MAX_RESOURCES} \
                 resources in all",
                spec.name
            ));
        } else if let Some(owner) = taken.get(&name) {
            errors.push(format!(
                "module `{}` declared {name}, which module `{owner}` already serves",
                spec.name
            ));
        } else if served.iter().any(|(n, _)| *n == name) {
            errors.push(format!("module `{}` declared {name} twice", spec.name));
        } else {
            served.push((name, info.clone()));
        }
    }
    (served, errors)
}

/// Serves every resource of a started module's [`plan`]; the errors are the plan's and any
/// resource that could not be served.
pub fn serve_all(
    handle: ModuleHandle,
    spec: &ModuleSpec,
    host_root: &Path,
    at: &Serving<'_>,
    taken: &BTreeMap<String, String>,
) -> (RunningModule, Vec<String>) {
    let (planned, mut errors) = plan(spec, handle.resources(), taken);
    let slot = ModuleSlot::new(handle);
    let resources = serve_planned(&slot, spec, host_root, &planned, at, &mut errors);
    (running(spec, host_root, slot, resources), errors)
}

/// Upgrades `old` to `handle` (a new version of its file or registry entry, loaded and
/// initialised) without the kubelet seeing the resources go: each resource the new version
/// still declares (same name, same health interval, `allocate-ahead` and `allocation-policy`, and the same sharing rule) keeps its socket, registration and
/// ListAndWatch stream, and is re-enumerated at once through the new version. One whose
/// options change registers again on the same socket. Resources no longer declared stop, new
/// ones are served.
pub async fn upgrade(
    old: RunningModule,
    handle: ModuleHandle,
    spec: &ModuleSpec,
    host_root: &Path,
    at: &Serving<'_>,
    taken: &BTreeMap<String, String>,
) -> (RunningModule, Vec<String>) {
    let (planned, mut errors) = plan(spec, handle.resources(), taken);
    // The watcher's interval and the preparer are set when a resource starts serving.
    let same_interval = old.spec.health_interval == spec.health_interval
        && old.spec.allocate_ahead == spec.allocate_ahead
        && old.spec.allocation_policy == spec.allocation_policy
        && old.spec.device_list_strategy == spec.device_list_strategy;
    let old_sharing = old.spec.sharing.clone();
    let RunningModule {
        slot, resources, ..
    } = old;
    let (kept, gone): (Vec<_>, Vec<_>) = resources.into_iter().partition(|r| {
        same_interval
            && old_sharing.rule(r.local()) == spec.sharing.rule(r.local())
            && planned
                .iter()
                .any(|(name, info)| *name == r.served.name && r.same_declaration(info))
    });
    // Gone ones stop while the old version still answers their last calls.
    stop_resources(gone, &slot, true).await;
    handle.inherit_own_edits(&slot.current());
    let previous = slot.replace(handle);
    for r in &kept {
        if let Some((_, info)) = planned.iter().find(|(name, _)| *name == r.served.name) {
            r.set_options(info);
        }
        r.poke.notify_one();
    }
    let fresh: Vec<_> = planned
        .into_iter()
        .filter(|(name, _)| !kept.iter().any(|r| r.served.name == *name))
        .collect();
    let mut resources = kept;
    resources.extend(serve_planned(
        &slot,
        spec,
        host_root,
        &fresh,
        at,
        &mut errors,
    ));
    tracing::info!(
        module = spec.name,
        from = previous.digest(),
        to = slot.current().digest(),
        "upgraded in place"
    );
    // The old version's cells end once calls still running on it finish.
    drop(previous);
    (running(spec, host_root, slot, resources), errors)
}

fn serve_planned(
    slot: &ModuleSlot,
    spec: &ModuleSpec,
    host_root: &Path,
    planned: &[(String, ResourceInfo)],
    at: &Serving<'_>,
    errors: &mut Vec<String>,
) -> Vec<RunningResource> {
    let mut resources = Vec::new();
    for (_, info) in planned {
        let owner = Owner {
            module: &spec.name,
            resource_domain: &spec.resource_domain,
            health_interval: spec.health_interval,
            allocate_ahead: spec.allocate_ahead,
            allocation_policy: spec.allocation_policy,
            share: spec.sharing.rule(&info.name),
            device_list_strategy: spec.device_list_strategy,
            host_root,
        };
        let backend = Replicated::new(slot.clone(), spec.sharing.clone());
        let upkeep: Arc<dyn Upkeep> = Arc::new(slot.clone());
        match resource::serve(&backend, &upkeep, &owner, info, at) {
            Ok(r) => resources.push(r),
            Err(message) => errors.push(
                LoadError::Invalid {
                    module: spec.name.clone(),
                    message,
                }
                .to_string(),
            ),
        }
    }
    resources
}

fn running(
    spec: &ModuleSpec,
    host_root: &Path,
    slot: ModuleSlot,
    resources: Vec<RunningResource>,
) -> RunningModule {
    let pokes: Vec<_> = resources.iter().map(|r| r.poke.clone()).collect();
    let nvml_events = slot
        .current()
        .nvml()
        .map(|nvml| nvml.subscribe(pokes.clone()));
    let dev_watch = super::dev_watch::watch(host_root, &spec.grants, pokes);
    RunningModule {
        spec: spec.clone(),
        slot,
        resources,
        _dev_watch: dev_watch,
        _nvml_events: nvml_events,
    }
}
