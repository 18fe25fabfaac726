//! Fetching a module by its pinned manifest digest: from the store when both its manifest and
//! its layer are there, else from the registry, every byte checked (the manifest against the
//! pin, its media types against the wasm OCI layout, the layer's size against the cap and its
//! bytes against the manifest's digest) before anything is stored.

use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use super::access::Access;
use super::reader::Reader;
use super::signature;
use super::store::Store;
use crate::config::ModuleSpec;
use crate::config::OciSource;
use crate::digest::sha256_hex;

/// The media types of the wasm OCI layout (`docs/design/oci.md`).
pub const MANIFEST_MEDIA_TYPE: &str = "application/vnd.oci.image.manifest.v1+json";
pub const CONFIG_MEDIA_TYPE: &str = "application/vnd.wasm.config.v0+json";
pub const LAYER_MEDIA_TYPE: &str = "application/wasm";
/// What an image index (a list of manifests, one per platform) is called, OCI's and Docker's.
const INDEX_MEDIA_TYPES: [&str; 2] = [
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
];
/// A manifest is small; anything larger is not one.
const MAX_MANIFEST: u64 = 4 << 20;
/// One pull, end to end.
pub const PULL_DEADLINE: Duration = Duration::from_secs(120);

/// How the agent reaches registries.
#[derive(Debug, Clone)]
pub struct Fetcher {
    pub store: Store,
    pub access: Access,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Manifest {
    media_type: Option<String>,
    config: Descriptor,
    layers: Vec<Descriptor>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Descriptor {
    media_type: String,
    digest: String,
    size: i64,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Probe {
    media_type: Option<String>,
    manifests: Option<serde::de::IgnoredAny>,
}

fn parse_manifest(manifest: &[u8]) -> Result<Manifest, String> {
    let probe: Probe =
        serde_json::from_slice(manifest).map_err(|e| format!("the manifest is not JSON: {e}"))?;
    let index = probe
        .media_type
        .as_deref()
        .filter(|t| INDEX_MEDIA_TYPES.contains(t));
    if index.is_some() || probe.manifests.is_some() {
        return Err(format!(
            "the digest pins an image index ({}), a list of manifests for several platforms, \
             not a wasm component artifact: pin the digest of the artifact's own manifest",
            index.unwrap_or("a `manifests` list")
        ));
    }
    serde_json::from_slice(manifest)
        .map_err(|e| format!("the manifest is not an OCI image manifest: {e}"))
}

/// The module layer a wasm manifest names: (its sha256 hex, its size). Err names what is not
/// the wasm OCI layout.
fn layer_of(manifest: &[u8]) -> Result<(String, u64), String> {
    wasm_layer(&parse_manifest(manifest)?)
}

fn wasm_layer(m: &Manifest) -> Result<(String, u64), String> {
    if let Some(t) = &m.media_type
        && t != MANIFEST_MEDIA_TYPE
    {
        return Err(format!(
            "the manifest's media type is {t}, not {MANIFEST_MEDIA_TYPE}"
        ));
    }
    if m.config.media_type != CONFIG_MEDIA_TYPE {
        return Err(format!(
            "the artifact's config is {}, not {CONFIG_MEDIA_TYPE}: it is not a wasm component \
             artifact (push modules with `devicelet module push` or `wkg oci push`)",
            m.config.media_type
        ));
    }
    let [layer] = m.layers.as_slice() else {
        return Err(format!(
            "the artifact has {} layers; a wasm component artifact has one",
            m.layers.len()
        ));
    };
    if layer.media_type != LAYER_MEDIA_TYPE {
        return Err(format!(
            "the artifact's layer is {}, not {LAYER_MEDIA_TYPE}",
            layer.media_type
        ));
    }
    let size = u64::try_from(layer.size).map_err(|_| "the layer's size is negative".to_string())?;
    if size > crate::files::MAX_MODULE {
        return Err(format!(
            "the module is {size} bytes, more than the {} a module may be",
            crate::files::MAX_MODULE
        ));
    }
    let hex = layer
        .digest
        .strip_prefix("sha256:")
        .filter(|h| h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()))
        .ok_or_else(|| format!("the layer's digest {} is not a sha256", layer.digest))?;
    Ok((hex.to_ascii_lowercase(), size))
}

/// The manifest `source` pins, fetched by digest (never past [`MAX_MANIFEST`]) and checked
/// against it.
async fn manifest_of(reader: &Reader, source: &OciSource) -> Result<Vec<u8>, String> {
    let accept = [
        MANIFEST_MEDIA_TYPE,
        INDEX_MEDIA_TYPES[0],
        INDEX_MEDIA_TYPES[1],
    ];
    let manifest = reader
        .manifest(
            &source.repository,
            &format!("sha256:{}", source.digest),
            &accept,
            MAX_MANIFEST,
        )
        .await
        .map_err(|e| format!("fetching the manifest: {e}"))?;
    let got = sha256_hex(&manifest);
    if got != source.digest {
        return Err(format!(
            "the registry answered a manifest whose digest is sha256:{got}, not the pinned \
             sha256:{}",
            source.digest
        ));
    }
    Ok(manifest)
}

/// The largest artifact config read: it lists a component's imports and exports.
const MAX_CONFIG: i64 = 1 << 20;

/// The artifact's config as JSON, when it is the wasm layout's (checked against its digest);
/// None for any other config. A wasm config over [`MAX_CONFIG`] or not JSON is refused by
/// name: it is what the import pre-check reads, never skipped.
async fn config_of(
    reader: &Reader,
    source: &OciSource,
    m: &Manifest,
) -> Result<Option<serde_json::Value>, PullError> {
    if m.config.media_type != CONFIG_MEDIA_TYPE {
        return Ok(None);
    }
    if !(0..=MAX_CONFIG).contains(&m.config.size) {
        return Err(PullError::Refused(format!(
            "the artifact's config is {} bytes; a wasm config may be at most {MAX_CONFIG}",
            m.config.size
        )));
    }
    let bytes = reader
        .blob(
            &source.repository,
            &m.config.digest,
            m.config.size as u64,
            super::reader::REQUEST_DEADLINE,
        )
        .await
        .map_err(|e| PullError::Failed(format!("fetching the config: {e}")))?;
    if format!("sha256:{}", sha256_hex(&bytes)) != m.config.digest {
        return Err(PullError::Failed(
            "the config's bytes do not match its digest".into(),
        ));
    }
    serde_json::from_slice(&bytes)
        .map(Some)
        .map_err(|e| PullError::Refused(format!("the artifact's config is not JSON: {e}")))
}

/// The component's (exports, imports) as a wasm config lists them (`component.exports`,
/// `component.imports`, as `wkg` and `devicelet module push` write them); None when it does not.
pub fn listed_interface(config: &serde_json::Value) -> Option<(Vec<String>, Vec<String>)> {
    let names = |key: &str| -> Option<Vec<String>> {
        config
            .get("component")?
            .get(key)?
            .as_array()?
            .iter()
            .map(|v| v.as_str().map(str::to_owned))
            .collect()
    };
    Some((names("exports")?, names("imports")?))
}

/// Why a pull did not give a module. `Refused`: what the digest pins is not a module this
/// node loads (its layout, its size, its imports), which no retry changes; `Failed`: anything
/// else (the registry unreachable or refusing, bytes that do not match), tried again.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PullError {
    #[error("{0}")]
    Refused(String),
    #[error("{0}")]
    Failed(String),
}

/// What `devicelet module inspect` shows of an artifact, read without fetching the module.
#[derive(Debug, Clone)]
pub struct Inspection {
    pub manifest_media_type: String,
    pub config_media_type: String,
    /// Why the artifact is not one a node would load; None when it is.
    pub refused: Option<String>,
    /// The layer's media type, digest and size, when there is one layer.
    pub layer: Option<(String, String, u64)>,
    /// The config, as JSON, when it is the wasm layout's.
    pub config: Option<serde_json::Value>,
    /// The signatures at its `.sig` tag, or why they could not be read.
    pub signatures: Result<Vec<signature::Signed>, String>,
}

/// Reads the artifact `source` pins: its manifest (checked against the pin) and its config.
pub async fn inspect(source: &OciSource, access: &Access) -> Result<Inspection, String> {
    let reader = access.reader(&source.registry)?;
    let manifest = manifest_of(&reader, source).await?;
    let m = parse_manifest(&manifest)?;
    let refused = wasm_layer(&m).err();
    let layer = match m.layers.as_slice() {
        [l] => Some((
            l.media_type.clone(),
            l.digest.clone(),
            u64::try_from(l.size).unwrap_or(0),
        )),
        _ => None,
    };
    let config = config_of(&reader, source, &m)
        .await
        .map_err(|e| e.to_string())?;
    let signatures = signature::fetch(&reader, source).await;
    Ok(Inspection {
        manifest_media_type: m.media_type.unwrap_or_else(|| "(none given)".into()),
        config_media_type: m.config.media_type,
        refused,
        layer,
        config,
        signatures,
    })
}

impl Fetcher {
    /// The module `source` pins, when the store holds its manifest (still matching its name)
    /// and its module file, and, for a `spec` with a `verify-key`, a kept signature that key
    /// verifies: the module's path and the sha256 its bytes must have. The module's bytes are
    /// not hashed here: the loader hashes them anyway, and refuses them unless they match
    /// (`ModuleSpec::sha256`), so a warm start from the store costs what one from a file does.
    /// Reads files: call it off the async workers.
    pub fn stored(&self, source: &OciSource, spec: &ModuleSpec) -> Option<(PathBuf, String)> {
        let manifest = self.store.get(&source.digest, MAX_MANIFEST)?;
        let (layer, _) = layer_of(&manifest).ok()?;
        let path = self.store.path(&layer);
        if !self.store.trusted(&path) {
            return None;
        }
        if let Some(key) = &spec.verify_key {
            let signed = self.store.signatures(&source.digest);
            signature::check(key, &source.digest, &signed).ok()?;
        }
        Some((path, layer))
    }

