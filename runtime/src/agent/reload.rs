//! Hot reload: an edit of the registry file, or a replaced `.wasm`, adds, removes or upgrades
//! modules without a restart. Untouched modules keep serving (their ListAndWatch streams stay
//! open); a broken registry is refused with a clear error and the running set keeps serving.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use notify::{RecommendedWatcher, RecursiveMode, Watcher};
use tokio::sync::{mpsc, watch};

use super::Shared;
use crate::config::{ModuleSpec, Registry};
use crate::digest::sha256_hex;

/// Editors save in several steps (write a temp file, rename): wait for quiet before reloading.
const SETTLE: Duration = Duration::from_millis(150);

/// inotify on the directories holding the registry and the module files.
pub struct RegistryWatch {
    watcher: RecommendedWatcher,
    dirs: BTreeSet<PathBuf>,
    /// The registry and module files now followed; the watcher's callback reads it.
    files: Arc<Mutex<BTreeSet<PathBuf>>>,
    events: mpsc::UnboundedReceiver<()>,
}

/// Whether a directory event concerns us: it names the registry or a module file, or a
/// Kubernetes ConfigMap volume's `..data` link (or the `..<timestamp>` directory behind it),
/// which is how a ConfigMap update arrives. Anything else written beside them (a log file, an
/// editor's swap file) is not a reason to reload.
fn concerns(event: &notify::Event, files: &BTreeSet<PathBuf>) -> bool {
    if matches!(event.kind, notify::EventKind::Access(_)) {
        return false;
    }
    event.paths.iter().any(|p| {
        files.contains(p)
            || p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(".."))
    })
}

/// The files whose change matters: the registry and every module's `.wasm`.
fn files_of(registry: &Registry) -> BTreeSet<PathBuf> {
    std::iter::once(registry.file.clone())
        // A module from a registry has no file of its own to follow: its digest is its entry's.
        .chain(
            registry
                .modules
                .iter()
                .filter(|m| m.source.is_none())
                .map(|m| m.path.clone()),
        )
        .map(|p| std::path::absolute(&p).unwrap_or(p))
        .collect()
}

impl RegistryWatch {
    pub fn new(registry: &Registry) -> notify::Result<RegistryWatch> {
        let (tx, events) = mpsc::unbounded_channel();
        let files = Arc::new(Mutex::new(BTreeSet::new()));
        let followed = files.clone();
        let watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
            let hit = match event {
                Ok(e) => concerns(&e, &followed.lock().unwrap_or_else(|p| p.into_inner())),
                // Events were lost: a reload is cheap and idempotent.
                Err(_) => true,
            };
            if hit {
                let _ = tx.send(());
            }
        })?;
        let mut watch = RegistryWatch {
            watcher,
            dirs: BTreeSet::new(),
            files,
            events,
        };
        watch.follow(registry);
        Ok(watch)
    }

    /// Watches the directories of `registry`'s files (and only those).
    fn follow(&mut self, registry: &Registry) {
        let files = files_of(registry);
        *self.files.lock().unwrap_or_else(|p| p.into_inner()) = files.clone();
        let dirs: BTreeSet<PathBuf> = files
            .iter()
            .filter_map(|f| f.parent().map(Path::to_owned))
            .collect();
        for gone in self.dirs.difference(&dirs) {
            let _ = self.watcher.unwatch(gone);
        }
        for new in dirs.difference(&self.dirs) {
            if let Err(e) = self.watcher.watch(new, RecursiveMode::NonRecursive) {
                tracing::warn!("cannot watch {} for changes: {e}", new.display());
            }
        }
        self.dirs = dirs;
    }

    /// The next change, after it settled; None once the watcher is gone.
    async fn changed(&mut self) -> Option<()> {
        self.events.recv().await?;
        loop {
            tokio::select! {
                more = self.events.recv() => more?,
                _ = tokio::time::sleep(SETTLE) => return Some(()),
            }
        }
    }
}

