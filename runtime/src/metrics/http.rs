//! The HTTP endpoint on `--metrics-addr`: `/metrics` for Prometheus, `/healthz` and `/readyz` for
//! the kubelet's probes.
//!
//! Plain HTTP/1.1 on hyper (already in the tree under tonic). It answers from memory only and
//! never waits on a module. Any pod that can reach the port can connect, so connections are
//! bounded in number (in all and per client address), one request each, with a few seconds to
//! send it: a client that holds connections open cannot starve the kubelet's probes for long,
//! and one that opens many from one address is turned away without touching the others.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::Full;
use hyper::body::Bytes;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, watch};

/// What the endpoint reports; the agent implements it.
pub trait Endpoints: Send + Sync + 'static {
    /// The Prometheus text exposition.
    fn metrics(&self) -> String;
    /// Ok when the agent's loops are alive; otherwise what is not.
    fn live(&self) -> Result<(), String>;
    /// Ok when every loaded module serves and is registered; otherwise what is missing.
    fn ready(&self) -> Result<(), String>;
}

/// Connections served at once; one more is closed at once.
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
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let peers = Arc::new(Peers::default());
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
        // Over either bound the connection is closed unanswered, without waiting.
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            continue;
        };
        let Some(seat) = Peers::take(&peers, peer.ip()) else {
            continue;
        };
        let endpoints = endpoints.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |request| {
                let response = respond(endpoints.as_ref(), &request);
                async move { Ok::<_, Infallible>(response) }
            });
            let connection = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT)
                .keep_alive(false)
                .serve_connection(TokioIo::new(stream), service);
            let _ = tokio::time::timeout(CONNECTION_LIFETIME, connection).await;
            drop((slot, seat));
        });
    }
}

/// Open connections per client address.
#[derive(Default)]
struct Peers(std::sync::Mutex<std::collections::HashMap<std::net::IpAddr, usize>>);

/// One open connection of a client address, given back when dropped.
struct Seat {
    peers: Arc<Peers>,
    ip: std::net::IpAddr,
}

impl Peers {
    fn take(peers: &Arc<Peers>, ip: std::net::IpAddr) -> Option<Seat> {
        let mut open = peers.0.lock().unwrap_or_else(|p| p.into_inner());
        let n = open.entry(ip).or_default();
        if *n >= MAX_PER_PEER {
            return None;
        }
        *n += 1;
        Some(Seat {
            peers: peers.clone(),
            ip,
        })
    }
}

impl Drop for Seat {
    fn drop(&mut self) {
        let mut open = self.peers.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = open.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                open.remove(&self.ip);
            }
        }
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
