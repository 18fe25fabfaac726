//! `NodePrepareResources` and `NodeUnprepareResources` for one driver (one served resource),
//! whatever version of the kubelet's API carried them (`server.rs` converts).
//!
//! The claims of one call are prepared concurrently, each in a task of its own and serialized
//! per claim UID (the kubelet may call again for one claim while the first call runs). A claim
//! the ledger has as prepared is answered as before (the kubelet calls again after its own
//! restart). Otherwise the claim is fetched from the API server and checked (`claim.rs`), each
//! request's device names are mapped back to the module's IDs in the current snapshot (each must
//! be there, and healthy unless the claim tolerates its health taint), and the devices are *reserved* in the agent's one allocation ledger:
//! the check that no other claim, and no container of the device-plugin front end, holds them and
//! the record that this claim does are one step, so of several claims naming one device exactly
//! one is prepared (a request with admin access holds nothing and is never refused). Then the
//! module's `allocate` is asked with the request's opaque config and key `<claim UID>/<request>`,
//! the answers go into one CDI spec file for the claim (a CDI device `<claim UID>-<request>` per
//! request), the claim is marked prepared and written to the ledger's checkpoint, and only then
//! answered. One claim's failure is its own entry's error; what was reserved and allocated for
//! it is given back.
//!
//! A prepared claim whose spec file is gone (CDI specs live on tmpfs, so after a reboot) is
//! prepared again from what the ledger kept.
//!
//! Unprepare needs only the UID: the ledger says what to release and which spec to remove. An
//! unknown UID succeeds (it was never prepared here, or is already unprepared). A module that
//! fails its `release` is logged, never allowed to pin a claim forever; a module's `release` must
//! be idempotent (an unprepare that fails after it is retried).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use k8s_openapi::api::resource::v1::DeviceToleration;
use tokio::sync::watch;
use tokio::time::Instant;

use super::HeldElsewhere;
use super::api::ApiClient;
use super::claim;
use super::claim_status::StatusWriter;
use super::events::{DraEvent, DraEvents};
use super::units::units;
use crate::device::{ContainerEdits, Prepared, Request, Share};
use crate::ledger::{
    Budget, ClaimRecord, Conflict, HeldShare, Ledger, LedgerError, PreparedRequest,
};
use crate::resource::backend::{BackendError, DeviceBackend};
use crate::resource::snapshot::Snapshot;

/// Most claims answered in one call: a pod has at most 32 claims; past it each gets an error.
pub const MAX_CLAIMS_PER_CALL: usize = 32;

/// A claim as the kubelet names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimRef {
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

/// One device of a prepared claim, as the kubelet is told.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreparedDevice {
    pub request: String,
    pub pool: String,
    pub device: String,
    pub cdi_ids: Vec<String>,
}

/// Why one claim was not prepared or unprepared: the text of its entry's `error`.
#[derive(Debug, thiserror::Error)]
pub enum ClaimError {
    #[error(
        "more than {MAX_CLAIMS_PER_CALL} claims in one call; this one was not prepared or unprepared"
    )]
    TooMany,
    /// An earlier call for the same claim still runs (its API read, a module call) as this
    /// call's deadline comes: answered now rather than after the kubelet stopped listening.
    #[error(
        "an earlier call for this claim is still running; this one was not started (the \
         kubelet's next try finds it done)"
    )]
    Busy,
    /// The call's deadline came before the claim's devices were reserved: nothing was done.
    #[error(
        "the call's deadline came before the claim's devices were reserved; nothing was done \
         (the kubelet's next try prepares it)"
    )]
    Late,
    /// The call's deadline came while the module still worked on the claim: the work goes on
    /// to its end (a claim is never left half prepared), and the kubelet's next try finds it.
    #[error(
        "the claim is still being {0} as the call's deadline comes; the kubelet's next try finds it done"
    )]
    StillRunning(&'static str),
    #[error(
        "DRA driver {0} left this node's registry: it only answers for the claims it prepared \
         before, until they are unprepared"
    )]
    Retiring(String),
    #[error("the agent has no API server to read claims from")]
    NoApi,
    #[error("{0}")]
    Api(String),
    /// The claim itself cannot be prepared here (`claim.rs`, names, devices).
    #[error("{0}")]
    Refused(String),
    #[error(transparent)]
    Held(Box<Conflict>),
    #[error("request {request:?}{again}: {source}", again = if *.again { ", prepared again" } else { "" })]
    Module {
        request: String,
        again: bool,
        source: BackendError,
    },
    /// A module that prepares claims could not undo one: what it made (a MIG instance) is
    /// still there, so the claim stays recorded for the kubelet's next NodeUnprepareResources.
    #[error(
        "request {request:?}: the module's unprepare failed; the claim stays prepared until an \
         unprepare succeeds: {source}"
    )]
    Unprepare {
        request: String,
        source: BackendError,
    },
    #[error("writing the claim's CDI spec {}: {message}", path.display())]
    Spec { path: PathBuf, message: String },
    #[error(transparent)]
    Ledger(#[from] LedgerError),
    #[error("the claim's task failed: {0}")]
    Task(String),
}

