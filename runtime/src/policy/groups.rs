//! Device groups (WIT 0.2 `device.group`): devices of one resource allocated together or not at
//! all, such as the functions of one IOMMU group (a container given one of them can reach the
//! others). The host refuses an Allocate that splits a group before the module sees it, and its
//! preferred allocation hands out whole groups.

use std::collections::BTreeMap;

use crate::device::Device;

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

/// Why allocating `ids` would split a group, if it would: a group some of whose devices are
/// asked for and some not.
pub fn split(snapshot: &[Device], ids: &[&str]) -> Option<String> {
    let groups = groups(snapshot);
    for (name, members) in &groups {
        let asked = members.iter().filter(|m| ids.contains(m)).count();
        if asked > 0 && asked < members.len() {
            let missing: Vec<&str> = members
                .iter()
                .filter(|m| !ids.contains(m))
                .copied()
                .collect();
            return Some(format!(
                "devices of group {name:?} are allocated together: the request has {asked} of \
                 its {} devices, not {}",
                members.len(),
                missing.join(", ")
            ));
        }
    }
    None
}

/// `chosen` (a preference, best first) made of whole groups: each chosen device brings the
/// rest of its group from `available`, a group that no longer fits is passed over, and the
/// size is made up from the other groups in `available` that fit. `must_include` devices come
/// first, whole groups or not: the kubelet needs them.
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
    let group_of =
        |id: &str| crate::resource::snapshot::find(snapshot, id).and_then(|d| d.group.as_deref());
    // A device's unit: its group's members that are available (or itself alone).
    let unit = |id: &String| -> Vec<String> {
        match group_of(id).and_then(|g| groups.get(g)) {
            Some(members) => members
                .iter()
                .filter(|m| {
                    available.iter().any(|a| a == *m) || must_include.iter().any(|a| a == *m)
                })
                .map(|m| (*m).to_owned())
                .collect(),
            None => vec![id.clone()],
        }
    };
    let mut answer: Vec<String> = Vec::with_capacity(size);
    for id in must_include {
        for member in unit(id) {
            if answer.len() < size && !answer.contains(&member) {
                answer.push(member);
            }
        }
    }
    for id in chosen.iter().chain(available) {
        if answer.contains(id) {
            continue;
        }
        let members = unit(id);
        let new: Vec<String> = members
            .into_iter()
            .filter(|m| !answer.contains(m))
            .collect();
        if answer.len() + new.len() <= size {
            answer.extend(new);
        }
        if answer.len() == size {
            break;
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
        // One device: g1 does not fit, the next lone device does.
        assert_eq!(
            keep_whole(&snapshot, &available, &[], ids(&["a0"]), 1),
            ids(&["b0"])
        );
        assert_eq!(
            keep_whole(&snapshot, &available, &[], ids(&["c0", "a0", "a1"]), 3),
            ids(&["c0", "a0", "a1"])
        );
    }
}
