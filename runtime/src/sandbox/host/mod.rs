//! The host interfaces a module may import. Each is linked only when the registry grants it, and
//! every call checks its path against the grants again.

mod devnodes;
mod log;
mod nvml;
mod output;
pub mod paths;
mod state;
mod sysfs;

pub use output::OutputBudget;
pub use state::HostState;
