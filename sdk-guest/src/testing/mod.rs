//! Running a module's logic on the host: `cargo test` in a module crate, against a fake node.
//!
//! On the host target (anything but `wasm32`) the SDK's [`crate::sysfs`], [`crate::devnodes`]
//! and [`crate::log`] functions talk to the [`FakeHost`] installed on the calling thread instead
//! of the agent. A [`Harness`] installs it around each call into your [`Plugin`], so a test
//! reads like what the agent does:
//!
//! ```
//! use devicelet_sdk::testing::{FakeHost, Harness};
//! # use devicelet_sdk::{ContainerEdits, Device, Plugin, PluginError, ResourceInfo, devnodes};
//! # struct Fuse;
//! # impl Plugin for Fuse {
//! #     fn init(_: &str) -> Result<(Self, Vec<ResourceInfo>), PluginError> {
//! #         Ok((Fuse, vec![ResourceInfo::new("fuse")]))
//! #     }
//! #     fn enumerate(&mut self, _: &str) -> Result<Vec<Device>, PluginError> {
//! #         Ok(devnodes::glob("/dev/fuse")?.into_iter().map(|_| Device::healthy("fuse")).collect())
//! #     }
//! #     fn allocate(&mut self, _: &str, _: &[String]) -> Result<ContainerEdits, PluginError> {
//! #         Ok(ContainerEdits::default().device("/dev/fuse", "/dev/fuse", "rw"))
//! #     }
//! # }
//! let host = FakeHost::new().grant_dev("/dev/fuse").char_device("/dev/fuse", 10, 229);
//! let mut module = Harness::<Fuse>::init(host, "{}").unwrap();
//! assert_eq!(module.enumerate("fuse").unwrap().len(), 1);
//! module.host().remove("/dev/fuse");
//! assert!(module.enumerate("fuse").unwrap().is_empty());
//! ```
//!
//! The fake host applies the agent's rules: a path is readable only when it or a directory above
//! it matches a grant (`grant_sysfs`, `grant_dev`, glob patterns as in the registry); symlinks
//! are followed while they stay inside `/sys` (or `/dev`), so a grant on
//! `/sys/bus/pci/devices/*` covers what those links point to; listing a directory shows only
//! the entries a grant covers or leads to; `/dev` globs refuse `**`, `.` and `..`. A path outside
//! the grants gives [`FsError::Denied`], as on a node. The harness also checks the answers the
//! way the agent does before the kubelet sees them (IDs unique and non-empty, device nodes under
//! the `/dev` grants and present), so a test fails where the agent would refuse.
//!
//! The node is described in memory ([`FakeHost::file`], [`FakeHost::symlink`],
//! [`FakeHost::char_device`]) or read from a fixture directory ([`FakeHost::from_fixture`]):
//! `sys/` holds files and symlinks as on a node (git keeps both), and `dev.list` lists the
//! device nodes, one per line, `c <major>:<minor> /dev/<path>` (`b` for block devices; `#`
//! starts a comment), since a repository cannot hold device nodes. `devicelet try --fixture`
//! reads the same layout. Changes while the module runs ([`FakeHost::set_file`] and the like)
//! go through the symlinks on their way, as writes on a node do: a file set by its
//! `/sys/bus/pci/devices/…` path is the one the module reads by either path.

mod nvml;
pub use nvml::FakeNvml;

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::rc::Rc;

use devicelet_rules::grants::{Denied, Pattern, WALK, granted, leads_to_grant};

use crate::ResourceInfo;
use crate::{
    ContainerEdits, CounterSet, Device, FsError, Level, NodeInfo, NodeKind, Plugin, PluginError,
    Prepared, Request,
};

/// Most symlinks followed in one path, as Linux's.
const MAX_LINKS: usize = 40;

#[derive(Debug, Clone)]
enum Entry {
    File(Vec<u8>),
    Link(String),
    Node(NodeInfo),
    Dir,
}

/// A fake node for module tests: its `/sys` and `/dev`, the module's grants, and what the module
/// logged. Change it between calls (a device unplugged, a file rewritten) through a shared
/// reference: [`Harness::host`].
#[derive(Debug, Default)]
pub struct FakeHost {
    tree: RefCell<BTreeMap<String, Entry>>,
    sysfs: Vec<Pattern>,
    dev: Vec<Pattern>,
    logs: RefCell<Vec<(Level, String)>>,
    nvml: RefCell<Option<FakeNvml>>,
    recheck: std::cell::Cell<Option<std::time::Duration>>,
}

impl FakeHost {
    /// An empty node with nothing granted.
    pub fn new() -> FakeHost {
        FakeHost::default()
    }

    /// Grants read access to sysfs paths matching `pattern` and everything below them, as the
    /// registry's `sysfs = [...]` does. Panics on an invalid pattern (a test's own mistake).
    pub fn grant_sysfs(mut self, pattern: &str) -> FakeHost {
        assert!(pattern.starts_with("/sys/"), "{pattern} is not under /sys/");
        self.sysfs
            .push(Pattern::new(pattern).expect("a valid glob pattern"));
        self
    }

    /// Grants NVML (as the registry's `libraries = ["nvml"]` does), answering as `nvml`
    /// describes. Without it, every [`crate::nvml`] query fails with `Unavailable`, as in a
    /// module the agent would refuse to link.
    pub fn grant_nvml(self, nvml: FakeNvml) -> FakeHost {
        *self.nvml.borrow_mut() = Some(nvml);
        self
    }

    /// A critical NVML event on the GPU with this UUID, received now: the next
    /// [`crate::nvml::events`] read returns it.
    pub fn nvml_event(&self, gpu_uuid: &str, kind: crate::nvml::EventKind) {
        if let Some(nvml) = self.nvml.borrow_mut().as_mut() {
            nvml.push_event(gpu_uuid, kind);
        }
    }

