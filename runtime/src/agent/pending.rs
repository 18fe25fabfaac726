//! Modules waiting for a pull from an OCI registry. A module whose pinned artifact is not in
//! the store is *pending*: it is pulled in a task of its own, tried again with backoff, while
//! every other module starts and serves. Once the pull lands it starts (or, for a digest
//! change, upgrades in place); an artifact that can never load (not the wasm layout, an
//! import beyond the grants) ends the wait as that module's load error.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::Shared;
use crate::backoff::Backoff;
use crate::config::ModuleSpec;
use crate::oci::pull::PullError;

/// The waits between tries: from the first failure's to the kubelet's own image-pull cap.
const FIRST_RETRY: Duration = Duration::from_secs(2);
const MAX_RETRY: Duration = Duration::from_secs(300);

/// A pull under way, in `Shared::pending` by module name.
pub(super) struct Pending {
    pub spec: ModuleSpec,
    since: Instant,
    attempts: u32,
    last_error: Option<String>,
    next_attempt: Option<Instant>,
    task: tokio::task::AbortHandle,
}

impl Pending {
    /// Whether the task running now is this entry's pull.
    fn is_current(&self) -> bool {
        tokio::task::try_id() == Some(self.task.id())
    }
}

/// A pending module, as `devicelet status` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PendingStatus {
    pub module: String,
    /// What is being pulled (`oci://…@sha256:…`).
    pub source: String,
    /// Whether an earlier version of the module serves meanwhile (a digest change).
    pub running: bool,
    pub waiting_ms: u64,
    /// Pulls tried and failed so far, the last one's error, and when the next one starts.
    pub attempts: u32,
    pub last_error: Option<String>,
    pub next_attempt_in_ms: Option<u64>,
}

impl Shared {
    fn lock_pending(
        &self,
    ) -> std::sync::MutexGuard<'_, std::collections::BTreeMap<String, Pending>> {
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Pulls `spec`'s module in the background and starts it once it is in the store. A pull
    /// of the same registry entry under way goes on; one of another entry is dropped for it.
    pub(super) fn pend(self: &Arc<Self>, spec: &ModuleSpec, host_root: &Path) {
        let mut pending = self.lock_pending();
        // Checked under the lock shutdown drops every pull under: nothing starts after it.
        if self.stopping.load(std::sync::atomic::Ordering::Relaxed) {
            return;
        }
        if pending
            .get(&spec.name)
            .is_some_and(|p| p.spec == *spec && !p.task.is_finished())
        {
            return;
        }
        // A new try: what the last one said is no longer the module's error.
        self.clear_pull_error(&spec.name);
        let source = spec.source.as_ref().map(|s| s.to_string());
        tracing::info!(
            module = spec.name,
            source,
            "pulling the module in the background"
        );
        // Spawned under the lock: the task's first look at its entry waits for the entry.
        let task = tokio::spawn(pull_then_start(
            self.clone(),
            spec.clone(),
            host_root.to_owned(),
        ));
        let replaced = pending.insert(
            spec.name.clone(),
            Pending {
                spec: spec.clone(),
                since: Instant::now(),
                attempts: 0,
                last_error: None,
                next_attempt: None,
                task: task.abort_handle(),
            },
        );
        if let Some(old) = replaced {
            old.task.abort();
        }
    }

    /// Drops the pulls whose registry entry `keep` does not accept (the entry changed or left
    /// the registry, or the agent stops).
    pub(super) fn drop_pending_unless(&self, keep: impl Fn(&ModuleSpec) -> bool) {
        self.lock_pending().retain(|_, p| {
            let kept = keep(&p.spec);
            if !kept {
                p.task.abort();
            }
            kept
        });
    }

    /// Takes `spec`'s entry out of the pending set, if it is that registry entry's: whoever
    /// takes it starts the module (a start from the store, with the artifact there already),
    /// and its pull, with nothing left to do, ends. False when there was none.
    pub(super) fn take_pending(&self, spec: &ModuleSpec) -> bool {
        let mut pending = self.lock_pending();
        if !pending.get(&spec.name).is_some_and(|p| p.spec == *spec) {
            return false;
        }
        if let Some(p) = pending.remove(&spec.name)
            && !p.is_current()
        {
            p.task.abort();
        }
        true
    }

    /// Takes `spec`'s entry if the task calling is its pull: false when the entry was replaced
    /// (another registry entry, or a fresh pull of this one) or taken by a start from the store.
    pub(super) fn take_own_pending(&self, spec: &ModuleSpec) -> bool {
        let mut pending = self.lock_pending();
        if pending
            .get(&spec.name)
            .is_some_and(|p| p.spec == *spec && p.is_current())
        {
            pending.remove(&spec.name);
            true
        } else {
            false
        }
    }

