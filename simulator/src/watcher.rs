//! The kubelet's plugin watcher, the second registration route (KUBELET.md §11), enabled by
//! [`SimConfig::plugins_registry`](super::SimConfig::plugins_registry).
//!
//! As in the kubelet (`pkg/kubelet/pluginmanager`):
//! - the directory is created if missing and watched recursively with inotify; at start (and
//!   after every simulated restart, and when inotify lost events) it is scanned;
//! - a socket file that appears (name not starting with `.`) is dialed, **with the socket path as
//!   HTTP/2 `:authority`**, as the kubelet's grpc-go client sends it; `GetInfo` is called (1 s
//!   deadline) and the answer checked: `type` `"DRAPlugin"` goes to the DRA plugin manager
//!   (`dra.rs`); otherwise it must be `"DevicePlugin"` (`CSIPlugin` belongs to a handler the
//!   simulator does not have), `supported_versions` must include `"v1beta1"`,
//!   `name` must be an extended resource name; an empty `endpoint` means the registration
//!   socket itself;
//! - then the device manager registers it exactly as after `Register` on `kubelet.sock`: dials
//!   the endpoint (`:authority` `localhost`), calls `GetDevicePluginOptions`, records the client
//!   (replacing an earlier one of the same name) and starts ListAndWatch;
//! - the outcome is reported with `NotifyRegistrationStatus` (5 s deadline): `{true, ""}`, or
//!   `{false, error}` with the kubelet's wording;
//! - a failure before the device manager was involved (dial, `GetInfo`, type, validation) is
//!   retried with exponential backoff from
//!   [`SimConfig::registry_retry`](super::SimConfig::registry_retry) up to 2m2s, as the
//!   kubelet's reconciler does. A failure *in* the device manager (endpoint not reachable,
//!   `GetDevicePluginOptions` failing) is **not** retried: the kubelet has already put the plugin
//!   in its actual state of the world, so it waits for the socket to be re-created (or for its
//!   own restart);
//! - a socket file that is removed deregisters the plugin: the device manager disconnects the
//!   client registered under the plugin's name — whichever that is now, even one that a later
//!   registration of the same name put there, as the kubelet's `DeRegisterPlugin` does —
//!   and allocatable drops to 0 as when a stream ends. A socket re-created at the same path is
//!   deregistered and registered again. A socket renamed away is not noticed (the kubelet
//!   ignores rename events), one renamed into the directory is registered.
//!
//! Unlike the kubelet, whose reconciler looks every second, the simulator registers as soon as
//! the event arrives (or `SimConfig::registry_lag` after it), and it ignores a second creation
//! event for the same file (same inode).

use std::collections::{BTreeMap, HashMap};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use notify::event::{ModifyKind, RenameMode};
use notify::{EventKind, RecommendedWatcher, RecursiveMode, Watcher};
use tokio::sync::mpsc;
use tokio::task::{AbortHandle, JoinHandle, JoinSet};
use tonic::transport::Channel;
use tracing::{info, warn};

use devicelet_api::authority;
use devicelet_api::deviceplugin::VERSION;
use devicelet_api::dra::DRA_PLUGIN;
use devicelet_api::names;
use devicelet_api::pluginregistration::registration_client::RegistrationClient;
use devicelet_api::pluginregistration::{
    DEVICE_PLUGIN, InfoRequest, PluginInfo, RegistrationStatus,
};

use super::Inner;
use super::dra;
use super::endpoint;
use super::error::SimError;
use super::events::SimEvent;
use super::registration::connect_client;
use super::state::Registry;

/// The kubelet's deadline on `GetInfo`.
const GET_INFO_TIMEOUT: Duration = Duration::from_secs(1);
/// The kubelet's deadline on `NotifyRegistrationStatus`.
const NOTIFY_TIMEOUT: Duration = Duration::from_secs(5);
/// The longest pause between two attempts (`maxDurationBeforeRetry`).
const MAX_RETRY: Duration = Duration::from_secs(122);
/// The shortest, whatever the configuration says, so a bad plugin cannot make it spin.
const MIN_RETRY: Duration = Duration::from_millis(10);

