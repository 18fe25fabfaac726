//! What a module may read from the host. A module sees nothing of sysfs or /dev unless its
//! registry entry grants it, and grants are glob patterns over absolute paths so that an operator
//! can say "the PCI devices" (`/sys/bus/pci/devices/*`) without listing every address.

use devicelet_rules::grants::{MATCH, Pattern};

use super::error::RegistryError;
use super::value::Node;

/// The host paths a module may read, as glob patterns. Empty (the default) grants nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Grants {
    /// Patterns under `/sys/`, for enumerating devices and reading their attributes.
    pub sysfs: Vec<Pattern>,
    /// Patterns under `/dev/`, for device nodes handed to containers.
    pub dev: Vec<Pattern>,
    /// Host directories the module may hand to containers as mounts (an MPS pipe directory),
    /// without reading them itself. Not under /proc, /sys or /dev: those have grants of their
    /// own.
    pub mounts: Vec<Pattern>,
    /// Vendor libraries (such as NVML) whose typed host interface the module may import, by
    /// name; only names in [`VENDOR_LIBRARIES`] are accepted.
    pub libraries: Vec<String>,
}

/// NVIDIA's management library, behind the `nvml` host interface.
pub const NVML: &str = "nvml";
/// The same library's functions that change a GPU (making and destroying MIG instances, the
/// `mig` host interface): a grant of their own, beside [`NVML`], since a module that only reads
/// GPUs should not be able to repartition them.
pub const NVML_MIG: &str = "nvml-mig";

/// The vendor libraries this devicelet can expose to modules through typed host interfaces. A
/// registry naming another library is refused.
pub const VENDOR_LIBRARIES: &[&str] = &[NVML, NVML_MIG];

impl Grants {
    /// Whether the vendor library `name` is granted.
    pub fn has_library(&self, name: &str) -> bool {
        self.libraries.iter().any(|l| l == name)
    }

    /// Whether nothing at all is granted.
    pub fn is_empty(&self) -> bool {
        self.sysfs.is_empty()
            && self.dev.is_empty()
            && self.mounts.is_empty()
            && self.libraries.is_empty()
    }
}

pub(super) const KEYS: &[&str] = &["sysfs", "dev", "mounts", "libraries"];

/// Reads a `[module.grants]` table.
pub(super) fn parse(node: &Node<'_>) -> Result<Grants, RegistryError> {
    let table = node.table("a table of grants, e.g. { dev = [\"/dev/fuse\"] }")?;
    let mut grants = Grants::default();
    for entry in table.entries() {
        match entry.name {
            "sysfs" => grants.sysfs = patterns(&entry.node, "/sys/")?,
            "dev" => grants.dev = patterns(&entry.node, "/dev/")?,
            "mounts" => grants.mounts = mount_patterns(&entry.node)?,
            "libraries" => grants.libraries = libraries(&entry.node)?,
            _ => return Err(entry.unknown(KEYS)),
        }
    }
    Ok(grants)
}

fn libraries(node: &Node<'_>) -> Result<Vec<String>, RegistryError> {
    let names = node
        .array("an array of vendor library names")?
        .iter()
        .map(|item| {
            let name = item.str()?;
            if VENDOR_LIBRARIES.contains(&name) {
                Ok(name.to_owned())
            } else {
                let known = if VENDOR_LIBRARIES.is_empty() {
                    "this devicelet provides none yet".to_owned()
                } else {
                    format!("known: {}", VENDOR_LIBRARIES.join(", "))
                };
                Err(item.error_in_str(0, format!("unknown vendor library {name:?} ({known})")))
            }
        })
        .collect::<Result<Vec<String>, RegistryError>>()?;
    if names.iter().any(|n| n == NVML_MIG) && !names.iter().any(|n| n == NVML) {
        return Err(node.error(format!(
            "{NVML_MIG:?} needs {NVML:?} granted too: it makes MIG instances through the same \
             library, and the module finds the GPUs through `nvml`"
        )));
    }
    Ok(names)
}

/// Host trees no device module may hand to a container, nor any directory above one: the
/// kernel's, the node's credentials and configuration, the kubelet's and devicelet's own state,
/// the container runtimes' state and sockets, and the CDI spec directories (a container that can
/// write a spec can give the next container anything).
pub const FORBIDDEN_MOUNTS: &[&str] = &[
    "/proc",
    "/sys",
    "/dev",
    "/etc",
    "/root",
    "/boot",
    "/var/lib/kubelet",
    "/var/lib/devicelet",
    "/var/lib/containerd",
    "/var/lib/docker",
    "/var/lib/containers",
    "/var/lib/crio",
    "/run/containerd",
    "/var/run/containerd",
    "/run/crio",
    "/var/run/crio",
    "/run/docker",
    "/var/run/docker",
    "/run/docker.sock",
    "/var/run/docker.sock",
    "/run/containers",
    "/var/run/containers",
    "/run/podman",
    "/var/run/podman",
    "/run/cdi",
    "/var/run/cdi",
    "/etc/cdi",
];

