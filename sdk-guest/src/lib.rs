//! Write a devicelet device module in Rust: implement one trait, invoke one macro.
//!
//! devicelet owns everything that is the same for every kind of device (kubelet sockets,
//! registration, health diffing, bookkeeping, sharing, NUMA-aware preferred allocation, CDI spec
//! files built from the module's `allocate` answer for each device). A module only answers the
//! vendor-specific questions: which devices exist, are they healthy, what does a container need
//! to use them, and optionally what to check before a container starts and which devices to
//! prefer. This crate hides the WebAssembly component plumbing of the `devicelet:plugin` WIT
//! world behind the [`Plugin`] trait and the [`export_plugin!`] macro, so a vendor crate depends
//! on `devicelet-sdk` alone.
//!
//! # Building
//!
//! A module is a `cdylib` built for `wasm32-wasip2`, which makes `cargo` emit a component
//! directly:
//!
//! ```toml
//! [lib]
//! crate-type = ["cdylib"]
//!
//! [dependencies]
//! devicelet-sdk = "0.2"
//! ```
//!
//! ```sh
//! cargo build --target wasm32-wasip2 --release
//! ```
//!
//! Do not build a module for the host target: the component exports only make sense inside the
//! devicelet sandbox.
//!
//! # Capabilities
//!
//! The registry grants each module the host interfaces it may use: `log` always, [`sysfs`] and
//! [`devnodes`] only with matching grants, [`nvml`] only with `libraries = ["nvml"]`. A component that imports an interface the registry
//! did not grant fails to load, so the SDK never touches an import on its own: calling a
//! function of [`sysfs`] or [`devnodes`] anywhere in your code is what makes your component
//! import that interface, and not calling it keeps the import out.
//!
//! # Example
//!
//! A complete module serving every `/dev/kvm`-like node the registry grants as one resource:
//!
//! ```no_run
//! use devicelet_sdk::{
//!     devnodes, export_plugin, ContainerEdits, Device, Plugin, PluginError, ResourceInfo,
//! };
//!
//! struct Kvm {
//!     pattern: String,
//! }
//!
//! impl Plugin for Kvm {
//!     fn init(config: &str) -> Result<(Self, Vec<ResourceInfo>), PluginError> {
//!         // The registry's config table arrives as JSON; this module takes no options.
//!         if !matches!(config.trim(), "" | "{}") {
//!             return Err(PluginError::InvalidConfig("kvm takes no options".into()));
//!         }
//!         devicelet_sdk::info!("serving /dev/kvm");
//!         Ok((Kvm { pattern: "/dev/kvm".into() }, vec![ResourceInfo::new("kvm")]))
//!     }
//!
//!     fn enumerate(&mut self, resource: &str) -> Result<Vec<Device>, PluginError> {
//!         if resource != "kvm" {
//!             return Err(PluginError::UnknownResource(resource.into()));
//!         }
//!         let nodes = devnodes::glob(&self.pattern)
//!             .map_err(|e| PluginError::Failed(format!("glob {}: {e}", self.pattern)))?;
//!         Ok(nodes
//!             .iter()
//!             .map(|path| Device::healthy(path.trim_start_matches("/dev/").replace('/', "-")))
//!             .collect())
//!     }
//!
//!     fn allocate(&mut self, _resource: &str, ids: &[String]) -> Result<ContainerEdits, PluginError> {
//!         let mut edits = ContainerEdits::default();
//!         for id in ids {
//!             let path = format!("/dev/{}", id.replace('-', "/"));
//!             edits = edits.device(&path, &path, "rw");
//!         }
//!         Ok(edits.env("KVM_DEVICES", ids.join(",")))
//!     }
//!
//!     // `prestart` and `preferred` keep their defaults: prestart does nothing, preferred
//!     // takes devices in order.
//! }
//!
//! export_plugin!(Kvm);
//! ```
//!
//! # Errors and panics
//!
//! Return a [`PluginError`] for anything the host should report and carry on from. A panic traps
//! the instance: the host drops it, creates a fresh one (calling [`Plugin::init`] again) after a
//! backoff and reports the module's devices unhealthy meanwhile. So panic only on bugs, never on
//! bad input from the config or the host file system.
//!
//! The host reports an error with the module's name and the error's `Display` text
//! (`invalid config: ...`, `unknown resource: ...`, or a `Failed` message as written), in its
//! log, in `devicelet status` and, for the kubelet's calls, in the pod's events. A
//! [`PluginError::InvalidConfig`] from `init` is reported against the registry file and line of
//! the module's `[module.config]` table; a trailing serde_json position (` at line 1 column 7`)
//! is cut, since the module sees its config as one line of JSON.

#![warn(missing_docs)]

// Lets the generated bindings name this crate the same way from inside it and from a vendor
// crate's `export_plugin!` expansion.
extern crate self as devicelet_sdk;

use std::cell::RefCell;

#[doc(hidden)]
pub mod bindings {
    #![allow(missing_docs)]
    // What `wit_bindgen::generate!` would expand to for `wit/` (this crate's WIT, 0.3.1), written
    // by `sdk-guest/bindgen` with the options it names: a module's build compiles no generator.
    include!("bindings.rs");
}

mod vanished;
pub use vanished::Vanished;

use bindings::devicelet::plugin::types as wit_types;
use bindings::exports::devicelet::plugin::plugin::Guest;

pub use bindings::devicelet::plugin::devnodes::{NodeInfo, NodeKind};
pub use bindings::devicelet::plugin::log::Level;
pub use wit_types::{
    Amount, AmountRange, Attribute, AttributeValue, Capacity, ContainerEdits, CounterSet,
    CounterUse, Device, DeviceNode, DeviceStatus, FsError, Health, Mount, Prepared, Request,
    RequestPolicy, ResourceInfo, Share, Taint, TaintEffect, ValidAmounts,
};

/// Why a call failed. The host reports it with the module's name: in the agent's log, in
/// `devicelet status`, and (for Allocate) in the pod's events, so say what an operator can act
/// on. `Display` gives that message (`invalid config: ...`, `unknown resource: ...`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PluginError {
    /// The module's `[module.config]` table is unusable; the host adds the registry file and
    /// line of that table.
    InvalidConfig(String),
    /// The host named a resource this module does not serve.
    UnknownResource(String),
    /// The host named a device this module does not know.
    UnknownDevice(String),
    /// Anything else.
    Failed(String),
}

