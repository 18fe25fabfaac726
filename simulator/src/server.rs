//! Serving `kubelet.sock` and the PodResources socket, and what the kubelet does to its
//! directory when it (re)starts.
//!
//! # `kubelet.sock` before it accepts connections
//!
//! A restarting kubelet creates `kubelet.sock` a moment before it accepts connections on it
//! (KUBELET.md §7): a plugin that reacts to the file appearing can dial too early. The simulator
//! widens that moment to [`SimConfig::accept_delay`](super::SimConfig::accept_delay) and
//! reproduces it at the socket level: the socket is *bound* (the file exists) but not yet
//! *listening*, so a connection attempt fails at once with `ECONNREFUSED` — what a client sees
//! on a node between the kubelet's `bind` and `listen`. After the delay the same socket starts
//! listening and gRPC is served on it. This needs `socket`/`bind`/`listen` as separate calls,
//! which std and tokio do not offer (their `bind` also listens), hence the few `libc` calls below.
//!
//! The alternative, listening at once but serving only after the delay, lets connections complete
//! and then leaves the gRPC call hanging until the server starts; a plugin that simply waits
//! would pass, while one with a short deadline fails only by chance. Refusing connections is the
//! behaviour a plugin must be ready for ("retry quickly"), so that is the one simulated.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, PoisonError};
use std::time::Duration;

use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::service::Routes;
use tracing::{debug, info, warn};

use devicelet_api::deviceplugin::registration_server::RegistrationServer;
use devicelet_api::podresources::pod_resources_lister_server::PodResourcesListerServer;
use devicelet_api::serve as grpc;

use super::Inner;
use super::error::SimError;
use super::events::SimEvent;
use super::podresources::PodResourcesService;
use super::registration::RegistrationService;

/// The kubelet's checkpoint file, the one thing it keeps when it cleans its directory.
pub(super) const CHECKPOINT: &str = "kubelet_internal_checkpoint";

/// How long a stop waits for open connections to finish before cutting them.
const DRAIN: Duration = Duration::from_millis(500);

/// A running gRPC server on a Unix socket.
pub(super) struct ServerHandle {
    shutdown: oneshot::Sender<()>,
    task: JoinHandle<()>,
}

impl ServerHandle {
    /// Stops accepting at once; used where nothing can be awaited (drop).
    pub fn abort(self) {
        self.task.abort();
    }

    /// Stops accepting; open connections get a moment to finish and are then cut.
    pub async fn stop(self) {
        let ServerHandle { shutdown, mut task } = self;
        let _ = shutdown.send(());
        if tokio::time::timeout(DRAIN, &mut task).await.is_err() {
            debug!("simulated kubelet: connections still open after {DRAIN:?}; cutting them");
            task.abort();
            let _ = task.await;
        }
    }
}

fn io_error(path: &Path) -> impl FnOnce(io::Error) -> SimError {
    let path = path.to_owned();
    move |source| SimError::Io { path, source }
}

/// Binds `kubelet.sock` and serves `Registration` on it for a new incarnation of the kubelet.
/// The socket file exists when this returns; connections are accepted after `accept_delay`
/// (at once if zero).
pub(super) fn serve(inner: &Arc<Inner>, accept_delay: Duration) -> Result<(), SimError> {
    let bound = bind_unlistening(&inner.socket).map_err(io_error(&inner.socket))?;
    let listener = if accept_delay.is_zero() {
        Listener::Ready(bound.listen().map_err(io_error(&inner.socket))?)
    } else {
        Listener::After(bound, accept_delay)
    };
    let epoch = inner.next_epoch();
    let service = RegistrationServer::new(RegistrationService {
        inner: Arc::clone(inner),
        epoch,
    });
    let router = Routes::new(service);
    let on_listen = {
        let inner = Arc::clone(inner);
        move || {
            let _registry = inner.lock();
            if inner.epoch() == epoch {
                info!(
                    "simulated kubelet accepts connections on {}",
                    inner.socket.display()
                );
                inner.notify(Some(SimEvent::Serving));
            }
        }
    };
    let handle = spawn(router, inner.socket.clone(), listener, on_listen);
    let previous = inner
        .server
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .replace(handle);
    if let Some(previous) = previous {
        previous.abort();
    }
    Ok(())
}

/// Binds the PodResources socket and serves `v1.PodResourcesLister` on it.
pub(super) fn serve_pod_resources(inner: &Arc<Inner>) -> Result<ServerHandle, SimError> {
    let path = &inner.pod_resources_socket;
    let listener = bind_unlistening(path)
        .and_then(BoundSocket::listen)
        .map_err(io_error(path))?;
    let router = Routes::new(PodResourcesListerServer::new(PodResourcesService {
        inner: Arc::clone(inner),
    }));
    Ok(spawn(
        router,
        path.clone(),
        Listener::Ready(listener),
        || {},
    ))
}

/// Connections a simulated kubelet socket serves at once: every plugin of a node may be
/// registering at the same moment.
const MAX_CONNECTIONS: usize = 1024;

/// Where a server gets its connections from.
enum Listener {
    Ready(tokio::net::UnixListener),
    /// Bound but refusing connections; starts listening after the delay.
    After(BoundSocket, Duration),
}

