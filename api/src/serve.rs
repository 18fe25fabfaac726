//! Serving gRPC on a Unix socket: one place, with the same guarantees on every socket.
//!
//! - Any `:authority` is accepted (none, `localhost`, the socket's path as the kubelet's plugin
//!   watcher and NVIDIA's device plugin send it): each connection goes through
//!   [`Rewritten::server`](crate::authority::Rewritten::server) before the HTTP/2 server parses
//!   a request.
//! - What a peer can make the server hold is bounded. A client that never reads its responses
//!   leaves them pending in the server; per connection that is at most [`MAX_STREAMS`] streams of
//!   at most [`MAX_SEND_BUFFER`] plus the one message each is sending, a listener serves at most
//!   `max_connections` at once (one more is closed at once), and a connection whose client stops
//!   reading stops answering the server's pings and is closed within [`KEEPALIVE`] plus
//!   [`KEEPALIVE_TIMEOUT`]; one that sends nothing at all is closed after [`SILENCE`].
//!
//! It is tonic's own `Server::serve_with_incoming_shutdown`, written out over hyper's HTTP/2
//! builder because tonic does not expose the per-stream send buffer.

use std::future::Future;
use std::io;
use std::pin::pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio_stream::{Stream, StreamExt};
use tonic::service::Routes;

use crate::authority::{LOCALHOST, Rewritten};

/// Requests one connection may have in flight at once. The kubelet keeps one ListAndWatch
/// stream open and makes one other call at a time per plugin.
pub const MAX_STREAMS: u32 = 8;
/// Bytes of a response the server buffers per stream beyond what the socket takes, before it
/// stops producing more for that stream (hyper's default is 400 KiB).
pub const MAX_SEND_BUFFER: usize = 64 * 1024;
/// Connections a device-plugin socket serves at once: the kubelet needs one (two, briefly,
/// across its restarts or a plugin-watcher registration).
pub const MAX_PLUGIN_CONNECTIONS: usize = 8;
/// How often the server pings a connection, and how long it waits for the answer before it
/// closes the connection: a client that stopped reading cannot hold what it left pending.
pub const KEEPALIVE: Duration = Duration::from_secs(30);
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(20);

/// How long a new connection may say nothing before it is closed: a client that connects and
/// sends no bytes cannot hold a place (the kubelet starts talking at once).
pub const SILENCE: Duration = Duration::from_secs(10);

/// A connection that notes when it first receives bytes.
struct Heard<S> {
    inner: S,
    heard: Arc<AtomicBool>,
}