impl std::fmt::Display for PluginError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PluginError::InvalidConfig(m) => write!(f, "invalid config: {m}"),
            PluginError::UnknownResource(m) => write!(f, "unknown resource: {m}"),
            PluginError::UnknownDevice(m) => write!(f, "unknown device: {m}"),
            PluginError::Failed(m) => f.write_str(m),
        }
    }
}

impl std::error::Error for PluginError {}

impl From<PluginError> for wit_types::PluginError {
    fn from(e: PluginError) -> Self {
        match e {
            PluginError::InvalidConfig(m) => wit_types::PluginError::InvalidConfig(m),
            PluginError::UnknownResource(m) => wit_types::PluginError::UnknownResource(m),
            PluginError::UnknownDevice(m) => wit_types::PluginError::UnknownDevice(m),
            PluginError::Failed(m) => wit_types::PluginError::Failed(m),
        }
    }
}

/// The vendor logic of a module: one value of this type lives in the instance between calls.
///
/// The host calls [`Plugin::init`] once per instance and every other method afterwards, one call
/// at a time. Each method gets the resource name as [`Plugin::init`] returned it, so a module
/// serving several resources dispatches on it; answer a name you do not serve with
/// [`PluginError::UnknownResource`].
///
/// Calls are bounded by host deadlines (a module that spins is interrupted and restarted), so
/// keep every method to quick reads of sysfs and /dev; the host polls `enumerate` at the module's
/// interval rather than expecting the module to watch for changes, and reads health from it.
///
/// The host runs two instances of the module, each with its own value of this type: one answers
/// `enumerate` (health work), the other `allocate` and `prestart` (the kubelet's calls), so an
/// Allocate never waits behind an enumeration; a module whose resources ask for preferred
/// allocation gets a third, for `preferred` alone. Do not rely on state one of them sets for
/// another: `allocate` must work on a fresh instance that never enumerated (look the devices up
/// again when you need them).
pub trait Plugin: Sized + 'static {
    /// Parses the registry's config table (JSON text) and says which resources the module
    /// serves.
    ///
    /// Reject anything you do not understand with [`PluginError::InvalidConfig`]: a typo in the
    /// registry should stop the module at startup, not silently change what it serves.
    fn init(config: &str) -> Result<(Self, Vec<ResourceInfo>), PluginError>;

    /// Every device of the resource, present and healthy or not.
    ///
    /// The host diffs successive answers, so a device that disappears should simply be left
    /// out, and IDs must be stable across calls (the kubelet allocates by them).
    fn enumerate(&mut self, resource: &str) -> Result<Vec<Device>, PluginError>;

    /// The counter sets the resource's devices draw on ([`Device::consumes`]): budgets such as
    /// a GPU's memory and compute slices, which Dynamic Resource Allocation's scheduler never
    /// lets the allocated partitions exceed. Called right after [`Plugin::enumerate`], in the
    /// same call from the host, so both describe one moment. The default has none.
    fn counter_sets(&mut self, resource: &str) -> Result<Vec<CounterSet>, PluginError> {
        let _ = resource;
        Ok(Vec::new())
    }

    /// What a container needs to use the given devices.
    ///
    /// The host checks the answer against the module's grants (device nodes and mounts must
    /// fall under them), so return exactly what the container needs and nothing broader.
    ///
    /// The host also calls it ahead of time, for each healthy device alone, whenever a device
    /// appears or changes, and answers the kubelet's single-device Allocates from those answers
    /// while the device is unchanged (registry key `allocate-ahead`, on by default). So answer
    /// from `ids` and the devices' state only (the same IDs get the same edits, whenever
    /// asked), and do side effects in [`Plugin::prestart`], which runs for every container.
    ///
    /// A module whose devices carry their own edits ([`Device::edits`]) need not implement it:
    /// the host answers with the union of the devices' edits and does not call it. The default
    /// says so in an error.
    fn allocate(&mut self, resource: &str, ids: &[String]) -> Result<ContainerEdits, PluginError> {
        let _ = ids;
        Err(PluginError::Failed(format!(
            "{resource}: this module gives each device's edits in `enumerate` and has no \
             `allocate` of its own"
        )))
    }

    /// [`Plugin::allocate`] for a request that carries config: a Dynamic Resource Allocation
    /// claim's opaque parameters for this module, as JSON (`config` is empty for the
    /// device-plugin front end). The default refuses any config and calls
    /// [`Plugin::allocate`] for a request without.
    fn allocate_with_config(
        &mut self,
        resource: &str,
        ids: &[String],
        config: &str,
    ) -> Result<ContainerEdits, PluginError> {
        no_config(resource, config)?;
        self.allocate(resource, ids)
    }

    /// [`Plugin::allocate_with_config`] with the whole request: for a device
    /// [shared by capacity](Device::shared_by_capacity), [`Request::shares`] says how much of it
    /// this claim holds (to set a memory limit, say). The default ignores the shares.
    fn allocate_request(&mut self, request: &Request) -> Result<ContainerEdits, PluginError> {
        self.allocate_with_config(&request.resource_name, &request.ids, &request.config)
    }

    /// Prepares a Dynamic Resource Allocation claim's request, for a resource declared
    /// [`with_prepares_claims`](ResourceInfo::with_prepares_claims): create what the claim
    /// needs (a MIG instance), and answer the container's edits and, per device, a JSON object
    /// for the claim's status. The agent records that the claim is being prepared before the
    /// call, and calls [`Plugin::unprepare`] after it, even after its own restart. The default
    /// answers [`Plugin::allocate_request`] with no status.
    fn prepare(&mut self, request: &Request) -> Result<Prepared, PluginError> {
        Ok(Prepared {
            edits: self.allocate_request(request)?,
            status: Vec::new(),
        })
    }

    /// Undoes [`Plugin::prepare`]. It may come twice, or for a request whose `prepare` never
    /// ran or failed (after an agent restart): succeed when there is nothing to undo. The
    /// default calls [`Plugin::release`].
    fn unprepare(&mut self, request: &Request) -> Result<(), PluginError> {
        self.release(&request.resource_name, &request.ids, &request.config)
    }

    /// Checks a DRA request's config before anything is reserved for its claim: a refusal
    /// fails the claim with your words, before any device is allocated. The default accepts
    /// any, leaving the config to [`Plugin::allocate_with_config`] (or [`Plugin::prepare`]),
    /// whose default refuses any.
    fn validate_config(&mut self, resource: &str, config: &str) -> Result<(), PluginError> {
        let _ = (resource, config);
        Ok(())
    }

    /// Told when an allocation ends, to undo on the host what [`Plugin::prestart`] set up:
    /// called when the agent learns the request ended (a DRA claim unprepared). The kubelet's
    /// device-plugin API never says when a container's devices are freed, so do not rely on it
    /// there. The default does nothing.
    fn release(&mut self, resource: &str, ids: &[String], config: &str) -> Result<(), PluginError> {
        let _ = (resource, ids, config);
        Ok(())
    }

    /// Runs before each container using the devices starts, when the resource asked for it with
    /// [`ResourceInfo::prestart`]. An error keeps the container from starting.
    ///
    /// The default does nothing.
    fn prestart(&mut self, resource: &str, ids: &[String]) -> Result<(), PluginError> {
        let _ = (resource, ids);
        Ok(())
    }

    /// Chooses `size` devices from `available`, including all of `must_include`, when the
    /// resource asked for it with [`ResourceInfo::preferred_allocation`].
    ///
    /// The kubelet treats the answer as a hint, but a good one (same NUMA node, same switch,
    /// spread over physical devices) is the point of asking. The default is
    /// [`default_preferred`].
    ///
    /// Only implement it for a preference the host cannot make: without it, the host answers
    /// for the resource itself from the devices' `numa_nodes` (all of `must_include`, then the
    /// fewest NUMA nodes, then packed or distributed, per the registry's `allocation-policy`),
    /// and the registry can put that policy over this method too.
    fn preferred(
        &mut self,
        resource: &str,
        available: &[String],
        must_include: &[String],
        size: usize,
    ) -> Result<Vec<String>, PluginError> {
        let _ = resource;
        Ok(default_preferred(available, must_include, size))
    }
}

