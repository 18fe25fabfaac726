//! The device-plugin front end: everything the kubelet sees of us, and the only code that names
//! its wire types. One gRPC server per resource, registration and its two routes, restart
//! handling and each resource's lifecycle, built on the resource core (`crate::resource`) and
//! free of WebAssembly. The simulator that stands in for the kubelet is its own crate,
//! `devicelet-simulator`.
//!
//! One Allocate, end to end: the kubelet dials the resource's socket ([`lifecycle`] serves it) and
//! calls [`plugin_server::ResourcePlugin`]'s `allocate`. A lone device usually has an answer
//! prepared ahead (`resource::prepared`); otherwise the server asks its backend
//! (`sandbox::slot::ModuleSlot`): the call crosses to the module's kubelet cell
//! (`sandbox/cell.rs`), runs the guest's `allocate` through the bindings (`sandbox/bindings.rs`),
//! has its answer checked there (`sandbox/checks.rs`) and comes back as
//! [`crate::device::ContainerEdits`], which CDI naming may shape, `plugin_server` records in the
//! ledger and converts to the kubelet's response.

pub use devicelet_api as api;
pub use devicelet_api::{names, uds};
pub mod lifecycle;
pub mod plugin_server;
pub mod podresources;
pub mod registration;
pub mod resource;
pub mod restart_watch;
pub mod route;