impl ClaimError {
    /// The module failed `request` (the first time it was asked).
    fn module(request: &str, source: BackendError) -> ClaimError {
        ClaimError::Module {
            request: request.to_owned(),
            again: false,
            source,
        }
    }
}

impl From<Conflict> for ClaimError {
    fn from(conflict: Conflict) -> Self {
        ClaimError::Held(Box::new(conflict))
    }
}

/// A pool's DRA device names, each with its members' module IDs.
type NameTable = HashMap<String, Vec<String>>;

/// Everything one driver's claims need.
pub struct Claims<B> {
    pub driver: String,
    /// This node's pool (the node's name).
    pub pool: String,
    /// The backend's own name of the resource.
    pub resource: String,
    /// The resource's served name: the ledger's key for its devices, shared with the
    /// device-plugin front end.
    pub served: String,
    /// The CDI kind of the claims' specs.
    pub kind: String,
    pub backend: B,
    pub devices: watch::Receiver<Snapshot>,
    pub api: Option<ApiClient>,
    pub cdi_dir: PathBuf,
    /// The agent's allocation ledger: who holds which device, through either front end.
    pub ledger: Ledger,
    /// Devices containers hold through the device-plugin front end.
    pub held: HeldElsewhere,
    events: DraEvents,
    /// Left the registry: only claims prepared already are answered (`retire.rs`).
    pub(super) retiring: std::sync::atomic::AtomicBool,
    locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// The last snapshot's units by DRA name ([`Claims::names_in`]).
    names: Mutex<Option<(Snapshot, Arc<NameTable>)>>,
    /// The last snapshot's budget of shared capacity and counters ([`Claims::budget_of`]).
    budget: Mutex<Option<(Snapshot, Arc<Budget>)>>,
    /// Writes prepared claims' `status.devices` (with an API server).
    status: Option<StatusWriter>,
}

/// What building a driver's [`Claims`] takes besides the backend.
pub struct ClaimsSpec {
    pub driver: String,
    pub pool: String,
    pub resource: String,
    pub served: String,
    pub kind: String,
    pub api: Option<ApiClient>,
    pub cdi_dir: PathBuf,
    pub ledger: Ledger,
    pub held: HeldElsewhere,
    pub events: DraEvents,
}

impl<B: DeviceBackend> Claims<B> {
    pub fn new(spec: ClaimsSpec, backend: B, devices: watch::Receiver<Snapshot>) -> Claims<B> {
        let ClaimsSpec {
            driver,
            pool,
            resource,
            served,
            kind,
            api,
            cdi_dir,
            ledger,
            held,
            events,
        } = spec;
        let status = api
            .clone()
            .map(|api| StatusWriter::start(api, driver.clone(), events.clone()));
        Claims {
            status,
            driver,
            pool,
            resource,
            served,
            kind,
            backend,
            devices,
            api,
            cdi_dir,
            ledger,
            held,
            events,
            retiring: Default::default(),
            locks: Mutex::default(),
            names: Mutex::default(),
            budget: Mutex::default(),
        }
    }

    /// How many claims this driver has prepared.
    pub fn prepared(&self) -> usize {
        self.ledger.claim_count(&self.driver)
    }

    /// Prepares each claim, concurrently; the answer has an entry for every UID asked. Each
    /// claim runs in its own task, so a kubelet that gives up on the call (its deadline, a
    /// dropped connection) cannot leave a claim half prepared: allocated but not recorded.
    pub async fn prepare(
        self: &Arc<Self>,
        claims: Vec<ClaimRef>,
        deadline: Instant,
    ) -> BTreeMap<String, Result<Vec<PreparedDevice>, ClaimError>> {
        let mut jobs = Vec::with_capacity(claims.len().min(MAX_CLAIMS_PER_CALL));
        let mut answers = BTreeMap::new();
        let asked = claims.len();
        for (i, claim) in claims.into_iter().enumerate() {
            if i >= MAX_CLAIMS_PER_CALL {
                answers.insert(claim.uid, Err(ClaimError::TooMany));
                continue;
            }
            let me = self.clone();
            let uid = claim.uid.clone();
            jobs.push((
                uid,
                tokio::spawn(async move {
                    let started = std::time::Instant::now();
                    let answer = me
                        .serialized(&claim.uid, Some(deadline), me.prepare_one(&claim, deadline))
                        .await;
                    if let Err(e) = &answer {
                        tracing::warn!(driver = me.driver, claim = claim.uid, "prepare: {e}");
                    }
                    let (ok, took) = (answer.is_ok(), started.elapsed());
                    me.events.emit(&me.driver, DraEvent::Prepared { ok, took });
                    answer
                }),
            ));
        }
        self.log_too_many("NodePrepareResources", asked);
        let answer_at = answer_time(deadline);
        for (uid, job) in jobs {
            answers.insert(uid, answer_by(answer_at, job, "prepared").await);
        }
        answers
    }

