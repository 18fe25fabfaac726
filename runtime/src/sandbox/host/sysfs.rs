//! `devicelet:plugin/sysfs`: read-only access to the granted sysfs paths.

use std::io::Read;

use super::HostState;
use super::paths::{granted, leads_to_grant, resolve};
use crate::sandbox::bindings::v0_1::devicelet::plugin::sysfs::Host;
use crate::sandbox::bindings::v0_1::devicelet::plugin::types::FsError;

/// Largest sysfs read handed to a module; sysfs attributes are a page at most.
const MAX_READ: u64 = 1 << 20;

pub(super) fn fs_error(e: std::io::Error) -> FsError {
    if e.kind() == std::io::ErrorKind::NotFound {
        FsError::NotFound
    } else {
        FsError::Io(e.to_string())
    }
}

impl Host for HostState {
    fn read(&mut self, path: String) -> Result<Vec<u8>, FsError> {
        let file = resolve(&self.host_root, &self.grants.sysfs, &path, false)
            .map_err(|e| FsError::Denied(e.to_string()))?;
        let mut buf = Vec::new();
        std::fs::File::open(file)
            .and_then(|f| f.take(MAX_READ).read_to_end(&mut buf))
            .map_err(fs_error)?;
        Ok(buf)
    }

    fn list(&mut self, path: String) -> Result<Vec<String>, FsError> {
        let dir = resolve(&self.host_root, &self.grants.sysfs, &path, true)
            .map_err(|e| FsError::Denied(e.to_string()))?;
        let base = path.trim_end_matches('/');
        let mut names = Vec::new();
        for entry in std::fs::read_dir(dir).map_err(fs_error)? {
            let entry = entry.map_err(fs_error)?;
            let Some(name) = entry.file_name().to_str().map(str::to_owned) else {
                continue;
            };
            let child = format!("{base}/{name}");
            if granted(&self.grants.sysfs, &child) || leads_to_grant(&self.grants.sysfs, &child) {
                names.push(name);
            }
        }
        names.sort();
        Ok(names)
    }

    fn read_link(&mut self, path: String) -> Result<String, FsError> {
        let link = resolve(&self.host_root, &self.grants.sysfs, &path, false)
            .map_err(|e| FsError::Denied(e.to_string()))?;
        let target = std::fs::read_link(link).map_err(fs_error)?;
        target
            .into_os_string()
            .into_string()
            .map_err(|_| FsError::Io("link target is not UTF-8".into()))
    }
}
