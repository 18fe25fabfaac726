//! `verify-key`: the vendor's public key a module from a registry must be signed with, read and
//! checked when the registry is, so that a bad key file is an error naming the registry's file,
//! line and key. Checking signatures with it is `oci::signature`'s.

use std::path::{Path, PathBuf};

use rustls::pki_types::SubjectPublicKeyInfoDer;
use rustls::pki_types::pem::PemObject;

/// A key file is a few hundred bytes.
pub(crate) const MAX_KEY_FILE: u64 = 64 << 10;
/// The DER of a P-256 SubjectPublicKeyInfo up to its 65-byte uncompressed point.
pub(crate) const P256_SPKI_PREFIX: [u8; 26] = [
    0x30, 0x59, 0x30, 0x13, 0x06, 0x07, 0x2a, 0x86, 0x48, 0xce, 0x3d, 0x02, 0x01, 0x06, 0x08, 0x2a,
    0x86, 0x48, 0xce, 0x3d, 0x03, 0x01, 0x07, 0x03, 0x42, 0x00,
];

/// A vendor's public key (`verify-key`): PEM `PUBLIC KEY`, ECDSA P-256, as `cosign
/// generate-key-pair` writes `cosign.pub` and `openssl pkey -pubout` does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerifyKey {
    pub path: PathBuf,
    point: Vec<u8>,
}

impl VerifyKey {
    /// Reads and checks the key file. Err says what is wrong with it.
    pub fn read(path: &Path) -> Result<VerifyKey, String> {
        let text = crate::files::read_regular(path, MAX_KEY_FILE)
            .map_err(|e| format!("reading {}: {e}", path.display()))?;
        let der = SubjectPublicKeyInfoDer::from_pem_slice(&text).map_err(|e| {
            format!(
                "{}: not a PEM public key (-----BEGIN PUBLIC KEY-----, as cosign.pub or \
                 `openssl pkey -pubout` writes): {e}",
                path.display()
            )
        })?;
        let point = der
            .as_ref()
            .strip_prefix(&P256_SPKI_PREFIX[..])
            .filter(|p| p.len() == 65 && p[0] == 4)
            .ok_or_else(|| {
                format!(
                    "{}: not an ECDSA P-256 public key (cosign's keyed signatures use P-256)",
                    path.display()
                )
            })?;
        Ok(VerifyKey {
            path: path.to_owned(),
            point: point.to_vec(),
        })
    }

    /// The key's uncompressed P-256 point.
    pub fn point(&self) -> &[u8] {
        &self.point
    }
}
