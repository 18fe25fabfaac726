//! `devicelet simulate`: run the kubelet simulator in the foreground, so a vendor can point
//! devicelet (or any device plugin) at it and watch what the kubelet would see.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, bail};
use tokio::sync::broadcast::error::RecvError;

use crate::kubelet::api::deviceplugin::Device;
use crate::kubelet::names;
use devicelet_simulator::{Allocation, SimConfig, SimEvent, Simulator};

/// Arguments of `devicelet simulate`.
#[derive(clap::Args, Debug)]
pub struct SimulateArgs {
    /// The kubelet's device-plugin directory to serve `kubelet.sock` in. Like a starting kubelet,
    /// the simulator deletes the sockets already there.
    #[arg(long, default_value = "/var/lib/kubelet/device-plugins")]
    pub dir: PathBuf,
    /// e.g. `--allocate devicelet.io/fuse=2`: after that resource registers, allocate 2 devices
    /// once and print the response. Repeatable.
    /// Each allocation goes to a new pod, `default/pod-<allocation id>`, container `main`, as
    /// the PodResources API then reports it.
    #[arg(long)]
    pub allocate: Vec<String>,
    /// Where to serve the PodResources API (`v1.PodResourcesLister`). Default:
    /// `pod-resources/kubelet.sock` next to `--dir`, as on a node.
    #[arg(long)]
    pub pod_resources_socket: Option<PathBuf>,
    /// Restart the simulated kubelet this often (e.g. `30s`, `5m`), to watch a plugin recover:
    /// each restart deletes the sockets in `--dir` and re-creates `kubelet.sock`, and every
    /// plugin must register again. Allocations survive, as in the kubelet's checkpoint.
    #[arg(long, value_parser = crate::config::parse_duration)]
    pub restart_every: Option<Duration>,
    /// After a restart, how long `kubelet.sock` exists before it accepts connections (connecting
    /// earlier is refused), as on a node where a plugin can see the file a moment too early.
    #[arg(long, default_value = "50ms", value_parser = crate::config::parse_duration)]
    pub accept_delay: Duration,
    /// Also accept plugins by the kubelet's plugin-watcher route (usually
    /// `/var/lib/kubelet/plugins_registry`): every socket appearing in DIR (at any depth) is
    /// asked `GetInfo` with its path as `:authority`, as the kubelet does; a `DevicePlugin` with
    /// a valid resource name and `v1beta1` is registered (its `endpoint`, or this socket when
    /// empty), and told the outcome with `NotifyRegistrationStatus`. Removing the socket
    /// deregisters it. Restarts leave DIR alone and find its plugins again by themselves.
    #[arg(long, value_name = "DIR")]
    pub plugins_registry_dir: Option<PathBuf>,
    /// Also play the kubelet's DRA plugin manager (needs `--plugins-registry-dir`: DRA drivers
    /// register only by the plugin watcher) with an API server stand-in on 127.0.0.1 holding
    /// this node, its ResourceSlices and ResourceClaims. A kubeconfig for it is written to
    /// `--kubeconfig-out`, and the `devicelet run` line that serves DRA drivers here is
    /// printed. Drivers' registrations and published devices are shown as they change; the
    /// node's slices are wiped at every (re)start and 30 s after a driver's last endpoint goes,
    /// as the kubelet does.
    #[arg(long)]
    pub dra: bool,
    /// With `--dra`: the node's name (the agent's `--node-name`).
    #[arg(long, default_value = "sim-node")]
    pub node_name: String,
    /// With `--dra`: where to write the API server stand-in's kubeconfig. Default:
    /// `dra-kubeconfig` next to `--dir`.
    #[arg(long)]
    pub kubeconfig_out: Option<PathBuf>,
    /// With `--dra`, e.g. `--claim gpu.example.com=2`: once that driver is registered and
    /// publishes 2 devices, allocate a ResourceClaim for them as the scheduler would and
    /// prepare it as the kubelet would (NodePrepareResources), printing the answer and the
    /// claim's status. After the count, comma-separated: `tolerate=KEY` (a toleration of that
    /// taint key, any value; `tolerate=*` every taint) and `capacity.NAME=QUANTITY` (a share of
    /// that much of a device's capacity), e.g.
    /// `--claim gpu.example.com=1,tolerate=devicelet.io/unhealthy,capacity.memory=10Gi`.
    /// Repeatable.
    #[arg(long)]
    pub claim: Vec<String>,
}

/// One `--allocate RESOURCE=COUNT` request.
#[derive(Debug, Clone, PartialEq)]
struct Request {
    resource: String,
    count: usize,
}

