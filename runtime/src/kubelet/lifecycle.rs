//! One resource's life with the kubelet: serve, register, and do both again whenever the kubelet
//! restarts (our socket vanished, or `kubelet.sock` is a new file), until told to stop.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::sync::watch;
use tokio_stream::wrappers::UnixListenerStream;

use super::api::deviceplugin::{
    DevicePluginOptions, KUBELET_SOCKET, device_plugin_server::DevicePluginServer,
};
use super::backend::DeviceBackend;
use super::plugin_server::ResourcePlugin;
use super::{registration, uds};

/// What the lifecycle needs to serve and register one resource.
pub struct Lifecycle<B> {
    pub plugin_dir: PathBuf,
    pub endpoint: String,
    pub resource: String,
    pub options: DevicePluginOptions,
    pub plugin: ResourcePlugin<B>,
    /// Bumped by the directory watcher on every creation or removal.
    pub kubelet_events: watch::Receiver<u64>,
    /// Flips once the first snapshot is in: nothing is served or registered before.
    pub ready: watch::Receiver<bool>,
    pub stop: watch::Receiver<bool>,
    /// Counts successful registrations, for status and tests.
    pub registrations: watch::Sender<u32>,
}

/// `kubelet.sock` can exist a moment before it accepts, and a refused connection costs
/// microseconds: retry every `FIRST_RETRY` for `FAST_PHASE`, so we register within a few
/// milliseconds of the kubelet accepting, then back off to `LAST_RETRY` when there is no
/// kubelet at all.
const FIRST_RETRY: Duration = Duration::from_millis(5);
const FAST_PHASE: Duration = Duration::from_secs(1);
const LAST_RETRY: Duration = Duration::from_secs(2);
/// The kubelet answers `Register` after dialing us back (10 s at most); a kubelet that accepts
/// but never answers must not hold a resource (or the agent's shutdown) forever.
const REGISTER_TIMEOUT: Duration = Duration::from_secs(15);

enum Registration {
    /// With the identity of the `kubelet.sock` that accepted.
    Accepted(Option<(u64, u64)>),
    SocketGone,
    Stopped,
}

/// A safety net under inotify (e.g. the directory itself was replaced): re-check this often.
const RECHECK: Duration = Duration::from_secs(5);

/// How long a new `kubelet.sock` may stand beside our socket before we take it as a restart
/// that will not delete our socket (see `wait_for_kubelet_restart`).
const DELETION_GRACE: Duration = Duration::from_secs(1);

/// Which `kubelet.sock` we registered with: a restarted kubelet makes a new file.
fn kubelet_identity(plugin_dir: &Path) -> Option<(u64, u64)> {
    std::fs::metadata(plugin_dir.join(KUBELET_SOCKET))
        .ok()
        .map(|m| (m.dev(), m.ino()))
}

impl<B: DeviceBackend> Lifecycle<B> {
    fn socket(&self) -> PathBuf {
        self.plugin_dir.join(&self.endpoint)
    }

    pub async fn run(mut self) {
        let mut ready = self.ready.clone();
        tokio::select! {
            _ = ready.wait_for(|r| *r) => {}
            _ = self.stop.wait_for(|s| *s) => return,
        }
        let mut bind_failures = 0u32;
        loop {
            if *self.stop.borrow() {
                return;
            }
            let (server_stop, server_stopped) = watch::channel(false);
            if let Err(e) = self.start_server(server_stopped) {
                if bind_failures == 0 {
                    tracing::error!(resource = self.resource, "cannot serve: {e}; retrying");
                }
                bind_failures += 1;
                if self.pause(LAST_RETRY).await {
                    return;
                }
                continue;
            }
            bind_failures = 0;
            let registered_with = match self.register().await {
                Registration::Accepted(identity) => identity,
                Registration::SocketGone => {
                    let _ = server_stop.send(true);
                    tracing::info!(
                        resource = self.resource,
                        "our socket vanished while registering; serving again"
                    );
                    continue;
                }
                Registration::Stopped => {
                    let _ = server_stop.send(true);
                    return;
                }
            };
            let stopped = self.wait_for_kubelet_restart(registered_with).await;
            let _ = server_stop.send(true);
            if stopped {
                return;
            }
            tracing::info!(
                resource = self.resource,
                "kubelet restarted; serving and registering again"
            );
        }
    }

