//! Running vendor modules: the wasmtime engine, the host/guest seam, the host interfaces a
//! module may be granted, and the actor that owns each module's instance.

pub mod actor;
pub mod bindings;
pub mod cache;
pub mod engine;
pub mod error;
pub mod host;
pub mod loader;
pub mod types;
pub mod validate;

pub use actor::{ModuleHandle, ModuleStats};
pub use error::{CallError, LoadError};
pub use types::{ContainerEdits, Device, DeviceNode, Health, Mount, PluginError, ResourceInfo};
