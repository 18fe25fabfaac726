//! Immediate re-checks when device nodes come and go: inotify on the directories of a module's
//! /dev grants (inside the host root), poking its resources' device watchers. The health
//! interval stays as the safety net (and for sysfs, which sends no inotify events).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use notify::{EventKind, RecommendedWatcher, RecursiveMode, Watcher};
use tokio::sync::Notify;

use crate::config::Grants;

/// The directory a grant pattern's matches live in: its path up to the first glob character
/// (`/dev/ttyUSB*` -> `/dev`, `/dev/net/tun` -> `/dev/net`).
fn watched_dir(pattern: &str) -> Option<&str> {
    let literal = &pattern[..pattern.find(['*', '?', '[']).unwrap_or(pattern.len())];
    literal
        .rsplit_once('/')
        .map(|(dir, _)| dir)
        .filter(|d| !d.is_empty())
}

/// Watches the directories of `grants.dev` under `host_root`; dropping it stops watching.
/// Directories that do not exist are skipped (the poll interval still covers them).
pub fn watch(
    host_root: &Path,
    grants: &Grants,
    pokes: Vec<Arc<Notify>>,
) -> Option<RecommendedWatcher> {
    let dirs: BTreeSet<PathBuf> = grants
        .dev
        .iter()
        .filter_map(|p| watched_dir(p.as_str()))
        .map(|d| host_root.join(d.trim_start_matches('/')))
        .collect();
    if dirs.is_empty() || pokes.is_empty() {
        return None;
    }
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        let relevant = match event {
            Ok(e) => matches!(e.kind, EventKind::Create(_) | EventKind::Remove(_)),
            Err(_) => true,
        };
        if relevant {
            for poke in &pokes {
                poke.notify_one();
            }
        }
    })
    .map_err(|e| tracing::warn!("cannot watch device nodes: {e}; relying on the health interval"))
    .ok()?;
    for dir in &dirs {
        if let Err(e) = watcher.watch(dir, RecursiveMode::NonRecursive) {
            tracing::debug!("not watching {}: {e}", dir.display());
        }
    }
    Some(watcher)
}

#[cfg(test)]
mod tests {
    use super::watched_dir;

    #[test]
    fn a_pattern_is_watched_in_its_literal_directory() {
        assert_eq!(watched_dir("/dev/ttyUSB*"), Some("/dev"));
        assert_eq!(watched_dir("/dev/net/tun"), Some("/dev/net"));
        assert_eq!(watched_dir("/dev/dri/renderD*"), Some("/dev/dri"));
        assert_eq!(watched_dir("/dev/*/by-id"), Some("/dev"));
    }
}
