//! Whether a path a module names is inside its registry grants: the security rule of the whole
//! sandbox. The agent's registry checks, its host interfaces and the SDK's test kit all call these
//! functions.
//!
//! Grants are glob patterns over absolute node paths (`/sys/bus/pci/devices/*`). Granting a path
//! grants everything below it. `*`, `?` and `[...]` never match `/`, so a grant of
//! `/sys/class/tty/*` does not reach `/sys/class/tty/ttyS0/device/driver`.

use glob::MatchOptions;
pub use glob::Pattern;

/// How a grant matches a path: one component per wildcard, case-sensitive.
pub const MATCH: MatchOptions = MatchOptions {
    case_sensitive: true,
    require_literal_separator: true,
    require_literal_leading_dot: false,
};

/// How a module's `/dev` glob (`devnodes.glob`) matches directory entries as it is walked: as
/// [`MATCH`], and a wildcard matches no leading dot, as a shell's does.
pub const WALK: MatchOptions = MatchOptions {
    require_literal_leading_dot: true,
    ..MATCH
};

/// Largest sysfs read handed to a module (sysfs attributes are a page at most); the kit cuts its
/// fake reads at the same size.
pub const MAX_SYSFS_READ: usize = 1 << 20;

/// Why a path was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Denied {
    /// Not absolute, or with an empty, `.` or `..` component (`*` matches `..`, so such paths are
    /// refused rather than matched or normalised). Carries the character index of the first bad
    /// component.
    NotNormal(usize),
    NotGranted,
}

/// `Ok` when `path` starts with `/` and every component is non-empty and neither `.` nor `..`;
/// otherwise the character index of the first bad component.
pub fn normal(path: &str) -> Result<(), usize> {
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

/// Whether `path` is normal and it, or one of its ancestors, matches one of `grants`.
pub fn granted(grants: &[Pattern], path: &str) -> bool {
    normal(path).is_ok()
        && std::path::Path::new(path).ancestors().any(|p| {
            p.to_str()
                .is_some_and(|p| grants.iter().any(|g| g.matches_with(p, MATCH)))
        })
}

/// Whether `path` itself (not only an ancestor) matches one of `grants`.
pub fn granted_exactly(grants: &[Pattern], path: &str) -> bool {
    normal(path).is_ok() && grants.iter().any(|g| g.matches_with(path, MATCH))
}

/// Whether some grant lies strictly below `dir`, so listing `dir` may reveal granted entries.
pub fn leads_to_grant(grants: &[Pattern], dir: &str) -> bool {
    let dir = dir.trim_end_matches('/');
    grants.iter().any(|g| {
        g.as_str()
            .strip_prefix(dir)
            .is_some_and(|rest| rest.starts_with('/'))
    })
}

/// Checks a path a module asked for: normal, and granted (or, when `listing`, a directory with a
/// grant below it).
pub fn check(grants: &[Pattern], path: &str, listing: bool) -> Result<(), Denied> {
    normal(path).map_err(Denied::NotNormal)?;
    if granted(grants, path) || listing && leads_to_grant(grants, path) {
        Ok(())
    } else {
        Err(Denied::NotGranted)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grants(patterns: &[&str]) -> Vec<Pattern> {
        patterns.iter().map(|p| Pattern::new(p).unwrap()).collect()
    }

    #[test]
    fn a_grant_covers_its_subtree_and_wildcards_stay_in_one_component() {
        let g = grants(&["/sys/class/tty/*", "/dev/net"]);
        assert!(granted(&g, "/sys/class/tty/ttyS0"));
        assert!(granted(&g, "/sys/class/tty/ttyS0/device/driver"));
        assert!(granted(&g, "/dev/net/tun"));
        assert!(!granted(&g, "/sys/class/net/eth0"));
        assert!(granted_exactly(&g, "/sys/class/tty/ttyS0"));
        assert!(!granted_exactly(&g, "/dev/net/tun"));
    }

    #[test]
    fn paths_that_are_not_normal_are_refused_whatever_the_grants() {
        let g = grants(&["/sys/**"]);
        for path in ["/sys/x/../../etc", "/sys//x", "/sys/./x", "sys/x", ""] {
            assert!(!granted(&g, path), "{path}");
            assert!(
                matches!(check(&g, path, false), Err(Denied::NotNormal(_))),
                "{path}"
            );
        }
        assert_eq!(normal("/sys/a/../b"), Err(7));
    }

    #[test]
    fn listing_is_allowed_on_the_way_to_a_grant_only() {
        let g = grants(&["/sys/bus/pci/devices/*"]);
        assert_eq!(check(&g, "/sys/bus", true), Ok(()));
        assert_eq!(check(&g, "/sys/bus", false), Err(Denied::NotGranted));
        assert_eq!(check(&g, "/sys/class", true), Err(Denied::NotGranted));
        assert!(!leads_to_grant(&g, "/sys/bus/pc"));
    }
}