    /// A critical NVML event raised inside one MIG instance of the GPU with this UUID, as NVML
    /// attributes it (see [`crate::nvml::event_instance`]).
    pub fn nvml_mig_event(
        &self,
        gpu_uuid: &str,
        kind: crate::nvml::EventKind,
        gpu_instance_id: u32,
        compute_instance_id: u32,
    ) {
        if let Some(nvml) = self.nvml.borrow_mut().as_mut() {
            nvml.push_mig_event(
                gpu_uuid,
                kind,
                crate::nvml::MigInstance {
                    gpu_instance_id,
                    compute_instance_id,
                },
            );
        }
    }

    /// How soon the last call asked to be enumerated again ([`crate::schedule::recheck_after`]),
    /// and forgets it.
    pub fn take_recheck(&self) -> Option<std::time::Duration> {
        self.recheck.take()
    }

    /// The MIG instances the module made through [`crate::mig`] on GPU `index` and has not
    /// destroyed: what a test checks after `unprepare`.
    pub fn mig_instances(&self, index: u32) -> Vec<crate::mig::MigPlacement> {
        self.nvml
            .borrow()
            .as_ref()
            .map_or(Vec::new(), |nvml| nvml.made_instances(index))
    }

    /// Makes every query on the GPU with this index fail with `GpuLost` (it fell off the bus),
    /// or answer again.
    pub fn set_gpu_lost(&self, index: u32, lost: bool) {
        if let Some(nvml) = self.nvml.borrow_mut().as_mut() {
            nvml.set_lost(index, lost);
        }
    }

    /// Grants the device nodes matching `pattern`, as the registry's `dev = [...]` does.
    pub fn grant_dev(mut self, pattern: &str) -> FakeHost {
        assert!(pattern.starts_with("/dev/"), "{pattern} is not under /dev/");
        self.dev
            .push(Pattern::new(pattern).expect("a valid glob pattern"));
        self
    }

    /// A file with these contents (its directories are implied).
    pub fn file(self, path: &str, contents: impl AsRef<[u8]>) -> FakeHost {
        self.set_file(path, contents);
        self
    }

    /// A symbolic link whose target is stored as given (sysfs uses relative ones:
    /// `../../../devices/pci0000:00/0000:03:00.0`).
    pub fn symlink(self, path: &str, target: &str) -> FakeHost {
        self.set_symlink(path, target);
        self
    }

    /// An empty directory (directories holding something are implied).
    pub fn dir(self, path: &str) -> FakeHost {
        self.add_dir(path);
        self
    }

    /// Replaces (or creates) a symbolic link while the module runs: a driver bound again
    /// (`driver -> ../../../bus/pci/drivers/vfio-pci`), after [`remove`](Self::remove) unbound it.
    pub fn set_symlink(&self, path: &str, target: &str) {
        self.insert(path, Entry::Link(target.to_owned()));
    }

    /// Adds an empty directory while the module runs.
    pub fn add_dir(&self, path: &str) {
        self.insert(path, Entry::Dir);
    }

    /// A character device node, mode 0666.
    pub fn char_device(self, path: &str, major: u32, minor: u32) -> FakeHost {
        self.add_node(path, NodeKind::Character, major, minor);
        self
    }

    /// A block device node, mode 0660.
    pub fn block_device(self, path: &str, major: u32, minor: u32) -> FakeHost {
        self.add_node(path, NodeKind::Block, major, minor);
        self
    }

    /// Reads a fixture directory: `sys/` (files and symlinks) and `dev.list` (see the module
    /// docs). Device nodes made with `mknod` under `dev/` are read too.
    pub fn from_fixture(dir: impl AsRef<Path>) -> std::io::Result<FakeHost> {
        let dir = dir.as_ref();
        let host = FakeHost::new();
        for area in ["sys", "dev"] {
            let root = dir.join(area);
            if root.is_dir() {
                host.read_tree(&root, &format!("/{area}"))?;
            }
        }
        let list = dir.join("dev.list");
        if list.exists() {
            let text = std::fs::read_to_string(&list)?;
            for node in parse_dev_list(&text)
                .map_err(|e| std::io::Error::other(format!("{}: {e}", list.display())))?
            {
                host.add_node(&node.path, node.kind, node.major, node.minor);
            }
        }
        Ok(host)
    }

    /// Replaces (or creates) a file.
    pub fn set_file(&self, path: &str, contents: impl AsRef<[u8]>) {
        self.insert(path, Entry::File(contents.as_ref().to_vec()));
    }

    /// Adds a device node.
    pub fn add_node(&self, path: &str, kind: NodeKind, major: u32, minor: u32) {
        let mode = if kind == NodeKind::Block {
            0o660
        } else {
            0o666
        };
        self.insert(
            path,
            Entry::Node(NodeInfo {
                kind,
                major,
                minor,
                mode,
            }),
        );
    }

    /// Removes a path and everything below it: a device unplugged, a PCI device gone.
    pub fn remove(&self, path: &str) {
        let prefix = format!("{}/", path.trim_end_matches('/'));
        self.tree
            .borrow_mut()
            .retain(|p, _| p != path && !p.starts_with(&prefix));
    }

    /// What the module logged so far, oldest first.
    pub fn logs(&self) -> Vec<(Level, String)> {
        self.logs.borrow().clone()
    }