/// One `--claim DRIVER=COUNT[,tolerate=KEY][,capacity.NAME=QUANTITY]...` request.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct ClaimRequest {
    pub driver: String,
    pub count: usize,
    pub request: devicelet_simulator::DeviceRequest,
}

fn parse_claim(text: &str) -> anyhow::Result<ClaimRequest> {
    let mut parts = text.split(',');
    let Some((driver, count)) = parts.next().and_then(|p| p.rsplit_once('=')) else {
        bail!("--claim {text:?}: expected DRIVER=COUNT, e.g. gpu.example.com=1");
    };
    if !devicelet_api::names::is_dns1123_subdomain(driver) {
        bail!("--claim {text:?}: {driver:?} is not a DRA driver name (a DNS subdomain)");
    }
    let count: usize = count
        .parse()
        .ok()
        .filter(|n| *n > 0)
        .with_context(|| format!("--claim {text:?}: the count must be a positive integer"))?;
    let mut request = devicelet_simulator::DeviceRequest {
        count,
        ..Default::default()
    };
    for part in parts {
        match part.split_once('=') {
            Some(("tolerate", "*")) => request
                .tolerations
                .push(serde_json::json!({"operator": "Exists"})),
            Some(("tolerate", key)) if names::is_qualified_name(key) => request
                .tolerations
                .push(serde_json::json!({"key": key, "operator": "Exists"})),
            Some((name, quantity)) if name.starts_with("capacity.") && !quantity.is_empty() => {
                request
                    .capacity
                    .insert(name["capacity.".len()..].to_owned(), quantity.to_owned());
            }
            _ => bail!(
                "--claim {text:?}: {part:?} is neither `tolerate=KEY` (a taint key, or `*`) nor \
                 `capacity.NAME=QUANTITY`"
            ),
        }
    }
    Ok(ClaimRequest {
        driver: driver.to_owned(),
        count,
        request,
    })
}

fn parse_request(text: &str) -> anyhow::Result<Request> {
    let Some((resource, count)) = text.rsplit_once('=') else {
        bail!("--allocate {text:?}: expected RESOURCE=COUNT, e.g. devicelet.io/fuse=2");
    };
    if let Err(why) = names::validate_resource_name(resource) {
        bail!(
            "--allocate {text:?}: {resource:?} is not a resource name the kubelet accepts: {why}"
        );
    }
    let count: usize =
        count.parse().ok().filter(|n| *n > 0).with_context(|| {
            format!("--allocate {text:?}: the count must be a positive integer")
        })?;
    Ok(Request {
        resource: resource.to_owned(),
        count,
    })
}

/// Runs the simulator until Ctrl-C or SIGTERM, printing registrations, snapshot changes and the
/// requested allocations to stdout.
pub async fn run(args: SimulateArgs) -> anyhow::Result<()> {
    let mut pending = args
        .allocate
        .iter()
        .map(|text| parse_request(text))
        .collect::<anyhow::Result<Vec<_>>>()?;

    if args.restart_every.is_some_and(|every| every.is_zero()) {
        bail!("--restart-every must be longer than 0");
    }
    let claims = args
        .claim
        .iter()
        .map(|text| parse_claim(text))
        .collect::<anyhow::Result<Vec<_>>>()?;
    if !args.dra && !claims.is_empty() {
        bail!("--claim needs --dra");
    }
    let api = match args.dra {
        true => Some(super::simulate_dra::start(&args).await?),
        false => None,
    };

    let config = SimConfig {
        accept_delay: args.accept_delay,
        pod_resources_socket: args.pod_resources_socket.clone(),
        plugins_registry: args.plugins_registry_dir.clone(),
        dra_api: api.as_ref().map(|api| devicelet_simulator::DraApi {
            server: api.handle(),
            node: args.node_name.clone(),
        }),
        ..SimConfig::default()
    };
    let sim = Simulator::start_with(&args.dir, config)
        .await
        .with_context(|| {
            format!(
                "cannot start the kubelet simulator in {}",
                args.dir.display()
            )
        })?;
    let mut events = sim.events();
    println!(
        "simulated kubelet listening on {}; waiting for device plugins to register",
        sim.socket().display()
    );
    println!(
        "PodResources API (v1.PodResourcesLister) on {}",
        sim.pod_resources_socket().display()
    );
    if let Some(dir) = sim.plugins_registry() {
        println!(
            "plugin watcher watching {} for registration sockets",
            dir.display()
        );
    }
    if let Some(every) = args.restart_every {
        println!("restarting the simulated kubelet every {every:?}");
    }
    let _dra =
        api.map(|api| super::simulate_dra::watch(api, sim.clone(), args.node_name.clone(), claims));

    let stop = super::stop_signal();
    tokio::pin!(stop);
    let mut restarts = args.restart_every.map(|every| {
        let mut interval = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        interval
    });
    let mut restart_count = 0u64;
    let mut last_devices: BTreeMap<String, Vec<Device>> = BTreeMap::new();
    loop {
        let event = tokio::select! {
            result = &mut stop => {
                result?;
                break;
            }
            () = next_restart(restarts.as_mut()) => {
                restart_count += 1;
                println!("restarting the simulated kubelet (restart {restart_count})");
                sim.restart()
                    .await
                    .context("restarting the simulated kubelet")?;
                continue;
            }
            event = events.recv() => event,
        };
        let event = match show(event, &mut last_devices) {
            Shown::Event(event) => event,
            Shown::Skip => continue,
            Shown::Closed => break,
        };
        if let SimEvent::Snapshot {
            resource,
            allocatable,
            ..
        } = &event
        {
            // Each requested allocation once, as soon as its resource has enough devices.
            let (ready, waiting) = std::mem::take(&mut pending)
                .into_iter()
                .partition(|r| r.resource == *resource && r.count <= *allocatable);
            pending = waiting;
            for request in ready {
                let sim = sim.clone();
                tokio::spawn(async move {
                    let text = match sim.allocate(&request.resource, request.count).await {
                        Ok(allocation) => format_allocation(&allocation),
                        Err(e) => format!(
                            "allocation of {} {} failed: {e}",
                            request.count, request.resource
                        ),
                    };
                    println!("{text}");
                });
            }
        }
    }
    println!("stopping the simulated kubelet");
    sim.shutdown().await;
    Ok(())
}

