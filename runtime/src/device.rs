//! Devices and what a container needs to use them, as the host sees them: independent of the
//! WIT version a module speaks, and of WebAssembly altogether.
//!
//! The kubelet side (`kubelet/`), the ledger and the policies use only these types; the sandbox
//! converts a module's answers into them at the seam (`sandbox::bindings`), so a new WIT major
//! version only needs a new bindings module.

/// Most devices one resource may list (replicas of shared devices included): far above any real
/// node, far below what hurts.
pub const MAX_DEVICES: usize = 16_384;
/// Longest device ID (a replica's `::<n>` suffix included).
pub const MAX_ID: usize = 128;

/// A resource a module serves, as declared by its `init`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResourceInfo {
    /// A bare suffix (`fuse`) or a full extended resource name (`vendor.com/fuse`).
    pub name: String,
    pub prestart: bool,
    pub preferred_allocation: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Health {
    Healthy,
    Unhealthy,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Device {
    pub id: String,
    pub health: Health,
    pub numa_nodes: Vec<i64>,
    pub attributes: Vec<(String, String)>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mount {
    pub container_path: String,
    pub host_path: String,
    pub read_only: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceNode {
    pub container_path: String,
    pub host_path: String,
    pub permissions: String,
    /// The host node as the host found it when it checked the answer; None until then. A
    /// runtime given the path alone makes the container's node like the host's, so a CDI spec
    /// naming the node must say all of this to give the same container.
    pub file: Option<NodeFile>,
}

/// What a device node on the host is: its kind, numbers, mode and owner.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NodeFile {
    pub kind: NodeKind,
    pub major: u64,
    pub minor: u64,
    /// Permission bits (`0o7777` at most), as `fileMode` in a CDI spec.
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
}

impl NodeFile {
    /// From what `stat` says of a node: its device number `rdev` and its full `mode`.
    pub fn new(kind: NodeKind, rdev: u64, mode: u32, uid: u32, gid: u32) -> NodeFile {
        NodeFile {
            kind,
            major: u64::from(libc::major(rdev)),
            minor: u64::from(libc::minor(rdev)),
            mode: mode & 0o7777,
            uid,
            gid,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum NodeKind {
    Char,
    Block,
}

/// What a container needs to use its allocated devices.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ContainerEdits {
    pub envs: Vec<(String, String)>,
    pub mounts: Vec<Mount>,
    pub devices: Vec<DeviceNode>,
    pub annotations: Vec<(String, String)>,
    pub cdi_devices: Vec<String>,
}

/// An error a module reported itself (as opposed to a trap or a missed deadline).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PluginError {
    #[error("invalid config: {0}")]
    InvalidConfig(String),
    #[error("unknown resource: {0}")]
    UnknownResource(String),
    #[error("unknown device: {0}")]
    UnknownDevice(String),
    #[error("{0}")]
    Failed(String),
}
