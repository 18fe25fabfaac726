//! The CDI spec file format, as much of it as the agent writes, and the naming rules of the CDI
//! specification (vendor, class, device names; the lowest `cdiVersion` a spec needs).
//!
//! These are our own types rather than the `container-device-interface` crate's: its spec types
//! can only be built by parsing text (their fields are private to the crate), and it brings a
//! JSON-schema validator with an HTTP client that the agent has no use for. The scenario tests
//! read every spec the agent writes back through that crate, validate it and resolve it.

use serde::Serialize;

/// A CDI spec file: one per served resource.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Spec {
    #[serde(rename = "cdiVersion")]
    pub version: &'static str,
    pub kind: String,
    pub devices: Vec<SpecDevice>,
    /// What every device of the spec needs: applied once per container however many devices
    /// of this kind it gets.
    #[serde(rename = "containerEdits", skip_serializing_if = "Edits::is_empty")]
    pub container_edits: Edits,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SpecDevice {
    pub name: String,
    #[serde(rename = "containerEdits")]
    pub container_edits: Edits,
}

/// A CDI `containerEdits` object (env, device nodes, mounts: what a device-plugin answer holds).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Edits {
    /// `KEY=value`.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
    #[serde(rename = "deviceNodes", skip_serializing_if = "Vec::is_empty")]
    pub device_nodes: Vec<DeviceNode>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub mounts: Vec<Mount>,
}

impl Edits {
    pub fn is_empty(&self) -> bool {
        self.env.is_empty() && self.device_nodes.is_empty() && self.mounts.is_empty()
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DeviceNode {
    /// Where the node appears in the container.
    pub path: String,
    /// Where it is on the host, when that differs from `path`.
    #[serde(rename = "hostPath", skip_serializing_if = "Option::is_none")]
    pub host_path: Option<String>,
    /// cgroup access, `rwm` or a subset; the runtime's default when absent.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub permissions: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Mount {
    #[serde(rename = "hostPath")]
    pub host_path: String,
    #[serde(rename = "containerPath")]
    pub container_path: String,
    /// A bind mount, read-only or not, as the kubelet mounts a device plugin's `Mount`.
    pub options: Vec<String>,
}

/// The lowest `cdiVersion` that covers what `spec` uses, by the specification's changelog:
/// 0.3.0 at least; 0.5.0 for device names that start with a digit and for device nodes whose
/// host path differs; 0.6.0 for a class with a dot in it. Older runtimes read older versions.
pub fn required_version(kind: &str, devices: &[SpecDevice], common: &Edits) -> &'static str {
    let class = kind.split_once('/').map_or("", |(_, class)| class);
    if class.contains('.') {
        return "0.6.0";
    }
    let digit_first = devices
        .iter()
        .any(|d| !d.name.starts_with(|c: char| c.is_ascii_alphabetic()));
    let host_path = devices
        .iter()
        .map(|d| &d.container_edits)
        .chain(std::iter::once(common))
        .flat_map(|e| &e.device_nodes)
        .any(|n| n.host_path.is_some());
    if digit_first || host_path {
        "0.5.0"
    } else {
        "0.3.0"
    }
}

/// The CDI kind for a served resource `vendor/class`: `devicelet.vendor/class`, or why it cannot
/// be one (CDI is stricter than Kubernetes: a class starts with a letter).
///
/// Ours, not the resource name itself: a vendor's own tooling may write specs of kind
/// `vendor/class` for the same devices (nvidia-ctk writes `nvidia.com/gpu=<uuid>`), and two
/// specs naming one device make runtimes drop both, or shadow one.
pub fn kind_of(resource: &str) -> Result<String, String> {
    let Some((vendor, class)) = resource.split_once('/') else {
        return Err(format!("{resource:?} has no vendor domain"));
    };
    let vendor = format!("devicelet.{vendor}");
    check_vendor_or_class("vendor", &vendor)?;
    check_vendor_or_class("class", class)?;
    Ok(format!("{vendor}/{class}"))
}

/// A vendor or class name: ASCII letters, digits, `_`, `-`, `.`; a letter first, a letter or
/// digit last.
fn check_vendor_or_class(what: &str, name: &str) -> Result<(), String> {
    let allowed = |c: char| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.');
    if !name.starts_with(|c: char| c.is_ascii_alphabetic()) {
        return Err(format!("its CDI {what} {name:?} must start with a letter"));
    }
    if !name.ends_with(|c: char| c.is_ascii_alphanumeric()) {
        return Err(format!(
            "its CDI {what} {name:?} must end with a letter or digit"
        ));
    }
    if let Some(c) = name.chars().find(|&c| !allowed(c)) {
        return Err(format!("its CDI {what} {name:?} may not contain {c:?}"));
    }
    Ok(())
}

/// Whether a device ID can be a CDI device name: ASCII letters, digits, `_`, `-`, `.`, `:`,
/// with a letter or digit first and last. A device whose ID cannot is left out of the spec (its
/// containers get the module's answer itself).
pub fn is_device_name(id: &str) -> bool {
    id.starts_with(|c: char| c.is_ascii_alphanumeric())
        && id.ends_with(|c: char| c.is_ascii_alphanumeric())
        && id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | ':'))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn device(name: &str, host_path: Option<&str>) -> SpecDevice {
        SpecDevice {
            name: name.into(),
            container_edits: Edits {
                device_nodes: vec![DeviceNode {
                    path: "/dev/x".into(),
                    host_path: host_path.map(Into::into),
                    permissions: None,
                }],
                ..Edits::default()
            },
        }
    }

    #[test]
    fn the_version_is_the_lowest_that_covers_what_is_used() {
        let none = Edits::default();
        assert_eq!(
            required_version("a.com/x", &[device("gpu0", None)], &none),
            "0.3.0"
        );
        assert_eq!(
            required_version("a.com/x", &[device("0", None)], &none),
            "0.5.0"
        );
        assert_eq!(
            required_version("a.com/x", &[device("gpu0", Some("/dev/y"))], &none),
            "0.5.0"
        );
        assert_eq!(
            required_version("a.com/x.shared", &[device("gpu0", None)], &none),
            "0.6.0"
        );
    }

    #[test]
    fn kinds_follow_the_cdi_grammar() {
        assert_eq!(
            kind_of("nvidia.com/gpu").as_deref(),
            Ok("devicelet.nvidia.com/gpu")
        );
        assert!(kind_of("devicelet.io/gpu.shared").is_ok());
        let e = kind_of("devicelet.io/1gpu").unwrap_err();
        assert!(e.contains("class \"1gpu\" must start with a letter"), "{e}");
        assert!(kind_of("fuse").is_err());
    }

    #[test]
    fn device_names_follow_the_cdi_grammar() {
        for ok in ["0", "gpu-0", "GPU-1b2c:3", "a.b_c"] {
            assert!(is_device_name(ok), "{ok}");
        }
        for bad in ["", "-a", "a-", "a/b", "a b", "gpu=0"] {
            assert!(!is_device_name(bad), "{bad}");
        }
    }
}