/// What became of one received event.
pub(super) enum Shown {
    Event(SimEvent),
    /// Nothing to act on (output fell behind).
    Skip,
    Closed,
}

/// Prints an event the way `simulate` and `try` show them (snapshots as what changed).
pub(super) fn show(
    event: Result<SimEvent, RecvError>,
    last_devices: &mut BTreeMap<String, Vec<Device>>,
) -> Shown {
    match event {
        Ok(event) => {
            if let Some(text) = describe(&event, last_devices) {
                println!("{text}");
            }
            Shown::Event(event)
        }
        Err(RecvError::Lagged(missed)) => {
            println!("(output fell behind: {missed} events not shown)");
            Shown::Skip
        }
        Err(RecvError::Closed) => Shown::Closed,
    }
}

/// The next `--restart-every` tick; never without the option.
async fn next_restart(restarts: Option<&mut tokio::time::Interval>) {
    match restarts {
        Some(interval) => {
            interval.tick().await;
        }
        None => std::future::pending().await,
    }
}

/// A line (or block) for an event; snapshots show what changed since the last one.
fn describe(event: &SimEvent, last_devices: &mut BTreeMap<String, Vec<Device>>) -> Option<String> {
    Some(match event {
        SimEvent::Registered {
            resource,
            endpoint,
            options,
            registrations,
        } => format!(
            "registered {resource} at endpoint {endpoint} (registration {registrations}; \
             pre_start_required={}, get_preferred_allocation_available={})",
            options.pre_start_required, options.get_preferred_allocation_available
        ),
        SimEvent::Rejected {
            resource,
            endpoint,
            reason,
        } => format!("REFUSED registration of {resource:?} at endpoint {endpoint:?}: {reason}"),
        SimEvent::Snapshot {
            resource,
            number,
            devices,
            capacity,
            allocatable,
        } => {
            let previous = last_devices.insert(resource.clone(), devices.clone());
            let mut text = format!(
                "{resource}: snapshot {number}: capacity {capacity}, allocatable {allocatable}"
            );
            let changes = device_changes(previous.as_deref().unwrap_or_default(), devices);
            if changes.is_empty() {
                text.push_str(" (no change)");
            }
            for change in changes {
                let _ = write!(text, "\n  {change}");
            }
            text
        }
        SimEvent::StreamEnded { resource, reason } => {
            format!("{resource}: {reason}; allocatable is now 0")
        }
        SimEvent::Restarted { sockets_removed } => {
            // The new kubelet knows no devices until the plugins register again.
            last_devices.clear();
            format!(
                "simulated kubelet restarted ({sockets_removed} sockets removed); every plugin must \
             register again"
            )
        }
        SimEvent::Serving => "kubelet.sock accepts connections again".to_owned(),
        SimEvent::RegistryAttempt { attempt } => {
            let socket = attempt.socket.display();
            match &attempt.error {
                None => format!(
                    "plugin watcher: registered {} from {socket}{}",
                    attempt.resource().unwrap_or_default(),
                    match &attempt.notified {
                        Some(Err(e)) => format!(" (NotifyRegistrationStatus failed: {e})"),
                        _ => String::new(),
                    }
                ),
                Some(error) => format!(
                    "plugin watcher: REFUSED {socket}: {error}{}",
                    if attempt.retry { " (will retry)" } else { "" }
                ),
            }
        }
        SimEvent::RegistryRemoved { socket, resource } => match resource {
            Some(resource) => format!(
                "plugin watcher: {} removed; {resource} deregistered",
                socket.display()
            ),
            None => format!("plugin watcher: {} removed", socket.display()),
        },
        SimEvent::Allocated { .. } | SimEvent::Released { .. } => return None,
        // Events a newer simulator adds are not part of this transcript.
        _ => return None,
    })
}

