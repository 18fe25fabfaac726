//! The on-disk checkpoint: `state_dir/ledger.json`, written atomically.
//!
//! Format: compact JSON, `{"version":1,"next_id":N,"entries":[Entry,...]}`, mode 0600, in a 0700
//! directory. Written by [`crate::files::write_atomically`] (temp file, fsync, rename, fsync the
//! directory), so a crash at any point leaves either the old or the new checkpoint, never a
//! partial one. A file that does not parse, has
//! another version, or whose ids are inconsistent is renamed aside to
//! `ledger.json.corrupt-<unix millis>` and the ledger starts empty.

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};
use tracing::{debug, warn};

use super::claims::{ClaimRecord, Claims};
use super::entry::{Entry, to_millis};
use super::error::LedgerError;
use super::journal::{self, Journal};
use super::state::State;

/// The checkpoint's file name inside the state directory.
pub const FILE_NAME: &str = "ledger.json";
/// The only checkpoint version this build reads and writes.
pub const VERSION: u64 = 1;

/// Largest checkpoint read: [`super::MAX_ENTRIES`] entries of many devices each fit well within.
const MAX_FILE: u64 = 64 << 20;
const FILE_MODE: u32 = 0o600;
/// Temp files are `.ledger.json.tmp-<pid>-<nanos>-<seq>` ([`crate::files::temp_prefix`]).
fn temp_prefix() -> String {
    crate::files::temp_prefix(FILE_NAME)
}
/// What agents before the shared atomic write named their temp files; still cleaned up.
const OLD_TEMP_PREFIX: &str = "ledger.json.tmp-";
/// A temp file older than this was left by a crash (a checkpoint takes milliseconds); another
/// agent sharing the directory during a rolling upgrade may own a younger one.
const STALE_TEMP_AGE: Duration = Duration::from_secs(60);

#[derive(Serialize)]
struct Out<'a> {
    version: u64,
    next_id: u64,
    entries: &'a [Entry],
    /// Prepared DRA claims by UID; absent when there are none, as in agents before claims.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    claims: BTreeMap<&'a String, &'a ClaimRecord>,
}

#[derive(Deserialize)]
struct In {
    next_id: u64,
    entries: Vec<Entry>,
    #[serde(default)]
    claims: BTreeMap<String, ClaimRecord>,
}

/// The checkpoint's bytes for `state`.
pub(crate) fn encode(state: &State) -> Result<Vec<u8>, serde_json::Error> {
    let out = Out {
        version: VERSION,
        next_id: state.next_id,
        entries: &state.entries,
        claims: state.claims.prepared(),
    };
    let mut bytes = serde_json::to_vec(&out)?;
    bytes.push(b'\n');
    Ok(bytes)
}

/// The state in `bytes`, or why it cannot be trusted.
pub(crate) fn decode(bytes: &[u8]) -> Result<State, String> {
    let value: serde_json::Value = serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
    match value.get("version") {
        Some(v) if *v == VERSION => {}
        Some(v) => {
            return Err(format!(
                "unsupported version {v} (this build reads {VERSION})"
            ));
        }
        None => return Err("no `version` field".to_owned()),
    }
    let In {
        next_id,
        entries,
        claims,
    } = serde_json::from_value(value).map_err(|e| e.to_string())?;
    let state = State {
        next_id,
        entries,
        claims: Claims::restore(claims)?,
    };
    state.check()?;
    Ok(state)
}

/// Where a ledger keeps its checkpoint.
#[derive(Debug)]
pub(crate) struct Store {
    dir: PathBuf,
    file: PathBuf,
}

impl Store {
    /// Creates `dir` (0700) if missing, removes temp files crashed writers left there, and
    /// restores the checkpoint, setting a corrupt one aside.
    pub fn open(dir: &Path) -> Result<(Store, State, Journal), LedgerError> {
        let store = Store {
            dir: dir.to_owned(),
            file: dir.join(FILE_NAME),
        };
        ensure_trusted(dir, &store.file)?;
        remove_stale_temps(dir);
        let mut state = store.load()?;
        let path = dir.join(journal::FILE_NAME);
        match fs::symlink_metadata(&path) {
            Ok(meta) => check_file(&path, &meta)?,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(LedgerError::io("stat", &path, e)),
        }
        let (journal, lines) =
            Journal::open(&path).map_err(|e| LedgerError::io("read", &path, e))?;
        if !lines.is_empty() {
            state.claims =
                replay(&state.claims, lines).map_err(|reason| LedgerError::Untrusted {
                    path: path.clone(),
                    reason,
                    fix: format!(
                        "check what is in it; removing it (`rm {}`) forgets the claims it holds",
                        path.display()
                    ),
                })?;
        }
        Ok((store, state, journal))
    }

