//! Every read from a registry — manifests, configs, modules, signatures, token answers and error
//! bodies — capped while it streams and under a deadline from its start to its last byte.
//!
//! Written here rather than through oci-client, which the agent still uses to push
//! (`devicelet module push`/`sign`): oci-client 0.18 reads a manifest (`pull_manifest_raw`), a
//! token answer and an error body whole before anything can look at its size, and its timeouts
//! are per read, so a registry could hold a pull as long as it trickles bytes, or grow the agent
//! by whatever it sends — a 500 MB manifest took the agent past 1 GB. Reading needs only GET, the
//! registry's challenge (basic, or a bearer token from the token flow) and redirects, which
//! reqwest (oci-client's own HTTP client, already in the tree) follows, dropping credentials on a
//! redirect to another host.

use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use reqwest::StatusCode;
use reqwest::header::{ACCEPT, AUTHORIZATION, WWW_AUTHENTICATE};

/// The longest one small read (a manifest, a config, a signature, a token) may take, start to
/// last byte.
pub const REQUEST_DEADLINE: Duration = Duration::from_secs(30);
/// The most of a token answer read: a real one is a few KB (a JWT).
const MAX_TOKEN_ANSWER: u64 = 64 << 10;
/// The most of an error's body read: enough for the registry's error envelope.
const MAX_ERROR_BODY: u64 = 4 << 10;
/// The most of a registry's own words an error repeats (in logs, status and metrics).
const MAX_ERROR_TEXT: usize = 200;

/// Why a read gave no bytes. Its text is short and names the request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct ReadError {
    /// The registry's HTTP status, when it answered with an error.
    pub status: Option<u16>,
    /// The first code of the registry's error envelope (`MANIFEST_UNKNOWN`), when it sent one.
    pub code: Option<String>,
    pub message: String,
}

impl ReadError {
    fn failed(message: String) -> ReadError {
        ReadError {
            status: None,
            code: None,
            message,
        }
    }

    /// Whether the registry said there is no such manifest, blob or repository.
    pub fn is_unknown(&self) -> bool {
        self.status == Some(404)
            || matches!(
                self.code.as_deref(),
                Some("MANIFEST_UNKNOWN" | "NAME_UNKNOWN" | "BLOB_UNKNOWN")
            )
    }
}

/// Reads from one registry, with the operator's TLS settings and credentials for it.
pub struct Reader {
    http: reqwest::Client,
    /// `https://host[:port]`, or `http://` for a registry listed as insecure.
    base: String,
    registry: String,
    basic: Option<(String, String)>,
    /// The bearer token the last challenge was answered with, tried first on the next request.
    bearer: std::sync::Mutex<Option<String>>,
}

impl std::fmt::Debug for Reader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Reader({})", self.base)
    }
}

impl Reader {
    pub(super) fn new(
        http: reqwest::Client,
        registry: &str,
        insecure: bool,
        basic: Option<(String, String)>,
    ) -> Reader {
        let scheme = if insecure { "http" } else { "https" };
        let host = match registry {
            "docker.io" | "index.docker.io" => "registry-1.docker.io",
            other => other,
        };
        Reader {
            http,
            base: format!("{scheme}://{host}"),
            registry: registry.to_owned(),
            basic,
            bearer: std::sync::Mutex::new(None),
        }
    }

    /// The manifest `reference` (a digest or a tag) of `repository`, asking for `accept`
    /// types, never more than `max` bytes.
    pub async fn manifest(
        &self,
        repository: &str,
        reference: &str,
        accept: &[&str],
        max: u64,
    ) -> Result<Vec<u8>, ReadError> {
        let path = format!("/v2/{repository}/manifests/{reference}");
        self.get(repository, &path, accept, max, REQUEST_DEADLINE)
            .await
    }

    /// The blob `digest` of `repository`, never more than `max` bytes, within `deadline`.
    pub async fn blob(
        &self,
        repository: &str,
        digest: &str,
        max: u64,
        deadline: Duration,
    ) -> Result<Vec<u8>, ReadError> {
        let path = format!("/v2/{repository}/blobs/{digest}");
        self.get(repository, &path, &[], max, deadline).await
    }

    async fn get(
        &self,
        repository: &str,
        path: &str,
        accept: &[&str],
        max: u64,
        deadline: Duration,
    ) -> Result<Vec<u8>, ReadError> {
        let url = format!("{}{path}", self.base);
        let read = async {
            let mut response = self.send(&url, accept, self.remembered()).await?;
            if response.status() == StatusCode::UNAUTHORIZED {
                let challenge = response
                    .headers()
                    .get(WWW_AUTHENTICATE)
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("")
                    .to_owned();
                let Some(auth) = self.answer(&challenge, repository).await? else {
                    return Err(self.refused(status_error(&url, response).await));
                };
                response = self.send(&url, accept, Some(auth)).await?;
                if response.status() == StatusCode::UNAUTHORIZED {
                    return Err(self.refused(status_error(&url, response).await));
                }
            }
            if !response.status().is_success() {
                return Err(status_error(&url, response).await);
            }
            read_capped(response, max)
                .await
                .map_err(|e| ReadError::failed(format!("GET {url}: {e}")))
        };
        tokio::time::timeout(deadline, read)
            .await
            .unwrap_or_else(|_| {
                Err(ReadError::failed(format!(
                    "GET {url}: no whole answer within {deadline:?}"
                )))
            })
    }

