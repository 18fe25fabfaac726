//! The kubelet's gRPC APIs, generated at build time from `proto/` (with the pure-Rust `protox`,
//! so no `protoc` is needed), the Unix-socket transport the kubelet uses, and its resource-name
//! rules: what the agent and the kubelet simulator both speak.

pub mod names;
pub mod uds;

/// Device-plugin API (`v1beta1.Registration`, `v1beta1.DevicePlugin`).
pub mod deviceplugin {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("v1beta1");

    /// The only device-plugin API version the kubelet accepts.
    pub const VERSION: &str = "v1beta1";
    /// The health string the kubelet counts as allocatable; anything else is unhealthy.
    pub const HEALTHY: &str = "Healthy";
    pub const UNHEALTHY: &str = "Unhealthy";
    /// The kubelet's own registration socket, inside its device-plugin directory.
    pub const KUBELET_SOCKET: &str = "kubelet.sock";
}

/// PodResources API (`v1.PodResourcesLister`).
pub mod podresources {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("v1");
}
