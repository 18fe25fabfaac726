//! One resource's life with the kubelet: serve, register, and do both again whenever the kubelet
//! restarts (our socket vanished, or `kubelet.sock` is a new file), until told to stop. On the
//! plugin-watcher route the kubelet comes to us instead: serve, and hear what it reports.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::sync::watch;
use tonic::service::Routes;

use std::sync::Arc;

use tokio::sync::mpsc;

use super::api::deviceplugin::VERSION;
use super::api::deviceplugin::{
    DevicePluginOptions, KUBELET_SOCKET, device_plugin_server::DevicePluginServer,
};
use super::api::pluginregistration::{DEVICE_PLUGIN, RegistrationStatus};
use super::plugin_server::ResourcePlugin;
use super::registration;
use super::route::{RegistrationState, Route};
use crate::backoff::Backoff;
use crate::plugin_socket::{self, WatcherInfo};
use crate::resource::backend::DeviceBackend;

/// What the lifecycle needs to serve and register one resource.
pub struct Lifecycle<B> {
    pub plugin_dir: PathBuf,
    pub endpoint: String,
    pub resource: String,
    /// Changed by an upgrade whose new version asks for other calls: register again.
    pub options: watch::Receiver<DevicePluginOptions>,
    /// Bumped to end the ListAndWatch streams of the current registration (the plugin's streams
    /// end when it changes) before registering again on the same socket.
    pub streams: watch::Sender<u64>,
    pub plugin: ResourcePlugin<B>,
    /// Bumped by the directory watcher on every creation or removal.
    pub kubelet_events: watch::Receiver<u64>,
    /// Flips once the first snapshot is in: nothing is served or registered before.
    pub ready: watch::Receiver<bool>,
    /// For a resource whose devices are named by CDI: flips once its spec names what was first
    /// prepared (or naming is off for now). Registering waits for it, so that no answer the
    /// kubelet checkpoints lacks the names it would have had a moment later.
    pub cdi_settled: Option<watch::Receiver<bool>>,
    pub stop: watch::Receiver<bool>,
    /// Counts successful registrations, for status and tests.
    pub registrations: watch::Sender<u32>,
    pub route: Route,
    pub state: Arc<RegistrationState>,
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

/// The longest a resource named by CDI waits for its spec before registering anyway: the first
/// round of prepared answers takes a module call per device, which a slow module can make long.
const CDI_SETTLE_LIMIT: Duration = Duration::from_secs(60);

/// How long to wait for the kubelet to drop its connections to our socket after the streams of
/// a registration ended, before registering with other options anyway.
const DISCONNECT_WAIT: Duration = Duration::from_secs(5);

/// After the kubelet reports a failed registration on the plugin-watcher route, how long to
/// wait for it to succeed by itself before serving on a new file; doubled per failure in a row.
const REFUSED_RETRY: Duration = Duration::from_secs(2);
const REFUSED_RETRY_MAX: Duration = Duration::from_secs(60);

/// Registration reports from the plugin watcher waiting to be read; the kubelet sends one per
/// registration attempt, so a handful is plenty.
const NOTICES: usize = 8;

/// Why a registration is over.
enum Over {
    Stopped,
    KubeletRestarted,
    OptionsChanged,
    /// On the plugin-watcher route: the kubelet reported a failed registration and has not
    /// registered us since.
    Refused,
}

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
        self.route.socket_dir(&self.plugin_dir).join(&self.endpoint)
    }

    pub async fn run(mut self) {
        let mut ready = self.ready.clone();
        tokio::select! {
            _ = ready.wait_for(|r| *r) => {}
            _ = self.stop.wait_for(|s| *s) => return,
        }
        if let Some(mut settled) = self.cdi_settled.take() {
            tokio::select! {
                _ = settled.wait_for(|s| *s) => {}
                _ = self.stop.wait_for(|s| *s) => return,
                () = tokio::time::sleep(CDI_SETTLE_LIMIT) => tracing::warn!(
                    resource = self.resource,
                    "its CDI spec is not written {CDI_SETTLE_LIMIT:?} after its first snapshot; \
                     registering anyway (Allocate lists the devices it cannot name)"
                ),
            }
        }
        let mut bind_failures = 0u32;
        let mut refusals = Backoff::new(REFUSED_RETRY, REFUSED_RETRY_MAX);
        loop {
            if *self.stop.borrow() {
                return;
            }
            let (server_stop, server_stopped) = watch::channel(false);
            let (open, connections) = watch::channel(0usize);
            let (notify, mut notices) = mpsc::channel(NOTICES);
            if let Err(e) = self.start_server(server_stopped, open, notify) {
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
            let watched = matches!(self.route, Route::PluginWatcher(_));
            let over = if watched {
                self.via_plugin_watcher(&mut notices, &connections, &mut refusals)
                    .await
            } else {
                self.via_kubelet_socket(&connections).await
            };
            self.state.set_registered(false);
            let _ = server_stop.send(true);
            match over {
                Over::Stopped => return,
                Over::OptionsChanged => tracing::info!(
                    resource = self.resource,
                    "the module's new version asks for other calls; serving on a new socket file for the plugin watcher"
                ),
                Over::KubeletRestarted if !watched => {
                    self.state.kubelet_restarted();
                    tracing::info!(
                        resource = self.resource,
                        "kubelet restarted; serving and registering again"
                    )
                }
                Over::KubeletRestarted => {}
                Over::Refused => tracing::info!(
                    resource = self.resource,
                    "serving on a new file for the plugin watcher to register"
                ),
            }
        }
    }

    /// Registers on this server until the kubelet restarts or we stop; options changed by an
    /// upgrade are registered again on the same socket.
    async fn via_kubelet_socket(&mut self, connections: &watch::Receiver<usize>) -> Over {
        loop {
            let registered_with = match self.register().await {
                Registration::Accepted(identity) => identity,
                Registration::SocketGone => {
                    tracing::info!(
                        resource = self.resource,
                        "our socket vanished while registering; serving again"
                    );
                    return Over::KubeletRestarted;
                }
                Registration::Stopped => return Over::Stopped,
            };
            self.state.set_registered(true);
            match self.wait_until_over(registered_with, connections).await {
                Over::OptionsChanged => {
                    tracing::info!(
                        resource = self.resource,
                        "the module's new version asks for other calls; registering again"
                    );
                    // End this registration's streams and let the kubelet disconnect it
                    // before it sees the next one.
                    self.state.set_registered(false);
                    self.streams.send_modify(|n| *n += 1);
                    if self.disconnected(connections.clone()).await {
                        return Over::Stopped;
                    }
                }
                over => return over,
            }
        }
    }

    /// Serves the plugin watcher until our socket is gone, the options change or we stop,
    /// recording what the kubelet reports. A kubelet restart needs nothing from us: the new
    /// kubelet finds the socket again and reports a new registration.
    async fn via_plugin_watcher(
        &mut self,
        notices: &mut mpsc::Receiver<RegistrationStatus>,
        connections: &watch::Receiver<usize>,
        refusals: &mut Backoff,
    ) -> Over {
        enum Event {
            Notice(RegistrationStatus),
            Check,
            Stop,
            Options,
            Retry,
        }
        let mut listening = true;
        let mut streams = connections.clone();
        // Set by a failed registration: when to serve on a new file if the kubelet has not
        // registered us by then.
        let mut retry_at: Option<tokio::time::Instant> = None;
        loop {
            let retry = retry_at;
            let event = tokio::select! {
                notice = notices.recv(), if listening => match notice {
                    Some(notice) => Event::Notice(notice),
                    None => {
                        listening = false;
                        Event::Check
                    }
                },
                _ = changed(&mut self.kubelet_events) => Event::Check,
                _ = tokio::time::sleep(RECHECK) => Event::Check,
                _ = self.stop.wait_for(|s| *s) => Event::Stop,
                _ = changed(&mut self.options) => Event::Options,
                _ = changed(&mut streams) => Event::Check,
                _ = sleep_until(retry), if retry.is_some() => Event::Retry,
            };
            match event {
                Event::Notice(RegistrationStatus {
                    plugin_registered: true,
                    ..
                }) => {
                    self.state.set_registered(true);
                    self.registrations.send_modify(|n| *n += 1);
                    retry_at = None;
                    refusals.reset();
                    tracing::info!(
                        resource = self.resource,
                        socket = %self.socket().display(),
                        "registered with the kubelet's plugin watcher"
                    );
                }
                Event::Notice(RegistrationStatus { error, .. }) => {
                    self.state.set_registered(false);
                    self.state.failed();
                    // The kubelet retries a registration its plugin watcher refused, but not
                    // one its device manager failed (it counts the socket as handled): if it
                    // has not registered us after a backoff, a new file makes it try again.
                    let backoff = refusals.current();
                    retry_at.get_or_insert(tokio::time::Instant::now() + backoff);
                    tracing::warn!(
                        resource = self.resource,
                        "the kubelet could not register us: {error}; serving on a new file in {backoff:?} unless it does meanwhile"
                    );
                }
                Event::Retry => {
                    refusals.failed();
                    return Over::Refused;
                }
                Event::Check => {}
                Event::Stop => return Over::Stopped,
                Event::Options => {
                    // The kubelet reads the options only when it registers us: end this
                    // registration and serve on a new file, which the watcher registers anew.
                    self.streams.send_modify(|n| *n += 1);
                    if self.disconnected(connections.clone()).await {
                        return Over::Stopped;
                    }
                    return Over::OptionsChanged;
                }
            }
            if *streams.borrow() == 0 {
                self.state.set_registered(false);
            }
            if !self.socket().exists() {
                tracing::info!(
                    resource = self.resource,
                    "our socket in the plugin watcher's directory vanished; serving again"
                );
                return Over::KubeletRestarted;
            }
        }
    }

    /// Waits (up to [`DISCONNECT_WAIT`]) until no connection to our socket is open; true if
    /// told to stop meanwhile.
    async fn disconnected(&mut self, connections: watch::Receiver<usize>) -> bool {
        tokio::select! {
            drained = all_closed_within(&connections, DISCONNECT_WAIT) => {
                if !drained {
                    tracing::warn!(
                        resource = self.resource,
                        "the kubelet kept its connection {DISCONNECT_WAIT:?} after the stream ended; registering anyway"
                    );
                }
                false
            }
            _ = self.stop.wait_for(|s| *s) => true,
        }
    }

    /// Serves on the agent's runtime, never on a thread that runs module code: a vendor call
    /// that blocks its thread (a hung driver) must not stall the kubelet's connection, so every
    /// call still ends at its deadline and answers kept by the host are still given.
    fn start_server(
        &self,
        server_stopped: watch::Receiver<bool>,
        open: watch::Sender<usize>,
        notices: mpsc::Sender<RegistrationStatus>,
    ) -> std::io::Result<()> {
        let plugin = self.plugin.clone();
        let (mut stop, mut server_stopped) = (self.stop.clone(), server_stopped);
        let routes = Routes::new(DevicePluginServer::new(plugin));
        let routes = match &self.route {
            Route::KubeletSocket => routes,
            Route::PluginWatcher(_) => routes.add_service(plugin_socket::watcher_registration(
                WatcherInfo {
                    kind: DEVICE_PLUGIN,
                    name: self.resource.clone(),
                    // This very socket serves the device-plugin API.
                    endpoint: self.socket(),
                    versions: vec![VERSION.into()],
                },
                // A lifecycle that is not listening any more (its server is being replaced) has
                // no use for the notice; the kubelet must not wait on it.
                move |notice| {
                    let _ = notices.try_send(notice);
                },
            )),
        };
        let shutdown = async move {
            tokio::select! {
                _ = stop.wait_for(|s| *s) => {}
                _ = server_stopped.wait_for(|s| *s) => {}
            }
        };
        let resource = self.resource.clone();
        let served = plugin_socket::serve(&self.socket(), routes, Some(open), shutdown, false)?;
        tokio::spawn(async move {
            let _ = served.await;
            tracing::debug!(resource, "device-plugin server stopped");
        });
        Ok(())
    }

    /// Registers, retrying until the kubelet accepts. A kubelet restarting meanwhile deletes our
    /// socket, and registering a socket that is gone can never succeed: that sends us back to
    /// serving.
    async fn register(&mut self) -> Registration {
        let mut slow = Backoff::new(FIRST_RETRY, LAST_RETRY);
        let mut complained = false;
        let started = tokio::time::Instant::now();
        loop {
            if !self.socket().exists() {
                return Registration::SocketGone;
            }
            let attempt = tokio::select! {
                attempt = tokio::time::timeout(
                    REGISTER_TIMEOUT,
                    registration::register(&self.plugin_dir, &self.endpoint, &self.resource, *self.options.borrow_and_update()),
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
                Err(e) => {
                    if matches!(e, registration::RegistrationError::Refused { .. }) {
                        self.state.failed();
                    }
                    if !complained {
                        tracing::warn!(resource = self.resource, "{e}; retrying with backoff");
                        complained = true;
                    }
                }
            }
            // A new kubelet.sock wakes us at once; otherwise back off.
            let delay = if started.elapsed() < FAST_PHASE {
                FIRST_RETRY
            } else {
                slow.failed()
            };
            tokio::select! {
                _ = tokio::time::sleep(delay) => {}
                _ = changed(&mut self.kubelet_events) => {}
                _ = self.stop.wait_for(|s| *s) => return Registration::Stopped,
            }
        }
    }

    /// Waits until the kubelet restarted, the options changed or we are told to stop.
    ///
    /// A starting kubelet deletes our socket: that alone is the restart. A new `kubelet.sock`
    /// with our socket still in place is a restart whose deletion has not happened (or not
    /// reached us) yet, so it counts only once [`DELETION_GRACE`] passes without the deletion;
    /// reacting at once would register with the new kubelet and then again when it deletes
    /// our socket.
    async fn wait_until_over(
        &mut self,
        registered_with: Option<(u64, u64)>,
        connections: &watch::Receiver<usize>,
    ) -> Over {
        let mut replaced_since: Option<tokio::time::Instant> = None;
        let mut connections = connections.clone();
        loop {
            let recheck = match replaced_since {
                Some(since) => {
                    (since + DELETION_GRACE).saturating_duration_since(tokio::time::Instant::now())
                }
                None => RECHECK,
            };
            tokio::select! {
                _ = changed(&mut self.kubelet_events) => {}
                _ = tokio::time::sleep(recheck) => {}
                _ = self.stop.wait_for(|s| *s) => return Over::Stopped,
                _ = changed(&mut self.options) => return Over::OptionsChanged,
                _ = changed(&mut connections) => {}
            }
            // The kubelet holds a connection for as long as it streams from us: with none, it
            // no longer holds the registration (it is restarting, or let us go).
            if *connections.borrow() == 0 {
                self.state.set_registered(false);
            }
            if !self.socket().exists() {
                return Over::KubeletRestarted;
            }
            let kubelet_replaced =
                kubelet_identity(&self.plugin_dir).is_some_and(|now| Some(now) != registered_with);
            replaced_since = match (kubelet_replaced, replaced_since) {
                (false, _) => None,
                (true, None) => Some(tokio::time::Instant::now()),
                (true, Some(since)) if since.elapsed() >= DELETION_GRACE => {
                    return Over::KubeletRestarted;
                }
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

/// Whether every connection counted in `connections` closes within `within`.
async fn all_closed_within(connections: &watch::Receiver<usize>, within: Duration) -> bool {
    let mut connections = connections.clone();
    tokio::time::timeout(within, connections.wait_for(|n| *n == 0))
        .await
        .is_ok_and(|r| r.is_ok())
}

/// Resolves when the value changes (the next directory event, new options, a connection opened
/// or closed); never, once nobody can change it (a watcher gone leaves the timers to it).
async fn changed<T>(value: &mut watch::Receiver<T>) {
    if value.changed().await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// Resolves at `at`; never without one.
async fn sleep_until(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}
