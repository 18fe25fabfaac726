//! The HTTP endpoint on `--metrics-addr`: `/metrics` for Prometheus, `/healthz` and `/readyz` for
//! the kubelet's probes.
//!
//! Plain HTTP/1.1 on hyper (already in the tree under tonic). It answers from memory only and
//! never waits on a module. Any pod that can reach the port can connect, so connections are
//! bounded in number (in all and per client address), one request each, with a few seconds to
//! send it. At either bound a new connection takes the place of one that has not sent its request
//! yet (a request, once read, is answered at once): at an address's own bound, its oldest; at the
//! global bound, the oldest of the address holding the most. Clients that open connections and
//! send nothing therefore cannot keep the kubelet's probes out: a probe comes from an address
//! holding one connection, sends its request as soon as it connects, and is never the one closed
//! while any address holds more.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::Full;
use hyper::body::Bytes;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use std::sync::atomic::{AtomicU64, Ordering};
use tokio::net::TcpListener;

use tokio::sync::{Notify, watch};

/// What the endpoint reports; the agent implements it.
pub trait Endpoints: Send + Sync + 'static {
    /// The Prometheus text exposition.
    fn metrics(&self) -> String;
    /// Ok when the agent's loops are alive; otherwise what is not.
    fn live(&self) -> Result<(), String>;
    /// Ok when every loaded module serves and is registered; otherwise what is missing.
    fn ready(&self) -> Result<(), String>;
}

/// Connections served at once; one more takes the place of the oldest idle one.
const MAX_CONNECTIONS: usize = 128;
/// Connections served at once from one client address (the kubelet probes from the node's).
const MAX_PER_PEER: usize = 8;
/// How long a client has to send its request's headers.
const HEADER_TIMEOUT: Duration = Duration::from_secs(5);
/// How long one connection may stay open in all.
const CONNECTION_LIFETIME: Duration = Duration::from_secs(30);

/// The OpenMetrics text format `prometheus-client` writes (Prometheus asks for it).
const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Serves until `stop`.
pub async fn serve(
    listener: TcpListener,
    endpoints: Arc<dyn Endpoints>,
    mut stop: watch::Receiver<bool>,
) {
    let open = Arc::new(Open::default());
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = stop.wait_for(|s| *s) => return,
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(e) => {
                // Out of file descriptors, say: don't spin on it.
                tracing::warn!("metrics endpoint: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let endpoints = endpoints.clone();
        // Over a bound with no connection to make room, the new one is closed unanswered.
        let Some(seat) = Open::admit(&open, peer.ip(), millis_since(*START)) else {
            continue;
        };
        tokio::spawn(async move {
            let (requested, closed) = (seat.requested.clone(), seat.close.clone());
            let _seat = seat;
            let service = hyper::service::service_fn(move |request| {
                requested.store(millis_since(*START), Ordering::Relaxed);
                let response = respond(endpoints.as_ref(), &request);
                async move { Ok::<_, Infallible>(response) }
            });
            let connection = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT)
                .keep_alive(false)
                .serve_connection(TokioIo::new(stream), service);
            tokio::select! {
                _ = tokio::time::timeout(CONNECTION_LIFETIME, connection) => {}
                () = closed.notified() => {}
            }
        });
    }
}

/// How long a client may take to read its answer before its connection may make room for
/// another: a probe's answer is a few bytes and is taken at once.
const ANSWER_GRACE: Duration = Duration::from_secs(1);

/// When the endpoint's clock started: request times are kept as milliseconds since.
static START: std::sync::LazyLock<std::time::Instant> =
    std::sync::LazyLock::new(std::time::Instant::now);

fn millis_since(start: std::time::Instant) -> u64 {
    u64::try_from(start.elapsed().as_millis())
        .unwrap_or(u64::MAX)
        .max(1)
}

/// The open connections, oldest first.
#[derive(Default)]
struct Open(std::sync::Mutex<OpenSet>);

#[derive(Default)]
struct OpenSet {
    next: u64,
    by_age: std::collections::BTreeMap<u64, Connection>,
}

struct Connection {
    ip: std::net::IpAddr,
    /// When its request was read (ms since [`START`]); 0 while none was.
    requested: Arc<AtomicU64>,
    /// Tells its task to close it.
    close: Arc<Notify>,
}

