//! A hostile OCI distribution registry on 127.0.0.1, for the scenarios that check the agent caps
//! and deadlines every registry read: a manifest that never ends, one that trickles in, error
//! bodies and bearer tokens far larger than any real one, and a well-behaved registry to compare
//! against. It speaks just enough HTTP/1.1 for the agent's client: GET and HEAD only, one request
//! per connection, `Connection: close`.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

const MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
const JSON: &str = "application/json";
/// Bodies go out in chunks this size, so a client that hangs up stops the writing soon.
const CHUNK: usize = 64 * 1024;
/// A request line and headers beyond this are cut off: no client of ours sends more.
const HEADER_CAP: u64 = 16 * 1024;

/// What the hostile registry answers.
pub enum Answer {
    /// Every manifest GET: 200, `Content-Length: bytes`, then `bytes` bytes of JSON-ish filler,
    /// in 64 KiB chunks until the client hangs up.
    Huge { bytes: u64 },
    /// Every manifest GET: 200 with headers at once, then `body` at `per_second` bytes a second
    /// (a tenth of that every 100 ms).
    Trickle { body: Vec<u8>, per_second: usize },
    /// Every request under /v2/<repo>/: `status` with `bytes` bytes of an OCI error envelope.
    ErrorBody { status: u16, bytes: u64 },
    /// Every /v2/ request without a bearer token: 401 with a challenge whose realm is GET /token,
    /// which answers a token response `bytes` bytes long. With a bearer token: 404.
    TokenFlood { bytes: u64 },
    /// A well-behaved registry for these manifests (media type, bytes), tags (tag, index into
    /// `manifests`) and blobs, each found by its digest.
    Serve {
        manifests: Vec<(String, Vec<u8>)>,
        tags: Vec<(String, usize)>,
        blobs: Vec<Vec<u8>>,
    },
}

pub struct HostileRegistry {
    /// `127.0.0.1:<port>`: the registry's host as an `oci://` source names it.
    pub addr: String,
    /// Body bytes written so far to clients (all answers together), so a scenario can show the
    /// client stopped reading long before the end.
    pub sent: Arc<AtomicU64>,
    /// Requests seen, as "METHOD path" lines (the path without its query).
    pub requests: Arc<Mutex<Vec<String>>>,
    /// Every `User-Agent` the requests carried (empty for one without).
    pub user_agents: Arc<Mutex<std::collections::BTreeSet<String>>>,
    socket: SocketAddr,
    stop: Arc<AtomicBool>,
    listener: Option<JoinHandle<()>>,
}

/// What every connection's thread shares.
struct Shared {
    answer: Answer,
    addr: String,
    sent: Arc<AtomicU64>,
    requests: Arc<Mutex<Vec<String>>>,
    user_agents: Arc<Mutex<std::collections::BTreeSet<String>>>,
}

impl HostileRegistry {
    pub fn start(answer: Answer) -> HostileRegistry {
        let listener = TcpListener::bind("127.0.0.1:0").expect("a port for the hostile registry");
        let socket = listener.local_addr().expect("its address");
        let (sent, requests) = (
            Arc::new(AtomicU64::new(0)),
            Arc::new(Mutex::new(Vec::new())),
        );
        let stop = Arc::new(AtomicBool::new(false));
        let user_agents = Arc::new(Mutex::new(std::collections::BTreeSet::new()));
        let shared = Arc::new(Shared {
            answer,
            addr: socket.to_string(),
            sent: sent.clone(),
            requests: requests.clone(),
            user_agents: user_agents.clone(),
        });
        let stopped = stop.clone();
        // A thread per connection: a trickled or huge answer must not hold up the next request.
        let listener = std::thread::spawn(move || {
            for stream in listener.incoming() {
                if stopped.load(Ordering::Relaxed) {
                    return;
                }
                let Ok(stream) = stream else { continue };
                let shared = shared.clone();
                std::thread::spawn(move || serve(&stream, &shared));
            }
        });
        HostileRegistry {
            addr: socket.to_string(),
            sent,
            requests,
            user_agents,
            socket,
            stop,
            listener: Some(listener),
        }
    }
}

impl Drop for HostileRegistry {
    /// Stops accepting: the wake-up connect makes the accept loop see the flag. Connection threads
    /// end on their own, when a write fails (or times out) or their answer is done.
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Joined only when the wake-up got through, so a drop never hangs.
        if TcpStream::connect(self.socket).is_ok()
            && let Some(listener) = self.listener.take()
        {
            let _ = listener.join();
        }
    }
}

/// `sha256:<hex>` of `bytes`.
pub fn digest_of(bytes: &[u8]) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let digest = ring::digest::digest(&ring::digest::SHA256, bytes);
    let mut out = String::from("sha256:");
    for byte in digest.as_ref() {
        out.push(char::from(HEX[usize::from(byte >> 4)]));
        out.push(char::from(HEX[usize::from(byte & 15)]));
    }
    out
}

