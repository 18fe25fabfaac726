//! The set of running modules, keyed by name: starting one (load, init, serve its resources)
//! and stopping one (end its streams, remove its sockets).

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use wasmtime::Engine;

use super::front_ends::{self, Context, FrontEnd, FrontEndKind, Stop};
use crate::config::ModuleSpec;
use crate::config::{MAX_RESOURCES, MAX_RESOURCES_PER_MODULE};
use crate::device::ResourceInfo;
use crate::dra::driver::DraOptions;
use crate::kubelet::resource::{self, Serving};
use crate::nvml::Libraries;
use crate::oci::Fetcher;
use crate::sandbox::cache::CompileCache;
use crate::sandbox::loader::{ModuleFile, load_file, read};
use crate::sandbox::slot::ModuleSlot;
use crate::sandbox::{LoadError, ModuleHandle};

pub struct RunningModule {
    pub spec: ModuleSpec,
    /// The module version answering, swapped in place by an upgrade.
    pub slot: ModuleSlot,
    /// What serves its resources: the front end the registry chose (`front_ends::start`).
    pub front_ends: Vec<Box<dyn FrontEnd>>,
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
    /// what they published goes too.
    pub async fn stop(self, retire: bool) {
        let how = || {
            if retire {
                Stop::Removed
            } else {
                Stop::Shutdown
            }
        };
        for front_end in self.front_ends {
            front_end.stop(how(), &self.slot).await;
        }
    }

    /// Its front ends of type `F`, for what only that front end knows.
    pub fn front_end<F: 'static>(&self) -> impl Iterator<Item = &F> {
        self.front_ends
            .iter()
            .filter_map(|f| f.as_any().downcast_ref::<F>())
    }
}

/// A module's file being read and hashed ahead of its start ([`read`], on a blocking thread),
/// while the agent's own start-up runs.
pub struct ReadAhead(tokio::task::JoinHandle<Result<ModuleFile, LoadError>>);

impl ReadAhead {
    pub fn start(spec: &ModuleSpec) -> ReadAhead {
        let spec = spec.clone();
        ReadAhead(tokio::task::spawn_blocking(move || read(&spec)))
    }
}

/// Compiles (on a blocking thread, or loads it precompiled from `cache`), instantiates and
/// initialises one module. `ahead`: its file, read ahead ([`ReadAhead`]); used only if it is
/// still what `spec`'s file holds (otherwise, or if that read failed, the file is read again).
pub async fn start_module(
    engine: &Engine,
    cache: Option<Arc<CompileCache>>,
    spec: &ModuleSpec,
    host_root: &Path,
    (libraries, fetcher): (&Libraries, Option<&Fetcher>),
    ahead: Option<ReadAhead>,
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
    let panicked = |what: &str, e: tokio::task::JoinError| LoadError::Invalid {
        module: spec.name.clone(),
        message: format!("{what} panicked: {e}"),
    };
    let ahead = match ahead {
        Some(ReadAhead(read)) => read
            .await
            .map_err(|e| panicked("reading the module", e))?
            .ok(),
        None => None,
    };
    let (engine, root) = (engine.clone(), host_root.to_owned());
    let libraries = libraries.clone();
    let loaded = tokio::task::spawn_blocking(move || {
        let file = match ahead {
            Some(file) if file.is_current_for(&spec_owned) => file,
            _ => read(&spec_owned)?,
        };
        load_file(
            &engine,
            cache.as_deref(),
            &spec_owned,
            &root,
            &libraries,
            file,
        )
    })
    .await
    .map_err(|e| panicked("the loader", e))??;
    ModuleHandle::start(loaded, |info| {
        resource::served_name(&spec.resource_domain, info, spec.sharing.rule(&info.name)).ok()
    })
    .await
}

