//! Everything the kubelet sees of us, and the simulator that stands in for it.

pub mod api;
pub mod names;
pub mod plugin_server;
pub mod registration;
pub mod simulator;
pub mod uds;