    /// The store's copy, or else a pull ([`pull`](Self::pull)), for the commands that load one
    /// module and wait for it (`validate`, `try`): its path and sha256. Err says what failed.
    pub async fn fetch(
        &self,
        source: &OciSource,
        spec: &ModuleSpec,
    ) -> Result<(PathBuf, String), String> {
        let (fetcher, pinned, wanted) = (self.clone(), source.clone(), spec.clone());
        let stored = tokio::task::spawn_blocking(move || fetcher.stored(&pinned, &wanted)).await;
        if let Ok(Some(found)) = stored {
            return Ok(found);
        }
        self.pull(source, spec).await.map_err(|e| e.to_string())
    }

    /// Pulls what `source` pins into the store, within [`PULL_DEADLINE`], every byte checked;
    /// the module's path and sha256. The config's import list is checked against `spec`'s grants before
    /// the module is fetched, so a module that could never link costs neither the download nor
    /// a compile.
    pub async fn pull(
        &self,
        source: &OciSource,
        spec: &ModuleSpec,
    ) -> Result<(PathBuf, String), PullError> {
        tokio::time::timeout(PULL_DEADLINE, self.pull_checked(source, spec))
            .await
            .map_err(|_| {
                PullError::Failed(format!("the pull took longer than {PULL_DEADLINE:?}"))
            })?
    }

