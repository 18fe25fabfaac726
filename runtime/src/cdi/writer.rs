//! Keeps one resource's spec file in step with its devices: rewritten (atomically) whenever the
//! prepared answers change, removed when the resource stops.
//!
//! A runtime applies whatever spec of our kind it finds, so the file is trusted only as far as
//! we can tell it is ours:
//! - nothing is written (and no device named) in a CDI directory that others than root and us
//!   could change, or below one ([`crate::trust`]); Allocate then lists the module's answer;
//! - Allocate names a device only while the file at the spec's path is the very file we wrote
//!   (same inode, unchanged since: its ctime moves with any write, chmod or rename);
//! - a file at our path that is not what we wrote is replaced by ours, and counted;
//! - while another file in the directory declares our kind, no device is named (runtimes would
//!   take both, or neither).

use std::collections::{BTreeMap, HashMap};
use std::io::Read;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::{Notify, watch};

use super::build::{self, View};
use crate::device::{ContainerEdits, NodeFile, NodeKind};
use crate::policy::sharing::physical_id;
use crate::resource::backend::Upkeep;
use crate::resource::prepared::Prepared;
use crate::resource::snapshot::Snapshot;

/// Longest spec file name written as is; longer ones are named by a digest.
const MAX_FILE_NAME: usize = 200;
/// Largest spec file read back (ours, or another one checked for our kind).
const MAX_SPEC: u64 = 4 << 20;
/// How often the file and the directory are checked when nothing else wakes the writer.
const RECHECK: Duration = Duration::from_secs(5);

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

/// Which file is at a path, and whether it changed: any write, chmod, chown or rename moves its
/// ctime, which no one can set back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileId {
    dev: u64,
    ino: u64,
    ctime: (i64, i64),
    size: u64,
}

impl FileId {
    fn of(meta: &std::fs::Metadata) -> FileId {
        FileId {
            dev: meta.dev(),
            ino: meta.ino(),
            ctime: (meta.ctime(), meta.ctime_nsec()),
            size: meta.size(),
        }
    }

    /// Whether the file at `path` is still this one (a symlink there is not).
    pub fn is_at(&self, path: &Path) -> bool {
        std::fs::symlink_metadata(path).is_ok_and(|m| FileId::of(&m) == *self)
    }
}

