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

/// [`bind`], with the socket file made 0600 (only its owner, and root, may connect) from the
/// moment it appears: the mode is set on the socket before `bind` creates the file (Linux takes
/// it from there, less the umask), so there is no moment, as with a `chmod` after `bind`, in
/// which another user could connect.
pub fn bind_private(path: &Path) -> io::Result<UnixListener> {
    use socket2::{Domain, SockAddr, Socket, Type};
    use std::os::fd::AsRawFd as _;
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let socket = Socket::new(Domain::UNIX, Type::STREAM, None)?;
    // SAFETY: fchmod on a descriptor we own; it touches no memory.
    if unsafe { libc::fchmod(socket.as_raw_fd(), 0o600) } != 0 {
        return Err(io::Error::last_os_error());
    }
    socket.bind(&SockAddr::unix(path)?)?;
    socket.listen(1024)?;
    socket.set_nonblocking(true)?;
    UnixListener::from_std(socket.into())
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt as _;

    #[tokio::test]
    async fn a_private_socket_is_0600_from_the_start_whatever_the_umask() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.sock");
        // SAFETY: umask has no memory effects. (Sockets other tests bind meanwhile get a wider
        // mode, which none of them checks.)
        let old = unsafe { libc::umask(0) };
        let bound = super::bind_private(&path);
        unsafe { libc::umask(old) };
        bound.unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        // A stale file is replaced.
        super::bind_private(&path).unwrap();
    }
}
