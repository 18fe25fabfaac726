//! What can go wrong when a test or a vendor drives the simulated kubelet.

use std::path::PathBuf;
use std::time::Duration;

use super::state::{PodRef, ResourceState};
use super::watcher::RegistryAttempt;

/// Why a [`Simulator`](super::Simulator) call failed.
///
/// Where the plugin answered with a gRPC status, its code and message are kept verbatim
/// ([`SimError::Rpc`]), so a test can assert that an error names the module that caused it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SimError {
    /// The plugin directory or `kubelet.sock` could not be set up.
    #[error("cannot serve the simulated kubelet at {path}: {source}")]
    Io {
        /// The file or directory concerned.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },

    /// Something already accepts connections on `kubelet.sock`: a real kubelet or another
    /// simulator. Refused rather than stealing its socket.
    #[error(
        "{path} already accepts connections: a kubelet (or another simulator) serves this directory"
    )]
    AlreadyServed {
        /// The live `kubelet.sock`.
        path: PathBuf,
    },

    /// A DRA call got no answer: the driver is not registered, or the call failed or ran out
    /// of time (the kubelet's wording).
    #[error("{0}")]
    Dra(String),

    /// No plugin ever registered this resource (the kubelet's own wording).
    #[error("cannot allocate unregistered device {resource}")]
    UnknownResource {
        /// The resource asked for.
        resource: String,
    },

    /// A container asked for no devices; the kubelet makes no device-plugin call then.
    #[error(
        "cannot allocate zero devices of {resource}: the kubelet makes no Allocate call for a container that requests none"
    )]
    ZeroCount {
        /// The resource asked for.
        resource: String,
    },

    /// [`Simulator::allocate_for`](super::Simulator::allocate_for) was given a pod the kubelet
    /// could not have (an empty name).
    #[error("invalid pod for an allocation ({pod}): {reason}")]
    InvalidPod {
        /// The pod as given.
        pod: PodRef,
        /// What is wrong with it.
        reason: String,
    },

    /// The container already holds devices of this resource: the kubelet allocates once per
    /// container and resource.
    #[error(
        "{pod} already holds {resource} devices (allocation {allocation_id}); the kubelet allocates once per container and resource"
    )]
    AlreadyAllocated {
        /// The container.
        pod: PodRef,
        /// The resource.
        resource: String,
        /// The allocation it holds.
        allocation_id: u64,
    },

    /// Fewer healthy, unallocated devices than requested (the kubelet's own wording).
    #[error(
        "requested number of devices unavailable for {resource}. Requested: {requested}, Available: {available}"
    )]
    Insufficient {
        /// The resource asked for.
        resource: String,
        /// How many devices were requested.
        requested: usize,
        /// How many healthy devices were free.
        available: usize,
    },

    /// The plugin's ListAndWatch stream ended (or the simulated kubelet restarted and the plugin
    /// has not registered again), so the kubelet treats its endpoint as stopped.
    #[error(
        "the device plugin endpoint for {resource} has been stopped (its ListAndWatch stream ended, or the kubelet restarted) and the plugin has not registered again"
    )]
    EndpointStopped {
        /// The resource concerned.
        resource: String,
    },

    /// The plugin answered a call with an error status (kept verbatim).
    #[error("{call} for {resource} failed ({code:?}): {message}")]
    Rpc {
        /// The resource whose plugin was called.
        resource: String,
        /// The gRPC method, e.g. `Allocate`.
        call: &'static str,
        /// The status code.
        code: tonic::Code,
        /// The status message from the plugin (or from the transport).
        message: String,
    },

    /// The plugin did not answer a call on which the real kubelet sets no deadline. The kubelet
    /// would wait forever, stalling pod admission on the whole node; the simulator gives up after
    /// [`SimConfig::stall_limit`](super::SimConfig::stall_limit) so that tests fail instead of
    /// hanging.
    #[error(
        "{call} for {resource} did not answer within {after:?}; the real kubelet sets no deadline on {call} and would stall pod admission on the whole node"
    )]
    Stalled {
        /// The resource whose plugin was called.
        resource: String,
        /// The gRPC method.
        call: &'static str,
        /// How long the simulator waited.
        after: Duration,
    },

    /// `Allocate` answered with no `container_responses`; the kubelet fails admission.
    #[error(
        "Allocate for {resource} returned no container responses; the kubelet reads container_responses[0] and fails pod admission"
    )]
    EmptyAllocateResponse {
        /// The resource whose plugin was called.
        resource: String,
    },

    /// The allocation was made (the pod was admitted) but `PreStartContainer` failed, so the
    /// container would not start. The devices stay allocated, as in the kubelet, until
    /// [`Simulator::release`](super::Simulator::release) is called with `allocation_id`.
    #[error(
        "PreStartContainer failed, so the container would not start (allocation {allocation_id} still holds its devices): {source}"
    )]
    PreStart {
        /// The allocation that was recorded before the failing call.
        allocation_id: u64,
        /// What went wrong.
        #[source]
        source: Box<SimError>,
    },

    /// [`Simulator::wait_until`](super::Simulator::wait_until) timed out.
    #[error("timed out after {after:?} waiting for resource {resource}; last state: {}", describe(.last.as_deref()))]
    Timeout {
        /// The resource waited for.
        resource: String,
        /// How long the wait lasted.
        after: Duration,
        /// What the simulated kubelet knew about the resource at the end (None: never
        /// registered).
        last: Option<Box<ResourceState>>,
    },

    /// [`Simulator::wait_registry`](super::Simulator::wait_registry) timed out.
    #[error(
        "timed out after {after:?} waiting for the plugin watcher; its attempts so far: {attempts:?}"
    )]
    RegistryTimeout {
        /// How long the wait lasted.
        after: Duration,
        /// Every registration attempt of the plugin watcher at the end.
        attempts: Vec<RegistryAttempt>,
    },
}

impl SimError {
    /// The plugin's gRPC status message, if this error carries one (also inside
    /// [`SimError::PreStart`]).
    pub fn plugin_message(&self) -> Option<&str> {
        match self {
            SimError::Rpc { message, .. } => Some(message),
            SimError::PreStart { source, .. } => source.plugin_message(),
            _ => None,
        }
    }

    pub(super) fn rpc(resource: &str, call: &'static str, status: &tonic::Status) -> Self {
        SimError::Rpc {
            resource: resource.to_owned(),
            call,
            code: status.code(),
            message: status.message().to_owned(),
        }
    }
}

fn describe(last: Option<&ResourceState>) -> String {
    match last {
        None => "never registered".to_owned(),
        Some(state) => format!("{state:?}"),
    }
}