/// Where a resource's spec stands, for status.
#[derive(Debug, Default)]
pub struct Written {
    /// Why devices are not named by CDI now (the spec cannot be written, the directory is not
    /// trusted, another spec declares our kind), until they are again.
    pub error: Mutex<Option<String>>,
    /// Files of our kind we did not write, at our path or beside it: replaced, or refused.
    pub foreign: AtomicU64,
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
pub struct SpecWriter {
    /// Whose version says which prepared answers are current.
    pub upkeep: Arc<dyn Upkeep>,
    pub kind: String,
    pub path: PathBuf,
    /// The resource's devices are replicas: the spec names their physical devices.
    pub shared: bool,
    pub devices: watch::Receiver<Snapshot>,
    pub prepared: Prepared,
    pub view: watch::Sender<Option<Arc<View>>>,
    pub written: Arc<Written>,
    /// Wakes the writer at once: Allocate found the file on disk not as written.
    pub recheck: Arc<Notify>,
    /// Set once the spec names what the preparer's first round answered, or naming by CDI is
    /// off for now: the resource registers only then, so the kubelet never checkpoints an
    /// answer that lacks names it would have had a moment later.
    pub settled: watch::Sender<bool>,
    /// Where the device nodes in the answers are: the spec's node facts are checked against
    /// them, so a node whose numbers or owner changed (a driver reloaded) is not named with
    /// stale ones.
    pub host_root: PathBuf,
    /// Set when the resource goes away for good (dropped from the registry, its strategy
    /// changed): the spec is then removed. When the agent merely stops, the spec stays, since
    /// the kubelet restarts containers from the answers it checkpointed, CDI names included,
    /// without asking again; the next agent rewrites it.
    pub retired: Arc<AtomicBool>,
    pub stop: watch::Receiver<bool>,
}

/// The file this writer put in place: its bytes, and which file it is.
#[derive(Clone)]
struct OnDisk {
    bytes: Arc<Vec<u8>>,
    file: FileId,
}

type Answers = BTreeMap<String, Arc<ContainerEdits>>;

/// What a check of the directory and our file found.
#[derive(Default)]
struct Checked {
    /// Why nothing may be written or named there.
    untrusted: Option<String>,
    /// What is at our path now, when it is still what we wrote (perhaps touched).
    ours: Option<OnDisk>,
    /// Something is at our path that we did not write.
    replaced: bool,
    /// Another file declaring our kind.
    foreign: Option<PathBuf>,
    /// Devices in the spec whose nodes are no longer as the spec says.
    stale: Vec<String>,
}

impl SpecWriter {
    /// Runs until the resource stops; removes the file then if the resource was retired.
    pub async fn run(mut self) {
        let mut progress = self.prepared.progress();
        let mut entries = Answers::new();
        let mut on_disk: Option<OnDisk> = None;
        // Files beside ours already read and found not to declare our kind.
        let known = Arc::new(Mutex::new(HashMap::<PathBuf, FileId>::new()));
        // Foreign files already counted, so one file is counted once.
        let mut counted: Option<PathBuf> = None;
        loop {
            // Rounds, not every answer: a round ends once every device has been asked, so a
            // start-up writes the spec once, not once per device.
            let rounds = progress.borrow_and_update().rounds;
            let checked = self.check(on_disk.clone(), &entries, known.clone()).await;
            if !checked.stale.is_empty() {
                tracing::info!(
                    kind = self.kind,
                    devices = ?checked.stale,
                    "device nodes changed since their answers were prepared; asking again"
                );
                let shared = self.shared;
                self.prepared.forget(|id| {
                    let id = if shared { physical_id(id) } else { id };
                    checked.stale.iter().any(|s| s == id)
                });
                entries.retain(|id, _| !checked.stale.contains(id));
            }
            let snapshot = self.devices.borrow_and_update().clone();
            let answers = self.prepared.current(&snapshot, self.upkeep.generation());
            let next = next_entries(&snapshot, &answers, self.shared, &entries);
            match checked.untrusted {
                Some(why) => {
                    self.refuse(why);
                    on_disk = None;
                }
                None => {
                    if checked.replaced {
                        // Nothing names the file there now, until ours is back in place.
                        self.view.send_replace(None);
                        self.written.foreign.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(
                            file = %self.path.display(),
                            kind = self.kind,
                            "the CDI spec at our path is not the one we wrote; writing ours over it"
                        );
                    }
                    let foreign = checked.foreign.is_some();
                    let intact = checked.ours.is_some() && checked.stale.is_empty();
                    if next != entries || !intact {
                        entries = next;
                        on_disk = self.write(&entries, checked.ours, !foreign).await;
                    } else {
                        // The same bytes, perhaps in a file touched or put back since: name
                        // devices by the file as it is now.
                        let moved = on_disk.as_ref().map(|o| o.file)
                            != checked.ours.as_ref().map(|o| o.file);
                        on_disk = checked.ours;
                        if !foreign && (moved || self.view.borrow().is_none()) {
                            self.publish(&entries, on_disk.as_ref());
                        }
                    }
                    if let Some(other) = &checked.foreign {
                        if counted.as_ref() != Some(other) {
                            self.written.foreign.fetch_add(1, Ordering::Relaxed);
                            counted = Some(other.clone());
                        }
                        self.refuse(format!(
                            "{} also declares kind {}: not naming devices by CDI while it is \
                             there (runtimes would apply either, or refuse both)",
                            other.display(),
                            self.kind
                        ));
                    } else {
                        counted = None;
                    }
                }
            }
            if rounds > 0 {
                self.settled.send_replace(true);
            }
            tokio::select! {
                changed = progress.wait_for(|p| p.rounds != rounds) => if changed.is_err() { break },
                changed = self.devices.changed() => if changed.is_err() { break },
                () = self.recheck.notified() => {}
                () = tokio::time::sleep(RECHECK) => {}
                _ = self.stop.wait_for(|stop| *stop) => break,
            }
        }
        self.view.send_replace(None);
        if self.retired.load(Ordering::Relaxed) {
            // Whatever is at our path goes with the resource: no one names its devices any more,
            // and a runtime must not resolve old names to someone else's edits.
            let (path, dir) = (self.path.clone(), self.path.parent().map(Path::to_owned));
            let _ = tokio::task::spawn_blocking(move || {
                if dir.is_some_and(|d| crate::trust::check_dir(&d).is_ok()) {
                    remove(&path);
                }
            })
            .await;
        }
    }

