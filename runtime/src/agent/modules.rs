//! The set of running modules, keyed by name: starting one (load, init, serve its resources)
//! and stopping one (end its streams, remove its sockets).

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use wasmtime::Engine;

use crate::config::{FrontEnd, ModuleSpec};
use crate::config::{MAX_RESOURCES, MAX_RESOURCES_PER_MODULE};
use crate::device::ResourceInfo;
use crate::dra::HeldElsewhere;
use crate::dra::driver::{DraOptions, DriverSpec, RunningDriver};
use crate::kubelet::resource::{self, Owner, RunningResource, Serving};
use crate::ledger::Ledger;
use crate::nvml::Libraries;
use crate::oci::Fetcher;
use crate::policy::sharing::{Replicated, physical_id};
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
    /// Its resources served as DRA drivers instead (`front-end = "dra"`).
    pub drivers: Vec<RunningDriver>,
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
        for driver in self.drivers {
            driver.stop(retire).await;
        }
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
    (libraries, fetcher): (&Libraries, Option<&Fetcher>),
) -> Result<ModuleHandle, LoadError> {
    // A module from a registry loads from its entry in the module store, pulled first if
    // missing.
    let mut spec_owned = spec.clone();
    if let Some(source) = &spec.source {
        let invalid = |message: String| LoadError::Invalid {
            module: spec.name.clone(),
            message,
        };
        let fetcher = fetcher.ok_or_else(|| {
            invalid(format!(
                "it comes from {source}, but the agent has no state directory for its module \
                 store (--state-dir)"
            ))
        })?;
        let (path, sha256) = fetcher
            .fetch(source, spec)
            .await
            .map_err(|e| invalid(format!("pulling {source}: {e}")))?;
        spec_owned.path = path;
        spec_owned.sha256 = Some(sha256);
    }
    let (engine, root) = (engine.clone(), host_root.to_owned());
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
pub async fn serve_all(
    handle: ModuleHandle,
    spec: &ModuleSpec,
    host_root: &Path,
    at: &Serving<'_>,
    taken: &BTreeMap<String, String>,
    dra: Option<&DraOptions>,
) -> (RunningModule, Vec<String>) {
    let (planned, mut errors) = plan(spec, handle.resources(), taken);
    let slot = ModuleSlot::new(handle);
    let (resources, drivers) = match &spec.front_end {
        FrontEnd::DevicePlugin => (
            serve_planned(&slot, spec, host_root, &planned, at, &mut errors),
            Vec::new(),
        ),
        FrontEnd::Dra { driver } => (
            Vec::new(),
            start_drivers(
                &slot,
                spec,
                driver.as_deref(),
                host_root,
                (&planned, taken),
                (dra, at.ledger),
                &mut errors,
            )
            .await,
        ),
    };
    (running(spec, host_root, slot, resources, drivers), errors)
}

/// How a DRA driver's name is kept among the served names, apart from resource names.
pub fn driver_key(driver: &str) -> String {
    format!("DRA driver {driver}")
}

/// The driver names a DRA module's planned resources get.
fn driver_names(explicit: Option<&str>, planned: &[(String, ResourceInfo)]) -> Vec<String> {
    planned
        .iter()
        .filter_map(|(name, _)| crate::dra::names::driver_name(explicit, name).ok())
        .collect()
}

/// Serves each planned resource as a DRA driver: the registry's `dra-driver` for a module with
/// one resource, else each resource's name turned around.
async fn start_drivers(
    slot: &ModuleSlot,
    spec: &ModuleSpec,
    explicit: Option<&str>,
    host_root: &Path,
    (planned, taken): (&[(String, ResourceInfo)], &BTreeMap<String, String>),
    (dra, ledger): (Option<&DraOptions>, &Ledger),
    errors: &mut Vec<String>,
) -> Vec<RunningDriver> {
    let Some(options) = dra else {
        errors.push(format!(
            "module `{}` has `front-end = \"dra\"`, but the agent serves no DRA drivers: give it \
             the node's name (--node-name, or NODE_NAME as a DaemonSet sets it from the pod's \
             spec.nodeName)",
            spec.name
        ));
        return Vec::new();
    };
    if explicit.is_some() && planned.len() > 1 {
        let names: Vec<&str> = planned.iter().map(|(n, _)| n.as_str()).collect();
        errors.push(format!(
            "module `{}`: `dra-driver` names one driver, but the module serves {} resources ({}); \
             drop it to serve each as its own driver (the resource name turned around)",
            spec.name,
            planned.len(),
            names.join(", ")
        ));
        return Vec::new();
    }
    let mut drivers = Vec::new();
    for (name, info) in planned {
        let driver = match crate::dra::names::driver_name(explicit, name) {
            Ok(driver) => driver,
            Err(e) => {
                errors.push(format!(
                    "module `{}`: {name} makes no DRA driver name ({e}); set `dra-driver`",
                    spec.name
                ));
                continue;
            }
        };
        if let Some(owner) = taken.get(&driver_key(&driver)) {
            errors.push(format!(
                "module `{}`: DRA driver {driver} (for {name}) is already served by module \
                 `{owner}`; give one of them another `dra-driver`",
                spec.name
            ));
            continue;
        }
        // A driver of this name still answering for claims after it left the registry hands
        // over: the new one reads its checkpoint.
        options.retirees.take_over(&driver).await;
        let upkeep: Arc<dyn Upkeep> = Arc::new(slot.clone());
        // What the device-plugin front end handed out under the same name stays out of the
        // pool until the kubelet reports its container gone (see `HeldElsewhere`).
        let held: HeldElsewhere = {
            // Under its own name, and as the device plugin served it shared and renamed.
            let ledger = ledger.clone();
            let names = [
                name.clone(),
                format!("{name}{}", crate::policy::sharing::RENAMED_SUFFIX),
            ];
            Arc::new(move || {
                names
                    .iter()
                    .flat_map(|n| ledger.holders(n))
                    .map(|(id, _)| physical_id(&id).to_owned())
                    .collect()
            })
        };
        let started = crate::dra::driver::start(
            slot,
            &upkeep,
            DriverSpec {
                driver: &driver,
                name,
                local: &info.name,
                health_interval: spec.health_interval,
                host_root: host_root.to_owned(),
                held,
                ledger: ledger.clone(),
            },
            options,
        );
        match started {
            Ok(d) => drivers.push(d),
            Err(e) => errors.push(format!("module `{}`: {e}", spec.name)),
        }
    }
    drivers
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
    dra: Option<&DraOptions>,
) -> (RunningModule, Vec<String>) {
    if let FrontEnd::Dra { driver } = &spec.front_end
        && !old.drivers.is_empty()
        && old.spec.health_interval == spec.health_interval
    {
        return upgrade_drivers(
            old,
            handle,
            spec,
            driver.as_deref(),
            host_root,
            at,
            taken,
            dra,
        )
        .await;
    }
    if !old.drivers.is_empty() || matches!(spec.front_end, FrontEnd::Dra { .. }) {
        // A module moved between front ends (or a DRA module whose health interval changed,
        // which its drivers' watchers were started with) stops on one and starts on the other;
        // DRA checkpoints keep prepared claims.
        let name = spec.name.clone();
        let staying = match &spec.front_end {
            FrontEnd::Dra { driver } => {
                let (planned, _) = plan(spec, handle.resources(), taken);
                driver_names(driver.as_deref(), &planned)
            }
            FrontEnd::DevicePlugin => Vec::new(),
        };
        let RunningModule {
            resources,
            drivers,
            slot,
            ..
        } = old;
        stop_resources(resources, &slot, true).await;
        // A driver the new version no longer serves takes its slices with it, so its devices
        // are not advertised while they may be served otherwise.
        for driver in drivers {
            let gone = !staying.contains(&driver.driver);
            driver.stop(gone).await;
        }
        let (running, errors) = serve_all(handle, spec, host_root, at, taken, dra).await;
        tracing::info!(module = name, "started again on its new version");
        return (running, errors);
    }
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
    upgraded(spec, &slot, previous);
    (
        running(spec, host_root, slot, resources, Vec::new()),
        errors,
    )
}

/// Upgrades a DRA module in place, as [`upgrade`] does for device-plugin resources: each
/// driver the new version still serves (same driver name, same resource) keeps its sockets,
/// registration, health streams, pool and claims, and enumerates again at once through the new
/// version, which answers its next prepare and unprepare. Drivers no longer served stop and
/// take their slices with them; new ones start.
#[allow(clippy::too_many_arguments)]
async fn upgrade_drivers(
    old: RunningModule,
    handle: ModuleHandle,
    spec: &ModuleSpec,
    explicit: Option<&str>,
    host_root: &Path,
    at: &Serving<'_>,
    taken: &BTreeMap<String, String>,
    dra: Option<&DraOptions>,
) -> (RunningModule, Vec<String>) {
    let (planned, mut errors) = plan(spec, handle.resources(), taken);
    let wanted: Vec<(String, &String, &ResourceInfo)> = planned
        .iter()
        .filter_map(|(name, info)| {
            let driver = crate::dra::names::driver_name(explicit, name).ok()?;
            Some((driver, name, info))
        })
        .collect();
    // One `dra-driver` for several resources is refused by `start_drivers`, which must then
    // see them all: nothing is kept.
    let keep_any = explicit.is_none() || planned.len() <= 1;
    let RunningModule { slot, drivers, .. } = old;
    let (kept, gone): (Vec<_>, Vec<_>) = drivers.into_iter().partition(|d| {
        keep_any
            && wanted.iter().any(|(driver, name, info)| {
                *driver == d.driver && **name == d.name && info.name == d.local
            })
    });
    // Gone ones stop while the old version still answers their last calls.
    for driver in gone {
        driver.stop(true).await;
    }
    handle.inherit_own_edits(&slot.current());
    let previous = slot.replace(handle);
    for d in &kept {
        d.poke.notify_one();
    }
    let fresh: Vec<(String, ResourceInfo)> = planned
        .iter()
        .filter(|(name, _)| !kept.iter().any(|d| d.name == *name))
        .cloned()
        .collect();
    // The kept drivers' names are taken: a fresh resource may not start a second one.
    let mut taken = taken.clone();
    for d in &kept {
        taken.insert(driver_key(&d.driver), spec.name.clone());
    }
    let mut drivers = kept;
    drivers.extend(
        start_drivers(
            &slot,
            spec,
            explicit,
            host_root,
            (&fresh, &taken),
            (dra, at.ledger),
            &mut errors,
        )
        .await,
    );
    upgraded(spec, &slot, previous);
    (running(spec, host_root, slot, Vec::new(), drivers), errors)
}

/// Logs an in-place upgrade and lets go of the old version: its cells end once calls still
/// running on it finish.
fn upgraded(spec: &ModuleSpec, slot: &ModuleSlot, previous: Arc<ModuleHandle>) {
    tracing::info!(
        module = spec.name,
        from = previous.digest(),
        to = slot.current().digest(),
        "upgraded in place"
    );
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
    drivers: Vec<RunningDriver>,
) -> RunningModule {
    let pokes: Vec<_> = resources
        .iter()
        .map(|r| r.poke.clone())
        .chain(drivers.iter().map(|d| d.poke.clone()))
        .collect();
    let nvml_events = slot
        .current()
        .nvml()
        .map(|nvml| nvml.subscribe(pokes.clone()));
    let dev_watch = super::dev_watch::watch(host_root, &spec.grants, pokes);
    RunningModule {
        spec: spec.clone(),
        slot,
        resources,
        drivers,
        _dev_watch: dev_watch,
        _nvml_events: nvml_events,
    }
}