    /// The checkpoint file.
    pub fn file(&self) -> &Path {
        &self.file
    }

    fn load(&self) -> Result<State, LedgerError> {
        // As any file the agent reads: a FIFO or a device node in its place must not park the
        // start, nor a huge file bloat it. Such a file is set aside like a corrupt one.
        let read = match crate::files::read_regular(&self.file, MAX_FILE) {
            Ok(bytes) => decode(&bytes),
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(State::default()),
            Err(e) if e.kind() == io::ErrorKind::InvalidInput => Err(e.to_string()),
            Err(e) => return Err(LedgerError::io("read", &self.file, e)),
        };
        match read {
            Ok(state) => Ok(state),
            Err(reason) => {
                let aside = self.set_aside()?;
                warn!(
                    file = %self.file.display(),
                    error = %reason,
                    renamed_to = %aside.display(),
                    "ledger checkpoint {} is corrupt ({reason}); renamed it to {} and starting \
                     with an empty ledger",
                    self.file.display(),
                    aside.display(),
                );
                Ok(State::default())
            }
        }
    }

    /// Renames the checkpoint to `ledger.json.corrupt-<unix millis>[-n]`, keeping earlier ones.
    fn set_aside(&self) -> Result<PathBuf, LedgerError> {
        let stem = format!("{FILE_NAME}.corrupt-{}", to_millis(SystemTime::now()));
        let mut aside = self.dir.join(&stem);
        let mut n = 0u32;
        while fs::symlink_metadata(&aside).is_ok() {
            n += 1;
            aside = self.dir.join(format!("{stem}-{n}"));
        }
        fs::rename(&self.file, &aside).map_err(|e| LedgerError::io("rename", &self.file, e))?;
        sync_dir(&self.dir)?;
        Ok(aside)
    }

    /// The checkpoint's bytes for `state` (cheap: done under the ledger's lock).
    pub fn encode(&self, state: &State) -> Result<Vec<u8>, LedgerError> {
        encode(state).map_err(|source| LedgerError::Encode {
            path: self.file.clone(),
            source,
        })
    }

    /// Writes `bytes` atomically ([`crate::files::write_atomically`]).
    pub fn save(&self, bytes: &[u8]) -> Result<(), LedgerError> {
        open_dir(&self.dir)
            .and_then(|dir| crate::files::write_atomically(&dir, FILE_NAME, bytes, FILE_MODE))
            .map_err(|e| LedgerError::io("write", &self.file, e))
    }
}

fn open_dir(dir: &Path) -> io::Result<cap_std::fs::Dir> {
    cap_std::fs::Dir::open_ambient_dir(dir, cap_std::ambient_authority())
}

/// `claims` with the journal's `lines` applied in order: each line a claim's whole record or its
/// end.
fn replay(claims: &Claims, lines: Vec<journal::Line>) -> Result<Claims, String> {
    let mut prepared: BTreeMap<String, ClaimRecord> = claims
        .prepared()
        .into_iter()
        .map(|(uid, record)| (uid.clone(), record.clone()))
        .collect();
    for line in lines {
        match line.claim {
            Some(record) => prepared.insert(line.uid, record),
            None => prepared.remove(&line.uid),
        };
    }
    Claims::restore(prepared)
}

/// Creates `dir` 0700 if missing and requires it, and the checkpoint in it if there is one, to be
/// what only root and this agent could have put there: the ledger says which devices are held,
/// and a planted one could hand a device out twice or keep one from every pod.
fn ensure_trusted(dir: &Path, file: &Path) -> Result<(), LedgerError> {
    crate::trust::private_dir(dir).map_err(|reason| LedgerError::Untrusted {
        path: dir.to_owned(),
        fix: reason.fix(),
        reason: reason.to_string(),
    })?;
    let meta = match fs::symlink_metadata(file) {
        Ok(meta) => meta,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(LedgerError::io("stat", file, e)),
    };
    check_file(file, &meta)
}

