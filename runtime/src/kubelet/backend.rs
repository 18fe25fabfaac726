//! What the kubelet side needs from whatever knows the devices: the one seam between serving the
//! kubelet and running vendor code.
//!
//! Everything in `kubelet/` is written against [`DeviceBackend`] and knows nothing of
//! WebAssembly; `sandbox::ModuleHandle` implements it. As in Intel's device-plugin framework, the
//! mandatory part is small (enumerate, allocate); preferred allocation and prestart have defaults
//! and are only called when the resource asked for them in its options.

use std::future::Future;

use crate::device::{ContainerEdits, Device};

/// Why a backend call failed, and so which gRPC status the kubelet gets. Every message names the
/// backend (the module), because it ends up in a pod's events.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BackendError {
    /// The backend answered with an error, or with an answer that broke a rule.
    #[error("{0}")]
    Failed(String),
    /// The call did not finish in time.
    #[error("{0}")]
    Deadline(String),
    /// The request breaks a rule of the resource (the kubelet gets `InvalidArgument`).
    #[error("{0}")]
    Invalid(String),
    /// The backend crashed in this call (it is restarted).
    #[error("{0}")]
    Crashed(String),
    /// The backend is down and did not run the call (restarting after a crash, failed for good).
    #[error("{0}")]
    Unavailable(String),
}

/// A source of devices for one or more resources, named by the backend's own (local) resource
/// names.
pub trait DeviceBackend: Clone + Send + Sync + 'static {
    /// Who to blame in logs.
    fn name(&self) -> &str;

    /// Every device of the resource, present and healthy or not. Called at start, every health
    /// interval and when asked to re-check; health comes from its answer.
    fn enumerate(
        &self,
        resource: &str,
    ) -> impl Future<Output = Result<Vec<Device>, BackendError>> + Send;

    /// What one container needs to use `ids`.
    fn allocate(
        &self,
        resource: &str,
        ids: Vec<String>,
    ) -> impl Future<Output = Result<ContainerEdits, BackendError>> + Send;

    /// `size` of `available`, including all of `must_include`; only called when the resource's
    /// options offer preferred allocation.
    fn preferred(
        &self,
        resource: &str,
        available: Vec<String>,
        must_include: Vec<String>,
        size: u32,
    ) -> impl Future<Output = Result<Vec<String>, BackendError>> + Send {
        let _ = (resource, available, must_include, size);
        std::future::ready(Err(BackendError::Failed(format!(
            "{} offers no preferred allocation",
            self.name()
        ))))
    }

    /// Runs before a container using `ids` starts; only called when the resource's options ask
    /// for it.
    fn prestart(
        &self,
        resource: &str,
        ids: Vec<String>,
    ) -> impl Future<Output = Result<(), BackendError>> + Send {
        let _ = (resource, ids);
        std::future::ready(Ok(()))
    }

    /// Changes whenever the backend's answers may change for reasons other than its devices (a new
    /// module version swapped in): Allocate answers prepared before are then stale.
    fn generation(&self) -> u64 {
        0
    }

    /// Asks to keep `bytes` of Allocate answers prepared for `resource` (their new total): the
    /// backend charges them to its memory budget, and says why not when they do not fit.
    fn keep_answers(&self, resource: &str, bytes: usize) -> Result<(), String> {
        let _ = (resource, bytes);
        Ok(())
    }

    /// The resource is no longer served: forget what is kept for it.
    fn release(&self, resource: &str) {
        let _ = resource;
    }

    /// Where to serve this backend's resources so that a call reaches it without a hop between
    /// threads. None: on the caller's runtime.
    fn serving_place(&self) -> Option<ServingPlace> {
        None
    }
}

/// A runtime to serve a resource on, and when to leave it.
pub struct ServingPlace {
    pub runtime: tokio::runtime::Handle,
    /// Flips to true when the place is lost (its thread got stuck): serve again at the
    /// backend's new place.
    pub lost: tokio::sync::watch::Receiver<bool>,
    /// Held by whoever serves there, so the place lives as long as its servers.
    pub keep_alive: std::sync::Arc<dyn std::any::Any + Send + Sync>,
}

/// A backend that can be replaced under a running resource: an upgrade swaps the new module
/// version in behind the same socket, registration and ListAndWatch stream, so the kubelet never
/// sees the resource go away. A call in flight finishes on the backend it started on.
pub struct Swappable<B> {
    name: std::sync::Arc<str>,
    current: std::sync::Arc<std::sync::RwLock<std::sync::Arc<B>>>,
    /// How many times a new backend was swapped in: the [`DeviceBackend::generation`].
    swaps: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl<B> Clone for Swappable<B> {
    fn clone(&self) -> Self {
        Swappable {
            name: self.name.clone(),
            current: self.current.clone(),
            swaps: self.swaps.clone(),
        }
    }
}

impl<B: DeviceBackend> Swappable<B> {
    pub fn new(backend: B) -> Self {
        Swappable {
            name: backend.name().into(),
            current: std::sync::Arc::new(std::sync::RwLock::new(std::sync::Arc::new(backend))),
            swaps: std::sync::Arc::default(),
        }
    }

    /// The backend answering now.
    pub fn current(&self) -> std::sync::Arc<B> {
        self.current
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Puts `next` in place for every later call; returns the one it replaces.
    pub fn replace(&self, next: B) -> std::sync::Arc<B> {
        let mut slot = self
            .current
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let previous = std::mem::replace(&mut *slot, std::sync::Arc::new(next));
        self.swaps
            .fetch_add(1, std::sync::atomic::Ordering::Release);
        previous
    }
}

impl<B: DeviceBackend> DeviceBackend for Swappable<B> {
    /// The name the backend had when this slot was made: an upgrade keeps the module's name.
    fn name(&self) -> &str {
        &self.name
    }

    async fn enumerate(&self, resource: &str) -> Result<Vec<Device>, BackendError> {
        self.current().enumerate(resource).await
    }

    async fn allocate(
        &self,
        resource: &str,
        ids: Vec<String>,
    ) -> Result<ContainerEdits, BackendError> {
        self.current().allocate(resource, ids).await
    }

    async fn preferred(
        &self,
        resource: &str,
        available: Vec<String>,
        must_include: Vec<String>,
        size: u32,
    ) -> Result<Vec<String>, BackendError> {
        self.current()
            .preferred(resource, available, must_include, size)
            .await
    }

    async fn prestart(&self, resource: &str, ids: Vec<String>) -> Result<(), BackendError> {
        self.current().prestart(resource, ids).await
    }

    fn generation(&self) -> u64 {
        self.swaps.load(std::sync::atomic::Ordering::Acquire)
    }

    fn keep_answers(&self, resource: &str, bytes: usize) -> Result<(), String> {
        self.current().keep_answers(resource, bytes)
    }

    fn release(&self, resource: &str) {
        self.current().release(resource);
    }

    fn serving_place(&self) -> Option<ServingPlace> {
        self.current().serving_place()
    }
}