    fn remembered(&self) -> Option<String> {
        let bearer = self.bearer.lock().unwrap_or_else(|p| p.into_inner());
        bearer.as_ref().map(|token| format!("Bearer {token}"))
    }

    async fn send(
        &self,
        url: &str,
        accept: &[&str],
        auth: Option<String>,
    ) -> Result<reqwest::Response, ReadError> {
        let mut request = self.http.get(url);
        if !accept.is_empty() {
            request = request.header(ACCEPT, accept.join(", "));
        }
        if let Some(auth) = auth {
            request = request.header(AUTHORIZATION, auth);
        }
        request.send().await.map_err(|e| {
            let text = super::access::with_causes(&e);
            let insecure = self.base.starts_with("http://");
            let text = super::access::plain_http_hint(&self.registry, insecure, text);
            ReadError::failed(format!("GET {url}: {text}"))
        })
    }

    /// The `Authorization` that answers `challenge`: basic credentials as they are, or a bearer
    /// token fetched from the challenge's realm with them; None when it asks for basic
    /// credentials and there are none.
    async fn answer(&self, challenge: &str, repository: &str) -> Result<Option<String>, ReadError> {
        let (scheme, params) = parse_challenge(challenge);
        if scheme.eq_ignore_ascii_case("basic") {
            return Ok(self.basic.as_ref().map(|(user, password)| {
                format!("Basic {}", BASE64.encode(format!("{user}:{password}")))
            }));
        }
        if !scheme.eq_ignore_ascii_case("bearer") {
            return Err(ReadError::failed(format!(
                "{}: answered 401 with a challenge devicelet does not know: {}",
                self.registry,
                short(challenge)
            )));
        }
        let realm = params
            .iter()
            .find(|(k, _)| k == "realm")
            .map(|(_, v)| v.as_str())
            .filter(|r| r.starts_with("https://") || r.starts_with("http://"))
            .ok_or_else(|| {
                ReadError::failed(format!(
                    "{}: its bearer challenge names no http(s) realm: {}",
                    self.registry,
                    short(challenge)
                ))
            })?;
        // The credentials go to the realm: never in clear text for a registry reached over
        // HTTPS (only one the operator listed as insecure may name a plain-HTTP token service).
        if realm.starts_with("http://") && self.base.starts_with("https://") {
            return Err(ReadError::failed(format!(
                "{}: its bearer challenge sends credentials to a plain-HTTP token service ({}); \
                 refused",
                self.registry,
                short(realm)
            )));
        }
        let mut query: Vec<(&str, String)> = Vec::new();
        if let Some((_, service)) = params.iter().find(|(k, _)| k == "service") {
            query.push(("service", service.clone()));
        }
        let scope = params
            .iter()
            .find(|(k, _)| k == "scope")
            .map(|(_, v)| v.clone())
            .unwrap_or_else(|| format!("repository:{repository}:pull"));
        query.push(("scope", scope));
        let url = reqwest::Url::parse_with_params(realm, &query).map_err(|e| {
            ReadError::failed(format!(
                "{}: its token realm {}: {e}",
                self.registry,
                short(realm)
            ))
        })?;
        let mut request = self.http.get(url.clone());
        if let Some((user, password)) = &self.basic {
            request = request.basic_auth(user, Some(password));
        }
        let response = request.send().await.map_err(|e| {
            ReadError::failed(format!(
                "the token service {url}: {}",
                super::access::with_causes(&e)
            ))
        })?;
        match response.status() {
            StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN => {
                return Err(self.refused(status_error(url.as_str(), response).await));
            }
            s if !s.is_success() => return Err(status_error(url.as_str(), response).await),
            _ => {}
        }
        let body = read_capped(response, MAX_TOKEN_ANSWER)
            .await
            .map_err(|e| ReadError::failed(format!("the token service {url}: {e}")))?;
        #[derive(serde::Deserialize)]
        struct Token {
            token: Option<String>,
            access_token: Option<String>,
        }
        let token = serde_json::from_slice::<Token>(&body)
            .ok()
            .and_then(|t| t.token.or(t.access_token))
            .filter(|t| !t.is_empty())
            .ok_or_else(|| {
                ReadError::failed(format!("the token service {url} answered no token"))
            })?;
        *self.bearer.lock().unwrap_or_else(|p| p.into_inner()) = Some(token.clone());
        Ok(Some(format!("Bearer {token}")))
    }