    /// Unprepares each claim by UID, concurrently and each in its own task like
    /// [`prepare`](Self::prepare), at most [`MAX_CLAIMS_PER_CALL`]; the answer has an entry for
    /// every UID asked.
    pub async fn unprepare(
        self: &Arc<Self>,
        uids: Vec<String>,
        deadline: Instant,
    ) -> BTreeMap<String, Result<(), ClaimError>> {
        self.log_too_many("NodeUnprepareResources", uids.len());
        let mut uids = uids;
        let refused = uids.split_off(uids.len().min(MAX_CLAIMS_PER_CALL));
        let mut answers: BTreeMap<String, Result<(), ClaimError>> = refused
            .into_iter()
            .map(|uid| (uid, Err(ClaimError::TooMany)))
            .collect();
        let jobs: Vec<_> = uids
            .into_iter()
            .map(|uid| {
                let me = self.clone();
                (
                    uid.clone(),
                    tokio::spawn(async move {
                        let started = std::time::Instant::now();
                        let answer = me
                            .serialized(&uid, Some(deadline), me.unprepare_one(&uid))
                            .await;
                        let (ok, took) = (answer.is_ok(), started.elapsed());
                        me.events
                            .emit(&me.driver, DraEvent::Unprepared { ok, took });
                        answer
                    }),
                )
            })
            .collect();
        let answer_at = answer_time(deadline);
        for (uid, job) in jobs {
            answers.insert(uid, answer_by(answer_at, job, "unprepared").await);
        }
        answers
    }

    /// Removes claim specs of this driver that no prepared claim names: left by an agent
    /// stopped between writing a spec and recording its claim. Blocking.
    pub fn remove_stale_specs(&self) {
        let known: BTreeSet<String> = self
            .ledger
            .claims_of(&self.driver)
            .into_iter()
            .map(|(uid, _)| uid)
            .collect();
        crate::cdi::claim::remove_stale(&self.cdi_dir, &self.driver, &known);
    }

    /// Undoes every claim of this driver recorded as being prepared by its module (WIT 0.3
    /// `claims`) when the agent stopped: the module's `unprepare` for each request, then the
    /// record goes. One whose `unprepare` fails stays recorded, and is tried again at the
    /// claim's next prepare or the next start.
    pub async fn recover(self: &Arc<Self>) {
        let preparing: Vec<(String, ClaimRecord)> = self
            .ledger
            .claims_of(&self.driver)
            .into_iter()
            .filter(|(_, c)| c.preparing)
            .collect();
        for (uid, record) in preparing {
            let undone = self
                .serialized(&uid, None, async {
                    match self.ledger.claim(&uid) {
                        Some(r) if r.preparing => self.undo_preparing(&uid, &r).await,
                        _ => Ok(()),
                    }
                })
                .await;
            match undone {
                Ok(()) => tracing::info!(
                    driver = self.driver,
                    claim = uid,
                    "undid claim {}/{}, which the module was preparing when the agent stopped",
                    record.namespace,
                    record.name
                ),
                Err(e) => tracing::warn!(driver = self.driver, claim = uid, "{e}"),
            }
        }
    }

    /// The module's `unprepare` for each request of `record`, recorded as being prepared; then
    /// the record goes, durably. On a failed `unprepare` the record stays.
    async fn undo_preparing(&self, uid: &str, record: &ClaimRecord) -> Result<(), ClaimError> {
        for request in &record.requests {
            self.backend
                .unprepare(self.request(uid, request))
                .await
                .map_err(|source| ClaimError::module(&request.request, source))?;
        }
        self.ledger.drop_claim(uid);
        self.persist().await
    }

    /// Writes the ledger's pending changes, on the blocking pool.
    async fn persist(&self) -> Result<(), ClaimError> {
        let ledger = self.ledger.clone();
        tokio::task::spawn_blocking(move || ledger.persist())
            .await
            .map_err(|e| ClaimError::Task(e.to_string()))?
            .map_err(ClaimError::from)
    }

    /// One line for a call past [`MAX_CLAIMS_PER_CALL`], not one per claim: the kubelet hears
    /// each in its answer.
    fn log_too_many(&self, call: &str, asked: usize) {
        if asked > MAX_CLAIMS_PER_CALL {
            tracing::warn!(
                driver = self.driver,
                "a {call} call asked for {asked} claims; the {} past the first \
                 {MAX_CLAIMS_PER_CALL} were refused",
                asked - MAX_CLAIMS_PER_CALL
            );
        }
    }

    /// Runs `work` while no other call for claim `uid` runs; [`ClaimError::Busy`] if another
    /// still runs when `until` comes.
    async fn serialized<T>(
        &self,
        uid: &str,
        until: Option<Instant>,
        work: impl Future<Output = Result<T, ClaimError>>,
    ) -> Result<T, ClaimError> {
        let lock = self
            .locks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(uid.to_owned())
            .or_default()
            .clone();
        let held = match until {
            Some(until) => tokio::time::timeout_at(until, lock.clone().lock_owned())
                .await
                .ok(),
            None => Some(lock.clone().lock_owned().await),
        };
        let answer = match held {
            Some(_held) => work.await,
            None => Err(ClaimError::Busy),
        };
        let mut locks = self.locks.lock().unwrap_or_else(|p| p.into_inner());
        // Only when no one else waits on it; this copy goes under the map's lock, so of two
        // finishing at once the second sees the first gone.
        if Arc::strong_count(&lock) <= 2 {
            locks.remove(uid);
        }
        drop(lock);
        drop(locks);
        answer
    }

