//! `devicelet:plugin/mig` (0.3.1): MIG instances made and destroyed. Linked for every module
//! granted `nvml`, so a module that can use MIG loads on a node that does not let it (the
//! reference nvidia-gpu, under `libraries = ["nvml"]`); its calls answer `unavailable` unless
//! `"nvml-mig"` is granted too, since they change the GPU. The calls run on the node's NVML thread under the
//! calling function's deadline, as `nvml`'s queries do (same state, [`Nvml`]); a `create` that
//! NVML finishes after the deadline leaves its instance, which the module's `unprepare` undoes
//! (the host calls it after a failed prepare, and after a restart).

use wasmtime::component::{HasSelf, Linker};

use super::nvml::{Nvml, mig_device};
use crate::sandbox::bindings::v0_1::devicelet::plugin::nvml::{MigDevice, NvmlError};
use crate::sandbox::bindings::v0_3::devicelet::plugin::mig::{
    self as wit, Host, MigLayout, MigPlacement,
};

/// Linked for a module granted `libraries = ["nvml"]`, under the names of the lines that
/// have `mig`.
pub fn add_to_linker<T: Send + 'static>(
    linker: &mut Linker<T>,
    view: fn(&mut T) -> &mut Nvml,
) -> wasmtime::Result<()> {
    for name in crate::sandbox::bindings::imports::mig_host_names() {
        wit::add_to_linker_instance::<T, HasSelf<Nvml>>(&mut linker.instance(&name)?, view)?;
    }
    Ok(())
}

/// What every `mig` call answers without the grant.
fn not_granted() -> NvmlError {
    NvmlError::Unavailable(
        "MIG instances are not granted to this module: its registry entry needs \
         libraries = [\"nvml\", \"nvml-mig\"]"
            .into(),
    )
}

impl Nvml {
    fn mig_allowed(&self) -> Result<(), NvmlError> {
        if self.mig_granted {
            Ok(())
        } else {
            Err(not_granted())
        }
    }
}

impl Host for Nvml {
    fn layout(&mut self, index: u32) -> Result<MigLayout, NvmlError> {
        self.mig_allowed()?;
        let layout = self.ask(move |n| n.mig_layout(index))?;
        Ok(MigLayout {
            memory_slices: layout.memory_slices,
            compute_slices: layout.compute_slices,
            placements: layout
                .placements
                .into_iter()
                .map(|p| MigPlacement {
                    profile: p.profile,
                    start: p.start,
                    size: p.size,
                    compute_slices: p.compute_slices,
                    memory_bytes: p.memory_bytes,
                })
                .collect(),
        })
    }

    fn create(&mut self, index: u32, profile: String, start: u32) -> Result<MigDevice, NvmlError> {
        self.mig_allowed()?;
        let root = self.host_root.clone();
        let made = self.ask(move |n| n.mig_create(index, &profile, start, &root))?;
        Ok(mig_device(made))
    }

    fn destroy(&mut self, index: u32, profile: String, start: u32) -> Result<bool, NvmlError> {
        self.mig_allowed()?;
        self.ask(move |n| n.mig_destroy(index, &profile, start))
    }
}