/// The forbidden tree (see [`FORBIDDEN_MOUNTS`]) that some path the grant `pattern` matches lies
/// in or above, if there is one. Judged by where the pattern can lead, not by its text: `*`, `?`
/// and character classes are matched against each forbidden tree component by component, `**`
/// (which can stand for any depth) reaches every tree below where it stands, and a component
/// that is no glob of its own (a class split by `/`) is taken to match anything.
pub fn forbidden_by_pattern(pattern: &str) -> Option<&'static str> {
    FORBIDDEN_MOUNTS.iter().copied().find(|tree| {
        reaches(pattern, tree, |part, name| {
            part == "**" || Pattern::new(part).map_or(true, |glob| glob.matches_with(name, MATCH))
        })
    })
}

/// The forbidden tree the resolved, literal `path` lies in or above, if there is one: what every
/// mount an answer asks for is checked against after its symlinks are resolved.
pub fn forbidden_by_path(path: &str) -> Option<&'static str> {
    FORBIDDEN_MOUNTS
        .iter()
        .copied()
        .find(|tree| forbidden_by_path_in(path, tree))
}

/// Whether the literal `path` lies in or above `tree`.
pub fn forbidden_by_path_in(path: &str, tree: &str) -> bool {
    reaches(path, tree, |part, name| part == name)
}

/// Whether a path `pattern` (absolute, `/`-separated) can match `tree`, a path above it, or a
/// path below it; `matches(part, name)` says whether one component of the pattern can be one
/// component of the tree. A `**` part ends the comparison: it can stand for what is left.
fn reaches(pattern: &str, tree: &str, matches: impl Fn(&str, &str) -> bool) -> bool {
    let pattern = pattern.trim_start_matches('/');
    if pattern.is_empty() {
        // `/` is above everything.
        return true;
    }
    let mut tree = tree.trim_start_matches('/').split('/');
    for part in pattern.split('/') {
        if part == "**" {
            return true;
        }
        match tree.next() {
            // The pattern goes on below the tree: what it matches there is inside it.
            None => return true,
            Some(name) if !matches(part, name) => return false,
            Some(_) => {}
        }
    }
    // The pattern ends at the tree or above it.
    true
}

/// Directories for `mounts`: absolute, at least two levels deep with no glob in those two, and
/// unable to match anything in or above a forbidden tree (those have grants of their own, or no
/// container should get them from a device module).
fn mount_patterns(node: &Node<'_>) -> Result<Vec<Pattern>, RegistryError> {
    let items = patterns(node, "/")?;
    for (pattern, item) in items.iter().zip(node.array("")?.iter()) {
        let text = pattern.as_str();
        let parts: Vec<&str> = text.trim_start_matches('/').split('/').collect();
        let fixed = parts.len() >= 2 && !parts[..2].iter().any(|p| p.contains(['*', '?', '[']));
        if !fixed {
            return Err(item.error_in_str(
                0,
                format!(
                    "mount grant {text:?} must name a directory at least two levels deep, with \
                     no glob in those two"
                ),
            ));
        }
        if let Some(tree) = forbidden_by_pattern(text) {
            return Err(item.error_in_str(
                0,
                format!(
                    "mount grant {text:?} could match {tree} or a directory above or below it, \
                     which no module may hand to a container (none of {} may be; use the \
                     sysfs and dev grants for /sys and /dev)",
                    FORBIDDEN_MOUNTS.join(", ")
                ),
            ));
        }
    }
    Ok(items)
}

fn patterns(node: &Node<'_>, prefix: &str) -> Result<Vec<Pattern>, RegistryError> {
    let example = format!("an array of glob patterns, e.g. [\"{prefix}*\"]");
    node.array(&example)?
        .iter()
        .map(|item| {
            let text = item.str()?;
            pattern(text, prefix).map_err(|(index, message)| item.error_in_str(index, message))
        })
        .collect()
}

