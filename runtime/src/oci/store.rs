//! The module store: content-addressed, `<state-dir>/modules/sha256/<hex>`, each file named by
//! the sha256 of its bytes (a manifest or a module). Written atomically (0600, in 0700
//! directories the agent owns, under the same trust rules as the compile cache), read back
//! checked: an entry whose bytes no longer match its name is deleted, and fetched again. A node
//! whose registry is unreachable starts from it.

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

    /// The entry's bytes, if present and still matching its name; one that does not match is
    /// deleted (and logged).
    pub fn get(&self, hex: &str, max: u64) -> Option<Vec<u8>> {
        let path = self.path(hex);
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
        crate::files::read_regular(&self.signatures_path(hex), MAX_SIGNATURES_FILE)
            .ok()
            .and_then(|bytes| serde_json::from_slice(&bytes).ok())
            .unwrap_or_default()
    }

    /// Keeps the signatures a pull verified for the manifest `hex`, for starts without the
    /// registry.
    pub fn put_signatures(&self, hex: &str, signed: &[Signed]) -> Result<(), String> {
        let dir = self.dir.join("signatures");
        crate::trust::private_dir(&dir).map_err(|e| format!("the module store: {e}"))?;
        let bytes = serde_json::to_vec(signed).map_err(|e| e.to_string())?;
        crate::files::write_file_atomically(&self.signatures_path(hex), &bytes, 0o600)
            .map_err(|e| format!("writing the signatures of {hex}: {e}"))
    }

    fn signatures_path(&self, hex: &str) -> PathBuf {
        self.dir.join("signatures").join(format!("{hex}.json"))
    }

    /// Stores `bytes` under their digest; the digest.
    pub fn put(&self, bytes: &[u8]) -> Result<String, String> {
        let dir = self.dir.join("sha256");
        crate::trust::private_dir(&dir).map_err(|e| format!("the module store: {e}"))?;
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
}
