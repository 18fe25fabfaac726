//! Keeps one resource's spec file in step with its devices: rewritten (atomically) whenever the
//! prepared answers change, removed when the resource stops.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::watch;

use super::build::{self, View};
use crate::kubelet::api::deviceplugin as api;
use crate::kubelet::backend::DeviceBackend;
use crate::kubelet::plugin_server::Snapshot;
use crate::kubelet::prepared::Prepared;
use crate::kubelet::sharing::physical_id;

/// Longest spec file name written as is; longer ones are named by a digest.
const MAX_FILE_NAME: usize = 200;

/// The spec file of the served resource `resource` (`vendor/class`), in `dir`:
/// `devicelet_<vendor>_<class>.json` (a vendor domain has no `_`, so names never collide).
pub fn spec_path(dir: &Path, resource: &str) -> PathBuf {
    let name = format!("devicelet_{}.json", resource.replace('/', "_"));
    if name.len() <= MAX_FILE_NAME {
        return dir.join(name);
    }
    let digest = crate::digest::sha256_hex(resource.as_bytes());
    dir.join(format!("devicelet_{}.json", &digest[..32]))
}

/// Where a resource's spec stands, for status.
#[derive(Debug, Default)]
pub struct Written {
    /// Why the last write failed, until one succeeds.
    pub error: Mutex<Option<String>>,
}

impl Written {
    pub fn error(&self) -> Option<String> {
        self.error
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    fn set_error(&self, error: Option<String>) {
        *self.error.lock().unwrap_or_else(PoisonError::into_inner) = error;
    }
}

/// What the writer follows and where it writes.
pub struct SpecWriter<B> {
    pub backend: B,
    pub kind: String,
    pub path: PathBuf,
    /// The resource's devices are replicas: the spec names their physical devices.
    pub shared: bool,
    pub devices: watch::Receiver<Snapshot>,
    pub prepared: Prepared,
    pub view: watch::Sender<Option<Arc<View>>>,
    pub written: Arc<Written>,
    /// Set when the resource goes away for good (dropped from the registry, its strategy
    /// changed): the spec is then removed. When the agent merely stops, the spec stays, since
    /// the kubelet restarts containers from the answers it checkpointed, CDI names included,
    /// without asking again; the next agent rewrites it.
    pub retired: Arc<AtomicBool>,
    pub stop: watch::Receiver<bool>,
}

/// The file this writer put in place: its bytes, and which file it is (device and inode), so a
/// file another writer replaced or something removed is noticed.
struct OnDisk {
    bytes: Arc<Vec<u8>>,
    file: (u64, u64),
}

type Answers = BTreeMap<String, Arc<api::ContainerAllocateResponse>>;

impl<B: DeviceBackend> SpecWriter<B> {
    /// Runs until the resource stops; removes the file then if the resource was retired.
    pub async fn run(mut self) {
        let mut progress = self.prepared.progress();
        let mut entries = Answers::new();
        let mut on_disk: Option<OnDisk> = None;
        loop {
            // Rounds, not every answer: a round ends once every device has been asked, so a
            // start-up writes the spec once, not once per device.
            progress.borrow_and_update();
            let snapshot = self.devices.borrow_and_update().clone();
            let answers = self.prepared.current(&snapshot, self.backend.generation());
            let next = next_entries(&snapshot, &answers, self.shared, &entries);
            let intact = match &on_disk {
                Some(ours) => is_ours(&self.path, ours).await,
                None => false,
            };
            if next != entries || !intact {
                entries = next;
                on_disk = self.write(&entries, on_disk, intact).await;
            }
            let rounds = progress.borrow().rounds;
            tokio::select! {
                changed = progress.wait_for(|p| p.rounds != rounds) => if changed.is_err() { break },
                changed = self.devices.changed() => if changed.is_err() { break },
                _ = self.stop.wait_for(|stop| *stop) => break,
            }
        }
        self.view.send_replace(None);
        if self.retired.load(Ordering::Relaxed) {
            let path = self.path.clone();
            let _ =
                tokio::task::spawn_blocking(move || remove_unless_replaced(&path, on_disk)).await;
        }
    }