    fn start_server(&self, server_stopped: watch::Receiver<bool>) -> std::io::Result<()> {
        std::fs::create_dir_all(&self.plugin_dir)?;
        let listener = uds::bind(&self.socket())?;
        restrict_to_owner(&self.socket());
        let plugin = self.plugin.clone();
        let (mut stop, mut server_stopped) = (self.stop.clone(), server_stopped);
        let resource = self.resource.clone();
        tokio::spawn(async move {
            let served = tonic::transport::Server::builder()
                .add_service(DevicePluginServer::new(plugin))
                .serve_with_incoming_shutdown(UnixListenerStream::new(listener), async move {
                    tokio::select! {
                        _ = stop.wait_for(|s| *s) => {}
                        _ = server_stopped.wait_for(|s| *s) => {}
                    }
                })
                .await;
            if let Err(e) = served {
                tracing::error!(resource, "device-plugin server failed: {e}");
            }
        });
        Ok(())
    }

    /// Registers, retrying until the kubelet accepts. A kubelet restarting meanwhile deletes our
    /// socket, and registering a socket that is gone can never succeed: that sends us back to
    /// serving.
    async fn register(&mut self) -> Registration {
        let mut delay = FIRST_RETRY;
        let mut complained = false;
        let started = tokio::time::Instant::now();
        loop {
            if !self.socket().exists() {
                return Registration::SocketGone;
            }
            let attempt = tokio::select! {
                attempt = tokio::time::timeout(
                    REGISTER_TIMEOUT,
                    registration::register(&self.plugin_dir, &self.endpoint, &self.resource, self.options),
                ) => attempt.unwrap_or_else(|_| Err(registration::RegistrationError::Timeout(REGISTER_TIMEOUT))),
                _ = self.stop.wait_for(|s| *s) => return Registration::Stopped,
            };
            match attempt {
                Ok(()) => {
                    self.registrations.send_modify(|n| *n += 1);
                    tracing::info!(
                        resource = self.resource,
                        endpoint = self.endpoint,
                        "registered with the kubelet"
                    );
                    // Only now: the kubelet that answered just dialed us back, so the file is
                    // its socket. Taken before the attempt it could still be a dead kubelet's
                    // file (or none), and the next directory event would look like a restart.
                    return Registration::Accepted(kubelet_identity(&self.plugin_dir));
                }
                Err(e) if !complained => {
                    tracing::warn!(resource = self.resource, "{e}; retrying with backoff");
                    complained = true;
                }
                Err(_) => {}
            }
            // A new kubelet.sock wakes us at once; otherwise back off.
            tokio::select! {
                _ = tokio::time::sleep(delay) => {}
                _ = kubelet_changed(&mut self.kubelet_events) => {}
                _ = self.stop.wait_for(|s| *s) => return Registration::Stopped,
            }
            if started.elapsed() >= FAST_PHASE {
                delay = (delay * 2).min(LAST_RETRY);
            }
        }
    }

    /// Waits until the kubelet restarted (returns false) or we are told to stop (true).
    ///
    /// A starting kubelet deletes our socket: that alone is the restart. A new `kubelet.sock`
    /// with our socket still in place is a restart whose deletion has not happened (or not
    /// reached us) yet, so it counts only once [`DELETION_GRACE`] passes without the deletion;
    /// reacting at once would register with the new kubelet and then again when it deletes
    /// our socket.
    async fn wait_for_kubelet_restart(&mut self, registered_with: Option<(u64, u64)>) -> bool {
        let mut replaced_since: Option<tokio::time::Instant> = None;
        loop {
            let recheck = match replaced_since {
                Some(since) => {
                    (since + DELETION_GRACE).saturating_duration_since(tokio::time::Instant::now())
                }
                None => RECHECK,
            };
            tokio::select! {
                _ = kubelet_changed(&mut self.kubelet_events) => {}
                _ = tokio::time::sleep(recheck) => {}
                _ = self.stop.wait_for(|s| *s) => return true,
            }
            if !self.socket().exists() {
                return false;
            }
            let kubelet_replaced =
                kubelet_identity(&self.plugin_dir).is_some_and(|now| Some(now) != registered_with);
            replaced_since = match (kubelet_replaced, replaced_since) {
                (false, _) => None,
                (true, None) => Some(tokio::time::Instant::now()),
                (true, Some(since)) if since.elapsed() >= DELETION_GRACE => return false,
                (true, since) => since,
            };
        }
    }

    /// Sleeps, returning true if told to stop meanwhile.
    async fn pause(&mut self, d: Duration) -> bool {
        tokio::select! {
            _ = tokio::time::sleep(d) => false,
            _ = self.stop.wait_for(|s| *s) => true,
        }
    }
}

/// Resolves on the next directory event; never, once the watcher is gone (the timers take over).
async fn kubelet_changed(events: &mut watch::Receiver<u64>) {
    if events.changed().await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// Only the kubelet (root) may talk to a plugin socket.
fn restrict_to_owner(path: &Path) {
    use std::os::unix::fs::PermissionsExt;
    if let Err(e) = std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)) {
        tracing::warn!("cannot restrict {} to its owner: {e}", path.display());
    }
}
