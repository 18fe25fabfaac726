//! One resource served as a DRA driver: the resource core's device watcher (the same one the
//! device-plugin front end uses), the driver's sockets for the kubelet (`server.rs`), its claims
//! (`prepare.rs`, held in the agent's allocation ledger) and its ResourceSlices (`slices.rs`).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{Notify, watch};
use tokio::task::JoinHandle;

use super::HeldElsewhere;
use super::api::ApiClient;
use super::error::DriverError;
use super::events::DraEvents;
use super::prepare::{Claims, ClaimsSpec};
use super::retire::Retirees;
use super::server::{self, Registered};
use super::slice_watch;
use super::slices::{self, Pool, Published};
use crate::resource::backend::{DeviceBackend, Upkeep};
use crate::resource::core::{self, CoreSpec};
use crate::resource::snapshot::Snapshot;

/// How often the publisher compares the API server's slices with the devices when nothing
/// changed: slices a starting kubelet wiped, or someone deleted, are back within it.
pub const DEFAULT_RESYNC: Duration = Duration::from_secs(10);

/// Where and for which node the agent serves DRA drivers.
#[derive(Debug, Clone)]
pub struct DraOptions {
    /// The kubelet's plugin-watcher directory (`/var/lib/kubelet/plugins_registry`).
    pub registry_dir: PathBuf,
    /// The kubelet's plugins directory (`/var/lib/kubelet/plugins`): `<driver>/dra.sock`.
    pub plugins_dir: PathBuf,
    /// This node's name: the pool's name and the slices' `spec.nodeName`.
    pub node: String,
    /// The API server; None serves the kubelet but publishes nothing and prepares nothing.
    pub api: Option<ApiClient>,
    /// Where agents before the one ledger kept each driver's claims (`dra-<driver>.json`,
    /// taken into the ledger once); None: nowhere.
    pub state_dir: Option<PathBuf>,
    /// Where claims' CDI specs go.
    pub cdi_dir: PathBuf,
    pub resync: Duration,
    /// Where drivers report what they do (the agent's metrics).
    pub events: DraEvents,
    /// Drivers that left the registry with claims still prepared.
    pub retirees: Retirees,
}

/// What starting a driver needs to know of the resource.
pub struct DriverSpec<'a> {
    /// The DRA driver name.
    pub driver: &'a str,
    /// The resource's served name (`vendor.com/gpu`), shown in status.
    pub name: &'a str,
    /// The backend's own name of it.
    pub local: &'a str,
    pub health_interval: Duration,
    pub host_root: PathBuf,
    pub held: HeldElsewhere,
    /// The agent's allocation ledger, which holds the driver's claims.
    pub ledger: crate::ledger::Ledger,
}

/// A driver's claims as the rest of the agent sees them: counted for status and metrics, and
/// closed to new claims when the driver retires.
pub trait ClaimCounts: Send + Sync {
    fn prepared(&self) -> usize;
    /// From now on only claims prepared already are answered by prepare.
    fn retire(&self);
}

impl<B: DeviceBackend> ClaimCounts for Claims<B> {
    fn prepared(&self) -> usize {
        Claims::prepared(self)
    }

