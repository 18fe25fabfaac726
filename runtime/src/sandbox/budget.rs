//! What the host keeps of a module's answers, charged to the module.
//!
//! Every per-item rule in [`super::checks`] can hold and still add up to gigabytes: 16,384
//! devices with 64 attributes of a kilobyte each. The agent serves every device type on the node,
//! and an OOM kill of it takes them all down, so each module's answers are charged against its
//! `host-memory` budget, with a cap per device too. An answer over budget is refused like any
//! broken rule; the previous snapshot (already paid for) stays.

use std::collections::HashMap;
use std::sync::Mutex;

use super::checks::Violation;
use crate::device::{ContainerEdits, Device};

/// Most bytes one device's entry may take: an ID, NUMA nodes and a few attributes fit many times.
pub const MAX_DEVICE_BYTES: usize = 16 * 1024;

/// Bytes a device set costs the host while it is kept: the entries themselves and every string.
pub fn cost(devices: &[Device]) -> Result<usize, Violation> {
    let mut total = 0usize;
    for d in devices {
        let one = std::mem::size_of::<Device>()
            + d.id.len()
            + d.numa_nodes.len() * std::mem::size_of::<i64>()
            + d.attributes
                .iter()
                .map(|(k, v)| std::mem::size_of::<(String, String)>() + k.len() + v.bytes())
                .sum::<usize>()
            + d.capacities
                .iter()
                .map(|(k, v)| std::mem::size_of::<(String, String)>() + k.len() + v.len())
                .sum::<usize>()
            + d.health_reason.as_ref().map_or(0, String::len)
            + d.group.as_ref().map_or(0, String::len)
            + d.edits.as_ref().map_or(0, ContainerEdits::bytes);
        if one > MAX_DEVICE_BYTES {
            return Err(format!(
                "device {:?} takes {one} bytes of host memory; at most {MAX_DEVICE_BYTES} allowed per device",
                d.id
            ));
        }
        total += one;
    }
    Ok(total)
}

/// What of a resource the host keeps: its snapshot, and the Allocate answers prepared ahead of
/// time for its devices (`resource::prepared`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kept {
    Devices,
    Answers,
}

/// One module's budget: what each of its resources' current snapshot and prepared answers cost.
#[derive(Debug)]
pub struct Budget {
    limit: usize,
    held: Mutex<HashMap<(String, Kept), usize>>,
}

impl Budget {
    pub fn new(limit: u64) -> Budget {
        Budget {
            limit: usize::try_from(limit).unwrap_or(usize::MAX),
            held: Mutex::default(),
        }
    }

    /// Replaces what `resource` holds of `kind` with `cost`, unless that would take the module
    /// past its budget (then nothing changes).
    pub fn charge(
        &self,
        resource: &str,
        kind: Kept,
        cost: Result<usize, Violation>,
    ) -> Result<(), Violation> {
        let cost = cost?;
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        // Prepared answers are a cache: devices never lose their place to them. The preparer
        // charges its answers again after every enumeration and drops them when they no longer
        // fit.
        let others: usize = held
            .iter()
            .filter(|((r, k), _)| !(r == resource && *k == kind))
            .filter(|((_, k), _)| kind == Kept::Answers || *k == Kept::Devices)
            .map(|(_, n)| n)
            .sum();
        if others.saturating_add(cost) > self.limit {
            let what = match kind {
                Kept::Devices => "its devices",
                Kept::Answers => "its prepared Allocate answers",
            };
            return Err(format!(
                "{what} would take its host memory to {} bytes ({cost} for {resource}); its host-memory budget is {} bytes",
                others.saturating_add(cost),
                self.limit
            ));
        }
        held.insert((resource.to_owned(), kind), cost);
        Ok(())
    }

    pub fn release(&self, resource: &str) {
        self.held
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|(r, _), _| r != resource);
    }

    pub fn used(&self) -> usize {
        self.held
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .sum()
    }

    pub fn limit(&self) -> usize {
        self.limit
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sandbox::Health;

    fn device(id: &str, attributes: usize, value: usize) -> Device {
        Device {
            id: id.into(),
            health: Health::Healthy,
            numa_nodes: vec![0],
            attributes: (0..attributes)
                .map(|i| (format!("k{i}"), "v".repeat(value).as_str().into()))
                .collect(),
            ..crate::device::Device::new("", crate::device::Health::Healthy)
        }
    }

    #[test]
    fn resources_share_the_modules_budget() {
        let budget = Budget::new(100_000);
        let big: Vec<Device> = (0..60).map(|i| device(&format!("d{i}"), 1, 1000)).collect();
        budget.charge("a", Kept::Devices, cost(&big)).unwrap();
        assert!(
            budget.charge("b", Kept::Devices, cost(&big)).is_err(),
            "a and b together exceed it"
        );
        // Replacing a's own snapshot is measured without its old one.
        budget.charge("a", Kept::Devices, cost(&big)).unwrap();
        budget.release("a");
        budget.charge("b", Kept::Devices, cost(&big)).unwrap();
        assert!(budget.used() > 60_000 && budget.used() <= 100_000);
    }

    #[test]
    fn prepared_answers_count_against_the_same_budget_and_go_with_the_resource() {
        let budget = Budget::new(100_000);
        budget.charge("a", Kept::Devices, Ok(40_000)).unwrap();
        let e = budget.charge("a", Kept::Answers, Ok(70_000)).unwrap_err();
        assert!(e.contains("prepared Allocate answers"), "{e}");
        budget.charge("a", Kept::Answers, Ok(20_000)).unwrap();
        budget.charge("a", Kept::Answers, Ok(10_000)).unwrap();
        assert_eq!(budget.used(), 50_000, "a new total replaces the old one");
        budget
            .charge("b", Kept::Devices, Ok(55_000))
            .expect("devices never lose their place to prepared answers");
        assert!(
            budget.charge("a", Kept::Answers, Ok(10_000)).is_err(),
            "the answers no longer fit"
        );
        budget.release("a");
        assert_eq!(budget.used(), 55_000, "a's answers went with its snapshot");
    }

    #[test]
    fn one_device_cannot_take_more_than_its_cap() {
        assert!(cost(&[device("fat", 60, 1000)]).is_err());
        assert!(cost(&[device("lean", 4, 64)]).is_ok());
    }
}
