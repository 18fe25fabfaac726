//! Running vendor modules: the wasmtime engine, the host/guest seam, the host interfaces a
//! module may be granted, and the cells that run each module's instances.

pub mod bindings;
pub mod budget;
pub mod cache;
pub mod cell;
pub mod checks;
pub mod compile_filter;
pub mod compiler;
pub mod engine;
mod entry_lock;
pub mod error;
pub mod host;
pub mod loader;
pub mod module;
pub mod slot;

pub use crate::device::{
    ContainerEdits, Device, DeviceNode, Health, Mount, PluginError, ResourceInfo,
};
pub use error::{CallError, CallKind, LoadError};
pub use module::{CallObserver, ModuleHandle, ModuleStats, Outcome};