    /// Puts `entry` at `path` as writing there on a node would: through the symlinks on the
    /// way (`/sys/bus/pci/devices/0000:03:00.0/x` lands in `/sys/devices/…/0000:03:00.0/x`),
    /// so what a module reads back through either path is what was set. A path whose links
    /// lead out of its tree is refused loudly: the module could never read it.
    fn insert(&self, path: &str, entry: Entry) {
        assert!(is_normal(path), "{path} is not an absolute, normal path");
        let area = ["/sys", "/dev"]
            .into_iter()
            .find(|a| path == *a || path.starts_with(&format!("{a}/")));
        let at = match area {
            Some(area) => self.resolve(area, path, false).unwrap_or_else(|e| {
                panic!("{path}: its symlinks lead where no module can read it ({e:?})")
            }),
            None => path.to_owned(),
        };
        self.tree.borrow_mut().insert(at, entry);
    }

    fn read_tree(&self, dir: &Path, logical: &str) -> std::io::Result<()> {
        use std::os::unix::fs::{FileTypeExt, MetadataExt};
        for entry in std::fs::read_dir(dir)? {
            let entry = entry?;
            let name = entry.file_name().to_string_lossy().into_owned();
            let path = entry.path();
            let at = format!("{logical}/{name}");
            let meta = std::fs::symlink_metadata(&path)?;
            let kind = meta.file_type();
            if kind.is_symlink() {
                let target = std::fs::read_link(&path)?;
                if target.is_absolute() {
                    return Err(std::io::Error::other(format!(
                        "{}: fixture links must be relative, as sysfs's are (an absolute one \
                         would point outside the node, and the agent refuses to follow it)",
                        path.display()
                    )));
                }
                self.insert(&at, Entry::Link(target.to_string_lossy().into_owned()));
            } else if kind.is_dir() {
                self.insert(&at, Entry::Dir);
                self.read_tree(&path, &at)?;
            } else if kind.is_char_device() || kind.is_block_device() {
                let rdev = meta.rdev();
                let major = ((rdev >> 8) & 0xfff) | ((rdev >> 32) & !0xfff);
                let minor = (rdev & 0xff) | ((rdev >> 12) & !0xff);
                let node = if kind.is_block_device() {
                    NodeKind::Block
                } else {
                    NodeKind::Character
                };
                self.add_node(&at, node, major as u32, minor as u32);
            } else {
                self.insert(&at, Entry::File(std::fs::read(&path)?));
            }
        }
        Ok(())
    }

    fn entry(&self, path: &str) -> Option<Entry> {
        let tree = self.tree.borrow();
        if let Some(e) = tree.get(path) {
            return Some(e.clone());
        }
        let prefix = format!("{path}/");
        tree.range(prefix.clone()..)
            .next()
            .filter(|(p, _)| p.starts_with(&prefix))
            .map(|_| Entry::Dir)
    }

    /// Follows symlinks in `path` while they stay inside `area` (`/sys` or `/dev`); with
    /// `follow_last` false, the last component is left as it is.
    fn resolve(&self, area: &str, path: &str, follow_last: bool) -> Result<String, FsError> {
        let mut pending: Vec<String> = path
            .trim_start_matches('/')
            .split('/')
            .rev()
            .map(str::to_owned)
            .collect();
        let mut at: Vec<String> = Vec::new();
        let mut links = 0;
        while let Some(component) = pending.pop() {
            match component.as_str() {
                "" | "." => continue,
                ".." => {
                    at.pop();
                    continue;
                }
                _ => {}
            }
            at.push(component);
            let here = format!("/{}", at.join("/"));
            if !here.starts_with(area) && !area.starts_with(&here) {
                return Err(FsError::Denied("the path resolves outside its tree".into()));
            }
            let last = pending.is_empty();
            if let Some(Entry::Link(target)) = self.entry(&here)
                && (follow_last || !last)
            {
                links += 1;
                if links > MAX_LINKS || target.starts_with('/') {
                    return Err(FsError::Denied("the path resolves outside its tree".into()));
                }
                at.pop();
                pending.extend(target.split('/').rev().map(str::to_owned));
            }
        }
        let resolved = format!("/{}", at.join("/"));
        if resolved != area && !resolved.starts_with(&format!("{area}/")) {
            return Err(FsError::Denied("the path resolves outside its tree".into()));
        }
        Ok(resolved)
    }

    fn check(&self, grants: &[Pattern], path: &str, listing: bool) -> Result<(), FsError> {
        if grants.is_empty() {
            return Err(no_grant(if path.starts_with("/dev") {
                "dev"
            } else {
                "sysfs"
            }));
        }
        devicelet_rules::grants::check(grants, path, listing).map_err(|e| {
            FsError::Denied(match e {
                Denied::NotNormal(_) => format!("{path} is not an absolute, normalised path"),
                Denied::NotGranted => format!("{path} is outside the module's grants"),
            })
        })
    }

    pub(crate) fn sysfs_read(&self, path: &str) -> Result<Vec<u8>, FsError> {
        self.check(&self.sysfs, path, false)?;
        let real = self.resolve("/sys", path, true)?;
        match self.entry(&real) {
            Some(Entry::File(bytes)) => Ok(bytes
                .into_iter()
                .take(devicelet_rules::grants::MAX_SYSFS_READ)
                .collect()),
            Some(_) => Err(FsError::Io(format!("{path} is not a regular file"))),
            None => Err(FsError::NotFound),
        }
    }

    pub(crate) fn sysfs_list(&self, path: &str) -> Result<Vec<String>, FsError> {
        self.check(&self.sysfs, path, true)?;
        let real = self.resolve("/sys", path, true)?;
        match self.entry(&real) {
            Some(Entry::Dir) => {}
            Some(_) => return Err(FsError::Io(format!("{path} is not a directory"))),
            None => return Err(FsError::NotFound),
        }
        let base = path.trim_end_matches('/');
        let names: BTreeSet<String> = self.children(&real);
        Ok(names
            .into_iter()
            .filter(|name| {
                let child = format!("{base}/{name}");
                granted(&self.sysfs, &child) || leads_to_grant(&self.sysfs, &child)
            })
            .collect())
    }