impl Connection {
    /// Whether it may make room for another: it has sent no request, or its client has not
    /// taken its answer within [`ANSWER_GRACE`].
    fn evictable(&self, now: u64) -> bool {
        match self.requested.load(Ordering::Relaxed) {
            0 => true,
            at => now.saturating_sub(at) > ANSWER_GRACE.as_millis() as u64,
        }
    }
}

/// A connection's place in [`Open`], given back when its task ends.
struct Seat {
    open: Arc<Open>,
    id: u64,
    requested: Arc<AtomicU64>,
    close: Arc<Notify>,
}

impl Open {
    fn lock(&self) -> std::sync::MutexGuard<'_, OpenSet> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Makes room for a connection from `ip` and gives it a seat; None when a bound is reached
    /// and no connection counted against it may make room. `now` is ms since [`START`].
    fn admit(open: &Arc<Open>, ip: std::net::IpAddr, now: u64) -> Option<Seat> {
        let mut set = open.lock();
        let from_peer = set.by_age.values().filter(|c| c.ip == ip).count();
        if from_peer >= MAX_PER_PEER && !set.evict(Some(ip), now) {
            return None;
        }
        if set.by_age.len() >= MAX_CONNECTIONS && !set.evict(None, now) {
            return None;
        }
        let id = set.next;
        set.next += 1;
        let (requested, close) = (Arc::new(AtomicU64::new(0)), Arc::new(Notify::new()));
        set.by_age.insert(
            id,
            Connection {
                ip,
                requested: requested.clone(),
                close: close.clone(),
            },
        );
        Some(Seat {
            open: open.clone(),
            id,
            requested,
            close,
        })
    }
}

impl OpenSet {
    /// Closes one connection that may make room: from `ip` when given, else from the address
    /// holding the most such connections (the oldest address first among equals); of those, the
    /// oldest. A probe from an address with few connections is thus never the one closed while
    /// another address holds more.
    fn evict(&mut self, ip: Option<std::net::IpAddr>, now: u64) -> bool {
        let from = match ip {
            Some(ip) => ip,
            None => {
                let mut counts: Vec<(std::net::IpAddr, usize)> = Vec::new();
                for c in self.by_age.values().filter(|c| c.evictable(now)) {
                    match counts.iter_mut().find(|(ip, _)| *ip == c.ip) {
                        Some((_, n)) => *n += 1,
                        None => counts.push((c.ip, 1)),
                    }
                }
                // `max_by_key` keeps the last of equals; reversed, the first (oldest) wins.
                let Some((ip, _)) = counts.into_iter().rev().max_by_key(|(_, n)| *n) else {
                    return false;
                };
                ip
            }
        };
        let oldest = self
            .by_age
            .iter()
            .find(|(_, c)| c.ip == from && c.evictable(now))
            .map(|(id, _)| *id);
        let Some(connection) = oldest.and_then(|id| self.by_age.remove(&id)) else {
            return false;
        };
        // A permit is kept if its task is not waiting yet: it closes as soon as it looks.
        connection.close.notify_one();
        true
    }
}

impl Drop for Seat {
    fn drop(&mut self) {
        self.open.lock().by_age.remove(&self.id);
    }
}

/// `GET path` on a new connection, as a probe or a scraper asks it: the status code and the
/// body. What the demo, the scenario tests and the benchmarks ask the endpoint with.
pub async fn get(addr: std::net::SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut conn = tokio::net::TcpStream::connect(addr).await?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    conn.write_all(request.as_bytes()).await?;
    let mut response = String::new();
    conn.read_to_string(&mut response).await?;
    let invalid = || std::io::Error::new(std::io::ErrorKind::InvalidData, "not an HTTP response");
    let (head, body) = response.split_once("\r\n\r\n").ok_or_else(invalid)?;
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(invalid)?;
    Ok((status, body.to_owned()))
}

