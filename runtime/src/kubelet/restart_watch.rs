//! Noticing a kubelet restart at once: inotify on the device-plugin directory.
//!
//! A restarting kubelet deletes every socket in the directory, ours included, then creates
//! `kubelet.sock` again. Each creation or removal in the directory bumps a counter; every
//! resource's lifecycle task wakes on it and checks whether it must serve and register again.

use std::path::Path;

use notify::{EventKind, RecommendedWatcher, RecursiveMode, Watcher};
use tokio::sync::watch;

/// Keeps the inotify watch alive; drop it to stop watching.
pub struct KubeletWatch {
    _watcher: RecommendedWatcher,
    pub events: watch::Receiver<u64>,
}

pub fn watch_plugin_dir(dir: &Path) -> notify::Result<KubeletWatch> {
    let (tx, events) = watch::channel(0u64);
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        let relevant = match event {
            Ok(e) => matches!(e.kind, EventKind::Create(_) | EventKind::Remove(_)),
            // A lost event (queue overflow) may hide a restart: let everyone re-check.
            Err(_) => true,
        };
        if relevant {
            tx.send_modify(|n| *n = n.wrapping_add(1));
        }
    })?;
    watcher.watch(dir, RecursiveMode::NonRecursive)?;
    Ok(KubeletWatch {
        _watcher: watcher,
        events,
    })
}
