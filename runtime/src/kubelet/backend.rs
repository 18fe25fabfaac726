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
    /// The backend is down (crashed and restarting, failed for good).
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

    /// The resource is no longer served: forget what is kept for it.
    fn release(&self, resource: &str) {
        let _ = resource;
    }
}