/// `Ok` when `resource` is the one resource a module serves (`served`), else the error the host
/// expects for a name it does not serve: the check a one-resource module starts each call with.
pub fn serves(resource: &str, served: &str) -> Result<(), PluginError> {
    if resource == served {
        Ok(())
    } else {
        Err(PluginError::UnknownResource(resource.to_owned()))
    }
}

/// What the defaults answer to a request's config: none is taken.
fn no_config(resource: &str, config: &str) -> Result<(), PluginError> {
    if config.trim().is_empty() {
        Ok(())
    } else {
        Err(PluginError::InvalidConfig(format!(
            "{resource} takes no request config"
        )))
    }
}

/// `must_include` first, then the rest of `available` in order, until `size` devices are
/// chosen.
///
/// The answer obeys every host rule for `preferred`: at most `size` IDs, each from `available`,
/// none twice. A `must_include` ID that is not in `available` is left out, and if
/// `must_include` alone exceeds `size` only its first `size` IDs are returned (the kubelet
/// never asks that; if it did, the request cannot be met either way and the kubelet decides).
pub fn default_preferred(
    available: &[String],
    must_include: &[String],
    size: usize,
) -> Vec<String> {
    let mut chosen: Vec<String> = Vec::with_capacity(size.min(available.len()));
    let offered = must_include
        .iter()
        .filter(|id| available.contains(id))
        .chain(available);
    for id in offered {
        if chosen.len() >= size {
            break;
        }
        if !chosen.contains(id) {
            chosen.push(id.clone());
        }
    }
    chosen
}

impl Device {
    /// A healthy device with no NUMA affinity and no attributes.
    pub fn healthy(id: impl Into<String>) -> Self {
        Self::new(id, Health::Healthy)
    }

    /// An unhealthy device: still listed so the kubelet knows it exists but won't allocate it.
    pub fn unhealthy(id: impl Into<String>) -> Self {
        Self::new(id, Health::Unhealthy)
    }

    /// A device with the given health, no NUMA affinity and no attributes.
    pub fn new(id: impl Into<String>, health: Health) -> Self {
        Self {
            id: id.into(),
            health,
            health_reason: None,
            numa_nodes: Vec::new(),
            attributes: Vec::new(),
            capacities: Vec::new(),
            group: None,
            exclusive: false,
            edits: None,
            taints: Vec::new(),
            shared_by_capacity: false,
            consumes: Vec::new(),
        }
    }

    /// An unhealthy device, and why: `validate`, `status` and the agent's log show the reason.
    pub fn unhealthy_because(id: impl Into<String>, reason: impl Into<String>) -> Self {
        let mut device = Self::new(id, Health::Unhealthy);
        device.health_reason = Some(reason.into());
        device
    }

    /// Adds a NUMA node, which the kubelet's topology manager uses to align devices with CPUs.
    pub fn numa_node(mut self, node: i64) -> Self {
        if !self.numa_nodes.contains(&node) {
            self.numa_nodes.push(node);
        }
        self
    }

    /// Adds a typed fact: text (`&str`, `String`), an integer (`i64`) or a boolean; see
    /// [`Device::version_attribute`] for versions. Names are C identifiers of at most 32
    /// characters, optionally after a DNS domain and `/` (`vendor.com/model`), as Dynamic
    /// Resource Allocation publishes them.
    ///
    /// Two text attributes the host reads: `pci-address` (`0000:3b:00.0`) and `dev`
    /// (`<major>:<minor>` of the device's character device node). A device with no
    /// [`Device::numa_node`] gets the NUMA node sysfs gives for either, so the kubelet can align
    /// it without the module reading topology itself.
    pub fn attribute(mut self, name: impl Into<String>, value: impl Into<AttributeValue>) -> Self {
        self.attributes.push(Attribute {
            name: name.into(),
            value: value.into(),
        });
        self
    }

    /// The value of the text attribute `name`, if the device has one (for tests; see also
    /// [`int`](Self::int), [`boolean`](Self::boolean), [`version`](Self::version),
    /// [`capacity_of`](Self::capacity_of) and [`value`](Self::value)).
    pub fn text(&self, name: &str) -> Option<&str> {
        match self.value(name)? {
            AttributeValue::Text(t) => Some(t.as_str()),
            _ => None,
        }
    }

    /// The attribute `name`, whatever its type.
    pub fn value(&self, name: &str) -> Option<&AttributeValue> {
        self.attributes
            .iter()
            .find(|a| a.name == name)
            .map(|a| &a.value)
    }

    /// The integer attribute `name`.
    pub fn int(&self, name: &str) -> Option<i64> {
        match self.value(name)? {
            AttributeValue::Int(i) => Some(*i),
            _ => None,
        }
    }

