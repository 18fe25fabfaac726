//! The agent: loads every module in the registry and serves each resource it declares.
//!
//! A module that fails to load is reported and skipped; the others are served regardless, so one
//! broken vendor module never takes the node's other device types down.

mod health;
mod resource;

use std::path::PathBuf;
use std::time::{SystemTime, UNIX_EPOCH};

use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::config::Registry;
use crate::sandbox::loader::load;
use crate::sandbox::{LoadError, ModuleHandle, engine};

pub use resource::{ServedResource, qualify};

/// Where the agent serves and what it serves.
#[derive(Debug, Clone)]
pub struct AgentOptions {
    pub registry: Registry,
    /// The kubelet's device-plugin directory: our sockets go here, next to `kubelet.sock`.
    pub plugin_dir: PathBuf,
}

/// A running agent. Dropping it without [`Agent::shutdown`] leaves its tasks running.
pub struct Agent {
    resources: Vec<ServedResource>,
    load_errors: Vec<LoadError>,
    stop: watch::Sender<bool>,
    tasks: JoinSet<()>,
}

impl Agent {
    /// Loads the modules and starts serving; registration with the kubelet proceeds in the
    /// background (and is retried) so a kubelet that is not up yet does not stop the agent.
    pub async fn start(options: AgentOptions) -> anyhow::Result<Agent> {
        let engine = engine::new_engine().map_err(|e| anyhow::anyhow!("{e:#}"))?;
        let instance = instance_id();
        let (stop, stopped) = watch::channel(false);
        let mut tasks = JoinSet::new();
        let mut resources = Vec::new();
        let mut load_errors = Vec::new();
        for spec in &options.registry.modules {
            let handle = match start_module(&engine, spec, &options.registry.host_root).await {
                Ok(handle) => handle,
                Err(e) => {
                    tracing::error!("{e}");
                    load_errors.push(e);
                    continue;
                }
            };
            for info in handle.resources() {
                match resource::serve(
                    &handle,
                    spec,
                    info,
                    &options.plugin_dir,
                    &instance,
                    stopped.clone(),
                    &mut tasks,
                )
                .await
                {
                    Ok(served) => resources.push(served),
                    Err(e) => {
                        let e = LoadError::Invalid {
                            module: spec.name.clone(),
                            message: format!("{e:#}"),
                        };
                        tracing::error!("{e}");
                        load_errors.push(e);
                    }
                }
            }
        }
        Ok(Agent {
            resources,
            load_errors,
            stop,
            tasks,
        })
    }

    pub fn resources(&self) -> &[ServedResource] {
        &self.resources
    }

    /// Modules (or resources) that could not be served, each naming the module.
    pub fn load_errors(&self) -> &[LoadError] {
        &self.load_errors
    }

    /// Ends the ListAndWatch streams, stops serving and removes our sockets.
    pub async fn shutdown(mut self) {
        let _ = self.stop.send(true);
        while self.tasks.join_next().await.is_some() {}
        for r in &self.resources {
            let _ = std::fs::remove_file(&r.socket);
        }
    }
}

/// Compiles (on a blocking thread), instantiates and initialises one module.
pub async fn start_module(
    engine: &wasmtime::Engine,
    spec: &crate::config::ModuleSpec,
    host_root: &std::path::Path,
) -> Result<ModuleHandle, LoadError> {
    let (engine, spec_owned, root) = (engine.clone(), spec.clone(), host_root.to_owned());
    let loaded = tokio::task::spawn_blocking(move || load(&engine, &spec_owned, &root))
        .await
        .map_err(|e| LoadError::Invalid {
            module: spec.name.clone(),
            message: format!("loader panicked: {e}"),
        })??;
    ModuleHandle::start(loaded).await
}

/// Unique per agent process, so a rolling upgrade never has two agents on one socket file.
fn instance_id() -> String {
    let millis = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or_default();
    format!("{millis}-{}", std::process::id())
}
