//! A stand-in for the kubelet's device manager, for our integration tests and for vendors trying
//! their module locally (`devicelet simulate`).
//!
//! It behaves as `KUBELET.md` describes the real kubelet, and in particular **fails where the
//! kubelet fails**: a plugin that registers before it serves, sends a path as endpoint, picks a
//! resource name the kubelet refuses, answers `Allocate` with no container responses, or lets
//! ListAndWatch end, sees here what it would see on a node. A simulator that is more forgiving
//! than the kubelet would let tests pass that fail in production.
//!
//! What it does, per `KUBELET.md`:
//! - serves `v1beta1.Registration` on `kubelet.sock` in the plugin directory, after deleting
//!   every socket there, as a starting kubelet does (§7);
//! - `Register` checks version, resource name and endpoint, dials the plugin (10 s), and calls
//!   `GetDevicePluginOptions` before answering; those options, not the request's, are used (§1–2);
//! - consumes ListAndWatch: every message is a full snapshot; capacity = all devices,
//!   allocatable = those exactly `"Healthy"`, 0 as soon as the stream ends (§3);
//! - a re-registration of a resource replaces its client (§8);
//! - [`Simulator::allocate`] / [`Simulator::allocate_for`] follow the kubelet's
//!   GetPreferredAllocation → Allocate → PreStartContainer sequence (§4–5) for a container of a
//!   pod; [`Simulator::release`] / [`Simulator::terminate_pod`] end it;
//! - serves `v1.PodResourcesLister` on its own socket ([`Simulator::pod_resources_socket`],
//!   by default `<plugin_dir>/../pod-resources/kubelet.sock`), telling which container holds
//!   which devices (§9); it keeps serving across restarts, and allocations survive them (the
//!   kubelet's checkpoint);
//! - [`Simulator::restart`] simulates a kubelet restart: sockets in the plugin directory deleted
//!   (checkpoint kept), plugins forgotten, and a new `kubelet.sock` that exists
//!   [`SimConfig::accept_delay`] before it accepts connections (§7);
//! - with [`SimConfig::plugins_registry`], the plugin watcher's route (§11): sockets appearing in
//!   that directory are asked `GetInfo` (with the socket path as `:authority`, as the kubelet's
//!   grpc-go client sends it), validated, registered with the device manager as after `Register`,
//!   and told the outcome with `NotifyRegistrationStatus`; a removed socket deregisters its
//!   plugin; a restart leaves the directory alone and finds the plugins there again by its
//!   start-up scan ([`Simulator::registry_attempts`], [`SimEvent::RegistryAttempt`]).
//!
//! Where the kubelet waits forever (§6) the simulator gives up after
//! [`SimConfig::stall_limit`] with [`SimError::Stalled`], so a test fails instead of hanging.
//!
//! Not simulated: topology-manager alignment, init-container device reuse, the 5-minute grace
//! after which a resource whose stream ended disappears, CPU/memory/dynamic resources in the
//! PodResources API, pods without devices, and the CSI and DRA handlers of the plugin watcher.

mod allocate;
pub mod apiserver;
mod claim_allocator;
mod claim_status;
mod dra;
mod dra_pods;
mod endpoint;
mod error;
mod events;
mod podresources;
pub use devicelet_api::quantity;
mod registration;
mod scheduler;
mod server;
mod state;
mod validation;
mod watcher;

pub use claim_allocator::{DeviceRequest, Left};

#[cfg(test)]
mod fake;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::{broadcast, watch};
use tracing::info;

use devicelet_api::deviceplugin::KUBELET_SOCKET;

pub use dra::{DraDeviceHealth, DraRegistration, DraService};
pub use dra_pods::PodClaim;
pub use error::SimError;
pub use events::SimEvent;
pub use state::{Allocation, PodRef, ResourceState};
pub use watcher::RegistryAttempt;

use server::ServerHandle;
use state::Registry;

/// The API server a simulated kubelet reaches for DRA, and which node it is.
#[derive(Debug, Clone, PartialEq)]
pub struct DraApi {
    pub server: apiserver::ApiHandle,
    pub node: String,
}

