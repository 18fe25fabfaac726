//! A resource's devices at one moment, as every front end sees them.

use std::sync::Arc;

use crate::device::{Device, Inventory};

/// The device set a resource serves, with the counter sets its devices draw on: replaced as a
/// whole whenever anything in it changes. Its devices are sorted by ID (the watcher sorts each
/// one), so [`find`] is a binary search.
pub type Snapshot = Arc<Inventory>;

/// The device with this ID in a snapshot (sorted by ID).
pub fn find<'a>(snapshot: &'a [Device], id: &str) -> Option<&'a Device> {
    snapshot
        .binary_search_by(|d| d.id.as_str().cmp(id))
        .ok()
        .map(|at| &snapshot[at])
}
