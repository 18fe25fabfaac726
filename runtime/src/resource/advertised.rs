//! What a front end advertises of a resource: its devices less those the allocation ledger says
//! the *other* front end holds. The device-plugin front end serves a resource that DRA claims may
//! still hold (the resource moved from DRA back to the device plugin while claims were
//! prepared, their driver answering until they are unprepared): those devices stay out of
//! ListAndWatch, so the kubelet never counts or hands them out, and each comes back once its
//! claim is unprepared.
//!
//! Partitions (devices that draw on counter sets, as MIG placements do) are never advertised
//! to the kubelet: it counts devices, not counters, and would hand out two placements that
//! overlap. Only DRA's scheduler can choose among them.

use std::sync::Arc;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::snapshot::Snapshot;
use crate::device::Inventory;
use crate::ledger::Ledger;
use crate::policy::sharing::physical_id;

/// `devices` without partitions and without the ones DRA claims hold of `resource` (its name
/// before any `.shared`), as a snapshot that changes when either does; unchanged snapshots pass
/// through as they are (no copy, no extra message) while no claim holds anything and no device
/// is a partition.
pub fn without_claimed(
    devices: watch::Receiver<Snapshot>,
    ledger: Ledger,
    resource: &str,
    mut stop: watch::Receiver<bool>,
) -> (watch::Receiver<Snapshot>, JoinHandle<()>) {
    let resource = resource
        .strip_suffix(crate::policy::sharing::RENAMED_SUFFIX)
        .unwrap_or(resource)
        .to_owned();
    let mut claims = ledger.claims_changed();
    let mut devices = devices;
    let filter = move |snapshot: &Snapshot| -> Snapshot {
        let claimed = ledger.claimed(&resource);
        if claimed.is_empty() && snapshot.iter().all(|d| d.consumes.is_empty()) {
            return snapshot.clone();
        }
        Arc::new(Inventory {
            devices: snapshot
                .iter()
                .filter(|d| d.consumes.is_empty() && !claimed.contains(physical_id(&d.id)))
                .cloned()
                .collect(),
            counter_sets: snapshot.counter_sets.clone(),
        })
    };
    let first = filter(&devices.borrow_and_update());
    let (tx, rx) = watch::channel(first);
    let task = tokio::spawn(async move {
        loop {
            tokio::select! {
                changed = devices.changed() => if changed.is_err() { return },
                changed = claims.changed() => if changed.is_err() { return },
                _ = stop.wait_for(|s| *s) => return,
            }
            let next = filter(&devices.borrow_and_update());
            tx.send_if_modified(|now| {
                let same = Arc::ptr_eq(now, &next) || **now == *next;
                if !same {
                    *now = next;
                }
                !same
            });
        }
    });
    (rx, task)
}
