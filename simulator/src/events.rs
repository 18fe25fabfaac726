//! The simulated kubelet's event log: what it would write to its own log, as values.
//!
//! Every event is also logged with `tracing`; the broadcast channel lets the CLI (and tests that
//! want a transcript) follow along without polling.

use std::path::PathBuf;

use devicelet_api::deviceplugin::{Device, DevicePluginOptions};

use super::state::PodRef;
use super::watcher::RegistryAttempt;

/// Something the simulated kubelet did or saw, in the order it happened.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum SimEvent {
    /// `Register` succeeded.
    Registered {
        /// The resource name.
        resource: String,
        /// The socket file name inside the plugin directory.
        endpoint: String,
        /// The options from `GetDevicePluginOptions`.
        options: DevicePluginOptions,
        /// How many times the resource has now been registered.
        registrations: u32,
    },
    /// `Register` failed; `reason` is the message the plugin got back.
    Rejected {
        /// The resource name as sent.
        resource: String,
        /// The endpoint as sent.
        endpoint: String,
        /// Why.
        reason: String,
    },
    /// A ListAndWatch message replaced the device set.
    Snapshot {
        /// The resource name.
        resource: String,
        /// The message's number on the current stream, from 1.
        number: u64,
        /// The devices, sorted by id.
        devices: Vec<Device>,
        /// Capacity after the snapshot.
        capacity: usize,
        /// Allocatable after the snapshot.
        allocatable: usize,
    },
    /// The current ListAndWatch stream ended; allocatable is now 0.
    StreamEnded {
        /// The resource name.
        resource: String,
        /// How it ended (the status message, or "closed by the plugin").
        reason: String,
    },
    /// An allocation was recorded.
    Allocated {
        /// The allocation id.
        id: u64,
        /// The container that holds (held) the devices.
        pod: PodRef,
        /// The resource name.
        resource: String,
        /// The devices.
        device_ids: Vec<String>,
    },
    /// An allocation was released.
    Released {
        /// The allocation id.
        id: u64,
        /// The container that holds (held) the devices.
        pod: PodRef,
        /// The resource name.
        resource: String,
        /// The devices that are free again.
        device_ids: Vec<String>,
    },
    /// The simulated kubelet restarted: sockets deleted, every plugin must register again.
    /// `kubelet.sock` exists from now on but accepts connections only after
    /// [`SimConfig::accept_delay`](super::SimConfig::accept_delay) (see [`SimEvent::Serving`]).
    Restarted {
        /// How many socket files were deleted.
        sockets_removed: usize,
    },
    /// `kubelet.sock` accepts connections again after a restart.
    Serving,
    /// The plugin watcher tried to register a socket in `plugins_registry` (successfully or
    /// not); also in [`Simulator::registry_attempts`](super::Simulator::registry_attempts).
    RegistryAttempt {
        /// What happened.
        attempt: RegistryAttempt,
    },
    /// A socket the plugin watcher knew was removed from `plugins_registry` (or re-created);
    /// if it had been registered, its resource was deregistered (a
    /// [`SimEvent::StreamEnded`] precedes this event when a live client was disconnected).
    RegistryRemoved {
        /// The socket file.
        socket: PathBuf,
        /// The resource the device manager was asked to register for it, if it got that far.
        resource: Option<String>,
    },
}