    /// The directory's trust, what is at our path, whether another file claims our kind, and
    /// which devices of `entries` no longer match their nodes: file-system work, off the
    /// agent's workers.
    async fn check(
        &self,
        ours: Option<OnDisk>,
        entries: &Answers,
        known: Arc<Mutex<HashMap<PathBuf, FileId>>>,
    ) -> Checked {
        let (path, kind, root) = (self.path.clone(), self.kind.clone(), self.host_root.clone());
        let entries = entries.clone();
        let run = move || {
            if let Err(why) = dir_trusted(&path) {
                return Checked {
                    untrusted: Some(why),
                    ..Checked::default()
                };
            }
            let (ours, replaced) = match ours {
                Some(ours) => match verify(&path, &ours) {
                    Some(now) => (Some(now), false),
                    None => (None, path.symlink_metadata().is_ok()),
                },
                None => (None, false),
            };
            let mut known = known.lock().unwrap_or_else(PoisonError::into_inner);
            Checked {
                untrusted: None,
                ours,
                replaced,
                foreign: foreign_spec(&path, &kind, &mut known),
                stale: stale_nodes(&root, &entries),
            }
        };
        tokio::task::spawn_blocking(run)
            .await
            .unwrap_or_else(|e| Checked {
                untrusted: Some(format!("checking the CDI directory failed: {e}")),
                ..Checked::default()
            })
    }

    /// Names nothing, for `why`.
    fn refuse(&self, why: String) {
        if self.written.error().as_deref() != Some(why.as_str()) {
            tracing::warn!(kind = self.kind, "{why}");
        }
        self.written.set_error(Some(why));
        self.view.send_replace(None);
    }

    /// Publishes what the file on disk names, for Allocate.
    fn publish(&self, entries: &Answers, on_disk: Option<&OnDisk>) {
        let view = on_disk.and_then(|ours| {
            build::build(&self.kind, entries).map(|(_, view)| view.at(&self.path, ours.file))
        });
        if view.is_some() {
            self.written.set_error(None);
        }
        self.view.send_replace(view.map(Arc::new));
    }

    /// Writes the spec for `entries` (removes ours when there are none) and, when `name`, publishes
    /// what the file holds; returns what is on disk now. `had`: our file, still in place.
    async fn write(&self, entries: &Answers, had: Option<OnDisk>, name: bool) -> Option<OnDisk> {
        let Some((spec, view)) = build::build(&self.kind, entries) else {
            // A spec with no devices is invalid: runtimes would report it.
            self.view.send_replace(None);
            if had.is_some() {
                let path = self.path.clone();
                let _ = tokio::task::spawn_blocking(move || remove(&path)).await;
            }
            return None;
        };
        let text = match serde_json::to_vec_pretty(&spec) {
            Ok(text) => Arc::new(text),
            Err(e) => {
                self.refuse(format!("cannot encode the CDI spec: {e}"));
                return had;
            }
        };
        if let Some(ours) = had.filter(|o| o.bytes == text) {
            if name {
                self.written.set_error(None);
                self.view
                    .send_replace(Some(Arc::new(view.at(&self.path, ours.file))));
            }
            return Some(ours);
        }
        let path = self.path.clone();
        let to_write = text.clone();
        let result = tokio::task::spawn_blocking(move || write_atomically(&path, &to_write))
            .await
            .unwrap_or_else(|e| Err(std::io::Error::other(e.to_string())));
        match result {
            Ok(file) => {
                if name {
                    self.written.set_error(None);
                    self.view
                        .send_replace(Some(Arc::new(view.at(&self.path, file))));
                }
                Some(OnDisk { bytes: text, file })
            }
            Err(e) => {
                // What the file holds is no longer what Allocate would name: name nothing.
                self.refuse(format!("cannot write {}: {e}", self.path.display()));
                None
            }
        }
    }
}

/// Makes the spec's directory if it is missing (as runtimes expect it: 0755), and says why
/// nothing may be written there if it cannot be trusted.
pub(super) fn dir_trusted(path: &Path) -> Result<(), String> {
    use std::os::unix::fs::DirBuilderExt;
    let dir = path.parent().unwrap_or(Path::new("/"));
    let made = std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o755)
        .create(dir);
    if let Err(e) = made
        && e.kind() != std::io::ErrorKind::AlreadyExists
    {
        return Err(format!("cannot write CDI specs in {}: {e}", dir.display()));
    }
    crate::trust::check_dir(dir).map_err(|e| match e {
        crate::trust::Untrusted::Inspect { .. } | crate::trust::Untrusted::NotADirectory { .. } => {
            format!("cannot write CDI specs in {}: {e}", dir.display())
        }
        e => format!(
            "not writing CDI specs in {}: {e}, so others could change what a runtime applies; \
             Allocate lists the devices instead ({})",
            dir.display(),
            e.fix()
        ),
    })
}

