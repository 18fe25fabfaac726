//! Which directories the agent may trust: those that no user but root and the agent's own can
//! change.
//!
//! What the agent loads (precompiled machine code), names (CDI specs a runtime applies) or
//! reports (its status socket) is trusted because of where it is. That holds only if nobody else
//! can put something there or swap the directory itself: whoever can write to a directory, or to
//! any directory above it, can rename it away and put one of their own in its place. So, as
//! sshd's `StrictModes` checks a user's `authorized_keys`, a trusted directory and every one above
//! it up to `/` must be owned by root or by us and writable by nobody else. A sticky directory
//! above (`/tmp`) is allowed: there only the owner of an entry may rename or remove it. Symlinks
//! on the way are followed, and both the path as written and where it leads are checked, since
//! whoever can write the directory holding a symlink can point it elsewhere.

use std::io;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// Why a directory cannot be trusted. Each names the path and what is wrong with it.
#[derive(Debug, thiserror::Error)]
pub enum Untrusted {
    #[error("cannot inspect {path}: {source}")]
    Inspect { path: PathBuf, source: io::Error },
    #[error("{path} is not a directory")]
    NotADirectory { path: PathBuf },
    #[error("{path} is owned by uid {owner}, not by root or this agent (uid {uid})")]
    Owner { path: PathBuf, owner: u32, uid: u32 },
    #[error("{path} has mode {mode:04o}: users other than its owner may write to it")]
    Writable { path: PathBuf, mode: u32 },
}

impl Untrusted {
    /// The directory the complaint is about (the checked one, or one above it).
    pub fn path(&self) -> &Path {
        match self {
            Untrusted::Inspect { path, .. }
            | Untrusted::NotADirectory { path }
            | Untrusted::Owner { path, .. }
            | Untrusted::Writable { path, .. } => path,
        }
    }

    /// What the operator can do about it.
    pub fn fix(&self) -> String {
        match self {
            Untrusted::Owner { path, .. } => format!(
                "give it to root or to the agent's user (`chown root {}`), or choose another \
                 directory",
                path.display()
            ),
            Untrusted::Writable { path, mode } => format!(
                "take the write bits away from others (`chmod {:04o} {}`) and check what is in \
                 it, or choose another directory",
                mode & !0o022,
                path.display()
            ),
            Untrusted::NotADirectory { .. } | Untrusted::Inspect { .. } => {
                "choose another directory".into()
            }
        }
    }
}

