//! The two ways a resource gets to the kubelet, and what the kubelet made of it.
//!
//! - `kubelet.sock` (the default): we call the kubelet's `Register`, and must do so again after
//!   every kubelet restart, which deletes our socket.
//! - The plugin watcher: our socket sits in `plugins_registry/` and answers the watcher's
//!   `GetInfo`; the kubelet finds it by itself, after its own restarts too (that directory is
//!   not wiped). The same socket serves the device-plugin API (the endpoint we give is its own
//!   path), so nothing of ours lives in the directory the kubelet wipes. Its `Registration`
//!   service is the plugin-socket layer's (`crate::plugin_socket`), as a DRA driver's is.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// How resources register with the kubelet.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Route {
    /// `Register` on `kubelet.sock`, sockets in the device-plugin directory.
    #[default]
    KubeletSocket,
    /// Sockets in this plugin-watcher directory (`/var/lib/kubelet/plugins_registry`).
    PluginWatcher(PathBuf),
}

impl Route {
    /// The directory our sockets go to.
    pub fn socket_dir<'a>(&'a self, plugin_dir: &'a Path) -> &'a Path {
        match self {
            Route::KubeletSocket => plugin_dir,
            Route::PluginWatcher(dir) => dir,
        }
    }
}

/// What the kubelet has done with one resource's registrations: for status, metrics and the
/// agent's readiness.
#[derive(Debug, Default)]
pub struct RegistrationState {
    registered: AtomicBool,
    kubelet_restarts: AtomicU64,
    failures: AtomicU64,
}

impl RegistrationState {
    /// Whether the kubelet holds our current registration.
    pub fn registered(&self) -> bool {
        self.registered.load(Ordering::Relaxed)
    }

    /// Kubelet restarts this resource noticed (each made it serve and register again).
    pub fn kubelet_restarts(&self) -> u64 {
        self.kubelet_restarts.load(Ordering::Relaxed)
    }

    /// Registrations the kubelet refused (or, on the plugin-watcher route, reported failed).
    pub fn failures(&self) -> u64 {
        self.failures.load(Ordering::Relaxed)
    }

    pub(super) fn set_registered(&self, registered: bool) {
        self.registered.store(registered, Ordering::Relaxed);
    }

    pub(super) fn kubelet_restarted(&self) {
        self.kubelet_restarts.fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn failed(&self) {
        self.failures.fetch_add(1, Ordering::Relaxed);
    }
}