    pub(crate) fn sysfs_read_link(&self, path: &str) -> Result<String, FsError> {
        self.check(&self.sysfs, path, false)?;
        let real = self.resolve("/sys", path, false)?;
        match self.entry(&real) {
            Some(Entry::Link(target)) => Ok(target),
            Some(_) => Err(FsError::Io(format!("{path} is not a symbolic link"))),
            None => Err(FsError::NotFound),
        }
    }

    pub(crate) fn dev_glob(&self, pattern: &str) -> Result<Vec<String>, FsError> {
        if self.dev.is_empty() {
            return Err(no_grant("dev"));
        }
        let Some(rest) = pattern.strip_prefix("/dev/") else {
            return Err(FsError::Denied(format!(
                "{pattern} is not a pattern under /dev/"
            )));
        };
        let components: Vec<&str> = rest.split('/').collect();
        if components
            .iter()
            .any(|c| c.is_empty() || *c == "." || *c == ".." || c.contains("**"))
        {
            return Err(FsError::Denied(format!(
                "{pattern} must be normal, without `.`, `..`, empty components or `**`"
            )));
        }
        let mut found = vec!["/dev".to_owned()];
        for component in components {
            let mut next = Vec::new();
            for at in &found {
                if !component.contains(['*', '?', '[']) {
                    let path = format!("{at}/{component}");
                    if self.entry(&path).is_some() {
                        next.push(path);
                    }
                    continue;
                }
                let Ok(real) = self.resolve("/dev", at, true) else {
                    continue;
                };
                let matcher = Pattern::new(component).map_err(|e| FsError::Io(e.to_string()))?;
                for name in self.children(&real) {
                    if matcher.matches_with(&name, WALK) {
                        next.push(format!("{at}/{name}"));
                    }
                }
            }
            found = next;
        }
        found.retain(|path| {
            granted(&self.dev, path)
                && match self.resolve("/dev", path, true) {
                    Ok(_) => true,
                    Err(FsError::NotFound) => true,
                    Err(_) => false,
                }
        });
        found.sort();
        Ok(found)
    }

    pub(crate) fn dev_stat(&self, path: &str) -> Result<NodeInfo, FsError> {
        self.check(&self.dev, path, false)?;
        let real = self.resolve("/dev", path, true)?;
        match self.entry(&real) {
            Some(Entry::Node(info)) => Ok(info),
            Some(_) => Ok(NodeInfo {
                kind: NodeKind::Other,
                major: 0,
                minor: 0,
                mode: 0o644,
            }),
            None => Err(FsError::NotFound),
        }
    }

    pub(crate) fn log(&self, level: Level, message: &str) {
        self.logs.borrow_mut().push((level, message.to_owned()));
    }

    fn children(&self, dir: &str) -> BTreeSet<String> {
        let prefix = format!("{dir}/");
        self.tree
            .borrow()
            .range(prefix.clone()..)
            .take_while(|(p, _)| p.starts_with(&prefix))
            .filter_map(|(p, _)| p[prefix.len()..].split('/').next().map(str::to_owned))
            .collect()
    }
}

/// One line of a fixture's `dev.list`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DevListEntry {
    /// Where the node is, e.g. `/dev/dri/renderD128`.
    pub path: String,
    /// Character or block.
    pub kind: NodeKind,
    /// The device number's major part.
    pub major: u32,
    /// The device number's minor part.
    pub minor: u32,
}

/// Parses a fixture's `dev.list`: `c <major>:<minor> /dev/<path>` or `b ...` per line, `#`
/// comments and blank lines ignored. The error names the line. The agent's fixture trees are read
/// by the same parser.
pub fn parse_dev_list(text: &str) -> Result<Vec<DevListEntry>, String> {
    use devicelet_rules::dev_list::{self, Kind};
    Ok(dev_list::parse(text)?
        .into_iter()
        .map(|e| DevListEntry {
            path: e.path,
            kind: match e.kind {
                Kind::Char => NodeKind::Character,
                Kind::Block => NodeKind::Block,
            },
            major: e.major,
            minor: e.minor,
        })
        .collect())
}

/// A module using sysfs or /dev without any grant of that kind: the agent would not load it.
fn no_grant(area: &str) -> FsError {
    FsError::Denied(format!(
        "no {area} grant at all: the agent would not even load a module that uses {area} \
         without one (grant_{area}, or [module.grants] {area} = [...])"
    ))
}

fn is_normal(path: &str) -> bool {
    devicelet_rules::grants::normal(path).is_ok()
}

thread_local! {
    static HOST: RefCell<Option<Rc<FakeHost>>> = const { RefCell::new(None) };
}

/// Runs `f` with `host` as the host of the SDK's calls on this thread: for testing a function
/// of your own (a scan, a parser) outside a [`Harness`].
pub fn with_host<T>(host: &Rc<FakeHost>, f: impl FnOnce() -> T) -> T {
    let previous = HOST.with(|h| h.borrow_mut().replace(host.clone()));
    struct Restore(Option<Rc<FakeHost>>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let previous = self.0.take();
            HOST.with(|h| *h.borrow_mut() = previous);
        }
    }
    let _restore = Restore(previous);
    f()
}

/// The SDK's calls on the host target land here.
pub(crate) fn current<T>(f: impl FnOnce(&FakeHost) -> Result<T, FsError>) -> Result<T, FsError> {
    let host = HOST.with(|h| h.borrow().clone());
    match host {
        Some(host) => f(&host),
        None => Err(FsError::Denied(
            "no host: on the host target, call the module through devicelet_sdk::testing::Harness \
             (or testing::with_host)"
                .into(),
        )),
    }
}

