//! The agent's allocation bookkeeping.
//!
//! Every `Allocate` the agent answers is [recorded](Ledger::record) as an [`Entry`] and
//! checkpointed atomically to `state_dir/ledger.json` before the answer goes out. The kubelet
//! never says when a container ends (KUBELET.md §9), so the agent periodically asks its
//! PodResources `List` ([`podresources::list_pods`]) and [reconciles](Ledger::reconcile): entries
//! are attributed to the container holding their devices, entries of ended containers are freed,
//! and allocations the kubelet knows but the ledger lost are adopted. [`Ledger::holders`] then
//! says which pod holds which device, for status output and sharing policies.
//!
//! Layout: `entry` (the records), `state` (the in-memory set and its queries),
//! `checkpoint` (the file format and atomic writes), `reconcile` (the `List` semantics),
//! [`podresources`] (the client), `error`.

mod checkpoint;
mod entry;
mod error;
pub mod podresources;
mod reconcile;
mod state;

#[cfg(test)]
mod tests;

use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, SystemTime};

use crate::kubelet::api::podresources::ListPodResourcesResponse;
use checkpoint::Store;
use state::State;

pub use checkpoint::{FILE_NAME, VERSION};
pub use entry::{Entry, Holder};
pub use error::LedgerError;
pub use reconcile::ReconcileReport;

/// How long a deferred record may wait for its checkpoint; records arriving meanwhile share it.
pub const FLUSH_DELAY: Duration = Duration::from_millis(20);

/// The allocation ledger. Cheap to clone; clones share one state.
///
/// Methods take a short lock and, for a persistent ledger, do their checkpoint (a few small
/// synchronous writes and fsyncs) under it, so concurrent writers are serialized and the file
/// always matches a state the ledger was in.
#[derive(Debug, Clone)]
pub struct Ledger {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    /// None: in memory only.
    store: Option<Store>,
    state: Mutex<Locked>,
    /// Wakes the flusher after a deferred record.
    changed: tokio::sync::Notify,
}

#[derive(Debug, Default)]
struct Locked {
    state: State,
    /// A change not yet checkpointed because a write failed; the next write retries.
    dirty: bool,
}

impl Ledger {
    /// Opens (creating it 0700 if missing) `state_dir` and restores `state_dir/ledger.json` if
    /// present. A corrupt checkpoint (unparsable, another version, inconsistent ids) is renamed
    /// aside to `ledger.json.corrupt-<unix millis>`, logged with `tracing::warn!` naming the file
    /// and the reason, and the ledger starts empty; the next reconciliation adopts what the
    /// kubelet still reports. Errors only when the directory or file cannot be accessed.
    pub fn open(state_dir: &Path) -> Result<Ledger, LedgerError> {
        let (store, state) = Store::open(state_dir)?;
        Ok(Ledger::new(Some(store), state))
    }

    /// A ledger that never touches the disk (for `devicelet demo` and tests).
    pub fn in_memory() -> Ledger {
        Ledger::new(None, State::default())
    }

    fn new(store: Option<Store>, state: State) -> Ledger {
        let state = Mutex::new(Locked {
            state,
            dirty: false,
        });
        Ledger {
            inner: Arc::new(Inner {
                store,
                state,
                changed: tokio::sync::Notify::new(),
            }),
        }
    }

    /// The checkpoint file, or None for an in-memory ledger.
    pub fn file(&self) -> Option<&Path> {
        self.inner.store.as_ref().map(Store::file)
    }

    /// Records an allocation of `device_ids` of `resource` and checkpoints it before returning.
    /// Returns the entry's id.
    ///
    /// If the checkpoint cannot be written the entry is still kept in memory (the container
    /// gets its devices either way; a later write retries) and the error is returned. An entry
    /// the kubelet never reports is freed by [`reconcile`](Self::reconcile) after `grace`.
    pub fn record(&self, resource: &str, device_ids: &[String]) -> Result<u64, LedgerError> {
        let mut locked = self.lock();
        let id = locked
            .state
            .push(resource, device_ids.to_vec(), None, SystemTime::now());
        self.checkpoint(&mut locked)?;
        Ok(id)
    }

