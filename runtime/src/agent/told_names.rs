//! The served names each module was told at its last start, kept in the state directory.
//!
//! A module of WIT 0.2 or later is told at `init` the names its resources are served under,
//! which the host only knows from what an `init` declared: without a memory of them, every start
//! instantiates a module once to learn its resources and again to tell it their names, and only
//! then makes the health cell's instance, whose enumeration is the first snapshot. With the
//! names its last start told the same file and config, the first instance is told them at once
//! and the health cell's instance is made alongside it ([`crate::sandbox::ModuleHandle::start`]
//! checks them against what the module declares, and falls back when they differ). A memory
//! that is missing, unreadable or wrong costs that saving, never correctness.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::config::ModuleSpec;
use crate::digest::sha256_hex;

/// Far above any record: a module serves at most a few dozen resources.
const MAX_RECORD: u64 = 256 << 10;

/// `<state dir>/told-names`, one file per module.
#[derive(Debug, Clone)]
pub struct ToldNames {
    dir: PathBuf,
}

#[derive(Serialize, Deserialize, PartialEq, Eq, Debug)]
#[serde(deny_unknown_fields)]
struct Record {
    /// sha256 of the module file.
    digest: String,
    /// sha256 of what its `init` is given besides the names (config, resource domain).
    init: String,
    /// (declared name, served name), as told.
    told: Vec<(String, String)>,
}

impl ToldNames {
    pub fn under(state_dir: &Path) -> ToldNames {
        ToldNames {
            dir: state_dir.join("told-names"),
        }
    }

    /// What the module's last start told it, if that start loaded the same file with the same
    /// config. Reads a file: call it off the async workers.
    pub fn recall(&self, spec: &ModuleSpec, digest: &str) -> Option<Vec<(String, String)>> {
        let bytes = crate::files::read_regular(&self.file(spec), MAX_RECORD).ok()?;
        let record: Record = serde_json::from_slice(&bytes).ok()?;
        (record.digest == digest && record.init == init_key(spec)).then_some(record.told)
    }

    /// Keeps `told` for the module's next start, unless that is what is kept already. Writes a
    /// file (synced): call it off the async workers.
    pub fn remember(
        &self,
        spec: &ModuleSpec,
        digest: &str,
        told: &[(String, String)],
    ) -> std::io::Result<()> {
        if self.recall(spec, digest).as_deref() == Some(told) {
            return Ok(());
        }
        let record = Record {
            digest: digest.to_owned(),
            init: init_key(spec),
            told: told.to_vec(),
        };
        let bytes = serde_json::to_vec(&record).map_err(std::io::Error::other)?;
        {
            use std::os::unix::fs::DirBuilderExt;
            match std::fs::DirBuilder::new().mode(0o700).create(&self.dir) {
                Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => return Err(e),
                _ => {}
            }
        }
        crate::files::write_file_atomically(&self.file(spec), &bytes, 0o600)
    }

    /// Named by a digest of the module's name, which may hold any character a TOML key can.
    fn file(&self, spec: &ModuleSpec) -> PathBuf {
        let name = sha256_hex(spec.name.as_bytes());
        self.dir.join(format!("{}.json", &name[..32]))
    }
}

fn init_key(spec: &ModuleSpec) -> String {
    sha256_hex(format!("{}\n{:?}", spec.config, spec.resource_domain).as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(config: &str) -> ModuleSpec {
        let text =
            format!("[[module]]\nname = \"gd\"\npath = \"m.wasm\"\n[module.config]\n{config}\n");
        let file = Path::new("/etc/devicelet/registry.toml");
        crate::config::Registry::parse(&text, file)
            .unwrap()
            .modules
            .remove(0)
    }

    fn names(served: &str) -> Vec<(String, String)> {
        vec![("fuse0".to_owned(), served.to_owned())]
    }

    #[test]
    fn names_are_recalled_only_for_the_same_file_and_config() {
        let state = tempfile::tempdir().unwrap();
        let told = ToldNames::under(state.path());
        let a = spec("x = 1");
        assert_eq!(told.recall(&a, "d1"), None, "nothing kept yet");
        told.remember(&a, "d1", &names("devicelet.io/fuse0"))
            .unwrap();
        assert_eq!(told.recall(&a, "d1"), Some(names("devicelet.io/fuse0")));
        assert_eq!(told.recall(&a, "d2"), None, "another file");
        assert_eq!(told.recall(&spec("x = 2"), "d1"), None, "another config");
        told.remember(&a, "d1", &names("example.com/fuse0"))
            .unwrap();
        assert_eq!(told.recall(&a, "d1"), Some(names("example.com/fuse0")));
    }

    #[test]
    fn a_damaged_record_is_no_memory() {
        let state = tempfile::tempdir().unwrap();
        let told = ToldNames::under(state.path());
        let a = spec("x = 1");
        told.remember(&a, "d1", &names("devicelet.io/fuse0"))
            .unwrap();
        std::fs::write(told.file(&a), b"{\"digest\": ").unwrap();
        assert_eq!(told.recall(&a, "d1"), None);
        told.remember(&a, "d1", &names("devicelet.io/fuse0"))
            .unwrap();
        assert_eq!(told.recall(&a, "d1"), Some(names("devicelet.io/fuse0")));
    }
}
