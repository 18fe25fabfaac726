//! `devicelet module push`: a module as a wasm component artifact (the layout `wkg` writes:
//! `docs/design/oci.md`): its bytes one `application/wasm` layer, a
//! `application/vnd.wasm.config.v0+json` config naming its imports and exports, and an OCI
//! image manifest, whose digest pins it in a registry line.

use std::path::Path;

use oci_client::Reference;

use super::pull::{CONFIG_MEDIA_TYPE, LAYER_MEDIA_TYPE, MANIFEST_MEDIA_TYPE};
use crate::config::OciSource;
use crate::digest::sha256_hex;

/// Where to push: `oci://<registry>/<repository>:<tag>` (no digest: pushing makes it).
pub fn target(text: &str) -> Result<(String, String, String), String> {
    let rest = text
        .strip_prefix("oci://")
        .ok_or_else(|| format!("{text:?}: expected oci://<registry>/<repository>:<tag>"))?;
    if rest.contains('@') {
        return Err(format!(
            "{text:?}: push to a tag; the digest is what pushing makes"
        ));
    }
    let (registry, path) = rest
        .split_once('/')
        .ok_or_else(|| format!("{text:?} names no repository"))?;
    let (repository, tag) = match path.rsplit_once(':') {
        Some((repository, tag)) if !tag.contains('/') => (repository, tag),
        _ => (path, "latest"),
    };
    // The same rules as a module's source, checked with a stand-in digest.
    let check = format!(
        "oci://{registry}/{repository}:{tag}@sha256:{}",
        "0".repeat(64)
    );
    crate::config::oci_source::parse(&check)?;
    Ok((registry.to_owned(), repository.to_owned(), tag.to_owned()))
}

/// Pushes the module at `file` to `to` (`oci://<registry>/<repository>:<tag>`); the source
/// that pins it. `interface` lists the component's (imports, exports).
pub async fn push(
    file: &Path,
    to: &str,
    interface: (Vec<String>, Vec<String>),
    access: &super::access::Access,
) -> Result<OciSource, String> {
    let (registry, repository, tag) = target(to)?;
    let bytes = crate::files::read_regular(file, crate::files::MAX_MODULE)
        .map_err(|e| format!("reading {}: {e}", file.display()))?;
    let layer = format!("sha256:{}", sha256_hex(&bytes));
    let (imports, exports) = interface;
    let config = serde_json::to_vec(&serde_json::json!({
        "created": devicelet_api::timestamp::now_rfc3339(),
        "architecture": "wasm",
        "os": "wasip2",
        "layerDigests": [layer],
        "component": {"imports": imports, "exports": exports},
    }))
    .map_err(|e| e.to_string())?;
    let config_digest = format!("sha256:{}", sha256_hex(&config));
    let manifest = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "mediaType": MANIFEST_MEDIA_TYPE,
        "artifactType": "application/vnd.wasm.component.v1+wasm",
        "config": {"mediaType": CONFIG_MEDIA_TYPE, "digest": config_digest, "size": config.len()},
        "layers": [{"mediaType": LAYER_MEDIA_TYPE, "digest": layer, "size": bytes.len()}],
    }))
    .map_err(|e| e.to_string())?;
    let reference: Reference = format!("{registry}/{repository}:{tag}")
        .parse()
        .map_err(|e| format!("{e}"))?;
    let client = access.client(&registry).await?;
    let explain = |what: &str, e: oci_client::errors::OciDistributionError| {
        format!("pushing the {what}: {}", access.explain(&registry, &e))
    };
    client
        .push_blob(&reference, config, &config_digest)
        .await
        .map_err(|e| explain("config", e))?;
    client
        .push_blob(&reference, bytes, &layer)
        .await
        .map_err(|e| explain("module", e))?;
    let digest = sha256_hex(&manifest);
    client
        .push_manifest_raw(
            &reference,
            manifest,
            http::HeaderValue::from_static(MANIFEST_MEDIA_TYPE),
        )
        .await
        .map_err(|e| explain("manifest", e))?;
    Ok(OciSource {
        registry,
        repository,
        tag: Some(tag),
        digest,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_push_target_is_a_tag() {
        assert_eq!(
            target("oci://localhost:5000/vendor/gpu:1.0").unwrap(),
            ("localhost:5000".into(), "vendor/gpu".into(), "1.0".into())
        );
        assert_eq!(target("oci://r.io/a").unwrap().2, "latest");
        assert!(target(&format!("oci://r.io/a@sha256:{}", "0".repeat(64))).is_err());
    }
}
