//! Serving one resource: its socket, its DevicePlugin server, its device watcher and its
//! registration with the kubelet.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio_stream::wrappers::UnixListenerStream;

use super::health;
use crate::config::ModuleSpec;
use crate::kubelet::api::deviceplugin::{
    DevicePluginOptions, device_plugin_server::DevicePluginServer,
};
use crate::kubelet::plugin_server::{ResourcePlugin, Snapshot};
use crate::kubelet::{names, registration, uds};
use crate::sandbox::{ModuleHandle, ResourceInfo};

/// A resource the agent serves.
#[derive(Debug, Clone)]
pub struct ServedResource {
    /// The extended resource name the kubelet knows (`vendor.com/type`).
    pub name: String,
    pub module: String,
    pub socket: PathBuf,
    pub options: DevicePluginOptions,
    pub devices: watch::Receiver<Snapshot>,
}

/// A bare suffix gets the module's domain; a full name is kept as the module gave it.
pub fn qualify(domain: &str, name: &str) -> String {
    if name.contains('/') {
        name.to_owned()
    } else {
        format!("{domain}/{name}")
    }
}

pub async fn serve(
    module: &ModuleHandle,
    spec: &ModuleSpec,
    info: &ResourceInfo,
    plugin_dir: &Path,
    instance: &str,
    stop: watch::Receiver<bool>,
    tasks: &mut JoinSet<()>,
) -> anyhow::Result<ServedResource> {
    let name = qualify(&spec.resource_domain, &info.name);
    names::validate_resource_name(&name)
        .map_err(|e| anyhow::anyhow!("declared an invalid resource name: {e}"))?;
    let endpoint = format!(
        "devicelet-{}-{instance}.sock",
        name.replace(['/', '.'], "_")
    );
    let socket = plugin_dir.join(&endpoint);
    let options = DevicePluginOptions {
        pre_start_required: info.prestart,
        get_preferred_allocation_available: info.preferred_allocation,
    };

    let (devices_tx, devices) = watch::channel(health::initial(module, &info.name).await);
    tasks.spawn(health::watch_devices(
        module.clone(),
        info.name.clone(),
        spec.health_interval,
        devices_tx,
        stop.clone(),
    ));

    std::fs::create_dir_all(plugin_dir)
        .with_context(|| format!("creating {}", plugin_dir.display()))?;
    let listener = uds::bind(&socket).with_context(|| format!("binding {}", socket.display()))?;
    let plugin = ResourcePlugin::new(
        &info.name,
        module.clone(),
        options,
        devices.clone(),
        stop.clone(),
    );
    let mut shutdown = stop.clone();
    let server_name = name.clone();
    tasks.spawn(async move {
        let served = tonic::transport::Server::builder()
            .add_service(DevicePluginServer::new(plugin))
            .serve_with_incoming_shutdown(UnixListenerStream::new(listener), async move {
                let _ = shutdown.wait_for(|s| *s).await;
            })
            .await;
        if let Err(e) = served {
            tracing::error!(resource = server_name, "device-plugin server failed: {e}");
        }
    });
    tasks.spawn(register_until_accepted(
        plugin_dir.to_owned(),
        endpoint,
        name.clone(),
        options,
        stop,
    ));
    Ok(ServedResource {
        name,
        module: spec.name.clone(),
        socket,
        options,
        devices,
    })
}

const FIRST_RETRY: Duration = Duration::from_millis(20);
const LAST_RETRY: Duration = Duration::from_secs(5);

/// The kubelet may not be up yet, or its socket may exist a moment before it accepts: retry
/// fast at first, then back off, and log the trouble once rather than in a loop.
async fn register_until_accepted(
    plugin_dir: PathBuf,
    endpoint: String,
    resource: String,
    options: DevicePluginOptions,
    mut stop: watch::Receiver<bool>,
) {
    let mut delay = FIRST_RETRY;
    let mut complained = false;
    loop {
        match registration::register(&plugin_dir, &endpoint, &resource, options).await {
            Ok(()) => {
                tracing::info!(resource, endpoint, "registered with the kubelet");
                return;
            }
            Err(e) => {
                if !complained {
                    tracing::warn!(resource, "{e}; retrying with backoff");
                    complained = true;
                }
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        delay = (delay * 2).min(LAST_RETRY);
    }
}