    fn retire(&self) {
        self.retiring
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// A running driver.
pub struct RunningDriver {
    pub driver: String,
    pub name: String,
    pub local: String,
    pub devices: watch::Receiver<Snapshot>,
    pub poke: Arc<Notify>,
    /// Wakes the publisher to compare the pool with the devices now (devices held elsewhere
    /// may have been freed).
    pub republish: Arc<Notify>,
    pub published: watch::Receiver<Published>,
    pub registered: Arc<Registered>,
    pub registration_socket: PathBuf,
    pub service_socket: PathBuf,
    pub claims: Arc<dyn ClaimCounts>,
    api: Option<ApiClient>,
    events: DraEvents,
    retirees: Retirees,
    pool: Pool,
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
    /// Publishes the pool; None without an API server.
    publisher: Option<JoinHandle<()>>,
}

/// Starts serving one resource of `backend` as a DRA driver.
pub fn start<B: DeviceBackend>(
    backend: &B,
    upkeep: &Arc<dyn Upkeep>,
    spec: DriverSpec<'_>,
    options: &DraOptions,
) -> Result<RunningDriver, DriverError> {
    let kind = crate::cdi::spec::dra_kind(spec.driver, spec.local).map_err(|message| {
        DriverError::Kind {
            driver: spec.driver.to_owned(),
            message,
        }
    })?;
    if let Some(dir) = &options.state_dir {
        super::old_checkpoint::adopt(dir, spec.driver, spec.name, &spec.ledger)?;
    }
    let (stop, stopped) = watch::channel(false);
    let core = core::start(
        backend,
        upkeep,
        CoreSpec {
            name: spec.name,
            local: spec.local,
            health_interval: spec.health_interval,
            allocate_ahead: false,
            shared: false,
            cdi: None,
            host_root: spec.host_root,
        },
        &stopped,
    );
    let claims = Arc::new(Claims::new(
        ClaimsSpec {
            driver: spec.driver.to_owned(),
            pool: options.node.clone(),
            resource: spec.local.to_owned(),
            served: spec.name.to_owned(),
            kind,
            api: options.api.clone(),
            cdi_dir: options.cdi_dir.clone(),
            ledger: spec.ledger.clone(),
            held: spec.held.clone(),
            events: options.events.clone(),
        },
        backend.clone(),
        core.devices.clone(),
    ));
    {
        let claims = claims.clone();
        tokio::task::spawn_blocking(move || claims.remove_stale_specs());
    }
    {
        // Claims a module was preparing when the agent stopped: undone before anything else
        // is asked of them (a kubelet retry waits behind this, claim by claim).
        let claims = claims.clone();
        tokio::spawn(async move { claims.recover().await });
    }
    let republish = Arc::new(Notify::new());
    let watching = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let served = server::serve(
        claims.clone(),
        (&options.registry_dir, &options.plugins_dir),
        (republish.clone(), watching.clone()),
        stopped.clone(),
    )
    .map_err(|source| DriverError::Serve {
        driver: spec.driver.to_owned(),
        source,
    })?;
    let pool = Pool {
        driver: spec.driver.to_owned(),
        node: options.node.clone(),
    };
    let (published_tx, published) = watch::channel(Published::default());
    let mut tasks = core.tasks;
    tasks.extend(served.tasks);
    let publisher = options.api.as_ref().map(|api| {
        let publish = slices::publish(
            api.clone(),
            pool.clone(),
            core.devices.clone(),
            (spec.held.clone(), republish.clone()),
            options.events.clone(),
            core.ready.clone(),
            options.resync,
            published_tx,
            stopped.clone(),
        );
        let watch = slice_watch::watch_pool(
            api.clone(),
            pool.clone(),
            republish.clone(),
            watching,
            stopped,
        );
        // One task: aborting the publisher stops the watch that wakes it, and the publisher's
        // end (only stopping explains it) ends the watch.
        tokio::spawn(async move {
            tokio::select! {
                () = publish => {}
                () = watch => {}
            }
        })
    });
    tracing::info!(
        driver = spec.driver,
        resource = spec.name,
        socket = %served.registration.display(),
        "serving as a DRA driver"
    );
    Ok(RunningDriver {
        driver: spec.driver.to_owned(),
        name: spec.name.to_owned(),
        local: spec.local.to_owned(),
        devices: core.devices,
        poke: core.poke,
        republish,
        published,
        registered: served.registered,
        registration_socket: served.registration,
        service_socket: served.service,
        claims,
        api: options.api.clone(),
        events: options.events.clone(),
        retirees: options.retirees.clone(),
        pool,
        stop,
        tasks,
        publisher,
    })
}

impl RunningDriver {
    /// Whether one of its tasks ended, which only stopping explains.
    pub fn task_ended(&self) -> bool {
        self.tasks
            .iter()
            .chain(&self.publisher)
            .any(|t| t.is_finished())
    }

    /// Stops serving; `retire` (the module or resource left the registry): its ResourceSlices
    /// go too, and while claims it prepared remain it keeps answering for them (see
    /// `retire.rs`) before it stops. Prepared claims stay in the ledger either way, so a later
    /// agent can still unprepare them.
    pub async fn stop(mut self, retire: bool) {
        if !retire {
            self.shutdown().await;
            return;
        }
        if self.claims.prepared() > 0 {
            self.claims.retire();
        }
        if let Some(publisher) = self.publisher.take() {
            publisher.abort();
            let _ = publisher.await;
        }
        if let Some(api) = &self.api {
            slices::withdraw(api, &self.pool, &self.events).await;
        }
        if self.claims.prepared() > 0 {
            self.retirees.clone().hold(self);
        } else {
            self.shutdown().await;
        }
    }

    /// Stops serving and removes its sockets; the slices and the claims in the ledger stay.
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        for task in self.tasks.into_iter().chain(self.publisher) {
            let _ = task.await;
        }
    }
}
