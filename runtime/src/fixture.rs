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

    /// Makes this tree the node a fixture directory describes: `sys/` and `proc/` copied (files
    /// and symlinks as they are; `proc/` for the driver tables modules rely on, such as
    /// NVIDIA's `proc/driver/nvidia-caps/mig-minors`), and exactly the device nodes its
    /// `dev.list` lists (one per line,
    /// `c <major>:<minor> /dev/<path>`, `b` for block; `#` comments), since a repository cannot
    /// hold device nodes. Run again after the fixture changed, it brings the tree in line:
    /// `sys/` is swapped for a fresh copy in one rename, and only the device nodes that changed
    /// are made or removed, so a module reading meanwhile sees no node vanish for nothing.
    pub fn load(&self, fixture: &Path) -> io::Result<()> {
        let list = fixture.join("dev.list");
        let wanted = match std::fs::read_to_string(&list) {
            Ok(text) => parse_dev_list(&text).map_err(|e| {
                io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("{}: {e}", list.display()),
                )
            })?,
            Err(e) if e.kind() == io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(e),
        };
        self.swap_in(fixture, "sys")?;
        self.swap_in(fixture, "proc")?;

        let mut present = Vec::new();
        self.device_nodes(&self.root.join("dev"), "/dev", &mut present)?;
        for (path, kind, rdev) in &present {
            let listed = wanted.iter().any(|n| {
                n.path == *path && n.kind == *kind && libc::makedev(n.major, n.minor) == *rdev
            });
            if !listed {
                std::fs::remove_file(self.path(path))?;
            }
        }
        for node in wanted {
            let rdev = libc::makedev(node.major, node.minor);
            if !present
                .iter()
                .any(|(path, kind, at)| *path == node.path && *kind == node.kind && *at == rdev)
            {
                self.add_node(&node.path, node.kind, node.major, node.minor)?;
            }
        }
        Ok(())
    }

    /// Replaces the tree's `name/` with a fresh copy of the fixture's (empty when it has none),
    /// in one rename.
    fn swap_in(&self, fixture: &Path, name: &str) -> io::Result<()> {
        let fresh = self.root.join(format!(".{name}.new"));
        let _ = std::fs::remove_dir_all(&fresh);
        std::fs::create_dir(&fresh)?;
        let from = fixture.join(name);
        if from.is_dir() {
            copy_tree(&from, &fresh)?;
        }
        let current = self.root.join(name);
        let old = self.root.join(format!(".{name}.old"));
        let _ = std::fs::remove_dir_all(&old);
        if current.exists() {
            std::fs::rename(&current, &old)?;
        }
        std::fs::rename(&fresh, &current)?;
        if old.exists() {
            std::fs::remove_dir_all(&old)?;
        }
        Ok(())
    }

    /// The device nodes under `dir` (logical path `at`), with their kind and number.
    fn device_nodes(
        &self,
        dir: &Path,
        at: &str,
        found: &mut Vec<(String, NodeType, libc::dev_t)>,
    ) -> io::Result<()> {
        use std::os::unix::fs::{FileTypeExt, MetadataExt};
        for entry in std::fs::read_dir(dir)? {
            let entry = entry?;
            let path = format!("{at}/{}", entry.file_name().to_string_lossy());
            let meta = std::fs::symlink_metadata(entry.path())?;
            let kind = meta.file_type();
            if kind.is_dir() {
                self.device_nodes(&entry.path(), &path, found)?;
            } else if kind.is_char_device() {
                found.push((path, NodeType::Char, meta.rdev() as libc::dev_t));
            } else if kind.is_block_device() {
                found.push((path, NodeType::Block, meta.rdev() as libc::dev_t));
            }
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

/// One line of a fixture's `dev.list`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListedNode {
    pub path: String,
    pub kind: NodeType,
    pub major: u32,
    pub minor: u32,
}

/// Parses a fixture's `dev.list` by the one parser the SDK's test kit also uses; the error names
/// the line.
pub fn parse_dev_list(text: &str) -> Result<Vec<ListedNode>, String> {
    use devicelet_rules::dev_list::{self, Kind};
    Ok(dev_list::parse(text)?
        .into_iter()
        .map(|e| ListedNode {
            path: e.path,
            kind: match e.kind {
                Kind::Char => NodeType::Char,
                Kind::Block => NodeType::Block,
            },
            major: e.major,
            minor: e.minor,
        })
        .collect())
}

/// Copies files, directories and symlinks (as links) from `from` into `to`.
fn copy_tree(from: &Path, to: &Path) -> io::Result<()> {
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let target = to.join(entry.file_name());
        let kind = entry.file_type()?;
        if kind.is_symlink() {
            let link = std::fs::read_link(entry.path())?;
            if link.is_absolute() {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!(
                        "{}: fixture links must be relative, as sysfs's are (an absolute one \
                         points outside the node, and the agent refuses to follow it)",
                        entry.path().display()
                    ),
                ));
            }
            std::os::unix::fs::symlink(link, &target)?;
        } else if kind.is_dir() {
            std::fs::create_dir(&target)?;
            copy_tree(&entry.path(), &target)?;
        } else {
            std::fs::copy(entry.path(), &target)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fixture_directory_becomes_a_node_tree() {
        let fixture = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(fixture.path().join("sys/devices/x")).unwrap();
        std::fs::write(fixture.path().join("sys/devices/x/vendor"), "0x1002\n").unwrap();
        std::fs::create_dir_all(fixture.path().join("sys/bus")).unwrap();
        std::os::unix::fs::symlink("../devices/x", fixture.path().join("sys/bus/x")).unwrap();
        std::fs::write(
            fixture.path().join("dev.list"),
            "c 1:3 /dev/null-ish # like /dev/null\n",
        )
        .unwrap();
        let root = tempfile::tempdir().unwrap();
        let tree = FixtureTree::new(root.path()).unwrap();
        tree.load(fixture.path()).unwrap();
        assert_eq!(
            std::fs::read_to_string(root.path().join("sys/bus/x/vendor")).unwrap(),
            "0x1002\n"
        );
        use std::os::unix::fs::FileTypeExt;
        let meta = std::fs::metadata(root.path().join("dev/null-ish")).unwrap();
        assert!(meta.file_type().is_char_device());
        // Reloaded after the fixture changed: a node no longer listed is gone.
        std::fs::write(fixture.path().join("dev.list"), "").unwrap();
        tree.load(fixture.path()).unwrap();
        assert!(!root.path().join("dev/null-ish").exists());
    }

    #[test]
    fn an_absolute_link_in_a_fixture_is_refused_by_name() {
        let fixture = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(fixture.path().join("sys/bus")).unwrap();
        std::os::unix::fs::symlink("/sys/devices/x", fixture.path().join("sys/bus/x")).unwrap();
        let root = tempfile::tempdir().unwrap();
        let tree = FixtureTree::new(root.path()).unwrap();
        let e = tree.load(fixture.path()).unwrap_err();
        assert!(
            e.to_string()
                .contains("sys/bus/x: fixture links must be relative"),
            "{e}"
        );
    }
}
