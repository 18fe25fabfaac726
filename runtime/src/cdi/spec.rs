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
    /// `c` or `b`, the node's numbers, its permission bits and owner: as the host node is, so
    /// the runtime makes the container's node as a CRI `Device` entry would (without them
    /// containerd 2.x gives it to the container's user, podman makes it 0666).
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub major: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub minor: Option<u64>,
    #[serde(rename = "fileMode", skip_serializing_if = "Option::is_none")]
    pub file_mode: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub uid: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gid: Option<u32>,
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
/// host path differs. Older runtimes read older versions; no class of ours needs 0.6.0.
pub fn required_version(devices: &[SpecDevice], common: &Edits) -> &'static str {
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

/// The CDI kind for a served resource `vendor/name`: `devicelet.<vendor>/<class>`, or why it
/// cannot be one.
///
/// Ours, not the resource name itself: a vendor's own tooling may write specs of kind
/// `vendor/class` for the same devices (nvidia-ctk writes `nvidia.com/gpu=<uuid>`), and two
/// specs naming one device make runtimes drop both, or shadow one.
///
/// The class is the name part spelled as every CDI library accepts it: letters, digits, `_` and
/// `-`, a letter first (CDI 0.5, which podman 4.3 vendors, refuses a `.`). `_` becomes `__`,
/// `.` becomes `_d`, and a name starting with a digit gets `n_` in front: `gpu` stays `gpu`,
/// `gpu.shared` is `gpu_dshared`, `mig-1g.10gb` is `mig-1g_d10gb`. No two resource names get one
/// kind: read left to right, a `_` is always followed by `_`, `d`, or (second, after the leading
/// `n`) a digit, each from one source only.
pub fn kind_of(resource: &str) -> Result<String, String> {
    let Some((vendor, name)) = resource.split_once('/') else {
        return Err(format!("{resource:?} has no vendor domain"));
    };
    let vendor = format!("devicelet.{vendor}");
    check_vendor_or_class("vendor", &vendor, &['_', '-', '.'])?;
    let class = class_of(name);
    check_vendor_or_class("class", &class, &['_', '-'])?;
    Ok(format!("{vendor}/{class}"))
}

/// The CDI kind of a DRA driver's per-claim specs, `k8s.<driver>/<class>` with the class from
/// the resource's own name (dra-example-driver names its `k8s.gpu.example.com/gpu`): the
/// `k8s.` vendor prefix keeps them apart from a vendor's own specs.
pub fn dra_kind(driver: &str, resource: &str) -> Result<String, String> {
    let vendor = format!("k8s.{driver}");
    check_vendor_or_class("vendor", &vendor, &['_', '-', '.'])?;
    let name = resource.rsplit('/').next().unwrap_or(resource);
    let class = class_of(name);
    check_vendor_or_class("class", &class, &['_', '-'])?;
    Ok(format!("{vendor}/{class}"))
}

/// Checks a fully qualified CDI device name, `vendor/class=device`, by the CDI grammar (vendor
/// and class start with a letter and end with a letter or digit; the vendor may hold `-_.`, the
/// class `-_`; the device as [`is_device_name`]). The one copy of that grammar: the CDI names a
/// module returns are checked here, and the agent's own kinds ([`kind_of`]) follow the same
/// vendor and class rule.
pub fn check_qualified_name(name: &str) -> Result<(), String> {
    let (kind, device) = name
        .split_once('=')
        .ok_or_else(|| format!("{name:?} has no `=device` part"))?;
    let (vendor, class) = kind
        .split_once('/')
        .ok_or_else(|| format!("{name:?} has no `vendor/` part"))?;
    check_vendor_or_class("vendor", vendor, &['_', '-', '.'])?;
    check_vendor_or_class("class", class, &['_', '-'])?;
    if !is_device_name(device) {
        return Err(format!("its CDI device name {device:?} is not valid"));
    }
    Ok(())
}

/// A resource's name part as a CDI class (see [`kind_of`]).
fn class_of(name: &str) -> String {
    let mut class = String::with_capacity(name.len() + 4);
    if name.starts_with(|c: char| c.is_ascii_digit()) {
        class.push_str("n_");
    }
    for c in name.chars() {
        match c {
            '_' => class.push_str("__"),
            '.' => class.push_str("_d"),
            c => class.push(c),
        }
    }
    class
}

/// A vendor or class name: ASCII letters, digits and `extra`; a letter first, a letter or digit
/// last.
fn check_vendor_or_class(what: &str, name: &str, extra: &[char]) -> Result<(), String> {
    let allowed = |c: char| c.is_ascii_alphanumeric() || extra.contains(&c);
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
                    kind: None,
                    major: None,
                    minor: None,
                    file_mode: None,
                    uid: None,
                    gid: None,
                }],
                ..Edits::default()
            },
        }
    }

    #[test]
    fn the_version_is_the_lowest_that_covers_what_is_used() {
        let none = Edits::default();
        assert_eq!(required_version(&[device("gpu0", None)], &none), "0.3.0");
        assert_eq!(required_version(&[device("0", None)], &none), "0.5.0");
        assert_eq!(
            required_version(&[device("gpu0", Some("/dev/y"))], &none),
            "0.5.0"
        );
    }

    #[test]
    fn kinds_follow_the_cdi_0_5_grammar_one_kind_per_resource() {
        assert_eq!(
            kind_of("nvidia.com/gpu").as_deref(),
            Ok("devicelet.nvidia.com/gpu")
        );
        assert_eq!(
            kind_of("devicelet.io/gpu.shared").as_deref(),
            Ok("devicelet.devicelet.io/gpu_dshared")
        );
        assert_eq!(
            kind_of("nvidia.com/mig-1g.10gb").as_deref(),
            Ok("devicelet.nvidia.com/mig-1g_d10gb")
        );
        assert_eq!(
            kind_of("devicelet.io/1gpu").as_deref(),
            Ok("devicelet.devicelet.io/n_1gpu")
        );
        assert!(kind_of("fuse").is_err());
        // Names that could collide under a careless escape each get their own class.
        let names = [
            "a_b", "a.b", "a__b", "a._b", "a_.b", "a_db", "a.db", "n_1", "n.1", "n1", "1", "n__1",
            "a-b", "a_d", "a.d",
        ];
        let kinds: std::collections::BTreeSet<String> = names
            .iter()
            .map(|n| kind_of(&format!("x.io/{n}")).unwrap())
            .collect();
        assert_eq!(kinds.len(), names.len(), "{kinds:?}");
        for kind in &kinds {
            let class = kind.split_once('/').unwrap().1;
            assert!(
                !class.contains('.') && class.starts_with(|c: char| c.is_ascii_alphabetic()),
                "{kind}"
            );
        }
    }

    #[test]
    fn qualified_names_follow_the_cdi_grammar_in_every_part() {
        assert_eq!(check_qualified_name("nvidia.com/gpu=GPU-1:0"), Ok(()));
        // The sandbox's own copy of this grammar let a vendor or class start with a digit, which
        // every CDI library refuses.
        for bad in [
            "1vendor.com/gpu=0",
            "vendor.com/1gpu=0",
            "vendor.com/g.pu=0",
            "vendor.com/gpu=.",
            "vendor.com=0",
            "vendor.com/gpu",
        ] {
            assert!(check_qualified_name(bad).is_err(), "{bad}");
        }
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
