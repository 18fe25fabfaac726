//! The agent's allocation bookkeeping.
//!
//! Every container request of an `Allocate` the kubelet is told succeeded is
//! [recorded](Ledger::record) as an [`Entry`]. Recording only changes memory, under a short lock;
//! [`Ledger::run_writer`] checkpoints atomically to `state_dir/ledger.json` within
//! [`FLUSH_DELAY`], on the blocking pool and outside that lock, so Allocate never waits for a
//! disk. A crash inside that window loses the newest entries from the file, and the next
//! reconciliation adopts them back from the kubelet. The kubelet
//! never says when a container ends (KUBELET.md §9), so the agent periodically asks its
//! PodResources `List` (`kubelet::podresources`, which turns the answer into [`Held`] records) and
//! [reconciles](Ledger::reconcile): entries
//! are attributed to the container holding their devices, entries of ended containers are freed,
//! and allocations the kubelet knows but the ledger lost are adopted. [`Ledger::holders`] then
//! says which pod holds which device, for status output and sharing policies.
//!
//! Layout: `entry` (the records), `state` (the in-memory set and its queries),
//! `checkpoint` (the file format), `reconcile` (the attribution rules), `error`. The ledger names
//! no kubelet wire type: the device-plugin front end converts at its edge.

mod budget;
mod checkpoint;
mod claims;
mod entry;
mod error;
mod journal;
mod reconcile;
mod state;

#[cfg(test)]
mod tests;

use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, SystemTime};

use checkpoint::Store;
use state::State;

pub use budget::Budget;
pub use checkpoint::{FILE_NAME, VERSION, check_file as check_trusted_file};
pub use claims::{ClaimRecord, Conflict, HeldShare, PreparedRequest};
pub use entry::{Entry, Holder};
pub use error::LedgerError;
pub use reconcile::{Held, ReconcileReport};

/// How long a record may wait for its checkpoint; records arriving meanwhile share it.
pub const FLUSH_DELAY: Duration = Duration::from_millis(20);
/// After a failed checkpoint, how long before the writer tries again on its own.
const RETRY_AFTER: Duration = Duration::from_secs(1);
/// The most entries kept. A node runs ~110 pods by default, so reaching this means the kubelet's
/// PodResources has been unreachable while pods came and went: the oldest entries nobody was
/// seen holding go first (they are the likeliest to be over), and are counted.
pub const MAX_ENTRIES: usize = 8192;

/// The allocation ledger. Cheap to clone; clones share one state.
///
/// The state sits behind a short lock that no I/O is ever done under: a checkpoint encodes the
/// state under the lock, then writes and fsyncs outside it. Writers are serialized by a second
/// lock and never write a state older than one already written, so the file always matches a
/// state the ledger was in, and never goes back in time.
#[derive(Debug, Clone)]
pub struct Ledger {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    /// None: in memory only.
    store: Option<Store>,
    state: Mutex<Locked>,
    /// Held for a whole write, so writers take turns; it guards the claims' journal (None for
    /// an in-memory ledger).
    writing: Mutex<Option<journal::Journal>>,
    /// The version last written; read without waiting for a write in progress (status asks).
    written: std::sync::atomic::AtomicU64,
    /// Wakes the writer after a change.
    changed: tokio::sync::Notify,
    /// Bumped whenever a claim takes or gives back devices: the device-plugin front end leaves
    /// claimed devices out of what it advertises.
    claims_changed: tokio::sync::watch::Sender<u64>,
    /// Set by the first change after a write, cleared by the writer as it starts the next one:
    /// a burst of Allocates wakes the writer's thread once, not once per call (each wake is a
    /// system call on Allocate's path).
    wake_pending: std::sync::atomic::AtomicBool,
}

#[derive(Debug, Default)]
struct Locked {
    state: State,
    /// Bumped by every change; the file holds the version in `Inner::written`.
    version: u64,
    /// Entries dropped to stay within [`MAX_ENTRIES`] since the agent started.
    dropped: u64,
    /// Claim changes in neither the journal nor the checkpoint yet, oldest first.
    pending: Vec<journal::Line>,
}