    /// The boolean attribute `name`.
    pub fn boolean(&self, name: &str) -> Option<bool> {
        match self.value(name)? {
            AttributeValue::Boolean(b) => Some(*b),
            _ => None,
        }
    }

    /// The version attribute `name` (`1.2.3`).
    pub fn version(&self, name: &str) -> Option<&str> {
        match self.value(name)? {
            AttributeValue::Version(v) => Some(v.as_str()),
            _ => None,
        }
    }

    /// The quantity of the capacity `name` (`80Gi`).
    pub fn capacity_of(&self, name: &str) -> Option<&str> {
        self.capacities
            .iter()
            .find(|c| c.name == name)
            .map(|c| c.value.as_str())
    }

    /// Adds a semantic-version fact (`1.2.3`, no leading `v`).
    pub fn version_attribute(
        mut self,
        name: impl Into<String>,
        version: impl Into<String>,
    ) -> Self {
        self.attributes.push(Attribute {
            name: name.into(),
            value: AttributeValue::Version(version.into()),
        });
        self
    }

    /// Adds an amount the device has, as a Kubernetes quantity (`80Gi`, `4`).
    pub fn capacity(mut self, name: impl Into<String>, quantity: impl Into<String>) -> Self {
        self.capacities.push(Capacity {
            name: name.into(),
            value: quantity.into(),
            request_policy: None,
        });
        self
    }

    /// Adds a capacity that claims of a device [shared by capacity](Device::shared_by_capacity)
    /// hold parts of, by `policy`: what a claim holds when it asks nothing, and the amounts
    /// what it asks is rounded up to.
    pub fn shared_capacity(
        mut self,
        name: impl Into<String>,
        quantity: impl Into<String>,
        policy: RequestPolicy,
    ) -> Self {
        self.capacities.push(Capacity {
            name: name.into(),
            value: quantity.into(),
            request_policy: Some(policy),
        });
        self
    }

    /// Lets several Dynamic Resource Allocation claims hold the device at once, each a part of
    /// its capacities (its [`shared_capacity`](Device::shared_capacity) by their policies, any
    /// other capacity as the claim asks); the scheduler and the agent keep the count. Not with
    /// [`exclusive`](Device::exclusive) or [`group`](Device::group).
    pub fn shared_by_capacity(mut self) -> Self {
        self.shared_by_capacity = true;
        self
    }

    /// What the device takes from one of the resource's [counter sets](Plugin::counter_sets)
    /// while allocated: a MIG partition's memory and compute slices of its GPU. At most two
    /// sets.
    pub fn consumes(mut self, counter_set: impl Into<String>, counters: &[(&str, &str)]) -> Self {
        self.consumes.push(CounterUse {
            counter_set: counter_set.into(),
            counters: amounts(counters),
        });
        self
    }

    /// Adds a taint of the module's own (at most three; keys outside `devicelet.io/`): the
    /// device stays offered, but Dynamic Resource Allocation gives it only to claims that
    /// tolerate the taint (and with [`TaintEffect::NoExecute`], evicts the pods of those that
    /// hold it and do not).
    pub fn taint(
        mut self,
        key: impl Into<String>,
        value: impl Into<String>,
        effect: TaintEffect,
    ) -> Self {
        self.taints.push(Taint {
            key: key.into(),
            value: value.into(),
            effect,
        });
        self
    }

    /// Puts the device in a group: devices of one resource in the same group are allocated
    /// together or not at all (the functions of one IOMMU group). The host's preferred
    /// allocation keeps groups whole, it refuses a request that splits one before calling the
    /// module (and never asks for one member's answer ahead of time), and it refuses a sharing
    /// rule that would replicate a grouped device.
    pub fn group(mut self, group: impl Into<String>) -> Self {
        self.group = Some(group.into());
        self
    }

    /// Marks the device as never shared: the agent refuses a `[module.sharing]` rule that
    /// would advertise it more than once, and serves no device of that resource until the rule
    /// goes.
    pub fn exclusive(mut self) -> Self {
        self.exclusive = true;
        self
    }

    /// What a container needs for this device alone. When every device of a request has them,
    /// the host answers the request with their union (and names them in CDI specs) without
    /// calling [`Plugin::allocate`].
    pub fn edits(mut self, edits: ContainerEdits) -> Self {
        self.edits = Some(edits);
        self
    }
}

fn amounts(pairs: &[(&str, &str)]) -> Vec<Amount> {
    pairs
        .iter()
        .map(|(name, value)| Amount {
            name: (*name).to_owned(),
            value: (*value).to_owned(),
        })
        .collect()
}

impl CounterSet {
    /// A counter set named `name` (a DNS label, unique in the resource), with its counters
    /// (DNS labels, Kubernetes quantities; at most 32).
    pub fn new(name: impl Into<String>, counters: &[(&str, &str)]) -> Self {
        CounterSet {
            name: name.into(),
            counters: amounts(counters),
        }
    }
}

impl RequestPolicy {
    /// Any amount; a claim that asks nothing holds `default` (None: the whole capacity).
    pub fn any(default: Option<&str>) -> Self {
        RequestPolicy {
            default: default.map(str::to_owned),
            valid: ValidAmounts::Any,
        }
    }

    /// `min`, then every `step` above it, up to `max`; a claim that asks nothing holds
    /// `default`.
    pub fn range(default: &str, min: &str, step: Option<&str>, max: Option<&str>) -> Self {
        RequestPolicy {
            default: Some(default.to_owned()),
            valid: ValidAmounts::Range(AmountRange {
                min: min.to_owned(),
                max: max.map(str::to_owned),
                step: step.map(str::to_owned),
            }),
        }
    }
}

impl Request {
    /// What this request holds of device `id`'s capacity `name`, when the device is shared by
    /// capacity.
    pub fn consumed(&self, id: &str, name: &str) -> Option<&str> {
        self.shares
            .iter()
            .find(|s| s.id == id)?
            .consumed
            .iter()
            .find(|a| a.name == name)
            .map(|a| a.value.as_str())
    }
}

impl From<&str> for AttributeValue {
    fn from(text: &str) -> Self {
        AttributeValue::Text(text.to_owned())
    }
}

impl From<String> for AttributeValue {
    fn from(text: String) -> Self {
        AttributeValue::Text(text)
    }
}