fn respond<B>(endpoints: &dyn Endpoints, request: &Request<B>) -> Response<Full<Bytes>> {
    if request.method() != Method::GET && request.method() != Method::HEAD {
        return text(StatusCode::METHOD_NOT_ALLOWED, "only GET\n".into());
    }
    match request.uri().path() {
        "/metrics" => {
            let mut response = text(StatusCode::OK, endpoints.metrics());
            if let Ok(kind) = OPENMETRICS.parse() {
                response
                    .headers_mut()
                    .insert(hyper::header::CONTENT_TYPE, kind);
            }
            response
        }
        "/healthz" => probe(endpoints.live()),
        "/readyz" => probe(endpoints.ready()),
        _ => text(
            StatusCode::NOT_FOUND,
            "not found: try /metrics, /healthz or /readyz\n".into(),
        ),
    }
}

fn probe(verdict: Result<(), String>) -> Response<Full<Bytes>> {
    match verdict {
        Ok(()) => text(StatusCode::OK, "ok\n".into()),
        Err(why) => text(StatusCode::SERVICE_UNAVAILABLE, format!("{why}\n")),
    }
}

fn text(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    if let Ok(kind) = "text/plain; charset=utf-8".parse() {
        response
            .headers_mut()
            .insert(hyper::header::CONTENT_TYPE, kind);
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Stub;

    impl Endpoints for Stub {
        fn metrics(&self) -> String {
            "# EOF\n".into()
        }
        fn live(&self) -> Result<(), String> {
            Ok(())
        }
        fn ready(&self) -> Result<(), String> {
            Err("devicelet.io/fuse (module `generic-dev`) is not registered".into())
        }
    }

    fn get(method: Method, path: &str) -> Response<Full<Bytes>> {
        let request = Request::builder()
            .method(method)
            .uri(path)
            .body(())
            .expect("a request");
        respond(&Stub, &request)
    }

    #[test]
    fn at_the_bound_idle_or_stalled_connections_make_room_never_a_fresh_answer() {
        let open = Arc::new(Open::default());
        let ip = |n: u8| std::net::IpAddr::from([10, 0, 0, n]);
        let open_now = |seats: &[Seat]| {
            let set = open.lock();
            seats
                .iter()
                .filter(|s| set.by_age.contains_key(&s.id))
                .count()
        };
        // 16 addresses fill the endpoint; each has sent its request at 1 ms and not read the
        // answer since (a client with a closed window).
        let mut stalled = Vec::new();
        for n in 0..16 {
            for _ in 0..MAX_PER_PEER {
                let seat = Open::admit(&open, ip(n), 1).expect("room");
                seat.requested.store(1, Ordering::Relaxed);
                stalled.push(seat);
            }
        }
        // While their answers are fresh, nothing makes room.
        assert!(Open::admit(&open, ip(200), 500).is_none());
        // Past the grace, a probe from the node's address takes the place of one of them.
        let probe = Open::admit(&open, ip(200), 5_000).expect("the probe gets in");
        assert_eq!(open_now(&stalled), MAX_CONNECTIONS - 1);
        probe.requested.store(5_000, Ordering::Relaxed);
        // Answered just now, the probe never makes room for newcomers from 50 more addresses:
        // stalled and idle connections go, from whichever address holds the most.
        let mut newcomers = Vec::new();
        for n in 0..200u8 {
            if let Some(seat) = Open::admit(&open, ip(100 + n % 50), 5_500) {
                newcomers.push(seat);
            }
        }
        assert_eq!(newcomers.len(), 200, "each made room for itself");
        assert!(
            open.lock().by_age.contains_key(&probe.id),
            "the probe stays"
        );
        assert!(
            open_now(&stalled) < MAX_CONNECTIONS / 2,
            "stalled ones made room"
        );
        assert_eq!(open.lock().by_age.len(), MAX_CONNECTIONS);
    }

    #[test]
    fn each_path_answers_what_it_owns() {
        let metrics = get(Method::GET, "/metrics");
        assert_eq!(metrics.status(), StatusCode::OK);
        assert_eq!(metrics.headers()[hyper::header::CONTENT_TYPE], OPENMETRICS);
        assert_eq!(get(Method::GET, "/healthz").status(), StatusCode::OK);
        assert_eq!(
            get(Method::GET, "/readyz").status(),
            StatusCode::SERVICE_UNAVAILABLE
        );
        assert_eq!(get(Method::GET, "/other").status(), StatusCode::NOT_FOUND);
        assert_eq!(
            get(Method::POST, "/metrics").status(),
            StatusCode::METHOD_NOT_ALLOWED
        );
    }
}
