//! What a running agent serves, with device health and holders: answered as one JSON document
//! per connection on `<state dir>/status.sock`, and printed by `devicelet status`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::watch;

use super::Shared;
use crate::ledger::Holder;
use crate::sandbox::{Health, ModuleStats};

pub const STATUS_SOCKET: &str = "status.sock";

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Status {
    pub modules: Vec<ModuleStatus>,
    pub resources: Vec<ResourceStatus>,
    /// Modules of the registry that are not served, each error naming its module.
    pub load_errors: Vec<String>,
    /// Why the last registry edit was refused, if it was.
    pub reload_error: Option<String>,
    #[serde(default)]
    pub ledger: LedgerStatus,
    /// The compile cache, when the agent was given a directory for one.
    #[serde(default)]
    pub cache: Option<CacheStatus>,
    /// Resources served as DRA drivers.
    #[serde(default)]
    pub dra_drivers: Vec<DraDriverStatus>,
    /// Modules waiting for a pull from their OCI registry.
    #[serde(default)]
    pub pending: Vec<super::PendingStatus>,
}

/// One resource served as a DRA driver.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DraDriverStatus {
    pub driver: String,
    pub resource: String,
    pub module: String,
    /// Its socket in the plugin watcher's directory.
    pub registration_socket: PathBuf,
    /// Whether the kubelet last said it registered the driver.
    pub registered: bool,
    /// DRA devices, as published: a device group counts once.
    pub devices: usize,
    pub healthy: usize,
    /// Devices in the published slices: those no device-plugin container holds, the unhealthy
    /// ones with the health taint (or left out, when `taints_dropped`).
    pub published: usize,
    /// The API server dropped device taints: unhealthy devices are withdrawn instead.
    #[serde(default)]
    pub taints_dropped: bool,
    /// The API server dropped counters: partitions are withdrawn.
    #[serde(default)]
    pub counters_dropped: bool,
    /// The API server dropped multiple allocations: shared devices are published whole.
    #[serde(default)]
    pub shared_dropped: bool,
    /// The pool's generation and slices last published; the writes made and API errors met.
    pub generation: i64,
    pub slices: usize,
    pub api_writes: u64,
    pub api_errors: u64,
    pub api_error: Option<String>,
    /// Claims prepared and not yet unprepared (in the checkpoint).
    pub prepared_claims: usize,
    /// Left the registry: it answers only for the claims it prepared, until they are
    /// unprepared (its module is then empty).
    #[serde(default)]
    pub retiring: bool,
    /// Each device as published (a group once, by its DRA name), with its health, why, and the
    /// claim holding it.
    #[serde(default)]
    pub device_states: Vec<DraDeviceStatus>,
}

/// One DRA device of a driver.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DraDeviceStatus {
    /// Its name in the ResourceSlice.
    pub name: String,
    /// The module's IDs of it (a group's every member).
    pub ids: Vec<String>,
    pub healthy: bool,
    pub reason: Option<String>,
    /// The claims holding it (a claim's UID and its namespace/name), or the device-plugin
    /// container still holding it.
    pub holders: Vec<String>,
}

