//! The names the DRA front end publishes: a driver's name (a DNS subdomain, what the kubelet's
//! plugin watcher and ResourceSlices key by) and each device's name in a ResourceSlice (a DNS
//! label). Module device IDs are freer (`0000:3b:02.0`, `GPU-8a3f…`, `ttyUSB0`), so they are
//! mapped: readable where the ID already is a label, and otherwise made one, with a digest of
//! the ID appended so that two IDs never meet on one name. The mapping is deterministic, so the
//! same ID gets the same name after a restart; the way back is the resource's own table of the
//! IDs it published ([`DeviceNames`]).

use std::collections::BTreeMap;

use sha2::{Digest, Sha256};

/// Longest DNS label (RFC 1123): a device name.
pub const MAX_LABEL: usize = 63;
/// Longest driver name (`DriverNameMaxLength`): a DNS subdomain, but the API keeps it to 63
/// bytes, so a longer one would be refused in every ResourceSlice.
pub const MAX_DRIVER: usize = 63;

/// Why a name cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NameError {
    #[error(
        "{0:?} is not a DNS subdomain (lowercase letters, digits, `-` and `.`, each part starting \
         and ending with a letter or digit, at most 63 characters), e.g. \"gpu.example.com\""
    )]
    NotASubdomain(String),
    #[error("device IDs {0:?} and {1:?} map to the same DRA device name {2:?}")]
    Collision(String, String, String),
}

/// Whether `name` is a DNS label (the one copy of the rule is `devicelet_api::names`).
pub fn is_label(name: &str) -> bool {
    devicelet_api::names::is_dns1123_label(name)
}

/// Checks a driver name: a DNS subdomain of at most [`MAX_DRIVER`] characters.
pub fn check_driver(name: &str) -> Result<(), NameError> {
    if devicelet_api::names::is_dra_driver_name(name) {
        Ok(())
    } else {
        Err(NameError::NotASubdomain(name.to_owned()))
    }
}

/// The driver name a resource is served under when the registry names none: its name turned
/// around, `nvidia.com/gpu` → `gpu.nvidia.com` (NVIDIA's and Intel's DRA drivers are named
/// so). A name that does not make a DNS subdomain (`vendor.com/GA102GL_A10`) must be given.
pub fn default_driver(resource: &str) -> Result<String, NameError> {
    let name = match resource.split_once('/') {
        Some((domain, suffix)) => format!("{suffix}.{domain}"),
        None => resource.to_owned(),
    };
    check_driver(&name)?;
    Ok(name)
}

/// The driver a resource is served as: the registry's `dra-driver` when it names one, else
/// [`default_driver`].
pub fn driver_name(explicit: Option<&str>, resource: &str) -> Result<String, NameError> {
    match explicit {
        Some(driver) => Ok(driver.to_owned()),
        None => default_driver(resource),
    }
}

/// The ResourceSlice device name of module device `id`: the ID itself when it is a DNS label,
/// else its letters and digits lower-cased with every other run as one `-`, then `-` and the
/// first 8 hex digits of the ID's sha256 (`0000:3b:02.0` → `0000-3b-02-0-` + 8 hex digits).
pub fn device_name(id: &str) -> String {
    if is_label(id) {
        return id.to_owned();
    }
    let mut readable = String::with_capacity(id.len());
    for c in id.chars() {
        if c.is_ascii_alphanumeric() {
            readable.push(c.to_ascii_lowercase());
        } else if !readable.ends_with('-') {
            readable.push('-');
        }
    }
    let digest = Sha256::digest(id.as_bytes());
    let tag: String = digest[..4].iter().map(|b| format!("{b:02x}")).collect();
    let room = MAX_LABEL - tag.len() - 1;
    let mut stem: String = readable.trim_matches('-').chars().take(room).collect();
    while stem.ends_with('-') {
        stem.pop();
    }
    if stem.is_empty() {
        format!("d-{tag}")
    } else {
        format!("{stem}-{tag}")
    }
}

/// The device names of one resource's devices, both ways.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeviceNames {
    by_name: BTreeMap<String, String>,
}

impl DeviceNames {
    /// The names of `ids`; two IDs on one name are refused, naming both.
    pub fn new<'a>(ids: impl IntoIterator<Item = &'a str>) -> Result<DeviceNames, NameError> {
        let mut by_name: BTreeMap<String, String> = BTreeMap::new();
        for id in ids {
            let name = device_name(id);
            if let Some(other) = by_name.get(&name)
                && other != id
            {
                return Err(NameError::Collision(other.clone(), id.to_owned(), name));
            }
            by_name.insert(name, id.to_owned());
        }
        Ok(DeviceNames { by_name })
    }

    /// The module ID published as `name`.
    pub fn id(&self, name: &str) -> Option<&str> {
        self.by_name.get(name).map(String::as_str)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn driver_names_are_dns_subdomains_defaulting_to_the_resource_turned_around() {
        assert_eq!(
            default_driver("nvidia.com/gpu").as_deref(),
            Ok("gpu.nvidia.com")
        );
        assert_eq!(
            default_driver("intel.com/x710-vf").as_deref(),
            Ok("x710-vf.intel.com")
        );
        assert!(default_driver("nvidia.com/GA102GL_A10").is_err());
        assert!(check_driver("gpu.example.com").is_ok());
        for bad in [
            "",
            "Gpu.example.com",
            "gpu..example.com",
            "-gpu.example.com",
            "gpu_x.com",
        ] {
            assert!(check_driver(bad).is_err(), "{bad}");
        }
        assert!(check_driver(&format!("{}.com", "a".repeat(64))).is_err());
        // Every label fine, but longer than the 63 bytes a ResourceSlice's driver may have.
        let long = format!("{}.{}.com", "a".repeat(40), "b".repeat(20));
        assert_eq!(long.len(), 65);
        assert!(check_driver(&long).is_err());
        assert!(check_driver(&long[2..]).is_ok());
    }

    #[test]
    fn device_names_are_labels_readable_where_they_can_be_and_never_shared() {
        assert_eq!(device_name("gpu-0"), "gpu-0");
        assert_eq!(device_name("net-tun"), "net-tun");
        let pci = device_name("0000:3b:02.0");
        assert!(pci.starts_with("0000-3b-02-0-"), "{pci}");
        let uuid = device_name("GPU-8a3f0c2e-1b4d-4e5f-9a6b-7c8d9e0f1a2b");
        assert!(is_label(&uuid), "{uuid}");
        assert!(uuid.starts_with("gpu-8a3f0c2e"), "{uuid}");
        // Case alone tells these apart: the digest keeps them apart.
        assert_ne!(device_name("ttyUSB0"), device_name("ttyusb0"));
        assert_ne!(device_name("fuse::0"), device_name("fuse-0"));
        for id in ["", ":::", &"x".repeat(500), "Ü", "a/b"] {
            let name = device_name(id);
            assert!(is_label(&name), "{id:?} → {name:?}");
        }
        assert_eq!(device_name("0000:3b:02.0"), pci, "the same every time");
    }

    #[test]
    fn the_table_maps_names_back_to_ids() {
        let names = DeviceNames::new(["0000:3b:02.0", "gpu-0"]).unwrap();
        assert_eq!(names.id(&device_name("0000:3b:02.0")), Some("0000:3b:02.0"));
        assert_eq!(names.id("gpu-0"), Some("gpu-0"));
        assert_eq!(names.id("gpu-1"), None);
    }
}
