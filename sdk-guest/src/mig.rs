//! Making and destroying MIG instances (WIT 0.3.1), for a module that creates one when a DRA
//! claim is prepared and destroys it when the claim ends.
//!
//! Needs the registry grants `libraries = ["nvml", "nvml-mig"]`: `nvml-mig` is apart from
//! `nvml` because it changes the GPU. Using any function here makes the component import the
//! `mig` interface, which the agent links for any module granted `nvml` (so the module loads
//! where it may not make instances); without `nvml-mig` every call answers
//! [`NvmlError::Unavailable`] naming the grant. An agent older than 0.3.1 refuses the module
//! outright.
//!
//! Calls wait for NVML under the calling function's deadline, as [`crate::nvml`]'s do. Make
//! instances in [`crate::Plugin::prepare`], never in `allocate`: the agent records the prepare
//! before calling it and calls [`crate::Plugin::unprepare`] after a failed one, and after a
//! restart for every prepare it did not see finish, so an instance NVML made after the call's
//! deadline, or before the agent was killed, is destroyed rather than leaked. That is why
//! [`destroy`] succeeds (answering `false`) when there is nothing to destroy.

pub use crate::bindings::devicelet::plugin::mig::{MigLayout, MigPlacement};
use crate::nvml::{MigDevice, NvmlError};

/// The agent's `mig` interface in a component; the test kit's fake host elsewhere.
mod host {
    #[cfg(target_arch = "wasm32")]
    pub use crate::bindings::devicelet::plugin::mig::{create, destroy, layout};

    #[cfg(not(target_arch = "wasm32"))]
    use super::*;

    #[cfg(not(target_arch = "wasm32"))]
    pub fn layout(index: u32) -> Result<MigLayout, NvmlError> {
        crate::testing::current_nvml(|n| n.mig_layout(index))
    }

    #[cfg(not(target_arch = "wasm32"))]
    pub fn create(index: u32, profile: &str, start: u32) -> Result<MigDevice, NvmlError> {
        crate::testing::current_nvml_mut(|n| n.mig_create(index, profile, start))
    }

    #[cfg(not(target_arch = "wasm32"))]
    pub fn destroy(index: u32, profile: &str, start: u32) -> Result<bool, NvmlError> {
        crate::testing::current_nvml_mut(|n| n.mig_destroy(index, profile, start))
    }
}

/// The MIG geometry of the GPU with this index: its memory and compute slices, and every
/// profile's placements. `NotSupported` when it cannot do MIG or MIG mode is off.
pub fn layout(index: u32) -> Result<MigLayout, NvmlError> {
    host::layout(index)
}

/// Makes a GPU instance of `profile` (`1g.10gb`) at memory slice `start` on the GPU with this
/// index, and a compute instance filling it; answers the new MIG device (UUID, instance IDs,
/// caps minors). `Failed` when its slices are taken, and outside [`crate::Plugin::prepare`]
/// (the agent answers it only there).
pub fn create(index: u32, profile: &str, start: u32) -> Result<MigDevice, NvmlError> {
    host::create(index, profile, start)
}

/// Destroys the GPU instance of `profile` at `start`, and its compute instances; `Ok(false)`
/// when there was none. The agent answers it only in [`crate::Plugin::prepare`] and
/// [`crate::Plugin::unprepare`].
pub fn destroy(index: u32, profile: &str, start: u32) -> Result<bool, NvmlError> {
    host::destroy(index, profile, start)
}
