//! Serving `kubelet.sock`, and what the kubelet does to its directory when it (re)starts.

use std::io;
use std::os::unix::fs::FileTypeExt;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::transport::Server;
use tracing::{debug, warn};

use crate::kubelet::api::deviceplugin::registration_server::RegistrationServer;
use crate::kubelet::uds;

use super::Inner;
use super::error::SimError;
use super::registration::RegistrationService;

/// The kubelet's checkpoint file, the one thing it keeps when it cleans its directory.
pub(super) const CHECKPOINT: &str = "kubelet_internal_checkpoint";

/// How long a stop waits for open connections to finish before cutting them.
const DRAIN: Duration = Duration::from_millis(500);

/// The running Registration server.
pub(super) struct ServerHandle {
    shutdown: oneshot::Sender<()>,
    task: JoinHandle<()>,
}

impl ServerHandle {
    /// Stops accepting at once; used where nothing can be awaited (drop).
    pub fn abort(self) {
        self.task.abort();
    }
}

/// Binds `kubelet.sock` and serves `Registration` on it for a new incarnation of the kubelet.
pub(super) fn serve(inner: &Arc<Inner>) -> Result<(), SimError> {
    let listener = uds::bind(&inner.socket).map_err(|source| SimError::Io {
        path: inner.socket.clone(),
        source,
    })?;
    let epoch = inner.next_epoch();
    let service = RegistrationServer::new(RegistrationService {
        inner: Arc::clone(inner),
        epoch,
    });
    let (shutdown, signal) = oneshot::channel::<()>();
    let socket = inner.socket.clone();
    let task = tokio::spawn(async move {
        let served = Server::builder()
            .add_service(service)
            .serve_with_incoming_shutdown(UnixListenerStream::new(listener), async {
                let _ = signal.await;
            })
            .await;
        if let Err(e) = served {
            warn!(
                "simulated kubelet stopped serving {}: {e}",
                socket.display()
            );
        }
    });
    let previous = inner
        .server
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .replace(ServerHandle { shutdown, task });
    if let Some(previous) = previous {
        previous.abort();
    }
    Ok(())
}

/// Stops serving: no new connections, registrations in flight are refused (the epoch moves
/// on), open connections get a moment to finish and are then cut.
pub(super) async fn stop(inner: &Inner) {
    inner.next_epoch();
    let handle = inner
        .server
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .take();
    let Some(ServerHandle { shutdown, mut task }) = handle else {
        return;
    };
    let _ = shutdown.send(());
    if tokio::time::timeout(DRAIN, &mut task).await.is_err() {
        debug!("simulated kubelet: connections still open after {DRAIN:?}; cutting them");
        task.abort();
        let _ = task.await;
    }
}

/// What a starting kubelet does to its device-plugin directory: deletes every socket in it
/// (plugins must notice and register again), keeping the checkpoint. Returns how many went.
pub(super) fn remove_sockets(dir: &Path) -> io::Result<usize> {
    let mut removed = 0;
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        if entry.file_name() == CHECKPOINT {
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
