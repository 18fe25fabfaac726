//! devicelet: one node agent serving the kubelet's device-plugin API for many device types,
//! with the vendor-specific logic in sandboxed WebAssembly components.
//!
//! The host/guest seam is [`sandbox::bindings`]; the kubelet lifecycle lives in [`kubelet`].

pub mod agent;
pub mod backoff;
pub mod cdi;
pub mod cli;
pub mod config;
pub mod device;
pub mod digest;
pub mod dra;
pub mod files;
pub mod fixture;
pub mod footprint;
pub mod kubelet;
pub mod ledger;
pub mod metrics;
pub mod nvml;
pub mod oci;
pub mod plugin_socket;
pub mod policy;
pub mod resource;
pub mod sandbox;
pub mod text;
pub mod trust;
