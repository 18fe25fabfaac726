//! Everything the kubelet sees of us: the generated APIs, one gRPC server per resource,
//! registration, restart handling and each resource's lifecycle, all written against the
//! [`backend::DeviceBackend`] trait and free of WebAssembly. The simulator that stands in for the
//! kubelet is its own crate, `devicelet-simulator`.
//!
//! One Allocate, end to end: the kubelet dials the resource's socket ([`lifecycle`] serves it) and
//! calls [`plugin_server::ResourcePlugin`]'s `allocate`, which asks the backend
//! (`sandbox::ModuleHandle`, in `sandbox/module.rs`): the call crosses to the module's kubelet
//! cell (`sandbox/cell.rs`), runs the guest's `allocate` through the bindings
//! (`sandbox/bindings.rs`), has its answer checked there (`sandbox/validate.rs`) and comes back as
//! [`crate::device::ContainerEdits`], which `plugin_server` records in the ledger and turns into
//! the kubelet's response. A single-device Allocate usually never gets that far: [`prepared`]
//! asked the module for that device's answer ahead of time, and the server answers from it.

pub use devicelet_api as api;
pub use devicelet_api::{names, uds};
mod connections;
pub mod lifecycle;
pub mod plugin_server;
pub mod podresources;
pub mod registration;
pub mod resource;
pub mod restart_watch;
pub mod route;