/// Timings of the simulated kubelet. The defaults are the kubelet's; tests shorten them.
#[derive(Debug, Clone, PartialEq)]
pub struct SimConfig {
    /// How long `Register` keeps trying to connect to the plugin's socket (kubelet: 10 s).
    pub dial_timeout: Duration,
    /// The deadline of `PreStartContainer` (kubelet: 30 s).
    pub prestart_timeout: Duration,
    /// How long to wait for `GetDevicePluginOptions`, `GetPreferredAllocation` and `Allocate`,
    /// on which the kubelet sets no deadline at all. Past it the simulator reports
    /// [`SimError::Stalled`] (or refuses the registration) instead of hanging. Default 30 s.
    pub stall_limit: Duration,
    /// After a [`restart`](Simulator::restart), how long `kubelet.sock` exists before it accepts
    /// connections; until then connecting fails with `ECONNREFUSED`, as between the kubelet's
    /// `bind` and `listen` (KUBELET.md §7: retry quickly). Default 50 ms; zero serves at once.
    /// [`start`](Simulator::start) always serves at once.
    pub accept_delay: Duration,
    /// Where to serve the PodResources API. None: `pod-resources/kubelet.sock` next to the
    /// plugin directory, as on a node (`/var/lib/kubelet/pod-resources/kubelet.sock`).
    pub pod_resources_socket: Option<PathBuf>,
    /// Enables the plugin watcher's registration route (KUBELET.md §11) on this directory (on a
    /// node `/var/lib/kubelet/plugins_registry`,
    /// [`devicelet_api::pluginregistration::DEFAULT_DIR`]): created if missing, watched
    /// recursively, scanned at start and after every restart, and never wiped. Keep it out of
    /// the plugin directory, whose sockets a restart deletes.
    /// None (the default): only `kubelet.sock` registers plugins.
    pub plugins_registry: Option<PathBuf>,
    /// The pause before the plugin watcher tries a socket again after a failure it retries
    /// (dial, `GetInfo`, type, validation); it doubles with every failure up to 2m2s, as the
    /// kubelet's reconciler backs off. Default 500 ms, the kubelet's first pause.
    pub registry_retry: Duration,
    /// The deadline on `NodePrepareResources` and `NodeUnprepareResources` (kubelet: 45 s,
    /// half its retry period).
    pub dra_call_timeout: Duration,
    /// The pause before the kubelet opens a DRA driver's health stream again after it failed or
    /// ended (kubelet 1.36: 5 s).
    pub dra_health_retry: Duration,
    /// The API server this kubelet's DRA manager reaches, and the node it runs: it wipes the
    /// node's ResourceSlices at every start, and a driver's [`dra_wipe_delay`](Self::dra_wipe_delay)
    /// after its last endpoint deregistered unless it registered again. None: no wipes.
    pub dra_api: Option<DraApi>,
    /// How long after a DRA driver's last endpoint goes its slices are wiped (kubelet: 30 s).
    pub dra_wipe_delay: Duration,
    /// Which kubelet's wipe on de-registration this one does.
    pub dra_wipe: DraWipe,
    /// How long after a socket event in [`plugins_registry`](Self::plugins_registry) the plugin
    /// watcher acts on it (with every event that arrived meanwhile, in order). The kubelet's
    /// reconciler looks once a second, so up to 1 s; default zero: at once.
    pub registry_lag: Duration,
}

/// What the kubelet's DRA manager does to a driver's slices when its last endpoint goes
/// (KUBELET.md §DRA).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DraWipe {
    /// 1.34 and later: wiped [`SimConfig::dra_wipe_delay`] later, unless the driver registered
    /// again meanwhile.
    #[default]
    Delayed,
    /// 1.32–1.33: wiped at once, in the background, whatever follows — a driver replacing its
    /// registration socket loses its slices.
    AtOnce,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            dial_timeout: Duration::from_secs(10),
            prestart_timeout: Duration::from_secs(30),
            stall_limit: Duration::from_secs(30),
            accept_delay: Duration::from_millis(50),
            pod_resources_socket: None,
            plugins_registry: None,
            registry_retry: Duration::from_millis(500),
            dra_call_timeout: devicelet_api::dra::CALL_DEADLINE,
            dra_health_retry: Duration::from_secs(5),
            dra_api: None,
            dra_wipe_delay: Duration::from_secs(30),
            dra_wipe: DraWipe::Delayed,
            registry_lag: Duration::ZERO,
        }
    }
}