struct Request {
    method: String,
    path: String,
    bearer: bool,
    agent: String,
}

/// The request line and headers; any body is ignored (GET and HEAD have none).
fn read_request(stream: &TcpStream) -> Option<Request> {
    let mut reader = BufReader::new(Read::take(stream, HEADER_CAP));
    let mut first = String::new();
    reader.read_line(&mut first).ok()?;
    let mut parts = first.split_whitespace();
    let (method, target) = (parts.next()?.to_owned(), parts.next()?);
    let path = target
        .split_once('?')
        .map_or(target, |(path, _)| path)
        .to_owned();
    let mut bearer = false;
    let mut agent = String::new();
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 || line.trim().is_empty() {
            break;
        }
        if let Some((name, value)) = line.split_once(':')
            && name.trim().eq_ignore_ascii_case("authorization")
        {
            let scheme = value.trim().get(..7);
            bearer = scheme.is_some_and(|s| s.eq_ignore_ascii_case("bearer "));
        }
        if let Some((name, value)) = line.split_once(':')
            && name.trim().eq_ignore_ascii_case("user-agent")
        {
            agent = value.trim().to_owned();
        }
    }
    Some(Request {
        method,
        path,
        bearer,
        agent,
    })
}

/// `/v2/<repo>/manifests/<reference>` or `/v2/<repo>/blobs/<digest>` → (repo, whether a
/// manifest, reference). The repository may hold slashes: the last marker splits.
fn object(path: &str) -> Option<(&str, bool, &str)> {
    let rest = path.strip_prefix("/v2/")?;
    let (at, manifest) = match (rest.rfind("/manifests/"), rest.rfind("/blobs/")) {
        (Some(m), Some(b)) if b > m => (b, false),
        (Some(m), _) => (m, true),
        (None, Some(b)) => (b, false),
        (None, None) => return None,
    };
    let skip = if manifest { "/manifests/" } else { "/blobs/" }.len();
    let (repo, reference) = (&rest[..at], &rest[at + skip..]);
    (!repo.is_empty() && !reference.is_empty()).then_some((repo, manifest, reference))
}

/// Answers one request, then the connection closes.
fn serve(stream: &TcpStream, shared: &Shared) {
    // Bounds a client that stops reading (or never sends), so no thread hangs forever.
    let _ = stream.set_write_timeout(Some(Duration::from_secs(60)));
    let _ = stream.set_read_timeout(Some(Duration::from_secs(60)));
    let Some(request) = read_request(stream) else {
        return;
    };
    if let Ok(mut seen) = shared.requests.lock() {
        seen.push(format!("{} {}", request.method, request.path));
    }
    if let Ok(mut agents) = shared.user_agents.lock() {
        agents.insert(request.agent.clone());
    }
    let head_only = request.method == "HEAD";
    let out = Out {
        stream,
        head_only,
        sent: &shared.sent,
    };
    if request.method != "GET" && !head_only {
        out.error(405, "UNSUPPORTED");
        return;
    }
    let found = object(&request.path);
    let root = request.path == "/v2/" || request.path == "/v2";
    match (&shared.answer, found) {
        (Answer::TokenFlood { bytes }, _) => token_flood(&out, &request, found, *bytes, shared),
        (
            Answer::Serve {
                manifests, tags, ..
            },
            Some((_, true, reference)),
        ) => {
            let tagged = tags
                .iter()
                .find(|(tag, _)| tag == reference)
                .map(|(_, i)| *i);
            let index = tagged.or_else(|| {
                manifests
                    .iter()
                    .position(|(_, m)| digest_of(m) == reference)
            });
            match index.and_then(|i| manifests.get(i)) {
                Some((media_type, bytes)) => {
                    let digest = format!("Docker-Content-Digest: {}", digest_of(bytes));
                    out.whole(200, media_type, &[digest], bytes);
                }
                None => out.error(404, "MANIFEST_UNKNOWN"),
            }
        }
        (Answer::Serve { blobs, .. }, Some((_, false, reference))) => {
            match blobs.iter().find(|blob| digest_of(blob) == reference) {
                Some(blob) => out.whole(200, "application/octet-stream", &[], blob),
                None => out.error(404, "BLOB_UNKNOWN"),
            }
        }
        (_, None) if root => out.whole(200, JSON, &[], b"{}"),
        (Answer::Huge { bytes }, Some((_, true, _))) => {
            out.filler(
                200,
                MANIFEST,
                b"{\"schemaVersion\":2,\"x\":\"",
                b"\"}",
                *bytes,
            );
        }
        (Answer::Trickle { body, per_second }, Some((_, true, _))) => {
            out.trickle(body, *per_second);
        }
        (Answer::ErrorBody { status, bytes }, Some(_)) => {
            let start = b"{\"errors\":[{\"code\":\"MANIFEST_UNKNOWN\",\"message\":\"";
            out.filler(*status, JSON, start, b"\"}]}", *bytes);
        }
        (_, Some((_, false, _))) => out.error(404, "BLOB_UNKNOWN"),
        _ => out.error(404, "MANIFEST_UNKNOWN"),
    }
}

