//! The Dynamic Resource Allocation front end: the same modules serving ResourceClaims through
//! the kubelet's DRA plugin API, with ResourceSlices published to the API server. One driver
//! per served resource (`driver.rs`), built on the resource core like the device-plugin front
//! end. `docs/dra.md` says what works today and what does not yet.

pub mod advanced;
pub mod api;
pub mod claim;
pub mod claim_status;
pub mod driver;
pub mod error;
pub mod events;
pub mod health;
pub mod names;
pub mod old_checkpoint;
pub mod prepare;
pub mod retire;
pub mod server;
pub mod slice_watch;
pub mod slices;
pub mod taints;
pub mod units;

use std::collections::BTreeSet;
use std::sync::Arc;

/// The module IDs of a resource's devices that running containers hold through the
/// device-plugin front end (the allocation ledger's record, reconciled with the kubelet's
/// PodResources). A driver keeps them out of its slices and refuses claims for them, so a node
/// that moves a resource from the device plugin to DRA never hands one device out twice: each
/// device joins the pool once the container holding it has ended.
pub type HeldElsewhere = Arc<dyn Fn() -> BTreeSet<String> + Send + Sync>;