impl From<i64> for AttributeValue {
    fn from(n: i64) -> Self {
        AttributeValue::Int(n)
    }
}

impl From<bool> for AttributeValue {
    fn from(b: bool) -> Self {
        AttributeValue::Boolean(b)
    }
}

impl ResourceInfo {
    /// A resource that needs neither prestart nor preferred-allocation calls.
    ///
    /// `name` is a suffix the host prefixes with the registry's resource domain (`fuse`), or a
    /// full extended resource name (`vendor.com/fuse`).
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            prestart: false,
            preferred_allocation: false,
            one_share_per_container: false,
            prepares_claims: false,
        }
    }

    /// A container never gets two shares of one device: under a registry sharing rule the
    /// agent refuses an Allocate naming two replicas of one device, before calling the module
    /// (MPS: one client per GPU per container).
    pub fn with_one_share_per_container(mut self, one: bool) -> Self {
        self.one_share_per_container = one;
        self
    }

    /// Dynamic Resource Allocation claims of the resource are prepared by [`Plugin::prepare`]
    /// and undone by [`Plugin::unprepare`], which the agent guarantees even across its
    /// restarts; otherwise by `allocate` and `release`.
    pub fn with_prepares_claims(mut self, prepares: bool) -> Self {
        self.prepares_claims = prepares;
        self
    }

    /// Asks the kubelet to call [`Plugin::prestart`] before each container using the resource.
    pub fn with_prestart(mut self, prestart: bool) -> Self {
        self.prestart = prestart;
        self
    }

    /// Asks the kubelet to call [`Plugin::preferred`] before each allocation (without it, the
    /// host answers the kubelet's call with its own NUMA-aware policy).
    pub fn with_preferred_allocation(mut self, preferred: bool) -> Self {
        self.preferred_allocation = preferred;
        self
    }
}

impl ContainerEdits {
    /// Sets an environment variable in the container.
    pub fn env(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.envs.push((key.into(), value.into()));
        self
    }

    /// Makes a device node available in the container; `permissions` is any combination of
    /// `r`, `w` and `m` (mknod).
    pub fn device(
        mut self,
        host_path: impl Into<String>,
        container_path: impl Into<String>,
        permissions: impl Into<String>,
    ) -> Self {
        self.devices.push(DeviceNode {
            host_path: host_path.into(),
            container_path: container_path.into(),
            permissions: permissions.into(),
        });
        self
    }

    /// Makes each of `nodes` available in the container at the same path, with `permissions`.
    pub fn nodes<S: Into<String>>(
        mut self,
        nodes: impl IntoIterator<Item = S>,
        permissions: &str,
    ) -> Self {
        for node in nodes {
            let node = node.into();
            self = self.device(node.clone(), node, permissions);
        }
        self
    }

    /// Bind-mounts a host path into the container.
    pub fn mount(
        mut self,
        host_path: impl Into<String>,
        container_path: impl Into<String>,
        read_only: bool,
    ) -> Self {
        self.mounts.push(Mount {
            host_path: host_path.into(),
            container_path: container_path.into(),
            read_only,
        });
        self
    }

    /// Adds an annotation to the container, for runtimes and hooks that key on them.
    pub fn annotation(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.annotations.push((key.into(), value.into()));
        self
    }

    /// Names a fully qualified CDI device (`vendor.com/class=name`) for the runtime to inject:
    /// for a module whose devices already have CDI specs (written by the vendor's own tooling).
    /// The host passes these on as they are, whatever the registry's `device-list-strategy`;
    /// it writes specs for the other edits itself when that strategy asks for CDI.
    pub fn cdi(mut self, name: impl Into<String>) -> Self {
        self.cdi_devices.push(name.into());
        self
    }
}

impl NodeInfo {
    /// Whether the node is a character or block device, i.e. something a container can be
    /// given through the device cgroup.
    pub fn is_device(&self) -> bool {
        matches!(self.kind, NodeKind::Character | NodeKind::Block)
    }
}

impl From<FsError> for PluginError {
    /// Lets `?` turn a file-system failure into a generic failure; prefer mapping it yourself
    /// when the path matters to whoever reads the error.
    fn from(err: FsError) -> Self {
        PluginError::Failed(fs_error_message(&err))
    }
}

fn fs_error_message(err: &FsError) -> String {
    match err {
        FsError::NotFound => "not found".to_string(),
        FsError::Denied(why) => format!("denied: {why}"),
        FsError::Io(why) => format!("I/O error: {why}"),
    }
}

/// Log lines that the host turns into tracing events tagged with the module's name.
///
/// The `log` interface is always granted. The macros [`trace!`], [`debug!`], [`info!`],
/// [`warn!`] and [`error!`] take `format!` arguments.
pub mod log {
    pub use crate::bindings::devicelet::plugin::log::Level;

    /// Sends one line at the given level; the host decides whether it is shown.
    pub fn log(level: Level, message: &str) {
        #[cfg(target_arch = "wasm32")]
        crate::bindings::devicelet::plugin::log::log(level, message);
        #[cfg(not(target_arch = "wasm32"))]
        crate::testing::log(level, message);
    }

    /// Logs at trace level.
    pub fn trace(message: &str) {
        log(Level::Trace, message);
    }

    /// Logs at debug level.
    pub fn debug(message: &str) {
        log(Level::Debug, message);
    }

    /// Logs at info level.
    pub fn info(message: &str) {
        log(Level::Info, message);
    }

    /// Logs at warn level.
    pub fn warn(message: &str) {
        log(Level::Warn, message);
    }

    /// Logs at error level.
    pub fn error(message: &str) {
        log(Level::Error, message);
    }
}

/// Asking the host to enumerate again sooner than the registry's `health-interval` (WIT 0.1.2).
///
/// Always granted. Call [`recheck_after`](schedule::recheck_after) from `enumerate` when you know
/// a device's health changes at a given time (a quiet period after an error ends): the host
/// enumerates the resource again by then, instead of at the next interval. Only calls made during
/// `enumerate` count, the shortest wins, and the host never waits longer than the interval anyway.
pub mod schedule {
    use std::time::Duration;

    /// Asks for the resource being enumerated to be enumerated again within `after` (at least
    /// 10 ms).
    pub fn recheck_after(after: Duration) {
        let ms = u64::try_from(after.as_millis()).unwrap_or(u64::MAX);
        #[cfg(target_arch = "wasm32")]
        crate::bindings::devicelet::plugin::schedule::recheck_after(ms);
        #[cfg(not(target_arch = "wasm32"))]
        crate::testing::recheck_after(Duration::from_millis(ms));
    }
}