/// One DRA driver of `module`.
pub(super) fn driver_status(
    d: &crate::dra::driver::RunningDriver,
    module: &str,
    ledger: &crate::ledger::Ledger,
) -> DraDriverStatus {
    let devices = d.devices.borrow();
    let units = crate::dra::units::units(&devices);
    // Containers of the device-plugin front end (a resource moved to DRA), and claims.
    let containers = ledger.holders(&d.name);
    let claims = ledger.claims_of(&d.driver);
    let device_states = units
        .iter()
        .map(|u| {
            let ids: Vec<String> = u.members.iter().map(|m| m.id.clone()).collect();
            let mut held: Vec<String> = containers
                .iter()
                .filter(|(id, _)| ids.contains(id))
                .filter_map(|(_, h)| h.as_ref().map(ToString::to_string))
                .collect();
            held.extend(
                claims
                    .iter()
                    .filter(|(_, c)| {
                        c.requests
                            .iter()
                            .any(|r| r.devices.iter().any(|(name, _)| *name == u.name))
                    })
                    .map(|(uid, c)| format!("{}/{} (claim {uid})", c.namespace, c.name)),
            );
            held.sort();
            held.dedup();
            DraDeviceStatus {
                name: u.name.clone(),
                healthy: u.healthy(),
                reason: u.reason(),
                holders: held,
                ids,
            }
        })
        .collect();
    let published = d.published.borrow();
    DraDriverStatus {
        driver: d.driver.clone(),
        resource: d.name.clone(),
        module: module.to_owned(),
        registration_socket: d.registration_socket.clone(),
        registered: d.registered.get(),
        // As published: a device group counts once.
        devices: units.len(),
        healthy: units.iter().filter(|u| u.healthy()).count(),
        published: published.devices,
        taints_dropped: published.taints_dropped,
        counters_dropped: published.counters_dropped,
        shared_dropped: published.shared_dropped,
        generation: published.generation,
        slices: published.slices,
        api_writes: published.writes,
        api_errors: published.errors,
        api_error: published.last_error.clone(),
        prepared_claims: d.claims.prepared(),
        retiring: false,
        device_states,
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CacheStatus {
    /// Why the directory is not used (modules are compiled in memory); None while it is.
    pub refused: Option<String>,
    /// Modules loaded precompiled, compiled (and cached), and whose cached copy was replaced.
    pub hits: u64,
    pub misses: u64,
    pub replaced: u64,
    /// Loads that found another process (a `validate`, a `precompile`, another agent) compiling
    /// the same module into the cache, and waited for it rather than compiling it too.
    #[serde(default)]
    pub waited: u64,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LedgerStatus {
    pub entries: u64,
    /// Entries dropped at the ledger's cap (PodResources unreachable while pods came and went).
    pub dropped: u64,
    /// Whether every change is in the checkpoint file yet.
    pub written: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModuleStatus {
    pub name: String,
    /// The module's own version, as its `init` said (WIT 0.2); empty for a 0.1 module.
    #[serde(default)]
    pub version: String,
    /// sha256 of the running module file.
    pub digest: String,
    /// The registry entry's `source` (`oci://…@sha256:…`) it was pulled from, if any.
    #[serde(default)]
    pub source: Option<String>,
    /// Traps, missed deadlines, refused answers...: what the sandbox caught so far.
    pub stats: ModuleStats,
    /// Set once the module stopped running for good (too many cells stuck in host calls): its
    /// devices are Unhealthy until its file or registry entry changes.
    #[serde(default)]
    pub failed: Option<String>,
    /// Bytes of agent memory its answers hold now, and its `host-memory` budget.
    #[serde(default)]
    pub host_memory: u64,
    #[serde(default)]
    pub host_memory_limit: u64,
    /// For a module granted NVML: whether NVML answers, or why not yet (the agent keeps trying).
    #[serde(default)]
    pub nvml: Option<crate::nvml::Availability>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResourceStatus {
    pub name: String,
    pub module: String,
    pub socket: PathBuf,
    pub registrations: u32,
    /// Whether the kubelet holds its registration now.
    #[serde(default)]
    pub registered: bool,
    /// Kubelet restarts it noticed, and registrations the kubelet refused or reported failed.
    #[serde(default)]
    pub kubelet_restarts: u64,
    #[serde(default)]
    pub registration_failures: u64,
    pub devices: Vec<DeviceStatus>,
    /// Whether the devices are replicas (`<id>::<n>`) of shared physical devices.
    #[serde(default)]
    pub shared: bool,
    /// Its CDI spec, when its device-list strategy uses CDI.
    #[serde(default)]
    pub cdi: Option<CdiStatus>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CdiStatus {
    pub strategy: String,
    pub spec: PathBuf,
    /// Devices the spec on disk names (0 while none is written).
    pub devices: usize,
    /// Containers whose devices Allocate named by CDI.
    pub named: u64,
    /// Containers given the module's answer itself: the spec would not have given them the same.
    pub unnamed: u64,
    /// Why devices are not named by CDI now (the spec cannot be written, its directory is not
    /// trusted, another spec declares its kind), until they are again.
    pub error: Option<String>,
    /// Files of its kind the agent did not write, found at its path (and replaced) or beside it
    /// (and refused).
    #[serde(default)]
    pub foreign: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceStatus {
    pub id: String,
    pub healthy: bool,
    /// The pod holding the device, once PodResources told us; `allocated` without a holder means
    /// allocated but not yet seen in PodResources.
    pub allocated: bool,
    pub holder: Option<Holder>,
    /// Whether a single-device Allocate of it is answered from an answer prepared ahead of time.
    #[serde(default)]
    pub prepared: bool,
    /// Why it is unhealthy, when the module said (WIT 0.2).
    #[serde(default)]
    pub reason: Option<String>,
    /// Its typed attributes and capacities, as `name=value` (WIT 0.2 types; 0.1 ones are text).
    #[serde(default)]
    pub attributes: Vec<String>,
}

pub(super) fn collect(shared: &Shared) -> Status {
    let modules = shared
        .lock_modules()
        .values()
        .map(|m| {
            let handle = m.handle();
            let (used, limit) = handle.host_memory();
            ModuleStatus {
                name: m.spec.name.clone(),
                version: handle.version().to_owned(),
                digest: handle.digest().to_owned(),
                source: m.spec.source.as_ref().map(|s| s.to_string()),
                stats: handle.stats(),
                failed: handle.failure(),
                host_memory: used as u64,
                host_memory_limit: limit as u64,
                nvml: handle.nvml().map(|n| n.availability()),
            }
        })
        .collect();
    let ledger = LedgerStatus {
        entries: shared.ledger.entry_count() as u64,
        dropped: shared.ledger.dropped(),
        written: shared.ledger.is_written(),
    };
    let cache = shared.cache.as_ref().map(|cache| match cache {
        Ok(cache) => {
            let stats = cache.stats();
            CacheStatus {
                refused: None,
                hits: stats.hits,
                misses: stats.misses,
                replaced: stats.replaced,
                waited: stats.waited,
            }
        }
        Err(why) => CacheStatus {
            refused: Some(why.clone()),
            ..CacheStatus::default()
        },
    });
    let mut status = Status {
        ledger,
        cache,
        modules,
        resources: Vec::new(),
        dra_drivers: Vec::new(),
        pending: shared.pending_status(),
        load_errors: shared.all_load_errors(),
        reload_error: shared
            .reload_error
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone(),
    };
    // Each front end says what it serves.
    for m in shared.lock_modules().values() {
        for front_end in &m.front_ends {
            front_end.status(&m.spec.name, &shared.ledger, &mut status);
        }
    }
    if let Some(dra) = &shared.dra {
        status
            .dra_drivers
            .extend(dra.retirees.each(|d| DraDriverStatus {
                retiring: true,
                ..driver_status(d, "", &shared.ledger)
            }));
    }
    status
}

/// One resource served through the device-plugin API, with each device's holder from `ledger`.
pub(super) fn resource_status(
    r: crate::kubelet::resource::ServedResource,
    ledger: &crate::ledger::Ledger,
) -> ResourceStatus {
    let holders = ledger.holders(&r.name);
    let devices = r
        .devices
        .borrow()
        .iter()
        .map(|d| {
            let held = holders.iter().find(|(id, _)| *id == d.id);
            DeviceStatus {
                id: d.id.clone(),
                healthy: d.health == Health::Healthy,
                allocated: held.is_some(),
                holder: held.and_then(|(_, h)| h.clone()),
                prepared: r.prepared.is_ready(&d.id),
                reason: d.health_reason.clone(),
                attributes: crate::device::describe_facts(d),
            }
        })
        .collect();
    ResourceStatus {
        registrations: *r.registrations.borrow(),
        registered: r.registration.registered(),
        kubelet_restarts: r.registration.kubelet_restarts(),
        registration_failures: r.registration.failures(),
        name: r.name,
        module: r.module,
        socket: r.socket,
        devices,
        shared: r.shared,
        cdi: r.cdi.map(|c| {
            use std::sync::atomic::Ordering::Relaxed;
            let devices = c.naming.view.borrow().as_ref().map_or(0, |v| v.len());
            CdiStatus {
                strategy: c.naming.strategy.to_string(),
                spec: c.path,
                devices,
                named: c.naming.counts.named.load(Relaxed),
                unnamed: c.naming.counts.unnamed.load(Relaxed),
                error: c.written.error(),
                foreign: c.written.foreign.load(Relaxed),
            }
        }),
    }
}

/// Binds the status socket (0600: it tells who runs what on the node).
pub(super) fn bind(state_dir: &Path) -> anyhow::Result<UnixListener> {
    use anyhow::Context;
    let path = state_dir.join(STATUS_SOCKET);
    devicelet_api::uds::bind_private(&path)
        .with_context(|| format!("binding the status socket {}", path.display()))
}

pub(super) async fn serve(
    shared: Arc<Shared>,
    listener: UnixListener,
    socket: PathBuf,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = stop.wait_for(|s| *s) => {
                let _ = std::fs::remove_file(&socket);
                return;
            }
        };
        let mut conn = match accepted {
            // The socket is 0600, so only its owner and root can connect; checked again here
            // in case its mode is ever widened.
            Ok((conn, _)) if !peer_uid(&conn).is_ok_and(crate::trust::is_ours_or_root) => continue,
            Ok((conn, _)) => conn,
            Err(e) => {
                // Out of file descriptors, say: don't spin on it.
                tracing::warn!("status socket: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                continue;
            }
        };
        let body = serde_json::to_vec(&collect(&shared)).unwrap_or_default();
        tokio::spawn(async move {
            let _ = conn.write_all(&body).await;
            let _ = conn.shutdown().await;
        });
    }
}

/// Asks the agent whose state directory is `state_dir` for its status. The answer is trusted
/// only from the state directory's owner (the agent's user) or root, in a directory nobody else
/// can change: anyone who could put a socket of their own at that path could otherwise tell us
/// anything.
pub async fn read(state_dir: &Path) -> anyhow::Result<Status> {
    use anyhow::Context;
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let (_, agent) = crate::trust::check_dir_of_anyone(state_dir).map_err(|e| {
        anyhow::anyhow!(
            "not asking the agent in {}: {e}, so whoever can write there could answer in its \
             place ({})",
            state_dir.display(),
            e.fix()
        )
    })?;
    let trusted = |uid: u32| uid == 0 || uid == agent;
    let path = state_dir.join(STATUS_SOCKET);
    let meta = std::fs::symlink_metadata(&path)
        .with_context(|| format!("no agent answers at {}", path.display()))?;
    if !meta.file_type().is_socket() {
        anyhow::bail!("{} is not a socket", path.display());
    }
    if !trusted(meta.uid()) {
        anyhow::bail!(
            "{} belongs to uid {}, not to root or the state directory's owner (uid {agent}): not \
             trusting what answers there",
            path.display(),
            meta.uid()
        );
    }
    let mut conn = UnixStream::connect(&path)
        .await
        .with_context(|| format!("no agent answers at {}", path.display()))?;
    let peer = peer_uid(&conn).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    if !trusted(peer) {
        anyhow::bail!(
            "{}: the process at the other end runs as uid {peer}, not as root or the state \
             directory's owner (uid {agent}): not trusting it",
            path.display()
        );
    }
    let mut body = Vec::new();
    (&mut conn).take(MAX_STATUS).read_to_end(&mut body).await?;
    serde_json::from_slice(&body)
        .with_context(|| format!("reading the status from {}", path.display()))
}

/// Largest status document read (thousands of devices fit in a few MiB).
const MAX_STATUS: u64 = 64 << 20;

/// The uid of the process at the other end of `conn` (`SO_PEERCRED`: the credentials it had when
/// it connected, or when it started listening).
fn peer_uid(conn: &UnixStream) -> Result<u32, String> {
    conn.peer_cred()
        .map(|c| c.uid())
        .map_err(|e| format!("cannot tell who is at the other end: {e}"))
}
