//! `devicelet:plugin/sysfs`: read-only access to the granted sysfs paths.
//!
//! Every call is bounded by construction: paths resolve beneath the host root's `/sys` in one
//! step, reads open only regular files (non-blocking, so a FIFO cannot park the thread) and stop
//! at [`MAX_READ`], listings stop at [`MAX_ENTRIES`]. What no check can bound — a sysfs attribute
//! whose driver hangs — blocks only the module's own cell (see `sandbox::cell`).

use std::io::Read;
use std::path::PathBuf;
use std::sync::Arc;

use cap_std::fs::{OpenOptions, OpenOptionsExt};
use devicelet_rules::grants::Pattern;
use wasmtime::component::{HasSelf, Linker};

use super::paths::{Beneath, PathError, beneath, check, escaped, granted, leads_to_grant};
use crate::sandbox::bindings::v0_1::devicelet::plugin::sysfs::{self, Host};
use crate::sandbox::bindings::v0_1::devicelet::plugin::types::FsError;

const MAX_READ: u64 = devicelet_rules::grants::MAX_SYSFS_READ as u64;
/// Most directory entries one listing looks at; `/sys/bus/pci/devices` on a big node has a few
/// hundred.
pub(super) const MAX_ENTRIES: usize = 65_536;

pub(super) fn fs_error(e: std::io::Error) -> FsError {
    if e.kind() == std::io::ErrorKind::NotFound {
        FsError::NotFound
    } else if escaped(&e) {
        FsError::Denied("the path resolves outside its tree".into())
    } else {
        FsError::Io(e.to_string())
    }
}

fn denied(e: PathError) -> FsError {
    FsError::Denied(e.to_string())
}

/// Everything `sysfs` can touch: the host root's `/sys`, within these grants.
pub struct Sysfs {
    host_root: Arc<PathBuf>,
    grants: Vec<Pattern>,
}

impl Sysfs {
    pub(super) fn new(host_root: Arc<PathBuf>, grants: Vec<Pattern>) -> Self {
        Sysfs { host_root, grants }
    }

    /// Linked only for a module granted some sysfs path.
    pub fn add_to_linker<T: Send + 'static>(
        linker: &mut Linker<T>,
        view: fn(&mut T) -> &mut Sysfs,
    ) -> wasmtime::Result<()> {
        // Under every line's name: the interface is the same in each.
        for name in crate::sandbox::bindings::imports::host_names("sysfs") {
            sysfs::add_to_linker_instance::<T, HasSelf<Sysfs>>(&mut linker.instance(&name)?, view)?;
        }
        Ok(())
    }

    fn open(&self, path: &str, listing: bool) -> Result<Beneath, FsError> {
        check(&self.grants, path, listing).map_err(denied)?;
        beneath(&self.host_root, path).map_err(fs_error)
    }
}

impl Host for Sysfs {
    fn read(&mut self, path: String) -> Result<Vec<u8>, FsError> {
        let at = self.open(&path, false)?;
        let mut options = OpenOptions::new();
        options
            .read(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY);
        let file = at.dir.open_with(&at.rel, &options).map_err(fs_error)?;
        if !file.metadata().map_err(fs_error)?.is_file() {
            return Err(FsError::Io(format!("{path} is not a regular file")));
        }
        let mut buf = Vec::new();
        file.take(MAX_READ)
            .read_to_end(&mut buf)
            .map_err(fs_error)?;
        Ok(buf)
    }

    fn list(&mut self, path: String) -> Result<Vec<String>, FsError> {
        let at = self.open(&path, true)?;
        let base = path.trim_end_matches('/');
        let mut names = Vec::new();
        for entry in at
            .dir
            .read_dir(&at.rel)
            .map_err(fs_error)?
            .take(MAX_ENTRIES)
        {
            let entry = entry.map_err(fs_error)?;
            let Some(name) = entry.file_name().to_str().map(str::to_owned) else {
                continue;
            };
            let child = format!("{base}/{name}");
            if granted(&self.grants, &child) || leads_to_grant(&self.grants, &child) {
                names.push(name);
            }
        }
        names.sort();
        Ok(names)
    }

    fn read_link(&mut self, path: String) -> Result<String, FsError> {
        let at = self.open(&path, false)?;
        let target = at.dir.read_link_contents(&at.rel).map_err(fs_error)?;
        target
            .into_os_string()
            .into_string()
            .map_err(|_| FsError::Io("link target is not UTF-8".into()))
    }
}
