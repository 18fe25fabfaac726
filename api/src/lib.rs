//! The kubelet's gRPC APIs, generated at build time from `proto/` (with the pure-Rust `protox`,
//! so no `protoc` is needed), the Unix-socket transport the kubelet uses, and its resource-name
//! rules: what the agent and the kubelet simulator both speak.

pub mod authority;
pub mod names;
pub mod serve;
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

/// The plugin watcher's registration API (`pluginregistration.Registration`), served on a socket
/// in the kubelet's `plugins_registry` directory: the route that survives kubelet restarts by
/// itself.
pub mod pluginregistration {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("pluginregistration");

    /// `PluginInfo.type` of a device plugin.
    pub const DEVICE_PLUGIN: &str = "DevicePlugin";
    /// The kubelet's default plugin-watcher directory.
    pub const DEFAULT_DIR: &str = "/var/lib/kubelet/plugins_registry";
}

/// PodResources API (`v1.PodResourcesLister`).
pub mod podresources {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("v1");
}