/// One registration attempt of the plugin watcher for a socket in `plugins_registry`.
#[derive(Debug, Clone, PartialEq)]
pub struct RegistryAttempt {
    /// The socket file in the `plugins_registry` directory.
    pub socket: PathBuf,
    /// What `GetInfo` answered; None when the socket could not be dialed or `GetInfo` failed.
    pub info: Option<PluginInfo>,
    /// None: registered. Otherwise why not, in the kubelet's words: the text sent as
    /// `RegistrationStatus.error`, or, when dialing or `GetInfo` failed and nothing was sent,
    /// the error the kubelet logs.
    pub error: Option<String>,
    /// The `NotifyRegistrationStatus` call: None when none was made (dial or `GetInfo` failed),
    /// `Some(Ok(()))` when the plugin answered it, `Some(Err(why))` when the call failed.
    pub notified: Option<Result<(), String>>,
    /// Whether the watcher will try this socket again after a pause: after a failure before the
    /// device manager was involved (dial, `GetInfo`, type, validation), not after one in the
    /// device manager (endpoint, `GetDevicePluginOptions`), nor after a success.
    pub retry: bool,
}

impl RegistryAttempt {
    /// Whether the plugin was registered.
    pub fn registered(&self) -> bool {
        self.error.is_none()
    }

    /// The resource name `GetInfo` answered, if it was answered.
    pub fn resource(&self) -> Option<&str> {
        self.info.as_ref().map(|i| i.name.as_str())
    }
}

/// The plugin watcher's part of the registry: the kubelet's desired and actual states of the
/// world, and the attempts made so far.
#[derive(Default)]
pub(super) struct WatchState {
    /// Bumped whenever the watcher stops (restart, shutdown): work of an earlier watcher finds
    /// it changed and is dropped.
    pub epoch: u64,
    /// The sockets found, by path.
    pub plugins: BTreeMap<PathBuf, Watched>,
    /// Every attempt, in order, across restarts.
    pub attempts: Vec<RegistryAttempt>,
    next_uuid: u64,
}

/// One socket the watcher found.
pub(super) struct Watched {
    /// Identifies this file's registration (the kubelet's plugin UUID): a re-created socket gets
    /// a new one, and work for the old one is dropped.
    pub uuid: u64,
    /// `(dev, ino)` of the socket file, to tell a re-created file from a repeated event.
    file: (u64, u64),
    /// The name the device manager was asked to register (the kubelet's actual state of the
    /// world): set once `GetInfo`'s answer passed validation. Deregistration disconnects it.
    pub name: Option<String>,
    /// For a DRA driver: the endpoint registered under `name`, which deregistration drops.
    pub dra_endpoint: Option<String>,
}

impl WatchState {
    fn is_current(&self, socket: &Path, epoch: u64, uuid: u64) -> bool {
        self.epoch == epoch && self.plugins.get(socket).is_some_and(|w| w.uuid == uuid)
    }
}

/// A running plugin watcher: the inotify watch and the task that acts on it.
pub(super) struct PluginWatcher {
    _watcher: RecommendedWatcher,
    task: JoinHandle<()>,
}

impl PluginWatcher {
    /// Stops watching; registrations in flight are aborted (and would be dropped anyway, the
    /// caller having moved the epoch on).
    pub fn abort(self) {
        self.task.abort();
    }
}

/// What the inotify callback tells the watcher task.
enum Hint {
    Created(PathBuf),
    Removed(PathBuf),
    /// Events were lost, or the watcher just started: look at the whole directory.
    Rescan,
}

/// Creates `dir` if missing, watches it and scans it. Work is tagged with the registry's
/// current watch epoch.
pub(super) fn start(inner: &Arc<Inner>, dir: &Path) -> Result<PluginWatcher, SimError> {
    let io = |source| SimError::Io {
        path: dir.to_owned(),
        source,
    };
    std::fs::create_dir_all(dir).map_err(io)?;
    let (tx, rx) = mpsc::unbounded_channel();
    let hints = tx.clone();
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        for hint in hints_of(event) {
            // The task is gone only when the watcher is being stopped.
            let _ = hints.send(hint);
        }
    })
    .map_err(|e| io(std::io::Error::other(e)))?;
    watcher
        .watch(dir, RecursiveMode::Recursive)
        .map_err(|e| io(std::io::Error::other(e)))?;
    // The start-up scan, after the watch is in place so nothing created meanwhile is missed.
    let _ = tx.send(Hint::Rescan);
    let epoch = inner.lock().watch.epoch;
    info!(
        "simulated kubelet's plugin watcher watching {}",
        dir.display()
    );
    let task = tokio::spawn(run(Arc::clone(inner), dir.to_owned(), epoch, rx));
    Ok(PluginWatcher {
        _watcher: watcher,
        task,
    })
}