    async fn prepare_one(
        &self,
        claim: &ClaimRef,
        deadline: Instant,
    ) -> Result<Vec<PreparedDevice>, ClaimError> {
        if let Some(half) = self.ledger.claim(&claim.uid).filter(|c| c.preparing) {
            // Left by an agent stopped in the module's `prepare`: undone, then prepared afresh.
            self.undo_preparing(&claim.uid, &half).await?;
        }
        if let Some(done) = self.ledger.claim(&claim.uid) {
            let spec_gone = done.spec_file.as_ref().is_some_and(|f| !f.exists());
            if !spec_gone {
                return Ok(self.devices_of(&done));
            }
            // The node rebooted (CDI specs live on tmpfs) or someone removed it: the module is
            // asked again, as for a new claim, with what the ledger kept.
            return self.restore(&claim.uid, done).await;
        }
        if self.retiring.load(std::sync::atomic::Ordering::Relaxed) {
            return Err(ClaimError::Retiring(self.driver.clone()));
        }
        let api = self.api.as_ref().ok_or(ClaimError::NoApi)?;
        // The lock may have come just before the deadline: not the API server's fault.
        if Instant::now() >= deadline {
            return Err(ClaimError::Late);
        }
        let object =
            match tokio::time::timeout_at(deadline, api.claim(&claim.namespace, &claim.name)).await
            {
                Ok(object) => object.map_err(|e| {
                    self.events.emit(&self.driver, DraEvent::ApiError);
                    ClaimError::Api(e.to_string())
                })?,
                Err(_) => {
                    self.events.emit(&self.driver, DraEvent::ApiError);
                    return Err(ClaimError::Api(format!(
                        "getting ResourceClaim {}/{}: no answer from the API server before the \
                     call's deadline",
                        claim.namespace, claim.name
                    )));
                }
            };
        let wanted = claim::wanted(&object, &claim.uid, &self.driver, &self.pool)?;
        for want in &wanted {
            check_names(&claim.uid, &want.request)?;
        }
        // A request's config is the module's to judge before anything is reserved for it.
        for want in wanted.iter().filter(|w| !w.config.is_empty()) {
            self.backend
                .validate_config(&self.resource, &want.config)
                .await
                .map_err(|source| ClaimError::module(&want.request, source))?;
        }
        let snapshot = self.devices.borrow().clone();
        let mut requests = Vec::with_capacity(wanted.len());
        for want in wanted {
            let devices = self.ids_of(&snapshot, &want.devices, &want.tolerations)?;
            let shares = want
                .shares
                .into_iter()
                .filter_map(|s| {
                    let (_, id) = devices.iter().find(|(name, _)| *name == s.device)?;
                    let device = crate::resource::snapshot::find(&snapshot, id);
                    Some(HeldShare {
                        device: id.clone(),
                        share_id: s.share_id,
                        consumed: match device {
                            Some(d) => consumed_by_name(d, s.consumed),
                            None => s.consumed,
                        },
                    })
                })
                .collect();
            requests.push(PreparedRequest {
                devices,
                request: want.request,
                config: want.config,
                cdi_ids: Vec::new(),
                admin: want.admin,
                shares,
                status: Vec::new(),
            });
        }
        let prepares = self.backend.prepares_claims(&self.resource);
        let mut record = ClaimRecord {
            driver: self.driver.clone(),
            resource: self.served.clone(),
            namespace: claim.namespace.clone(),
            name: claim.name.clone(),
            requests,
            spec_file: None,
            preparing: prepares,
            by_module: prepares,
        };
        // Nothing is begun that the call could not answer for: once reserved, the claim is
        // prepared to its end, whatever the kubelet's deadline (see `answer_by`).
        if Instant::now() >= deadline {
            return Err(ClaimError::Late);
        }
        let budget = self.budget_of(&snapshot);
        self.ledger
            .reserve_claim_within(&claim.uid, record.clone(), &budget)?;
        if prepares {
            // The write-ahead record: whatever the module creates from here on, a restart
            // finds the claim and has it undone.
            self.ledger.prepare_claim(&claim.uid, record.clone());
            if let Err(e) = self.persist().await {
                self.ledger.drop_claim(&claim.uid);
                return Err(e);
            }
        }
        let mut answers: BTreeMap<String, Arc<ContainerEdits>> = BTreeMap::new();
        for (done, request) in record.requests.iter_mut().enumerate() {
            let outcome = self
                .prepare_request(&claim.uid, request, prepares)
                .await
                .map_err(|source| ClaimError::module(&request.request, source));
            match outcome {
                Ok(prepared) => {
                    request.cdi_ids = prepared.edits.cdi_devices.clone();
                    request.status = prepared.status;
                    answers.insert(
                        format!("{}-{}", claim.uid, request.request),
                        Arc::new(prepared.edits),
                    );
                }
                Err(error) => {
                    if prepares {
                        // The module's `prepare` may have created part of what failed: every
                        // request is unprepared, and if that fails too the write-ahead record
                        // stays, so the kubelet's retry (or the next start) undoes it again.
                        if let Err(e) = self.undo_preparing(&claim.uid, &record).await {
                            tracing::warn!(
                                driver = self.driver,
                                claim = claim.uid,
                                "undoing a failed prepare: {e}; tried again at the claim's next \
                                 prepare or the agent's next start"
                            );
                        }
                    } else {
                        let done = ClaimRecord {
                            requests: record.requests[..done].to_vec(),
                            ..record.clone()
                        };
                        self.give_back(&claim.uid, &done).await;
                    }
                    return Err(error);
                }
            }
        }
        record.preparing = false;
        self.finish(&claim.uid, record, answers).await
    }