/// Which of a module's declared resources `run` serves, under which names, and why the others
/// are not (each error names the module and where its registry entry is). `validate` shows the
/// same plan.
pub fn plan(
    spec: &ModuleSpec,
    declared: &[ResourceInfo],
    taken: &BTreeMap<String, String>,
) -> (Vec<(String, ResourceInfo)>, Vec<String>) {
    let (served, errors) = plan_unplaced(spec, declared, taken);
    let errors = errors
        .into_iter()
        .map(|e| format!("{}: {e}", spec.entry_at))
        .collect();
    (served, errors)
}

fn plan_unplaced(
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

/// Serves every resource of a started module's [`plan`] through the front end the registry
/// names (or `custom`); the errors are the plan's and any resource that could not be served.
pub async fn serve_all(
    handle: ModuleHandle,
    spec: &ModuleSpec,
    host_root: &Path,
    at: &Serving<'_>,
    taken: &BTreeMap<String, String>,
    (dra, custom): (Option<&DraOptions>, Option<&Arc<dyn FrontEndKind>>),
) -> (RunningModule, Vec<String>) {
    let (planned, mut errors) = plan(spec, handle.resources(), taken);
    let slot = ModuleSlot::new(handle);
    let cx = Context {
        slot: &slot,
        spec,
        host_root,
        planned: &planned,
        taken,
        at,
        dra,
    };
    let (front_end, more) = front_ends::start(&cx, custom).await;
    errors.extend(more);
    (running(spec, host_root, slot, vec![front_end]), errors)
}

/// Upgrades `old` to `handle` (a new version of its file or registry entry, loaded and
/// initialised). Where every front end keeps it in place, the kubelet never sees the
/// resources go: each front end first stops what the new version no longer serves (the old
/// version answering their last calls), the new version is swapped in, then each front end
/// has what it kept look again and serves what is new. Otherwise (the module moved between
/// front ends, or changed what its front end was started with) it stops on the old and starts
/// on the new.
pub async fn upgrade(
    old: RunningModule,
    handle: ModuleHandle,
    spec: &ModuleSpec,
    host_root: &Path,
    at: &Serving<'_>,
    taken: &BTreeMap<String, String>,
    (dra, custom): (Option<&DraOptions>, Option<&Arc<dyn FrontEndKind>>),
) -> (RunningModule, Vec<String>) {
    let (planned, mut errors) = plan(spec, handle.resources(), taken);
    let RunningModule {
        spec: old_spec,
        slot,
        mut front_ends,
        ..
    } = old;
    let cx = Context {
        slot: &slot,
        spec,
        host_root,
        planned: &planned,
        taken,
        at,
        dra,
    };
    if !front_ends.iter().all(|f| f.keeps(&old_spec, &cx)) {
        for front_end in front_ends {
            front_end.stop(Stop::Restart(&cx), &slot).await;
        }
        let (running, errors) = serve_all(handle, spec, host_root, at, taken, (dra, custom)).await;
        tracing::info!(module = spec.name, "started again on its new version");
        return (running, errors);
    }
    for front_end in &mut front_ends {
        front_end.stop_gone(&old_spec, &cx).await;
    }
    handle.inherit_own_edits(&slot.current());
    let previous = slot.replace(handle);
    for front_end in &mut front_ends {
        errors.extend(front_end.resume(&cx).await);
    }
    tracing::info!(
        module = spec.name,
        from = previous.digest(),
        to = slot.current().digest(),
        "upgraded in place"
    );
    (running(spec, host_root, slot, front_ends), errors)
}

fn running(
    spec: &ModuleSpec,
    host_root: &Path,
    slot: ModuleSlot,
    front_ends: Vec<Box<dyn FrontEnd>>,
) -> RunningModule {
    let pokes: Vec<_> = front_ends.iter().flat_map(|f| f.pokes()).collect();
    let nvml_events = slot
        .current()
        .nvml()
        .map(|nvml| nvml.subscribe(pokes.clone()));
    let dev_watch = super::dev_watch::watch(host_root, &spec.grants, pokes);
    RunningModule {
        spec: spec.clone(),
        slot,
        front_ends,
        _dev_watch: dev_watch,
        _nvml_events: nvml_events,
    }
}