/// What an inotify event means to the kubelet's watcher: created (or moved in) and removed
/// paths; renames away are ignored, as by the kubelet.
fn hints_of(event: notify::Result<notify::Event>) -> Vec<Hint> {
    let event = match event {
        Ok(event) => event,
        Err(_) => return vec![Hint::Rescan],
    };
    if event.need_rescan() {
        return vec![Hint::Rescan];
    }
    match event.kind {
        EventKind::Create(_) | EventKind::Modify(ModifyKind::Name(RenameMode::To)) => {
            event.paths.into_iter().map(Hint::Created).collect()
        }
        EventKind::Modify(ModifyKind::Name(RenameMode::Both)) => {
            event.paths.into_iter().skip(1).map(Hint::Created).collect()
        }
        EventKind::Remove(_) => event.paths.into_iter().map(Hint::Removed).collect(),
        _ => Vec::new(),
    }
}

/// The watcher task: keeps one registration task per socket found.
async fn run(
    inner: Arc<Inner>,
    dir: PathBuf,
    epoch: u64,
    mut hints: mpsc::UnboundedReceiver<Hint>,
) {
    let mut watcher = Tasks {
        inner,
        epoch,
        set: JoinSet::new(),
        running: HashMap::new(),
    };
    let lag = watcher.inner.config.registry_lag;
    while let Some(first) = hints.recv().await {
        let mut batch = vec![first];
        if !lag.is_zero() {
            tokio::time::sleep(lag).await;
            while let Ok(hint) = hints.try_recv() {
                batch.push(hint);
            }
        }
        for hint in batch {
            match hint {
                Hint::Created(path) => watcher.created(&path),
                Hint::Removed(path) => watcher.removed(&path),
                Hint::Rescan => watcher.rescan(&dir),
            }
        }
        while watcher.set.try_join_next().is_some() {}
    }
}

/// The watcher task's state. Dropping it (the task is aborted) aborts every registration task.
struct Tasks {
    inner: Arc<Inner>,
    epoch: u64,
    set: JoinSet<()>,
    running: HashMap<PathBuf, AbortHandle>,
}

impl Tasks {
    /// A path appeared: a socket to register, or a directory to look into.
    fn created(&mut self, path: &Path) {
        // Gone already: its removal event follows.
        let Ok(meta) = std::fs::metadata(path) else {
            return;
        };
        if meta.is_dir() {
            for (socket, file) in sockets_under(path) {
                self.found(&socket, file);
            }
        } else if meta.file_type().is_socket() {
            self.found(path, (meta.dev(), meta.ino()));
        }
    }

    /// A path went away: every socket at or under it is deregistered.
    fn removed(&mut self, path: &Path) {
        let gone: Vec<PathBuf> = {
            let registry = self.inner.lock();
            registry
                .watch
                .plugins
                .keys()
                .filter(|p| p.starts_with(path))
                .cloned()
                .collect()
        };
        for socket in gone {
            self.forget(&socket);
        }
    }

    /// Brings the view in line with the directory: the start-up scan, or lost events.
    fn rescan(&mut self, dir: &Path) {
        let present: BTreeMap<PathBuf, (u64, u64)> = sockets_under(dir).into_iter().collect();
        let stale: Vec<PathBuf> = {
            let registry = self.inner.lock();
            registry
                .watch
                .plugins
                .iter()
                .filter(|(p, w)| present.get(*p) != Some(&w.file))
                .map(|(p, _)| p.clone())
                .collect()
        };
        for socket in stale {
            self.forget(&socket);
        }
        for (socket, file) in present {
            self.found(&socket, file);
        }
    }

