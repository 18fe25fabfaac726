//! Reconciliation with the kubelet's PodResources `List`: who holds what, what was freed.
//!
//! The plugin is never told when a container ends (KUBELET.md §9); the `List` answer is the only
//! source. One pass, given the answer and the time:
//!
//! 1. **Attribute.** An entry is held by the container that reports, for the entry's resource,
//!    *all* of the entry's device ids. The kubelet reports one `ContainerDevices` per device (and
//!    per NUMA node), so a container's ids are the union of all its `ContainerDevices` with that
//!    `resource_name`. If several containers qualify, the entry's current holder is kept when it
//!    is among them, else the first in the answer's order wins. An entry with no device ids is
//!    held by no one.
//! 2. **Free.** An entry no container holds is removed if it had a holder (its container ended)
//!    or is at least `grace` old (the kubelet records a container's devices right after
//!    `Allocate`, but the pod may take a moment to show up). Otherwise it stays pending.
//!    An entry whose holder also has a newer entry of the same resource covering all of its
//!    devices is removed as superseded (the kubelet keeps one allocation per container and
//!    resource; this happens to devices reused from init containers).
//! 3. **Adopt.** Devices a listed container holds, of a resource `ours` accepts, that no entry
//!    attributed to that container covers (allocations made before the agent lost its state, or
//!    by a predecessor) get a new entry with that holder, made now, so the ledger mirrors the
//!    kubelet. Other plugins' resources are never adopted.
//!
//! Known limit: the `List` answer omits regular (non-restartable) init containers, so devices of
//! an init container that runs longer than `grace` are freed in the ledger while it runs.

use std::collections::HashSet;
use std::fmt;
use std::time::{Duration, SystemTime};

use super::entry::{Entry, Holder};
use super::state::State;

/// What one reconciliation pass did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReconcileReport {
    /// Entries whose holder was set or changed.
    pub attributed: usize,
    /// Entries removed: their container left the `List` answer, they never showed up within
    /// `grace`, or a newer entry of the same container superseded them. As they were.
    pub freed: Vec<Entry>,
    /// Entries created for allocations the kubelet reported and the ledger did not know.
    pub adopted: Vec<Entry>,
    /// Entries younger than `grace` that no container holds yet.
    pub pending: usize,
}

impl ReconcileReport {
    /// Whether the pass changed the ledger.
    pub fn changed(&self) -> bool {
        self.attributed > 0 || !self.freed.is_empty() || !self.adopted.is_empty()
    }
}

impl fmt::Display for ReconcileReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} attributed, {} freed, {} adopted, {} pending",
            self.attributed,
            self.freed.len(),
            self.adopted.len(),
            self.pending
        )
    }
}

/// The devices of one resource one holder holds, as the front end learned it (the device-plugin
/// front end: from the kubelet's PodResources `List`, `kubelet::podresources::held`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Held {
    pub holder: Holder,
    pub resource: String,
    /// Deduplicated, in the answer's order.
    pub device_ids: Vec<String>,
}

/// The index in `held` of the container holding `entry`, if any.
fn holder_of(entry: &Entry, held: &[Held]) -> Option<usize> {
    if entry.device_ids.is_empty() {
        return None;
    }
    let qualifies = |h: &Held| {
        h.resource == entry.resource && entry.device_ids.iter().all(|id| h.device_ids.contains(id))
    };
    let mut candidates = held.iter().enumerate().filter(|(_, h)| qualifies(h));
    let first = candidates.next()?.0;
    let current = entry.holder.as_ref().and_then(|current| {
        std::iter::once(first)
            .chain(candidates.map(|(i, _)| i))
            .find(|&i| held[i].holder == *current)
    });
    Some(current.unwrap_or(first))
}

impl State {
    /// One pass as the module describes, at time `now`.
    pub(crate) fn reconcile(
        &mut self,
        held: &[Held],
        grace: Duration,
        now: SystemTime,
        ours: &dyn Fn(&str) -> bool,
    ) -> ReconcileReport {
        let mut report = ReconcileReport::default();

        // 1 and 2: attribute or free.
        let mut kept: Vec<(Entry, Option<usize>)> = Vec::with_capacity(self.entries.len());
        for mut entry in std::mem::take(&mut self.entries) {
            match holder_of(&entry, held) {
                Some(at) => {
                    if entry.holder.as_ref() != Some(&held[at].holder) {
                        entry.holder = Some(held[at].holder.clone());
                        report.attributed += 1;
                    }
                    kept.push((entry, Some(at)));
                }
                None => {
                    let age = now
                        .duration_since(entry.allocated_at)
                        .unwrap_or(Duration::ZERO);
                    if entry.holder.is_some() || age >= grace {
                        report.freed.push(entry);
                    } else {
                        report.pending += 1;
                        kept.push((entry, None));
                    }
                }
            }
        }

        // 2, superseded: a held entry whose devices a newer entry of the same container and
        // resource also covers. Same container means same index in `held`.
        let superseded: Vec<bool> = kept
            .iter()
            .enumerate()
            .map(|(i, (entry, at))| {
                at.is_some()
                    && kept[i + 1..].iter().any(|(newer, newer_at)| {
                        newer_at == at
                            && entry
                                .device_ids
                                .iter()
                                .all(|id| newer.device_ids.contains(id))
                    })
            })
            .collect();
        let mut covered: Vec<HashSet<&str>> = vec![HashSet::new(); held.len()];
        for ((entry, at), superseded) in kept.iter().zip(&superseded) {
            if let (Some(at), false) = (at, superseded) {
                covered[*at].extend(entry.device_ids.iter().map(String::as_str));
            }
        }

        // 3: adopt what the kubelet reports of our resources and no entry covers.
        let mut adopt = Vec::new();
        for (h, covered) in held.iter().zip(&covered) {
            if !ours(&h.resource) {
                continue;
            }
            let missing: Vec<String> = h
                .device_ids
                .iter()
                .filter(|id| !covered.contains(id.as_str()))
                .cloned()
                .collect();
            if !missing.is_empty() {
                adopt.push((h.resource.clone(), missing, h.holder.clone()));
            }
        }

        for ((entry, _), superseded) in kept.into_iter().zip(superseded) {
            if superseded {
                report.freed.push(entry);
            } else {
                self.entries.push(entry);
            }
        }
        for (resource, device_ids, holder) in adopt {
            self.push(&resource, device_ids, Some(holder), now);
            if let Some(entry) = self.entries.last() {
                report.adopted.push(entry.clone());
            }
        }
        report
    }
}
