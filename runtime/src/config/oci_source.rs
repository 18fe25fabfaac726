//! `oci://<registry>/<repository>[:tag]@sha256:<digest>`: where a module comes from, pinned by
//! its manifest's digest. The tag is informative only (it says what the digest was pushed as);
//! the digest alone is fetched, so what runs can never change under the same registry line.

/// A module's source, as the registry names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OciSource {
    /// `host[:port]`.
    pub registry: String,
    pub repository: String,
    pub tag: Option<String>,
    /// The manifest's sha256, 64 lowercase hex digits.
    pub digest: String,
}

impl std::fmt::Display for OciSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "oci://{}/{}", self.registry, self.repository)?;
        if let Some(tag) = &self.tag {
            write!(f, ":{tag}")?;
        }
        write!(f, "@sha256:{}", self.digest)
    }
}

impl OciSource {
    /// The reference the client fetches: by digest.
    pub fn by_digest(&self) -> String {
        format!(
            "{}/{}@sha256:{}",
            self.registry, self.repository, self.digest
        )
    }
}

/// Parses a source; Err says what is wrong, with a hint where one helps.
pub fn parse(text: &str) -> Result<OciSource, String> {
    let rest = text.strip_prefix("oci://").ok_or_else(|| {
        format!("{text:?} is not an OCI reference: expected oci://<registry>/<repository>@sha256:<digest>")
    })?;
    let (name, digest) = match rest.rsplit_once('@') {
        Some((name, digest)) => (name, digest),
        None => {
            return Err(format!(
                "{text:?} has no digest: a module is pinned by its manifest's digest, \
                 oci://{rest}@sha256:<digest> (`devicelet module push` prints it; for an \
                 artifact pushed otherwise it is the sha256 of its manifest: \
                 `skopeo inspect --raw docker://{rest} | sha256sum`)"
            ));
        }
    };
    let hex = digest.strip_prefix("sha256:").ok_or_else(|| {
        format!("{text:?}: the digest must be sha256:<64 hex digits>, not {digest:?}")
    })?;
    if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(format!(
            "{text:?}: the digest must be sha256:<64 hex digits>, not {digest:?}"
        ));
    }
    let (registry, path) = name.split_once('/').ok_or_else(|| {
        format!("{text:?} names no repository: expected oci://<registry>/<repository>@sha256:…")
    })?;
    if registry.is_empty() || registry.contains(|c: char| c.is_whitespace()) {
        return Err(format!("{text:?}: {registry:?} is not a registry host"));
    }
    // A tag follows the last path segment's colon (a registry port's colon is in `registry`).
    let (repository, tag) = match path.rsplit_once(':') {
        Some((repository, tag)) if !tag.contains('/') => (repository, Some(tag)),
        _ => (path, None),
    };
    let valid_repository = !repository.is_empty()
        && repository.split('/').all(|segment| {
            !segment.is_empty()
                && segment
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b))
        });
    if !valid_repository {
        return Err(format!(
            "{text:?}: {repository:?} is not a repository name (lowercase letters, digits, \
             '.', '_', '-', in '/'-separated segments)"
        ));
    }
    if let Some(tag) = tag
        && (tag.is_empty()
            || tag.len() > 128
            || !tag
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b)))
    {
        return Err(format!("{text:?}: {tag:?} is not a tag"));
    }
    Ok(OciSource {
        registry: registry.to_owned(),
        repository: repository.to_owned(),
        tag: tag.map(str::to_owned),
        digest: hex.to_ascii_lowercase(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const D: &str = "4f6c3a5e9b0d2a1c8e7f6a5b4c3d2e1f0a9b8c7d6e5f4a3b2c1d0e9f8a7b6c5d";

    #[test]
    fn a_reference_is_registry_repository_optional_tag_and_a_required_digest() {
        let s = parse(&format!(
            "oci://registry.example.com:5000/vendor/gpu:1.2.0@sha256:{D}"
        ))
        .expect("valid");
        assert_eq!(s.registry, "registry.example.com:5000");
        assert_eq!(s.repository, "vendor/gpu");
        assert_eq!(s.tag.as_deref(), Some("1.2.0"));
        assert_eq!(s.digest, D);
        assert_eq!(
            s.to_string(),
            format!("oci://registry.example.com:5000/vendor/gpu:1.2.0@sha256:{D}")
        );
        assert_eq!(
            s.by_digest(),
            format!("registry.example.com:5000/vendor/gpu@sha256:{D}")
        );
        let untagged = parse(&format!("oci://ghcr.io/a/b@sha256:{D}")).expect("valid");
        assert_eq!((untagged.repository.as_str(), untagged.tag), ("a/b", None));

        let no_digest = parse("oci://ghcr.io/a/b:1.0").unwrap_err();
        assert!(no_digest.contains("has no digest"), "{no_digest}");
        assert!(no_digest.contains("devicelet module push"), "{no_digest}");
        for bad in [
            format!("https://ghcr.io/a@sha256:{D}"),
            format!("oci://ghcr.io@sha256:{D}"),
            format!("oci://ghcr.io/A/b@sha256:{D}"),
            "oci://ghcr.io/a@sha256:abc".to_string(),
            format!("oci://ghcr.io/a@sha512:{D}"),
            format!("oci://ghcr.io/a:bad tag@sha256:{D}"),
        ] {
            assert!(parse(&bad).is_err(), "{bad}");
        }
    }
}
