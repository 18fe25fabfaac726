//! The digests a bindings file's header records. One copy: the scenario that checks the
//! committed files (`tests/tests/scenarios/guest_bindings.rs`) includes this file as it is.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use sha2::{Digest, Sha256};

/// A WIT folder's `.wit` files, by name: each name, a NUL, its bytes, a NUL (through a link,
/// the folder it names).
pub fn wit_digest(dir: &Path) -> Result<String> {
    let mut names: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .map(|e| e.map(|e| e.path()))
        .collect::<Result<_, _>>()?;
    names.retain(|p| p.extension().is_some_and(|e| e == "wit"));
    names.sort();
    let mut hash = Sha256::new();
    for path in names {
        let name = path.file_name().context("a file name")?;
        hash.update(name.as_encoded_bytes());
        hash.update([0]);
        hash.update(std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?);
        hash.update([0]);
    }
    Ok(format!("{:x}", hash.finalize()))
}

pub fn sha256(bytes: &[u8]) -> String {
    format!("{:x}", Sha256::digest(bytes))
}