/// Logs a `format!`-style message at trace level through the host.
#[macro_export]
macro_rules! trace {
    ($($arg:tt)*) => { $crate::log::log($crate::log::Level::Trace, &::std::format!($($arg)*)) };
}

/// Logs a `format!`-style message at debug level through the host.
#[macro_export]
macro_rules! debug {
    ($($arg:tt)*) => { $crate::log::log($crate::log::Level::Debug, &::std::format!($($arg)*)) };
}

/// Logs a `format!`-style message at info level through the host.
#[macro_export]
macro_rules! info {
    ($($arg:tt)*) => { $crate::log::log($crate::log::Level::Info, &::std::format!($($arg)*)) };
}

/// Logs a `format!`-style message at warn level through the host.
#[macro_export]
macro_rules! warn {
    ($($arg:tt)*) => { $crate::log::log($crate::log::Level::Warn, &::std::format!($($arg)*)) };
}

/// Logs a `format!`-style message at error level through the host.
#[macro_export]
macro_rules! error {
    ($($arg:tt)*) => { $crate::log::log($crate::log::Level::Error, &::std::format!($($arg)*)) };
}

/// Read access to the sysfs paths the registry grants the module.
///
/// Paths are absolute (`/sys/bus/pci/devices/...`); the host resolves them inside the granted
/// root and refuses anything else with [`FsError::Denied`]. Using any function here makes the
/// component import the `sysfs` interface, which then needs a sysfs grant in the registry.
pub mod sysfs {
    use crate::FsError;

    /// The agent's `sysfs` interface in a component; the test kit's fake host elsewhere.
    mod host {
        #[cfg(target_arch = "wasm32")]
        pub use crate::bindings::devicelet::plugin::sysfs::{list, read, read_link};

        #[cfg(not(target_arch = "wasm32"))]
        pub fn read(path: &str) -> Result<Vec<u8>, crate::FsError> {
            crate::testing::current(|h| h.sysfs_read(path))
        }

        #[cfg(not(target_arch = "wasm32"))]
        pub fn list(path: &str) -> Result<Vec<String>, crate::FsError> {
            crate::testing::current(|h| h.sysfs_list(path))
        }

        #[cfg(not(target_arch = "wasm32"))]
        pub fn read_link(path: &str) -> Result<String, crate::FsError> {
            crate::testing::current(|h| h.sysfs_read_link(path))
        }
    }

    /// The file's raw contents (capped in size by the host).
    pub fn read(path: &str) -> Result<Vec<u8>, FsError> {
        host::read(path)
    }

    /// The file's contents as text with surrounding whitespace trimmed, which is how sysfs
    /// attributes (`0x10de\n`) are meant to be read.
    ///
    /// Contents that are not UTF-8 give [`FsError::Io`].
    pub fn read_to_string(path: &str) -> Result<String, FsError> {
        let bytes = host::read(path)?;
        match String::from_utf8(bytes) {
            Ok(text) => Ok(text.trim().to_string()),
            Err(_) => Err(FsError::Io(format!("{path}: contents are not UTF-8"))),
        }
    }

    /// A numeric attribute, decimal or `0x` hexadecimal (`numa_node` holds `-1`, `vendor`
    /// holds `0x1002`); unparsable contents give [`FsError::Io`].
    pub fn read_i64(path: &str) -> Result<i64, FsError> {
        let text = read_to_string(path)?;
        let (negative, digits) = match text.strip_prefix('-') {
            Some(rest) => (true, rest),
            None => (false, text.as_str()),
        };
        let parsed = match digits
            .strip_prefix("0x")
            .or_else(|| digits.strip_prefix("0X"))
        {
            Some(hex) => i64::from_str_radix(hex, 16),
            None => digits.parse::<i64>(),
        };
        match parsed {
            Ok(value) if negative => Ok(-value),
            Ok(value) => Ok(value),
            Err(_) => Err(FsError::Io(format!("{path}: {text:?} is not a number"))),
        }
    }

    /// Entry names of a directory, sorted.
    pub fn list(path: &str) -> Result<Vec<String>, FsError> {
        host::list(path)
    }

    /// The target of a symbolic link as stored (often relative, e.g. `../../../0000:01:00.0`);
    /// sysfs encodes relationships such as a device's driver or IOMMU group this way.
    pub fn read_link(path: &str) -> Result<String, FsError> {
        host::read_link(path)
    }
}

/// Discovery of the device nodes under /dev the registry grants the module.
///
/// Using any function here makes the component import the `devnodes` interface, which then
/// needs a /dev grant in the registry.
pub mod devnodes {
    use crate::{FsError, NodeInfo};

    /// The agent's `devnodes` interface in a component; the test kit's fake host elsewhere.
    mod host {
        #[cfg(target_arch = "wasm32")]
        pub use crate::bindings::devicelet::plugin::devnodes::{glob, stat};

        #[cfg(not(target_arch = "wasm32"))]
        pub fn glob(pattern: &str) -> Result<Vec<String>, crate::FsError> {
            crate::testing::current(|h| h.dev_glob(pattern))
        }

        #[cfg(not(target_arch = "wasm32"))]
        pub fn stat(path: &str) -> Result<crate::NodeInfo, crate::FsError> {
            crate::testing::current(|h| h.dev_stat(path))
        }
    }

    /// Granted paths matching the pattern (`*`, `?`, `[...]`), sorted. A pattern that matches
    /// nothing gives an empty list, not an error.
    pub fn glob(pattern: &str) -> Result<Vec<String>, FsError> {
        host::glob(pattern)
    }

    /// Kind, major/minor numbers and permission bits of a node.
    pub fn stat(path: &str) -> Result<NodeInfo, FsError> {
        host::stat(path)
    }

    /// Whether a granted device node exists at `path`.
    pub fn exists(path: &str) -> bool {
        host::stat(path).is_ok()
    }
}

thread_local! {
    /// The instance [`Plugin::init`] created. A component instance is single-threaded and the
    /// host never re-enters it, so a thread-local cell is all the synchronisation needed.
    static INSTANCE: RefCell<Option<Box<dyn ErasedPlugin>>> = const { RefCell::new(None) };
}