/// The checkpoint file must not be a link, and must be ours and writable by us alone. (Something
/// else of ours in its place, a FIFO or a directory, is set aside like a corrupt file.)
pub fn check_file(file: &Path, meta: &fs::Metadata) -> Result<(), LedgerError> {
    use std::os::unix::fs::MetadataExt as _;
    let untrusted = |reason: String, fix: String| LedgerError::Untrusted {
        path: file.to_owned(),
        reason,
        fix,
    };
    let shown = file.display();
    if meta.file_type().is_symlink() {
        return Err(untrusted(
            "it is a symbolic link, which could point anywhere".into(),
            format!("check where it leads, then remove it (`rm {shown}`)"),
        ));
    }
    let uid = crate::trust::euid();
    if meta.uid() != uid {
        return Err(untrusted(
            format!(
                "it is owned by uid {}, not by this agent (uid {uid})",
                meta.uid()
            ),
            format!("check who wrote it, then remove it (`rm {shown}`) or `chown {uid} {shown}`"),
        ));
    }
    let mode = meta.mode() & 0o7777;
    if mode & 0o022 != 0 {
        return Err(untrusted(
            format!("it has mode {mode:04o}: users other than its owner may write to it"),
            format!("check what is in it, then `chmod 0600 {shown}`"),
        ));
    }
    Ok(())
}

fn sync_dir(dir: &Path) -> Result<(), LedgerError> {
    open_dir(dir)
        .and_then(|d| crate::files::sync_dir(&d))
        .map_err(|e| LedgerError::io("fsync directory", dir, e))
}

/// Best effort: removes ledger temp files older than [`STALE_TEMP_AGE`].
fn remove_stale_temps(dir: &Path) {
    let Ok(read) = fs::read_dir(dir) else { return };
    let prefix = temp_prefix();
    for entry in read.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !(name.starts_with(&prefix) || name.starts_with(OLD_TEMP_PREFIX)) {
            continue;
        }
        let age = entry
            .metadata()
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok());
        if age.is_some_and(|age| age > STALE_TEMP_AGE) {
            let path = entry.path();
            match fs::remove_file(&path) {
                Ok(()) => debug!(file = %path.display(), "removed a stale ledger temp file"),
                Err(e) => debug!(file = %path.display(), error = %e, "cannot remove stale temp"),
            }
        }
    }
}

