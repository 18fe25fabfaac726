//! What the resource core needs from whatever knows the devices: the one seam between serving a
//! resource and running vendor code.
//!
//! Two parts. [`DeviceBackend`] is the calls, four of them as in Intel's device-plugin framework:
//! enumerate and allocate are mandatory; preferred allocation and prestart have defaults and are
//! only called when the resource asked for them in its options. [`Upkeep`] is what the core asks
//! of the place the backend lives (its memory budget, its version, its runtime), kept apart so
//! that a decorator over the calls (sharing) never has to forward it. The sandbox's module slot
//! implements both; the core and the front ends know nothing of WebAssembly.

use std::future::Future;

use crate::device::{ContainerEdits, Inventory, Prepared, Request};

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
    ) -> impl Future<Output = Result<Inventory, BackendError>> + Send;

    /// What one container needs to use `ids`.
    fn allocate(
        &self,
        resource: &str,
        ids: Vec<String>,
    ) -> impl Future<Output = Result<ContainerEdits, BackendError>> + Send;

    /// `size` of `available`, including all of `must_include`; only called when the resource's
    /// options offer preferred allocation. A backend without one answers [`no_preferred`].
    fn preferred(
        &self,
        resource: &str,
        available: Vec<String>,
        must_include: Vec<String>,
        size: u32,
    ) -> impl Future<Output = Result<Vec<String>, BackendError>> + Send;

    /// What a container needs for `request`, which may carry the request's own config and key
    /// (a DRA claim's). A backend that knows no config answers [`allocate_without_config`].
    fn allocate_request(
        &self,
        request: Request,
    ) -> impl Future<Output = Result<ContainerEdits, BackendError>> + Send;

    /// The end of `request` (a DRA claim unprepared): what was set up for it may go.
    fn release(&self, request: Request) -> impl Future<Output = Result<(), BackendError>> + Send;

    /// Checks a DRA request's opaque `config` before any device is reserved for it, so a bad
    /// one fails the claim with the backend's words. A backend that takes any config (or none)
    /// keeps this default.
    fn validate_config(
        &self,
        resource: &str,
        config: &str,
    ) -> impl Future<Output = Result<(), BackendError>> + Send {
        let _ = (resource, config);
        async { Ok(()) }
    }

    /// Whether the resource's DRA claims are prepared by [`prepare`](Self::prepare), which
    /// creates something [`unprepare`](Self::unprepare) must undo, even across a restart (WIT
    /// 0.3 `prepares-claims`); otherwise by `allocate_request` and `release`.
    fn prepares_claims(&self, resource: &str) -> bool;

    /// A DRA claim's request prepared: the container's edits and the claim's status data.
    /// Only called for a resource that [`prepares_claims`](Self::prepares_claims).
    fn prepare(
        &self,
        request: Request,
    ) -> impl Future<Output = Result<Prepared, BackendError>> + Send;

    /// Undoes [`prepare`](Self::prepare): must succeed when there is nothing to undo.
    fn unprepare(&self, request: Request) -> impl Future<Output = Result<(), BackendError>> + Send;

    /// Runs before a container using `ids` starts; only called when the resource's options ask
    /// for it.
    fn prestart(
        &self,
        resource: &str,
        ids: Vec<String>,
    ) -> impl Future<Output = Result<(), BackendError>> + Send;

    /// How soon the resource's last enumeration asked to be enumerated again (something the
    /// backend knows changes by then, such as a quiet period ending); None: at the interval.
    fn recheck_after(&self, resource: &str) -> Option<std::time::Duration>;
}

// Every call of the trait is required, none has a default: a decorator (sharing, the module
// slot) must name each one, so none can be dropped on the way to the backend it wraps, as
// `allocate_request` and `release` once were. A backend with nothing to do for a call says so
// with one of these.

/// [`DeviceBackend::prepare`] of a backend that prepares no claims itself.
pub fn prepares_nothing(name: &str) -> Result<Prepared, BackendError> {
    Err(BackendError::Failed(format!(
        "{name} prepares no claims itself"
    )))
}

/// The answer of a backend that offers no preferred allocation.
pub fn no_preferred(name: &str) -> Result<Vec<String>, BackendError> {
    Err(BackendError::Failed(format!(
        "{name} offers no preferred allocation"
    )))
}

/// [`DeviceBackend::allocate_request`] for a backend that knows no per-request config: a request
/// without one is an `allocate`, one with config is refused.
pub async fn allocate_without_config<B: DeviceBackend>(
    backend: &B,
    request: Request,
) -> Result<ContainerEdits, BackendError> {
    if !request.config.is_empty() {
        return Err(BackendError::Invalid(format!(
            "{} takes no per-request config",
            backend.name()
        )));
    }
    backend.allocate(&request.resource, request.ids).await
}

/// The calls a test double has nothing to do for, spelled out once: no preferred allocation,
/// no per-request config, nothing to release or run before a container, the usual interval.
#[cfg(test)]
macro_rules! plain_calls {
    () => {
        async fn preferred(
            &self,
            _: &str,
            _: Vec<String>,
            _: Vec<String>,
            _: u32,
        ) -> Result<Vec<String>, $crate::resource::backend::BackendError> {
            $crate::resource::backend::no_preferred(self.name())
        }

        async fn allocate_request(
            &self,
            request: $crate::device::Request,
        ) -> Result<$crate::device::ContainerEdits, $crate::resource::backend::BackendError> {
            $crate::resource::backend::allocate_without_config(self, request).await
        }

        async fn release(
            &self,
            _: $crate::device::Request,
        ) -> Result<(), $crate::resource::backend::BackendError> {
            Ok(())
        }

        async fn prestart(
            &self,
            _: &str,
            _: Vec<String>,
        ) -> Result<(), $crate::resource::backend::BackendError> {
            Ok(())
        }

        fn prepares_claims(&self, _: &str) -> bool {
            false
        }

        async fn prepare(
            &self,
            _: $crate::device::Request,
        ) -> Result<$crate::device::Prepared, $crate::resource::backend::BackendError> {
            $crate::resource::backend::prepares_nothing(self.name())
        }

        async fn unprepare(
            &self,
            _: $crate::device::Request,
        ) -> Result<(), $crate::resource::backend::BackendError> {
            Ok(())
        }

        fn recheck_after(&self, _: &str) -> Option<std::time::Duration> {
            None
        }
    };
}
#[cfg(test)]
pub(crate) use plain_calls;

/// Where a backend lives, as the resource core sees it. Every method has a default for a backend
/// that lives nowhere special ([`Unkept`]).
pub trait Upkeep: Send + Sync + 'static {
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
}

/// A backend with no budget and no versions.
pub struct Unkept;

impl Upkeep for Unkept {}
