//! Starting a resource's core: everything that serving it means whatever front end serves it.
//! The device watcher (whose first enumeration runs in its own task, so a slow module delays only
//! its own resource), the Allocate answers prepared ahead of time, and the CDI spec writer. A
//! front end (the device-plugin server and its registration, `kubelet::resource::serve`) is
//! handed the [`Core`] and reads devices, answers and CDI naming from it.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use tokio::sync::{Notify, watch};
use tokio::task::JoinHandle;

use super::backend::{DeviceBackend, Upkeep};
use super::health::{self, Signals};
use super::prepared::{self, Prepared};
use super::snapshot::Snapshot;
use crate::cdi::{self, DeviceListStrategy, Naming, SpecWriter, Written};

/// What the core of one resource needs to start.
pub struct CoreSpec<'a> {
    /// The name the resource is served under (`vendor.com/type`), which its CDI spec follows.
    pub name: &'a str,
    /// The backend's own name for it.
    pub local: &'a str,
    /// How often the devices are re-enumerated.
    pub health_interval: Duration,
    /// Whether single-device Allocate answers are prepared ahead of time.
    pub allocate_ahead: bool,
    /// Whether the devices are replicas of shared physical devices.
    pub shared: bool,
    /// The CDI spec to keep written, when the device-list strategy uses CDI.
    pub cdi: Option<CdiSpec>,
    /// Where the device nodes the answers name are (`/` on a node).
    pub host_root: PathBuf,
}

/// A resource's CDI spec: its kind, its file and how answers name devices.
pub struct CdiSpec {
    pub kind: String,
    pub path: PathBuf,
    pub strategy: DeviceListStrategy,
}

/// A resource's CDI spec file and how Allocate has named its devices.
#[derive(Debug, Clone)]
pub struct CdiServed {
    pub path: PathBuf,
    pub naming: Naming,
    pub written: Arc<Written>,
}

/// A started core: what a front end reads, and the tasks that end when `stop` flips.
pub struct Core {
    /// Every device, replaced whole on any change, sorted by ID.
    pub devices: watch::Receiver<Snapshot>,
    /// True once the first enumeration finished (or failed).
    pub ready: watch::Receiver<bool>,
    /// Wakes the device watcher for an immediate re-enumeration.
    pub poke: Arc<Notify>,
    pub prepared: Prepared,
    pub cdi: Option<CdiServed>,
    /// True once the CDI spec for the first snapshot is written (or given up on).
    pub cdi_settled: Option<watch::Receiver<bool>>,
    /// Tells the CDI spec writer the resource goes away for good.
    pub retired: Arc<AtomicBool>,
    pub tasks: Vec<JoinHandle<()>>,
}

/// Starts the core of one resource served from `backend`, which lives where `upkeep` says.
pub fn start<B: DeviceBackend>(
    backend: &B,
    upkeep: &Arc<dyn Upkeep>,
    spec: CoreSpec<'_>,
    stop: &watch::Receiver<bool>,
) -> Core {
    let (devices_tx, devices) = watch::channel(Snapshot::default());
    let (ready_tx, ready) = watch::channel(false);
    let poke = Arc::new(Notify::new());
    let enumerated = Arc::new(Notify::new());
    let watcher = tokio::spawn(health::watch_devices(
        backend.clone(),
        spec.local.to_owned(),
        spec.health_interval,
        devices_tx,
        Signals {
            ready: ready_tx,
            poke: poke.clone(),
            enumerated: enumerated.clone(),
            stop: stop.clone(),
        },
    ));
    let prepared = Prepared::default();
    let mut tasks = vec![watcher];
    if spec.allocate_ahead {
        tasks.push(tokio::spawn(prepared::prepare_answers(
            backend.clone(),
            upkeep.clone(),
            spec.local.to_owned(),
            devices.clone(),
            enumerated,
            prepared.clone(),
            stop.clone(),
        )));
    }

    let retired = Arc::new(AtomicBool::new(false));
    let mut cdi_settled = None;
    let cdi = spec.cdi.map(|c| {
        let (view_tx, view) = watch::channel(None);
        let (settled_tx, settled_rx) = watch::channel(false);
        cdi_settled = Some(settled_rx);
        let written = Arc::new(Written::default());
        let recheck = Arc::new(Notify::new());
        tasks.push(tokio::spawn(
            SpecWriter {
                upkeep: upkeep.clone(),
                kind: c.kind,
                path: c.path.clone(),
                shared: spec.shared,
                devices: devices.clone(),
                prepared: prepared.clone(),
                view: view_tx,
                written: written.clone(),
                recheck: recheck.clone(),
                settled: settled_tx,
                host_root: spec.host_root,
                retired: retired.clone(),
                stop: stop.clone(),
            }
            .run(),
        ));
        CdiServed {
            path: c.path,
            naming: Naming {
                strategy: c.strategy,
                view,
                annotation_key: cdi::annotation_key(spec.name).into(),
                counts: Arc::default(),
                recheck,
            },
            written,
        }
    });
    Core {
        devices,
        ready,
        poke,
        prepared,
        cdi,
        cdi_settled,
        retired,
        tasks,
    }
}
