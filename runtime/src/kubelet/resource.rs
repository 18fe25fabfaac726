//! Serving one resource through the device-plugin API: its core (`resource::core`: devices,
//! prepared answers, CDI spec), then its gRPC server and its lifecycle with the kubelet.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use tokio::sync::{Notify, watch};
use tokio::task::JoinHandle;

use super::api::deviceplugin::DevicePluginOptions;
use super::lifecycle::Lifecycle;
use super::names;
use super::plugin_server::{ResourcePlugin, Watches};
use super::route::{RegistrationState, Route};
use crate::cdi::{self, DeviceListStrategy};
use crate::config::ShareRule;
use crate::device::ResourceInfo;
use crate::ledger::Ledger;
use crate::policy::{AllocationPolicy, Preferred};
use crate::resource::backend::{DeviceBackend, Upkeep};
pub use crate::resource::core::CdiServed;
use crate::resource::core::{self, CdiSpec, CoreSpec};
use crate::resource::prepared::Prepared;
use crate::resource::snapshot::Snapshot;

/// A resource the agent serves, as others (status, tests) may observe it.
#[derive(Debug, Clone)]
pub struct ServedResource {
    /// The extended resource name the kubelet knows (`vendor.com/type`).
    pub name: String,
    pub module: String,
    pub socket: PathBuf,
    pub options: watch::Receiver<DevicePluginOptions>,
    pub devices: watch::Receiver<Snapshot>,
    /// True once the first enumeration finished (or failed): only then is the resource served
    /// and registered.
    pub ready: watch::Receiver<bool>,
    /// How many times the kubelet accepted our registration (once per kubelet start).
    pub registrations: watch::Receiver<u32>,
    /// Whether the kubelet holds the registration now, and the restarts and refusals seen.
    pub registration: Arc<RegistrationState>,
    /// Allocate answers prepared ahead of time, per device.
    pub prepared: Prepared,
    /// Whether its devices are replicas (`<id>::<n>`) of shared physical devices.
    pub shared: bool,
    /// Its CDI spec, when its device-list strategy uses CDI.
    pub cdi: Option<CdiServed>,
}

/// A served resource and what stops it.
pub struct RunningResource {
    pub served: ServedResource,
    /// The module's own name for it (what its budget is charged under).
    local: String,
    /// Wakes the device watcher for an immediate re-enumeration.
    pub poke: Arc<Notify>,
    options: watch::Sender<DevicePluginOptions>,
    /// Who answers GetPreferredAllocation: follows the module's declaration and the registry.
    preferred: watch::Sender<Preferred>,
    policy: AllocationPolicy,
    /// Whether its devices are advertised as replicas.
    shared: bool,
    stop: watch::Sender<bool>,
    /// Tells the CDI spec writer the resource goes away for good.
    retired: Arc<std::sync::atomic::AtomicBool>,
    tasks: Vec<JoinHandle<()>>,
}

impl RunningResource {
    /// The module's own name for the resource.
    pub fn local(&self) -> &str {
        &self.local
    }

    /// Whether an upgraded module's declaration can take this resource over as it runs: the
    /// same name, as the module spells it (what its calls are made with).
    pub fn same_declaration(&self, info: &ResourceInfo) -> bool {
        self.local == info.name
    }

    /// Puts an upgraded module's options in force: if they differ, the ListAndWatch streams end,
    /// the kubelet is let disconnect, and the resource registers again on the same socket.
    pub fn set_options(&self, info: &ResourceInfo) {
        let who = who_answers(self.policy, info, self.shared);
        self.preferred.send_replace(who);
        let next = options_of(info, who);
        self.options.send_if_modified(|now| {
            let changed = *now != next;
            *now = next;
            changed
        });
    }

