//! What a driver publishes as one DRA device. The scheduler allocates published devices one by
//! one and knows nothing of WIT 0.2 device groups (devices allocated together or not at all,
//! such as the functions of one IOMMU group), so a group is published as one device: named
//! and described by its first member (by ID), healthy only while every member is, and prepared
//! as all of its members. An ungrouped device is a unit of its own.

use std::collections::BTreeMap;

use super::names::device_name;
use crate::device::{Device, Health};

/// One DRA device: a device, or a whole group.
#[derive(Debug)]
pub struct Unit<'a> {
    /// Its DRA device name: its first member's.
    pub name: String,
    /// The first member, whose attributes and capacities describe the unit.
    pub first: &'a Device,
    /// Every member, `first` included, by ID.
    pub members: Vec<&'a Device>,
}

impl Unit<'_> {
    /// Healthy while every member is.
    pub fn healthy(&self) -> bool {
        self.members.iter().all(|d| d.health == Health::Healthy)
    }

    /// The first unhealthy member's reason, naming that member when it is not the first.
    pub fn reason(&self) -> Option<String> {
        reason_of(&self.members)
    }
}

/// Why a unit of `members` (its first member first) is unhealthy: its first unhealthy member's
/// reason, naming that member when it is not the first. What the health taint's value and
/// prepare's refusal both say.
pub fn reason_of(members: &[&Device]) -> Option<String> {
    let sick = members.iter().find(|d| d.health != Health::Healthy)?;
    let why = sick.health_reason.as_deref().unwrap_or("unhealthy");
    Some(if members.first().is_some_and(|f| f.id == sick.id) {
        why.to_owned()
    } else {
        format!("{}: {why}", sick.id)
    })
}

/// The units of `snapshot`, by name.
pub fn units(snapshot: &[Device]) -> Vec<Unit<'_>> {
    let mut groups: BTreeMap<&str, Vec<&Device>> = BTreeMap::new();
    let mut out = Vec::new();
    for d in snapshot {
        match &d.group {
            Some(g) => groups.entry(g).or_default().push(d),
            None => out.push(Unit {
                name: device_name(&d.id),
                first: d,
                members: vec![d],
            }),
        }
    }
    for mut members in groups.into_values() {
        members.sort_by(|a, b| a.id.cmp(&b.id));
        let first = members[0];
        out.push(Unit {
            name: device_name(&first.id),
            first,
            members,
        });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grouped(id: &str, group: &str, health: Health) -> Device {
        let mut d = Device::new(id, health);
        d.group = Some(group.into());
        d
    }

    #[test]
    fn a_group_is_one_unit_named_by_its_first_member_and_sick_if_any_member_is() {
        let mut audio = grouped("0000:65:00.1", "iommu-41", Health::Unhealthy);
        audio.health_reason = Some("bound to snd_hda_intel, not vfio-pci".into());
        let snapshot = vec![
            audio,
            grouped("0000:65:00.0", "iommu-41", Health::Healthy),
            Device::new("0000:3b:02.0", Health::Healthy),
        ];
        let units = units(&snapshot);
        assert_eq!(units.len(), 2);
        let gpu = units
            .iter()
            .find(|u| u.first.id == "0000:65:00.0")
            .expect("the group");
        assert_eq!(gpu.name, device_name("0000:65:00.0"));
        assert_eq!(gpu.members.len(), 2);
        assert!(!gpu.healthy());
        assert_eq!(
            gpu.reason().as_deref(),
            Some("0000:65:00.1: bound to snd_hda_intel, not vfio-pci")
        );
        let vf = units.iter().find(|u| u.members.len() == 1).expect("alone");
        assert!(vf.healthy() && vf.reason().is_none());
    }
}