impl Ledger {
    /// Opens (creating it 0700 if missing) `state_dir` and restores `state_dir/ledger.json` if
    /// present. A corrupt checkpoint (unparsable, another version, inconsistent ids) is renamed
    /// aside to `ledger.json.corrupt-<unix millis>`, logged with `tracing::warn!` naming the file
    /// and the reason, and the ledger starts empty; the next reconciliation adopts what the
    /// kubelet still reports. Errors only when the directory or file cannot be accessed.
    pub fn open(state_dir: &Path) -> Result<Ledger, LedgerError> {
        let (store, state, journal) = Store::open(state_dir)?;
        Ok(Ledger::new(Some(store), state, Some(journal)))
    }

    /// A ledger that never touches the disk (for `devicelet demo` and tests).
    pub fn in_memory() -> Ledger {
        Ledger::new(None, State::default(), None)
    }

    fn new(store: Option<Store>, state: State, journal: Option<journal::Journal>) -> Ledger {
        Ledger {
            inner: Arc::new(Inner {
                store,
                state: Mutex::new(Locked {
                    state,
                    ..Locked::default()
                }),
                writing: Mutex::new(journal),
                written: std::sync::atomic::AtomicU64::new(0),
                changed: tokio::sync::Notify::new(),
                claims_changed: tokio::sync::watch::Sender::new(0),
                wake_pending: std::sync::atomic::AtomicBool::new(false),
            }),
        }
    }

    /// The checkpoint file, or None for an in-memory ledger.
    pub fn file(&self) -> Option<&Path> {
        self.inner.store.as_ref().map(Store::file)
    }

    /// Records an allocation of `device_ids` of `resource` in memory and returns the entry's id;
    /// [`run_writer`](Self::run_writer) checkpoints it within [`FLUSH_DELAY`], coalescing
    /// bursts into one write. Older entries give the devices up (see `State::supersede`), so the
    /// ledger stays as small as the devices it names. At [`MAX_ENTRIES`] the oldest entry no container was seen holding
    /// (else the oldest) is dropped and counted in [`dropped`](Self::dropped). An entry the
    /// kubelet never reports is freed by [`reconcile`](Self::reconcile) after its grace.
    ///
    /// A device a DRA claim holds (`resource` served through DRA before, or still answering for
    /// its claims) is refused, in the same step that records: one device is never held through
    /// both front ends.
    pub fn record(&self, resource: &str, device_ids: &[String]) -> Result<u64, Conflict> {
        let ids = self.record_all(resource, std::slice::from_ref(&device_ids.to_vec()))?;
        Ok(ids.first().copied().unwrap_or_default())
    }

    /// [`record`](Self::record) for each container of one `Allocate`: all of them, or (when a
    /// claim holds one of the devices) none.
    pub fn record_all(
        &self,
        resource: &str,
        containers: &[Vec<String>],
    ) -> Result<Vec<u64>, Conflict> {
        let mut locked = self.lock();
        if let Some(conflict) = containers
            .iter()
            .find_map(|ids| locked.state.claims.claim_holding(resource, ids))
        {
            return Err(conflict);
        }
        let mut entry_ids = Vec::with_capacity(containers.len());
        let mut dropped = 0;
        for device_ids in containers {
            locked.state.supersede(resource, device_ids);
            dropped += locked.state.make_room(MAX_ENTRIES - 1);
            let id = locked
                .state
                .push(resource, device_ids.clone(), None, SystemTime::now());
            entry_ids.push(id);
        }
        locked.version += 1;
        if dropped > 0 {
            locked.dropped += dropped;
            let total = locked.dropped;
            drop(locked);
            // At 1, 2, 4, 8, ... drops: said, but not once per Allocate.
            if total.is_power_of_two() {
                tracing::warn!(
                    "the ledger holds {MAX_ENTRIES} entries (is PodResources unreachable?): \
                     dropped the oldest unattributed ones, {total} so far"
                );
            }
        } else {
            drop(locked);
        }
        self.wake_writer();
        Ok(entry_ids)
    }

    /// The first of `device_ids` of `resource` (as the device-plugin front end serves it) a DRA
    /// claim holds: Allocate refuses it before asking the module.
    pub fn claimed_of(&self, resource: &str, device_ids: &[String]) -> Option<Conflict> {
        self.lock().state.claims.claim_holding(resource, device_ids)
    }