/// `schedule::recheck-after` on the host target: kept by the installed host, shortest first.
pub(crate) fn recheck_after(after: std::time::Duration) {
    if let Some(host) = HOST.with(|h| h.borrow().clone()) {
        let kept = host
            .recheck
            .get()
            .map_or(after, |earlier| earlier.min(after));
        host.recheck.set(Some(kept));
    }
}

/// The SDK's MIG calls on the host target land here: they change the fake GPU.
pub(crate) fn current_nvml_mut<T>(
    f: impl FnOnce(&mut FakeNvml) -> Result<T, crate::nvml::NvmlError>,
) -> Result<T, crate::nvml::NvmlError> {
    let host = nvml_host()?;
    let mut nvml = host.nvml.borrow_mut();
    match nvml.as_mut() {
        Some(nvml) => f(nvml),
        None => Err(not_granted()),
    }
}

/// The SDK's NVML calls on the host target land here.
pub(crate) fn current_nvml<T>(
    f: impl FnOnce(&FakeNvml) -> Result<T, crate::nvml::NvmlError>,
) -> Result<T, crate::nvml::NvmlError> {
    let host = nvml_host()?;
    let nvml = host.nvml.borrow();
    match nvml.as_ref() {
        Some(nvml) => f(nvml),
        None => Err(not_granted()),
    }
}

/// The installed host, or the error an NVML call answers without one.
fn nvml_host() -> Result<Rc<FakeHost>, crate::nvml::NvmlError> {
    HOST.with(|h| h.borrow().clone()).ok_or_else(|| {
        crate::nvml::NvmlError::Unavailable(
            "no host: on the host target, call the module through devicelet_sdk::testing::Harness \
             (or testing::with_host)"
                .into(),
        )
    })
}

fn not_granted() -> crate::nvml::NvmlError {
    crate::nvml::NvmlError::Unavailable("nvml is not granted: FakeHost::grant_nvml".into())
}

/// Logs land in the installed host, or on stderr without one.
pub(crate) fn log(level: Level, message: &str) {
    let host = HOST.with(|h| h.borrow().clone());
    match host {
        Some(host) => host.log(level, message),
        None => eprintln!("[{level:?}] {message}"),
    }
}

/// One instance of a module, driven as the agent drives it, against a [`FakeHost`].
pub struct Harness<P> {
    host: Rc<FakeHost>,
    plugin: P,
    resources: Vec<ResourceInfo>,
    /// Each resource's last enumeration, which the agent answers own-edits requests from and
    /// checks device groups against.
    snapshots: BTreeMap<String, Vec<Device>>,
    config: String,
}

impl<P: Plugin> Harness<P> {
    /// Calls the module's `init` with `config` (the registry's `[module.config]` table as JSON,
    /// which is what the agent hands over), as the agent does under the default resource
    /// domain, `devicelet.io`: once to learn the resources, then again in the instance that
    /// answers, which [`crate::context::served_as`] tells their full names.
    pub fn init(host: FakeHost, config: &str) -> Result<Harness<P>, PluginError> {
        Self::init_in(host, config, "devicelet.io")
    }

    /// [`Harness::init`] under the registry's `resource-domain`.
    pub fn init_in(host: FakeHost, config: &str, domain: &str) -> Result<Harness<P>, PluginError> {
        let host = Rc::new(host);
        crate::context::set(domain, Vec::new());
        let (_, declared) = with_host(&host, || P::init(config))?;
        let served = declared
            .iter()
            .map(|r| {
                let full = if r.name.contains('/') {
                    r.name.clone()
                } else {
                    format!("{domain}/{}", r.name)
                };
                (r.name.clone(), full)
            })
            .collect();
        crate::context::set(domain, served);
        let (plugin, resources) = with_host(&host, || P::init(config))?;
        Ok(Harness {
            host,
            plugin,
            resources,
            snapshots: BTreeMap::new(),
            config: config.to_owned(),
        })
    }

    /// A second instance of the same module on the same node: the agent runs one for
    /// `enumerate` and another for the kubelet's calls, and `allocate` must work on one that
    /// never enumerated.
    pub fn another(&self, config: &str) -> Result<Harness<P>, PluginError> {
        let (plugin, resources) = with_host(&self.host, || P::init(config))?;
        Ok(Harness {
            host: self.host.clone(),
            plugin,
            resources,
            snapshots: BTreeMap::new(),
            config: config.to_owned(),
        })
    }

    /// The node, to change between calls.
    pub fn host(&self) -> &FakeHost {
        &self.host
    }

    /// The resources `init` declared.
    pub fn resources(&self) -> &[ResourceInfo] {
        &self.resources
    }

    /// `enumerate`, with its answer checked as the agent checks it.
    pub fn enumerate(&mut self, resource: &str) -> Result<Vec<Device>, PluginError> {
        let devices = with_host(&self.host, || self.plugin.enumerate(resource))?;
        let mut seen = BTreeSet::new();
        for d in &devices {
            if d.id.is_empty() || !seen.insert(d.id.clone()) {
                return Err(PluginError::Failed(format!(
                    "the agent would refuse this answer: device ID {:?} is empty or listed twice",
                    d.id
                )));
            }
        }
        self.snapshots.insert(resource.to_owned(), devices.clone());
        Ok(devices)
    }