/// `+ id health`, `- id`, `~ id old -> new` lines between two sorted device lists.
fn device_changes(before: &[Device], after: &[Device]) -> Vec<String> {
    let before: BTreeMap<&str, &Device> = before.iter().map(|d| (d.id.as_str(), d)).collect();
    let after: BTreeMap<&str, &Device> = after.iter().map(|d| (d.id.as_str(), d)).collect();
    let mut lines = Vec::new();
    for (id, device) in &after {
        match before.get(id) {
            None => lines.push(format!("+ {id} {}{}", device.health, numa(device))),
            Some(old) if old.health != device.health || old.topology != device.topology => {
                let topology = if old.topology == device.topology {
                    numa(device)
                } else {
                    let shown = |d: &Device| match numa(d) {
                        n if n.is_empty() => "none".to_owned(),
                        n => n
                            .trim_start_matches(" (NUMA ")
                            .trim_end_matches(')')
                            .to_owned(),
                    };
                    format!(" (NUMA {} -> {})", shown(old), shown(device))
                };
                lines.push(format!(
                    "~ {id} {} -> {}{topology}",
                    old.health, device.health
                ))
            }
            Some(_) => {}
        }
    }
    for id in before.keys().filter(|id| !after.contains_key(*id)) {
        lines.push(format!("- {id}"));
    }
    lines
}

fn numa(device: &Device) -> String {
    match &device.topology {
        Some(topology) if !topology.nodes.is_empty() => {
            let nodes: Vec<String> = topology.nodes.iter().map(|n| n.id.to_string()).collect();
            format!(" (NUMA {})", nodes.join(","))
        }
        _ => String::new(),
    }
}

/// The full answer for one container, as a container runtime would apply it.
pub(super) fn format_allocation(allocation: &Allocation) -> String {
    let response = &allocation.response;
    let mut text = format!(
        "allocation {} of {} to pod {}/{} container {}: {}",
        allocation.id,
        allocation.resource,
        allocation.pod.namespace,
        allocation.pod.name,
        allocation.pod.container,
        allocation.device_ids.join(", ")
    );
    match &allocation.preferred {
        Some(preferred) => {
            let _ = write!(
                text,
                "\n  GetPreferredAllocation answered: [{}]",
                preferred.join(", ")
            );
        }
        None => text.push_str("\n  GetPreferredAllocation: not offered by the plugin"),
    }
    section(
        &mut text,
        "envs",
        sorted(&response.envs, |k, v| format!("{k}={v}")),
    );
    section(
        &mut text,
        "mounts",
        response
            .mounts
            .iter()
            .map(|m| {
                format!(
                    "{} -> {}{}",
                    m.host_path,
                    m.container_path,
                    if m.read_only { " (read-only)" } else { "" }
                )
            })
            .collect(),
    );
    section(
        &mut text,
        "devices",
        response
            .devices
            .iter()
            .map(|d| {
                format!(
                    "{} -> {} ({})",
                    d.host_path, d.container_path, d.permissions
                )
            })
            .collect(),
    );
    section(
        &mut text,
        "annotations",
        sorted(&response.annotations, |k, v| format!("{k}={v}")),
    );
    section(
        &mut text,
        "cdi devices",
        response
            .cdi_devices
            .iter()
            .map(|d| d.name.clone())
            .collect(),
    );
    let _ = write!(
        text,
        "\n  PreStartContainer: {}",
        if allocation.prestarted {
            "called, succeeded"
        } else {
            "not required by the plugin"
        }
    );
    text
}