    /// A socket file exists at `socket`: registers it unless this very file is known already.
    fn found(&mut self, socket: &Path, file: (u64, u64)) {
        if socket
            .file_name()
            .is_some_and(|n| n.as_encoded_bytes().starts_with(b"."))
        {
            return;
        }
        let known = {
            let registry = self.inner.lock();
            if registry.watch.epoch != self.epoch {
                return;
            }
            registry.watch.plugins.get(socket).map(|w| w.file)
        };
        match known {
            Some(known) if known == file => return,
            // Re-created: the old registration goes first.
            Some(_) => self.forget(socket),
            None => {}
        }
        let uuid = {
            let mut registry = self.inner.lock();
            if registry.watch.epoch != self.epoch {
                return;
            }
            let watch = &mut registry.watch;
            watch.next_uuid += 1;
            let uuid = watch.next_uuid;
            watch.plugins.insert(
                socket.to_owned(),
                Watched {
                    uuid,
                    file,
                    name: None,
                    dra_endpoint: None,
                },
            );
            uuid
        };
        info!(
            "plugin watcher: found socket {}; registering it",
            socket.display()
        );
        let handle = self.set.spawn(register_socket(
            Arc::clone(&self.inner),
            socket.to_owned(),
            self.epoch,
            uuid,
        ));
        if let Some(old) = self.running.insert(socket.to_owned(), handle) {
            old.abort();
        }
    }

    /// The socket at `socket` is gone (or replaced): its registration work stops and, if it got
    /// as far as the device manager, the plugin is deregistered.
    fn forget(&mut self, socket: &Path) {
        if let Some(task) = self.running.remove(socket) {
            task.abort();
        }
        let inner = &self.inner;
        let mut registry = inner.lock();
        if registry.watch.epoch != self.epoch {
            return;
        }
        let Some(watched) = registry.watch.plugins.remove(socket) else {
            return;
        };
        let resource = watched.name;
        if let (Some(driver), Some(endpoint)) = (&resource, &watched.dra_endpoint) {
            if registry.dra.deregister(driver, endpoint) {
                info!("plugin watcher: DRA driver {driver}: endpoint {endpoint} deregistered");
                if !registry.dra.has(driver) {
                    inner.wipe_later(&mut registry, driver);
                }
            }
        } else if let Some(name) = &resource
            && registry.disconnect(name)
        {
            let reason = format!(
                "deregistered: its plugin watcher socket {} was removed",
                socket.display()
            );
            warn!("{name}: {reason}; allocatable is now 0 until the plugin registers again");
            inner.notify(Some(SimEvent::StreamEnded {
                resource: name.clone(),
                reason,
            }));
        }
        info!(
            "plugin watcher: socket {} removed{}",
            socket.display(),
            resource
                .as_deref()
                .map(|r| format!(" (resource {r} deregistered)"))
                .unwrap_or_default()
        );
        inner.notify(Some(SimEvent::RegistryRemoved {
            socket: socket.to_owned(),
            resource,
        }));
    }
}

/// Every socket file at any depth under `dir`, with its `(dev, ino)`; unreadable entries are
/// skipped, as the kubelet's walk does.
fn sockets_under(dir: &Path) -> Vec<(PathBuf, (u64, u64))> {
    let mut found = Vec::new();
    let mut dirs = vec![dir.to_owned()];
    while let Some(dir) = dirs.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let Ok(meta) = std::fs::metadata(&path) else {
                continue;
            };
            if meta.is_dir() {
                dirs.push(path);
            } else if meta.file_type().is_socket() {
                found.push((path, (meta.dev(), meta.ino())));
            }
        }
    }
    found.sort();
    found
}

/// Registers one socket, retrying with backoff while the failure is one the kubelet's
/// reconciler retries.
async fn register_socket(inner: Arc<Inner>, socket: PathBuf, epoch: u64, uuid: u64) {
    let mut pause = inner.config.registry_retry.max(MIN_RETRY);
    let work = Work {
        inner: &inner,
        socket: &socket,
        epoch,
        uuid,
    };
    while work.attempt().await {
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(MAX_RETRY);
    }
}

/// One socket's registration work, for one watcher epoch and one file.
struct Work<'a> {
    inner: &'a Arc<Inner>,
    socket: &'a Path,
    epoch: u64,
    uuid: u64,
}

