//! What a module may read from the host. A module sees nothing of sysfs or /dev unless its
//! registry entry grants it, and grants are glob patterns over absolute paths so that an operator
//! can say "the PCI devices" (`/sys/bus/pci/devices/*`) without listing every address.

use glob::{MatchOptions, Pattern};

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

/// The vendor libraries this devicelet can expose to modules through typed host interfaces. A
/// registry naming another library is refused.
pub const VENDOR_LIBRARIES: &[&str] = &[NVML];

/// `*`, `?` and `[...]` never match `/`: a grant of `/sys/class/tty/*` must not reach
/// `/sys/class/tty/ttyS0/device/driver/...`. Only `**` crosses directories, and only when the
/// operator writes it.
const MATCH: MatchOptions = MatchOptions {
    case_sensitive: true,
    require_literal_separator: true,
    require_literal_leading_dot: false,
};

impl Grants {
    /// Whether `path` (an absolute host path as the module names it, not prefixed by the host
    /// root) is under one of the sysfs grants.
    ///
    /// A path that is not absolute and normalised (`.`, `..` or empty components) is refused
    /// outright rather than matched: `*` matches `..`, so `/sys/x/*/../../etc` would otherwise
    /// slip past `/sys/x/**`. Symlinks are the caller's to resolve before asking.
    pub fn allows_sysfs(&self, path: &str) -> bool {
        allows(&self.sysfs, path)
    }

    /// Whether `path` is under one of the /dev grants; see [`Grants::allows_sysfs`].
    pub fn allows_dev(&self, path: &str) -> bool {
        allows(&self.dev, path)
    }

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

fn allows(patterns: &[Pattern], path: &str) -> bool {
    normalized_absolute(path).is_ok()
        && patterns
            .iter()
            .any(|pattern| pattern.matches_with(path, MATCH))
}

const KEYS: &[&str] = &["sysfs", "dev", "mounts", "libraries"];

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
    node.array("an array of vendor library names")?
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
        .collect()
}

/// Host trees no device module may hand to a container: the kernel's, the node's credentials and
/// configuration, and the kubelet's and devicelet's own state.
const FORBIDDEN_MOUNTS: &[&str] = &[
    "/proc",
    "/sys",
    "/dev",
    "/etc",
    "/root",
    "/boot",
    "/var/lib/kubelet",
    "/var/lib/devicelet",
    "/run/containerd",
    "/var/run/containerd",
];

/// Directories for `mounts`: absolute, and outside the trees that have grants of their own (or
/// that no container should get from a device module).
fn mount_patterns(node: &Node<'_>) -> Result<Vec<Pattern>, RegistryError> {
    let items = patterns(node, "/")?;
    for (pattern, item) in items.iter().zip(node.array("")?.iter()) {
        let text = pattern.as_str();
        let parts: Vec<&str> = text.trim_start_matches('/').split('/').collect();
        let fixed = parts.len() >= 2 && !parts[..2].iter().any(|p| p.contains(['*', '?', '[']));
        let forbidden = FORBIDDEN_MOUNTS
            .iter()
            .any(|f| text == *f || text.starts_with(&format!("{f}/")));
        if !fixed || forbidden {
            return Err(item.error_in_str(
                0,
                format!(
                    "mount grant {text:?} must name a directory at least two levels deep (no glob \
                     in those two), and not under {} (use the sysfs and dev grants for /sys and \
                     /dev)",
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
    normalized_absolute(text).map_err(|index| {
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

/// `Ok` when `path` starts with `/` and every component is non-empty and neither `.` nor `..`;
/// otherwise the character index of the first bad component.
fn normalized_absolute(path: &str) -> Result<(), usize> {
    let Some(rest) = path.strip_prefix('/') else {
        return Err(0);
    };
    let mut index = 1;
    for component in rest.split('/') {
        if component.is_empty() || component == "." || component == ".." {
            return Err(index);
        }
        index += component.chars().count() + 1;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert!(g.allows_sysfs("/sys/bus/pci/devices/0000:00:1f.2"));
        assert!(!g.allows_sysfs("/sys/bus/pci/devices/0000:00:1f.2/vendor"));
        assert!(!g.allows_sysfs("/sys/bus/pci/devices"));
        assert!(g.allows_dev("/dev/fuse"));
        assert!(g.allows_dev("/dev/ttyUSB0"));
        assert!(!g.allows_dev("/dev/ttyUSB0/x"));
        assert!(!g.allows_dev("/dev/fuse2"));
        // sysfs grants say nothing about /dev and vice versa.
        assert!(!g.allows_dev("/sys/bus/pci/devices/0000:00:1f.2"));
        assert!(!g.allows_sysfs("/dev/fuse"));
        assert!(!Grants::default().allows_dev("/dev/fuse"));
        assert!(Grants::default().is_empty());
    }

    #[test]
    fn double_star_crosses_directories_but_not_upwards() {
        let g = grants(&["/sys/class/net/**"], &["/dev/*"]);
        assert!(g.allows_sysfs("/sys/class/net/eth0/address"));
        assert!(!g.allows_sysfs("/sys/class/net/../../../etc/shadow"));
        assert!(!g.allows_dev("/dev/.."));
        assert!(!g.allows_dev("/dev/."));
        assert!(!g.allows_dev("/dev//fuse"));
        assert!(!g.allows_dev("dev/fuse"));
        assert!(g.allows_dev("/dev/fuse"));
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