    /// Takes the devices `record` asks for to claim `uid`, if no other claim and no container
    /// holds one (admin requests take none): the check and the record are one step under the
    /// ledger's lock, so of several claims racing for a device exactly one gets it. The claim is
    /// reserved, not yet written: [`prepare_claim`](Self::prepare_claim) makes it durable,
    /// [`drop_claim`](Self::drop_claim) gives the devices back.
    pub fn reserve_claim(&self, uid: &str, record: ClaimRecord) -> Result<(), Conflict> {
        self.reserve_claim_within(uid, record, &Budget::default())
    }

    /// [`reserve_claim`](Self::reserve_claim), also checking that the claim's shares and
    /// partitions fit `budget` beside every other claim's, in the same step.
    pub fn reserve_claim_within(
        &self,
        uid: &str,
        record: ClaimRecord,
        budget: &Budget,
    ) -> Result<(), Conflict> {
        let mut locked = self.lock();
        let state = &mut locked.state;
        if state.claims.by_uid.contains_key(uid) {
            return Err(Conflict::Busy {
                uid: uid.to_owned(),
            });
        }
        if let Some(conflict) = state
            .claims
            .conflict(uid, &record)
            .or_else(|| claims::container_holding(&state.entries, &record))
        {
            return Err(conflict);
        }
        budget.check(&state.claims, uid, &record)?;
        state.claims.insert(uid.to_owned(), record, false);
        drop(locked);
        self.claims_moved();
        Ok(())
    }

    /// Tells watchers of [`claims_changed`](Self::claims_changed).
    fn claims_moved(&self) {
        self.inner.claims_changed.send_modify(|n| *n += 1);
    }

    /// Changes whenever claims take or give back devices.
    pub fn claims_changed(&self) -> tokio::sync::watch::Receiver<u64> {
        self.inner.claims_changed.subscribe()
    }

    /// Marks reserved claim `uid` prepared with `record` (its devices unchanged, its answer
    /// filled in); [`persist`](Self::persist) then writes it.
    pub fn prepare_claim(&self, uid: &str, record: ClaimRecord) {
        let mut locked = self.lock();
        locked
            .state
            .claims
            .insert(uid.to_owned(), record.clone(), true);
        self.journal(&mut locked, uid, Some(record));
        drop(locked);
        self.claims_moved();
    }

    /// Queues a claim's change for [`persist`](Self::persist), on a ledger that has a file.
    fn journal(&self, locked: &mut Locked, uid: &str, claim: Option<ClaimRecord>) {
        if self.inner.store.is_some() {
            locked.pending.push(journal::Line {
                uid: uid.to_owned(),
                claim,
            });
        }
    }

    /// Forgets claim `uid`, reserved or prepared, freeing its devices; Some if it was prepared
    /// (then [`persist`](Self::persist) writes its absence).
    pub fn drop_claim(&self, uid: &str) -> Option<ClaimRecord> {
        let mut locked = self.lock();
        let gone = locked.state.claims.remove(uid)?;
        if gone.prepared {
            self.journal(&mut locked, uid, None);
        }
        drop(locked);
        self.claims_moved();
        gone.prepared.then_some(gone.record)
    }

    /// Claim `uid` if it is prepared.
    pub fn claim(&self, uid: &str) -> Option<ClaimRecord> {
        let locked = self.lock();
        let claim = locked.state.claims.by_uid.get(uid)?;
        claim.prepared.then(|| claim.record.clone())
    }

    /// The prepared claims of `driver`, by UID.
    pub fn claims_of(&self, driver: &str) -> Vec<(String, ClaimRecord)> {
        self.lock()
            .state
            .claims
            .by_uid
            .iter()
            .filter(|(_, c)| c.prepared && c.record.driver == driver)
            .map(|(uid, c)| (uid.clone(), c.record.clone()))
            .collect()
    }

    /// How many claims `driver` has prepared.
    pub fn claim_count(&self, driver: &str) -> usize {
        self.lock()
            .state
            .claims
            .by_uid
            .values()
            .filter(|c| c.prepared && c.record.driver == driver)
            .count()
    }