fn spawn(
    router: Routes,
    socket: PathBuf,
    listener: Listener,
    on_listen: impl FnOnce() + Send + 'static,
) -> ServerHandle {
    let (shutdown, mut signal) = oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        let listener = match listener {
            Listener::Ready(listener) => listener,
            Listener::After(bound, delay) => {
                tokio::select! {
                    _ = &mut signal => return,
                    () = tokio::time::sleep(delay) => {}
                }
                match bound.listen() {
                    Ok(listener) => {
                        on_listen();
                        listener
                    }
                    Err(e) => {
                        warn!(
                            "simulated kubelet cannot listen on {}: {e}",
                            socket.display()
                        );
                        return;
                    }
                }
            }
        };
        // As the kubelet, whatever `:authority` a plugin dials with (NVIDIA's device plugin
        // sends the socket's path).
        grpc::serve(
            UnixListenerStream::new(listener),
            router,
            MAX_CONNECTIONS,
            async {
                let _ = signal.await;
            },
        )
        .await;
        debug!("simulated kubelet stopped serving {}", socket.display());
    });
    ServerHandle { shutdown, task }
}

/// Stops serving `kubelet.sock`: no new connections, registrations in flight are refused (the
/// epoch moves on), open connections get a moment to finish and are then cut.
pub(super) async fn stop(inner: &Inner) {
    inner.next_epoch();
    let handle = inner
        .server
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .take();
    if let Some(handle) = handle {
        handle.stop().await;
    }
}

/// A stream Unix socket bound to its path (the file exists) but not listening: connecting to it
/// fails with `ECONNREFUSED` until [`listen`](Self::listen).
struct BoundSocket {
    fd: OwnedFd,
}

/// Creates the socket file at `path` (replacing a stale one) without listening on it.
fn bind_unlistening(path: &Path) -> io::Result<BoundSocket> {
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let bytes = path.as_os_str().as_bytes();
    // SAFETY: an all-zero `sockaddr_un` is valid (an empty address).
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    if bytes.is_empty() || bytes.contains(&0) || bytes.len() >= addr.sun_path.len() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "not usable as a Unix socket path (at most {} bytes, no NUL)",
                addr.sun_path.len() - 1
            ),
        ));
    }
    addr.sun_family = libc::sa_family_t::try_from(libc::AF_UNIX)
        .map_err(|_| io::Error::other("AF_UNIX does not fit sa_family_t"))?;
    for (dst, src) in addr.sun_path.iter_mut().zip(bytes) {
        *dst = *src as libc::c_char;
    }
    let len = libc::socklen_t::try_from(
        std::mem::offset_of!(libc::sockaddr_un, sun_path) + bytes.len() + 1,
    )
    .map_err(|_| io::Error::other("socket address length overflows socklen_t"))?;

    // SAFETY: a plain system call with constant arguments.
    let raw = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0) };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `raw` is a descriptor just returned by `socket`, owned by nothing else.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    // SAFETY: a plain system call on a descriptor we own.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFD, libc::FD_CLOEXEC) } < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `addr` is an initialized `sockaddr_un` and `len` does not exceed its size.
    let rc = unsafe {
        libc::bind(
            fd.as_raw_fd(),
            (&raw const addr).cast::<libc::sockaddr>(),
            len,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(BoundSocket { fd })
}

impl BoundSocket {
    /// Starts accepting connections (queued until the server accepts them).
    fn listen(self) -> io::Result<tokio::net::UnixListener> {
        // SAFETY: a plain system call on a descriptor we own.
        if unsafe { libc::listen(self.fd.as_raw_fd(), libc::SOMAXCONN) } < 0 {
            return Err(io::Error::last_os_error());
        }
        let listener = std::os::unix::net::UnixListener::from(self.fd);
        listener.set_nonblocking(true)?;
        tokio::net::UnixListener::from_std(listener)
    }
}

/// What a starting kubelet does to its device-plugin directory: deletes every socket in it
/// (plugins must notice and register again), keeping the checkpoint. Returns how many went.
pub(super) fn remove_sockets(dir: &Path) -> io::Result<usize> {
    remove_sockets_but(dir, None)
}

/// [`remove_sockets`], sparing the file named `keep` as well (a restart that deletes the
/// plugins' sockets apart from `kubelet.sock`).
pub(super) fn remove_sockets_but(dir: &Path, keep: Option<&str>) -> io::Result<usize> {
    let mut removed = 0;
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        if entry.file_name() == CHECKPOINT || keep.is_some_and(|k| entry.file_name() == k) {
            continue;
        }
        // `file_type` does not follow symlinks, like the kubelet's `os.Lstat`.
        if !entry.file_type()?.is_socket() {
            continue;
        }
        match std::fs::remove_file(entry.path()) {
            Ok(()) => removed += 1,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    Ok(removed)
}

/// Whether something accepts connections on `path` (a live kubelet or simulator).
pub(super) async fn accepts_connections(path: &Path) -> bool {
    matches!(
        tokio::time::timeout(
            Duration::from_secs(1),
            tokio::net::UnixStream::connect(path)
        )
        .await,
        Ok(Ok(_))
    )
}
