//! CDI (Container Device Interface) spec files for the served resources, and Allocate answers
//! that name their devices.
//!
//! A resource whose registry entry asks for a CDI `device-list-strategy` gets one spec file in
//! the CDI directory (`--cdi-dir`): its kind is the served resource name, with one CDI device per
//! physical device built from the module's answer for that device alone (the answers prepared
//! ahead, `resource::prepared`), and the edits every device shares lifted to the spec's top
//! level. Allocate then names the devices (`cdi_devices`, or a `cdi.k8s.io/` annotation)
//! instead of, or as well as, listing their edits; but only when applying the written spec gives
//! the container exactly what the module answered for that request. Otherwise (a device not in
//! the spec yet, an answer for several devices that is not the sum of their own) the container
//! gets the module's answer as device specs, env and mounts, so nothing is lost.

mod build;
pub mod claim;
pub mod installed;
pub mod spec;
mod strategy;
mod writer;

pub use build::View;
pub use strategy::{Counts, DeviceListStrategy, Naming, annotation_key};
pub use writer::{FileId, SpecWriter, Written, remove_stale, spec_path};

/// Where CDI spec files go unless `--cdi-dir` says otherwise: the directory runtimes read
/// transient specs from.
pub const DEFAULT_DIR: &str = "/var/run/cdi";

/// Builds a spec from each device's own answer, for tests and `validate`.
pub use build::build;