/// The devices of `entries` whose device nodes, under `root`, are no longer of the kind,
/// numbers, mode and owner their answer recorded (or are gone).
fn stale_nodes(root: &Path, entries: &Answers) -> Vec<String> {
    use std::os::unix::fs::FileTypeExt;
    let now = |path: &str| {
        let meta = std::fs::symlink_metadata(root.join(path.trim_start_matches('/'))).ok()?;
        let kind = if meta.file_type().is_char_device() {
            NodeKind::Char
        } else if meta.file_type().is_block_device() {
            NodeKind::Block
        } else {
            return None;
        };
        Some(NodeFile::new(
            kind,
            meta.rdev(),
            meta.mode(),
            meta.uid(),
            meta.gid(),
        ))
    };
    entries
        .iter()
        .filter(|(_, answer)| {
            answer
                .devices
                .iter()
                .any(|d| d.file.is_some_and(|f| now(&d.host_path) != Some(f)))
        })
        .map(|(id, _)| id.clone())
        .collect()
}

/// What is at `path` if it is what we wrote: the same file, or (touched, renamed back...) one
/// holding exactly our bytes.
fn verify(path: &Path, ours: &OnDisk) -> Option<OnDisk> {
    if ours.file.is_at(path) {
        return Some(ours.clone());
    }
    let (bytes, file) = read_spec(path).ok()?;
    (bytes == *ours.bytes).then(|| OnDisk {
        bytes: ours.bytes.clone(),
        file,
    })
}

/// A regular file's bytes (never through a symlink, never blocking on a FIFO), and which file
/// they came from.
fn read_spec(path: &Path) -> std::io::Result<(Vec<u8>, FileId)> {
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)?;
    let meta = file.metadata()?;
    if !meta.is_file() || meta.len() > MAX_SPEC {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "not a regular file of a spec's size",
        ));
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    (&mut file).take(MAX_SPEC).read_to_end(&mut bytes)?;
    Ok((bytes, FileId::of(&meta)))
}

/// Another file that declares `kind` where a runtime would read it beside ours: our spec's
/// directory, and the transient directory that takes precedence over `/etc/cdi` when ours is
/// that one. `known` remembers the files already read that do not, so each is read again only
/// once it changes. Symlinks are followed, as runtimes follow them.
fn foreign_spec(ours: &Path, kind: &str, known: &mut HashMap<PathBuf, FileId>) -> Option<PathBuf> {
    let dir = ours.parent()?;
    let mut dirs = vec![dir.to_owned()];
    if dir == Path::new("/etc/cdi") {
        dirs.push(PathBuf::from(super::DEFAULT_DIR));
    }
    let mut seen = Vec::new();
    let mut found = None;
    for dir in dirs {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten().take(4096) {
            let path = entry.path();
            let spec_like = path
                .extension()
                .is_some_and(|e| e == "json" || e == "yaml" || e == "yml");
            if path == ours || !spec_like {
                continue;
            }
            seen.push(path.clone());
            let Ok(meta) = std::fs::metadata(&path) else {
                continue;
            };
            let id = FileId::of(&meta);
            if known.get(&path) == Some(&id) {
                continue;
            }
            match crate::files::read_regular(&path, MAX_SPEC) {
                Ok(bytes) if declares(&bytes, kind) => {
                    found.get_or_insert(path);
                }
                _ => {
                    known.insert(path, id);
                }
            }
        }
    }
    known.retain(|p, _| seen.contains(p));
    found
}

/// Whether spec text says its kind is `kind`: read as JSON when it is JSON; otherwise (YAML, in
/// any of its styles) whenever `kind` appears as a token of its own, which may refuse a file
/// that only mentions it, never miss one that declares it.
fn declares(bytes: &[u8], kind: &str) -> bool {
    if let Ok(json) = serde_json::from_slice::<serde_json::Value>(bytes) {
        return json.get("kind").and_then(|k| k.as_str()) == Some(kind);
    }
    let text = String::from_utf8_lossy(bytes);
    let part = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | '/');
    text.match_indices(kind).any(|(at, _)| {
        let before = text[..at].chars().next_back();
        let after = text[at + kind.len()..].chars().next();
        !before.is_some_and(part) && !after.is_some_and(part)
    })
}