/// The order in which a [`Simulator::restart_in_order`] changes the device-plugin directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RestartOrder {
    /// The kubelet's own order (KUBELET.md §7): every socket deleted, then `kubelet.sock`
    /// created again (the pause is not used).
    SocketsThenKubelet,
    /// The plugins' sockets go first; the old `kubelet.sock` stays, refusing connections, until
    /// the pause is over and a new one replaces it.
    PluginSocketsFirst,
    /// A new `kubelet.sock` replaces the old one first; the plugins' sockets are deleted only
    /// after the pause.
    KubeletFirst,
}

/// The PodResources socket's default place for `plugin_dir`: `pod-resources/kubelet.sock` in its
/// parent directory (`/var/lib/kubelet/device-plugins` → `/var/lib/kubelet/pod-resources/kubelet.sock`).
pub fn default_pod_resources_socket(plugin_dir: &Path) -> PathBuf {
    let parent = match (plugin_dir.file_name(), plugin_dir.parent()) {
        (Some(_), Some(parent)) => parent.to_owned(),
        // `/`, `..`, `foo/..`: no name to strip.
        _ => plugin_dir.join(".."),
    };
    parent.join("pod-resources").join(KUBELET_SOCKET)
}

/// A running simulated kubelet. Cheap to clone: all clones share one simulator. Dropping the
/// last clone stops it (without removing `kubelet.sock`; [`shutdown`](Self::shutdown) does).
#[derive(Clone)]
pub struct Simulator {
    inner: Arc<Inner>,
    _guard: Arc<StopOnDrop>,
}

/// State shared by the handle, the Registration service and the ListAndWatch tasks.
struct Inner {
    dir: PathBuf,
    socket: PathBuf,
    pod_resources_socket: PathBuf,
    config: SimConfig,
    registry: Mutex<Registry>,
    /// Bumped on every change, for [`Simulator::wait_until`].
    changed: watch::Sender<u64>,
    events: broadcast::Sender<SimEvent>,
    /// The incarnation of the kubelet now serving; registrations of an earlier one are refused.
    epoch: AtomicU64,
    server: Mutex<Option<ServerHandle>>,
    /// The PodResources server, which runs from start to shutdown, restarts included.
    pod_server: Mutex<Option<ServerHandle>>,
    /// The plugin watcher, with [`SimConfig::plugins_registry`]; replaced at every restart.
    watcher: Mutex<Option<watcher::PluginWatcher>>,
    /// The kubelet admits one pod at a time.
    admission: tokio::sync::Mutex<()>,
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, Registry> {
        self.registry.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Wakes waiters, and publishes `event` if given. Called with the registry locked, so that
    /// events come out in the order the state changed.
    fn notify(&self, event: Option<SimEvent>) {
        self.changed.send_modify(|n| *n = n.wrapping_add(1));
        if let Some(event) = event {
            // No subscriber is fine.
            let _ = self.events.send(event);
        }
    }

    fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::SeqCst)
    }

    fn next_epoch(&self) -> u64 {
        self.epoch.fetch_add(1, Ordering::SeqCst) + 1
    }

    /// Stops the server and every stream task without waiting (drop).
    fn abort(&self) {
        self.next_epoch();
        let server = self
            .server
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(server) = server {
            server.abort();
        }
        if let Some(server) = self.take_pod_server() {
            server.abort();
        }
        self.stop_watcher();
        self.lock().abort_streams();
    }

    /// A starting kubelet's DRA manager wipes every ResourceSlice of its node at once.
    fn wipe_at_start(&self) {
        if let Some(api) = &self.config.dra_api {
            let wiped = api.server.wipe_slices(&api.node, None);
            info!(
                "kubelet start: {wiped} ResourceSlices of node {} wiped",
                api.node
            );
        }
    }

    /// The last endpoint of `driver` went: its slices are wiped after the delay, unless it
    /// registered again meanwhile (which cancels the wipe); a wipe already queued keeps its
    /// deadline. Called with the registry locked.
    fn wipe_later(self: &Arc<Self>, registry: &mut Registry, driver: &str) {
        let Some(api) = self.config.dra_api.clone() else {
            return;
        };
        if self.config.dra_wipe == DraWipe::AtOnce {
            let driver = driver.to_owned();
            tokio::spawn(async move {
                let wiped = api.server.wipe_slices(&api.node, Some(&driver));
                info!("DRA driver {driver} deregistered: {wiped} ResourceSlices wiped at once");
            });
            return;
        }
        let Some(token) = registry.dra.queue_wipe(driver) else {
            return;
        };
        let (inner, driver) = (Arc::downgrade(self), driver.to_owned());
        let delay = self.config.dra_wipe_delay;
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            let Some(inner) = inner.upgrade() else {
                return;
            };
            if !inner.lock().dra.wipe_due(&driver, token) {
                return;
            }
            let wiped = api.server.wipe_slices(&api.node, Some(&driver));
            info!("DRA driver {driver} gone for {delay:?}: {wiped} ResourceSlices wiped");
        });
    }

    /// Starts the plugin watcher if configured: it scans the directory, then follows it.
    fn start_watcher(self: &Arc<Self>) -> Result<(), SimError> {
        let Some(dir) = &self.config.plugins_registry else {
            return Ok(());
        };
        let started = watcher::start(self, dir)?;
        let previous = self
            .watcher
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .replace(started);
        if let Some(previous) = previous {
            previous.abort();
        }
        Ok(())
    }

    /// Stops the plugin watcher and forgets what it found (a restarting kubelet's plugin
    /// manager starts empty); registrations in flight are dropped. The clients it registered
    /// stay until the caller drops them.
    fn stop_watcher(&self) {
        let watcher = self
            .watcher
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(watcher) = watcher {
            watcher.abort();
        }
        let mut registry = self.lock();
        registry.watch.epoch += 1;
        registry.watch.plugins.clear();
        // Its DRA plugin manager starts empty too; dropping it ends the health streams.
        registry.dra = dra::DraState::default();
    }

    fn take_pod_server(&self) -> Option<ServerHandle> {
        self.pod_server
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }
}

