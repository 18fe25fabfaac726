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

/// What a module's `init` answered: its own version (empty for a 0.1 module) and its resources.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ModuleInfo {
    pub version: String,
    pub resources: Vec<ResourceInfo>,
}

/// What `init` is told: the config table as JSON, the resource domain, and the names the
/// resources are served under (by declared name), once known.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct InitContext {
    pub config: String,
    pub resource_domain: String,
    pub served_as: Vec<(String, String)>,
}

/// One allocation as the module sees it: the resource by its declared name, the devices, and the
/// request's opaque config (JSON; empty from the device-plugin front end).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Request {
    pub resource: String,
    pub ids: Vec<String>,
    pub config: String,
    /// Tells requests for the same devices apart; empty from the device-plugin front end.
    pub key: String,
    /// What the request holds of each of its devices shared by capacity (a DRA claim's
    /// consumed capacity); empty otherwise.
    pub shares: Vec<Share>,
}

/// One request's part of a device shared by capacity.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Share {
    pub id: String,
    /// The scheduler's `shareID`.
    pub share_id: String,
    /// (capacity name, quantity).
    pub consumed: Vec<(String, String)>,
}

/// What a module's `prepare` (WIT 0.3 `claims`) answers for one request of a DRA claim: the
/// container's edits, and per device the JSON the claim's status carries.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Prepared {
    pub edits: ContainerEdits,
    /// (device ID, JSON object).
    pub status: Vec<(String, String)>,
}

impl Request {
    /// An allocation as the device-plugin front end asks for it: no config, no key.
    pub fn without_config(resource: &str, ids: Vec<String>) -> Request {
        Request {
            resource: resource.to_owned(),
            ids,
            ..Request::default()
        }
    }
}

/// A resource a module serves, as declared by its `init`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResourceInfo {
    /// A bare suffix (`fuse`) or a full extended resource name (`vendor.com/fuse`).
    pub name: String,
    pub prestart: bool,
    pub preferred_allocation: bool,
    /// A container never gets two shares (replicas) of one device (WIT 0.3).
    pub one_share_per_container: bool,
    /// DRA claims are prepared through the module's `claims` export, under the host's
    /// write-ahead record (WIT 0.3).
    pub prepares_claims: bool,
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
    /// Why it is unhealthy, when the module said (WIT 0.2); None while healthy.
    pub health_reason: Option<String>,
    pub numa_nodes: Vec<i64>,
    pub attributes: Vec<(String, AttributeValue)>,
    /// Name and Kubernetes quantity (`80Gi`).
    pub capacities: Vec<(String, String)>,
    /// Devices of one resource with the same group are allocated together or not at all.
    pub group: Option<String>,
    /// Never shared: a sharing rule for its resource is refused.
    pub exclusive: bool,
    /// What a container needs for this device alone: with them for every device of a request,
    /// the host answers Allocate without calling the module.
    pub edits: Option<ContainerEdits>,
    /// The PCIe root complex (`pci0000:00`) sysfs puts a PCI device under: the host's, never
    /// the module's (`policy::topology`); DRA publishes it as `resource.kubernetes.io/pcieRoot`.
    pub pcie_root: Option<String>,
    /// The module's own taints (WIT 0.3), published beside the host's health taint.
    pub taints: Vec<Taint>,
    /// Several DRA claims may hold it at once, each a part of its capacities (WIT 0.3): how
    /// much of which capacity a claim may hold.
    pub shared: Option<Shared>,
    /// What it takes from its inventory's counter sets while allocated (WIT 0.3).
    pub consumes: Vec<CounterUse>,
}

/// A device taint of the module's own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Taint {
    pub key: String,
    pub value: String,
    pub effect: TaintEffect,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TaintEffect {
    NoSchedule,
    NoExecute,
    None,
}

impl TaintEffect {
    /// As the DRA API spells it.
    pub fn api(self) -> &'static str {
        match self {
            TaintEffect::NoSchedule => "NoSchedule",
            TaintEffect::NoExecute => "NoExecute",
            TaintEffect::None => "None",
        }
    }
}

/// How claims share a device by capacity: each capacity's request policy, by name (a capacity
/// without one is held as asked, the whole of it when a claim asks nothing).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Shared {
    pub policies: Vec<(String, RequestPolicy)>,
}

/// DRA's `CapacityRequestPolicy`: quantities as the module gave them.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RequestPolicy {
    /// None: the whole capacity.
    pub default: Option<String>,
    pub valid: ValidAmounts,
}

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum ValidAmounts {
    #[default]
    Any,
    Range {
        min: String,
        max: Option<String>,
        step: Option<String>,
    },
    Values(Vec<String>),
}

/// A budget in a resource's pool that devices draw on (DRA `sharedCounters`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CounterSet {
    pub name: String,
    /// (counter name, quantity).
    pub counters: Vec<(String, String)>,
}

/// What a device takes from one counter set while allocated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CounterUse {
    pub counter_set: String,
    pub counters: Vec<(String, String)>,
}

/// What a module's `enumerate` answered: its devices, and (WIT 0.3) the counter sets they draw
/// on. Reads as its devices (`Deref`), which is all most of the host needs.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Inventory {
    pub devices: Vec<Device>,
    pub counter_sets: Vec<CounterSet>,
}