    /// Writes the spec for `entries` (removes ours when there are none) and publishes what the
    /// file holds; returns what is on disk now. `intact`: `had` is still the file at the path.
    async fn write(&self, entries: &Answers, had: Option<OnDisk>, intact: bool) -> Option<OnDisk> {
        let Some((spec, view)) = build::build(&self.kind, entries) else {
            // A spec with no devices is invalid: runtimes would report it.
            self.view.send_replace(None);
            if let Some(ours) = had.filter(|_| intact) {
                let path = self.path.clone();
                let _ =
                    tokio::task::spawn_blocking(move || remove_unless_replaced(&path, Some(ours)))
                        .await;
            }
            return None;
        };
        let text = match serde_json::to_vec_pretty(&spec) {
            Ok(text) => Arc::new(text),
            Err(e) => {
                self.written
                    .set_error(Some(format!("cannot encode the CDI spec: {e}")));
                self.view.send_replace(None);
                return had;
            }
        };
        if had.as_ref().is_some_and(|o| intact && o.bytes == text) {
            self.view.send_replace(Some(Arc::new(view)));
            return had;
        }
        let path = self.path.clone();
        let to_write = text.clone();
        let result = tokio::task::spawn_blocking(move || write_atomically(&path, &to_write))
            .await
            .unwrap_or_else(|e| Err(std::io::Error::other(e.to_string())));
        match result {
            Ok(file) => {
                self.written.set_error(None);
                self.view.send_replace(Some(Arc::new(view)));
                Some(OnDisk { bytes: text, file })
            }
            Err(e) => {
                let message = format!("cannot write {}: {e}", self.path.display());
                if self.written.error().as_deref() != Some(message.as_str()) {
                    tracing::warn!(kind = self.kind, error = message, "CDI spec not written");
                }
                self.written.set_error(Some(message));
                // What the file holds is no longer what Allocate would name: name nothing.
                self.view.send_replace(None);
                had
            }
        }
    }
}

/// Whether the file at `path` is still the one this writer put there.
async fn is_ours(path: &Path, ours: &OnDisk) -> bool {
    let path = path.to_owned();
    let file = ours.file;
    tokio::task::spawn_blocking(move || identity(&path).is_ok_and(|now| now == file))
        .await
        .unwrap_or(false)
}

fn identity(path: &Path) -> std::io::Result<(u64, u64)> {
    let meta = std::fs::metadata(path)?;
    Ok((meta.dev(), meta.ino()))
}

/// The answer per physical device: this round's where there is one, else the one written last
/// while the device is still listed (an Unhealthy device, or one being asked again, keeps its
/// entry, so a container allocated it before can still be created).
fn next_entries(
    snapshot: &Snapshot,
    answers: &HashMap<String, Arc<api::ContainerAllocateResponse>>,
    shared: bool,
    last: &Answers,
) -> Answers {
    let physical = |id: &str| {
        if shared {
            physical_id(id).to_owned()
        } else {
            id.to_owned()
        }
    };
    let mut next = Answers::new();
    for d in snapshot.iter() {
        if let Some(answer) = answers.get(&d.id) {
            next.entry(physical(&d.id))
                .or_insert_with(|| answer.clone());
        }
    }
    for d in snapshot.iter() {
        if let std::collections::btree_map::Entry::Vacant(free) = next.entry(physical(&d.id))
            && let Some(answer) = last.get(free.key())
        {
            free.insert(answer.clone());
        }
    }
    next
}

/// Temp file in the same directory, synced, world-readable (runtimes read it), renamed over the
/// spec: a runtime never reads half a spec. The temp name does not end in `.json`, so a runtime
/// scanning the directory meanwhile ignores it. Returns the new file's identity.
fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<(u64, u64)> {
    let dir = path
        .parent()
        .ok_or_else(|| std::io::Error::other("the spec path has no directory"))?;
    std::fs::create_dir_all(dir)?;
    let mut file = tempfile::Builder::new()
        .prefix(".devicelet-")
        .suffix(".tmp")
        .tempfile_in(dir)?;
    file.write_all(bytes)?;
    file.as_file().sync_all()?;
    file.as_file()
        .set_permissions(std::fs::Permissions::from_mode(0o644))?;
    let meta = file.as_file().metadata()?;
    file.persist(path).map_err(|e| e.error)?;
    Ok((meta.dev(), meta.ino()))
}

/// Removes the spec of a resource that went away, unless another writer (a newer agent during
/// a rolling upgrade) has replaced the file this one wrote. With none written by this writer
/// (a spec left by an earlier run of the agent), whatever is at the path goes.
fn remove_unless_replaced(path: &Path, ours: Option<OnDisk>) {
    if let Some(ours) = ours
        && identity(path).ok() != Some(ours.file)
    {
        return;
    }
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => tracing::warn!(file = %path.display(), error = %e, "cannot remove CDI spec"),
    }
}

/// Removes the `devicelet_*.json` specs in `dir` that are not in `keep`: left by resources that
/// went away while the agent was not running. Called once at start, after every module loaded.
pub fn remove_stale(dir: &Path, keep: &[PathBuf]) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name.starts_with("devicelet_") && name.ends_with(".json") && !keep.contains(&path) {
            match std::fs::remove_file(&path) {
                Ok(()) => {
                    tracing::info!(file = %path.display(), "removed a CDI spec no resource serves")
                }
                Err(e) => {
                    tracing::warn!(file = %path.display(), error = %e, "cannot remove a stale CDI spec")
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_files_are_named_by_kind_and_never_too_long() {
        let dir = Path::new("/var/run/cdi");
        assert_eq!(
            spec_path(dir, "devicelet.io/fuse"),
            dir.join("devicelet_devicelet.io_fuse.json")
        );
        let long = format!("{}.com/x", "v".repeat(250));
        let name = spec_path(dir, &long);
        assert!(name.file_name().unwrap().len() < 100, "{}", name.display());
    }

    #[test]
    fn a_write_replaces_the_file_whole_and_removal_spares_a_newer_writer() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cdi/devicelet_a.com_x.json");
        let first = write_atomically(&path, b"same").unwrap();
        let ours = |file| OnDisk {
            bytes: Arc::new(b"same".to_vec()),
            file,
        };
        // Another writer puts identical bytes in place: a different file all the same.
        let newer = write_atomically(&path, b"same").unwrap();
        assert_ne!(first, newer);
        let names: Vec<_> = std::fs::read_dir(path.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 1, "no temp file left: {names:?}");
        remove_unless_replaced(&path, Some(ours(first)));
        assert!(path.exists(), "the newer writer's spec stays");
        remove_unless_replaced(&path, Some(ours(newer)));
        assert!(!path.exists());
    }

    #[test]
    fn stale_specs_of_resources_no_longer_served_are_removed_at_start() {
        let dir = tempfile::tempdir().unwrap();
        let served = dir.path().join("devicelet_a.com_x.json");
        let gone = dir.path().join("devicelet_a.com_y.json");
        let theirs = dir.path().join("nvidia.json");
        for p in [&served, &gone, &theirs] {
            std::fs::write(p, "{}").unwrap();
        }
        remove_stale(dir.path(), std::slice::from_ref(&served));
        assert!(served.exists() && theirs.exists());
        assert!(!gone.exists());
    }
}