    /// One request prepared: by the module's `prepare` for a resource that `prepares`,
    /// otherwise by `allocate` (no status of its own).
    async fn prepare_request(
        &self,
        uid: &str,
        request: &PreparedRequest,
        prepares: bool,
    ) -> Result<Prepared, BackendError> {
        let asked = self.request(uid, request);
        if prepares {
            self.backend.prepare(asked).await
        } else {
            Ok(Prepared {
                edits: self.backend.allocate_request(asked).await?,
                status: Vec::new(),
            })
        }
    }

    /// What the module is asked for `request` of claim `uid`: each device once, and the
    /// request's shares of devices shared by capacity.
    fn request(&self, uid: &str, request: &PreparedRequest) -> Request {
        let mut ids: Vec<String> = Vec::with_capacity(request.devices.len());
        for (_, id) in &request.devices {
            if !ids.contains(id) {
                ids.push(id.clone());
            }
        }
        Request {
            resource: self.resource.clone(),
            ids,
            config: request.config.clone(),
            key: format!("{uid}/{}", request.request),
            shares: request
                .shares
                .iter()
                .map(|s| Share {
                    id: s.device.clone(),
                    share_id: s.share_id.clone(),
                    consumed: s.consumed.clone(),
                })
                .collect(),
        }
    }

    /// Writes the claim's spec and records it prepared, durably, in one trip to the blocking
    /// pool; on failure gives back what was reserved and allocated.
    async fn finish(
        &self,
        uid: &str,
        record: ClaimRecord,
        answers: BTreeMap<String, Arc<ContainerEdits>>,
    ) -> Result<Vec<PreparedDevice>, ClaimError> {
        let (record, spec) = self.with_spec(uid, record, &answers);
        let answer = self.devices_of(&record);
        if let Err(e) = self.make_durable(uid, &record, spec).await {
            self.remove_spec(&record).await;
            if record.by_module {
                // Undone under its write-ahead record again, which stays if that fails.
                let undo = ClaimRecord {
                    preparing: true,
                    ..record
                };
                self.ledger.prepare_claim(uid, undo.clone());
                if let Err(u) = self.undo_preparing(uid, &undo).await {
                    tracing::warn!(driver = self.driver, claim = uid, "undoing a claim: {u}");
                }
            } else {
                self.give_back(uid, &record).await;
            }
            // Its end reaches the journal with the next write.
            return Err(e);
        }
        self.report(&record);
        Ok(answer)
    }

    /// Queues the claim's `status.devices` entries (see `claim_status`).
    fn report(&self, record: &ClaimRecord) {
        if let Some(status) = &self.status {
            status.prepared(&self.pool, record);
        }
    }

    /// A prepared claim whose spec is gone, prepared again from what the ledger kept.
    async fn restore(
        &self,
        uid: &str,
        done: ClaimRecord,
    ) -> Result<Vec<PreparedDevice>, ClaimError> {
        let mut answers = BTreeMap::new();
        let prepares = done.by_module;
        for request in &done.requests {
            let prepared =
                self.prepare_request(uid, request, prepares)
                    .await
                    .map_err(|source| ClaimError::Module {
                        request: request.request.clone(),
                        again: true,
                        source,
                    })?;
            answers.insert(
                format!("{uid}-{}", request.request),
                Arc::new(prepared.edits),
            );
        }
        let (record, spec) = self.with_spec(uid, done, &answers);
        let answer = self.devices_of(&record);
        self.make_durable(uid, &record, spec).await?;
        self.report(&record);
        Ok(answer)
    }

    /// `record` with its CDI spec file and IDs, and the spec to write (None when no request's
    /// answer holds anything a spec carries).
    fn with_spec(
        &self,
        uid: &str,
        mut record: ClaimRecord,
        answers: &BTreeMap<String, Arc<ContainerEdits>>,
    ) -> (ClaimRecord, Option<(PathBuf, crate::cdi::spec::Spec)>) {
        let Some((spec, _)) = crate::cdi::build(&self.kind, answers) else {
            record.spec_file = None;
            return (record, None);
        };
        let in_spec: BTreeSet<&str> = spec.devices.iter().map(|d| d.name.as_str()).collect();
        // A request whose answer holds something a spec carries gets its CDI device first.
        for request in &mut record.requests {
            let name = format!("{uid}-{}", request.request);
            let id = format!("{}={name}", self.kind);
            if in_spec.contains(name.as_str()) && !request.cdi_ids.contains(&id) {
                request.cdi_ids.insert(0, id);
            }
        }
        let path = crate::cdi::claim::path(&self.cdi_dir, &self.driver, uid);
        record.spec_file = Some(path.clone());
        (record, Some((path, spec)))
    }