impl From<Vec<Device>> for Inventory {
    fn from(devices: Vec<Device>) -> Self {
        Inventory {
            devices,
            counter_sets: Vec::new(),
        }
    }
}

impl FromIterator<Device> for Inventory {
    fn from_iter<I: IntoIterator<Item = Device>>(devices: I) -> Self {
        Inventory::from(devices.into_iter().collect::<Vec<_>>())
    }
}

impl std::ops::Deref for Inventory {
    type Target = Vec<Device>;
    fn deref(&self) -> &Vec<Device> {
        &self.devices
    }
}

impl std::ops::DerefMut for Inventory {
    fn deref_mut(&mut self) -> &mut Vec<Device> {
        &mut self.devices
    }
}

impl Device {
    /// A device with nothing but its ID and health: what a 0.1 module's device converts from,
    /// and what tests build on.
    pub fn new(id: impl Into<String>, health: Health) -> Device {
        Device {
            id: id.into(),
            health,
            health_reason: None,
            numa_nodes: Vec::new(),
            attributes: Vec::new(),
            capacities: Vec::new(),
            group: None,
            exclusive: false,
            edits: None,
            pcie_root: None,
            taints: Vec::new(),
            shared: None,
            consumes: Vec::new(),
        }
    }

    /// The text of attribute `name`, whatever its kind.
    pub fn attribute(&self, name: &str) -> Option<String> {
        self.attributes
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.to_string())
    }
}

/// A device's attributes and capacities as `validate` and `status` show them: `name=value`, a
/// typed attribute's kind after a colon unless it is text (`cores=96:int`), a capacity as
/// `name=quantity (capacity)`.
pub fn describe_facts(d: &Device) -> Vec<String> {
    let attributes = d.attributes.iter().map(|(k, v)| match v {
        AttributeValue::Text(t) => format!("{k}={t}"),
        other => format!("{k}={other}:{}", other.kind()),
    });
    let capacities = d
        .capacities
        .iter()
        .map(|(k, v)| format!("{k}={v} (capacity)"));
    attributes.chain(capacities).collect()
}

/// A typed fact about a device: the kinds DRA publishes. A 0.1 module's are all text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AttributeValue {
    Int(i64),
    Bool(bool),
    Text(String),
    /// A semantic version, `1.2.3`.
    Version(String),
}

impl AttributeValue {
    /// The kind, as `validate` and `status` name it.
    pub fn kind(&self) -> &'static str {
        match self {
            AttributeValue::Int(_) => "int",
            AttributeValue::Bool(_) => "bool",
            AttributeValue::Text(_) => "string",
            AttributeValue::Version(_) => "version",
        }
    }

    /// Bytes it holds, for the host-memory budget and the size checks.
    pub fn bytes(&self) -> usize {
        match self {
            AttributeValue::Int(_) | AttributeValue::Bool(_) => 8,
            AttributeValue::Text(t) | AttributeValue::Version(t) => t.len(),
        }
    }
}

impl std::fmt::Display for AttributeValue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AttributeValue::Int(n) => write!(f, "{n}"),
            AttributeValue::Bool(b) => write!(f, "{b}"),
            AttributeValue::Text(t) | AttributeValue::Version(t) => f.write_str(t),
        }
    }
}

impl From<&str> for AttributeValue {
    fn from(text: &str) -> Self {
        AttributeValue::Text(text.to_owned())
    }
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

impl ContainerEdits {
    /// Bytes it holds while the host keeps it: the edits and every string in them.
    pub fn bytes(&self) -> usize {
        let pairs = |m: &[(String, String)]| {
            m.iter()
                .map(|(k, v)| std::mem::size_of::<(String, String)>() + k.len() + v.len())
                .sum::<usize>()
        };
        std::mem::size_of::<ContainerEdits>()
            + pairs(&self.envs)
            + pairs(&self.annotations)
            + self
                .mounts
                .iter()
                .map(|m| std::mem::size_of::<Mount>() + m.container_path.len() + m.host_path.len())
                .sum::<usize>()
            + self
                .devices
                .iter()
                .map(|d| {
                    std::mem::size_of::<DeviceNode>()
                        + d.container_path.len()
                        + d.host_path.len()
                        + d.permissions.len()
                })
                .sum::<usize>()
            + self
                .cdi_devices
                .iter()
                .map(|c| std::mem::size_of::<String>() + c.len())
                .sum::<usize>()
    }

    /// The edits of several devices as one answer: each entry once, in the order first given
    /// (what the host answers for a request whose devices all carry their own edits).
    pub fn union<'a>(parts: impl IntoIterator<Item = &'a ContainerEdits>) -> ContainerEdits {
        fn add<T: PartialEq + Clone>(into: &mut Vec<T>, from: &[T]) {
            for item in from {
                if !into.contains(item) {
                    into.push(item.clone());
                }
            }
        }
        let mut union = ContainerEdits::default();
        for part in parts {
            add(&mut union.envs, &part.envs);
            add(&mut union.mounts, &part.mounts);
            add(&mut union.devices, &part.devices);
            add(&mut union.annotations, &part.annotations);
            add(&mut union.cdi_devices, &part.cdi_devices);
        }
        union
    }
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