/// The answer per physical device: this round's where there is one, else the one written last
/// while the device is still listed (an Unhealthy device, or one being asked again, keeps its
/// entry, so a container allocated it before can still be created).
fn next_entries(
    snapshot: &Snapshot,
    answers: &HashMap<String, Arc<ContainerEdits>>,
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

/// Written by [`crate::files::write_atomically`], world-readable (runtimes read it): a runtime
/// never reads half a spec, and the temp name does not end in `.json`, so a runtime scanning the
/// directory meanwhile ignores it. Returns the file now at the path, read back: it must hold what
/// was written.
fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<FileId> {
    crate::files::write_file_atomically(path, bytes, 0o644)?;
    let (back, id) = read_spec(path)?;
    if back != bytes {
        return Err(std::io::Error::other(
            "another file was put in its place as it was written",
        ));
    }
    Ok(id)
}

pub(super) fn remove(path: &Path) {
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => tracing::warn!(file = %path.display(), error = %e, "cannot remove CDI spec"),
    }
}

/// Removes the `devicelet_*.json` specs in `dir` that are not in `keep`: left by resources that
/// went away, or stopped using CDI, while the agent was not running. Called once at start,
/// after every module loaded; nothing is touched in a directory others could change.
pub fn remove_stale(dir: &Path, keep: &[PathBuf]) {
    if let Err(e) = crate::trust::check_dir(dir) {
        if !matches!(e, crate::trust::Untrusted::Inspect { .. }) {
            tracing::warn!("not cleaning up CDI specs in {}: {e}", dir.display());
        }
        return;
    }
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
    use std::os::unix::fs::PermissionsExt;

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
    fn a_file_is_ours_only_while_unchanged() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cdi/devicelet_a.com_x.json");
        std::fs::create_dir(path.parent().unwrap()).unwrap();
        let mut first = None;
        let syncs = crate::files::tests::dir_syncs_during(|| {
            first = Some(write_atomically(&path, b"same").unwrap());
        });
        // The rename is made durable (this writer once skipped the directory's fsync).
        assert_eq!(syncs, 1);
        let first = first.unwrap();
        assert!(first.is_at(&path));
        let names: Vec<_> = std::fs::read_dir(path.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 1, "no temp file left: {names:?}");
        let ours = OnDisk {
            bytes: Arc::new(b"same".to_vec()),
            file: first,
        };
        // Replaced by other bytes: not ours.
        std::fs::write(path.with_extension("new"), b"theirs").unwrap();
        std::fs::rename(path.with_extension("new"), &path).unwrap();
        assert!(!first.is_at(&path));
        assert!(verify(&path, &ours).is_none());
        // The same bytes in another file: ours again, under its new identity.
        std::fs::write(path.with_extension("new"), b"same").unwrap();
        std::fs::rename(path.with_extension("new"), &path).unwrap();
        let again = verify(&path, &ours).expect("our bytes");
        assert!(again.file.is_at(&path) && again.file != first);
        // Changed in place: its ctime moved.
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666)).unwrap();
        assert!(!again.file.is_at(&path));
    }

    #[test]
    fn another_file_of_our_kind_is_found_json_or_yaml() {
        let dir = tempfile::tempdir().unwrap();
        let ours = dir.path().join("devicelet_a.com_x.json");
        std::fs::write(&ours, r#"{"kind":"devicelet.a.com/x"}"#).unwrap();
        let other = dir.path().join("other.json");
        std::fs::write(&other, r#"{"kind":"devicelet.a.com/xy"}"#).unwrap();
        let mut known = HashMap::new();
        assert_eq!(foreign_spec(&ours, "devicelet.a.com/x", &mut known), None);
        assert_eq!(known.len(), 1, "remembered as not ours");
        let yaml = dir.path().join("evil.yaml");
        std::fs::write(&yaml, "cdiVersion: 0.3.0\nkind: \"devicelet.a.com/x\"\n").unwrap();
        assert_eq!(
            foreign_spec(&ours, "devicelet.a.com/x", &mut known),
            Some(yaml.clone())
        );
        std::fs::remove_file(&yaml).unwrap();
        assert_eq!(foreign_spec(&ours, "devicelet.a.com/x", &mut known), None);
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