    /// `allocate`, with its answer checked as the agent checks it: every device node under the
    /// `/dev` grants and present, no variable set twice. As in the agent, a request for a device
    /// the resource's last enumeration did not list, or that splits a device group, fails
    /// without calling the module. When every device carried its own
    /// edits in the resource's last [`Harness::enumerate`] (one is made if there was none), the
    /// answer is their union and `allocate` is not called, as in the agent.
    pub fn allocate(
        &mut self,
        resource: &str,
        ids: &[&str],
    ) -> Result<ContainerEdits, PluginError> {
        let ids: Vec<String> = ids.iter().map(|s| s.to_string()).collect();
        let snapshot = self.snapshot(resource)?;
        if let Some(unknown) = ids.iter().find(|id| !snapshot.iter().any(|d| &&d.id == id)) {
            return Err(PluginError::Failed(format!(
                "the agent would refuse this request (the module not called): {unknown:?} is \
                 not a device of {resource}'s last enumeration"
            )));
        }
        for device in snapshot.iter().filter(|d| ids.contains(&d.id)) {
            let Some(group) = &device.group else { continue };
            if let Some(left) = snapshot
                .iter()
                .find(|d| d.group.as_ref() == Some(group) && !ids.contains(&d.id))
            {
                return Err(PluginError::Failed(format!(
                    "the agent would refuse this request (InvalidArgument, the module not \
                     called): it splits device group {group:?}, leaving out {:?}",
                    left.id
                )));
            }
        }
        let edits = match own_edits(&snapshot, &ids) {
            Some(edits) => edits,
            None => with_host(&self.host, || {
                self.plugin.allocate_with_config(resource, &ids, "")
            })?,
        };
        self.checked(edits)
    }

    /// `edits` if the agent would take them: no variable set twice, every device node there.
    fn checked(&self, edits: ContainerEdits) -> Result<ContainerEdits, PluginError> {
        if let Some((name, first, second)) = devicelet_rules::edits::env_set_twice(&edits.envs) {
            return Err(PluginError::Failed(format!(
                "the agent would refuse this answer: env {name} is set twice, to {first:?} and \
                 {second:?}"
            )));
        }
        for node in &edits.devices {
            self.host.dev_stat(&node.host_path).map_err(|e| {
                PluginError::Failed(format!(
                    "the agent would refuse this answer: device node {}: {e}",
                    node.host_path
                ))
            })?;
        }
        Ok(edits)
    }

    /// `counter_sets`, as the agent asks right after `enumerate`.
    pub fn counter_sets(&mut self, resource: &str) -> Result<Vec<CounterSet>, PluginError> {
        with_host(&self.host, || self.plugin.counter_sets(resource))
    }

    /// `prepare`, for a DRA claim's request, with its answer checked as the agent checks it:
    /// the devices from the resource's last enumeration, the edits as for
    /// [`Harness::allocate`], status data only for the request's devices, each a JSON object
    /// of at most 10 KiB.
    pub fn prepare(&mut self, request: &Request) -> Result<Prepared, PluginError> {
        let snapshot = self.snapshot(&request.resource_name)?;
        if let Some(unknown) = request
            .ids
            .iter()
            .find(|id| !snapshot.iter().any(|d| &&d.id == id))
        {
            return Err(PluginError::Failed(format!(
                "the agent would refuse this request (the module not called): {unknown:?} is \
                 not a device of {}'s last enumeration",
                request.resource_name
            )));
        }
        let prepared = with_host(&self.host, || self.plugin.prepare(request))?;
        for status in &prepared.status {
            let object =
                status.data.trim_start().starts_with('{') && status.data.trim_end().ends_with('}');
            if !request.ids.contains(&status.id) || !object || status.data.len() > 10 * 1024 {
                return Err(PluginError::Failed(format!(
                    "the agent would refuse this answer: status for {:?} is not a JSON object \
                     of at most 10 KiB about one of the request's devices",
                    status.id
                )));
            }
        }
        Ok(Prepared {
            edits: self.checked(prepared.edits)?,
            status: prepared.status,
        })
    }

    /// `unprepare`.
    pub fn unprepare(&mut self, request: &Request) -> Result<(), PluginError> {
        with_host(&self.host, || self.plugin.unprepare(request))
    }

    /// The resource's last enumeration; without one, one made as the agent makes it, by an
    /// instance of its own (so this instance's state stays as the test left it).
    fn snapshot(&mut self, resource: &str) -> Result<Vec<Device>, PluginError> {
        if let Some(devices) = self.snapshots.get(resource) {
            return Ok(devices.clone());
        }
        let mut lane = self.another(&self.config.clone())?;
        lane.enumerate(resource)
    }

    /// `prestart`.
    pub fn prestart(&mut self, resource: &str, ids: &[&str]) -> Result<(), PluginError> {
        let ids: Vec<String> = ids.iter().map(|s| s.to_string()).collect();
        with_host(&self.host, || self.plugin.prestart(resource, &ids))
    }

    /// `preferred`, with its answer checked as the agent checks it: at most `size` IDs, each
    /// offered, none twice, every `must_include` there.
    pub fn preferred(
        &mut self,
        resource: &str,
        available: &[&str],
        must_include: &[&str],
        size: usize,
    ) -> Result<Vec<String>, PluginError> {
        let available: Vec<String> = available.iter().map(|s| s.to_string()).collect();
        let must: Vec<String> = must_include.iter().map(|s| s.to_string()).collect();
        let chosen = with_host(&self.host, || {
            self.plugin.preferred(resource, &available, &must, size)
        })?;
        let unique: BTreeSet<&String> = chosen.iter().collect();
        if chosen.len() > size
            || unique.len() != chosen.len()
            || chosen.iter().any(|id| !available.contains(id))
            || must
                .iter()
                .any(|id| available.contains(id) && !chosen.contains(id))
        {
            return Err(PluginError::Failed(format!(
                "the agent would refuse this answer: {chosen:?} (from {available:?}, must include \
                 {must:?}, size {size})"
            )));
        }
        Ok(chosen)
    }
}