fn sorted(
    map: &std::collections::HashMap<String, String>,
    line: impl Fn(&str, &str) -> String,
) -> Vec<String> {
    let sorted: BTreeMap<_, _> = map.iter().collect();
    sorted.into_iter().map(|(k, v)| line(k, v)).collect()
}

fn section(text: &mut String, title: &str, lines: Vec<String>) {
    if lines.is_empty() {
        let _ = write!(text, "\n  {title}: none");
        return;
    }
    let _ = write!(text, "\n  {title}:");
    for line in lines {
        let _ = write!(text, "\n    {line}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kubelet::api::deviceplugin::{
        CdiDevice, ContainerAllocateResponse, DeviceSpec, HEALTHY, Mount, NumaNode, TopologyInfo,
        UNHEALTHY,
    };
    use devicelet_simulator::PodRef;

    #[test]
    fn parses_allocation_requests() {
        assert_eq!(
            parse_request("devicelet.io/fuse=2").unwrap(),
            Request {
                resource: "devicelet.io/fuse".into(),
                count: 2
            }
        );
        for bad in [
            "devicelet.io/fuse",
            "devicelet.io/fuse=0",
            "devicelet.io/fuse=x",
            "fuse=1",
        ] {
            assert!(parse_request(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn parses_claim_requests_with_tolerations_and_capacity() {
        let claim = parse_claim(
            "gpu.example.com=1,tolerate=devicelet.io/unhealthy,tolerate=*,capacity.memory=10Gi",
        )
        .unwrap();
        assert_eq!((claim.driver.as_str(), claim.count), ("gpu.example.com", 1));
        assert_eq!(
            claim.request.tolerations,
            [
                serde_json::json!({"key": "devicelet.io/unhealthy", "operator": "Exists"}),
                serde_json::json!({"operator": "Exists"})
            ]
        );
        assert_eq!(claim.request.capacity["memory"], "10Gi");
        assert_eq!(claim.request.count, 1);
        for bad in [
            "gpu.example.com",
            "gpu.example.com=0",
            "GPU=1",
            "gpu.example.com=1,colour=blue",
            "gpu.example.com=1,tolerate=-bad",
            "gpu.example.com=1,capacity.memory=",
        ] {
            assert!(parse_claim(bad).is_err(), "{bad}");
        }
    }

    fn dev(id: &str, health: &str) -> Device {
        Device {
            id: id.into(),
            health: health.into(),
            topology: None,
        }
    }

    #[test]
    fn shows_device_changes() {
        let before = [dev("a", HEALTHY), dev("b", HEALTHY)];
        let after = [dev("b", UNHEALTHY), dev("c", HEALTHY)];
        assert_eq!(
            device_changes(&before, &after),
            ["~ b Healthy -> Unhealthy", "+ c Healthy", "- a"]
        );
        assert!(device_changes(&after, &after).is_empty());
        let mut moved = dev("b", UNHEALTHY);
        moved.topology = Some(TopologyInfo {
            nodes: vec![NumaNode { id: 1 }],
        });
        assert_eq!(
            device_changes(&[moved.clone()], &[dev("b", UNHEALTHY)]),
            ["~ b Unhealthy -> Unhealthy (NUMA 1 -> none)"]
        );
    }

    #[test]
    fn prints_the_whole_response() {
        let allocation = Allocation {
            id: 1,
            pod: PodRef::generated(1),
            resource: "devicelet.io/fuse".into(),
            device_ids: vec!["fuse-0".into()],
            preferred: None,
            response: ContainerAllocateResponse {
                envs: [
                    ("B".to_owned(), "2".to_owned()),
                    ("A".to_owned(), "1".to_owned()),
                ]
                .into(),
                mounts: vec![Mount {
                    container_path: "/c".into(),
                    host_path: "/h".into(),
                    read_only: true,
                }],
                devices: vec![DeviceSpec {
                    container_path: "/dev/fuse".into(),
                    host_path: "/dev/fuse".into(),
                    permissions: "rw".into(),
                }],
                annotations: Default::default(),
                cdi_devices: vec![CdiDevice {
                    name: "devicelet.io/fuse=fuse-0".into(),
                }],
            },
            prestarted: false,
        };
        let text = format_allocation(&allocation);
        for expected in [
            "allocation 1 of devicelet.io/fuse to pod default/pod-1 container main: fuse-0",
            "envs:\n    A=1\n    B=2",
            "/h -> /c (read-only)",
            "/dev/fuse -> /dev/fuse (rw)",
            "annotations: none",
            "cdi devices:\n    devicelet.io/fuse=fuse-0",
        ] {
            assert!(text.contains(expected), "{expected:?} in\n{text}");
        }
    }
}
