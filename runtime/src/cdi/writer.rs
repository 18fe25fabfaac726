//! Keeps one resource's spec file in step with its devices: rewritten (atomically) whenever the
//! prepared answers change, removed when the resource stops.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
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

/// The spec file of the resource whose CDI kind is `kind`, in `dir`:
/// `devicelet_<vendor>_<class>.json` (a vendor domain has no `_`, so names never collide).
pub fn spec_path(dir: &Path, kind: &str) -> PathBuf {
    let name = format!("devicelet_{}.json", kind.replace('/', "_"));
    if name.len() <= MAX_FILE_NAME {
        return dir.join(name);
    }
    let digest = crate::digest::sha256_hex(kind.as_bytes());
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
    pub stop: watch::Receiver<bool>,
}

impl<B: DeviceBackend> SpecWriter<B> {
    /// Runs until the resource stops, then removes the file (unless something else has
    /// replaced it since).
    pub async fn run(mut self) {
        let mut progress = self.prepared.progress();
        let mut entries = BTreeMap::new();
        let mut bytes: Option<Arc<Vec<u8>>> = None;
        loop {
            let snapshot = self.devices.borrow_and_update().clone();
            let answers = self.prepared.current(&snapshot, self.backend.generation());
            let next = next_entries(&snapshot, &answers, self.shared, &entries);
            if next != entries || bytes.is_none() {
                entries = next;
                bytes = self.write(&entries, bytes).await;
            }
            tokio::select! {
                changed = progress.changed() => if changed.is_err() { break },
                changed = self.devices.changed() => if changed.is_err() { break },
                _ = self.stop.wait_for(|stop| *stop) => break,
            }
        }
        self.view.send_replace(None);
        if let Some(ours) = bytes {
            let path = self.path.clone();
            let _ = tokio::task::spawn_blocking(move || remove_if_ours(&path, &ours)).await;
        }
    }

    /// Writes the spec for `entries` (removes it when there are none) and publishes what it
    /// holds; returns the bytes now in the file.
    async fn write(
        &self,
        entries: &BTreeMap<String, api::ContainerAllocateResponse>,
        had: Option<Arc<Vec<u8>>>,
    ) -> Option<Arc<Vec<u8>>> {
        let Some((spec, view)) = build::build(&self.kind, entries) else {
            // A spec with no devices is invalid: runtimes would report it.
            self.view.send_replace(None);
            if let Some(ours) = had {
                let path = self.path.clone();
                let _ = tokio::task::spawn_blocking(move || remove_if_ours(&path, &ours)).await;
            }
            return None;
        };
        let text = match serde_json::to_vec_pretty(&spec) {
            Ok(text) => Arc::new(text),
            Err(e) => {
                self.written
                    .set_error(Some(format!("cannot encode the CDI spec: {e}")));
                return had;
            }
        };
        if had.as_ref() == Some(&text) {
            self.view.send_replace(Some(Arc::new(view)));
            return had;
        }
        let path = self.path.clone();
        let to_write = text.clone();
        let result = tokio::task::spawn_blocking(move || write_atomically(&path, &to_write))
            .await
            .unwrap_or_else(|e| Err(std::io::Error::other(e.to_string())));
        match result {
            Ok(()) => {
                self.written.set_error(None);
                self.view.send_replace(Some(Arc::new(view)));
                Some(text)
            }
            Err(e) => {
                let message = format!("cannot write {}: {e}", self.path.display());
                if self.written.error().as_deref() != Some(message.as_str()) {
                    tracing::warn!(kind = self.kind, error = message, "CDI spec not written");
                }
                self.written.set_error(Some(message));
                // Names only what the file on disk holds, which is no longer known.
                self.view.send_replace(None);
                None
            }
        }
    }
}

/// The answer per physical device: this round's where there is one, else the one written last
/// while the device is still listed (an Unhealthy device, or one being asked again, keeps its
/// entry, so a container allocated it before can still be created).
fn next_entries(
    snapshot: &Snapshot,
    answers: &HashMap<String, api::ContainerAllocateResponse>,
    shared: bool,
    last: &BTreeMap<String, api::ContainerAllocateResponse>,
) -> BTreeMap<String, api::ContainerAllocateResponse> {
    let physical = |id: &str| {
        if shared {
            physical_id(id).to_owned()
        } else {
            id.to_owned()
        }
    };
    let mut next = BTreeMap::new();
    for d in snapshot.iter() {
        if let Some(answer) = answers.get(&d.id) {
            next.entry(physical(&d.id))
                .or_insert_with(|| answer.clone());
        }
    }
    for d in snapshot.iter() {
        let id = physical(&d.id);
        if !next.contains_key(&id) {
            if let Some(answer) = last.get(&id) {
                next.insert(id, answer.clone());
            }
        }
    }
    next
}

/// Temp file in the same directory, synced, world-readable (runtimes read it), renamed over the
/// spec: a runtime never reads half a spec. The temp name does not end in `.json`, so a runtime
/// scanning the directory meanwhile ignores it.
fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
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
    file.persist(path).map_err(|e| e.error)?;
    Ok(())
}

/// Removes the spec unless another writer (a newer agent during a rolling upgrade) replaced it.
fn remove_if_ours(path: &Path, ours: &[u8]) {
    match std::fs::read(path) {
        Ok(now) if now == ours => {
            if let Err(e) = std::fs::remove_file(path) {
                tracing::warn!(file = %path.display(), error = %e, "cannot remove CDI spec");
            }
        }
        _ => {}
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
        write_atomically(&path, b"one").unwrap();
        write_atomically(&path, b"two").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"two");
        let names: Vec<_> = std::fs::read_dir(path.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 1, "no temp file left: {names:?}");
        remove_if_ours(&path, b"one");
        assert!(path.exists(), "another writer's spec stays");
        remove_if_ours(&path, b"two");
        assert!(!path.exists());
    }
}