/// As the agent answers a request whose devices all carry their own edits: their union, in
/// order, without calling `allocate`. None when one of them has none.
fn own_edits(snapshot: &[Device], ids: &[String]) -> Option<ContainerEdits> {
    fn add<T: PartialEq + Clone>(into: &mut Vec<T>, from: &[T]) {
        for item in from {
            if !into.contains(item) {
                into.push(item.clone());
            }
        }
    }
    let mut union = ContainerEdits::default();
    for id in ids {
        let edits = snapshot.iter().find(|d| &d.id == id)?.edits.as_ref()?;
        add(&mut union.envs, &edits.envs);
        add(&mut union.mounts, &edits.mounts);
        add(&mut union.devices, &edits.devices);
        add(&mut union.annotations, &edits.annotations);
        add(&mut union.cdi_devices, &edits.cdi_devices);
    }
    Some(union)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{devnodes, sysfs};

    fn pci_node() -> Rc<FakeHost> {
        Rc::new(
            FakeHost::new()
                .grant_sysfs("/sys/bus/pci/devices/*")
                .grant_dev("/dev/dri/renderD*")
                .file("/sys/devices/pci0000:00/0000:03:00.0/vendor", "0x1002\n")
                .file("/sys/devices/pci0000:00/0000:03:00.0/numa_node", "1\n")
                .file("/sys/devices/system/cpu/online", "0-63\n")
                .symlink(
                    "/sys/bus/pci/devices/0000:03:00.0",
                    "../../../devices/pci0000:00/0000:03:00.0",
                )
                .char_device("/dev/dri/renderD128", 226, 128)
                .char_device("/dev/dri/card0", 226, 0),
        )
    }

    #[test]
    fn a_file_set_through_a_symlinked_path_is_what_the_module_reads_through_either_path() {
        let host = pci_node();
        // As a test changes a real node's sysfs: through the link a module reads by.
        host.set_file("/sys/bus/pci/devices/0000:03:00.0/vendor", "0x10de\n");
        host.set_file("/sys/bus/pci/devices/0000:03:00.0/power_state", "D3cold\n");
        with_host(&host, || {
            assert_eq!(
                sysfs::read_to_string("/sys/bus/pci/devices/0000:03:00.0/vendor").unwrap(),
                "0x10de"
            );
            assert_eq!(
                sysfs::read_to_string("/sys/bus/pci/devices/0000:03:00.0/power_state").unwrap(),
                "D3cold"
            );
        });
        // It landed at the link's target, not beside the link.
        assert!(matches!(
            host.entry("/sys/devices/pci0000:00/0000:03:00.0/power_state"),
            Some(Entry::File(_))
        ));
        assert!(
            host.entry("/sys/bus/pci/devices/0000:03:00.0/power_state")
                .is_none()
        );
    }

    #[test]
    #[should_panic(expected = "its symlinks lead where no module can read it")]
    fn a_file_set_through_a_link_out_of_its_tree_is_refused_loudly() {
        let host = pci_node();
        host.set_symlink("/sys/bus/pci/devices/escape", "/etc");
        host.set_file("/sys/bus/pci/devices/escape/passwd", "x");
    }

    #[test]
    fn a_sysfs_grant_covers_what_its_links_point_to_and_nothing_else() {
        let host = pci_node();
        with_host(&host, || {
            assert_eq!(
                sysfs::read_to_string("/sys/bus/pci/devices/0000:03:00.0/vendor").unwrap(),
                "0x1002"
            );
            assert_eq!(
                sysfs::read_i64("/sys/bus/pci/devices/0000:03:00.0/numa_node").unwrap(),
                1
            );
            assert_eq!(
                sysfs::list("/sys/bus/pci/devices").unwrap(),
                ["0000:03:00.0"]
            );
            assert_eq!(
                sysfs::read_link("/sys/bus/pci/devices/0000:03:00.0").unwrap(),
                "../../../devices/pci0000:00/0000:03:00.0"
            );
            // The link's target is not granted by its own path.
            assert!(matches!(
                sysfs::read("/sys/devices/pci0000:00/0000:03:00.0/vendor"),
                Err(FsError::Denied(_))
            ));
            assert!(matches!(
                sysfs::read("/sys/devices/system/cpu/online"),
                Err(FsError::Denied(_))
            ));
            assert!(matches!(
                sysfs::read("/sys/bus/pci/devices/0000:03:00.0/../../../x"),
                Err(FsError::Denied(_))
            ));
            assert_eq!(
                sysfs::read("/sys/bus/pci/devices/0000:09:00.0/vendor"),
                Err(FsError::NotFound)
            );
        });
    }

    #[test]
    fn links_and_nodes_come_and_go_while_the_module_runs() {
        let host = pci_node();
        // Read through the bus's link, kept where sysfs keeps it.
        let driver = "/sys/bus/pci/devices/0000:03:00.0/driver";
        let real = "/sys/devices/pci0000:00/0000:03:00.0/driver";
        with_host(&host, || {
            assert_eq!(sysfs::read_link(driver), Err(FsError::NotFound));
        });
        // Bound to a driver, unbound, bound again: what a rebinding module must follow.
        host.set_symlink(real, "../../../bus/pci/drivers/vfio-pci");
        with_host(&host, || {
            assert_eq!(
                sysfs::read_link(driver).unwrap(),
                "../../../bus/pci/drivers/vfio-pci"
            );
        });
        host.remove(real);
        with_host(&host, || {
            assert_eq!(sysfs::read_link(driver), Err(FsError::NotFound));
        });
        host.set_symlink(real, "../../../bus/pci/drivers/amdgpu");
        host.add_node("/dev/dri/renderD129", NodeKind::Character, 226, 129);
        with_host(&host, || {
            assert_eq!(
                sysfs::read_link(driver).unwrap(),
                "../../../bus/pci/drivers/amdgpu"
            );
        });
        assert!(host.tree.borrow().contains_key("/dev/dri/renderD129"));
    }

    #[test]
    fn a_sysfs_read_is_cut_where_the_agents_is() {
        // The kit once cut reads at 64 KiB while the agent hands over up to 1 MiB: a module
        // reading a big attribute passed its tests and saw other bytes on a node.
        let big = vec![b'x'; devicelet_rules::grants::MAX_SYSFS_READ + 4096];
        let host = Rc::new(
            FakeHost::new()
                .grant_sysfs("/sys/class/big")
                .file("/sys/class/big/blob", &big),
        );
        with_host(&host, || {
            let read = sysfs::read("/sys/class/big/blob").unwrap();
            assert_eq!(read.len(), devicelet_rules::grants::MAX_SYSFS_READ);
        });
    }

    #[test]
    fn dev_globs_see_only_granted_nodes() {
        let host = pci_node();
        with_host(&host, || {
            assert_eq!(
                devnodes::glob("/dev/dri/*").unwrap(),
                ["/dev/dri/renderD128"]
            );
            let info = devnodes::stat("/dev/dri/renderD128").unwrap();
            assert_eq!(
                (info.kind, info.major, info.minor),
                (NodeKind::Character, 226, 128)
            );
            assert!(matches!(
                devnodes::stat("/dev/dri/card0"),
                Err(FsError::Denied(_))
            ));
            assert!(matches!(devnodes::glob("/dev/**"), Err(FsError::Denied(_))));
        });
        host.remove("/dev/dri/renderD128");
        with_host(&host, || {
            assert!(devnodes::glob("/dev/dri/*").unwrap().is_empty())
        });
    }

    #[test]
    fn a_module_without_any_grant_of_a_kind_is_told_the_agent_would_not_load_it() {
        let host = Rc::new(FakeHost::new().grant_dev("/dev/fuse"));
        with_host(&host, || {
            let e = sysfs::read("/sys/bus/pci/devices").unwrap_err();
            assert!(
                matches!(e, FsError::Denied(ref why) if why.contains("no sysfs grant at all")),
                "{e:?}"
            );
        });
    }

    #[test]
    fn fixture_links_must_be_relative() {
        let dir = std::env::temp_dir().join(format!("devicelet-kit-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("sys/bus")).unwrap();
        std::os::unix::fs::symlink("/sys/devices/x", dir.join("sys/bus/x")).unwrap();
        let e = FakeHost::from_fixture(&dir).unwrap_err();
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(e.to_string().contains("must be relative"), "{e}");
    }

    #[test]
    fn without_a_host_calls_are_refused_not_aborted() {
        let e = sysfs::read("/sys/x").unwrap_err();
        assert!(
            matches!(e, FsError::Denied(ref why) if why.contains("Harness")),
            "{e:?}"
        );
    }

    #[test]
    fn dev_lists_parse_and_name_the_bad_line() {
        let nodes =
            parse_dev_list("# GPUs\nc 226:128 /dev/dri/renderD128\n\nb 8:0 /dev/sda # disk\n")
                .unwrap();
        assert_eq!(nodes.len(), 2);
        assert_eq!(nodes[1].kind, NodeKind::Block);
        let e = parse_dev_list("c 226:128 /dev/ok\nc 226 /dev/bad\n").unwrap_err();
        assert!(e.starts_with("line 2:"), "{e}");
        assert!(parse_dev_list("c 1:2 /etc/passwd").is_err());
    }

    /// Two serial ports, one device group, each with its own edits; `env` gives each port's
    /// edits a variable, the same name for both.
    struct Pair {
        env: bool,
        allocate_calls: u32,
    }

    impl Plugin for Pair {
        fn init(config: &str) -> Result<(Self, Vec<ResourceInfo>), PluginError> {
            let pair = Pair {
                env: config == "env",
                allocate_calls: 0,
            };
            Ok((pair, vec![ResourceInfo::new("serial")]))
        }

        fn enumerate(&mut self, _resource: &str) -> Result<Vec<Device>, PluginError> {
            Ok(["ttyS0", "ttyS1"]
                .iter()
                .map(|id| {
                    let path = format!("/dev/{id}");
                    let mut edits = ContainerEdits::default().device(path.clone(), path, "rw");
                    if self.env {
                        edits = edits.env("PORT", *id);
                    }
                    Device::healthy(*id).group("pair").edits(edits)
                })
                .collect())
        }

        fn allocate(
            &mut self,
            _resource: &str,
            _ids: &[String],
        ) -> Result<ContainerEdits, PluginError> {
            self.allocate_calls += 1;
            Ok(ContainerEdits::default())
        }
    }

    fn ports() -> FakeHost {
        FakeHost::new()
            .grant_dev("/dev/ttyS*")
            .char_device("/dev/ttyS0", 4, 64)
            .char_device("/dev/ttyS1", 4, 65)
    }

    #[test]
    fn allocate_refuses_what_the_agent_refuses_and_answers_from_own_edits() {
        let mut pair = Harness::<Pair>::init(ports(), "").unwrap();
        let e = pair.allocate("serial", &["ttyS0"]).unwrap_err();
        assert!(
            e.to_string().contains("splits device group \"pair\""),
            "{e}"
        );
        let edits = pair.allocate("serial", &["ttyS0", "ttyS1"]).unwrap();
        assert_eq!(edits.devices.len(), 2);
        assert_eq!(
            pair.plugin.allocate_calls, 0,
            "answered from the devices' edits"
        );
        let mut clash = Harness::<Pair>::init(ports(), "env").unwrap();
        let e = clash.allocate("serial", &["ttyS0", "ttyS1"]).unwrap_err();
        assert!(e.to_string().contains("env PORT is set twice"), "{e}");
    }
}