    /// Records an allocation in memory and leaves the checkpoint to [`Ledger::run_flusher`],
    /// which writes within [`FLUSH_DELAY`] and coalesces bursts into one write. This keeps the
    /// fsync off Allocate's path: a crash inside that window loses the entry from the file, and
    /// the next PodResources reconciliation adopts it again.
    pub fn record_deferred(&self, resource: &str, device_ids: &[String]) -> u64 {
        let mut locked = self.lock();
        let id = locked
            .state
            .push(resource, device_ids.to_vec(), None, SystemTime::now());
        locked.dirty = true;
        drop(locked);
        self.inner.changed.notify_one();
        id
    }

    /// Writes deferred records until `stop` flips, then once more. For a persistent ledger, run
    /// it as a task next to the code calling [`Ledger::record_deferred`].
    pub async fn run_flusher(self, mut stop: tokio::sync::watch::Receiver<bool>) {
        loop {
            let stopping = tokio::select! {
                _ = self.inner.changed.notified() => false,
                _ = stop.wait_for(|s| *s) => true,
            };
            if !stopping {
                tokio::time::sleep(FLUSH_DELAY).await;
            }
            let ledger = self.clone();
            let written = tokio::task::spawn_blocking(move || ledger.flush_if_dirty()).await;
            match written {
                Ok(Err(e)) => tracing::error!("checkpointing the ledger: {e}"),
                Err(e) => tracing::error!("checkpointing the ledger: {e}"),
                Ok(Ok(())) => {}
            }
            if stopping {
                return;
            }
        }
    }

    fn flush_if_dirty(&self) -> Result<(), LedgerError> {
        let mut locked = self.lock();
        if locked.dirty {
            self.checkpoint(&mut locked)
        } else {
            Ok(())
        }
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

    /// Reconciles with the kubelet's PodResources `List` answer and checkpoints if anything
    /// changed. The full rules are in `ledger/reconcile.rs`; in short: entries are attributed
    /// to the container holding all their devices; entries no container holds are freed if they
    /// had a holder or are at least `grace` old; devices listed containers hold, of resources
    /// for which `ours` returns true, that no entry covers are adopted as new entries. `ours`
    /// keeps other plugins' resources (GPUs of a vendor plugin, say) out of the ledger; pass
    /// e.g. `&|r| names.iter().any(|n| n == r)`.
    ///
    /// If the checkpoint fails the in-memory ledger is still updated (and the error returned).
    pub fn reconcile(
        &self,
        pods: &ListPodResourcesResponse,
        grace: Duration,
        ours: &dyn Fn(&str) -> bool,
    ) -> Result<ReconcileReport, LedgerError> {
        let mut locked = self.lock();
        let report = locked.state.reconcile(pods, grace, SystemTime::now(), ours);
        if report.changed() || locked.dirty {
            self.checkpoint(&mut locked)?;
        }
        Ok(report)
    }

    /// Writes the checkpoint now (graceful shutdown). A no-op for an in-memory ledger.
    pub fn flush(&self) -> Result<(), LedgerError> {
        let mut locked = self.lock();
        self.checkpoint(&mut locked)
    }

    fn checkpoint(&self, locked: &mut Locked) -> Result<(), LedgerError> {
        let Some(store) = &self.inner.store else {
            return Ok(());
        };
        match store.save(&locked.state) {
            Ok(()) => {
                locked.dirty = false;
                Ok(())
            }
            Err(e) => {
                locked.dirty = true;
                Err(e)
            }
        }
    }

    /// Nothing panics while holding the lock, but a poisoned state is still consistent: every
    /// mutation completes before any I/O.
    fn lock(&self) -> MutexGuard<'_, Locked> {
        self.inner
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}
