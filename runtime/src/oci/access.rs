//! How the agent reaches registries: over HTTPS with the system's roots plus an optional CA
//! bundle (`--registry-ca`), plain HTTP only for registries the operator lists as insecure, and
//! credentials from a Docker `config.json` (`--registry-auth`, the file a
//! `kubernetes.io/dockerconfigjson` Secret mounts). oci-client answers the registry's challenge:
//! basic credentials as they are, or exchanged for a bearer token by the token flow.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use oci_client::Client;
use oci_client::client::{Certificate, CertificateEncoding, ClientConfig, ClientProtocol};
use oci_client::secrets::RegistryAuth;
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;
use serde::Deserialize;

/// A CA bundle or a Docker config is small.
const MAX_FILE: u64 = 4 << 20;

#[derive(Debug, Clone, Default)]
pub struct Access {
    /// Registries (`host[:port]`) spoken to over plain HTTP.
    pub insecure: Vec<String>,
    /// Certificates (DER) trusted besides the system's roots.
    ca: Vec<Vec<u8>>,
    /// (user, password) by registry host, from the Docker config.
    credentials: BTreeMap<String, (String, String)>,
}

#[derive(Deserialize)]
struct DockerConfig {
    #[serde(default)]
    auths: BTreeMap<String, DockerAuth>,
}

#[derive(Deserialize)]
struct DockerAuth {
    auth: Option<String>,
    username: Option<String>,
    password: Option<String>,
}

/// The registry host a Docker config key or a source names: `https://index.docker.io/v1/` and
/// `registry.example.com:5000` alike. Docker Hub's names are one host, the one oci-client
/// sends requests to (`Reference::resolve_registry`).
fn host_of(key: &str) -> String {
    let key = key
        .strip_prefix("https://")
        .or_else(|| key.strip_prefix("http://"))
        .unwrap_or(key);
    let host = key.split('/').next().unwrap_or(key).to_ascii_lowercase();
    match host.as_str() {
        "docker.io" | "registry-1.docker.io" | "index.docker.io" => "index.docker.io".to_owned(),
        _ => host,
    }
}

impl Access {
    /// Reads the CA bundle and the Docker config, if given. Err names the file and what is
    /// wrong with it.
    pub fn load(
        insecure: Vec<String>,
        ca_file: Option<&Path>,
        auth_file: Option<&Path>,
    ) -> Result<Access, String> {
        let mut access = Access {
            insecure,
            ..Access::default()
        };
        if let Some(file) = ca_file {
            let pem = crate::files::read_regular(file, MAX_FILE)
                .map_err(|e| format!("reading the registry CA bundle {}: {e}", file.display()))?;
            for cert in CertificateDer::pem_slice_iter(&pem) {
                let cert =
                    cert.map_err(|e| format!("the registry CA bundle {}: {e}", file.display()))?;
                access.ca.push(cert.to_vec());
            }
            if access.ca.is_empty() {
                return Err(format!(
                    "the registry CA bundle {} holds no PEM certificate (-----BEGIN CERTIFICATE-----)",
                    file.display()
                ));
            }
        }
        if let Some(file) = auth_file {
            access.credentials = docker_config(file)?;
        }
        Ok(access)
    }

    /// A client for one registry, with its credentials (if the Docker config has any) in place
    /// for every request it makes. Err: the TLS settings cannot be used.
    pub async fn client(&self, registry: &str) -> Result<Client, String> {
        // kube and this client share rustls; ring is the agent's provider (see dra/api.rs).
        let _ = rustls::crypto::ring::default_provider().install_default();
        let client = Client::try_from(ClientConfig {
            protocol: ClientProtocol::HttpsExcept(self.insecure.clone()),
            connect_timeout: Some(Duration::from_secs(10)),
            read_timeout: Some(Duration::from_secs(30)),
            extra_root_certificates: self
                .ca
                .iter()
                .map(|der| Certificate {
                    encoding: CertificateEncoding::Der,
                    data: der.clone(),
                })
                .collect(),
            user_agent: devicelet_api::USER_AGENT,
            ..ClientConfig::default()
        })
        .map_err(|e| format!("the registry client: {e}"))?;
        client
            .store_auth_if_needed(&host_of(registry), &self.auth(registry))
            .await;
        Ok(client)
    }

