//! `devicelet:plugin/devnodes`: discovery of the granted device nodes.
//!
//! Globs are walked by the host one path component at a time, beneath the host root's `/dev`,
//! looking at no more than [`MAX_WALK`] entries: with no `**` (refused) the depth is the
//! pattern's, so a symlink loop cannot make a walk endless, and a huge directory cannot make it
//! long.

use std::path::Path;

use cap_std::fs::{Dir, FileTypeExt, MetadataExt};
use devicelet_rules::grants::{Pattern, WALK};

use std::path::PathBuf;
use std::sync::Arc;

use wasmtime::component::{HasSelf, Linker};

use super::paths::{Beneath, beneath, check, granted};
use super::sysfs::fs_error;
use crate::sandbox::bindings::v0_1::devicelet::plugin::devnodes::{self, Host, NodeInfo, NodeKind};
use crate::sandbox::bindings::v0_1::devicelet::plugin::types::FsError;

/// Most paths one glob may return.
const MAX_MATCHES: usize = 4096;
/// Most directory entries one glob may look at.
pub(crate) const MAX_WALK: usize = 65_536;

/// Linux's `dev_t` encoding (glibc's `gnu_dev_major`/`gnu_dev_minor`).
fn major_minor(dev: u64) -> (u32, u32) {
    let major = ((dev >> 8) & 0xfff) | ((dev >> 32) & !0xfff);
    let minor = (dev & 0xff) | ((dev >> 12) & !0xff);
    (major as u32, minor as u32)
}

/// Why a `/dev` glob is refused, or None when it may be walked.
pub(crate) fn bad_pattern(pattern: &str) -> Option<String> {
    let Some(rest) = pattern.strip_prefix("/dev/") else {
        return Some(format!("{pattern} is not a pattern under /dev/"));
    };
    if rest
        .split('/')
        .any(|c| c.is_empty() || c == "." || c == ".." || c.contains("**"))
    {
        return Some(format!(
            "{pattern} must be normal, without `.`, `..`, empty components or `**`"
        ));
    }
    None
}

fn has_magic(component: &str) -> bool {
    component.contains(['*', '?', '['])
}

/// Walks `components` below `dir` (a relative path beneath the `/dev` tree), collecting the
/// relative paths that match, within the walk and match bounds.
struct Walk<'a> {
    dev: &'a Dir,
    visited: usize,
    found: Vec<String>,
}

impl Walk<'_> {
    fn walk(&mut self, at: &str, components: &[&str]) -> Result<(), FsError> {
        let Some((first, rest)) = components.split_first() else {
            self.found.push(at.to_owned());
            return Ok(());
        };
        let join = |name: &str| {
            if at.is_empty() {
                name.to_owned()
            } else {
                format!("{at}/{name}")
            }
        };
        if !has_magic(first) {
            let next = join(first);
            if self.dev.symlink_metadata(&next).is_ok() {
                return self.walk(&next, rest);
            }
            return Ok(());
        }
        let pattern = Pattern::new(first).map_err(|e| FsError::Io(e.to_string()))?;
        let dir = if at.is_empty() { "." } else { at };
        let Ok(entries) = self.dev.read_dir(dir) else {
            return Ok(());
        };
        let mut names = Vec::new();
        for entry in entries {
            self.visited += 1;
            if self.visited > MAX_WALK {
                return Err(FsError::Io(format!(
                    "the pattern looks at more than {MAX_WALK} entries"
                )));
            }
            let Ok(entry) = entry else { continue };
            if let Some(name) = entry.file_name().to_str()
                && pattern.matches_with(name, WALK)
            {
                names.push(name.to_owned());
            }
        }
        names.sort();
        for name in names {
            if self.found.len() >= MAX_MATCHES {
                break;
            }
            self.walk(&join(&name), rest)?;
        }
        Ok(())
    }
}

