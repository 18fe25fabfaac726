//! Mapping a module's logical paths (`/sys/...`, `/dev/...`) onto the host root, inside its grants.
//!
//! A module always speaks in node paths; the host root (a fixture tree in tests) is the host's
//! business. Granting a path grants everything below it.

use std::path::{Path, PathBuf};

use glob::{MatchOptions, Pattern};

const MATCH: MatchOptions = MatchOptions {
    case_sensitive: true,
    require_literal_separator: true,
    require_literal_leading_dot: false,
};

/// Why a path was refused, for the module's `fs-error.denied`.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum PathError {
    #[error("{0} is not an absolute, normalised path")]
    NotNormal(String),
    #[error("{0} is outside the module's grants")]
    NotGranted(String),
    #[error("{0} resolves outside the host root")]
    Escapes(String),
}

/// Whether `path` or one of its ancestors matches one of `grants`.
pub fn granted(grants: &[Pattern], path: &str) -> bool {
    Path::new(path).ancestors().any(|p| {
        p.to_str()
            .is_some_and(|p| grants.iter().any(|g| g.matches_with(p, MATCH)))
    })
}

/// Whether some grant lies strictly below `dir`, so listing it may reveal granted entries.
pub fn leads_to_grant(grants: &[Pattern], dir: &str) -> bool {
    let dir = dir.trim_end_matches('/');
    grants.iter().any(|g| {
        g.as_str()
            .strip_prefix(dir)
            .is_some_and(|rest| rest.starts_with('/'))
    })
}

/// Absolute, with no empty, `.` or `..` components: `Path::components` would quietly drop `.`
/// and `//`, and a glob's `*` matches them, so they are refused here rather than normalised.
fn is_normal(path: &str) -> bool {
    path.strip_prefix('/').is_some_and(|rest| {
        rest.split('/')
            .all(|c| !c.is_empty() && c != "." && c != "..")
    })
}

/// Resolves a logical path the module may use to its place under the host root, refusing paths
/// that are not normal, not granted (unless `listing` and a grant lies below), or whose resolved
/// location (after symlinks) leaves the host root.
pub fn resolve(
    root: &Path,
    grants: &[Pattern],
    path: &str,
    listing: bool,
) -> Result<PathBuf, PathError> {
    if !is_normal(path) {
        return Err(PathError::NotNormal(path.to_owned()));
    }
    if !(granted(grants, path) || listing && leads_to_grant(grants, path)) {
        return Err(PathError::NotGranted(path.to_owned()));
    }
    let physical = root.join(path.trim_start_matches('/'));
    // Symlinks (sysfs is full of them) may be followed, but only while they stay inside the
    // tree the path started in: `/sys/...` must resolve inside the host root's `/sys`.
    let area = path.split('/').nth(1).unwrap_or_default();
    let escapes = |_| PathError::Escapes(path.to_owned());
    match physical.canonicalize() {
        Ok(real) => {
            let real_area = root.join(area).canonicalize().map_err(escapes)?;
            if !real.starts_with(&real_area) {
                return Err(PathError::Escapes(path.to_owned()));
            }
        }
        // Nothing there: the caller's own open reports it as not found.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(escapes(e)),
    }
    Ok(physical)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pats(p: &[&str]) -> Vec<Pattern> {
        p.iter().map(|p| Pattern::new(p).unwrap()).collect()
    }

    #[test]
    fn a_grant_covers_its_subtree_but_not_its_siblings() {
        let g = pats(&["/sys/bus/pci/devices/*"]);
        assert!(granted(&g, "/sys/bus/pci/devices/0000:01:00.0"));
        assert!(granted(&g, "/sys/bus/pci/devices/0000:01:00.0/vendor"));
        assert!(!granted(&g, "/sys/bus/usb/devices/1-1"));
        assert!(!granted(&g, "/sys/bus/pci"));
    }

    #[test]
    fn listing_a_parent_of_a_grant_is_allowed() {
        let g = pats(&["/sys/bus/pci/devices/*"]);
        assert!(leads_to_grant(&g, "/sys/bus/pci/devices"));
        assert!(leads_to_grant(&g, "/sys/bus"));
        assert!(!leads_to_grant(&g, "/sys/class"));
    }

    #[test]
    fn dot_dot_and_relative_paths_are_refused() {
        let root = Path::new("/nonexistent-root");
        let g = pats(&["/dev/*"]);
        assert_eq!(
            resolve(root, &g, "/dev/../etc/passwd", false),
            Err(PathError::NotNormal("/dev/../etc/passwd".into()))
        );
        assert!(resolve(root, &g, "dev/fuse", false).is_err());
        assert!(resolve(root, &g, "/dev/./fuse", false).is_err());
        assert!(resolve(root, &g, "/dev//fuse", false).is_err());
        assert_eq!(
            resolve(root, &g, "/dev/fuse", false),
            Ok(PathBuf::from("/nonexistent-root/dev/fuse"))
        );
    }

    #[test]
    fn symlinks_leaving_the_root_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("dev")).unwrap();
        std::os::unix::fs::symlink("/etc/hostname", dir.path().join("dev/escape")).unwrap();
        let g = pats(&["/dev/*"]);
        assert_eq!(
            resolve(dir.path(), &g, "/dev/escape", false),
            Err(PathError::Escapes("/dev/escape".into()))
        );
    }

    #[test]
    fn symlinks_leaving_their_tree_are_refused_even_inside_the_root() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("sys/class")).unwrap();
        std::fs::create_dir_all(dir.path().join("etc")).unwrap();
        std::fs::write(dir.path().join("etc/shadow"), "x").unwrap();
        std::fs::create_dir_all(dir.path().join("sys/devices/pci0")).unwrap();
        std::fs::write(dir.path().join("sys/devices/pci0/vendor"), "0x10de").unwrap();
        std::os::unix::fs::symlink("../../etc", dir.path().join("sys/class/out")).unwrap();
        std::os::unix::fs::symlink("../devices/pci0", dir.path().join("sys/class/gpu")).unwrap();
        let g = pats(&["/sys/class/*"]);
        assert!(resolve(dir.path(), &g, "/sys/class/out/shadow", false).is_err());
        assert!(resolve(dir.path(), &g, "/sys/class/gpu/vendor", false).is_ok());
    }
}
