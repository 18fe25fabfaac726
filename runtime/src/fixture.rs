//! Fixture device trees: a directory standing in for the node's `/` (its `/dev` and `/sys`), so
//! the demo, the tests and a vendor trying a module locally need no hardware.
//!
//! Device nodes are real character and block devices made with `mknod(2)`, so a module sees
//! exactly what it would see on a node. That needs root (or `CAP_MKNOD`).

use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// A fixture tree rooted at a directory the caller owns.
#[derive(Debug, Clone)]
pub struct FixtureTree {
    root: PathBuf,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeType {
    Char,
    Block,
}

impl FixtureTree {
    pub fn new(root: &Path) -> io::Result<FixtureTree> {
        std::fs::create_dir_all(root.join("dev"))?;
        std::fs::create_dir_all(root.join("sys"))?;
        Ok(FixtureTree {
            root: root.to_owned(),
        })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Where a node path such as `/dev/fuse` lives in the tree.
    pub fn path(&self, node_path: &str) -> PathBuf {
        self.root.join(node_path.trim_start_matches('/'))
    }

    /// Creates the device node `node_path` (e.g. `/dev/net/tun`), with its parent directories.
    pub fn add_node(
        &self,
        node_path: &str,
        kind: NodeType,
        major: u32,
        minor: u32,
    ) -> io::Result<()> {
        let path = self.path(node_path);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)?;
        }
        let c_path = CString::new(path.as_os_str().as_bytes())
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        let mode = 0o666
            | match kind {
                NodeType::Char => libc::S_IFCHR,
                NodeType::Block => libc::S_IFBLK,
            };
        let dev = libc::makedev(major, minor);
        // SAFETY: c_path is a valid NUL-terminated string that outlives the call.
        if unsafe { libc::mknod(c_path.as_ptr(), mode, dev) } != 0 {
            let e = io::Error::last_os_error();
            return Err(io::Error::new(
                e.kind(),
                format!(
                    "mknod {}: {e} (fixture device nodes need root or CAP_MKNOD)",
                    path.display()
                ),
            ));
        }
        Ok(())
    }

    pub fn remove(&self, node_path: &str) -> io::Result<()> {
        std::fs::remove_file(self.path(node_path))
    }

    /// Writes a sysfs attribute such as `/sys/bus/pci/devices/0000:01:00.0/vendor`.
    pub fn write_file(&self, path: &str, contents: &str) -> io::Result<()> {
        let path = self.path(path);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)?;
        }
        std::fs::write(path, contents)
    }
}
