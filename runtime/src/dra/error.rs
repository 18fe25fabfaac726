//! Why a DRA driver could not start, as the agent reports it (a claim's own errors are
//! `prepare::ClaimError`, each in its claim's entry).

use std::path::PathBuf;

/// Why a resource could not be served as a DRA driver.
#[derive(Debug, thiserror::Error)]
pub enum DriverError {
    /// The driver and resource make no CDI kind for the claims' specs.
    #[error("DRA driver {driver}: {message}")]
    Kind { driver: String, message: String },
    #[error("DRA driver {driver}: serving its sockets: {source}")]
    Serve {
        driver: String,
        source: std::io::Error,
    },
    /// An older agent's `dra-<driver>.json` could not be taken into the ledger.
    #[error("the DRA checkpoint {}: {message}", file.display())]
    OldCheckpoint { file: PathBuf, message: String },
}
