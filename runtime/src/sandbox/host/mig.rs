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
use crate::sandbox::error::CallKind;

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

    /// Whether the export being called may do `what`: an instance made anywhere but in
    /// `prepare` has no record the host would undo it by, so it could only leak.
    fn in_claims(&self, what: &str, allowed: &[CallKind]) -> Result<(), NvmlError> {
        match self.calling {
            Some(kind) if allowed.contains(&kind) => Ok(()),
            other => Err(NvmlError::Failed(format!(
                "mig.{what} is answered only in {}; this is {}",
                allowed
                    .iter()
                    .map(|k| format!("claims.{k}"))
                    .collect::<Vec<_>>()
                    .join(" or "),
                other.map_or_else(|| "init".to_owned(), |k| k.to_string())
            ))),
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
        self.in_claims("create", &[CallKind::Prepare])?;
        let root = self.host_root.clone();
        let made = self.ask(move |n| n.mig_create(index, &profile, start, &root))?;
        Ok(mig_device(made))
    }

    fn destroy(&mut self, index: u32, profile: String, start: u32) -> Result<bool, NvmlError> {
        self.mig_allowed()?;
        self.in_claims("destroy", &[CallKind::Prepare, CallKind::Unprepare])?;
        self.ask(move |n| n.mig_destroy(index, &profile, start))
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;
    use std::sync::Arc;

    use super::*;

    #[test]
    fn instances_are_made_only_in_prepare_and_destroyed_only_in_claims_calls() {
        let mut granted = Nvml::new(Arc::new(PathBuf::from("/")), None, true);
        for kind in [CallKind::Enumerate, CallKind::Allocate, CallKind::Unprepare] {
            granted.calling(kind);
            let refused = granted.create(0, "1g.10gb".into(), 0).unwrap_err();
            assert!(
                matches!(&refused, NvmlError::Failed(m) if m.contains("only in claims.prepare")),
                "{kind}: {refused:?}"
            );
        }
        granted.calling(CallKind::Health);
        assert!(matches!(
            granted.destroy(0, "1g.10gb".into(), 0),
            Err(NvmlError::Failed(_))
        ));
        // In the claims calls they reach NVML (absent here).
        granted.calling(CallKind::Prepare);
        assert!(matches!(
            granted.create(0, "1g.10gb".into(), 0),
            Err(NvmlError::Unavailable(_))
        ));
        granted.calling(CallKind::Unprepare);
        assert!(matches!(
            granted.destroy(0, "1g.10gb".into(), 0),
            Err(NvmlError::Unavailable(_))
        ));
        // Without the grant, nothing, wherever.
        let mut reader = Nvml::new(Arc::new(PathBuf::from("/")), None, false);
        reader.calling(CallKind::Prepare);
        let refused = reader.create(0, "1g.10gb".into(), 0).unwrap_err();
        assert!(
            matches!(&refused, NvmlError::Unavailable(m) if m.contains("nvml-mig")),
            "{refused:?}"
        );
    }
}