    /// The module IDs of `resource` that DRA claims hold: the device-plugin front end leaves
    /// them out of what it advertises.
    pub fn claimed(&self, resource: &str) -> std::collections::BTreeSet<String> {
        self.lock().state.claims.held_ids(resource)
    }

    /// Takes in claims a driver's checkpoint of an older agent kept (`dra-<driver>.json`), as
    /// prepared, and writes them; refuses them all if one holds a device something else holds.
    pub fn adopt_claims(&self, claims: Vec<(String, ClaimRecord)>) -> Result<(), Conflict> {
        {
            let mut locked = self.lock();
            let state = &mut locked.state;
            let mut next = state.claims.clone();
            for (uid, record) in &claims {
                if let Some(conflict) = next
                    .conflict(uid, record)
                    .or_else(|| claims::container_holding(&state.entries, record))
                {
                    return Err(conflict);
                }
                next.insert(uid.clone(), record.clone(), true);
            }
            state.claims = next;
            for (uid, record) in claims {
                self.journal(&mut locked, &uid, Some(record));
            }
        }
        self.claims_moved();
        Ok(())
    }

    /// Makes every claim change so far durable, and returns once it is: what a DRA prepare or
    /// unprepare waits for before answering. One line per change is appended to the journal
    /// and flushed, whatever the size of the ledger; changes finishing together share one
    /// append. Past [`journal::COMPACT_AFTER`] lines the checkpoint is rewritten instead.
    /// Blocking: call it from the blocking pool. Even with nothing pending it takes the
    /// writers' lock: another caller may have taken this caller's change into an append still
    /// in progress, and only that lock waits for it to be flushed.
    pub fn persist(&self) -> Result<(), LedgerError> {
        let mut writing = self
            .inner
            .writing
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let Some(journal) = writing.as_mut() else {
            return Ok(());
        };
        let lines = std::mem::take(&mut self.lock().pending);
        if lines.is_empty() {
            // Written by whoever held the lock before us, and flushed before they let it go.
            return Ok(());
        }
        if journal.len() + lines.len() > journal::COMPACT_AFTER {
            self.lock().pending.splice(0..0, lines);
            return self.write_locked(&mut writing, true);
        }
        journal.append(&lines).map_err(|e| {
            let path = journal.path().to_owned();
            // Still to be written: the next persist tries again.
            self.lock().pending.splice(0..0, lines);
            LedgerError::io("append to", path, e)
        })
    }

    /// Tells the writer there is something to write, unless it was told already.
    fn wake_writer(&self) {
        if !self
            .inner
            .wake_pending
            .swap(true, std::sync::atomic::Ordering::AcqRel)
        {
            self.inner.changed.notify_one();
        }
    }

    /// Entries dropped to stay within [`MAX_ENTRIES`] since the agent started.
    pub fn dropped(&self) -> u64 {
        self.lock().dropped
    }

    /// Checkpoints changes until `stop` flips, then once more: within [`FLUSH_DELAY`] of a
    /// change, on the blocking pool, retrying a failed write every second. Run it as a task
    /// beside the code calling [`record`](Self::record) and [`reconcile`](Self::reconcile).
    pub async fn run_writer(self, mut stop: tokio::sync::watch::Receiver<bool>) {
        let mut failing = false;
        loop {
            let stopping = tokio::select! {
                _ = self.inner.changed.notified() => false,
                _ = tokio::time::sleep(RETRY_AFTER), if failing => false,
                _ = stop.wait_for(|s| *s) => true,
            };
            if !stopping {
                tokio::time::sleep(FLUSH_DELAY).await;
            }
            // Changes from here on wake us again; the write below covers the ones before.
            self.inner
                .wake_pending
                .store(false, std::sync::atomic::Ordering::Release);
            let ledger = self.clone();
            let written = tokio::task::spawn_blocking(move || ledger.write(false)).await;
            let error = match written {
                Ok(Ok(())) => None,
                Ok(Err(e)) => Some(e.to_string()),
                Err(e) => Some(e.to_string()),
            };
            match error {
                Some(e) if !failing => {
                    tracing::error!("checkpointing the ledger: {e}; retrying every second");
                    failing = true;
                }
                Some(_) => {}
                None if failing => {
                    tracing::info!("the ledger checkpoint is written again");
                    failing = false;
                }
                None => {}
            }
            if stopping {
                return;
            }
        }
    }

