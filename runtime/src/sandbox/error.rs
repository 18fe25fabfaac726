//! Why a module could not be loaded, or why a call into it failed. Every message names the module,
//! because an operator reading a pod event or a log line must know which vendor to blame.

use std::path::PathBuf;
use std::time::Duration;

use crate::device::PluginError;

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The cause is part of the message (not a `source`), so a `{:#}` chain says it once.
    #[error("module `{module}`: cannot read {path}: {error}")]
    Read {
        module: String,
        path: PathBuf,
        error: std::io::Error,
    },
    #[error(
        "module `{module}`: {path} has sha256 {actual}, but the registry expects {expected}; refusing to load it"
    )]
    Digest {
        module: String,
        path: PathBuf,
        expected: String,
        actual: String,
    },
    #[error("module `{module}`: {path} is not a valid WebAssembly component: {message}")]
    Compile {
        module: String,
        path: PathBuf,
        message: String,
    },
    #[error(
        "module `{module}` imports `{import}`, which its registry grants do not allow (grant it in [module.grants])"
    )]
    UngrantedImport { module: String, import: String },
    #[error("module `{module}` imports `{import}`, which devicelet does not provide")]
    UnknownImport { module: String, import: String },
    #[error(
        "module `{module}` was built against devicelet:plugin@{wants}; this devicelet speaks {speaks} (rebuild the module with an SDK for one of those, or update devicelet)"
    )]
    UnsupportedVersion {
        module: String,
        wants: String,
        speaks: String,
    },
    #[error("module `{module}` does not export the devicelet plugin interface: {message}")]
    NotAPlugin { module: String, message: String },
    /// `init` failed; the call error names the module.
    #[error("{0}")]
    Init(CallError),
    /// The module refused its `[module.config]`.
    #[error("module `{module}` refused its [module.config] ({at}): {message}")]
    Config {
        module: String,
        /// `file:line` of the table in the registry.
        at: String,
        message: String,
    },
    #[error("module `{module}`: {message}")]
    Invalid { module: String, message: String },
}

/// The names of the calls into a module, for error messages and logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallKind {
    Init,
    Enumerate,
    Health,
    Allocate,
    Prestart,
    Preferred,
    /// Telling the module an allocation ended (0.2).
    Release,
    /// A DRA claim's request prepared, or undone, through the `claims` export (0.3).
    Prepare,
    Unprepare,
    /// A request's config checked (`config.validate-config`, 0.2 and later).
    ValidateConfig,
}

impl std::fmt::Display for CallKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            CallKind::Init => "init",
            CallKind::Enumerate => "enumerate",
            CallKind::Health => "health",
            CallKind::Allocate => "allocate",
            CallKind::Prestart => "prestart",
            CallKind::Preferred => "preferred",
            CallKind::Release => "release",
            CallKind::Prepare => "prepare",
            CallKind::Unprepare => "unprepare",
            CallKind::ValidateConfig => "validate-config",
        })
    }
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum CallError {
    #[error("module `{module}` returned an error from {call}: {error}")]
    Plugin {
        module: String,
        call: CallKind,
        error: PluginError,
    },
    #[error("module `{module}` trapped in {call}: {message}")]
    Trap {
        module: String,
        call: CallKind,
        message: String,
    },
    /// Cut off by its cell at the deadline.
    #[error("module `{module}` missed its {deadline:?} deadline in {call}")]
    Deadline {
        module: String,
        call: CallKind,
        deadline: Duration,
    },
    /// Its cell did not cut it off (a thread blocked in a host call): the caller's backstop gave
    /// up on it, and the cell is replaced if it stays stuck.
    #[error(
        "module `{module}` missed its {deadline:?} deadline in {call} and was not stopped in time; the call was abandoned"
    )]
    Overran {
        module: String,
        call: CallKind,
        deadline: Duration,
    },
    /// A host call stopped waiting at the deadline: the node's vendor library was stalled, not
    /// the module broken.
    #[error("module `{module}` missed its {deadline:?} deadline in {call}: {message}")]
    Stalled {
        module: String,
        call: CallKind,
        deadline: Duration,
        message: String,
    },
    #[error("module `{module}` returned an invalid answer from {call}: {message}")]
    InvalidOutput {
        module: String,
        call: CallKind,
        message: String,
    },
    #[error("module `{module}` is not running: {reason}")]
    Unavailable { module: String, reason: String },
}