/// Stops the simulator when the last handle goes: the server task and stream tasks hold the
/// shared state alive, so this guard, held only by handles, is what notices.
struct StopOnDrop(Arc<Inner>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Simulator {
    /// Creates `plugin_dir` if missing and serves `v1beta1.Registration` on
    /// `plugin_dir/kubelet.sock`, and `v1.PodResourcesLister` on
    /// [`pod_resources_socket`](Self::pod_resources_socket), with the kubelet's timings. Both
    /// accept connections when this returns.
    ///
    /// Like a starting kubelet it first deletes every socket file in `plugin_dir` (keeping the
    /// checkpoint), so plugins already serving there must notice and register again. It refuses
    /// to start if something already accepts connections on `kubelet.sock` or on the
    /// PodResources socket (a real kubelet, or another simulator), rather than taking its socket
    /// away. As that socket lives next to `plugin_dir` by default, simulators running side by
    /// side (parallel tests) need plugin directories with distinct parents, e.g.
    /// `<tempdir>/device-plugins`, or their own [`SimConfig::pod_resources_socket`].
    pub async fn start(plugin_dir: &Path) -> Result<Simulator, SimError> {
        Self::start_with(plugin_dir, SimConfig::default()).await
    }

    /// [`start`](Self::start) with other timings (tests use short ones).
    pub async fn start_with(plugin_dir: &Path, config: SimConfig) -> Result<Simulator, SimError> {
        let io = |path: &Path| {
            let path = path.to_owned();
            move |source| SimError::Io { path, source }
        };
        tokio::fs::create_dir_all(plugin_dir)
            .await
            .map_err(io(plugin_dir))?;
        let dir = plugin_dir.to_owned();
        let socket = dir.join(KUBELET_SOCKET);
        let pod_resources_socket = config
            .pod_resources_socket
            .clone()
            .unwrap_or_else(|| default_pod_resources_socket(&dir));
        for path in [&socket, &pod_resources_socket] {
            if server::accepts_connections(path).await {
                return Err(SimError::AlreadyServed { path: path.clone() });
            }
        }
        if let Some(parent) = pod_resources_socket.parent() {
            tokio::fs::create_dir_all(parent)
                .await
                .map_err(io(parent))?;
        }
        let removed = server::remove_sockets(&dir).map_err(io(&dir))?;

        let inner = Arc::new(Inner {
            dir,
            socket,
            pod_resources_socket,
            config,
            registry: Mutex::new(Registry::default()),
            changed: watch::Sender::new(0),
            events: broadcast::Sender::new(1024),
            epoch: AtomicU64::new(0),
            server: Mutex::new(None),
            pod_server: Mutex::new(None),
            watcher: Mutex::new(None),
            admission: tokio::sync::Mutex::new(()),
        });
        inner.wipe_at_start();
        let pod_server = server::serve_pod_resources(&inner)?;
        *inner
            .pod_server
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(pod_server);
        if let Err(e) = server::serve(&inner, Duration::ZERO).and_then(|()| inner.start_watcher()) {
            inner.abort();
            return Err(e);
        }
        info!(
            "simulated kubelet serving {} ({removed} stale sockets removed), PodResources on {}",
            inner.socket.display(),
            inner.pod_resources_socket.display()
        );
        Ok(Simulator {
            _guard: Arc::new(StopOnDrop(Arc::clone(&inner))),
            inner,
        })
    }

    /// The device-plugin directory, as given to [`start`](Self::start): plugins bind their
    /// sockets here.
    pub fn plugin_dir(&self) -> &Path {
        &self.inner.dir
    }

    /// The simulated kubelet's registration socket, `plugin_dir/kubelet.sock`.
    pub fn socket(&self) -> &Path {
        &self.inner.socket
    }

    /// Where the PodResources API (`v1.PodResourcesLister`) is served: by default
    /// `pod-resources/kubelet.sock` next to the plugin directory, or
    /// [`SimConfig::pod_resources_socket`].
    pub fn pod_resources_socket(&self) -> &Path {
        &self.inner.pod_resources_socket
    }

    /// The timings in use.
    pub fn config(&self) -> &SimConfig {
        &self.inner.config
    }

    /// Snapshot of what the simulated kubelet knows about one resource, None if never
    /// registered.
    pub fn resource(&self, name: &str) -> Option<ResourceState> {
        self.inner.lock().snapshot(name)
    }

    /// How many times `name` was registered successfully, across restarts; 0 if never.
    pub fn registrations(&self, name: &str) -> u32 {
        self.resource(name).map_or(0, |r| r.registrations)
    }

    /// Snapshots of every resource ever registered, sorted by name.
    pub fn resources(&self) -> Vec<ResourceState> {
        let registry = self.inner.lock();
        registry
            .resources
            .values()
            .map(|r| r.state.clone())
            .collect()
    }

    /// Follows what happens from now on (registrations, refusals, snapshots, stream ends,
    /// allocations). A subscriber that falls more than 1024 events behind gets
    /// `RecvError::Lagged`.
    pub fn events(&self) -> broadcast::Receiver<SimEvent> {
        self.inner.events.subscribe()
    }

    /// Waits until `pred` holds for the resource (which may not be registered yet), woken by
    /// every change rather than polling. On timeout the error shows the last state, so a failing
    /// test says what the kubelet saw instead.
    pub async fn wait_until(
        &self,
        name: &str,
        timeout: Duration,
        pred: impl Fn(&ResourceState) -> bool,
    ) -> Result<ResourceState, SimError> {
        let deadline = tokio::time::Instant::now() + timeout;
        // Subscribe before looking, so a change between the look and the wait is not missed.
        let mut changes = self.inner.changed.subscribe();
        loop {
            let last = self.resource(name);
            if let Some(state) = last.as_ref().filter(|s| pred(s)) {
                return Ok(state.clone());
            }
            // The sender lives as long as `self`, so `changed` fails only by timing out.
            if !matches!(
                tokio::time::timeout_at(deadline, changes.changed()).await,
                Ok(Ok(()))
            ) {
                return Err(SimError::Timeout {
                    resource: name.to_owned(),
                    after: timeout,
                    last: self.resource(name).map(Box::new),
                });
            }
        }
    }

    /// The plugin watcher's directory ([`SimConfig::plugins_registry`]), if that route is on.
    pub fn plugins_registry(&self) -> Option<&Path> {
        self.inner.config.plugins_registry.as_deref()
    }

    /// Every registration attempt the plugin watcher made, in order, across restarts: which
    /// socket, what `GetInfo` answered, the error if any (what `NotifyRegistrationStatus`
    /// carried), whether the notification was delivered. Empty without
    /// [`SimConfig::plugins_registry`].
    pub fn registry_attempts(&self) -> Vec<RegistryAttempt> {
        self.inner.lock().watch.attempts.clone()
    }

    /// The sockets the plugin watcher now knows in its directory, each with the resource name
    /// it was registered (or is being registered) under once `GetInfo` passed validation.
    pub fn registry_sockets(&self) -> BTreeMap<PathBuf, Option<String>> {
        self.inner
            .lock()
            .watch
            .plugins
            .iter()
            .map(|(path, watched)| (path.clone(), watched.name.clone()))
            .collect()
    }

    /// Waits until `pred` holds for [`registry_attempts`](Self::registry_attempts), woken by
    /// every change; on timeout the error lists the attempts made.
    pub async fn wait_registry(
        &self,
        timeout: Duration,
        pred: impl Fn(&[RegistryAttempt]) -> bool,
    ) -> Result<Vec<RegistryAttempt>, SimError> {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut changes = self.inner.changed.subscribe();
        loop {
            let attempts = self.registry_attempts();
            if pred(&attempts) {
                return Ok(attempts);
            }
            if !matches!(
                tokio::time::timeout_at(deadline, changes.changed()).await,
                Ok(Ok(()))
            ) {
                return Err(SimError::RegistryTimeout {
                    after: timeout,
                    attempts: self.registry_attempts(),
                });
            }
        }
    }

    /// What `driver`'s health stream last reported, device by device.
    pub fn dra_health(&self, driver: &str) -> Vec<DraDeviceHealth> {
        self.inner
            .lock()
            .dra
            .health
            .get(driver)
            .cloned()
            .unwrap_or_default()
    }

    /// Waits until `pred` holds for `driver`'s reported health (at most `timeout`).
    pub async fn wait_dra_health(
        &self,
        driver: &str,
        timeout: Duration,
        pred: impl Fn(&[DraDeviceHealth]) -> bool,
    ) -> Result<Vec<DraDeviceHealth>, SimError> {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut changes = self.inner.changed.subscribe();
        loop {
            let health = self.dra_health(driver);
            if pred(&health) {
                return Ok(health);
            }
            if !matches!(
                tokio::time::timeout_at(deadline, changes.changed()).await,
                Ok(Ok(()))
            ) {
                return Err(SimError::Dra(format!(
                    "the health of DRA driver {driver} not as expected after {timeout:?}: {health:?}"
                )));
            }
        }
    }

    /// The DRA drivers the plugin manager holds: every registered endpoint, by driver.
    pub fn dra_registrations(&self) -> Vec<DraRegistration> {
        self.inner.lock().dra.registrations()
    }

    /// `NodePrepareResources` for `claims`, sent as the kubelet does: to `driver`'s newest
    /// endpoint that accepts connections, through the service chosen at registration (a v1beta1
    /// answer converted to v1), under [`SimConfig::dra_call_timeout`]. Err: no answer (the
    /// driver not registered, the call failed or ran out of time), in the kubelet's words.
    pub async fn node_prepare_resources(
        &self,
        driver: &str,
        claims: Vec<devicelet_api::dra::v1::Claim>,
    ) -> Result<devicelet_api::dra::v1::NodePrepareResourcesResponse, SimError> {
        dra::prepare(
            &self.inner,
            driver,
            claims,
            self.inner.config.dra_call_timeout,
        )
        .await
        .map_err(SimError::Dra)
    }

    /// [`node_prepare_resources`](Self::node_prepare_resources) with `deadline` as the call's
    /// timeout instead of the kubelet's.
    pub async fn node_prepare_resources_within(
        &self,
        driver: &str,
        claims: Vec<devicelet_api::dra::v1::Claim>,
        deadline: Duration,
    ) -> Result<devicelet_api::dra::v1::NodePrepareResourcesResponse, SimError> {
        dra::prepare(&self.inner, driver, claims, deadline)
            .await
            .map_err(SimError::Dra)
    }

    /// `NodeUnprepareResources`, sent like [`node_prepare_resources`](Self::node_prepare_resources).
    pub async fn node_unprepare_resources(
        &self,
        driver: &str,
        claims: Vec<devicelet_api::dra::v1::Claim>,
    ) -> Result<devicelet_api::dra::v1::NodeUnprepareResourcesResponse, SimError> {
        dra::unprepare(
            &self.inner,
            driver,
            claims,
            self.inner.config.dra_call_timeout,
        )
        .await
        .map_err(SimError::Dra)
    }

    /// Simulates a kubelet restart (KUBELET.md §7): stops serving, drops every plugin client and
    /// stream, deletes every socket file in the plugin directory (keeping
    /// `kubelet_internal_checkpoint`, and files that are not sockets), and serves `kubelet.sock`
    /// again. Resources stay known with capacity 0 until their plugins register again
    /// ([`ResourceState::registrations`] keeps counting); allocations survive, as in the
    /// kubelet's checkpoint, and the PodResources API keeps serving them.
    ///
    /// Returns once the new `kubelet.sock` exists. It accepts connections only
    /// [`SimConfig::accept_delay`] later (then [`SimEvent::Serving`] is published); a plugin
    /// dialing before that gets `ECONNREFUSED` and must retry, as on a node.
    ///
    /// With [`SimConfig::plugins_registry`], the plugin watcher forgets what it found and starts
    /// again: that directory is not touched, and its start-up scan registers the plugins serving
    /// there again by itself, with no need for `kubelet.sock` (which may still refuse
    /// connections then).
    pub async fn restart(&self) -> Result<(), SimError> {
        let inner = &self.inner;
        server::stop(inner).await;
        inner.stop_watcher();
        inner.lock().forget_endpoints();
        inner.wipe_at_start();
        self.restart_stopped().await
    }

    /// The rest of [`restart`](Self::restart), once the old server is stopped.
    async fn restart_stopped(&self) -> Result<(), SimError> {
        let inner = &self.inner;
        let removed = server::remove_sockets(&inner.dir).map_err(|source| SimError::Io {
            path: inner.dir.clone(),
            source,
        })?;
        {
            let _registry = inner.lock();
            inner.notify(Some(SimEvent::Restarted {
                sockets_removed: removed,
            }));
        }
        info!("simulated kubelet restarted: {removed} sockets removed");
        server::serve(inner, inner.config.accept_delay)?;
        inner.start_watcher()
    }

    /// A restart whose directory changes happen in `order`, with `pause` between the two halves
    /// so plugins act in between (inotify may deliver a real restart's events late or in
    /// bursts, and a plugin must register exactly once per kubelet start whatever it saw
    /// first). Returns when both halves are done; like [`restart`](Self::restart), the new
    /// `kubelet.sock` accepts connections [`SimConfig::accept_delay`] after it is created.
    pub async fn restart_in_order(
        &self,
        order: RestartOrder,
        pause: Duration,
    ) -> Result<(), SimError> {
        let inner = &self.inner;
        let io = |source| SimError::Io {
            path: inner.dir.clone(),
            source,
        };
        server::stop(inner).await;
        inner.stop_watcher();
        inner.lock().forget_endpoints();
        inner.wipe_at_start();
        let removed = match order {
            RestartOrder::SocketsThenKubelet => return self.restart_stopped().await,
            RestartOrder::PluginSocketsFirst => {
                let removed =
                    server::remove_sockets_but(&inner.dir, Some(KUBELET_SOCKET)).map_err(io)?;
                tokio::time::sleep(pause).await;
                server::serve(inner, inner.config.accept_delay)?;
                removed + 1
            }
            RestartOrder::KubeletFirst => {
                // Held open under another name while the new file is made, the old inode cannot
                // be reused for it: plugins see a different `kubelet.sock`, as a new kubelet's
                // would usually be.
                let held = inner.dir.join(".kubelet.sock.old");
                let hold = std::fs::hard_link(&inner.socket, &held);
                server::serve(inner, inner.config.accept_delay)?;
                if hold.is_ok() {
                    std::fs::remove_file(&held).map_err(io)?;
                }
                tokio::time::sleep(pause).await;
                server::remove_sockets_but(&inner.dir, Some(KUBELET_SOCKET)).map_err(io)? + 1
            }
        };
        {
            let _registry = inner.lock();
            inner.notify(Some(SimEvent::Restarted {
                sockets_removed: removed,
            }));
        }
        inner.start_watcher()
    }

    /// Stops serving, stops every ListAndWatch consumer and removes `kubelet.sock` and the
    /// PodResources socket.
    pub async fn shutdown(self) {
        let inner = &self.inner;
        server::stop(inner).await;
        inner.stop_watcher();
        if let Some(pod_server) = inner.take_pod_server() {
            pod_server.stop().await;
        }
        inner.abort();
        for path in [&inner.socket, &inner.pod_resources_socket] {
            match std::fs::remove_file(path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => tracing::warn!("cannot remove {}: {e}", path.display()),
            }
        }
        info!("simulated kubelet stopped");
    }
}