    async fn pull_checked(
        &self,
        source: &OciSource,
        spec: &ModuleSpec,
    ) -> Result<(PathBuf, String), PullError> {
        let reader = self
            .access
            .reader(&source.registry)
            .map_err(PullError::Failed)?;
        let manifest = manifest_of(&reader, source)
            .await
            .map_err(PullError::Failed)?;
        // Who made it comes before anything it says. Tried again: a signature may be added.
        let signed = match &spec.verify_key {
            Some(key) => {
                let signed = signature::fetch(&reader, source)
                    .await
                    .map_err(PullError::Failed)?;
                signature::check(key, &source.digest, &signed)
                    .map_err(|e| PullError::Failed(format!("refused: {e}")))?;
                Some(signed)
            }
            None => None,
        };
        let m = parse_manifest(&manifest).map_err(PullError::Refused)?;
        let (layer, size) = wasm_layer(&m).map_err(PullError::Refused)?;
        let config = config_of(&reader, source, &m).await?;
        if let Some((exports, imports)) = config.as_ref().and_then(listed_interface) {
            let exports: Vec<&str> = exports.iter().map(String::as_str).collect();
            let imports: Vec<&str> = imports.iter().map(String::as_str).collect();
            crate::sandbox::loader::check_names(spec, &exports, &imports).map_err(|e| {
                PullError::Refused(format!(
                    "its artifact's config says: {e}; refused before fetching the module"
                ))
            })?;
        }
        // Never past the size the manifest says (itself at most MAX_MODULE).
        let bytes = reader
            .blob(
                &source.repository,
                &format!("sha256:{layer}"),
                size,
                PULL_DEADLINE,
            )
            .await
            .map_err(|e| PullError::Failed(format!("fetching the module: {e}")))?;
        let got = sha256_hex(&bytes);
        if got != layer {
            return Err(PullError::Failed(format!(
                "the module's bytes have digest sha256:{got}, not the manifest's sha256:{layer}: \
                 refused"
            )));
        }
        let (store, digest) = (self.store.clone(), source.digest.clone());
        tokio::task::spawn_blocking(move || {
            store.put(&bytes)?;
            if let Some(signed) = signed {
                store.put_signatures(&digest, &signed)?;
            }
            // Last: a manifest in the store means all it needs is there.
            store.put(&manifest)?;
            Ok((store.path(&layer), layer))
        })
        .await
        .map_err(|e| e.to_string())
        .and_then(|r| r)
        .map_err(PullError::Failed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manifest(config: &str, layers: &[(&str, i64)]) -> Vec<u8> {
        let layers: Vec<_> = layers
            .iter()
            .map(|(t, size)| {
                serde_json::json!({"mediaType": t, "digest": format!("sha256:{}", "a".repeat(64)), "size": size})
            })
            .collect();
        serde_json::to_vec(&serde_json::json!({
            "schemaVersion": 2,
            "mediaType": MANIFEST_MEDIA_TYPE,
            "config": {"mediaType": config, "digest": format!("sha256:{}", "b".repeat(64)), "size": 2},
            "layers": layers,
        }))
        .unwrap()
    }

    #[test]
    fn only_the_wasm_layout_is_taken_and_refusals_name_what_is_wrong() {
        let ok = manifest(CONFIG_MEDIA_TYPE, &[(LAYER_MEDIA_TYPE, 10)]);
        assert_eq!(layer_of(&ok), Ok(("a".repeat(64), 10)));
        let image = manifest(
            "application/vnd.oci.image.config.v1+json",
            &[(LAYER_MEDIA_TYPE, 10)],
        );
        assert!(
            layer_of(&image)
                .unwrap_err()
                .contains("not a wasm component artifact")
        );
        let tar = manifest(
            CONFIG_MEDIA_TYPE,
            &[("application/vnd.oci.image.layer.v1.tar+gzip", 10)],
        );
        assert!(layer_of(&tar).unwrap_err().contains("not application/wasm"));
        let two = manifest(
            CONFIG_MEDIA_TYPE,
            &[(LAYER_MEDIA_TYPE, 10), (LAYER_MEDIA_TYPE, 10)],
        );
        assert!(layer_of(&two).unwrap_err().contains("has 2 layers"));
        let huge = manifest(CONFIG_MEDIA_TYPE, &[(LAYER_MEDIA_TYPE, 1 << 40)]);
        assert!(layer_of(&huge).unwrap_err().contains("more than"));
    }
}