/// Everything `devnodes` can touch: the host root's `/dev`, within these grants.
pub struct Devnodes {
    host_root: Arc<PathBuf>,
    grants: Vec<Pattern>,
}

impl Devnodes {
    pub(super) fn new(host_root: Arc<PathBuf>, grants: Vec<Pattern>) -> Self {
        Devnodes { host_root, grants }
    }

    /// Linked only for a module granted some /dev path.
    pub fn add_to_linker<T: Send + 'static>(
        linker: &mut Linker<T>,
        view: fn(&mut T) -> &mut Devnodes,
    ) -> wasmtime::Result<()> {
        // Under every line's name: the interface is the same in each.
        for name in crate::sandbox::bindings::imports::host_names("devnodes") {
            devnodes::add_to_linker_instance::<T, HasSelf<Devnodes>>(
                &mut linker.instance(&name)?,
                view,
            )?;
        }
        Ok(())
    }

    fn open(&self, path: &str) -> Result<Beneath, FsError> {
        check(&self.grants, path, false).map_err(|e| FsError::Denied(e.to_string()))?;
        beneath(&self.host_root, path).map_err(fs_error)
    }
}

impl Host for Devnodes {
    fn glob(&mut self, pattern: String) -> Result<Vec<String>, FsError> {
        if let Some(why) = bad_pattern(&pattern) {
            return Err(FsError::Denied(why));
        }
        let dev = match beneath(&self.host_root, "/dev") {
            Ok(at) => at.dir,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(fs_error(e)),
        };
        let components: Vec<&str> = pattern["/dev/".len()..].split('/').collect();
        let mut walk = Walk {
            dev: &dev,
            visited: 0,
            found: Vec::new(),
        };
        walk.walk("", &components)?;
        let mut paths: Vec<String> = walk
            .found
            .into_iter()
            .map(|rel| format!("/dev/{rel}"))
            // A match must be granted, and what it points to must stay inside /dev (a dangling
            // link is shown; `stat` then reports it not found).
            .filter(|logical| granted(&self.grants, logical))
            .filter(|logical| {
                let rel = Path::new(&logical["/dev/".len()..]);
                match dev.metadata(rel) {
                    Ok(_) => true,
                    Err(e) => e.kind() == std::io::ErrorKind::NotFound,
                }
            })
            .collect();
        paths.sort();
        Ok(paths)
    }

    fn stat(&mut self, path: String) -> Result<NodeInfo, FsError> {
        let at = self.open(&path)?;
        let meta = at.dir.metadata(&at.rel).map_err(fs_error)?;
        let kind = if meta.file_type().is_char_device() {
            NodeKind::Character
        } else if meta.file_type().is_block_device() {
            NodeKind::Block
        } else {
            NodeKind::Other
        };
        let (major, minor) = major_minor(meta.rdev());
        Ok(NodeInfo {
            kind,
            major,
            minor,
            mode: meta.mode() & 0o7777,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::{bad_pattern, major_minor};

    #[test]
    fn recursive_and_escaping_patterns_are_refused() {
        assert!(bad_pattern("/dev/**").is_some());
        assert!(bad_pattern("/dev/dri/**/card*").is_some());
        assert!(bad_pattern("/dev/../etc/*").is_some());
        assert!(bad_pattern("/sys/*").is_some());
        assert!(bad_pattern("/dev//fuse").is_some());
        assert!(bad_pattern("/dev/dri/renderD*").is_none());
    }

    #[test]
    fn decodes_linux_dev_t() {
        // /dev/fuse is 10:229; makedev(10, 229) = 0x0ae5.
        assert_eq!(major_minor(0x0ae5), (10, 229));
        // A large minor: makedev(511, 1048575).
        let dev = (511u64 & 0xfff) << 8 | (1048575u64 & 0xff) | ((1048575u64 & !0xff) << 12);
        assert_eq!(major_minor(dev), (511, 1048575));
    }
}
