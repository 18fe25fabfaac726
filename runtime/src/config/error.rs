//! The one error type of registry loading. An operator fixing a registry needs to know where to
//! look, so every validation failure carries the file, a 1-based line and column, and the dotted
//! key path of the offending setting; the rendered message reads like a compiler diagnostic
//! (`registry.toml:7:17: key `module[0].call-deadline`: ...`) so editors and terminals can jump
//! to it.

use std::io;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    /// The registry file could not be read at all (missing, unreadable, a directory, ...).
    /// The cause is part of the message (not a `source`), so a `{:#}` chain says it once.
    #[error("{}: cannot read the module registry: {error}", file.display())]
    Read { file: PathBuf, error: io::Error },

    /// The file was read but its content is not a valid registry.
    #[error("{}:{line}:{column}: {}{message}", file.display(), key_prefix(key.as_deref()))]
    Invalid {
        file: PathBuf,
        /// 1-based line of the offending text.
        line: usize,
        /// 1-based column, counted in characters, of the offending text.
        column: usize,
        /// Dotted key path such as `module[1].grants.dev[0]`; `None` only when the text is not
        /// TOML at all and there is no key to speak of.
        key: Option<String>,
        message: String,
    },
}

impl RegistryError {
    /// The registry file the error is about.
    pub fn file(&self) -> &Path {
        match self {
            RegistryError::Read { file, .. } | RegistryError::Invalid { file, .. } => file,
        }
    }

    /// The dotted key path at fault, when there is one.
    pub fn key(&self) -> Option<&str> {
        match self {
            RegistryError::Read { .. } => None,
            RegistryError::Invalid { key, .. } => key.as_deref(),
        }
    }
}

fn key_prefix(key: Option<&str>) -> String {
    key.map(|key| format!("key `{key}`: ")).unwrap_or_default()
}
