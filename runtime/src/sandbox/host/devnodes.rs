//! `devicelet:plugin/devnodes`: discovery of the granted device nodes.

use std::os::unix::fs::{FileTypeExt, MetadataExt};

use super::HostState;
use super::paths::{granted, resolve};
use super::sysfs::fs_error;
use crate::sandbox::bindings::v0_1::devicelet::plugin::devnodes::{Host, NodeInfo, NodeKind};
use crate::sandbox::bindings::v0_1::devicelet::plugin::types::FsError;

/// Most paths one glob may return, so a pattern like `/dev/**` cannot exhaust the agent.
const MAX_MATCHES: usize = 4096;

/// Linux's `dev_t` encoding (glibc's `gnu_dev_major`/`gnu_dev_minor`).
fn major_minor(dev: u64) -> (u32, u32) {
    let major = ((dev >> 8) & 0xfff) | ((dev >> 32) & !0xfff);
    let minor = (dev & 0xff) | ((dev >> 12) & !0xff);
    (major as u32, minor as u32)
}

impl Host for HostState {
    fn glob(&mut self, pattern: String) -> Result<Vec<String>, FsError> {
        if !pattern.starts_with("/dev/") || pattern.split('/').any(|c| c == "..") {
            return Err(FsError::Denied(format!(
                "{pattern} is not a pattern under /dev/"
            )));
        }
        let root = self.host_root.to_string_lossy();
        let root = root.trim_end_matches('/');
        let physical = format!("{}{pattern}", glob::Pattern::escape(root));
        let entries = glob::glob(&physical).map_err(|e| FsError::Io(e.to_string()))?;
        let mut paths = Vec::new();
        for entry in entries.flatten().take(MAX_MATCHES * 4) {
            let Some(logical) = entry
                .to_str()
                .and_then(|p| p.strip_prefix(root))
                .map(str::to_owned)
            else {
                continue;
            };
            if granted(&self.grants.dev, &logical)
                && resolve(&self.host_root, &self.grants.dev, &logical, false).is_ok()
            {
                paths.push(logical);
                if paths.len() == MAX_MATCHES {
                    break;
                }
            }
        }
        paths.sort();
        Ok(paths)
    }

    fn stat(&mut self, path: String) -> Result<NodeInfo, FsError> {
        let node = resolve(&self.host_root, &self.grants.dev, &path, false)
            .map_err(|e| FsError::Denied(e.to_string()))?;
        let meta = std::fs::metadata(node).map_err(fs_error)?;
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
    use super::major_minor;

    #[test]
    fn decodes_linux_dev_t() {
        // /dev/fuse is 10:229; makedev(10, 229) = 0x0ae5.
        assert_eq!(major_minor(0x0ae5), (10, 229));
        // A large minor: makedev(511, 1048575).
        let dev = (511u64 & 0xfff) << 8 | (1048575u64 & 0xff) | ((1048575u64 & !0xff) << 12);
        assert_eq!(major_minor(dev), (511, 1048575));
    }
}