/// The agent's effective uid: what it owns, and whom it trusts besides root.
pub fn euid() -> u32 {
    // SAFETY: geteuid(2) has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// Whether root or we own files of `uid`.
pub fn is_ours_or_root(uid: u32) -> bool {
    uid == 0 || uid == euid()
}

/// Ok when no user but root and us can change what `dir` holds or swap it: `dir` is a directory
/// owned by root or us and writable by nobody else (sticky or not), and so is every directory
/// above it, except that those may be sticky and writable by all.
pub fn check_dir(dir: &Path) -> Result<(), Untrusted> {
    let (path, owner) = check_dir_of_anyone(dir)?;
    if !is_ours_or_root(owner) {
        return Err(Untrusted::Owner {
            path,
            owner,
            uid: euid(),
        });
    }
    Ok(())
}

/// As [`check_dir`], but `dir` itself may belong to anyone (it must still be writable by its
/// owner alone); returns its owner. Only that owner and root can then put anything in it: how
/// `devicelet status`, run as root, tells an agent running as another user from an impostor.
pub fn check_dir_of_anyone(dir: &Path) -> Result<(PathBuf, u32), Untrusted> {
    let dir = std::path::absolute(dir).map_err(inspect(dir))?;
    let real = std::fs::canonicalize(&dir).map_err(inspect(&dir))?;
    let meta = std::fs::metadata(&real).map_err(inspect(&real))?;
    if !meta.is_dir() {
        return Err(Untrusted::NotADirectory { path: dir });
    }
    let mode = meta.mode() & 0o7777;
    if mode & 0o022 != 0 {
        return Err(Untrusted::Writable { path: real, mode });
    }
    // Every directory the path passes through, as written and hop by hop through its symlinks,
    // and every directory above where it leads.
    walk(&dir, 0)?;
    check_above(&real)?;
    Ok((real, meta.uid()))
}
/// Creates `dir` (and what is missing above it) 0700 when it does not exist, then requires it to
/// be ours, private and trusted ([`check_dir`]). One readable by others but writable by nobody
/// else has its mode narrowed to 0700: only we could have put anything in it.
pub fn private_dir(dir: &Path) -> Result<(), Untrusted> {
    use std::os::unix::fs::DirBuilderExt;
    match std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
    {
        Ok(()) => {}
        // `recursive` reports an existing non-directory as AlreadyExists; checked below.
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(source) => {
            return Err(Untrusted::Inspect {
                path: dir.to_owned(),
                source,
            });
        }
    }
    check_dir(dir)?;
    let meta = std::fs::metadata(dir).map_err(inspect(dir))?;
    let uid = euid();
    if meta.uid() != uid {
        return Err(Untrusted::Owner {
            path: dir.to_owned(),
            owner: meta.uid(),
            uid,
        });
    }
    if meta.mode() & 0o077 != 0 {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
            .map_err(inspect(dir))?;
        tracing::info!(
            "{} was readable by others (mode {:04o}); narrowed it to 0700",
            dir.display(),
            meta.mode() & 0o7777
        );
    }
    Ok(())
}

/// Most symlinks followed on one path, as the kernel's own limit.
const MAX_HOPS: usize = 40;

/// The directories above `path` (absolute) as written, and for each symlink on the way (`path`
/// itself included) its owner and, recursively, the directories its target passes through: a
/// symlink can be pointed elsewhere by whoever owns it or can write the directory holding it.
fn walk(path: &Path, hops: usize) -> Result<(), Untrusted> {
    for at in path.ancestors() {
        let meta = std::fs::symlink_metadata(at).map_err(inspect(at))?;
        if meta.file_type().is_symlink() {
            if hops >= MAX_HOPS {
                return Err(Untrusted::Inspect {
                    path: at.to_owned(),
                    source: io::Error::other("too many levels of symbolic links"),
                });
            }
            if !is_ours_or_root(meta.uid()) {
                return Err(Untrusted::Owner {
                    path: at.to_owned(),
                    owner: meta.uid(),
                    uid: euid(),
                });
            }
            let target = std::fs::read_link(at).map_err(inspect(at))?;
            let base = at.parent().unwrap_or(Path::new("/"));
            walk(&base.join(target), hops + 1)?;
        } else if at != path {
            check_entry(at, &meta, true)?;
        }
    }
    Ok(())
}

/// Every directory strictly above `path` (absolute, resolved).
fn check_above(path: &Path) -> Result<(), Untrusted> {
    for dir in path.ancestors().skip(1) {
        let meta = std::fs::symlink_metadata(dir).map_err(inspect(dir))?;
        check_entry(dir, &meta, true)?;
    }
    Ok(())
}

fn check_entry(path: &Path, meta: &std::fs::Metadata, sticky_ok: bool) -> Result<(), Untrusted> {
    let uid = euid();
    if !is_ours_or_root(meta.uid()) {
        return Err(Untrusted::Owner {
            path: path.to_owned(),
            owner: meta.uid(),
            uid,
        });
    }
    let mode = meta.mode() & 0o7777;
    let sticky = mode & 0o1000 != 0;
    if mode & 0o022 != 0 && !(sticky_ok && sticky) {
        return Err(Untrusted::Writable {
            path: path.to_owned(),
            mode,
        });
    }
    Ok(())
}

fn inspect(path: &Path) -> impl FnOnce(io::Error) -> Untrusted + '_ {
    move |source| Untrusted::Inspect {
        path: path.to_owned(),
        source,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mode(path: &Path, mode: u32) {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    #[test]
    fn a_private_dir_under_a_sticky_one_is_trusted() {
        // tempdir() is under /tmp: sticky and writable by all.
        let tmp = tempfile::tempdir().unwrap();
        check_dir(tmp.path()).unwrap();
        let state = tmp.path().join("a/state");
        private_dir(&state).unwrap();
        assert_eq!(std::fs::metadata(&state).unwrap().mode() & 0o777, 0o700);
    }

    #[test]
    fn a_dir_others_may_write_to_is_not_trusted_even_sticky() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("open");
        std::fs::create_dir(&dir).unwrap();
        mode(&dir, 0o1777);
        let e = check_dir(&dir).unwrap_err();
        assert!(matches!(e, Untrusted::Writable { mode: 0o1777, .. }), "{e}");
        assert!(e.fix().contains("chmod 1755"), "{}", e.fix());
        mode(&dir, 0o770);
        assert!(matches!(private_dir(&dir), Err(Untrusted::Writable { .. })));
    }

    #[test]
    fn a_dir_below_one_others_may_write_to_is_not_trusted() {
        let tmp = tempfile::tempdir().unwrap();
        let open = tmp.path().join("open");
        let inner = open.join("state");
        std::fs::create_dir_all(&inner).unwrap();
        mode(&open, 0o777);
        let e = check_dir(&inner).unwrap_err();
        assert_eq!(e.path(), open, "{e}");
        // The same reached through a symlink from a trusted place.
        let link = tmp.path().join("link");
        std::os::unix::fs::symlink(&inner, &link).unwrap();
        assert_eq!(check_dir(&link).unwrap_err().path(), open);
        // A symlink that lives in the open directory, pointing somewhere trusted, is no better:
        // whoever can write there can point it elsewhere.
        let safe = tmp.path().join("safe");
        std::fs::create_dir(&safe).unwrap();
        let swappable = open.join("to-safe");
        std::os::unix::fs::symlink(&safe, &swappable).unwrap();
        assert_eq!(check_dir(&swappable).unwrap_err().path(), open);
        mode(&open, 0o755);
        check_dir(&inner).unwrap();
    }

    #[test]
    fn every_hop_of_a_symlink_chain_is_checked() {
        // /safe/l1 -> /open/l2 -> /safe/state: the resolved path and the path as written are
        // both trusted, but /open, which holds the second link, is not.
        let tmp = tempfile::tempdir().unwrap();
        let (safe, open) = (tmp.path().join("safe"), tmp.path().join("open"));
        std::fs::create_dir_all(safe.join("state")).unwrap();
        std::fs::create_dir(&open).unwrap();
        mode(&open, 0o777);
        std::os::unix::fs::symlink(safe.join("state"), open.join("l2")).unwrap();
        std::os::unix::fs::symlink(open.join("l2"), safe.join("l1")).unwrap();
        assert_eq!(check_dir(&safe.join("l1")).unwrap_err().path(), open);
        mode(&open, 0o755);
        check_dir(&safe.join("l1")).unwrap();
        if euid() == 0 {
            // A link another user owns can be pointed elsewhere by them (in a sticky directory
            // they may even replace it).
            let theirs = safe.join("theirs");
            std::os::unix::fs::symlink(safe.join("state"), &theirs).unwrap();
            std::os::unix::fs::lchown(&theirs, Some(65534), None).unwrap();
            assert!(matches!(
                check_dir(&theirs),
                Err(Untrusted::Owner { owner: 65534, .. })
            ));
        }
    }

    #[test]
    fn readable_bits_are_narrowed_and_files_are_not_dirs() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("state");
        std::fs::create_dir(&dir).unwrap();
        mode(&dir, 0o755);
        private_dir(&dir).unwrap();
        assert_eq!(std::fs::metadata(&dir).unwrap().mode() & 0o777, 0o700);
        let file = tmp.path().join("file");
        std::fs::write(&file, "").unwrap();
        assert!(matches!(
            check_dir(&file),
            Err(Untrusted::NotADirectory { .. })
        ));
    }

    #[test]
    fn a_dir_of_another_user_is_not_trusted() {
        let tmp = tempfile::tempdir().unwrap();
        let theirs = tmp.path().join("theirs");
        std::fs::create_dir(&theirs).unwrap();
        // Only root can give a directory away; anyone else already has one that is not theirs.
        if euid() == 0 {
            std::os::unix::fs::chown(&theirs, Some(65534), None).unwrap();
            let e = check_dir(&theirs).unwrap_err();
            assert!(matches!(e, Untrusted::Owner { owner: 65534, .. }), "{e}");
            let below = theirs.join("state");
            std::fs::create_dir(&below).unwrap();
            assert_eq!(check_dir(&below).unwrap_err().path(), theirs);
        } else {
            assert!(private_dir(Path::new("/")).is_err());
        }
    }
}