/// The names in `dir` that are ledger temp files (for tests).
#[cfg(test)]
pub(crate) fn temp_files(dir: &Path) -> Vec<String> {
    fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(&temp_prefix()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt as _;

    fn state_with(n: usize) -> State {
        let mut s = State::default();
        for i in 0..n {
            s.push(
                "devicelet.io/fuse",
                vec![format!("fuse-{i}")],
                None,
                SystemTime::now(),
            );
        }
        s
    }

    #[test]
    fn encode_decode_round_trip() {
        let s = state_with(3);
        let bytes = encode(&s).unwrap();
        let json: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(json["version"], 1);
        assert_eq!(json["next_id"], 4);
        assert_eq!(json["entries"].as_array().unwrap().len(), 3);
        assert_eq!(decode(&bytes).unwrap(), s);
    }

    #[test]
    fn decode_refuses_what_it_cannot_trust() {
        for (bytes, why) in [
            (&b""[..], "EOF"),
            (b"{\"version\":1,\"next_id\":3,\"entr", "EOF"),
            (b"[]", "version"),
            (b"{\"next_id\":1,\"entries\":[]}", "version"),
            (
                b"{\"version\":2,\"next_id\":1,\"entries\":[]}",
                "unsupported version 2",
            ),
            (
                b"{\"version\":\"1\",\"next_id\":1,\"entries\":[]}",
                "unsupported version",
            ),
            (b"{\"version\":1,\"entries\":[]}", "next_id"),
            (
                b"{\"version\":1,\"next_id\":1,\"entries\":[{\"id\":1}]}",
                "missing field",
            ),
            (
                b"{\"version\":1,\"next_id\":1,\"entries\":[{\"id\":1,\"resource\":\"r\",\
                  \"device_ids\":[],\"allocated_at\":0,\"holder\":null}]}",
                "next_id",
            ),
        ] {
            let err = decode(bytes).unwrap_err();
            assert!(
                err.contains(why),
                "{:?}: {err}",
                String::from_utf8_lossy(bytes)
            );
        }
    }

    #[test]
    fn save_sets_modes_and_leaves_no_temp_files() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("a/state");
        let (store, state, _) = Store::open(&dir).unwrap();
        assert_eq!(state, State::default());
        assert_eq!(
            fs::metadata(&dir).unwrap().permissions().mode() & 0o777,
            0o700
        );
        assert!(!store.file().exists(), "opening alone writes nothing");
        let s = state_with(2);
        store.save(&store.encode(&s).unwrap()).unwrap();
        assert_eq!(
            fs::metadata(store.file()).unwrap().permissions().mode() & 0o777,
            0o600
        );
        assert_eq!(temp_files(&dir), Vec::<String>::new());
        assert_eq!(decode(&fs::read(store.file()).unwrap()).unwrap(), s);
    }

    #[test]
    fn a_directory_others_may_write_is_refused_and_a_readable_one_narrowed() {
        let tmp = tempfile::tempdir().unwrap();
        fs::set_permissions(tmp.path(), fs::Permissions::from_mode(0o750)).unwrap();
        Store::open(tmp.path()).unwrap();
        assert_eq!(
            fs::metadata(tmp.path()).unwrap().permissions().mode() & 0o777,
            0o700
        );
        fs::set_permissions(tmp.path(), fs::Permissions::from_mode(0o777)).unwrap();
        let e = Store::open(tmp.path()).unwrap_err().to_string();
        assert!(e.contains("mode 0777") && e.contains("chmod 0755"), "{e}");
    }

    #[test]
    fn a_planted_or_loose_checkpoint_is_refused_with_its_path_and_the_fix() {
        let tmp = tempfile::tempdir().unwrap();
        let file = tmp.path().join(FILE_NAME);
        fs::write(&file, encode(&state_with(1)).unwrap()).unwrap();
        fs::set_permissions(&file, fs::Permissions::from_mode(0o666)).unwrap();
        let e = Store::open(tmp.path()).unwrap_err().to_string();
        assert!(
            e.contains(&file.display().to_string())
                && e.contains("mode 0666")
                && e.contains("chmod 0600"),
            "{e}"
        );
        fs::set_permissions(&file, fs::Permissions::from_mode(0o600)).unwrap();
        Store::open(tmp.path()).unwrap();

        let elsewhere = tmp.path().join("elsewhere.json");
        fs::rename(&file, &elsewhere).unwrap();
        std::os::unix::fs::symlink(&elsewhere, &file).unwrap();
        let e = Store::open(tmp.path()).unwrap_err().to_string();
        assert!(e.contains("symbolic link"), "{e}");
        fs::remove_file(&file).unwrap();

        if crate::trust::euid() == 0 {
            fs::write(&file, encode(&state_with(1)).unwrap()).unwrap();
            std::os::unix::fs::chown(&file, Some(65534), None).unwrap();
            let e = Store::open(tmp.path()).unwrap_err().to_string();
            assert!(e.contains("owned by uid 65534") && e.contains("rm "), "{e}");
        }
    }

    #[test]
    fn stale_temp_files_are_removed_young_ones_kept() {
        let tmp = tempfile::tempdir().unwrap();
        let old = tmp.path().join(format!("{}1-2-3", temp_prefix()));
        let young = tmp.path().join(format!("{}4-5-6", temp_prefix()));
        let other = tmp.path().join("unrelated");
        for p in [&old, &young, &other] {
            fs::write(p, b"{").unwrap();
        }
        let past = SystemTime::now() - Duration::from_secs(3600);
        fs::File::options()
            .write(true)
            .open(&old)
            .unwrap()
            .set_modified(past)
            .unwrap();
        Store::open(tmp.path()).unwrap();
        assert!(!old.exists());
        assert!(young.exists());
        assert!(other.exists());
    }

    #[test]
    fn a_fifo_or_a_directory_in_the_way_is_set_aside_at_once() {
        let tmp = tempfile::tempdir().unwrap();
        let file = tmp.path().join(FILE_NAME);
        let c = std::ffi::CString::new(file.to_str().unwrap()).unwrap();
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        // Opened non-blocking: this returns at once instead of waiting for a writer.
        let (_, state, _) = Store::open(tmp.path()).unwrap();
        assert_eq!(state, State::default());
        assert!(!file.exists(), "the FIFO is renamed aside");
        fs::create_dir(&file).unwrap();
        let (_, state, _) = Store::open(tmp.path()).unwrap();
        assert_eq!(state, State::default());
        assert!(!file.exists(), "the directory is renamed aside");
    }

    #[test]
    fn corrupt_copies_are_kept_side_by_side() {
        let tmp = tempfile::tempdir().unwrap();
        let file = tmp.path().join(FILE_NAME);
        for _ in 0..2 {
            fs::write(&file, b"garbage").unwrap();
            let (_, state, _) = Store::open(tmp.path()).unwrap();
            assert_eq!(state, State::default());
        }
        let aside: Vec<_> = fs::read_dir(tmp.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("ledger.json.corrupt-"))
            .collect();
        assert_eq!(aside.len(), 2, "{aside:?}");
        assert!(!file.exists());
    }
}