    /// Marks the resource as going away for good (dropped from the registry, served
    /// differently), rather than the agent stopping: its CDI spec is removed when it stops.
    pub fn retire(&self) {
        self.retired
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether one of its tasks (device watcher, lifecycle, spec writer...) ended, which only
    /// stopping explains: anything else is a bug that leaves the resource unserved.
    pub fn task_ended(&self) -> bool {
        self.tasks.iter().any(|t| t.is_finished())
    }

    /// Tells its tasks to end, without waiting: stopping many resources at once then takes as
    /// long as the slowest, not the sum.
    pub fn signal_stop(&self) {
        let _ = self.stop.send(true);
    }

    /// Ends its ListAndWatch stream (the kubelet sees allocatable drop to 0), stops serving and
    /// removes its socket.
    pub async fn stop(self, upkeep: &dyn Upkeep) {
        self.signal_stop();
        for task in self.tasks {
            let _ = task.await;
        }
        let _ = std::fs::remove_file(&self.served.socket);
        upkeep.release(&self.local);
    }
}

/// Who answers GetPreferredAllocation: the registry's policy, except that a shared resource's is
/// always the host's (the module knows nothing of replicas), least-used devices first unless the
/// policy says `packed`.
pub fn who_answers(policy: AllocationPolicy, info: &ResourceInfo, shared: bool) -> Preferred {
    use crate::policy::preferred::Spread;
    match policy.for_resource(info.preferred_allocation && !shared) {
        Preferred::Host(_) if shared && policy != AllocationPolicy::Packed => {
            Preferred::Host(Spread::Distributed)
        }
        who => who,
    }
}

fn options_of(info: &ResourceInfo, preferred: Preferred) -> DevicePluginOptions {
    DevicePluginOptions {
        pre_start_required: info.prestart,
        get_preferred_allocation_available: preferred != Preferred::Off,
    }
}

/// The extended resource name a module's declaration is served under, or why it cannot be:
/// invalid, or outside the module's domain (so a module cannot take over another vendor's
/// resource: a new registration replaces the old plugin in the kubelet).
pub fn servable_name(resource_domain: &str, info: &ResourceInfo) -> Result<String, String> {
    let name = qualify(resource_domain, &info.name);
    names::validate_resource_name(&name)
        .map_err(|e| format!("declared an invalid resource name: {e}"))?;
    if !name.starts_with(&format!("{resource_domain}/")) {
        return Err(format!(
            "declared {name}, outside its resource domain {resource_domain} (set `resource-domain` in the registry to allow it)"
        ));
    }
    Ok(name)
}

/// [`servable_name`], as sharing serves it: `<name>.shared` when the rule renames.
pub fn served_name(
    resource_domain: &str,
    info: &ResourceInfo,
    share: &ShareRule,
) -> Result<String, String> {
    let name = crate::policy::sharing::served_name(servable_name(resource_domain, info)?, share);
    names::validate_resource_name(&name)
        .map_err(|e| format!("is shared as an invalid resource name: {e}"))?;
    Ok(name)
}

/// A bare suffix gets the module's domain; a full name is kept as the module gave it.
pub fn qualify(domain: &str, name: &str) -> String {
    if name.contains('/') {
        name.to_owned()
    } else {
        format!("{domain}/{name}")
    }
}

/// Longest path a Unix socket may have (`sun_path` holds 108 bytes with the NUL).
pub const MAX_SOCKET_PATH: usize = 107;
/// Hex digits of the resource name's digest in a socket name: 48 bits, so two resources of one
/// agent never share a file.
const ENDPOINT_HASH: usize = 12;

/// The socket file name: short, whatever the resource is called (a valid resource name can be 300
/// characters; the path must fit [`MAX_SOCKET_PATH`]), unique per resource (a digest of its name)
/// and per agent process. Which resource a socket serves is in `devicelet status`.
pub fn endpoint_name(resource: &str, instance: &str) -> String {
    let hash = &crate::digest::sha256_hex(resource.as_bytes())[..ENDPOINT_HASH];
    format!("devicelet-{hash}-{instance}.sock")
}

/// Whether every socket of this agent fits in `plugin_dir`; an error that says why when not.
pub fn check_socket_dir(plugin_dir: &Path, instance: &str) -> Result<(), String> {
    let longest = plugin_dir.join(endpoint_name("", instance));
    let len = longest.as_os_str().len();
    if len > MAX_SOCKET_PATH {
        return Err(format!(
            "socket paths in {} would be {len} bytes, over the {MAX_SOCKET_PATH} a Unix socket \
             allows; the directory path is too long",
            plugin_dir.display()
        ));
    }
    Ok(())
}

/// Where and as whom to serve.
pub struct Serving<'a> {
    /// The kubelet's device-plugin directory, where `kubelet.sock` is.
    pub plugin_dir: &'a Path,
    pub route: &'a Route,
    /// Unique per agent process, so a rolling upgrade never has two agents on one socket file.
    pub instance: &'a str,
    pub kubelet_events: &'a watch::Receiver<u64>,
    pub ledger: &'a Ledger,
    /// Where CDI spec files go.
    pub cdi_dir: &'a Path,
}

/// Who serves a resource, and how: what the registry says of its module.
pub struct Owner<'a> {
    /// The module's name, shown in status.
    pub module: &'a str,
    /// The domain its bare resource names get, and the only one it may serve in.
    pub resource_domain: &'a str,
    /// How often the devices are re-enumerated.
    pub health_interval: std::time::Duration,
    /// Whether single-device Allocate answers are prepared ahead of time.
    pub allocate_ahead: bool,
    /// Who answers GetPreferredAllocation.
    pub allocation_policy: AllocationPolicy,
    /// How the resource's devices are shared.
    pub share: &'a ShareRule,
    /// How Allocate names devices to the runtime.
    pub device_list_strategy: DeviceListStrategy,
    /// Where the device nodes its answers name are (`/` on a node): CDI specs are checked
    /// against them.
    pub host_root: &'a Path,
}