/// A challenge for every /v2/ request without a bearer token, and a huge token at its realm.
fn token_flood(
    out: &Out,
    request: &Request,
    found: Option<(&str, bool, &str)>,
    bytes: u64,
    shared: &Shared,
) {
    if request.path == "/token" {
        out.filler(200, JSON, b"{\"token\":\"", b"\"}", bytes);
    } else if !(request.path == "/v2" || request.path.starts_with("/v2/")) || request.bearer {
        out.error(404, "MANIFEST_UNKNOWN");
    } else {
        let scope = found.map_or(String::new(), |(repo, _, _)| {
            format!(",scope=\"repository:{repo}:pull\"")
        });
        let realm = format!("realm=\"http://{}/token\",service=\"hostile\"", shared.addr);
        let challenge = format!("WWW-Authenticate: Bearer {realm}{scope}");
        let body = r#"{"errors":[{"code":"UNAUTHORIZED","message":"token needed","detail":null}]}"#;
        out.whole(401, JSON, &[challenge], body.as_bytes());
    }
}

/// One connection's answer; for HEAD, headers only.
struct Out<'a> {
    stream: &'a TcpStream,
    head_only: bool,
    sent: &'a AtomicU64,
}

impl Out<'_> {
    /// The status line and headers; whether they went out.
    fn head(&self, status: u16, content_type: &str, length: u64, extra: &[String]) -> bool {
        let reason = match status {
            200 => "OK",
            401 => "Unauthorized",
            404 => "Not Found",
            405 => "Method Not Allowed",
            _ => "Hostile",
        };
        let mut head = format!(
            "HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\nContent-Length: {length}\r\nConnection: close\r\n"
        );
        for line in extra {
            head.push_str(line);
            head.push_str("\r\n");
        }
        head.push_str("\r\n");
        let mut stream = self.stream;
        stream
            .write_all(head.as_bytes())
            .and_then(|()| stream.flush())
            .is_ok()
    }

    /// Body bytes, counted in `sent` once written; whether they went out.
    fn body(&self, bytes: &[u8]) -> bool {
        let mut stream = self.stream;
        if stream
            .write_all(bytes)
            .and_then(|()| stream.flush())
            .is_err()
        {
            return false;
        }
        self.sent.fetch_add(bytes.len() as u64, Ordering::Relaxed);
        true
    }

    fn whole(&self, status: u16, content_type: &str, extra: &[String], body: &[u8]) {
        if self.head(status, content_type, body.len() as u64, extra) && !self.head_only {
            self.body(body);
        }
    }

    /// A short OCI error envelope.
    fn error(&self, status: u16, code: &str) {
        let body = format!(
            r#"{{"errors":[{{"code":"{code}","message":"hostile registry","detail":null}}]}}"#
        );
        self.whole(status, JSON, &[], body.as_bytes());
    }

    /// `total` bytes: `prefix`, 'a's, `suffix` (both cut short if `total` is), in 64 KiB chunks
    /// until a write fails.
    fn filler(&self, status: u16, content_type: &str, prefix: &[u8], suffix: &[u8], total: u64) {
        if !self.head(status, content_type, total, &[]) || self.head_only {
            return;
        }
        // Where the suffix starts: a `total` shorter than both ends cuts them short.
        let (start, tail) = (prefix.len() as u64, suffix.len() as u64);
        let tail = total.saturating_sub(tail).max(start);
        let byte = |i: u64| {
            if i < start {
                prefix[i as usize]
            } else if i >= tail {
                suffix.get((i - tail) as usize).copied().unwrap_or(b'a')
            } else {
                b'a'
            }
        };
        let plain = vec![b'a'; CHUNK];
        let mut at = 0;
        while at < total {
            let end = total.min(at + CHUNK as u64);
            let written = if at >= start && end <= tail {
                self.body(&plain[..(end - at) as usize])
            } else {
                self.body(&(at..end).map(&byte).collect::<Vec<u8>>())
            };
            if !written {
                return;
            }
            at = end;
        }
    }

    /// `body` a tenth of `per_second` every 100 ms, after the headers at once.
    fn trickle(&self, body: &[u8], per_second: usize) {
        if !self.head(200, MANIFEST, body.len() as u64, &[]) || self.head_only {
            return;
        }
        for chunk in body.chunks((per_second / 10).max(1)) {
            if !self.body(chunk) {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}
