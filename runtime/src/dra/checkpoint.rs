//! The claims a DRA driver has prepared, kept on disk so that the kubelet's
//! `NodeUnprepareResources`, which carries only a claim's UID, can be answered after an agent
//! restart or upgrade: which module devices each claim holds, under which request and config,
//! and which CDI spec file and device names it was given. One JSON file per driver in the
//! agent's state directory, written atomically (0600) before a prepare is answered.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

/// The file format's version: bumped on an incompatible change, which a reader refuses.
const VERSION: u32 = 1;
/// Largest checkpoint read back.
const MAX_FILE: u64 = 64 << 20;

/// One prepared claim.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PreparedClaim {
    pub namespace: String,
    pub name: String,
    pub requests: Vec<PreparedRequest>,
    /// The claim's CDI spec file; None when no request needed one.
    pub spec_file: Option<PathBuf>,
}

/// One request of a prepared claim.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PreparedRequest {
    pub request: String,
    /// (device name in the ResourceSlice, the module's device ID).
    pub devices: Vec<(String, String)>,
    /// The opaque config the module was given (JSON, or empty).
    pub config: String,
    /// What the kubelet was told: the CDI device IDs a container using the request gets.
    pub cdi_ids: Vec<String>,
}

#[derive(Serialize, Deserialize)]
struct File {
    version: u32,
    claims: BTreeMap<String, PreparedClaim>,
}

/// The prepared claims of one driver, by UID; with a file, every change is on disk before the
/// call returns.
pub struct Checkpoint {
    file: Option<PathBuf>,
    claims: Mutex<BTreeMap<String, PreparedClaim>>,
}

impl Checkpoint {
    /// Reads `file` (a missing file is an empty checkpoint); None keeps claims in memory only.
    pub fn open(file: Option<PathBuf>) -> Result<Checkpoint, String> {
        let claims = match &file {
            Some(path) => read(path)?,
            None => BTreeMap::new(),
        };
        Ok(Checkpoint {
            file,
            claims: Mutex::new(claims),
        })
    }

    pub fn get(&self, uid: &str) -> Option<PreparedClaim> {
        self.lock().get(uid).cloned()
    }

    /// The claim other than `except` that holds module device `id`, with its UID.
    pub fn holder_of(&self, id: &str, except: &str) -> Option<(String, PreparedClaim)> {
        self.lock()
            .iter()
            .find(|(uid, claim)| {
                *uid != except
                    && claim
                        .requests
                        .iter()
                        .any(|r| r.devices.iter().any(|(_, held)| held == id))
            })
            .map(|(uid, claim)| (uid.clone(), claim.clone()))
    }

    pub fn uids(&self) -> Vec<String> {
        self.lock().keys().cloned().collect()
    }

    /// Records a prepared claim; Err leaves the checkpoint as it was.
    pub fn insert(&self, uid: &str, claim: PreparedClaim) -> Result<(), String> {
        let mut claims = self.lock();
        let mut next = claims.clone();
        next.insert(uid.to_owned(), claim);
        self.write(&next)?;
        *claims = next;
        Ok(())
    }

    /// Forgets a claim; Err leaves the checkpoint as it was.
    pub fn remove(&self, uid: &str) -> Result<Option<PreparedClaim>, String> {
        let mut claims = self.lock();
        if !claims.contains_key(uid) {
            return Ok(None);
        }
        let mut next = claims.clone();
        let gone = next.remove(uid);
        self.write(&next)?;
        *claims = next;
        Ok(gone)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, PreparedClaim>> {
        self.claims.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self, claims: &BTreeMap<String, PreparedClaim>) -> Result<(), String> {
        let Some(path) = &self.file else {
            return Ok(());
        };
        let file = File {
            version: VERSION,
            claims: claims.clone(),
        };
        let bytes = serde_json::to_vec_pretty(&file).map_err(|e| e.to_string())?;
        crate::files::write_file_atomically(path, &bytes, 0o600)
            .map_err(|e| format!("writing the DRA checkpoint {}: {e}", path.display()))
    }
}

fn read(path: &Path) -> Result<BTreeMap<String, PreparedClaim>, String> {
    let bytes = match crate::files::read_regular(path, MAX_FILE) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(BTreeMap::new()),
        Err(e) => {
            return Err(format!(
                "reading the DRA checkpoint {}: {e}",
                path.display()
            ));
        }
    };
    let file: File = serde_json::from_slice(&bytes)
        .map_err(|e| format!("the DRA checkpoint {} is not valid: {e}", path.display()))?;
    if file.version != VERSION {
        return Err(format!(
            "the DRA checkpoint {} has version {}, this agent reads version {VERSION}",
            path.display(),
            file.version
        ));
    }
    Ok(file.claims)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim(name: &str) -> PreparedClaim {
        PreparedClaim {
            namespace: "team".into(),
            name: name.into(),
            requests: vec![PreparedRequest {
                request: "gpu".into(),
                devices: vec![("gpu-0".into(), "0000:3b:00.0".into())],
                config: String::new(),
                cdi_ids: vec!["k8s.gpu.example.com/gpu=u-gpu".into()],
            }],
            spec_file: None,
        }
    }

    #[test]
    fn claims_survive_a_reopen_and_removal_is_kept_too() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("dra-gpu.example.com.json");
        let checkpoint = Checkpoint::open(Some(file.clone())).unwrap();
        checkpoint.insert("u1", claim("a")).unwrap();
        checkpoint.insert("u2", claim("b")).unwrap();
        checkpoint.remove("u1").unwrap();
        let again = Checkpoint::open(Some(file.clone())).unwrap();
        assert_eq!(again.uids(), ["u2"]);
        assert_eq!(again.get("u2"), Some(claim("b")));
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(
            std::fs::metadata(&file).unwrap().permissions().mode() & 0o777,
            0o600
        );

        std::fs::write(&file, br#"{"version": 9, "claims": {}}"#).unwrap();
        let e = Checkpoint::open(Some(file)).err().unwrap();
        assert!(e.contains("has version 9"), "{e}");
    }
}