/// Serves `info` from `backend` (which lives where `upkeep` says): a device watcher (whose first
/// enumeration runs in its own task) and a lifecycle that serves and registers once that first
/// snapshot is in.
pub fn serve<B: DeviceBackend>(
    backend: &B,
    upkeep: &Arc<dyn Upkeep>,
    spec: &Owner<'_>,
    info: &ResourceInfo,
    at: &Serving<'_>,
) -> Result<RunningResource, String> {
    let name = served_name(spec.resource_domain, info, spec.share)?;
    let kind = match spec.device_list_strategy.uses_cdi() {
        true => Some(
            cdi::spec::kind_of(&name)
                .map_err(|e| format!("cannot have a CDI spec for {name}: {e}"))?,
        ),
        false => None,
    };
    let shared = spec.share.shares();
    let endpoint = endpoint_name(&name, at.instance);
    let who = who_answers(spec.allocation_policy, info, shared);
    let (preferred_tx, preferred) = watch::channel(who);
    let (options_tx, options) = watch::channel(options_of(info, who));
    let (streams_tx, streams) = watch::channel(0u64);
    let (stop_tx, stop) = watch::channel(false);

    let cdi = kind.map(|kind| CdiSpec {
        kind,
        path: cdi::spec_path(at.cdi_dir, &name),
        strategy: spec.device_list_strategy,
    });
    let core::Core {
        devices,
        ready,
        poke,
        prepared,
        cdi,
        cdi_settled,
        retired,
        mut tasks,
    } = core::start(
        backend,
        upkeep,
        CoreSpec {
            name: &name,
            local: &info.name,
            health_interval: spec.health_interval,
            allocate_ahead: spec.allocate_ahead,
            shared,
            cdi,
            host_root: spec.host_root.to_owned(),
        },
        &stop,
    );

    // Devices DRA claims still hold (the resource was served through DRA before) are not
    // advertised until their claims are unprepared.
    let (advertised, filter) = crate::resource::advertised::without_claimed(
        devices.clone(),
        at.ledger.clone(),
        &name,
        stop.clone(),
    );
    tasks.push(filter);
    let plugin = ResourcePlugin::new(
        &name,
        &info.name,
        backend.clone(),
        at.ledger.clone(),
        Watches {
            options: options.clone(),
            streams,
            devices: advertised,
            stop: stop.clone(),
            prepared: prepared.clone(),
            preferred,
            shared,
            one_share: info.one_share_per_container,
            cdi: cdi.as_ref().map(|c| c.naming.clone()),
            upkeep: upkeep.clone(),
        },
    );
    let (registrations_tx, registrations) = watch::channel(0);
    let registration = Arc::new(RegistrationState::default());
    tasks.push(tokio::spawn(
        Lifecycle {
            plugin_dir: at.plugin_dir.to_owned(),
            endpoint: endpoint.clone(),
            resource: name.clone(),
            options: options.clone(),
            streams: streams_tx,
            plugin,
            kubelet_events: at.kubelet_events.clone(),
            ready: ready.clone(),
            cdi_settled,
            stop,
            registrations: registrations_tx,
            route: at.route.clone(),
            state: registration.clone(),
        }
        .run(),
    ));
    Ok(RunningResource {
        served: ServedResource {
            name,
            module: spec.module.to_owned(),
            socket: at.route.socket_dir(at.plugin_dir).join(endpoint),
            options,
            devices,
            ready,
            registrations,
            registration,
            prepared,
            shared,
            cdi,
        },
        poke,
        local: info.name.clone(),
        options: options_tx,
        preferred: preferred_tx,
        policy: spec.allocation_policy,
        shared,
        stop: stop_tx,
        retired,
        tasks,
    })
}

#[cfg(test)]
mod tests {
    use super::endpoint_name;

    #[test]
    fn endpoints_of_different_resources_never_collide() {
        let a = endpoint_name("ex.com/gpu.shared", "1-2");
        let b = endpoint_name("ex.com/gpu_shared", "1-2");
        assert_ne!(a, b);
        assert!(a.starts_with("devicelet-") && a.ends_with("-1-2.sock"));
        assert!(!a.contains('/'));
        let long = format!("example.com/{}", "x".repeat(63));
        assert_eq!(
            endpoint_name(&long, "1-2").len(),
            a.len(),
            "the name never grows"
        );
    }

    #[test]
    fn a_directory_too_long_for_its_sockets_is_refused() {
        let ok = std::path::Path::new("/var/lib/kubelet/device-plugins");
        assert!(super::check_socket_dir(ok, "1795391356784-25343").is_ok());
        let deep = std::path::PathBuf::from(format!("/{}", "d".repeat(80)));
        let e = super::check_socket_dir(&deep, "1795391356784-25343").unwrap_err();
        assert!(e.contains("too long"), "{e}");
    }
}
