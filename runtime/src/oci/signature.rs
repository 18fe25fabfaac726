//! Vendor signatures on modules: cosign's keyed "simple signing", as `cosign sign --key` stores
//! it in the registry and `cosign verify --key` checks it (`docs/design/oci.md`). The signature
//! artifact sits at the tag `sha256-<hex>.sig` beside the module; each of its layers is a JSON
//! payload naming the signed manifest's digest, with an ECDSA P-256 (SHA-256) signature over the
//! payload's bytes in the layer's `dev.cosignproject.cosign/signature` annotation.
//!
//! Written on ring (already the agent's TLS provider) rather than the `sigstore` crate: keyed
//! verification of this one format is a prefix check, a base64 decode and one ECDSA call, while
//! `sigstore` would bring its own TLS, crypto and TUF stacks to the agent. The transparency log
//! is not consulted (as `cosign verify --insecure-ignore-tlog`): the operator's key is the trust.

use std::path::Path;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use oci_client::{Client, Reference};
use ring::signature::{ECDSA_P256_SHA256_ASN1, ECDSA_P256_SHA256_FIXED, UnparsedPublicKey};
use rustls::pki_types::PrivatePkcs8KeyDer;
use rustls::pki_types::pem::PemObject;
use serde::{Deserialize, Serialize};

use super::reader::Reader;
use crate::config::OciSource;
pub use crate::config::VerifyKey;
use crate::config::verify_key::MAX_KEY_FILE;
use crate::digest::sha256_hex;

pub const SIGNATURE_MEDIA_TYPE: &str = "application/vnd.dev.cosign.simplesigning.v1+json";
pub const SIGNATURE_ANNOTATION: &str = "dev.cosignproject.cosign/signature";
const PAYLOAD_TYPE: &str = "cosign container image signature";
/// The manifest types a signature artifact may have: OCI, or Docker's when cosign was told to.
const SIGNATURE_MANIFEST_TYPES: [&str; 2] = [
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
];
/// A payload is a few hundred bytes; a signature artifact a few layers.
const MAX_PAYLOAD: i64 = 64 << 10;
const MAX_SIGNATURES: usize = 16;
/// Checking signatures with a vendor's key (the key itself is read with the registry).
pub trait Verifies {
    fn verifies(&self, payload: &[u8], signature: &[u8]) -> bool;
}

impl Verifies for VerifyKey {
    /// Whether `signature` (DER, or r‖s as cosign also takes) signs `payload` with this key.
    fn verifies(&self, payload: &[u8], signature: &[u8]) -> bool {
        let alg = if signature.len() == 64 {
            &ECDSA_P256_SHA256_FIXED
        } else {
            &ECDSA_P256_SHA256_ASN1
        };
        UnparsedPublicKey::new(alg, self.point())
            .verify(payload, signature)
            .is_ok()
    }
}

/// One signature as the registry holds it and the module store keeps it: the payload's bytes
/// and the signature over them, base64.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Signed {
    pub payload: String,
    pub signature: String,
}

/// Where a module's signatures are: the tag cosign names after the manifest's digest.
pub fn signature_tag(digest_hex: &str) -> String {
    format!("sha256-{digest_hex}.sig")
}

#[derive(Deserialize)]
struct Payload {
    critical: Critical,
}

#[derive(Deserialize)]
struct Critical {
    image: Image,
    #[serde(rename = "type")]
    kind: String,
}

#[derive(Deserialize)]
struct Image {
    #[serde(rename = "docker-manifest-digest")]
    digest: String,
}