    /// A reader of one registry, for pulls: every body capped as it streams and every request
    /// under a deadline (`reader.rs`). Err: the TLS settings cannot be used.
    pub fn reader(&self, registry: &str) -> Result<super::reader::Reader, String> {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let mut certificates = Vec::with_capacity(self.ca.len());
        for der in &self.ca {
            certificates.push(
                reqwest::Certificate::from_der(der)
                    .map_err(|e| format!("a registry CA certificate: {e}"))?,
            );
        }
        let http = reqwest::Client::builder()
            .tls_certs_merge(certificates)
            .connect_timeout(Duration::from_secs(10))
            .read_timeout(Duration::from_secs(30))
            .user_agent(devicelet_api::USER_AGENT)
            .build()
            .map_err(|e| format!("the registry client: {}", with_causes(&e)))?;
        let insecure = self
            .insecure
            .iter()
            .any(|r| r.eq_ignore_ascii_case(registry));
        let basic = self.credentials.get(&host_of(registry)).cloned();
        Ok(super::reader::Reader::new(http, registry, insecure, basic))
    }

    /// The credentials for `registry` (`host[:port]`): basic from the Docker config, else none.
    fn auth(&self, registry: &str) -> RegistryAuth {
        match self.credentials.get(&host_of(registry)) {
            Some((user, password)) => RegistryAuth::Basic(user.clone(), password.clone()),
            None => RegistryAuth::Anonymous,
        }
    }

    /// A registry error as the operator needs it: with its causes (a TLS or connection
    /// failure hides behind "error sending request"), and a refusal of credentials says whose.
    pub fn explain(&self, registry: &str, e: &oci_client::errors::OciDistributionError) -> String {
        use oci_client::errors::OciDistributionError::{AuthenticationFailure, UnauthorizedError};
        let insecure = self
            .insecure
            .iter()
            .any(|r| r.eq_ignore_ascii_case(registry));
        let text = plain_http_hint(registry, insecure, with_causes(e));
        if !matches!(e, UnauthorizedError { .. } | AuthenticationFailure(_)) {
            return text;
        }
        if self.credentials.contains_key(&host_of(registry)) {
            format!("{text}: the credentials --registry-auth gives for {registry} were refused")
        } else {
            format!(
                "{text}: {registry} wants credentials, and --registry-auth gives none for it (a \
                 Docker config.json with an `auths` entry for {registry})"
            )
        }
    }
}

/// `text`, an error reaching `registry` over HTTPS, with the fix when it reads as a registry
/// that answered TLS in plain HTTP (rustls: "received corrupt message of type
/// InvalidContentType"), as a local `docker-registry` does.
pub fn plain_http_hint(registry: &str, insecure: bool, text: String) -> String {
    let plain = [
        "InvalidContentType",
        "corrupt message",
        "wrong version number",
    ]
    .iter()
    .any(|sign| text.contains(sign));
    if insecure || !plain {
        return text;
    }
    format!(
        "{text} (the registry seems to answer in plain HTTP: if {registry} has no TLS, give \
         --insecure-registry {registry})"
    )
}

/// `e` and each of its causes not already in its message.
pub fn with_causes(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut next = e.source();
    while let Some(cause) = next {
        let text = cause.to_string();
        if !out.contains(&text) {
            out = format!("{out}: {text}");
        }
        next = cause.source();
    }
    out
}