    /// Marks `record` prepared, then writes its spec and journals it, together on the blocking
    /// pool, and returns once both are on disk. (A spec written and a journal line lost to a
    /// crash leave a spec nobody names, removed when the driver starts; a line written and a
    /// spec lost leave a prepared claim whose spec is gone, which its next prepare writes
    /// again.)
    async fn make_durable(
        &self,
        uid: &str,
        record: &ClaimRecord,
        spec: Option<(PathBuf, crate::cdi::spec::Spec)>,
    ) -> Result<(), ClaimError> {
        self.ledger.prepare_claim(uid, record.clone());
        let ledger = self.ledger.clone();
        tokio::task::spawn_blocking(move || {
            if let Some((path, spec)) = spec {
                crate::cdi::claim::write(&path, &spec)
                    .map_err(|message| ClaimError::Spec { path, message })?;
            }
            ledger.persist().map_err(ClaimError::from)
        })
        .await
        .map_err(|e| ClaimError::Task(e.to_string()))?
    }

    async fn unprepare_one(&self, uid: &str) -> Result<(), ClaimError> {
        let Some(prepared) = self.ledger.claim(uid) else {
            return Ok(());
        };
        if let Err(e) = self.release_all(uid, &prepared).await {
            // Some of it may be undone already: recorded as being prepared again, its spec gone,
            // so no prepare answers from it and the next unprepare (or start) tries again.
            if let Some(path) = &prepared.spec_file {
                let path = path.clone();
                let _ = tokio::task::spawn_blocking(move || crate::cdi::claim::remove(&path)).await;
            }
            self.ledger.prepare_claim(
                uid,
                ClaimRecord {
                    preparing: true,
                    spec_file: None,
                    ..prepared
                },
            );
            if let Err(p) = self.persist().await {
                tracing::warn!(driver = self.driver, claim = uid, "{p}");
            }
            return Err(e);
        }
        self.ledger.drop_claim(uid);
        // A claim recorded before names were kept (an older checkpoint) has none to write to.
        if let Some(status) = self.status.as_ref().filter(|_| !prepared.name.is_empty()) {
            status.unprepared(&prepared.namespace, &prepared.name);
        }
        let ledger = self.ledger.clone();
        // One trip: the spec goes, and the claim's end is journaled.
        tokio::task::spawn_blocking(move || {
            if let Some(path) = &prepared.spec_file {
                crate::cdi::claim::remove(path);
            }
            ledger.persist()
        })
        .await
        .map_err(|e| ClaimError::Task(e.to_string()))??;
        Ok(())
    }

    /// What the kubelet is told for a prepared claim: each device (a group's members once,
    /// under its name), the request's CDI IDs on the first device of the request (the answer
    /// covers the request as a whole).
    fn devices_of(&self, claim: &ClaimRecord) -> Vec<PreparedDevice> {
        let mut out = Vec::new();
        for request in &claim.requests {
            let mut names: Vec<&String> = request.devices.iter().map(|(name, _)| name).collect();
            names.dedup();
            for (i, name) in names.into_iter().enumerate() {
                out.push(PreparedDevice {
                    request: request.request.clone(),
                    pool: self.pool.clone(),
                    device: name.clone(),
                    cdi_ids: if i == 0 {
                        request.cdi_ids.clone()
                    } else {
                        Vec::new()
                    },
                });
            }
        }
        out
    }

    /// The units of `snapshot` by DRA name, each as its members' IDs: made once per snapshot
    /// (the device watcher sends a new one only when something changed), so that a claim's
    /// names are looked up, not recomputed over the pool for every claim.
    fn names_in(&self, snapshot: &Snapshot) -> Arc<NameTable> {
        let mut cached = self.names.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((of, names)) = cached.as_ref()
            && Arc::ptr_eq(of, snapshot)
        {
            return names.clone();
        }
        let names: Arc<NameTable> = Arc::new(
            units(snapshot)
                .into_iter()
                .map(|u| (u.name, u.members.iter().map(|d| d.id.clone()).collect()))
                .collect(),
        );
        *cached = Some((snapshot.clone(), names.clone()));
        names
    }

    /// The budget of `snapshot`'s shared devices and partitions, made once per snapshot.
    fn budget_of(&self, snapshot: &Snapshot) -> Arc<Budget> {
        let mut cached = self.budget.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((of, budget)) = cached.as_ref()
            && Arc::ptr_eq(of, snapshot)
        {
            return budget.clone();
        }
        let budget = Arc::new(Budget::of(snapshot, &snapshot.counter_sets));
        *cached = Some((snapshot.clone(), budget.clone()));
        budget
    }

