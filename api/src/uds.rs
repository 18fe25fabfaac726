//! gRPC over Unix sockets, the only transport the kubelet uses for plugins.

use std::io;
use std::path::{Path, PathBuf};

use hyper_util::rt::TokioIo;
use tokio::net::{UnixListener, UnixStream};
use tonic::transport::{Channel, Endpoint, Uri};

/// Dials a gRPC server on a Unix socket the way the kubelet does (`:authority` = `localhost`).
///
/// The connection is made lazily per request retry by tonic's reconnect logic, so the caller
/// sees a failed first call, not a hang, when nothing listens.
pub async fn connect(path: &Path) -> Result<Channel, tonic::transport::Error> {
    let path: PathBuf = path.to_owned();
    Endpoint::from_static("http://localhost")
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move { Ok::<_, io::Error>(TokioIo::new(UnixStream::connect(path).await?)) }
        }))
        .await
}

/// A client of the gRPC server on a Unix socket that connects on first use and again after
/// every lost connection, as grpc-go's `NewClient` does (the kubelet's DRA plugin manager dials
/// drivers this way): nothing fails until a call is made.
pub fn connect_lazy(path: &Path) -> Channel {
    let path: PathBuf = path.to_owned();
    Endpoint::from_static("http://localhost").connect_with_connector_lazy(tower::service_fn(
        move |_: Uri| {
            let path = path.clone();
            async move { Ok::<_, io::Error>(TokioIo::new(UnixStream::connect(path).await?)) }
        },
    ))
}

/// Binds a Unix socket, replacing a stale file left by an earlier process: a stale file makes
/// clients fail with "connection refused" instead of reaching us.
pub fn bind(path: &Path) -> io::Result<UnixListener> {
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    UnixListener::bind(path)
}