/// The object-safe part of [`Plugin`], so the instance can live in one non-generic static.
trait ErasedPlugin {
    fn enumerate(&mut self, resource: &str) -> Result<Vec<Device>, PluginError>;
    fn counter_sets(&mut self, resource: &str) -> Result<Vec<CounterSet>, PluginError>;
    fn allocate_request(&mut self, request: &Request) -> Result<ContainerEdits, PluginError>;
    fn prepare(&mut self, request: &Request) -> Result<Prepared, PluginError>;
    fn unprepare(&mut self, request: &Request) -> Result<(), PluginError>;
    fn validate_config(&mut self, resource: &str, config: &str) -> Result<(), PluginError>;
    fn release(&mut self, resource: &str, ids: &[String], config: &str) -> Result<(), PluginError>;
    fn prestart(&mut self, resource: &str, ids: &[String]) -> Result<(), PluginError>;
    fn preferred(
        &mut self,
        resource: &str,
        available: &[String],
        must_include: &[String],
        size: usize,
    ) -> Result<Vec<String>, PluginError>;
}

impl<P: Plugin> ErasedPlugin for P {
    fn enumerate(&mut self, resource: &str) -> Result<Vec<Device>, PluginError> {
        Plugin::enumerate(self, resource)
    }
    fn counter_sets(&mut self, resource: &str) -> Result<Vec<CounterSet>, PluginError> {
        Plugin::counter_sets(self, resource)
    }
    fn allocate_request(&mut self, request: &Request) -> Result<ContainerEdits, PluginError> {
        Plugin::allocate_request(self, request)
    }
    fn prepare(&mut self, request: &Request) -> Result<Prepared, PluginError> {
        Plugin::prepare(self, request)
    }
    fn unprepare(&mut self, request: &Request) -> Result<(), PluginError> {
        Plugin::unprepare(self, request)
    }
    fn validate_config(&mut self, resource: &str, config: &str) -> Result<(), PluginError> {
        Plugin::validate_config(self, resource, config)
    }
    fn release(&mut self, resource: &str, ids: &[String], config: &str) -> Result<(), PluginError> {
        Plugin::release(self, resource, ids, config)
    }
    fn prestart(&mut self, resource: &str, ids: &[String]) -> Result<(), PluginError> {
        Plugin::prestart(self, resource, ids)
    }
    fn preferred(
        &mut self,
        resource: &str,
        available: &[String],
        must_include: &[String],
        size: usize,
    ) -> Result<Vec<String>, PluginError> {
        Plugin::preferred(self, resource, available, must_include, size)
    }
}

fn with_instance<T>(
    f: impl FnOnce(&mut dyn ErasedPlugin) -> Result<T, PluginError>,
) -> Result<T, PluginError> {
    INSTANCE.with(|cell| match cell.try_borrow_mut() {
        Ok(mut slot) => match slot.as_mut() {
            Some(plugin) => f(plugin.as_mut()),
            None => Err(PluginError::Failed("not initialised".to_string())),
        },
        Err(_) => Err(PluginError::Failed("plugin re-entered".to_string())),
    })
}

/// What the agent told this instance at `init`, beyond the config: the registry's resource
/// domain and the full names the module's resources are served under (WIT 0.2).
///
/// Call these from [`Plugin::init`] or later. The agent learns the names from the module's
/// first `init` (the resources it declares), so that first instance sees none; every instance
/// that answers a call sees them all. The test kit does the same.
pub mod context {
    use std::cell::RefCell;

    thread_local! {
        static CONTEXT: RefCell<(String, Vec<(String, String)>)> =
            const { RefCell::new((String::new(), Vec::new())) };
    }

    /// Records what `init` was told (the export adapter and the test kit call it).
    #[doc(hidden)]
    pub fn set(resource_domain: &str, served_as: Vec<(String, String)>) {
        CONTEXT.with(|c| *c.borrow_mut() = (resource_domain.to_owned(), served_as));
    }

    /// The registry's resource domain for this module (`devicelet.io` unless set): what a
    /// resource name without a `/` is prefixed with.
    pub fn resource_domain() -> String {
        CONTEXT.with(|c| c.borrow().0.clone())
    }

    /// Whether the agent told this instance no served names: it is the first instance of this
    /// load of the module, whose `init` tells the agent what the module serves. The agent then
    /// makes the instances that answer calls (one for `enumerate`, one for the kubelet's
    /// calls, one for `preferred` when a resource asks for it, a new one after a trap), each
    /// running `init` again, so what is worth doing once per load, such as logging what the
    /// module serves, belongs behind this. (A module none of whose declared resources has a
    /// valid name in its resource domain is told no names in any instance.)
    pub fn first_instance() -> bool {
        CONTEXT.with(|c| c.borrow().1.is_empty())
    }

    /// The full name the resource the module declared as `declared` is served under
    /// (`vendor.com/vf`, or `vendor.com/gpu.shared` when the registry shares and renames it);
    /// None before the agent knows it, or when it serves no such resource.
    pub fn served_as(declared: &str) -> Option<String> {
        CONTEXT.with(|c| {
            c.borrow()
                .1
                .iter()
                .find(|(d, _)| d == declared)
                .map(|(_, s)| s.clone())
        })
    }
}

/// Implementation details used by [`export_plugin!`]; not part of the API.
#[doc(hidden)]
pub mod __private {
    pub use wit_bindgen;

    use super::*;
    use bindings::exports::devicelet::plugin::claims::Guest as ClaimsGuest;
    use bindings::exports::devicelet::plugin::config::Guest as ConfigGuest;
    use bindings::exports::devicelet::plugin::release::Guest as ReleaseGuest;
    use wit_types::{InitContext, Inventory, ModuleInfo, PluginError as WitError};

    /// The module crate's version, as `export_plugin!` reads it from the crate's manifest.
    pub trait Version {
        const VERSION: &'static str;
    }

    /// Binds the WIT exports to a [`Plugin`] type; the export macro names it through a type
    /// alias because the generated macro only accepts an identifier.
    pub struct Adapter<P, V>(std::marker::PhantomData<(P, V)>);