    /// (name, module ID) of each device name's members (a group's every device), from the
    /// current snapshot; each must be published and held by no device-plugin container, and
    /// healthy unless the claim tolerates its health taint (`tolerations`, by name). Work in the
    /// size of the claim: a name is looked up in the snapshot's table of names, and its members
    /// by ID.
    fn ids_of(
        &self,
        snapshot: &Snapshot,
        names: &[String],
        tolerations: &BTreeMap<String, Vec<DeviceToleration>>,
    ) -> Result<Vec<(String, String)>, ClaimError> {
        let table = self.names_in(snapshot);
        let refused = |m: String| Err(ClaimError::Refused(m));
        let mut out: Vec<(String, String)> = Vec::new();
        let mut held = None;
        for name in names {
            if out.iter().any(|(n, _)| n == name) {
                return refused(format!("device {name:?} is allocated twice"));
            }
            let Some(members) = table.get(name).map(|ids| {
                ids.iter()
                    .filter_map(|id| crate::resource::snapshot::find(snapshot, id))
                    .collect::<Vec<_>>()
            }) else {
                return refused(format!("device {name:?} is not one this driver publishes"));
            };
            // Worded as the published taint's, so a toleration of it matches here too.
            if let Some(reason) = super::units::reason_of(&members) {
                let taint = super::taints::health_taint(Some(&reason));
                let tolerated = tolerations
                    .get(name)
                    .is_some_and(|t| t.iter().any(|t| super::taints::tolerates(t, &taint)));
                if !tolerated {
                    return refused(format!(
                        "device {name:?} is unhealthy: {reason} (only a claim that tolerates \
                         its taint {}={}:{} may have it)",
                        taint.key,
                        taint.value.as_deref().unwrap_or_default(),
                        taint.effect
                    ));
                }
                tracing::info!(
                    driver = self.driver,
                    device = name,
                    "preparing an unhealthy device: the claim tolerates its taint ({reason})"
                );
            }
            // The module's own NoExecute taints: a claim that does not tolerate one must not run
            // on the device, however it was allocated (a NoSchedule taint only keeps new
            // allocations away, which is the scheduler's business, and may postdate this one).
            let untolerated = members
                .iter()
                .flat_map(|d| super::advanced::own_taints(d))
                .find(|taint| {
                    taint.effect == "NoExecute"
                        && !tolerations
                            .get(name)
                            .is_some_and(|t| t.iter().any(|t| super::taints::tolerates(t, taint)))
                });
            if let Some(taint) = untolerated {
                return refused(format!(
                    "device {name:?} carries the module's taint {}={}:{}, which the claim does \
                     not tolerate",
                    taint.key,
                    taint.value.as_deref().unwrap_or_default(),
                    taint.effect
                ));
            }
            let held = held.get_or_insert_with(|| (self.held)());
            if members.iter().any(|d| held.contains(&d.id)) {
                return refused(format!(
                    "device {name:?} is still held by a container the device-plugin front end \
                     allocated it to; it joins the pool when that container ends"
                ));
            }
            out.extend(members.iter().map(|d| (name.clone(), d.id.clone())));
        }
        Ok(out)
    }

    /// Releases what the module allocated for `record` and frees the claim's reservation.
    async fn give_back(&self, uid: &str, record: &ClaimRecord) {
        if let Err(e) = self.release_all(uid, record).await {
            tracing::warn!(driver = self.driver, claim = uid, "{e}");
        }
        self.ledger.drop_claim(uid);
    }

    /// The module's `unprepare` for each request of a claim its `prepare` prepared (the first
    /// failure returned, after every request was tried: each may come again), its `release`
    /// otherwise (a failure logged: `release` undoes only host-side setup).
    async fn release_all(&self, uid: &str, record: &ClaimRecord) -> Result<(), ClaimError> {
        let mut first = None;
        for request in &record.requests {
            let asked = self.request(uid, request);
            if record.by_module {
                if let Err(source) = self.backend.unprepare(asked).await {
                    first.get_or_insert(ClaimError::Unprepare {
                        request: request.request.clone(),
                        source,
                    });
                }
            } else if let Err(e) = self.backend.release(asked).await {
                tracing::warn!(
                    driver = self.driver,
                    claim = uid,
                    request = request.request,
                    "the module's release failed (the claim is unprepared anyway): {e}"
                );
            }
        }
        first.map_or(Ok(()), Err)
    }

    async fn remove_spec(&self, claim: &ClaimRecord) {
        if let Some(path) = claim.spec_file.clone() {
            let _ = tokio::task::spawn_blocking(move || crate::cdi::claim::remove(&path)).await;
        }
    }
}

/// A UUID in its text form, lowercase, as the API server makes `metadata.uid`.
fn is_uid(uid: &str) -> bool {
    let groups: Vec<&str> = uid.split('-').collect();
    groups.len() == 5
        && groups.iter().zip([8, 4, 4, 4, 12]).all(|(g, n)| {
            g.len() == n
                && g.bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        })
}

/// When a call whose work ends at `deadline` (nine tenths of the kubelet's time) is answered:
/// a little after, still within the kubelet's time, so a claim whose lock wait ended at the
/// deadline is answered "busy", not "still running".
fn answer_time(deadline: Instant) -> Instant {
    deadline + deadline.saturating_duration_since(Instant::now()) / 18
}