    /// A refusal of credentials (`answer`: the registry's or its token service's), saying whose.
    fn refused(&self, answer: ReadError) -> ReadError {
        let whose = if self.basic.is_some() {
            format!(
                "the credentials --registry-auth gives for {} were refused",
                self.registry
            )
        } else {
            format!(
                "{} wants credentials, and --registry-auth gives none for it (a Docker \
                 config.json with an `auths` entry for {})",
                self.registry, self.registry
            )
        };
        ReadError {
            message: format!("{}: {whose}", answer.message),
            ..answer
        }
    }
}

/// The scheme of a `WWW-Authenticate` challenge and its `key="value"` parameters.
fn parse_challenge(challenge: &str) -> (String, Vec<(String, String)>) {
    let challenge = challenge.trim();
    let (scheme, rest) = challenge.split_once(' ').unwrap_or((challenge, ""));
    let mut params = Vec::new();
    let mut rest = rest.trim();
    while let Some((key, after)) = rest.split_once('=') {
        let key = key
            .trim()
            .trim_start_matches(',')
            .trim()
            .to_ascii_lowercase();
        let (value, next) = match after.strip_prefix('"') {
            Some(quoted) => match quoted.find('"') {
                Some(end) => (&quoted[..end], &quoted[end + 1..]),
                None => (quoted, ""),
            },
            None => after.split_once(',').unwrap_or((after, "")),
        };
        params.push((key, value.to_owned()));
        rest = next.trim_start_matches(|c: char| c == ',' || c.is_whitespace());
    }
    (scheme.to_owned(), params)
}

/// The body, read as it streams and refused past `max` bytes: before it costs the agent more.
async fn read_capped(mut response: reqwest::Response, max: u64) -> Result<Vec<u8>, String> {
    let too_large = || format!("the registry sent more than {max} bytes");
    if response.content_length().is_some_and(|n| n > max) {
        return Err(too_large());
    }
    let mut bytes = Vec::new();
    while let Some(chunk) = response
        .chunk()
        .await
        .map_err(|e| super::access::with_causes(&e))?
    {
        let needed = bytes.len() + chunk.len();
        if needed as u64 > max {
            return Err(too_large());
        }
        // Doubling, but never past the cap: a body at the cap holds the cap, not twice it.
        if needed > bytes.capacity() {
            let target = needed.max(bytes.capacity() * 2).min(max as usize);
            bytes.reserve_exact(target - bytes.len());
        }
        bytes.extend_from_slice(&chunk);
    }
    Ok(bytes)
}

/// An error answer as one short line: its status and the first code and message of the
/// registry's error envelope, else the start of its body. Only [`MAX_ERROR_BODY`] is read.
async fn status_error(url: &str, mut response: reqwest::Response) -> ReadError {
    let status = response.status();
    let mut body = Vec::new();
    while let Ok(Some(chunk)) = response.chunk().await {
        let room = MAX_ERROR_BODY as usize - body.len();
        body.extend_from_slice(&chunk[..chunk.len().min(room)]);
        if body.len() >= MAX_ERROR_BODY as usize {
            break;
        }
    }
    #[derive(serde::Deserialize)]
    struct Envelope {
        errors: Vec<Entry>,
    }
    #[derive(serde::Deserialize)]
    struct Entry {
        code: String,
        #[serde(default)]
        message: String,
    }
    let envelope = serde_json::from_slice::<Envelope>(&body).ok();
    let first = envelope.as_ref().and_then(|e| e.errors.first());
    let said = match first {
        Some(entry) => format!("{}: {}", short(&entry.code), short(&entry.message)),
        None => short(&String::from_utf8_lossy(&body)),
    };
    ReadError {
        status: Some(status.as_u16()),
        code: first.map(|e| e.code.clone()),
        message: format!("GET {url}: HTTP {status}: {said}"),
    }
}

/// A registry's own words, cut to [`MAX_ERROR_TEXT`] characters on one line.
pub fn short(text: &str) -> String {
    crate::text::cut(text, MAX_ERROR_TEXT)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn challenges_are_parsed_with_quoted_and_bare_values() {
        let (scheme, params) = parse_challenge(
            r#"Bearer realm="https://auth.example/token",service="registry.example",scope="repository:a/b:pull,push""#,
        );
        assert_eq!(scheme, "Bearer");
        assert_eq!(
            params,
            vec![
                ("realm".into(), "https://auth.example/token".into()),
                ("service".into(), "registry.example".into()),
                ("scope".into(), "repository:a/b:pull,push".into()),
            ]
        );
        let (scheme, params) = parse_challenge("Basic realm=Registry");
        assert_eq!(scheme, "Basic");
        assert_eq!(params, vec![("realm".into(), "Registry".into())]);
    }
}