impl<S: AsyncRead + Unpin> AsyncRead for Heard<S> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let read = std::pin::Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.heard.store(true, Ordering::Relaxed);
        }
        read
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Heard<S> {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        std::pin::Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Serves `routes` on the connections of `incoming`, at most `max_connections` at once, until
/// `shutdown`; then stops accepting, asks every connection to finish (HTTP/2 GOAWAY: requests in
/// flight complete) and waits for them to close.
pub async fn serve<I, IO>(
    incoming: I,
    routes: Routes,
    max_connections: usize,
    shutdown: impl Future<Output = ()>,
) where
    I: Stream<Item = io::Result<IO>>,
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let mut http = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
    http.timer(TokioTimer::new())
        .max_concurrent_streams(MAX_STREAMS)
        .max_send_buf_size(MAX_SEND_BUFFER)
        .keep_alive_interval(Some(KEEPALIVE))
        .keep_alive_timeout(KEEPALIVE_TIMEOUT);
    let service = TowerToHyperService::new(routes.prepare());
    let (stop, stopping) = watch::channel(false);
    let mut connections = JoinSet::new();
    {
        let mut incoming = pin!(incoming);
        let mut shutdown = pin!(shutdown);
        loop {
            let accepted = tokio::select! {
                () = &mut shutdown => break,
                Some(_) = connections.join_next(), if !connections.is_empty() => continue,
                accepted = incoming.next() => accepted,
            };
            let io = match accepted {
                None => break,
                Some(Ok(io)) => io,
                Some(Err(e)) => {
                    // Out of file descriptors, say: don't spin on it.
                    tracing::warn!("accepting a connection: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            if connections.len() >= max_connections {
                tracing::debug!("{max_connections} connections open: closing a new one");
                continue;
            }
            let heard = Arc::new(AtomicBool::new(false));
            let io = Heard {
                inner: Rewritten::server(io, LOCALHOST),
                heard: heard.clone(),
            };
            let connection = http.serve_connection(TokioIo::new(io), service.clone());
            let mut stopping = stopping.clone();
            connections.spawn(async move {
                let mut connection = pin!(connection);
                let silent = async {
                    tokio::time::sleep(SILENCE).await;
                    if heard.load(Ordering::Relaxed) {
                        std::future::pending::<()>().await;
                    }
                };
                tokio::select! {
                    _ = connection.as_mut() => return,
                    // It holds a place and says nothing: make room.
                    () = silent => return,
                    _ = stopping.wait_for(|s| *s) => {}
                }
                connection.as_mut().graceful_shutdown();
                let _ = connection.await;
            });
        }
        // `incoming` goes here: no connection is accepted while the others finish.
    }
    stop.send_replace(true);
    while connections.join_next().await.is_some() {}
}

#[cfg(test)]
mod tests {
    use std::pin::Pin;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{UnixListener, UnixStream};
    use tokio_stream::wrappers::UnixListenerStream;
    use tonic::{Request, Response, Status};

    use super::*;
    use crate::authority::{put_head, put_literal};
    use crate::deviceplugin::device_plugin_server::{DevicePlugin, DevicePluginServer};
    use crate::deviceplugin::*;

    /// Counts what the server asked of it: ListAndWatch streams started and snapshots produced
    /// (each about 100 KB, as many as the server pulls).
    #[derive(Clone, Default)]
    struct Plugin {
        streams: Arc<AtomicUsize>,
        snapshots: Arc<AtomicUsize>,
    }

    type Snapshots = Pin<Box<dyn Stream<Item = Result<ListAndWatchResponse, Status>> + Send>>;

    #[tonic::async_trait]
    impl DevicePlugin for Plugin {
        async fn get_device_plugin_options(
            &self,
            _: Request<Empty>,
        ) -> Result<Response<DevicePluginOptions>, Status> {
            Ok(Response::new(DevicePluginOptions::default()))
        }

        type ListAndWatchStream = Snapshots;

        async fn list_and_watch(&self, _: Request<Empty>) -> Result<Response<Snapshots>, Status> {
            self.streams.fetch_add(1, Ordering::SeqCst);
            let snapshots = self.snapshots.clone();
            let big = ListAndWatchResponse {
                devices: (0..1000)
                    .map(|i| Device {
                        id: format!("{i:0>90}"),
                        health: HEALTHY.into(),
                        topology: None,
                    })
                    .collect(),
            };
            let stream = tokio_stream::iter(std::iter::repeat(big)).map(move |snapshot| {
                snapshots.fetch_add(1, Ordering::SeqCst);
                Ok(snapshot)
            });
            Ok(Response::new(Box::pin(stream)))
        }

        async fn get_preferred_allocation(
            &self,
            _: Request<PreferredAllocationRequest>,
        ) -> Result<Response<PreferredAllocationResponse>, Status> {
            Err(Status::unimplemented("no"))
        }

        async fn allocate(
            &self,
            _: Request<AllocateRequest>,
        ) -> Result<Response<AllocateResponse>, Status> {
            Err(Status::unimplemented("no"))
        }

        async fn pre_start_container(
            &self,
            _: Request<PreStartContainerRequest>,
        ) -> Result<Response<PreStartContainerResponse>, Status> {
            Err(Status::unimplemented("no"))
        }
    }

    fn start(max_connections: usize) -> (tempfile::TempDir, std::path::PathBuf, Plugin) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("plugin.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let plugin = Plugin::default();
        let routes = Routes::new(DevicePluginServer::new(plugin.clone()));
        let incoming = UnixListenerStream::new(listener);
        tokio::spawn(serve(
            incoming,
            routes,
            max_connections,
            std::future::pending(),
        ));
        (dir, path, plugin)
    }

    const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

    /// A client's opening: the preface, and the largest flow-control windows HTTP/2 allows, so
    /// that only the server's own bounds hold its output back.
    fn opening() -> Vec<u8> {
        let mut out = PREFACE.to_vec();
        let window: u32 = (1 << 31) - 1;
        let mut settings = vec![0x00, 0x04];
        settings.extend_from_slice(&window.to_be_bytes());
        put_head(&mut out, settings.len(), 0x4, 0, 0);
        out.extend(settings);
        put_head(&mut out, 4, 0x8, 0, 0);
        out.extend_from_slice(&(window - 65_535).to_be_bytes());
        out
    }

    /// A gRPC call with an empty message on `stream`, `authority` (None: no `:authority`).
    fn call(out: &mut Vec<u8>, stream: u32, path: &str, authority: Option<&str>) {
        let mut block = Vec::new();
        let mut fields = vec![(":method", "POST"), (":scheme", "http"), (":path", path)];
        if let Some(authority) = authority {
            fields.push((":authority", authority));
        }
        fields.extend([("content-type", "application/grpc"), ("te", "trailers")]);
        for (name, value) in fields {
            put_literal(&mut block, 0x00, name.as_bytes(), value.as_bytes());
        }
        put_head(out, block.len(), 0x1, 0x4, stream);
        out.extend(block);
        put_head(out, 5, 0x0, 0x1, stream);
        out.extend([0u8; 5]);
    }

    /// Reads frames until stream 1 gets its response headers (true) or is reset (false).
    async fn answered(conn: &mut UnixStream) -> bool {
        loop {
            let mut head = [0u8; 9];
            conn.read_exact(&mut head).await.unwrap();
            let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
            let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
            let mut payload = vec![0u8; len];
            conn.read_exact(&mut payload).await.unwrap();
            match (head[3], stream) {
                (0x1, 1) => return true,
                (0x3, 1) => return false,
                _ => {}
            }
        }
    }

    #[tokio::test]
    async fn requests_are_answered_whatever_their_authority() {
        let (_dir, path, _) = start(8);
        let socket = path.to_str().unwrap();
        for authority in [
            None,
            Some("localhost"),
            Some(socket),
            Some("%2Fvar%2Fx.sock"),
        ] {
            let mut conn = UnixStream::connect(&path).await.unwrap();
            let mut out = opening();
            call(
                &mut out,
                1,
                "/v1beta1.DevicePlugin/GetDevicePluginOptions",
                authority,
            );
            conn.write_all(&out).await.unwrap();
            assert!(answered(&mut conn).await, "{authority:?} was refused");
        }
    }

    #[tokio::test]
    async fn a_connection_over_the_cap_is_closed_at_once() {
        let (_dir, path, _) = start(2);
        let mut held = Vec::new();
        for _ in 0..2 {
            let mut conn = UnixStream::connect(&path).await.unwrap();
            conn.write_all(&opening()).await.unwrap();
            held.push(conn);
        }
        let mut third = UnixStream::connect(&path).await.unwrap();
        let mut buf = [0u8; 64];
        assert_eq!(third.read(&mut buf).await.unwrap(), 0, "closed unanswered");
        // The held ones are served.
        let mut out = Vec::new();
        call(
            &mut out,
            1,
            "/v1beta1.DevicePlugin/GetDevicePluginOptions",
            None,
        );
        held[0].write_all(&out).await.unwrap();
        assert!(answered(&mut held[0]).await);
    }

    /// Eight connections that never say a word would hold every place the kubelet has: each is
    /// closed after [`SILENCE`], and a talking one never is.
    #[tokio::test]
    async fn a_connection_that_says_nothing_is_closed() {
        let (_dir, path, _) = start(8);
        let mut silent = UnixStream::connect(&path).await.unwrap();
        let mut talking = UnixStream::connect(&path).await.unwrap();
        talking.write_all(&opening()).await.unwrap();
        // The server's own SETTINGS come first; then, at the end of the silence, the end.
        let mut got = Vec::new();
        tokio::time::timeout(SILENCE * 3, silent.read_to_end(&mut got))
            .await
            .expect("closed")
            .unwrap();
        let mut out = Vec::new();
        call(
            &mut out,
            1,
            "/v1beta1.DevicePlugin/GetDevicePluginOptions",
            None,
        );
        talking.write_all(&out).await.unwrap();
        assert!(answered(&mut talking).await, "the talking one is served");
    }

    /// The attack: one connection, huge flow-control windows, 64 ListAndWatch streams whose
    /// responses are never read. The server takes at most [`MAX_STREAMS`] of them and produces,
    /// per stream, only what its send buffer holds.
    #[tokio::test]
    async fn a_client_that_never_reads_cannot_make_the_server_hold_much() {
        let (_dir, path, plugin) = start(8);
        let mut conn = UnixStream::connect(&path).await.unwrap();
        let mut out = opening();
        for i in 0..64 {
            call(
                &mut out,
                2 * i + 1,
                "/v1beta1.DevicePlugin/ListAndWatch",
                Some("localhost"),
            );
        }
        conn.write_all(&out).await.unwrap();
        // Production stops once every buffer is full; without the bounds it runs on into the
        // hundreds of megabytes within that time.
        let (mut last, mut still) = (usize::MAX, 0);
        for _ in 0..400 {
            tokio::time::sleep(Duration::from_millis(50)).await;
            let now = plugin.snapshots.load(Ordering::SeqCst);
            still = if now == last { still + 1 } else { 0 };
            if still == 4 {
                break;
            }
            last = now;
        }
        let streams = plugin.streams.load(Ordering::SeqCst);
        let snapshots = plugin.snapshots.load(Ordering::SeqCst);
        assert!(streams <= MAX_STREAMS as usize, "{streams} streams");
        // A snapshot is ~100 KB: per stream one being sent past the 64 KiB buffer, one more
        // pulled, and what the socket itself took.
        assert!(
            snapshots <= streams * 3 + 4,
            "{snapshots} snapshots for {streams} streams"
        );
    }
}
