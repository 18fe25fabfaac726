//! The module store: content-addressed, `<state-dir>/modules/sha256/<hex>`, each file named by
//! the sha256 of its bytes (a manifest or a module). Written atomically (0600, in 0700
//! directories the agent owns, under the same trust rules as the compile cache), read back
//! checked: an entry whose bytes no longer match its name is deleted, and fetched again. A node
//! whose registry is unreachable starts from it. The trust rules hold on every read as on every
//! write: an entry in a directory someone else could write, or a file not ours or writable by
//! others, is not read (and logged), so a loosened store is never loaded from.

use std::path::{Path, PathBuf};

use super::signature::Signed;
use crate::digest::sha256_hex;

/// Signatures kept per manifest: a few payloads.
const MAX_SIGNATURES_FILE: u64 = 1 << 20;

/// A store directory (`.../modules`).
#[derive(Debug, Clone)]
pub struct Store {
    dir: PathBuf,
}

impl Store {
    /// The store under `state_dir`; made (0700) and checked when first written.
    pub fn under(state_dir: &Path) -> Store {
        Store {
            dir: state_dir.join("modules"),
        }
    }

    /// Where the entry for `hex` lives.
    pub fn path(&self, hex: &str) -> PathBuf {
        self.dir.join("sha256").join(hex)
    }

    /// Whether the entry at `path` may be read: its directory trusted ([`crate::trust`]) and
    /// the file a regular one of ours (or root's) that nobody else may write. Logs why not;
    /// false for an entry that is not there, silently.
    pub fn trusted(&self, path: &Path) -> bool {
        use std::os::unix::fs::MetadataExt;
        let meta = match std::fs::symlink_metadata(path) {
            Ok(meta) => meta,
            Err(_) => return false,
        };
        let why = match path.parent().map(crate::trust::check_dir) {
            Some(Err(e)) => Some(format!("{e}; {}", e.fix())),
            None => Some("it has no directory".to_owned()),
            Some(Ok(())) if !meta.is_file() => Some("it is not a regular file".to_owned()),
            Some(Ok(())) if !crate::trust::is_ours_or_root(meta.uid()) => Some(format!(
                "it is owned by uid {}, not by root or this agent",
                meta.uid()
            )),
            Some(Ok(())) if meta.mode() & 0o022 != 0 => Some(format!(
                "it has mode {:04o}: others may write to it",
                meta.mode() & 0o7777
            )),
            Some(Ok(())) => None,
        };
        if let Some(why) = &why {
            tracing::warn!(
                entry = %path.display(),
                "a module store entry is not trusted, so not read: {why}"
            );
        }
        why.is_none()
    }

    /// The entry's bytes, if present, trusted and still matching its name; one that does not
    /// match is deleted (and logged).
    pub fn get(&self, hex: &str, max: u64) -> Option<Vec<u8>> {
        let path = self.path(hex);
        if !self.trusted(&path) {
            return None;
        }
        let bytes = crate::files::read_regular(&path, max).ok()?;
        if sha256_hex(&bytes) == hex {
            return Some(bytes);
        }
        tracing::warn!(
            entry = %path.display(),
            "a module store entry no longer matches its digest: deleted, to be fetched again"
        );
        let _ = std::fs::remove_file(&path);
        None
    }

    /// The signatures kept for the manifest `hex` (checked again against the registry's key at
    /// every start, so a changed key is never satisfied by an old check); none if absent.
    pub fn signatures(&self, hex: &str) -> Vec<Signed> {
        let path = self.signatures_path(hex);
        if !self.trusted(&path) {
            return Vec::new();
        }
        crate::files::read_regular(&path, MAX_SIGNATURES_FILE)
            .ok()
            .and_then(|bytes| serde_json::from_slice(&bytes).ok())
            .unwrap_or_default()
    }

    /// Keeps the signatures a pull verified for the manifest `hex`, for starts without the
    /// registry.
    pub fn put_signatures(&self, hex: &str, signed: &[Signed]) -> Result<(), String> {
        self.private("signatures")?;
        let bytes = serde_json::to_vec(signed).map_err(|e| e.to_string())?;
        crate::files::write_file_atomically(&self.signatures_path(hex), &bytes, 0o600)
            .map_err(|e| format!("writing the signatures of {hex}: {e}"))
    }

    /// `sub` of the store, made and checked only after the store itself is: nothing is made
    /// inside a directory before it is known to be ours.
    fn private(&self, sub: &str) -> Result<PathBuf, String> {
        let dir = self.dir.join(sub);
        for d in [&self.dir, &dir] {
            crate::trust::private_dir(d)
                .map_err(|e| format!("the module store: {e}; {}", e.fix()))?;
        }
        Ok(dir)
    }

    fn signatures_path(&self, hex: &str) -> PathBuf {
        self.dir.join("signatures").join(format!("{hex}.json"))
    }

    /// Stores `bytes` under their digest; the digest.
    pub fn put(&self, bytes: &[u8]) -> Result<String, String> {
        self.private("sha256")?;
        let hex = sha256_hex(bytes);
        crate::files::write_file_atomically(&self.path(&hex), bytes, 0o600)
            .map_err(|e| format!("writing the module store entry {hex}: {e}"))?;
        Ok(hex)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_are_named_by_their_digest_and_a_tampered_one_is_deleted() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::under(dir.path());
        let hex = store.put(b"module bytes").expect("stored");
        assert_eq!(hex, sha256_hex(b"module bytes"));
        assert_eq!(store.get(&hex, 1024).as_deref(), Some(&b"module bytes"[..]));
        std::fs::write(store.path(&hex), b"tampered").unwrap();
        assert_eq!(store.get(&hex, 1024), None);
        assert!(!store.path(&hex).exists(), "deleted, to be fetched again");
    }

    #[test]
    fn a_loosened_store_is_not_read_and_nothing_is_made_in_a_foreign_one() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let store = Store::under(dir.path());
        let hex = store.put(b"module bytes").expect("stored");
        let sha = dir.path().join("modules/sha256");
        std::fs::set_permissions(&sha, std::fs::Permissions::from_mode(0o777)).unwrap();
        assert_eq!(store.get(&hex, 1024), None, "a directory others may write");
        std::fs::set_permissions(&sha, std::fs::Permissions::from_mode(0o700)).unwrap();
        std::fs::set_permissions(store.path(&hex), std::fs::Permissions::from_mode(0o666)).unwrap();
        assert_eq!(store.get(&hex, 1024), None, "a file others may write");
        std::fs::set_permissions(store.path(&hex), std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(store.get(&hex, 1024).is_some());

        // The store a symlink to a directory anyone may write: refused before `sha256/` is made.
        let other = tempfile::tempdir().unwrap();
        let open = other.path().join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
        let state = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink(&open, state.path().join("modules")).unwrap();
        let e = Store::under(state.path()).put(b"x").unwrap_err();
        assert!(e.contains("mode 0777"), "{e}");
        assert!(!open.join("sha256").exists(), "nothing made inside it");
    }
}