    /// Whether `spec`'s entry still waits for the pull calling.
    fn own_pending(&self, spec: &ModuleSpec) -> bool {
        self.lock_pending()
            .get(&spec.name)
            .is_some_and(|p| p.spec == *spec && p.is_current())
    }

    /// Records what a background pull or start reported for `module`: shown with the load
    /// errors until the module is tried again, started, or leaves the registry.
    fn set_pull_error(&self, module: &str, errors: Vec<String>) {
        let mut all = self.pull_errors.lock().unwrap_or_else(|p| p.into_inner());
        if errors.is_empty() {
            all.remove(module);
        } else {
            all.insert(module.to_owned(), errors);
        }
    }

    pub(super) fn clear_pull_error(&self, module: &str) {
        self.set_pull_error(module, Vec::new());
    }

    pub(super) fn pending_status(&self) -> Vec<PendingStatus> {
        let running = self.lock_modules().keys().cloned().collect::<Vec<_>>();
        let now = Instant::now();
        self.lock_pending()
            .values()
            .map(|p| PendingStatus {
                module: p.spec.name.clone(),
                source: p
                    .spec
                    .source
                    .as_ref()
                    .map(|s| s.to_string())
                    .unwrap_or_default(),
                running: running.contains(&p.spec.name),
                waiting_ms: now.duration_since(p.since).as_millis() as u64,
                attempts: p.attempts,
                last_error: p.last_error.clone(),
                next_attempt_in_ms: p
                    .next_attempt
                    .map(|at| at.saturating_duration_since(now).as_millis() as u64),
            })
            .collect()
    }

    /// Records a failed try on `spec`'s entry, if it is still pending.
    fn pull_failed(&self, spec: &ModuleSpec, error: &str, retry_in: Duration) {
        if let Some(p) = self
            .lock_pending()
            .get_mut(&spec.name)
            .filter(|p| p.spec == *spec)
        {
            p.attempts += 1;
            p.last_error = Some(error.to_owned());
            p.next_attempt = Some(Instant::now() + retry_in);
        }
    }
}

async fn pull_then_start(shared: Arc<Shared>, spec: ModuleSpec, host_root: std::path::PathBuf) {
    let (Some(fetcher), Some(source)) = (shared.fetcher.clone(), spec.source.clone()) else {
        return;
    };
    let mut backoff = Backoff::new(FIRST_RETRY, MAX_RETRY);
    loop {
        // An entry replaced, removed or started from elsewhere has no more use for this pull.
        if !shared.own_pending(&spec) {
            return;
        }
        match fetcher.pull(&source, &spec).await {
            Ok(_) => {}
            Err(PullError::Refused(why)) => {
                shared.metrics.pulled(&spec.name, "refused");
                if !shared.take_own_pending(&spec) {
                    return;
                }
                let serving = shared.lock_modules().contains_key(&spec.name);
                let error = format!(
                    "module `{}`: pulling {source}: {why}{}",
                    spec.name,
                    if serving {
                        "; the running version keeps serving"
                    } else {
                        ""
                    }
                );
                tracing::error!("{error}");
                shared.set_pull_error(&spec.name, vec![error]);
                return;
            }
            Err(PullError::Failed(why)) => {
                shared.metrics.pulled(&spec.name, "failed");
                let wait = backoff.failed();
                tracing::warn!(
                    module = spec.name,
                    %source,
                    retry_in = ?wait,
                    "pulling the module failed: {why}"
                );
                shared.pull_failed(&spec, &why, wait);
                tokio::time::sleep(wait).await;
                continue;
            }
        }
        shared.metrics.pulled(&spec.name, "ok");
        tracing::info!(module = spec.name, %source, "pulled; starting it");
        let errors = {
            // Counted as a start under way: readiness waits for it, as for any start.
            let _starting = super::Starting::new(&shared.starting);
            Box::pin(shared.start_module_if(&spec, &host_root, super::Over::Pending(&spec))).await
        };
        for e in &errors {
            tracing::error!("{e}");
        }
        if !errors.is_empty() {
            // A start that failed ends the wait too: its errors are the module's load errors.
            shared.take_own_pending(&spec);
            shared.set_pull_error(&spec.name, errors);
            return;
        }
        // Still ours: the start found no artifact in the store after all (it was removed
        // meanwhile), so pull again; otherwise the module started, or another pull took over.
        if !shared.own_pending(&spec) {
            return;
        }
        let wait = backoff.failed();
        shared.pull_failed(&spec, "the pulled artifact left the module store", wait);
        tokio::time::sleep(wait).await;
    }
}
