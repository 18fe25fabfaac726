//! The seam between the agent and its front ends: every API a module's resources can be served
//! through (the kubelet's device-plugin API, Dynamic Resource Allocation) is one [`FrontEnd`]
//! to the agent. A running module holds its front ends in one list, and starting, upgrading in
//! place, stopping, readiness, liveness and the names it takes all go through this trait; what a
//! front end does with the kubelet (sockets, registration, wire types) stays in its own folder
//! (`kubelet/`, `dra/`), reached from the adapter here. [`kind_of`] is the one place a module's
//! front end is chosen (`start`, `run` and `validate` ask it): a third front end is its folder,
//! an adapter file here and one line there.

pub mod device_plugin;
pub mod dra;

use std::any::Any;
use std::collections::BTreeMap;
use std::future::Future;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;

use tokio::sync::Notify;

use crate::config::ModuleSpec;
use crate::device::ResourceInfo;
use crate::dra::driver::DraOptions;
use crate::kubelet::resource::Serving;
use crate::sandbox::slot::ModuleSlot;

/// A future a front end hands back.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// What starting or upgrading a module's front end works with.
pub struct Context<'a> {
    /// The module version answering (after an in-place upgrade's swap: the new one).
    pub slot: &'a ModuleSlot,
    /// The module's registry entry (the new one, for an upgrade).
    pub spec: &'a ModuleSpec,
    pub host_root: &'a Path,
    /// The resources to serve, under their served names (`modules::plan`).
    pub planned: &'a [(String, ResourceInfo)],
    /// Names other modules serve, with the module serving each.
    pub taken: &'a BTreeMap<String, String>,
    pub at: &'a Serving<'a>,
    pub dra: Option<&'a DraOptions>,
}

/// How a front end is stopped.
pub enum Stop<'a> {
    /// The agent stops: everything stays for the next agent (registrations aside).
    Shutdown,
    /// The module left the registry: what it published goes too.
    Removed,
    /// The module starts again on a new version that `next` describes (it moved between front
    /// ends, or changed what this front end was started with).
    Restart(&'a Context<'a>),
}

/// One API through which a module's resources reach the kubelet, as the agent sees it.
pub trait FrontEnd: Send + Sync {
    /// For the queries particular to one front end (its status section, its metrics).
    fn as_any(&self) -> &dyn Any;

    /// The resources it serves, by served name (`vendor.com/gpu`).
    fn resources(&self) -> Vec<String>;

    /// The names it serves under, and keys of its own kind (a DRA driver's name): no other
    /// module may take them.
    fn names(&self) -> Vec<String>;

    /// What wakes its device watchers (a device node appeared, NVML reported an event).
    fn pokes(&self) -> Vec<Arc<Notify>>;

    /// Tasks of it that ended though nothing stopped them, one line each, naming `module`.
    fn ended(&self, module: &str) -> Vec<String>;

    /// Why it is not ready yet (not registered with the kubelet), one line each.
    fn not_ready(&self, module: &str) -> Vec<String>;

    /// Whether it takes the module's new version in place: the registry still chooses it, and
    /// nothing it was started with changed beyond what it can follow.
    fn keeps(&self, old: &ModuleSpec, cx: &Context<'_>) -> bool;

    /// First step of an in-place upgrade, while the old version still answers: stops what the
    /// new version no longer serves (or serves otherwise).
    fn stop_gone<'a>(&'a mut self, old: &'a ModuleSpec, cx: &'a Context<'a>) -> BoxFuture<'a, ()>;

    /// Second step, once the new version answers: what it kept looks again, what is new is
    /// served. Returns the problems, each naming the module.
    fn resume<'a>(&'a mut self, cx: &'a Context<'a>) -> BoxFuture<'a, Vec<String>>;

    /// Adds what it serves to the agent's status (its own section), with holders from `ledger`.
    fn status(&self, module: &str, ledger: &crate::ledger::Ledger, out: &mut super::status::Status);

    /// Stops serving.
    fn stop<'a>(self: Box<Self>, how: Stop<'a>, slot: &'a ModuleSlot) -> BoxFuture<'a, ()>;
}

/// A way of serving modules; [`kind_of`] picks the one the registry names.
pub trait FrontEndKind: Send + Sync {
    /// Serves `cx.planned`; the problems name the module.
    fn start<'a>(&'a self, cx: &'a Context<'a>) -> BoxFuture<'a, (Box<dyn FrontEnd>, Vec<String>)>;

    /// How each of `planned` would be served, one line each, or why it would not be (what
    /// `validate` prints before a resource's devices).
    fn describe(
        &self,
        spec: &ModuleSpec,
        planned: &[(String, ResourceInfo)],
    ) -> Vec<Result<String, String>>;

    /// Whether it needs the API server (`run` connects to one only then, and fails to start
    /// when it cannot).
    fn needs_api_server(&self) -> bool;

    /// Whether a module's answer for a device is asked before anyone requests it (the device
    /// plugin's answers prepared ahead, its CDI spec): `validate` then asks for each device's
    /// answer and checks the CDI names in it. DRA asks at prepare time, with the claim's config.
    fn answers_ahead(&self) -> bool;
}

/// The front end the registry names for `spec`: the one place a front end is chosen.
pub fn kind_of(spec: &ModuleSpec) -> &'static dyn FrontEndKind {
    match &spec.front_end {
        crate::config::FrontEnd::DevicePlugin => &device_plugin::DevicePlugin,
        crate::config::FrontEnd::Dra { .. } => &dra::Dra,
    }
}

/// Starts the front end that serves `cx.spec`: the registry's `front-end`, unless the agent was
/// given a front end of its own for every module (`AgentOptions::front_end`: an embedder's, or a
/// test's).
pub async fn start(
    cx: &Context<'_>,
    custom: Option<&Arc<dyn FrontEndKind>>,
) -> (Box<dyn FrontEnd>, Vec<String>) {
    match custom {
        Some(kind) => kind.start(cx).await,
        None => kind_of(cx.spec).start(cx).await,
    }
}