    impl<P: Plugin, V: Version> Guest for Adapter<P, V> {
        fn init(context: InitContext) -> Result<ModuleInfo, WitError> {
            // Drop any previous instance first so a failed re-init leaves "not initialised"
            // rather than a stale plugin configured from an older config.
            let cleared = INSTANCE.with(|cell| match cell.try_borrow_mut() {
                Ok(mut slot) => {
                    *slot = None;
                    true
                }
                Err(_) => false,
            });
            if !cleared {
                return Err(PluginError::Failed("plugin re-entered".to_string()).into());
            }
            crate::context::set(&context.resource_domain, context.served_as);
            let (plugin, resources) = P::init(&context.config).map_err(WitError::from)?;
            INSTANCE.with(|cell| match cell.try_borrow_mut() {
                Ok(mut slot) => {
                    *slot = Some(Box::new(plugin));
                    Ok(ModuleInfo {
                        version: V::VERSION.to_owned(),
                        resources,
                    })
                }
                Err(_) => Err(PluginError::Failed("plugin re-entered".to_string()).into()),
            })
        }

        fn enumerate(resource_name: String) -> Result<Inventory, WitError> {
            with_instance(|p| {
                Ok(Inventory {
                    devices: p.enumerate(&resource_name)?,
                    counter_sets: p.counter_sets(&resource_name)?,
                })
            })
            .map_err(WitError::from)
        }

        fn allocate(request: Request) -> Result<ContainerEdits, WitError> {
            with_instance(|p| p.allocate_request(&request)).map_err(WitError::from)
        }

        fn prestart(resource_name: String, ids: Vec<String>) -> Result<(), WitError> {
            with_instance(|p| p.prestart(&resource_name, &ids)).map_err(WitError::from)
        }

        fn preferred(
            resource_name: String,
            available: Vec<String>,
            must_include: Vec<String>,
            size: u32,
        ) -> Result<Vec<String>, WitError> {
            let size = usize::try_from(size).unwrap_or(usize::MAX);
            with_instance(|p| p.preferred(&resource_name, &available, &must_include, size))
                .map_err(WitError::from)
        }
    }

    impl<P: Plugin, V: Version> ReleaseGuest for Adapter<P, V> {
        fn release(request: Request) -> Result<(), WitError> {
            with_instance(|p| p.release(&request.resource_name, &request.ids, &request.config))
                .map_err(WitError::from)
        }
    }

    impl<P: Plugin, V: Version> ClaimsGuest for Adapter<P, V> {
        fn prepare(request: Request) -> Result<Prepared, WitError> {
            with_instance(|p| p.prepare(&request)).map_err(WitError::from)
        }

        fn unprepare(request: Request) -> Result<(), WitError> {
            with_instance(|p| p.unprepare(&request)).map_err(WitError::from)
        }
    }

    impl<P: Plugin, V: Version> ConfigGuest for Adapter<P, V> {
        fn validate_config(resource_name: String, config: String) -> Result<(), WitError> {
            with_instance(|p| p.validate_config(&resource_name, &config)).map_err(WitError::from)
        }
    }
}

/// Exports a [`Plugin`] implementation as the module's `devicelet:plugin/plugin` interface.
///
/// Invoke it once, at the top level of the module's crate:
///
/// ```ignore
/// devicelet_sdk::export_plugin!(MyPlugin);
/// ```
///
/// It exports only when building the component (`wasm32`). On the host target it only checks
/// that the type implements [`Plugin`], so `cargo test` in the module's crate links and runs
/// its tests against [`testing::FakeHost`].
#[macro_export]
macro_rules! export_plugin {
    ($plugin:ty) => {
        #[cfg(target_arch = "wasm32")]
        const _: () = {
            struct __DeviceletModuleVersion;
            impl $crate::__private::Version for __DeviceletModuleVersion {
                const VERSION: &'static str = ::core::env!("CARGO_PKG_VERSION");
            }
            type __DeviceletPluginExport =
                $crate::__private::Adapter<$plugin, __DeviceletModuleVersion>;
            $crate::__export_device_plugin_full_impl!(
                __DeviceletPluginExport with_types_in $crate::bindings
            );
        };
        #[cfg(not(target_arch = "wasm32"))]
        const _: fn() = || {
            fn implements_plugin<P: $crate::Plugin>() {}
            implements_plugin::<$plugin>();
        };
    };
}

pub mod mig;
pub mod nvml;
pub mod pci;
#[cfg(not(target_arch = "wasm32"))]
pub mod testing;

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn default_preferred_puts_must_include_first() {
        let got = default_preferred(&ids(&["a", "b", "c", "d"]), &ids(&["c"]), 3);
        assert_eq!(got, ids(&["c", "a", "b"]));
    }

    #[test]
    fn default_preferred_obeys_every_host_rule() {
        // Never more than `size`, even when must-include alone is more.
        let got = default_preferred(&ids(&["a", "b"]), &ids(&["a", "b"]), 1);
        assert_eq!(got, ids(&["a"]));
        // Only offered IDs, none twice.
        let got = default_preferred(&ids(&["a", "b", "a"]), &ids(&["x", "b", "b"]), 3);
        assert_eq!(got, ids(&["b", "a"]));
        assert!(default_preferred(&ids(&["a"]), &[], 0).is_empty());
    }

    #[test]
    fn a_device_s_facts_read_back_by_their_type() {
        let d = Device::healthy("gpu-0")
            .attribute("model", "MI300X")
            .attribute("cores", 304i64)
            .attribute("mig", true)
            .version_attribute("firmware", "1.2.3")
            .capacity("memory", "192Gi");
        assert_eq!(d.text("model"), Some("MI300X"));
        assert_eq!(d.int("cores"), Some(304));
        assert_eq!(d.boolean("mig"), Some(true));
        assert_eq!(d.version("firmware"), Some("1.2.3"));
        assert_eq!(d.capacity_of("memory"), Some("192Gi"));
        // The wrong type, or no such fact: None.
        assert_eq!(
            (d.int("model"), d.text("cores"), d.capacity_of("model")),
            (None, None, None)
        );
        assert!(matches!(d.value("cores"), Some(AttributeValue::Int(304))));
    }

    #[test]
    fn plugin_errors_read_as_messages() {
        assert_eq!(
            PluginError::InvalidConfig("unknown key `pathz`".into()).to_string(),
            "invalid config: unknown key `pathz`"
        );
        assert_eq!(PluginError::Failed("no GPU".into()).to_string(), "no GPU");
        assert_eq!(
            PluginError::from(FsError::Denied("not granted".into())).to_string(),
            "denied: not granted"
        );
        let boxed: Box<dyn std::error::Error> = Box::new(PluginError::UnknownDevice("x".into()));
        assert_eq!(boxed.to_string(), "unknown device: x");
    }
}
