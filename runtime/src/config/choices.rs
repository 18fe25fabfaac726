//! The registry's words for what the host decides for a module's resources: who answers
//! GetPreferredAllocation, and how Allocate names devices to the runtime. Plain values; the
//! policies (`crate::policy`) and CDI (`crate::cdi`) act on them.

/// Who answers a resource's GetPreferredAllocation, as the registry's `allocation-policy` says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AllocationPolicy {
    /// The module's own `preferred` when it asks for the call, the host's `packed` otherwise.
    #[default]
    Module,
    /// The host, filling NUMA nodes (and devices) with the fewest free first.
    Packed,
    /// The host, spreading over the NUMA nodes it chose.
    Distributed,
    /// Nobody: the kubelet picks devices itself.
    None,
}

/// Which ways Allocate names a container's devices; any non-empty combination.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceListStrategy {
    /// Device specs, env and mounts, as the module answered (what every runtime understands).
    pub devices: bool,
    /// The `cdi_devices` field (containerd 1.7+, CRI-O 1.24+ with CDI enabled).
    pub cdi_cri: bool,
    /// A `cdi.k8s.io/` annotation (older runtimes with CDI annotations enabled).
    pub cdi_annotations: bool,
}

impl Default for DeviceListStrategy {
    fn default() -> Self {
        DeviceListStrategy {
            devices: true,
            cdi_cri: false,
            cdi_annotations: false,
        }
    }
}

impl DeviceListStrategy {
    pub const NAMES: [&'static str; 3] = ["devices", "cdi-cri", "cdi-annotations"];

    /// The strategy made of these names; an error naming the first unknown one.
    pub fn parse<'a>(names: impl IntoIterator<Item = &'a str>) -> Result<Self, String> {
        let mut s = DeviceListStrategy {
            devices: false,
            cdi_cri: false,
            cdi_annotations: false,
        };
        for name in names {
            match name {
                "devices" => s.devices = true,
                "cdi-cri" => s.cdi_cri = true,
                "cdi-annotations" => s.cdi_annotations = true,
                _ => {
                    return Err(format!(
                        "unknown device-list strategy {name:?}: expected \"devices\", \"cdi-cri\" or \"cdi-annotations\""
                    ));
                }
            }
        }
        if !(s.devices || s.cdi_cri || s.cdi_annotations) {
            return Err("the device-list strategy is empty: name at least one of \"devices\", \"cdi-cri\", \"cdi-annotations\"".into());
        }
        Ok(s)
    }

    /// Whether the resource gets a CDI spec file.
    pub fn uses_cdi(&self) -> bool {
        self.cdi_cri || self.cdi_annotations
    }
}

impl std::fmt::Display for DeviceListStrategy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let on = [self.devices, self.cdi_cri, self.cdi_annotations];
        let names: Vec<&str> = Self::NAMES
            .iter()
            .zip(on)
            .filter(|(_, on)| *on)
            .map(|(name, _)| *name)
            .collect();
        f.write_str(&names.join(", "))
    }
}
