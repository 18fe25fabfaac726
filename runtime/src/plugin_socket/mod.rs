//! The plugin-socket layer both front ends stand on: a Unix socket that only its owner (the
//! kubelet runs as root) may connect to from the moment it exists, gRPC served on it on the
//! agent's runtime until told to stop, and the plugin watcher's `Registration` service
//! (`GetInfo` / `NotifyRegistrationStatus`) that both a device plugin on the watcher route and a
//! DRA driver answer. A front end brings its own services and what it tells the watcher; it
//! binds, serves and registers nothing itself.

pub mod connections;

use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use devicelet_api::pluginregistration::registration_server::{Registration, RegistrationServer};
use devicelet_api::pluginregistration::{
    InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse,
};
use devicelet_api::{serve as grpc, uds};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::service::Routes;
use tonic::{Request, Response, Status};

/// Binds `socket` (0600 from the start, a stale file replaced) and serves `routes` on it until
/// `shutdown` completes, counting open connections in `open` when given; the socket file is
/// removed afterwards if `remove` says so.
pub fn serve(
    socket: &Path,
    routes: Routes,
    open: Option<watch::Sender<usize>>,
    shutdown: impl Future<Output = ()> + Send + 'static,
    remove: bool,
) -> std::io::Result<JoinHandle<()>> {
    if let Some(dir) = socket.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let listener = uds::bind_private(socket)?;
    let path = socket.to_owned();
    Ok(tokio::spawn(async move {
        let incoming = UnixListenerStream::new(listener);
        match open {
            Some(open) => {
                let incoming = connections::counted(incoming, open);
                grpc::serve(incoming, routes, grpc::MAX_PLUGIN_CONNECTIONS, shutdown).await;
            }
            None => grpc::serve(incoming, routes, grpc::MAX_PLUGIN_CONNECTIONS, shutdown).await,
        }
        if remove {
            let _ = std::fs::remove_file(&path);
        }
    }))
}

/// What a plugin tells the kubelet's plugin watcher about itself.
#[derive(Debug, Clone)]
pub struct WatcherInfo {
    /// `DevicePlugin` or `DRAPlugin`.
    pub kind: &'static str,
    /// The extended resource name, or the DRA driver name.
    pub name: String,
    /// The socket serving the plugin's API.
    pub endpoint: PathBuf,
    pub versions: Vec<String>,
}

/// The plugin watcher's `Registration` service: answers `GetInfo` with `info` and hands every
/// `NotifyRegistrationStatus` to `notice` (which must not block: the kubelet waits on it).
pub fn watcher_registration(
    info: WatcherInfo,
    notice: impl Fn(RegistrationStatus) + Send + Sync + 'static,
) -> RegistrationServer<WatcherRegistration> {
    RegistrationServer::new(WatcherRegistration {
        info,
        notice: Arc::new(notice),
    })
}

/// See [`watcher_registration`].
pub struct WatcherRegistration {
    info: WatcherInfo,
    notice: Arc<dyn Fn(RegistrationStatus) + Send + Sync>,
}

#[tonic::async_trait]
impl Registration for WatcherRegistration {
    async fn get_info(&self, _: Request<InfoRequest>) -> Result<Response<PluginInfo>, Status> {
        Ok(Response::new(PluginInfo {
            r#type: self.info.kind.into(),
            name: self.info.name.clone(),
            endpoint: self.info.endpoint.display().to_string(),
            supported_versions: self.info.versions.clone(),
        }))
    }

    async fn notify_registration_status(
        &self,
        request: Request<RegistrationStatus>,
    ) -> Result<Response<RegistrationStatusResponse>, Status> {
        (self.notice)(request.into_inner());
        Ok(Response::new(RegistrationStatusResponse {}))
    }
}