impl Work<'_> {
    fn is_current(&self, registry: &Registry) -> bool {
        registry
            .watch
            .is_current(self.socket, self.epoch, self.uuid)
    }

    /// One attempt (the kubelet's `GenerateRegisterPluginFunc`); true to try again later.
    async fn attempt(&self) -> bool {
        let socket = self.socket.display();
        let channel = match registration_channel(self.socket, self.inner.config.dial_timeout).await
        {
            Ok(channel) => channel,
            Err(e) => {
                return self.record(
                    None,
                    format!("RegisterPlugin error -- dial failed at socket {socket}, err: {e}"),
                    None,
                    true,
                );
            }
        };
        let mut client = RegistrationClient::new(channel);
        let mut request = tonic::Request::new(InfoRequest {});
        request.set_timeout(GET_INFO_TIMEOUT);
        let info = match tokio::time::timeout(GET_INFO_TIMEOUT, client.get_info(request)).await {
            Ok(Ok(info)) => info.into_inner(),
            Ok(Err(status)) => {
                return self.record(
                    None,
                    format!(
                        "RegisterPlugin error -- failed to get plugin info using RPC GetInfo at \
                         socket {socket}, err: {}",
                        status_text(&status)
                    ),
                    None,
                    true,
                );
            }
            Err(_) => {
                return self.record(
                    None,
                    format!(
                        "RegisterPlugin error -- failed to get plugin info using RPC GetInfo at \
                         socket {socket}, err: context deadline exceeded (no answer within \
                         {GET_INFO_TIMEOUT:?})"
                    ),
                    None,
                    true,
                );
            }
        };
        info!(
            "plugin watcher: {socket}: GetInfo answered type {:?}, name {:?}, endpoint {:?}, \
             supported versions {:?}",
            info.r#type, info.name, info.endpoint, info.supported_versions
        );

        if info.r#type == DRA_PLUGIN {
            return self.attempt_dra(&mut client, info).await;
        }
        if info.r#type != DEVICE_PLUGIN {
            let mut error = format!(
                "RegisterPlugin error -- no handler registered for plugin type: {} at socket \
                 {socket}",
                info.r#type
            );
            if info.r#type == "CSIPlugin" {
                // A real kubelet has this handler; the simulator does not.
                error.push_str(" (the kubelet simulator handles DevicePlugin and DRAPlugin only)");
            }
            let notified = notify(&mut client, false, &error).await;
            return self.record(Some(info), error, Some(notified), true);
        }
        let endpoint = if info.endpoint.is_empty() {
            self.socket.to_string_lossy().into_owned()
        } else {
            info.endpoint.clone()
        };
        if let Err(why) = validate(&info) {
            let error = format!("RegisterPlugin error -- plugin validation failed with err: {why}");
            let notified = notify(&mut client, false, &error).await;
            return self.record(Some(info), error, Some(notified), true);
        }

        // Into the actual state of the world before the device manager is called, as in the
        // kubelet: from here on a removal deregisters the name, and a failure is not retried.
        {
            let mut registry = self.inner.lock();
            if !self.is_current(&registry) {
                return false;
            }
            if let Some(watched) = registry.watch.plugins.get_mut(self.socket) {
                watched.name = Some(info.name.clone());
            }
        }
        let registered = if Path::new(&endpoint).is_absolute() {
            connect_client(
                self.inner,
                &info.name,
                Path::new(&endpoint),
                &endpoint,
                |_, registry| self.is_current(registry),
            )
            .await
            .map(|_| ())
            .map_err(|status| status.message().to_owned())
        } else {
            Err(format!(
                "cannot connect to the device plugin at {endpoint:?}: not an absolute path; the \
                 kubelet would dial it relative to its own working directory"
            ))
        };
        if !self.is_current(&self.inner.lock()) {
            return false;
        }
        self.registered(&mut client, info, registered).await
    }

    /// The end of an attempt that reached the handler's `RegisterPlugin`: the outcome notified
    /// and recorded. A failure there is not retried.
    async fn registered(
        &self,
        client: &mut RegistrationClient<Channel>,
        info: PluginInfo,
        registered: Result<(), String>,
    ) -> bool {
        match registered {
            Ok(()) => {
                let notified = notify(client, true, "").await;
                if let Err(e) = &notified {
                    warn!(
                        "plugin watcher: {}: registered, but NotifyRegistrationStatus failed: {e}",
                        self.socket.display()
                    );
                }
                self.record_outcome(RegistryAttempt {
                    socket: self.socket.to_owned(),
                    info: Some(info),
                    error: None,
                    notified: Some(notified),
                    retry: false,
                });
                false
            }
            Err(why) => {
                let error =
                    format!("RegisterPlugin error -- plugin registration failed with err: {why}");
                let notified = notify(client, false, &error).await;
                self.record(Some(info), error, Some(notified), false)
            }
        }
    }

    /// The rest of an attempt for a `DRAPlugin` socket: the DRA handler's `ValidatePlugin`
    /// (retried on failure), then `RegisterPlugin` (not retried: the plugin is in the actual
    /// state of the world by then).
    async fn attempt_dra(
        &self,
        client: &mut RegistrationClient<Channel>,
        info: PluginInfo,
    ) -> bool {
        let endpoint = if info.endpoint.is_empty() {
            self.socket.to_string_lossy().into_owned()
        } else {
            info.endpoint.clone()
        };
        let service = match dra::validate(&info.name, &endpoint, &info.supported_versions) {
            Ok(service) => service,
            Err(why) => {
                let error =
                    format!("RegisterPlugin error -- plugin validation failed with err: {why}");
                let notified = notify(client, false, &error).await;
                return self.record(Some(info), error, Some(notified), true);
            }
        };
        let registered = {
            let mut registry = self.inner.lock();
            if !self.is_current(&registry) {
                return false;
            }
            if let Some(watched) = registry.watch.plugins.get_mut(self.socket) {
                watched.name = Some(info.name.clone());
                watched.dra_endpoint = Some(endpoint.clone());
            }
            registry.dra.register(dra::DraRegistration {
                driver: info.name.clone(),
                endpoint: endpoint.clone(),
                service,
            })
        };
        if registered.is_ok() {
            info!(
                "plugin watcher: DRA driver {} registered at {endpoint} ({service:?})",
                info.name
            );
            let task = tokio::spawn(dra::watch_health(
                Arc::clone(self.inner),
                info.name.clone(),
                endpoint.clone(),
                self.inner.config.dra_health_retry,
            ));
            self.inner
                .lock()
                .dra
                .watching(&info.name, &endpoint, task.abort_handle());
        }
        self.registered(client, info, registered).await
    }

    /// Records a failed attempt; returns `retry`.
    fn record(
        &self,
        info: Option<PluginInfo>,
        error: String,
        notified: Option<Result<(), String>>,
        retry: bool,
    ) -> bool {
        warn!(
            "plugin watcher: {}{}",
            error,
            if retry { "; will retry" } else { "" }
        );
        self.record_outcome(RegistryAttempt {
            socket: self.socket.to_owned(),
            info,
            error: Some(error),
            notified,
            retry,
        });
        retry
    }

    fn record_outcome(&self, attempt: RegistryAttempt) {
        let mut registry = self.inner.lock();
        if !self.is_current(&registry) {
            return;
        }
        registry.watch.attempts.push(attempt.clone());
        self.inner
            .notify(Some(SimEvent::RegistryAttempt { attempt }));
    }
}

