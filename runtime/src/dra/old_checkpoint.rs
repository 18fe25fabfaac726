//! Agents before the one allocation ledger kept each driver's prepared claims in a file of its
//! own, `<state dir>/dra-<driver>.json`. An upgraded agent reads it once, under the ledger's trust
//! rules, takes its claims into the ledger and removes it, so a claim prepared by the old agent
//! is still unprepared (its module released, its spec removed) by the new one.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::error::DriverError;
use crate::ledger::{ClaimRecord, Ledger, PreparedRequest};

/// The only version those agents wrote.
const VERSION: u32 = 1;
const MAX_FILE: u64 = 64 << 20;

#[derive(Deserialize)]
struct File {
    version: u32,
    claims: BTreeMap<String, OldClaim>,
}

#[derive(Deserialize)]
struct OldClaim {
    namespace: String,
    name: String,
    requests: Vec<OldRequest>,
    spec_file: Option<PathBuf>,
}

#[derive(Deserialize)]
struct OldRequest {
    request: String,
    devices: Vec<(String, String)>,
    config: String,
    cdi_ids: Vec<String>,
}

/// Where an older agent kept `driver`'s claims.
pub fn path(state_dir: &Path, driver: &str) -> PathBuf {
    state_dir.join(format!("dra-{driver}.json"))
}

/// Moves the claims of `driver`'s old checkpoint, if there is one, into `ledger` (written before
/// the file goes). Blocking; done once, when the driver starts.
pub fn adopt(
    state_dir: &Path,
    driver: &str,
    resource: &str,
    ledger: &Ledger,
) -> Result<(), DriverError> {
    let file = path(state_dir, driver);
    let failed = |message: String| DriverError::OldCheckpoint {
        file: file.clone(),
        message,
    };
    let meta = match std::fs::symlink_metadata(&file) {
        Ok(meta) => meta,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(failed(format!("reading it: {e}"))),
    };
    crate::ledger::check_trusted_file(&file, &meta).map_err(|e| failed(e.to_string()))?;
    let bytes = crate::files::read_regular(&file, MAX_FILE)
        .map_err(|e| failed(format!("reading it: {e}")))?;
    let old: File =
        serde_json::from_slice(&bytes).map_err(|e| failed(format!("not valid: {e}")))?;
    if old.version != VERSION {
        return Err(failed(format!(
            "has version {}, this agent reads version {VERSION}",
            old.version
        )));
    }
    let claims: Vec<(String, ClaimRecord)> = old
        .claims
        .into_iter()
        .map(|(uid, c)| {
            let record = ClaimRecord {
                driver: driver.to_owned(),
                resource: resource.to_owned(),
                namespace: c.namespace,
                name: c.name,
                requests: c
                    .requests
                    .into_iter()
                    .map(|r| PreparedRequest {
                        request: r.request,
                        devices: r.devices,
                        config: r.config,
                        cdi_ids: r.cdi_ids,
                        admin: false,
                        shares: Vec::new(),
                        status: Vec::new(),
                    })
                    .collect(),
                spec_file: c.spec_file,
                preparing: false,
                by_module: false,
            };
            (uid, record)
        })
        .collect();
    let count = claims.len();
    ledger
        .adopt_claims(claims)
        .map_err(|e| failed(format!("names a device held otherwise: {e}")))?;
    ledger.flush().map_err(|e| failed(e.to_string()))?;
    std::fs::remove_file(&file).map_err(|e| failed(format!("removing it: {e}")))?;
    tracing::info!(
        driver,
        claims = count,
        file = %file.display(),
        "took the claims of an older agent's DRA checkpoint into the ledger"
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_old_checkpoint_moves_into_the_ledger_once() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = Ledger::open(dir.path()).unwrap();
        let file = path(dir.path(), "gpu.example.com");
        let old = r#"{"version":1,"claims":{"u1":{"namespace":"team","name":"a","requests":[{"request":"gpu","devices":[["gpu-0","0000:3b:00.0"]],"config":"","cdi_ids":["k8s.gpu.example.com/gpu=u1-gpu"]}],"spec_file":null}}}"#;
        std::fs::write(&file, old).unwrap();
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o666)).unwrap();
        let e = adopt(dir.path(), "gpu.example.com", "example.com/gpu", &ledger)
            .unwrap_err()
            .to_string();
        assert!(e.contains("mode 0666"), "{e}");
        assert_eq!(ledger.claim_count("gpu.example.com"), 0);

        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
        adopt(dir.path(), "gpu.example.com", "example.com/gpu", &ledger).unwrap();
        assert!(!file.exists());
        let again = Ledger::open(dir.path()).unwrap();
        let claim = again.claim("u1").expect("kept in the ledger's checkpoint");
        assert_eq!(claim.resource, "example.com/gpu");
        assert_eq!(claim.requests[0].devices[0].1, "0000:3b:00.0");
        assert_eq!(
            again
                .claimed("example.com/gpu")
                .into_iter()
                .collect::<Vec<_>>(),
            ["0000:3b:00.0"]
        );
    }
}