/// Checks that one of `signed` is by `key` and names `digest_hex`. Err says what failed.
pub fn check(key: &VerifyKey, digest_hex: &str, signed: &[Signed]) -> Result<(), String> {
    if signed.is_empty() {
        return Err(format!(
            "not signed: there is no signature at {}",
            signature_tag(digest_hex)
        ));
    }
    let mut by_key = Vec::new();
    for s in signed {
        let (Ok(payload), Ok(signature)) = (BASE64.decode(&s.payload), BASE64.decode(&s.signature))
        else {
            continue;
        };
        if key.verifies(&payload, &signature) {
            by_key.push(payload);
        }
    }
    if by_key.is_empty() {
        return Err(format!(
            "not signed by {}: none of its {} signature(s) verifies with that key",
            key.path.display(),
            signed.len()
        ));
    }
    let pinned = format!("sha256:{digest_hex}");
    let mut named = Vec::new();
    for payload in &by_key {
        match serde_json::from_slice::<Payload>(payload) {
            Ok(p) if p.critical.kind == PAYLOAD_TYPE && p.critical.image.digest == pinned => {
                return Ok(());
            }
            Ok(p) => named.push(p.critical.image.digest),
            Err(_) => named.push("(an unreadable payload)".into()),
        }
    }
    Err(format!(
        "a signature by {} signs {}, not the pinned {pinned}",
        key.path.display(),
        named.join(", ")
    ))
}

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct SignatureManifest {
    schema_version: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    media_type: Option<String>,
    config: Layer,
    layers: Vec<Layer>,
}

#[derive(Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Layer {
    media_type: String,
    digest: String,
    size: i64,
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    annotations: std::collections::BTreeMap<String, String>,
}

/// The signature artifact's place: the `.sig` tag in the module's repository.
fn signature_reference(source: &OciSource) -> Result<Reference, String> {
    let tag = signature_tag(&source.digest);
    format!("{}/{}:{tag}", source.registry, source.repository)
        .parse()
        .map_err(|e| format!("{e}"))
}

/// The signature artifact's manifest, if the registry has one (None when it answers that
/// there is none), never read past [`MAX_PAYLOAD`].
async fn signature_manifest(
    reader: &Reader,
    source: &OciSource,
) -> Result<Option<SignatureManifest>, String> {
    let tag = signature_tag(&source.digest);
    let fetched = reader
        .manifest(
            &source.repository,
            &tag,
            &SIGNATURE_MANIFEST_TYPES,
            MAX_PAYLOAD as u64,
        )
        .await;
    let bytes = match fetched {
        Ok(bytes) => bytes,
        Err(e) if e.is_unknown() => return Ok(None),
        Err(e) => return Err(format!("fetching its signatures ({tag}): {e}")),
    };
    let manifest = serde_json::from_slice(&bytes).map_err(|e| {
        format!(
            "the signature manifest at {tag}: {}",
            super::reader::short(&e.to_string())
        )
    })?;
    Ok(Some(manifest))
}

/// The signatures the registry holds for what `source` pins (at most [`MAX_SIGNATURES`]), each
/// payload checked against its digest.
pub async fn fetch(reader: &Reader, source: &OciSource) -> Result<Vec<Signed>, String> {
    let Some(manifest) = signature_manifest(reader, source).await? else {
        return Ok(Vec::new());
    };
    let mut out = Vec::new();
    for layer in manifest
        .layers
        .iter()
        .filter(|l| l.media_type == SIGNATURE_MEDIA_TYPE && (0..=MAX_PAYLOAD).contains(&l.size))
        .take(MAX_SIGNATURES)
    {
        let Some(signature) = layer.annotations.get(SIGNATURE_ANNOTATION) else {
            continue;
        };
        let payload = reader
            .blob(
                &source.repository,
                &layer.digest,
                layer.size as u64,
                super::reader::REQUEST_DEADLINE,
            )
            .await
            .map_err(|e| format!("fetching a signature's payload: {e}"))?;
        if format!("sha256:{}", sha256_hex(&payload)) != layer.digest {
            continue;
        }
        out.push(Signed {
            payload: BASE64.encode(&payload),
            signature: signature.clone(),
        });
    }
    Ok(out)
}