/// A Docker `config.json`'s `auths`: (user, password) by registry host.
fn docker_config(file: &Path) -> Result<BTreeMap<String, (String, String)>, String> {
    let bytes = crate::files::read_regular(file, MAX_FILE)
        .map_err(|e| format!("reading the registry credentials {}: {e}", file.display()))?;
    let config: DockerConfig = serde_json::from_slice(&bytes).map_err(|e| {
        format!(
            "the registry credentials {} are not a Docker config.json: {e}",
            file.display()
        )
    })?;
    let mut out = BTreeMap::new();
    for (key, entry) in config.auths {
        let pair = match (&entry.auth, &entry.username, &entry.password) {
            (Some(auth), _, _) if !auth.trim().is_empty() => BASE64
                .decode(auth.trim())
                .ok()
                .and_then(|b| String::from_utf8(b).ok())
                .and_then(|s| s.split_once(':').map(|(u, p)| (u.to_owned(), p.to_owned())))
                .ok_or_else(|| {
                    format!(
                        "{}: auths.{key:?}.auth is not base64 of user:password",
                        file.display()
                    )
                })?,
            (None, Some(user), Some(password)) => (user.clone(), password.clone()),
            // An entry a credential helper or an identity token serves: nothing to send here.
            _ => {
                tracing::warn!(
                    file = %file.display(),
                    registry = key,
                    "a registry credentials entry without `auth` or `username` and `password`: \
                     skipped (credential helpers and identity tokens are not read)"
                );
                continue;
            }
        };
        out.insert(host_of(&key), pair);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {

    #[test]
    fn a_tls_error_from_a_plain_http_registry_says_to_list_it_as_insecure() {
        let tls = "error sending request: received corrupt message of type InvalidContentType";
        let hinted = super::plain_http_hint("127.0.0.1:5000", false, tls.to_owned());
        assert!(
            hinted.ends_with("give --insecure-registry 127.0.0.1:5000)"),
            "{hinted}"
        );
        // Listed already, or another error: as it was.
        assert_eq!(super::plain_http_hint("r:5000", true, tls.to_owned()), tls);
        let refused = "error sending request: connection refused";
        assert_eq!(
            super::plain_http_hint("r:5000", false, refused.to_owned()),
            refused
        );
    }
    use super::*;

    #[test]
    fn docker_config_entries_are_keyed_by_host_and_bad_ones_named() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("config.json");
        let auth = BASE64.encode("alice:s3cret:with-colon");
        std::fs::write(
            &file,
            format!(
                r#"{{"auths": {{"https://Registry.Example.com:5000/v1/": {{"auth": "{auth}"}},
                    "ghcr.io": {{"username": "bob", "password": "pw"}}}}, "credsStore": "desktop"}}"#
            ),
        )
        .unwrap();
        let access = Access::load(Vec::new(), None, Some(&file)).unwrap();
        assert!(matches!(
            access.auth("registry.example.com:5000"),
            RegistryAuth::Basic(u, p) if u == "alice" && p == "s3cret:with-colon"
        ));
        assert!(matches!(access.auth("ghcr.io"), RegistryAuth::Basic(u, _) if u == "bob"));
        assert!(matches!(access.auth("quay.io"), RegistryAuth::Anonymous));

        // Docker Hub under any of its names; entries a helper serves are skipped.
        std::fs::write(
            &file,
            format!(
                r#"{{"auths": {{"https://index.docker.io/v1/": {{"auth": "{auth}"}},
                    "ghcr.io": {{}}, "quay.io": {{"auth": "", "identitytoken": "x"}}}}}}"#
            ),
        )
        .unwrap();
        let access = Access::load(Vec::new(), None, Some(&file)).unwrap();
        assert!(matches!(access.auth("docker.io"), RegistryAuth::Basic(u, _) if u == "alice"));
        assert!(matches!(access.auth("ghcr.io"), RegistryAuth::Anonymous));

        std::fs::write(&file, r#"{"auths": {"r.io": {"auth": "!!"}}}"#).unwrap();
        let e = Access::load(Vec::new(), None, Some(&file)).unwrap_err();
        assert!(e.contains("auths.\"r.io\".auth is not base64"), "{e}");
        std::fs::write(&file, "{\"auths\": []}").unwrap();
        let e = Access::load(Vec::new(), None, Some(&file)).unwrap_err();
        assert!(e.contains("not a Docker config.json"), "{e}");
        let e = Access::load(Vec::new(), Some(&file), None).unwrap_err();
        assert!(e.contains("holds no PEM certificate"), "{e}");
    }
}
