//! Device groups (WIT 0.2 `device.group`): devices of one resource allocated together or not at
//! all, such as the functions of one IOMMU group (a container given one of them can reach the
//! others). The host refuses an Allocate that splits a group before the module sees it, and its
//! preferred allocation hands out whole groups. A grouped device is never shared (the sharing
//! policy refuses to replicate one), so the IDs here are the devices' own.

use std::collections::{BTreeMap, HashSet};

use crate::device::Device;

/// Most member IDs a refusal names.
const SHOWN: usize = 8;

/// The members of each group in `snapshot`, by group name; empty when no device has one.
fn groups(snapshot: &[Device]) -> BTreeMap<&str, Vec<&str>> {
    let mut groups: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for d in snapshot {
        if let Some(g) = &d.group {
            groups.entry(g).or_default().push(&d.id);
        }
    }
    groups
}

/// Whether `device` shares its group with another device of `snapshot`: allocating it alone
/// would split the group.
pub fn has_partners(snapshot: &[Device], device: &Device) -> bool {
    device.group.as_ref().is_some_and(|g| {
        snapshot
            .iter()
            .any(|d| d.id != device.id && d.group.as_ref() == Some(g))
    })
}

/// Why allocating `ids` would split a group, if it would: a group some of whose devices are
/// asked for and some not.
pub fn split(snapshot: &[Device], ids: &[&str]) -> Option<String> {
    let asked: HashSet<&str> = ids.iter().copied().collect();
    for (name, members) in groups(snapshot) {
        let missing: Vec<&str> = members
            .iter()
            .filter(|m| !asked.contains(*m))
            .copied()
            .collect();
        if missing.len() < members.len() && !missing.is_empty() {
            let mut shown: Vec<String> = missing
                .iter()
                .take(SHOWN)
                .map(|id| id.chars().take(64).collect())
                .collect();
            if missing.len() > SHOWN {
                shown.push(format!("and {} more", missing.len() - SHOWN));
            }
            let name: String = name.chars().take(64).collect();
            return Some(format!(
                "devices of group {name:?} are allocated together: the request has {} of its \
                 {} devices, not {}",
                members.len() - missing.len(),
                members.len(),
                shown.join(", ")
            ));
        }
    }
    None
}

/// `chosen` (a preference, best first) made of whole groups: each chosen device brings the
/// rest of its group from `available`, a group that does not fit is passed over, and the size
/// is made up from the other groups in `available` that fit. `must_include` devices come first,
/// whole groups or not: the kubelet needs them.
pub fn keep_whole(
    snapshot: &[Device],
    available: &[String],
    must_include: &[String],
    chosen: Vec<String>,
    size: usize,
) -> Vec<String> {
    let groups = groups(snapshot);
    if groups.is_empty() {
        return chosen;
    }
    let offered: HashSet<&str> = available
        .iter()
        .chain(must_include)
        .map(String::as_str)
        .collect();
    let group_of: std::collections::HashMap<&str, &str> = snapshot
        .iter()
        .filter_map(|d| Some((d.id.as_str(), d.group.as_deref()?)))
        .collect();
    // Each group's offered members, once.
    let units: BTreeMap<&str, Vec<&str>> = groups
        .iter()
        .map(|(g, members)| {
            let offered: Vec<&str> = members
                .iter()
                .filter(|m| offered.contains(*m))
                .copied()
                .collect();
            (*g, offered)
        })
        .collect();
    let mut answer: Vec<String> = Vec::with_capacity(size);
    let mut taken: HashSet<&str> = HashSet::new();
    let mut tried: HashSet<&str> = HashSet::new();
    fn take<'a>(id: &'a str, size: usize, answer: &mut Vec<String>, taken: &mut HashSet<&'a str>) {
        if answer.len() < size && taken.insert(id) {
            answer.push(id.to_owned());
        }
    }
    for id in must_include {
        match group_of.get(id.as_str()).and_then(|g| units.get(g)) {
            Some(members) => {
                for m in members {
                    take(m, size, &mut answer, &mut taken);
                }
            }
            None => take(id, size, &mut answer, &mut taken),
        }
    }
    for id in chosen.iter().chain(available) {
        if answer.len() == size {
            break;
        }
        if taken.contains(id.as_str()) {
            continue;
        }
        match group_of.get(id.as_str()) {
            Some(g) => {
                if !tried.insert(g) {
                    continue;
                }
                let Some(members) = units.get(g) else {
                    continue;
                };
                let new = members.iter().filter(|m| !taken.contains(*m)).count();
                if answer.len() + new <= size {
                    for m in members {
                        take(m, size, &mut answer, &mut taken);
                    }
                }
            }
            None => take(id, size, &mut answer, &mut taken),
        }
    }
    answer
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::Health;

    fn device(id: &str, group: Option<&str>) -> Device {
        Device {
            group: group.map(str::to_owned),
            ..Device::new(id, Health::Healthy)
        }
    }

    fn ids(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| (*s).to_owned()).collect()
    }

    fn node() -> Vec<Device> {
        vec![
            device("a0", Some("g1")),
            device("a1", Some("g1")),
            device("b0", Some("g2")),
            device("c0", None),
        ]
    }

    #[test]
    fn a_request_with_part_of_a_group_is_a_split() {
        let snapshot = node();
        assert_eq!(split(&snapshot, &["a0", "a1"]), None);
        assert_eq!(split(&snapshot, &["b0", "c0"]), None);
        let why = split(&snapshot, &["a0", "c0"]).expect("split");
        assert!(why.contains("\"g1\"") && why.contains("a1"), "{why}");
        assert!(has_partners(&snapshot, &snapshot[0]));
        assert!(!has_partners(&snapshot, &snapshot[2]), "a group of one");
    }

    #[test]
    fn the_preference_hands_out_whole_groups() {
        let snapshot = node();
        let available = ids(&["a0", "a1", "b0", "c0"]);
        // The NUMA choice starts with a0: its group comes whole.
        assert_eq!(
            keep_whole(&snapshot, &available, &[], ids(&["a0", "c0"]), 2),
            ids(&["a0", "a1"])
        );
        // One device: g1 does not fit, the next group of one does.
        assert_eq!(
            keep_whole(&snapshot, &available, &[], ids(&["a0"]), 1),
            ids(&["b0"])
        );
        assert_eq!(
            keep_whole(&snapshot, &available, &[], ids(&["c0", "a0", "a1"]), 3),
            ids(&["c0", "a0", "a1"])
        );
    }

    #[test]
    fn a_group_as_large_as_a_resource_may_be_is_handed_out_whole() {
        let snapshot: Vec<Device> = (0..16_384)
            .map(|i| device(&format!("d{i}"), Some("all")))
            .collect();
        let available: Vec<String> = snapshot.iter().map(|d| d.id.clone()).collect();
        let answer = keep_whole(&snapshot, &available, &[], available.clone(), 16_384);
        assert_eq!(answer.len(), 16_384);
        assert!(keep_whole(&snapshot, &available, &[], available.clone(), 3).is_empty());
    }
}