/// A claim task's answer, or [`ClaimError::StillRunning`] when the call's `deadline` comes
/// first: the task goes on to its end (dropping its handle does not stop it).
async fn answer_by<T>(
    deadline: Instant,
    job: tokio::task::JoinHandle<Result<T, ClaimError>>,
    doing: &'static str,
) -> Result<T, ClaimError> {
    match tokio::time::timeout_at(deadline, job).await {
        Ok(Ok(answer)) => answer,
        Ok(Err(e)) => Err(ClaimError::Task(e.to_string())),
        Err(_) => Err(ClaimError::StillRunning(doing)),
    }
}

/// A claim's UID and request names become a CDI device name (`<uid>-<request>`) and a file name
/// (`devicelet-dra_<driver>_<uid>.json`): one that cannot is refused by name, never prepared
/// with no device. The API server makes UIDs (UUIDs) and checks request names (DNS labels), so
/// only a broken or hostile server sends such a claim.
fn check_names(uid: &str, request: &str) -> Result<(), ClaimError> {
    if !is_uid(uid) || !crate::cdi::spec::is_device_name(uid) {
        return Err(ClaimError::Refused(format!(
            "claim UID {:?} is not a UID as the API server makes them (a UUID); it cannot name a \
             CDI device or a file",
            uid.chars().take(80).collect::<String>()
        )));
    }
    if request.is_empty() || !crate::cdi::spec::is_device_name(&format!("{uid}-{request}")) {
        return Err(ClaimError::Refused(format!(
            "request name {:?} cannot name a CDI device",
            request.chars().take(80).collect::<String>()
        )));
    }
    Ok(())
}

/// What a share consumed, under the module's names for the device's capacities (the API's
/// spelling turns `-` and `.` into `_`), and every capacity the allocation left out counted as
/// the scheduler counts one a claim asks nothing of: its policy's default, else all of it. So
/// neither the module nor the ledger sees a capacity under a name it does not know, and an
/// allocation that omits one cannot hold it for nothing.
fn consumed_by_name(
    device: &crate::device::Device,
    consumed: Vec<(String, String)>,
) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = consumed
        .into_iter()
        .map(|(published, q)| {
            let name = device
                .capacities
                .iter()
                .find(|(n, _)| {
                    *n == published
                        || super::slices::attribute_name(n).as_deref() == Some(&published)
                })
                .map_or(published, |(n, _)| n.clone());
            (name, q)
        })
        .collect();
    for (name, value) in &device.capacities {
        // Only what the slice published: the scheduler never saw a capacity the API refused.
        if out.iter().any(|(n, _)| n == name) || super::slices::attribute_name(name).is_none() {
            continue;
        }
        let default = device.shared.as_ref().and_then(|s| {
            s.policies
                .iter()
                .find(|(n, _)| n == name)
                .and_then(|(_, p)| p.default.clone())
        });
        out.push((name.clone(), default.unwrap_or_else(|| value.clone())));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_share_is_read_under_the_modules_names_and_what_it_omits_counts_whole_or_default() {
        use crate::device::{Device, Health, RequestPolicy, Shared, ValidAmounts};
        let mut d = Device::new("gpu0", Health::Healthy);
        d.capacities = vec![
            ("memory-mib".into(), "80Gi".into()),
            ("threads".into(), "100".into()),
            ("engines".into(), "8".into()),
        ];
        d.shared = Some(Shared {
            policies: vec![(
                "engines".into(),
                RequestPolicy {
                    default: Some("1".into()),
                    valid: ValidAmounts::Any,
                },
            )],
        });
        let consumed = consumed_by_name(&d, vec![("memory_mib".into(), "10Gi".into())]);
        assert_eq!(
            consumed,
            [
                ("memory-mib".to_owned(), "10Gi".to_owned()),
                ("threads".to_owned(), "100".to_owned()),
                ("engines".to_owned(), "1".to_owned()),
            ]
        );
    }

    #[test]
    fn uids_and_requests_that_make_no_cdi_name_are_refused_by_name() {
        const UID: &str = "0b5e6a2c-9d1f-4e2a-8c3b-7f6e5d4c3b2a";
        check_names(UID, "gpu").expect("a real claim");
        for (uid, request, says) in [
            ("", "gpu", "claim UID \"\""),
            ("a/b", "gpu", "claim UID \"a/b\""),
            ("/../../tmp/x", "gpu", "claim UID \"/../../tmp/x\""),
            ("u\n1", "gpu", "claim UID \"u\\n1\""),
            ("0B5E6A2C-9D1F-4E2A-8C3B-7F6E5D4C3B2A", "gpu", "not a UID"),
            ("0b5e6a2c-9d1f-4e2a-8c3b-7f6e5d4c3b2a-0", "gpu", "not a UID"),
            (UID, "../../../x", "request name \"../../../x\""),
            (UID, "", "request name \"\""),
        ] {
            let e = check_names(uid, request).unwrap_err().to_string();
            assert!(e.contains(says), "{uid:?} {request:?}: {e}");
        }
    }
}