/// The device manager's `ValidatePlugin`, in its order: versions, then the name.
fn validate(info: &PluginInfo) -> Result<(), String> {
    if !info.supported_versions.iter().any(|v| v == VERSION) {
        return Err(format!(
            "manager version, {VERSION}, is not among plugin supported versions {:?}",
            info.supported_versions
        ));
    }
    names::validate_resource_name(&info.name).map_err(|why| {
        format!(
            "invalid name of device plugin socket: the ResourceName {:?} is invalid: {why}",
            info.name
        )
    })
}

/// `NotifyRegistrationStatus` with the kubelet's deadline.
async fn notify(
    client: &mut RegistrationClient<Channel>,
    registered: bool,
    error: &str,
) -> Result<(), String> {
    let mut request = tonic::Request::new(RegistrationStatus {
        plugin_registered: registered,
        error: error.to_owned(),
    });
    request.set_timeout(NOTIFY_TIMEOUT);
    match tokio::time::timeout(NOTIFY_TIMEOUT, client.notify_registration_status(request)).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(status)) => Err(status_text(&status)),
        Err(_) => Err(format!(
            "context deadline exceeded (no answer within {NOTIFY_TIMEOUT:?})"
        )),
    }
}

/// Dials a registration socket as the kubelet's plugin watcher does: retrying until `timeout`
/// (grpc-go's blocking dial), with the socket path as `:authority` (grpc-go's default authority
/// for a dial target that is a path; the kubelet sets no `WithAuthority` there).
async fn registration_channel(socket: &Path, timeout: Duration) -> Result<Channel, String> {
    let authority = socket.to_string_lossy();
    endpoint::connect_retrying(socket, timeout, |path| authority::connect(path, &authority))
        .await
        .map_err(|last| {
            format!(
                "failed to dial socket {}: no connection within {timeout:?}: {last}",
                socket.display()
            )
        })
}

fn status_text(status: &tonic::Status) -> String {
    format!(
        "rpc error: code = {:?} desc = {}",
        status.code(),
        status.message()
    )
}