    /// Writes the checkpoint now, even if nothing changed (graceful shutdown). Blocking: call it
    /// from `spawn_blocking` on a runtime. A no-op for an in-memory ledger.
    pub fn flush(&self) -> Result<(), LedgerError> {
        self.write(true)
    }

    /// Encodes the state under the state lock, writes and fsyncs outside it.
    fn write(&self, always: bool) -> Result<(), LedgerError> {
        let mut writing = self
            .inner
            .writing
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        self.write_locked(&mut writing, always)
    }

    /// [`write`](Self::write) with the writers' lock held; the journal starts empty after it.
    fn write_locked(
        &self,
        writing: &mut Option<journal::Journal>,
        always: bool,
    ) -> Result<(), LedgerError> {
        let Some(store) = &self.inner.store else {
            return Ok(());
        };
        let written = self
            .inner
            .written
            .load(std::sync::atomic::Ordering::Acquire);
        let (version, bytes, lines) = {
            let mut locked = self.lock();
            if locked.version <= written && locked.pending.is_empty() && !always {
                return Ok(());
            }
            let bytes = store.encode(&locked.state)?;
            // What the journal would have said is in the checkpoint now.
            (locked.version, bytes, std::mem::take(&mut locked.pending))
        };
        if let Err(e) = store.save(&bytes) {
            self.lock().pending.splice(0..0, lines);
            return Err(e);
        }
        self.inner
            .written
            .store(version, std::sync::atomic::Ordering::Release);
        if let Some(journal) = writing.as_mut() {
            journal
                .clear()
                .map_err(|e| LedgerError::io("empty", journal.path().to_owned(), e))?;
        }
        Ok(())
    }

    /// Whether every change is on disk, in the checkpoint or the journal (for tests and
    /// status); never waits for a write.
    pub fn is_written(&self) -> bool {
        let written = self
            .inner
            .written
            .load(std::sync::atomic::Ordering::Acquire);
        let locked = self.lock();
        self.inner.store.is_none() || (locked.version <= written && locked.pending.is_empty())
    }

    /// How many entries it holds, without copying them (metrics ask at every scrape).
    pub fn entry_count(&self) -> usize {
        self.lock().state.entries.len()
    }

    /// All entries, in increasing id (= recording) order.
    pub fn entries(&self) -> Vec<Entry> {
        self.lock().state.entries.clone()
    }

    /// Device id → holder for `resource`, one row per allocated device, sorted by device id.
    /// `None`: allocated, not yet seen in PodResources. Devices not listed are free as far as
    /// the ledger knows. A device named by several entries shows the newest entry's holder.
    pub fn holders(&self, resource: &str) -> Vec<(String, Option<Holder>)> {
        self.lock().state.holders(resource)
    }

    /// Reconciles with the kubelet's PodResources `List` answer in memory; a change reaches the
    /// file through [`run_writer`](Self::run_writer). The full rules are in
    /// `ledger/reconcile.rs`; in short: entries are attributed to the container holding all
    /// their devices; entries no container holds are freed if they had a holder or are at least
    /// `grace` old; devices listed containers hold, of resources for which `ours` returns true,
    /// that no entry covers are adopted as new entries. `ours` keeps other plugins' resources
    /// (GPUs of a vendor plugin, say) out of the ledger; pass e.g.
    /// `&|r| names.iter().any(|n| n == r)`.
    pub fn reconcile(
        &self,
        held: &[Held],
        grace: Duration,
        ours: &dyn Fn(&str) -> bool,
    ) -> ReconcileReport {
        let mut locked = self.lock();
        let report = locked.state.reconcile(held, grace, SystemTime::now(), ours);
        if report.changed() {
            locked.version += 1;
            drop(locked);
            self.wake_writer();
        }
        report
    }

    /// Nothing panics while holding the lock, but a poisoned state is still consistent: every
    /// mutation completes before anything else reads it.
    fn lock(&self) -> MutexGuard<'_, Locked> {
        self.inner
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}
