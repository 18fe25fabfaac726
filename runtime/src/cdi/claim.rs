//! Per-claim CDI specs, the DRA front end's: one file per prepared claim,
//! `<dir>/devicelet-dra_<driver>_<claim UID>.json`, written, removed and cleaned up under the
//! same rules as the per-resource specs (`writer.rs`): the directory made 0755 if missing and
//! refused if others could change it, the file replaced atomically. Blocking: call from the
//! blocking pool.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use super::spec::Spec;

/// Where the spec of claim `uid` of `driver` goes in `dir`.
pub fn path(dir: &Path, driver: &str, uid: &str) -> PathBuf {
    dir.join(format!("{}{uid}.json", prefix(driver)))
}

fn prefix(driver: &str) -> String {
    format!("devicelet-dra_{driver}_")
}

/// Writes `spec` at `path` (see [`path`]).
pub fn write(path: &Path, spec: &Spec) -> Result<(), String> {
    let bytes = serde_json::to_vec_pretty(spec).map_err(|e| e.to_string())?;
    super::writer::dir_trusted(path)?;
    crate::files::write_file_atomically(path, &bytes, 0o644)
        .map_err(|e| format!("cannot write {}: {e}", path.display()))
}

/// Removes a claim's spec; one already gone is fine.
pub fn remove(path: &Path) {
    super::writer::remove(path);
}

/// Removes the specs of `driver` in `dir` whose claim is not in `known`: left by an agent
/// stopped between writing a spec and recording its claim. Nothing is touched in a directory
/// others could change.
pub fn remove_stale(dir: &Path, driver: &str, known: &BTreeSet<String>) {
    if crate::trust::check_dir(dir).is_err() {
        return;
    }
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let prefix = prefix(driver);
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(uid) = name
            .strip_prefix(&prefix)
            .and_then(|rest| rest.strip_suffix(".json"))
        else {
            continue;
        };
        if !known.contains(uid) {
            remove(&entry.path());
        }
    }
}
