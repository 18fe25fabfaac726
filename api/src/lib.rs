//! The kubelet's gRPC APIs, generated at build time from `proto/` (with the pure-Rust `protox`,
//! so no `protoc` is needed), the Unix-socket transport the kubelet uses, and its resource-name
//! rules: what the agent and the kubelet simulator both speak.

/// What devicelet calls itself on every HTTP request it makes (API servers, OCI registries):
/// audit logs and API priority and fairness name it.
pub const USER_AGENT: &str = concat!("devicelet/", env!("CARGO_PKG_VERSION"));

pub mod authority;
pub mod names;
pub mod quantity;
pub mod serve;
pub mod timestamp;
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

/// The DRA plugin API a DRA driver serves to the kubelet, in both versions the kubelet speaks
/// (1.34 and later take `v1`, older ones `v1beta1`; identical but for the package and `v1`'s
/// `share_id`), and the device-health stream beside it.
pub mod dra {
    /// `PluginInfo.type` of a DRA driver.
    pub const DRA_PLUGIN: &str = "DRAPlugin";
    /// What a driver lists in `PluginInfo.supported_versions`, preferred first: the kubelet takes
    /// the first it supports.
    pub const SUPPORTED_VERSIONS: [&str; 2] = ["v1.DRAPlugin", "v1beta1.DRAPlugin"];
    /// The kubelet's deadline on every DRA call.
    pub const CALL_DEADLINE: std::time::Duration = std::time::Duration::from_secs(45);

    /// `k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin`.
    pub mod v1 {
        #![allow(clippy::all, missing_docs)]
        tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1");
    }

    /// `k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin`.
    pub mod v1beta1 {
        #![allow(clippy::all, missing_docs)]
        tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1beta1");
    }

    /// `v1alpha1.DRAResourceHealth` (Kubernetes 1.34 to 1.37).
    pub mod health {
        #![allow(clippy::all, missing_docs)]
        tonic::include_proto!("v1alpha1");
    }

    #[cfg(test)]
    mod tests {
        /// The kubelet calls these exact gRPC service names; a proto package typo would make
        /// every call Unimplemented.
        #[test]
        fn services_are_named_as_the_kubelet_calls_them() {
            assert_eq!(
                super::v1::dra_plugin_server::SERVICE_NAME,
                "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin"
            );
            assert_eq!(
                super::v1beta1::dra_plugin_server::SERVICE_NAME,
                "k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin"
            );
            assert_eq!(
                super::health::dra_resource_health_server::SERVICE_NAME,
                "v1alpha1.DRAResourceHealth"
            );
            let versions = super::SUPPORTED_VERSIONS.map(|v| v.split_once('.').map(|(v, _)| v));
            assert_eq!(versions, [Some("v1"), Some("v1beta1")]);
        }
    }
}

mod dra_versions;

/// PodResources API (`v1.PodResourcesLister`).
pub mod podresources {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("v1");
}
