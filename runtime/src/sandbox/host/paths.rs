//! Mapping a module's logical paths (`/sys/...`, `/dev/...`) onto the host root, inside its grants.
//!
//! A module always speaks in node paths; the host root (a fixture tree in tests) is the host's
//! business. Granting a path grants everything below it.

use std::path::{Path, PathBuf};

use cap_std::ambient_authority;
use cap_std::fs::Dir;
use devicelet_rules::grants::{Denied, Pattern};
pub use devicelet_rules::grants::{granted, granted_exactly, leads_to_grant};

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

/// Checks a logical path a module asked for ([`devicelet_rules::grants::check`]), naming it in the error.
pub fn check(grants: &[Pattern], path: &str, listing: bool) -> Result<(), PathError> {
    devicelet_rules::grants::check(grants, path, listing).map_err(|e| match e {
        Denied::NotNormal(_) => PathError::NotNormal(path.to_owned()),
        Denied::NotGranted => PathError::NotGranted(path.to_owned()),
    })
}

/// A checked logical path, opened as the tree it starts in (the host root's `/sys` or `/dev`)
/// plus the rest of the path. Everything done through it resolves beneath that tree in one step
/// (cap-std: `openat2` with `RESOLVE_BENEATH` where the kernel has it): symlinks are followed only
/// while they stay inside, and there is no window between checking a path and opening it.
pub struct Beneath {
    pub dir: Dir,
    /// Relative to `dir`; `.` for the tree itself.
    pub rel: PathBuf,
}

/// Opens the tree `path` starts in. `path` must have passed [`check`] (or be otherwise normal).
pub fn beneath(root: &Path, path: &str) -> std::io::Result<Beneath> {
    let rest = path.strip_prefix('/').unwrap_or(path);
    let (area, rel) = rest.split_once('/').unwrap_or((rest, "."));
    let dir = Dir::open_ambient_dir(root.join(area), ambient_authority())?;
    Ok(Beneath {
        dir,
        rel: PathBuf::from(rel),
    })
}

/// Whether an I/O error means the path tried to leave its tree (cap-std reports escapes as
/// permission errors; the kernel's `RESOLVE_BENEATH` as `EXDEV`).
pub fn escaped(e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::PermissionDenied || e.raw_os_error() == Some(libc::EXDEV)
}

/// Where `path` really is, as a logical path: symlinks resolved beneath its tree.
pub fn real_path(root: &Path, path: &str) -> std::io::Result<String> {
    resolved(root, path).map(|(real, _, _)| real)
}

/// Where `path` really is, and what is there, with the tree opened once.
pub fn real_path_and_metadata(
    root: &Path,
    path: &str,
) -> std::io::Result<(String, cap_std::fs::Metadata)> {
    let (real, at, canonical) = resolved(root, path)?;
    let meta = at.dir.metadata(canonical)?;
    Ok((real, meta))
}

/// The logical real path, the opened tree, and the canonical path within it.
fn resolved(root: &Path, path: &str) -> std::io::Result<(String, Beneath, PathBuf)> {
    let at = beneath(root, path)?;
    let canonical = at.dir.canonicalize(&at.rel)?;
    let area = path.split('/').nth(1).unwrap_or_default();
    let text = canonical
        .to_str()
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidData, "path is not UTF-8"))?;
    let real = if text.is_empty() || text == "." {
        format!("/{area}")
    } else {
        format!("/{area}/{text}")
    };
    Ok((real, at, canonical))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pats(p: &[&str]) -> Vec<Pattern> {
        p.iter().map(|p| Pattern::new(p).unwrap()).collect()
    }

    #[test]
    fn dot_dot_and_relative_paths_are_refused() {
        let g = pats(&["/dev/*"]);
        assert_eq!(
            check(&g, "/dev/../etc/passwd", false),
            Err(PathError::NotNormal("/dev/../etc/passwd".into()))
        );
        assert!(check(&g, "dev/fuse", false).is_err());
        assert!(check(&g, "/dev/./fuse", false).is_err());
        assert!(check(&g, "/dev//fuse", false).is_err());
        assert_eq!(check(&g, "/dev/fuse", false), Ok(()));
    }

    #[test]
    fn symlinks_leaving_the_root_are_refused() {
        // The targets exist outside the root, so only the escape check can refuse them.
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("secret"), "x").unwrap();
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("dev")).unwrap();
        std::os::unix::fs::symlink(outside.path().join("secret"), dir.path().join("dev/escape"))
            .unwrap();
        let up = format!("../../../../../../../..{}", outside.path().display());
        std::os::unix::fs::symlink(up, dir.path().join("dev/up")).unwrap();
        let at = beneath(dir.path(), "/dev/escape").unwrap();
        let e = at.dir.open(&at.rel).unwrap_err();
        assert!(escaped(&e), "{e}");
        let at = beneath(dir.path(), "/dev/up/secret").unwrap();
        let e = at.dir.open(&at.rel).unwrap_err();
        assert!(escaped(&e), "{e}");
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
        let out = beneath(dir.path(), "/sys/class/out/shadow").unwrap();
        let e = out.dir.open(&out.rel).unwrap_err();
        assert!(escaped(&e), "{e}");
        let gpu = beneath(dir.path(), "/sys/class/gpu/vendor").unwrap();
        assert!(gpu.dir.open(&gpu.rel).is_ok());
        assert_eq!(
            real_path(dir.path(), "/sys/class/gpu/vendor").unwrap(),
            "/sys/devices/pci0/vendor"
        );
    }
}
