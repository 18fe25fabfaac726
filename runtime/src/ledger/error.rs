//! The ledger's one error type.

use std::io;
use std::path::PathBuf;
use std::time::Duration;

/// What can go wrong keeping the ledger or asking the kubelet for its pods.
///
/// A corrupt checkpoint is *not* an error: [`Ledger::open`](super::Ledger::open) renames it aside
/// and starts empty.
#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    /// A file-system call on the state directory or one of its files failed.
    #[error("ledger: cannot {action} {path}: {source}")]
    Io {
        /// What was being done (`"create"`, `"read"`, `"rename"`, ...).
        action: &'static str,
        /// The file or directory it was done to.
        path: PathBuf,
        source: io::Error,
    },
    /// The state directory or the checkpoint could have been put there by someone else.
    #[error("ledger: refusing {path}: {reason}; {fix}")]
    Untrusted {
        path: PathBuf,
        reason: String,
        fix: String,
    },
    /// The checkpoint could not be serialized (not expected to happen for our own types).
    #[error("ledger: cannot encode the checkpoint for {path}: {source}")]
    Encode {
        path: PathBuf,
        source: serde_json::Error,
    },
    /// The kubelet's PodResources socket could not be dialled.
    #[error("PodResources {socket}: cannot connect: {source}")]
    Connect {
        socket: PathBuf,
        source: tonic::transport::Error,
    },
    /// The kubelet answered `List` with an error.
    #[error("PodResources {socket}: List failed: {status}")]
    List {
        socket: PathBuf,
        status: Box<tonic::Status>,
    },
    /// The kubelet did not answer `List` in time.
    #[error("PodResources {socket}: no answer to List within {after:?}")]
    Timeout { socket: PathBuf, after: Duration },
}

impl LedgerError {
    pub(crate) fn io(action: &'static str, path: impl Into<PathBuf>, source: io::Error) -> Self {
        LedgerError::Io {
            action,
            path: path.into(),
            source,
        }
    }
}