pub async fn run(
    shared: Arc<Shared>,
    mut current: Registry,
    mut watch: RegistryWatch,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        tokio::select! {
            changed = watch.changed() => if changed.is_none() { return },
            _ = stop.wait_for(|s| *s) => return,
        }
        shared
            .reloads
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        // File reads stay off the agent's shared workers.
        let file = current.file.clone();
        let loaded = tokio::task::spawn_blocking(move || {
            let next = Registry::load(&file)?;
            // A module from a registry has no file: its entry's digest says it all.
            let digests: Vec<Option<String>> = next
                .modules
                .iter()
                .map(|m| m.source.is_none().then(|| file_digest(&m.path)).flatten())
                .collect();
            Ok::<_, crate::config::RegistryError>((next, digests))
        })
        .await;
        let loaded = match loaded {
            Ok(loaded) => loaded,
            Err(e) => {
                tracing::error!("reading the registry failed: {e}");
                continue;
            }
        };
        let (next, digests) = match loaded {
            Ok(pair) => pair,
            Err(e) => {
                shared.metrics.reloaded(false);
                let running = shared.lock_modules().len();
                tracing::error!(
                    "registry edit refused: {e}; still serving the previous {running} module(s)"
                );
                *shared
                    .reload_error
                    .lock()
                    .unwrap_or_else(|p| p.into_inner()) = Some(e.to_string());
                continue;
            }
        };
        *shared
            .reload_error
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = None;
        apply(&shared, &current, &next, &digests).await;
        shared.metrics.reloaded(true);
        watch.follow(&next);
        current = next;
    }
}

fn file_digest(path: &Path) -> Option<String> {
    Some(sha256_hex(
        &crate::files::read_regular(path, crate::files::MAX_MODULE).ok()?,
    ))
}

/// Whether a running module must be restarted to match its new registry entry and file.
fn needs_restart(
    running: &super::modules::RunningModule,
    new: &ModuleSpec,
    digest: Option<&str>,
) -> bool {
    // A module from a registry is pinned by the digest in its entry: the entry says it all.
    running.spec != *new || (new.source.is_none() && digest != Some(running.handle().digest()))
}

/// `digests` are the new modules' file digests, hashed before any lock is taken: status and
/// resource listings must not wait on file reads. Modules that left are stopped here; the ones
/// to start or upgrade each start in a task of their own (`Shared::start_for_edit`), so this
/// returns without waiting on any load or compile: the next edit is never held up by a slow one.
async fn apply(shared: &Arc<Shared>, old: &Registry, new: &Registry, digests: &[Option<String>]) {
    let root_changed = old.host_root != new.host_root;
    // Under the claim, so that a background pull's start either finished (and its module is
    // seen here) or will see its entry gone.
    let claim = shared.claiming.lock().await;
    // A pull for an entry that changed or left goes; the new entry's starts below.
    shared.drop_pending_unless(|spec| !root_changed && new.modules.contains(spec));
    for module in &old.modules {
        if !new.modules.iter().any(|m| m.name == module.name) {
            shared.clear_pull_error(&module.name);
        }
    }
    // A start under way that this edit no longer wants (its entry changed, went, or went back
    // to what runs) is never installed, and what it would report is not kept.
    shared.keep_edit_starts(|name| {
        new.modules
            .iter()
            .zip(digests)
            .find(|(s, _)| s.name == name)
            .map(|(s, digest)| (s, new.host_root.as_path(), digest.as_deref()))
    });
    let (removed, to_start): (Vec<String>, Vec<(ModuleSpec, Option<String>)>) = {
        let running = shared.lock_modules();
        let removed = running
            .keys()
            .filter(|name| !new.modules.iter().any(|s| &&s.name == name))
            .cloned()
            .collect();
        let start = new
            .modules
            .iter()
            .zip(digests)
            .filter(|(s, digest)| {
                running
                    .get(&s.name)
                    .is_none_or(|m| root_changed || needs_restart(m, s, digest.as_deref()))
            })
            .filter(|(s, digest)| !shared.starting_already(s, &new.host_root, digest.as_deref()))
            .map(|(s, digest)| (s.clone(), digest.clone()))
            .collect();
        (removed, start)
    };
    for name in &removed {
        tracing::info!(module = name, "removed from the registry; stopping");
        shared.stop_module(name, true).await;
    }
    drop(claim);
    for (spec, digest) in &to_start {
        shared.start_for_edit(spec.clone(), new.host_root.clone(), digest.clone());
    }
    tracing::info!(
        removed = removed.len(),
        starting = to_start.len(),
        "registry edit applied; modules start on their own"
    );
}