/// `devicelet module sign`: signs what `source` pins with the PKCS#8 P-256 key at `key_file`
/// and adds the signature to the artifact at its `.sig` tag, as `cosign sign --key` does (a
/// signature already there stays). The signature's base64.
pub async fn sign(
    source: &OciSource,
    key_file: &Path,
    (reader, client): (&Reader, &Client),
) -> Result<String, String> {
    let text = crate::files::read_regular(key_file, MAX_KEY_FILE)
        .map_err(|e| format!("reading {}: {e}", key_file.display()))?;
    if String::from_utf8_lossy(&text).contains("ENCRYPTED SIGSTORE PRIVATE KEY") {
        return Err(format!(
            "{} is a cosign-encrypted key: sign with `cosign sign --key` (its signatures verify \
             the same), or give a PKCS#8 key (`openssl genpkey -algorithm EC -pkeyopt \
             ec_paramgen_curve:P-256`)",
            key_file.display()
        ));
    }
    let der = PrivatePkcs8KeyDer::from_pem_slice(&text).map_err(|e| {
        format!(
            "{}: not a PKCS#8 PEM private key (-----BEGIN PRIVATE KEY-----; convert an EC \
             PRIVATE KEY with `openssl pkcs8 -topk8 -nocrypt`): {e}",
            key_file.display()
        )
    })?;
    let rng = ring::rand::SystemRandom::new();
    let pair = ring::signature::EcdsaKeyPair::from_pkcs8(
        &ring::signature::ECDSA_P256_SHA256_ASN1_SIGNING,
        der.secret_pkcs8_der(),
        &rng,
    )
    .map_err(|e| format!("{}: not an ECDSA P-256 key: {e}", key_file.display()))?;
    let payload = serde_json::to_vec(&serde_json::json!({
        "critical": {
            "identity": {"docker-reference": format!("{}/{}", source.registry, source.repository)},
            "image": {"docker-manifest-digest": format!("sha256:{}", source.digest)},
            "type": PAYLOAD_TYPE,
        },
        "optional": null,
    }))
    .map_err(|e| e.to_string())?;
    let signature = pair
        .sign(&rng, &payload)
        .map_err(|e| format!("signing: {e}"))?;
    let signature = BASE64.encode(signature.as_ref());

    let reference = signature_reference(source)?;
    let mut layers = match signature_manifest(reader, source).await? {
        Some(manifest) => manifest.layers,
        None => Vec::new(),
    };
    // Appended: the signatures there stay (the same payload signed by another key is another
    // layer with the same digest, as cosign writes it).
    let payload_digest = format!("sha256:{}", sha256_hex(&payload));
    layers.push(Layer {
        media_type: SIGNATURE_MEDIA_TYPE.into(),
        digest: payload_digest.clone(),
        size: payload.len() as i64,
        annotations: [(SIGNATURE_ANNOTATION.to_owned(), signature.clone())].into(),
    });
    // The config go-containerregistry writes for cosign: nothing reads it but its digest.
    let config = serde_json::to_vec(&serde_json::json!({
        "architecture": "", "created": "0001-01-01T00:00:00Z",
        "history": [{"created": "0001-01-01T00:00:00Z"}], "os": "",
        "rootfs": {"type": "layers", "diff_ids": layers.iter().map(|l| &l.digest).collect::<Vec<_>>()},
        "config": {},
    }))
    .map_err(|e| e.to_string())?;
    let config_digest = format!("sha256:{}", sha256_hex(&config));
    let manifest = SignatureManifest {
        schema_version: 2,
        media_type: Some(SIGNATURE_MANIFEST_TYPES[0].into()),
        config: Layer {
            media_type: "application/vnd.oci.image.config.v1+json".into(),
            digest: config_digest.clone(),
            size: config.len() as i64,
            annotations: Default::default(),
        },
        layers,
    };
    let manifest = serde_json::to_vec(&manifest).map_err(|e| e.to_string())?;
    client
        .push_blob(&reference, config, &config_digest)
        .await
        .map_err(|e| format!("pushing the signature's config: {e}"))?;
    client
        .push_blob(&reference, payload, &payload_digest)
        .await
        .map_err(|e| format!("pushing the signature's payload: {e}"))?;
    client
        .push_manifest_raw(
            &reference,
            manifest,
            http::HeaderValue::from_static(SIGNATURE_MANIFEST_TYPES[0]),
        )
        .await
        .map_err(|e| format!("pushing the signature: {e}"))?;
    Ok(signature)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::verify_key::P256_SPKI_PREFIX;

    /// A P-256 key pair made by ring: (the public key as PEM, the PKCS#8 PEM private key).
    fn key_pair(dir: &Path, name: &str) -> (VerifyKey, ring::signature::EcdsaKeyPair) {
        use ring::signature::KeyPair;
        let rng = ring::rand::SystemRandom::new();
        let alg = &ring::signature::ECDSA_P256_SHA256_ASN1_SIGNING;
        let pkcs8 = ring::signature::EcdsaKeyPair::generate_pkcs8(alg, &rng).unwrap();
        let pair = ring::signature::EcdsaKeyPair::from_pkcs8(alg, pkcs8.as_ref(), &rng).unwrap();
        let mut spki = P256_SPKI_PREFIX.to_vec();
        spki.extend_from_slice(pair.public_key().as_ref());
        let pem = format!(
            "-----BEGIN PUBLIC KEY-----\n{}\n-----END PUBLIC KEY-----\n",
            BASE64.encode(&spki)
        );
        let path = dir.join(name);
        std::fs::write(&path, pem).unwrap();
        (VerifyKey::read(&path).unwrap(), pair)
    }

    fn signed(pair: &ring::signature::EcdsaKeyPair, digest: &str) -> Signed {
        let payload = format!(
            r#"{{"critical":{{"identity":{{"docker-reference":"r.io/v/m"}},"image":{{"docker-manifest-digest":"sha256:{digest}"}},"type":"{PAYLOAD_TYPE}"}},"optional":null}}"#
        );
        let rng = ring::rand::SystemRandom::new();
        let signature = pair.sign(&rng, payload.as_bytes()).unwrap();
        Signed {
            payload: BASE64.encode(payload.as_bytes()),
            signature: BASE64.encode(signature.as_ref()),
        }
    }

    #[test]
    fn a_signature_counts_only_by_the_key_and_for_the_pinned_digest() {
        let dir = tempfile::tempdir().unwrap();
        let (vendor, vendor_pair) = key_pair(dir.path(), "vendor.pub");
        let (_, other_pair) = key_pair(dir.path(), "other.pub");
        let (pinned, other_digest) = ("a".repeat(64), "b".repeat(64));

        assert_eq!(
            check(&vendor, &pinned, &[signed(&vendor_pair, &pinned)]),
            Ok(())
        );
        let other_too = [signed(&other_pair, &pinned), signed(&vendor_pair, &pinned)];
        assert_eq!(check(&vendor, &pinned, &other_too), Ok(()));

        let unsigned = check(&vendor, &pinned, &[]).unwrap_err();
        assert!(unsigned.contains("not signed"), "{unsigned}");
        let by_other = check(&vendor, &pinned, &[signed(&other_pair, &pinned)]).unwrap_err();
        assert!(
            by_other.contains("not signed by") && by_other.contains("vendor.pub"),
            "{by_other}"
        );
        let elsewhere = check(&vendor, &pinned, &[signed(&vendor_pair, &other_digest)]);
        assert!(
            elsewhere
                .unwrap_err()
                .contains(&format!("signs sha256:{other_digest}")),
            "a signature of another artifact does not carry over"
        );
        // A payload altered after signing.
        let mut altered = signed(&vendor_pair, &pinned);
        altered.payload = BASE64.encode(
            String::from_utf8(BASE64.decode(&altered.payload).unwrap())
                .unwrap()
                .replace("r.io", "x.io"),
        );
        assert!(check(&vendor, &pinned, &[altered]).is_err());
    }

    #[test]
    fn only_a_p256_public_key_in_pem_is_a_verify_key() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("k.pub");
        std::fs::write(&path, "not a key").unwrap();
        assert!(
            VerifyKey::read(&path)
                .unwrap_err()
                .contains("not a PEM public key")
        );
        // An Ed25519 SubjectPublicKeyInfo.
        let mut ed = vec![
            0x30, 0x2a, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x03, 0x21, 0x00,
        ];
        ed.extend_from_slice(&[7; 32]);
        std::fs::write(
            &path,
            format!(
                "-----BEGIN PUBLIC KEY-----\n{}\n-----END PUBLIC KEY-----\n",
                BASE64.encode(&ed)
            ),
        )
        .unwrap();
        assert!(
            VerifyKey::read(&path)
                .unwrap_err()
                .contains("not an ECDSA P-256")
        );
    }
}
