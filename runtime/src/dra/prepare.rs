//! `NodePrepareResources` and `NodeUnprepareResources` for one driver (one served resource),
//! whatever version of the kubelet's API carried them (`server.rs` converts).
//!
//! Prepare, per claim and serialized per claim UID: a claim already in the checkpoint is answered
//! as before (the kubelet calls again after its own restart); otherwise the claim is fetched
//! from the API server and checked (`claim.rs`), each request's device names are mapped back to
//! the module's IDs in the current snapshot (each must be there and healthy), the module's
//! `allocate` is asked with the request's opaque config and key `<claim UID>/<request>`, the
//! answers go into one CDI spec file for the claim (a CDI device `<claim UID>-<request>` per
//! request), the claim is checkpointed, and only then answered. One claim's failure is its own
//! entry's error; requests already allocated for it are released.
//!
//! A claim already checkpointed whose spec file is gone (CDI specs live on tmpfs, so after a
//! reboot) is prepared again from the checkpoint. A device another prepared claim holds is
//! refused unless the claim has admin access.
//!
//! Unprepare needs only the UID: the checkpoint says what to release and which spec to remove.
//! An unknown UID succeeds (it was never prepared here, or is already unprepared). A module
//! that fails its `release` is logged, never allowed to pin a claim forever; a module's
//! `release` must be idempotent (an unprepare that fails after it is retried).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use tokio::sync::watch;

use super::HeldElsewhere;
use super::api::ApiClient;
use super::checkpoint::{Checkpoint, PreparedClaim, PreparedRequest};
use super::claim;
use super::events::{DraEvent, DraEvents};
use super::units::units;
use crate::device::{ContainerEdits, Request};
use crate::resource::backend::DeviceBackend;
use crate::resource::snapshot::Snapshot;

/// Most claims answered in one call: a pod has far fewer; past it each gets an error.
pub const MAX_CLAIMS_PER_CALL: usize = 256;

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

/// Everything one driver's claims need.
pub struct Claims<B> {
    pub driver: String,
    /// This node's pool (the node's name).
    pub pool: String,
    /// The backend's own name of the resource.
    pub resource: String,
    /// The CDI kind of the claims' specs.
    pub kind: String,
    pub backend: B,
    pub devices: watch::Receiver<Snapshot>,
    pub api: Option<ApiClient>,
    pub cdi_dir: PathBuf,
    pub checkpoint: Arc<Checkpoint>,
    /// Devices containers hold through the device-plugin front end.
    pub held: HeldElsewhere,
    events: DraEvents,
    /// Left the registry: only claims prepared already are answered (`retire.rs`).
    pub(super) retiring: std::sync::atomic::AtomicBool,
    locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

impl<B: DeviceBackend> Claims<B> {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        driver: String,
        pool: String,
        resource: String,
        kind: String,
        backend: B,
        devices: watch::Receiver<Snapshot>,
        api: Option<ApiClient>,
        cdi_dir: PathBuf,
        checkpoint: Checkpoint,
        held: HeldElsewhere,
        events: DraEvents,
    ) -> Claims<B> {
        Claims {
            driver,
            pool,
            resource,
            kind,
            backend,
            devices,
            api,
            cdi_dir,
            checkpoint: Arc::new(checkpoint),
            held,
            events,
            retiring: Default::default(),
            locks: Mutex::default(),
        }
    }

    /// Prepares each claim; the answer has an entry for every UID asked. Each claim runs in
    /// its own task, so a kubelet that gives up on the call (its deadline, a dropped
    /// connection) cannot leave a claim half prepared: allocated but not checkpointed.
    pub async fn prepare(
        self: &Arc<Self>,
        claims: Vec<ClaimRef>,
    ) -> BTreeMap<String, Result<Vec<PreparedDevice>, String>> {
        let mut answers = BTreeMap::new();
        for (i, claim) in claims.into_iter().enumerate() {
            let started = std::time::Instant::now();
            let answer = if i >= MAX_CLAIMS_PER_CALL {
                Err(format!(
                    "more than {MAX_CLAIMS_PER_CALL} claims in one NodePrepareResources call; \
                     this one was not prepared"
                ))
            } else {
                let me = self.clone();
                let job = claim.clone();
                tokio::spawn(async move {
                    let lock = me.lock_for(&job.uid);
                    let answer = {
                        let _held = lock.lock().await;
                        me.prepare_one(&job).await
                    };
                    me.forget_lock(&job.uid, &lock);
                    answer
                })
                .await
                .unwrap_or_else(|e| Err(format!("preparing the claim failed: {e}")))
            };
            if let Err(e) = &answer {
                tracing::warn!(driver = self.driver, claim = claim.uid, "prepare: {e}");
            }
            let (ok, took) = (answer.is_ok(), started.elapsed());
            self.events
                .emit(&self.driver, DraEvent::Prepared { ok, took });
            answers.insert(claim.uid, answer);
        }
        answers
    }

