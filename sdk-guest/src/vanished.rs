//! Devices that disappear: a GPU that falls off the bus is gone from sysfs, and a module that
//! simply stops listing it has the kubelet drop it silently. [`Vanished`] keeps such a device
//! listed, Unhealthy with a reason, for as long as the instance runs, so the kubelet stops
//! placing pods on it and the operator sees why.

use std::collections::BTreeMap;

use crate::{Device, Health};

/// The devices an instance has listed, to report those it can no longer find.
#[derive(Debug, Default)]
pub struct Vanished {
    seen: BTreeMap<String, Device>,
}

impl Vanished {
    /// Remembers every device of `devices` and appends, Unhealthy because of `reason`, each one
    /// listed before and missing now (as last seen: its NUMA node and attributes).
    pub fn keep(&mut self, devices: &mut Vec<Device>, reason: &str) {
        for d in devices.iter() {
            self.seen.insert(d.id.clone(), d.clone());
        }
        for (id, last) in &self.seen {
            if !devices.iter().any(|d| &d.id == id) {
                devices.push(Device {
                    health: Health::Unhealthy,
                    health_reason: Some(reason.to_owned()),
                    edits: None,
                    ..last.clone()
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_device_that_goes_stays_listed_unhealthy_as_last_seen() {
        let mut vanished = Vanished::default();
        let mut first = vec![
            Device::healthy("a").numa_node(1),
            Device::healthy("b").attribute("pci-address", "0000:03:00.0"),
        ];
        vanished.keep(&mut first, "gone");
        assert_eq!(first.len(), 2);
        let mut later = vec![Device::healthy("a").numa_node(1)];
        vanished.keep(&mut later, "fell off the bus");
        assert_eq!(later.len(), 2);
        let b = &later[1];
        assert_eq!(
            (b.id.as_str(), b.health, b.health_reason.as_deref()),
            ("b", Health::Unhealthy, Some("fell off the bus"))
        );
        assert_eq!(b.text("pci-address"), Some("0000:03:00.0"));
    }
}
