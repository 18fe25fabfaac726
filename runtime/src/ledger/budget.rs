//! What a node's devices give claims beyond whole devices (WIT 0.3): the capacity of a device
//! shared by capacity, summed over its shares, and the counters partitions draw on, summed over
//! the partitions claims hold. The scheduler keeps both counts; the ledger checks them again
//! as it reserves a claim, so a stale or hostile allocation is refused by name instead of
//! oversubscribing a device.

use std::collections::BTreeMap;

use devicelet_api::quantity;

use super::claims::{ClaimRecord, Claims, Conflict};
use crate::device::{CounterSet, CounterUse, Device};

/// The devices of one resource that have a budget: shared ones' capacities, partitions'
/// counters, and the counter sets, from one snapshot.
#[derive(Debug, Clone, Default)]
pub struct Budget {
    /// Devices shared by capacity, by module ID: their capacities.
    shared: BTreeMap<String, Vec<(String, String)>>,
    /// Devices that consume counters, by module ID.
    consumes: BTreeMap<String, Vec<CounterUse>>,
    sets: Vec<CounterSet>,
}

impl Budget {
    /// The budget of a resource's devices and counter sets.
    pub fn of(devices: &[Device], sets: &[CounterSet]) -> Budget {
        let mut budget = Budget {
            sets: sets.to_vec(),
            ..Budget::default()
        };
        for d in devices {
            if d.shared.is_some() {
                budget.shared.insert(d.id.clone(), d.capacities.clone());
            }
            if !d.consumes.is_empty() {
                budget.consumes.insert(d.id.clone(), d.consumes.clone());
            }
        }
        budget
    }

    /// Whether `record` (claim `uid`) fits beside every other claim of its resource.
    pub(crate) fn check(
        &self,
        claims: &Claims,
        uid: &str,
        record: &ClaimRecord,
    ) -> Result<(), Conflict> {
        let resource = &record.resource;
        let others: Vec<&ClaimRecord> = claims
            .by_uid
            .iter()
            .filter(|(u, c)| *u != uid && c.record.resource == *resource)
            .map(|(_, c)| &c.record)
            .collect();
        for share in record.shares() {
            let device = &share.device;
            let Some(capacities) = self.shared.get(device) else {
                return Err(Conflict::NotShared {
                    resource: resource.clone(),
                    device: device.clone(),
                });
            };
            for (name, _) in &share.consumed {
                let total = capacities
                    .iter()
                    .find(|(n, _)| n == name)
                    .and_then(|(_, q)| quantity::parse(q))
                    .unwrap_or(0);
                let used = |r: &ClaimRecord| -> i128 {
                    r.shares()
                        .filter(|s| &s.device == device)
                        .flat_map(|s| &s.consumed)
                        .filter(|(n, _)| n == name)
                        .filter_map(|(_, q)| quantity::parse(q))
                        .sum()
                };
                let before: i128 = others.iter().map(|r| used(r)).sum();
                let asked = used(record);
                if before + asked > total {
                    return Err(Conflict::Capacity {
                        resource: resource.clone(),
                        device: device.clone(),
                        capacity: name.clone(),
                        asked: quantity::format(asked),
                        left: quantity::format((total - before).max(0)),
                    });
                }
            }
        }
        let mine: Vec<&str> = record
            .held()
            .filter(|id| self.consumes.contains_key(*id))
            .collect();
        if mine.is_empty() {
            return Ok(());
        }
        // Each counter's use by the devices the other claims hold, then by this claim's.
        let mut used: BTreeMap<(&str, &str), i128> = BTreeMap::new();
        for id in others
            .iter()
            .flat_map(|r| r.held())
            .chain(mine.iter().copied())
        {
            for u in self.consumes.get(id).into_iter().flatten() {
                for (counter, q) in &u.counters {
                    *used.entry((&u.counter_set, counter)).or_default() +=
                        quantity::parse(q).unwrap_or(0);
                }
            }
        }
        for ((set, counter), total_used) in used {
            let total = self
                .sets
                .iter()
                .find(|s| s.name == set)
                .and_then(|s| s.counters.iter().find(|(n, _)| n == counter))
                .and_then(|(_, q)| quantity::parse(q))
                .unwrap_or(0);
            if total_used > total
                && let Some(device) = mine.iter().find(|id| {
                    self.consumes[**id].iter().any(|u| {
                        u.counter_set == set && u.counters.iter().any(|(n, _)| n == counter)
                    })
                })
            {
                return Err(Conflict::Counters {
                    resource: resource.clone(),
                    device: (*device).to_owned(),
                    counter_set: set.to_owned(),
                    counter: counter.to_owned(),
                    total: quantity::format(total),
                });
            }
        }
        Ok(())
    }
}
