//! The host interfaces a module may import. Each owns its state (what it may touch, nothing more),
//! has its own `add_to_linker`, and is linked only when the registry grants it; every call checks
//! its path against the grants again.

mod devnodes;
mod log;
mod mig;
mod nvml;
mod output;
pub mod paths;
mod schedule;
mod state;
mod sysfs;

pub use devnodes::Devnodes;
pub use log::Log;
pub use mig::add_to_linker as add_mig_to_linker;
pub use nvml::Nvml;
pub use output::OutputAllowance;
pub use schedule::Schedule;
pub use state::HostState;
pub use sysfs::Sysfs;