/// A grant pattern: an absolute, normalised path under `prefix`, valid as a glob.
fn pattern(text: &str, prefix: &str) -> Result<Pattern, (usize, String)> {
    if !text.starts_with(prefix) {
        return Err((
            0,
            format!("grant {text:?} is not under {prefix}: it must start with {prefix:?}"),
        ));
    }
    devicelet_rules::grants::normal(text).map_err(|index| {
        (
            index,
            format!(
                "grant {text:?} is not a normalised absolute path: it must not contain empty, \".\" \
                 or \"..\" components, nor end with '/'"
            ),
        )
    })?;
    Pattern::new(text).map_err(|error| {
        (
            error.pos,
            format!("grant {text:?} is not a valid glob pattern: {}", error.msg),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use devicelet_rules::grants::granted;

    fn grants(sysfs: &[&str], dev: &[&str]) -> Grants {
        let compile = |patterns: &[&str], prefix| {
            patterns
                .iter()
                .map(|p| pattern(p, prefix).unwrap())
                .collect()
        };
        Grants {
            sysfs: compile(sysfs, "/sys/"),
            dev: compile(dev, "/dev/"),
            mounts: Vec::new(),
            libraries: Vec::new(),
        }
    }

    #[test]
    fn star_stays_within_one_component() {
        let g = grants(&["/sys/bus/pci/devices/*"], &["/dev/fuse", "/dev/ttyUSB*"]);
        assert!(granted(&g.sysfs, "/sys/bus/pci/devices/0000:00:1f.2"));
        // Granting a path grants what is below it, as the host interfaces read it (the
        // registry's own copy of this rule once matched the path alone and said no here).
        assert!(granted(
            &g.sysfs,
            "/sys/bus/pci/devices/0000:00:1f.2/vendor"
        ));
        assert!(!granted(&g.sysfs, "/sys/bus/pci/devices0"));
        assert!(!granted(&g.sysfs, "/sys/bus/pci/devices"));
        assert!(granted(&g.dev, "/dev/fuse"));
        assert!(granted(&g.dev, "/dev/ttyUSB0"));
        assert!(granted(&g.dev, "/dev/ttyUSB0/x"));
        assert!(!granted(&g.dev, "/dev/fuse2"));
        // sysfs grants say nothing about /dev and vice versa.
        assert!(!granted(&g.dev, "/sys/bus/pci/devices/0000:00:1f.2"));
        assert!(!granted(&g.sysfs, "/dev/fuse"));
        assert!(!granted(&Grants::default().dev, "/dev/fuse"));
        assert!(Grants::default().is_empty());
    }

    #[test]
    fn double_star_crosses_directories_but_not_upwards() {
        let g = grants(&["/sys/class/net/**"], &["/dev/*"]);
        assert!(granted(&g.sysfs, "/sys/class/net/eth0/address"));
        assert!(!granted(&g.sysfs, "/sys/class/net/../../../etc/shadow"));
        assert!(!granted(&g.dev, "/dev/.."));
        assert!(!granted(&g.dev, "/dev/."));
        assert!(!granted(&g.dev, "/dev//fuse"));
        assert!(!granted(&g.dev, "dev/fuse"));
        assert!(granted(&g.dev, "/dev/fuse"));
    }

    #[test]
    fn mount_grants_are_judged_by_where_they_can_lead() {
        for bad in [
            "/var/lib/kube*",
            "/var/lib/[k]ubelet",
            "/var/lib/*",
            "/var/lib/k?belet",
            "/var/lib/kubelet/pods",
            "/var/lib",
            "/var/**",
            "/var/lib/**/x",
            "/var/lib/containerd",
            "/var/lib/[a-z]*d",
            "/run/cdi",
            "/var/run/d*",
            "/etc/cdi",
        ] {
            assert!(forbidden_by_pattern(bad).is_some(), "{bad} passed");
        }
        for good in [
            "/run/nvidia/mps",
            "/run/nvidia/*",
            "/var/lib/kubelet-plugins-x",
            "/opt/**",
            "/var/lib/nvidia/[a-z]*",
            "/var/run/nvidia-mps",
        ] {
            assert_eq!(forbidden_by_pattern(good), None, "{good}");
        }
        assert_eq!(
            forbidden_by_path("/var/lib/kubelet/pods"),
            Some("/var/lib/kubelet")
        );
        assert_eq!(forbidden_by_path("/var/lib"), Some("/var/lib/kubelet"));
        assert_eq!(forbidden_by_path("/"), Some("/proc"));
        assert_eq!(forbidden_by_path("/var/lib/kube*"), None, "a literal path");
        assert_eq!(forbidden_by_path("/run/nvidia/mps"), None);
    }

    #[test]
    fn patterns_are_checked() {
        assert!(
            pattern("/dev/fuse", "/sys/")
                .unwrap_err()
                .1
                .contains("is not under /sys/")
        );
        assert!(
            pattern("dev/fuse", "/dev/")
                .unwrap_err()
                .1
                .contains("is not under /dev/")
        );
        assert!(
            pattern("/dev", "/dev/")
                .unwrap_err()
                .1
                .contains("is not under /dev/")
        );
        assert_eq!(pattern("/dev/", "/dev/").unwrap_err().0, 5);
        assert_eq!(pattern("/dev/a/../b", "/dev/").unwrap_err().0, 7);
        assert_eq!(pattern("/dev//a", "/dev/").unwrap_err().0, 5);
        let (index, message) = pattern("/dev/tty[", "/dev/").unwrap_err();
        assert_eq!(index, 8);
        assert!(message.contains("not a valid glob pattern"), "{message}");
    }
}