    /// Unprepares each claim by UID, each in its own task like [`prepare`](Self::prepare); the
    /// answer has an entry for every UID asked.
    pub async fn unprepare(
        self: &Arc<Self>,
        uids: Vec<String>,
    ) -> BTreeMap<String, Result<(), String>> {
        let mut answers = BTreeMap::new();
        for uid in uids {
            let started = std::time::Instant::now();
            let (me, job) = (self.clone(), uid.clone());
            let answer = tokio::spawn(async move {
                let lock = me.lock_for(&job);
                let answer = {
                    let _held = lock.lock().await;
                    me.unprepare_one(&job).await
                };
                me.forget_lock(&job, &lock);
                answer
            })
            .await
            .unwrap_or_else(|e| Err(format!("unpreparing the claim failed: {e}")));
            let (ok, took) = (answer.is_ok(), started.elapsed());
            self.events
                .emit(&self.driver, DraEvent::Unprepared { ok, took });
            answers.insert(uid, answer);
        }
        answers
    }

    /// Removes claim specs of this driver that no checkpointed claim names: left by an agent
    /// stopped between writing a spec and checkpointing its claim.
    pub fn remove_stale_specs(&self) {
        let prefix = format!("devicelet-dra_{}_", self.driver);
        let Ok(entries) = std::fs::read_dir(&self.cdi_dir) else {
            return;
        };
        let known = self.checkpoint.uids();
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(uid) = name
                .strip_prefix(&prefix)
                .and_then(|rest| rest.strip_suffix(".json"))
            else {
                continue;
            };
            if !known.iter().any(|k| k == uid) {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }

    fn lock_for(&self, uid: &str) -> Arc<tokio::sync::Mutex<()>> {
        self.locks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(uid.to_owned())
            .or_default()
            .clone()
    }

    fn forget_lock(&self, uid: &str, lock: &Arc<tokio::sync::Mutex<()>>) {
        let mut locks = self.locks.lock().unwrap_or_else(|p| p.into_inner());
        // Only when no one else waits on it.
        if Arc::strong_count(lock) <= 2 {
            locks.remove(uid);
        }
    }

    async fn prepare_one(&self, claim: &ClaimRef) -> Result<Vec<PreparedDevice>, String> {
        if let Some(done) = self.checkpoint.get(&claim.uid) {
            let spec_gone = done.spec_file.as_ref().is_some_and(|f| !f.exists());
            if !spec_gone {
                return Ok(self.devices_of(&done));
            }
            // The node rebooted (CDI specs live on tmpfs) or someone removed it: the module is
            // asked again, as for a new claim, with what the checkpoint kept.
            return self.restore(&claim.uid, done).await;
        }
        if self.retiring.load(std::sync::atomic::Ordering::Relaxed) {
            return Err(format!(
                "DRA driver {} left this node's registry: it only answers for the claims it \
                 prepared before, until they are unprepared",
                self.driver
            ));
        }
        let api = self
            .api
            .as_ref()
            .ok_or("the agent has no API server to read claims from")?;
        let object = api
            .claim(&claim.namespace, &claim.name)
            .await
            .map_err(|e| {
                self.events.emit(&self.driver, DraEvent::ApiError);
                e.to_string()
            })?;
        let wanted = claim::wanted(&object, &claim.uid, &self.driver, &self.pool)?;
        let mut requests = Vec::with_capacity(wanted.len());
        let mut answers: BTreeMap<String, Arc<ContainerEdits>> = BTreeMap::new();
        for want in wanted {
            let devices = match self
                .ids_of(&want.devices)
                .and_then(|d| self.not_held(&claim.uid, &d, want.admin).map(|()| d))
            {
                Ok(devices) => devices,
                Err(e) => {
                    self.release_all(&claim.uid, &requests).await;
                    return Err(e);
                }
            };
            let request = Request {
                resource: self.resource.clone(),
                ids: devices.iter().map(|(_, id)| id.clone()).collect(),
                config: want.config.clone(),
                key: format!("{}/{}", claim.uid, want.request),
            };
            let edits = match self.backend.allocate_request(request).await {
                Ok(edits) => edits,
                Err(e) => {
                    self.release_all(&claim.uid, &requests).await;
                    return Err(format!("request {:?}: {e}", want.request));
                }
            };
            let cdi_ids = edits.cdi_devices.clone();
            answers.insert(format!("{}-{}", claim.uid, want.request), Arc::new(edits));
            requests.push(PreparedRequest {
                request: want.request,
                devices,
                config: want.config,
                cdi_ids,
            });
        }
        self.finish(claim, requests, answers).await
    }

    /// Writes the claim's spec and checkpoints it; on failure releases what was allocated.
    async fn finish(
        &self,
        claim: &ClaimRef,
        mut requests: Vec<PreparedRequest>,
        answers: BTreeMap<String, Arc<ContainerEdits>>,
    ) -> Result<Vec<PreparedDevice>, String> {
        let (spec_file, in_spec) = match self.write_spec(&claim.uid, &answers).await {
            Ok(written) => written,
            Err(e) => {
                self.release_all(&claim.uid, &requests).await;
                return Err(e);
            }
        };
        // A request whose answer holds something a spec carries gets its CDI device first.
        for request in &mut requests {
            let name = format!("{}-{}", claim.uid, request.request);
            let id = format!("{}={name}", self.kind);
            if in_spec.contains(&name) && !request.cdi_ids.contains(&id) {
                request.cdi_ids.insert(0, id);
            }
        }
        let prepared = PreparedClaim {
            namespace: claim.namespace.clone(),
            name: claim.name.clone(),
            requests,
            spec_file,
        };
        let (checkpoint, uid, record) =
            (self.checkpoint.clone(), claim.uid.clone(), prepared.clone());
        let recorded = tokio::task::spawn_blocking(move || checkpoint.insert(&uid, record))
            .await
            .unwrap_or_else(|e| Err(e.to_string()));
        if let Err(e) = recorded {
            self.remove_spec(&prepared).await;
            self.release_all(&claim.uid, &prepared.requests).await;
            return Err(e);
        }
        Ok(self.devices_of(&prepared))
    }

    /// A checkpointed claim whose spec is gone, prepared again from what the checkpoint kept.
    async fn restore(&self, uid: &str, done: PreparedClaim) -> Result<Vec<PreparedDevice>, String> {
        let mut answers = BTreeMap::new();
        for request in &done.requests {
            let ask = Request {
                resource: self.resource.clone(),
                ids: request.devices.iter().map(|(_, id)| id.clone()).collect(),
                config: request.config.clone(),
                key: format!("{uid}/{}", request.request),
            };
            let edits = self
                .backend
                .allocate_request(ask)
                .await
                .map_err(|e| format!("request {:?}, prepared again: {e}", request.request))?;
            answers.insert(format!("{uid}-{}", request.request), Arc::new(edits));
        }
        let claim = ClaimRef {
            namespace: done.namespace.clone(),
            name: done.name.clone(),
            uid: uid.to_owned(),
        };
        self.finish(&claim, done.requests, answers).await
    }

    /// Refuses devices another prepared claim holds, unless this one has admin access.
    fn not_held(&self, uid: &str, devices: &[(String, String)], admin: bool) -> Result<(), String> {
        if admin {
            return Ok(());
        }
        for (name, id) in devices {
            if let Some((other, held)) = self.checkpoint.holder_of(id, uid) {
                return Err(format!(
                    "device {name:?} is already prepared for ResourceClaim {}/{} (UID {other})",
                    held.namespace, held.name
                ));
            }
        }
        Ok(())
    }

    async fn unprepare_one(&self, uid: &str) -> Result<(), String> {
        let Some(prepared) = self.checkpoint.get(uid) else {
            return Ok(());
        };
        self.release_all(uid, &prepared.requests).await;
        self.remove_spec(&prepared).await;
        let (checkpoint, uid) = (self.checkpoint.clone(), uid.to_owned());
        tokio::task::spawn_blocking(move || checkpoint.remove(&uid))
            .await
            .unwrap_or_else(|e| Err(e.to_string()))?;
        Ok(())
    }

    /// What the kubelet is told for a prepared claim: each device (a group's members once,
    /// under its name), the request's CDI IDs on the first device of the request (the answer
    /// covers the request as a whole).
    fn devices_of(&self, claim: &PreparedClaim) -> Vec<PreparedDevice> {
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

    /// (name, module ID) of each device name's members (a group's every device), from the
    /// current snapshot; each must be published: healthy, and held by no device-plugin
    /// container.
    fn ids_of(&self, names: &[String]) -> Result<Vec<(String, String)>, String> {
        let snapshot = self.devices.borrow().clone();
        let held = (self.held)();
        let units = units(&snapshot);
        let mut out = Vec::new();
        for name in names {
            let unit = units
                .iter()
                .find(|u| u.name == *name)
                .ok_or_else(|| format!("device {name:?} is not one this driver publishes"))?;
            if let Some(why) = unit.reason() {
                return Err(format!("device {name:?} is unhealthy: {why}"));
            }
            if unit.members.iter().any(|d| held.contains(&d.id)) {
                return Err(format!(
                    "device {name:?} is still held by a container the device-plugin front end \
                     allocated it to; it joins the pool when that container ends"
                ));
            }
            out.extend(unit.members.iter().map(|d| (name.clone(), d.id.clone())));
        }
        Ok(out)
    }

    async fn release_all(&self, uid: &str, requests: &[PreparedRequest]) {
        for request in requests {
            let release = Request {
                resource: self.resource.clone(),
                ids: request.devices.iter().map(|(_, id)| id.clone()).collect(),
                config: request.config.clone(),
                key: format!("{uid}/{}", request.request),
            };
            if let Err(e) = self.backend.release(release).await {
                tracing::warn!(
                    driver = self.driver,
                    claim = uid,
                    request = request.request,
                    "the module's release failed (the claim is unprepared anyway): {e}"
                );
            }
        }
    }

    /// The claim's spec file, `<cdi dir>/devicelet-dra_<driver>_<uid>.json`, and the CDI device
    /// names in it; None when no request needs one.
    async fn write_spec(
        &self,
        uid: &str,
        answers: &BTreeMap<String, Arc<ContainerEdits>>,
    ) -> Result<(Option<PathBuf>, BTreeSet<String>), String> {
        let Some((spec, _)) = crate::cdi::build(&self.kind, answers) else {
            return Ok((None, BTreeSet::new()));
        };
        let names = spec.devices.iter().map(|d| d.name.clone()).collect();
        let bytes = serde_json::to_vec_pretty(&spec).map_err(|e| e.to_string())?;
        let path = self
            .cdi_dir
            .join(format!("devicelet-dra_{}_{uid}.json", self.driver));
        let (dir, name) = (self.cdi_dir.clone(), path.clone());
        tokio::task::spawn_blocking(move || {
            std::fs::create_dir_all(&dir)?;
            // As for the device-plugin front end's specs: a directory others can write is one
            // where they could change what a runtime applies.
            crate::trust::check_dir(&dir).map_err(|e| {
                std::io::Error::other(format!(
                    "the directory cannot be trusted: {e} ({})",
                    e.fix()
                ))
            })?;
            crate::files::write_file_atomically(&name, &bytes, 0o644)
        })
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| format!("writing the claim's CDI spec {}: {e}", path.display()))?;
        Ok((Some(path), names))
    }

    async fn remove_spec(&self, claim: &PreparedClaim) {
        if let Some(path) = claim.spec_file.clone() {
            let _ = tokio::task::spawn_blocking(move || match std::fs::remove_file(&path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    tracing::warn!("removing the claim's CDI spec {}: {e}", path.display())
                }
                _ => {}
            })
            .await;
        }
    }
}
