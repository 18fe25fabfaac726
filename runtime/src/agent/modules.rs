//! The set of running modules, keyed by name: starting one (load, init, serve its resources)
//! and stopping one (end its streams, remove its sockets).

use std::path::Path;
use std::sync::Arc;

use wasmtime::Engine;

use super::resource::{self, RunningResource, Serving};
use crate::config::ModuleSpec;
use crate::sandbox::cache::CompileCache;
use crate::sandbox::loader::load;
use crate::sandbox::{LoadError, ModuleHandle};

pub struct RunningModule {
    pub spec: ModuleSpec,
    pub handle: ModuleHandle,
    pub resources: Vec<RunningResource>,
}

impl RunningModule {
    pub async fn stop(self) {
        for r in self.resources {
            r.stop().await;
        }
    }
}

/// Compiles (on a blocking thread, or loads it precompiled from `cache`), instantiates and
/// initialises one module.
pub async fn start_module(
    engine: &Engine,
    cache: Option<Arc<CompileCache>>,
    spec: &ModuleSpec,
    host_root: &Path,
) -> Result<ModuleHandle, LoadError> {
    let (engine, spec_owned, root) = (engine.clone(), spec.clone(), host_root.to_owned());
    let loaded =
        tokio::task::spawn_blocking(move || load(&engine, cache.as_deref(), &spec_owned, &root))
            .await
            .map_err(|e| LoadError::Invalid {
                module: spec.name.clone(),
                message: format!("loader panicked: {e}"),
            })??;
    ModuleHandle::start(loaded).await
}

/// Starts a module and serves every resource it declares. Resources it names invalidly are
/// reported (each error names the module) and skipped; the others are served.
pub async fn start(
    engine: &Engine,
    cache: Option<Arc<CompileCache>>,
    spec: &ModuleSpec,
    host_root: &Path,
    at: &Serving<'_>,
) -> Result<(RunningModule, Vec<String>), LoadError> {
    let handle = start_module(engine, cache, spec, host_root).await?;
    let mut resources = Vec::new();
    let mut errors = Vec::new();
    for info in handle.resources() {
        match resource::serve(&handle, spec, info, at).await {
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
    Ok((
        RunningModule {
            spec: spec.clone(),
            handle,
            resources,
        },
        errors,
    ))
}
