//! The simulated kubelet against a scripted fake plugin.

use std::sync::atomic::Ordering;
use std::time::Duration;

use tempfile::TempDir;
use tonic::{Code, Status};

use super::fake::{AllocateMode, Call, FakePlugin, device, healthy, register};
use super::*;
use devicelet_api::deviceplugin::{
    ContainerAllocateRequest, ContainerPreferredAllocationRequest, DevicePluginOptions, HEALTHY,
    UNHEALTHY, VERSION,
};

const RESOURCE: &str = "devicelet.io/fake";
const WAIT: Duration = Duration::from_secs(5);

fn options(
    pre_start_required: bool,
    get_preferred_allocation_available: bool,
) -> DevicePluginOptions {
    DevicePluginOptions {
        pre_start_required,
        get_preferred_allocation_available,
    }
}

fn test_config() -> SimConfig {
    SimConfig {
        dial_timeout: Duration::from_millis(300),
        prestart_timeout: Duration::from_secs(5),
        stall_limit: Duration::from_millis(300),
        ..SimConfig::default()
    }
}

/// A simulator on `<tmp>/device-plugins`, PodResources on `<tmp>/pod-resources/kubelet.sock`.
async fn simulator_with(config: SimConfig) -> (TempDir, Simulator) {
    let dir = TempDir::new().unwrap();
    let sim = Simulator::start_with(&dir.path().join("device-plugins"), config)
        .await
        .unwrap();
    (dir, sim)
}

async fn simulator() -> (TempDir, Simulator) {
    simulator_with(test_config()).await
}

/// A fake plugin with `devices`, registered and with its first snapshot seen.
async fn registered(sim: &Simulator, opts: DevicePluginOptions, devices: &[&str]) -> FakePlugin {
    let plugin = FakePlugin::serve(sim.plugin_dir(), "fake-1.sock", opts, healthy(devices));
    plugin.register(sim.socket(), RESOURCE).await.unwrap();
    sim.wait_until(RESOURCE, WAIT, |r| r.snapshots >= 1)
        .await
        .unwrap();
    plugin
}

#[tokio::test]
async fn registration_then_first_snapshot_is_visible() {
    let (dir, sim) = simulator().await;
    let mut events = sim.events();
    let plugin = FakePlugin::serve(
        sim.plugin_dir(),
        "fake-1.sock",
        options(true, false),
        vec![
            device("d2", HEALTHY),
            device("d0", UNHEALTHY),
            device("d1", HEALTHY),
            device("d3", "healthy"),
        ],
    );
    // The request's options differ: the kubelet uses GetDevicePluginOptions'.
    plugin
        .register_as(sim.socket(), VERSION, RESOURCE, options(false, true))
        .await
        .unwrap();
    let state = sim
        .wait_until(RESOURCE, WAIT, |r| r.snapshots >= 1)
        .await
        .unwrap();
    assert_eq!(state.endpoint, "fake-1.sock");
    assert_eq!(state.options, options(true, false));
    assert_eq!(state.registrations, 1);
    assert!(state.streaming);
    let ids: Vec<_> = state.devices.iter().map(|d| d.id.as_str()).collect();
    assert_eq!(ids, ["d0", "d1", "d2", "d3"]);
    assert_eq!((state.capacity, state.allocatable), (4, 2));
    assert_eq!(sim.resources(), vec![state]);
    assert_eq!(
        plugin.fake.calls()[..2],
        [Call::Options, Call::ListAndWatch]
    );

    assert!(matches!(
        events.recv().await.unwrap(),
        SimEvent::Registered {
            registrations: 1,
            ..
        }
    ));
    // Later snapshots replace the set.
    plugin.fake.set_devices(healthy(&["e0"]));
    let state = sim
        .wait_until(RESOURCE, WAIT, |r| r.snapshots >= 2)
        .await
        .unwrap();
    assert_eq!((state.capacity, state.allocatable), (1, 1));
    assert_eq!(state.devices[0].id, "e0");
    let plugin_dir = sim.plugin_dir().to_owned();
    let pod_resources = sim.pod_resources_socket().to_owned();
    assert_eq!(pod_resources, dir.path().join("pod-resources/kubelet.sock"));
    assert!(pod_resources.exists());
    sim.shutdown().await;
    assert!(!plugin_dir.join("kubelet.sock").exists());
    assert!(!pod_resources.exists());
}

#[tokio::test]
async fn invalid_registrations_are_refused() {
    let (_dir, sim) = simulator().await;
    let plugin = FakePlugin::serve(
        sim.plugin_dir(),
        "fake-1.sock",
        options(false, false),
        healthy(&["a"]),
    );
    let opts = options(false, false);
    let long_name = format!("example.com/{}", "x".repeat(64));
    for (version, endpoint, resource, why) in [
        ("v1alpha", "fake-1.sock", RESOURCE, "API version"),
        ("", "fake-1.sock", RESOURCE, "API version"),
        (VERSION, "fake-1.sock", "fake", "ResourceName"),
        (VERSION, "fake-1.sock", "kubernetes.io/fake", "ResourceName"),
        (
            VERSION,
            "fake-1.sock",
            "gpu.kubernetes.io/fake",
            "ResourceName",
        ),
        (
            VERSION,
            "fake-1.sock",
            "requests.example.com/fake",
            "ResourceName",
        ),
        (VERSION, "fake-1.sock", "Example.com/fake", "ResourceName"),
        (VERSION, "fake-1.sock", long_name.as_str(), "ResourceName"),
        (VERSION, "", RESOURCE, "endpoint"),
        (
            VERSION,
            &format!("{}/fake-1.sock", sim.plugin_dir().display()),
            RESOURCE,
            "endpoint",
        ),
    ] {
        let status = register(sim.socket(), version, endpoint, resource, opts)
            .await
            .expect_err(resource);
        assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
        assert!(status.message().contains(why), "{why}: {status:?}");
    }
    assert_eq!(sim.resources(), vec![]);
    // Validation comes before any dialing.
    assert_eq!(plugin.fake.calls(), vec![]);
}

#[tokio::test]
async fn failing_options_or_missing_socket_fail_registration() {
    let (_dir, sim) = simulator().await;
    let plugin = FakePlugin::serve(
        sim.plugin_dir(),
        "fake-1.sock",
        options(false, false),
        healthy(&["a"]),
    );
    *plugin.fake.options_error.lock().unwrap() = Some(Status::internal("module fake-gpu trapped"));
    let status = plugin.register(sim.socket(), RESOURCE).await.unwrap_err();
    assert!(
        status.message().contains("module fake-gpu trapped"),
        "{status:?}"
    );
    assert!(sim.resource(RESOURCE).is_none());

    // Registering before serving: nothing listens on the endpoint.
    let started = std::time::Instant::now();
    let status = register(
        sim.socket(),
        VERSION,
        "nobody.sock",
        RESOURCE,
        options(false, false),
    )
    .await
    .unwrap_err();
    assert!(status.message().contains("nobody.sock"), "{status:?}");
    assert!(started.elapsed() < Duration::from_secs(3));
    assert!(sim.resource(RESOURCE).is_none());
}

#[tokio::test]
async fn preferred_allocation_is_used_when_valid_and_ignored_when_not() {
    let (_dir, sim) = simulator().await;
    let plugin = registered(&sim, options(false, true), &["a", "b", "c", "d"]).await;

    *plugin.fake.preferred.lock().unwrap() = Ok(vec!["d".into(), "c".into()]);
    let allocation = sim.allocate(RESOURCE, 2).await.unwrap();
    assert_eq!(allocation.device_ids, ["c", "d"]);
    assert_eq!(allocation.preferred, Some(vec!["d".into(), "c".into()]));
    assert_eq!(allocation.response.envs["FAKE_DEVICES"], "c,d");
    assert!(!allocation.prestarted);
    let calls = plugin.fake.calls();
    assert_eq!(
        calls[calls.len() - 2..],
        [
            Call::Preferred(vec![ContainerPreferredAllocationRequest {
                available_device_i_ds: vec!["a".into(), "b".into(), "c".into(), "d".into()],
                must_include_device_i_ds: vec![],
                allocation_size: 2,
            }]),
            Call::Allocate(vec![ContainerAllocateRequest {
                devices_ids: vec!["c".into(), "d".into()],
            }]),
        ]
    );
    sim.release(allocation.id);

    // Names no candidate: ignored.
    *plugin.fake.preferred.lock().unwrap() = Ok(vec!["x".into(), "y".into()]);
    let allocation = sim.allocate(RESOURCE, 2).await.unwrap();
    assert_eq!(allocation.device_ids, ["a", "b"]);
    // Holds an allocated device (a, b are taken) and too few: the usable one, then filled up.
    *plugin.fake.preferred.lock().unwrap() = Ok(vec!["a".into(), "d".into()]);
    let second = sim.allocate(RESOURCE, 2).await.unwrap();
    assert_eq!(second.device_ids, ["c", "d"]);

    // An error fails the allocation, as in the kubelet.
    sim.release(allocation.id);
    *plugin.fake.preferred.lock().unwrap() = Err(Status::internal("module fake-gpu: no topology"));
    let err = sim.allocate(RESOURCE, 1).await.unwrap_err();
    assert_eq!(err.plugin_message(), Some("module fake-gpu: no topology"));
    assert!(
        err.to_string().contains("module fake-gpu: no topology"),
        "{err}"
    );
}

#[tokio::test]
async fn preferred_allocation_is_not_asked_unless_offered() {
    let (_dir, sim) = simulator().await;
    let plugin = registered(&sim, options(false, false), &["a", "b"]).await;
    let allocation = sim.allocate(RESOURCE, 1).await.unwrap();
    assert_eq!(allocation.device_ids, ["a"]);
    assert_eq!(allocation.preferred, None);
    assert!(
        !plugin
            .fake
            .calls()
            .iter()
            .any(|c| matches!(c, Call::Preferred(_)))
    );
}

#[tokio::test]
async fn prestart_is_called_only_when_required() {
    let (_dir, sim) = simulator().await;
    let plugin = registered(&sim, options(true, false), &["a", "b"]).await;
    let allocation = sim.allocate(RESOURCE, 2).await.unwrap();
    assert!(allocation.prestarted);
    assert_eq!(
        plugin.fake.calls().last(),
        Some(&Call::PreStart(vec!["a".into(), "b".into()]))
    );

    // A failing prestart leaves the pod admitted: the devices stay allocated until released.
    sim.release(allocation.id);
    *plugin.fake.prestart_error.lock().unwrap() =
        Some(Status::internal("module fake-gpu: reset failed"));
    let err = sim.allocate(RESOURCE, 1).await.unwrap_err();
    let SimError::PreStart { allocation_id, .. } = &err else {
        panic!("{err}");
    };
    assert_eq!(err.plugin_message(), Some("module fake-gpu: reset failed"));
    assert!(matches!(
        sim.allocate(RESOURCE, 2).await,
        Err(SimError::Insufficient { available: 1, .. })
    ));
    sim.release(*allocation_id);

    let (_dir2, sim2) = simulator().await;
    let plugin = registered(&sim2, options(false, false), &["a"]).await;
    let allocation = sim2.allocate(RESOURCE, 1).await.unwrap();
    assert!(!allocation.prestarted);
    assert!(
        !plugin
            .fake
            .calls()
            .iter()
            .any(|c| matches!(c, Call::PreStart(_)))
    );
}

#[tokio::test]
async fn allocations_hold_devices_until_released() {
    let (_dir, sim) = simulator().await;
    let plugin = FakePlugin::serve(
        sim.plugin_dir(),
        "fake-1.sock",
        options(false, false),
        vec![
            device("a", HEALTHY),
            device("b", UNHEALTHY),
            device("c", HEALTHY),
            device("d", HEALTHY),
        ],
    );
    plugin.register(sim.socket(), RESOURCE).await.unwrap();
    sim.wait_until(RESOURCE, WAIT, |r| r.snapshots >= 1)
        .await
        .unwrap();

    let first = sim.allocate(RESOURCE, 2).await.unwrap();
    assert_eq!(first.device_ids, ["a", "c"]);
    let err = sim.allocate(RESOURCE, 2).await.unwrap_err();
    assert!(
        matches!(
            err,
            SimError::Insufficient {
                requested: 2,
                available: 1,
                ..
            }
        ),
        "{err}"
    );
    sim.release(first.id);
    let again = sim.allocate(RESOURCE, 3).await.unwrap();
    assert_eq!(again.device_ids, ["a", "c", "d"]);
    assert_ne!(again.id, first.id);

    assert!(matches!(
        sim.allocate("devicelet.io/none", 1).await,
        Err(SimError::UnknownResource { .. })
    ));
    assert!(matches!(
        sim.allocate(RESOURCE, 0).await,
        Err(SimError::ZeroCount { .. })
    ));
}

#[tokio::test]
async fn allocate_failures_are_reported() {
    let (_dir, sim) = simulator().await;
    let plugin = registered(&sim, options(true, false), &["a", "b"]).await;

    *plugin.fake.allocate.lock().unwrap() = AllocateMode::Empty;
    let err = sim.allocate(RESOURCE, 1).await.unwrap_err();
    assert!(
        matches!(err, SimError::EmptyAllocateResponse { .. }),
        "{err}"
    );

    *plugin.fake.allocate.lock().unwrap() =
        AllocateMode::Fail(Status::unavailable("module fake-gpu is down"));
    let err = sim.allocate(RESOURCE, 1).await.unwrap_err();
    assert_eq!(err.plugin_message(), Some("module fake-gpu is down"));

    *plugin.fake.allocate.lock().unwrap() = AllocateMode::Hang;
    let err = sim.allocate(RESOURCE, 1).await.unwrap_err();
    assert!(
        matches!(
            err,
            SimError::Stalled {
                call: "Allocate",
                ..
            }
        ),
        "{err}"
    );

    // Failed allocations hold nothing, and no prestart followed them.
    *plugin.fake.allocate.lock().unwrap() = AllocateMode::Normal;
    assert_eq!(
        sim.allocate(RESOURCE, 2).await.unwrap().device_ids,
        ["a", "b"]
    );
    let prestarts = plugin
        .fake
        .calls()
        .iter()
        .filter(|c| matches!(c, Call::PreStart(_)))
        .count();
    assert_eq!(prestarts, 1);
}

#[tokio::test]
async fn stream_end_drops_allocatable_to_zero() {
    let (_dir, sim) = simulator().await;
    let plugin = registered(&sim, options(false, false), &["a", "b"]).await;
    plugin.fake.end_streams();
    let state = sim
        .wait_until(RESOURCE, WAIT, |r| !r.streaming)
        .await
        .unwrap();
    assert_eq!((state.capacity, state.allocatable), (2, 0));
    assert_eq!(state.devices.len(), 2);
    let err = sim.allocate(RESOURCE, 1).await.unwrap_err();
    assert!(
        matches!(err, SimError::Insufficient { available: 0, .. }),
        "{err}"
    );

    // Registering again brings it back.
    plugin.register(sim.socket(), RESOURCE).await.unwrap();
    let state = sim
        .wait_until(RESOURCE, WAIT, |r| r.registrations == 2 && r.snapshots >= 1)
        .await
        .unwrap();
    assert_eq!((state.capacity, state.allocatable), (2, 2));
}

#[tokio::test]
async fn reregistration_replaces_the_client() {
    let (_dir, sim) = simulator().await;
    let old = registered(&sim, options(false, false), &["x"]).await;
    let new = FakePlugin::serve(
        sim.plugin_dir(),
        "fake-2.sock",
        options(true, false),
        healthy(&["y", "z"]),
    );
    new.register(sim.socket(), RESOURCE).await.unwrap();
    let state = sim
        .wait_until(RESOURCE, WAIT, |r| r.registrations == 2 && r.snapshots >= 1)
        .await
        .unwrap();
    assert_eq!(state.endpoint, "fake-2.sock");
    assert_eq!(state.options, options(true, false));
    assert_eq!(state.devices.len(), 2);

    // The old stream was cancelled, so nothing the old plugin sends reaches the kubelet.
    for _ in 0..100 {
        if old.fake.cancelled_streams.load(Ordering::SeqCst) == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(old.fake.cancelled_streams.load(Ordering::SeqCst), 1);
    old.fake.set_devices(healthy(&["x", "w"]));

    let allocation = sim.allocate(RESOURCE, 2).await.unwrap();
    assert_eq!(allocation.device_ids, ["y", "z"]);
    assert!(allocation.prestarted);
    assert!(
        !old.fake
            .calls()
            .iter()
            .any(|c| matches!(c, Call::Allocate(_)))
    );
    let state = sim.resource(RESOURCE).unwrap();
    assert!(state.streaming);
    assert_eq!(state.snapshots, 1);
}

/// Registers until the kubelet accepts it, as a plugin must after a restart (KUBELET.md §7):
/// retrying quickly while `kubelet.sock` refuses connections.
async fn register_retrying(sim: &Simulator, plugin: &FakePlugin) {
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        match plugin.register(sim.socket(), RESOURCE).await {
            Ok(()) => return,
            Err(status) if status.code() == Code::Unavailable => {
                assert!(std::time::Instant::now() < deadline, "{status:?}");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            Err(status) => panic!("{status:?}"),
        }
    }
}

#[tokio::test]
async fn restart_deletes_sockets_and_forgets_plugins() {
    let (_dir, sim) = simulator().await;
    let dir = sim.plugin_dir().to_owned();
    let plugin = registered(&sim, options(false, false), &["a", "b"]).await;
    let held = sim.allocate(RESOURCE, 1).await.unwrap();
    std::fs::write(dir.join(server::CHECKPOINT), "{}").unwrap();
    std::fs::write(dir.join("notes.txt"), "kept").unwrap();

    sim.restart().await.unwrap();
    assert!(!dir.join("fake-1.sock").exists());
    assert!(dir.join(server::CHECKPOINT).exists());
    assert!(dir.join("notes.txt").exists());
    assert!(sim.socket().exists());
    let state = sim.resource(RESOURCE).unwrap();
    assert_eq!(
        (state.capacity, state.allocatable, state.streaming),
        (0, 0, false)
    );
    assert!(matches!(
        sim.allocate(RESOURCE, 1).await,
        Err(SimError::Insufficient { .. })
    ));

    // The plugin serves again (new socket) and registers again; the allocation survived.
    drop(plugin);
    let plugin = FakePlugin::serve(
        sim.plugin_dir(),
        "fake-2.sock",
        options(false, false),
        healthy(&["a", "b"]),
    );
    register_retrying(&sim, &plugin).await;
    let state = sim
        .wait_until(RESOURCE, WAIT, |r| r.registrations == 2 && r.snapshots >= 1)
        .await
        .unwrap();
    assert_eq!(state.allocatable, 2);
    assert_eq!(sim.registrations(RESOURCE), 2);
    assert_eq!(sim.registrations("devicelet.io/none"), 0);
    let next = sim.allocate(RESOURCE, 1).await.unwrap();
    assert_eq!(next.device_ids, ["b"]);
    assert_ne!(held.device_ids, next.device_ids);
}

#[tokio::test]
async fn kubelet_sock_refuses_connections_for_accept_delay_after_restart() {
    // Long enough that even a loaded machine gets its early attempts in within it.
    let delay = Duration::from_secs(3);
    let (_dir, sim) = simulator_with(SimConfig {
        accept_delay: delay,
        ..test_config()
    })
    .await;
    let plugin = registered(&sim, options(false, false), &["a"]).await;
    let mut events = sim.events();

    let restarted = std::time::Instant::now();
    sim.restart().await.unwrap();
    // The file is there at once ...
    assert!(sim.socket().exists());
    drop(plugin);
    let plugin = FakePlugin::serve(
        sim.plugin_dir(),
        "fake-2.sock",
        options(false, false),
        healthy(&["a"]),
    );
    // ... but a connection is refused until the delay has passed, and so is a registration.
    let early = tokio::net::UnixStream::connect(sim.socket()).await;
    let register_early = plugin.register(sim.socket(), RESOURCE).await;
    assert!(
        restarted.elapsed() < delay,
        "the machine took {:?} to try; this test cannot tell refused from accepted",
        restarted.elapsed()
    );
    let err = early.expect_err("kubelet.sock accepted a connection during accept_delay");
    assert_eq!(err.kind(), std::io::ErrorKind::ConnectionRefused, "{err}");
    let status = register_early.unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert_eq!(sim.registrations(RESOURCE), 1);

    register_retrying(&sim, &plugin).await;
    assert!(restarted.elapsed() >= delay);
    sim.wait_until(RESOURCE, WAIT, |r| r.registrations == 2 && r.snapshots >= 1)
        .await
        .unwrap();
    let mut seen = Vec::new();
    while let Ok(event) = events.try_recv() {
        seen.push(event);
    }
    let restarted_at = seen
        .iter()
        .position(|e| matches!(e, SimEvent::Restarted { .. }))
        .unwrap();
    let serving_at = seen
        .iter()
        .position(|e| matches!(e, SimEvent::Serving))
        .unwrap();
    let registered_at = seen
        .iter()
        .position(|e| matches!(e, SimEvent::Registered { .. }))
        .unwrap();
    assert!(
        restarted_at < serving_at && serving_at < registered_at,
        "{seen:?}"
    );
}

#[tokio::test]
async fn shutdown_during_accept_delay_stops_cleanly() {
    let (_dir, sim) = simulator_with(SimConfig {
        accept_delay: Duration::from_secs(60),
        ..test_config()
    })
    .await;
    sim.restart().await.unwrap();
    let socket = sim.socket().to_owned();
    // A second restart while the first is still not accepting.
    sim.restart().await.unwrap();
    assert!(socket.exists());
    tokio::time::timeout(Duration::from_secs(2), sim.shutdown())
        .await
        .unwrap();
    assert!(!socket.exists());
}

#[tokio::test]
async fn a_second_simulator_on_a_live_directory_is_refused() {
    let (dir, sim) = simulator().await;
    let err = Simulator::start(sim.plugin_dir()).await.err().unwrap();
    assert!(matches!(err, SimError::AlreadyServed { .. }), "{err}");
    // Another plugin directory, but the same PodResources socket.
    let err = Simulator::start(&dir.path().join("other"))
        .await
        .err()
        .unwrap();
    let SimError::AlreadyServed { path } = &err else {
        panic!("{err}");
    };
    assert_eq!(path, sim.pod_resources_socket());
}

#[tokio::test]
async fn start_deletes_stale_sockets() {
    let tmp = TempDir::new().unwrap();
    let dir = tmp.path().join("device-plugins");
    std::fs::create_dir(&dir).unwrap();
    let stale = dir.join("old-plugin.sock");
    let _listener = std::os::unix::net::UnixListener::bind(&stale).unwrap();
    std::fs::write(dir.join("notes.txt"), "kept").unwrap();
    let sim = Simulator::start(&dir).await.unwrap();
    assert!(!stale.exists());
    assert!(dir.join("notes.txt").exists());
    assert!(sim.socket().exists());
    sim.shutdown().await;
}

#[tokio::test]
async fn wait_until_times_out_with_the_last_state() {
    let (_dir, sim) = simulator().await;
    let err = sim
        .wait_until(RESOURCE, Duration::from_millis(50), |_| true)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("never registered"), "{err}");
    let _plugin = registered(&sim, options(false, false), &["a"]).await;
    let err = sim
        .wait_until(RESOURCE, Duration::from_millis(50), |r| r.allocatable == 5)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("allocatable: 1"), "{err}");
}

mod pod_resources {
    use tonic::transport::Channel;

    use super::*;
    use devicelet_api::deviceplugin::{Device, NumaNode, TopologyInfo};
    use devicelet_api::podresources::pod_resources_lister_client::PodResourcesListerClient;
    use devicelet_api::podresources::{
        self as pr, AllocatableResourcesRequest, ContainerDevices, ContainerResources,
        GetPodResourcesRequest, ListPodResourcesRequest, PodResources,
    };
    use devicelet_api::uds;

    const OTHER: &str = "devicelet.io/other";

    async fn client(sim: &Simulator) -> PodResourcesListerClient<Channel> {
        PodResourcesListerClient::new(uds::connect(sim.pod_resources_socket()).await.unwrap())
    }

    async fn list(client: &mut PodResourcesListerClient<Channel>) -> Vec<PodResources> {
        client
            .list(ListPodResourcesRequest {})
            .await
            .unwrap()
            .into_inner()
            .pod_resources
    }

    async fn get(
        client: &mut PodResourcesListerClient<Channel>,
        namespace: &str,
        name: &str,
    ) -> Result<PodResources, Status> {
        client
            .get(GetPodResourcesRequest {
                pod_name: name.to_owned(),
                pod_namespace: namespace.to_owned(),
            })
            .await
            .map(|r| r.into_inner().pod_resources.unwrap())
    }

    fn numa_device(id: &str, health: &str, nodes: &[i64]) -> Device {
        Device {
            id: id.to_owned(),
            health: health.to_owned(),
            topology: (!nodes.is_empty()).then(|| TopologyInfo {
                nodes: nodes.iter().map(|id| NumaNode { id: *id }).collect(),
            }),
        }
    }

    /// One kubelet entry: one device, on one NUMA node (or without topology).
    fn entry(resource: &str, id: &str, node: Option<i64>) -> ContainerDevices {
        ContainerDevices {
            resource_name: resource.to_owned(),
            device_ids: vec![id.to_owned()],
            topology: node.map(|id| pr::TopologyInfo {
                nodes: vec![pr::NumaNode { id }],
            }),
        }
    }

    fn container(name: &str, devices: Vec<ContainerDevices>) -> ContainerResources {
        ContainerResources {
            name: name.to_owned(),
            devices,
            ..Default::default()
        }
    }

    fn pod(namespace: &str, name: &str, containers: Vec<ContainerResources>) -> PodResources {
        PodResources {
            name: name.to_owned(),
            namespace: namespace.to_owned(),
            containers,
        }
    }

    #[tokio::test]
    async fn list_get_and_allocatable_over_the_socket() {
        let (_dir, sim) = simulator().await;
        let mut pods = client(&sim).await;
        assert_eq!(list(&mut pods).await, vec![]);

        let fake = FakePlugin::serve(
            sim.plugin_dir(),
            "fake-1.sock",
            options(false, false),
            vec![
                numa_device("d0", HEALTHY, &[0]),
                numa_device("d1", HEALTHY, &[1]),
                numa_device("d2", HEALTHY, &[0, 1]),
                numa_device("d3", HEALTHY, &[]),
                numa_device("d4", UNHEALTHY, &[0]),
            ],
        );
        fake.register(sim.socket(), RESOURCE).await.unwrap();
        let other = FakePlugin::serve(
            sim.plugin_dir(),
            "other-1.sock",
            options(false, false),
            healthy(&["o0", "o1"]),
        );
        other.register(sim.socket(), OTHER).await.unwrap();
        sim.wait_until(RESOURCE, WAIT, |r| r.snapshots >= 1)
            .await
            .unwrap();
        sim.wait_until(OTHER, WAIT, |r| r.snapshots >= 1)
            .await
            .unwrap();

        let trainer = PodRef::new("team-a", "trainer", "main");
        let sidecar = PodRef::new("team-a", "trainer", "sidecar");
        let a = sim.allocate_for(&trainer, RESOURCE, 2).await.unwrap();
        assert_eq!(
            (a.pod.clone(), a.device_ids.clone()),
            (trainer.clone(), vec!["d0".into(), "d1".into()])
        );
        let b = sim.allocate_for(&sidecar, RESOURCE, 1).await.unwrap();
        assert_eq!(b.device_ids, ["d2"]);
        sim.allocate_for(&trainer, OTHER, 1).await.unwrap();
        let generated = sim.allocate(RESOURCE, 1).await.unwrap();
        assert_eq!(
            generated.pod,
            PodRef::new("default", format!("pod-{}", generated.id), "main")
        );
        assert_eq!(generated.device_ids, ["d3"]);

        let expected_trainer = pod(
            "team-a",
            "trainer",
            vec![
                container(
                    "main",
                    vec![
                        entry(RESOURCE, "d0", Some(0)),
                        entry(RESOURCE, "d1", Some(1)),
                        entry(OTHER, "o0", Some(0)),
                    ],
                ),
                // A device on two NUMA nodes is reported once per node, as by the kubelet.
                container(
                    "sidecar",
                    vec![
                        entry(RESOURCE, "d2", Some(0)),
                        entry(RESOURCE, "d2", Some(1)),
                    ],
                ),
            ],
        );
        let expected_generated = pod(
            "default",
            &generated.pod.name,
            vec![container("main", vec![entry(RESOURCE, "d3", None)])],
        );
        assert_eq!(
            list(&mut pods).await,
            vec![expected_generated.clone(), expected_trainer.clone()]
        );
        assert_eq!(
            get(&mut pods, "team-a", "trainer").await.unwrap(),
            expected_trainer
        );
        assert_eq!(
            get(&mut pods, "default", &generated.pod.name)
                .await
                .unwrap(),
            expected_generated
        );
        // The kubelet answers an unknown pod with a plain error: code Unknown.
        let status = get(&mut pods, "team-b", "trainer").await.unwrap_err();
        assert_eq!(status.code(), Code::Unknown);
        assert_eq!(
            status.message(),
            "pod trainer in namespace team-b not found"
        );

        // Every healthy device, allocated or not; the unhealthy d4 is left out.
        let allocatable = pods
            .get_allocatable_resources(AllocatableResourcesRequest {})
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            allocatable.devices,
            vec![
                entry(RESOURCE, "d0", Some(0)),
                entry(RESOURCE, "d1", Some(1)),
                entry(RESOURCE, "d2", Some(0)),
                entry(RESOURCE, "d2", Some(1)),
                entry(RESOURCE, "d3", None),
                entry(OTHER, "o0", Some(0)),
                entry(OTHER, "o1", Some(0)),
            ]
        );
        assert!(allocatable.cpu_ids.is_empty() && allocatable.memory.is_empty());

        // A device turning unhealthy leaves GetAllocatableResources, not List.
        fake.fake.set_devices(vec![
            numa_device("d0", UNHEALTHY, &[0]),
            numa_device("d1", HEALTHY, &[1]),
        ]);
        sim.wait_until(RESOURCE, WAIT, |r| r.snapshots >= 2)
            .await
            .unwrap();
        let allocatable = pods
            .get_allocatable_resources(AllocatableResourcesRequest {})
            .await
            .unwrap()
            .into_inner()
            .devices;
        assert_eq!(allocatable[0], entry(RESOURCE, "d1", Some(1)));
        assert_eq!(allocatable.len(), 3);
        assert_eq!(
            get(&mut pods, "team-a", "trainer").await.unwrap(),
            expected_trainer
        );
    }

    #[tokio::test]
    async fn release_and_terminate_pod_free_devices_and_leave_list() {
        let (_dir, sim) = simulator().await;
        let _plugin = registered(&sim, options(false, false), &["a", "b"]).await;
        let mut pods = client(&sim).await;
        let mut events = sim.events();

        let main = PodRef::new("ns", "web", "main");
        let side = PodRef::new("ns", "web", "side");
        let first = sim.allocate_for(&main, RESOURCE, 1).await.unwrap();
        let second = sim.allocate_for(&side, RESOURCE, 1).await.unwrap();
        assert_eq!(
            (first.device_ids.as_slice(), second.device_ids.as_slice()),
            (&["a".to_owned()][..], &["b".to_owned()][..])
        );
        let err = sim.allocate_for(&main, RESOURCE, 1).await.unwrap_err();
        assert!(
            matches!(&err, SimError::AlreadyAllocated { allocation_id, .. } if *allocation_id == first.id),
            "{err}"
        );
        let err = sim
            .allocate_for(&PodRef::new("ns", "web", ""), RESOURCE, 1)
            .await
            .unwrap_err();
        assert!(matches!(err, SimError::InvalidPod { .. }), "{err}");

        // One container's allocation ends: its device is free, the pod stays with the other.
        sim.release(first.id);
        let listed = list(&mut pods).await;
        assert_eq!(listed.len(), 1);
        assert_eq!(listed[0].containers.len(), 1);
        assert_eq!(listed[0].containers[0].name, "side");
        let reused = sim.allocate(RESOURCE, 1).await.unwrap();
        assert_eq!(reused.device_ids, ["a"]);

        // The pod terminates: everything it held is free and it leaves List and Get.
        assert_eq!(sim.terminate_pod("ns", "web"), vec![second.id]);
        let listed = list(&mut pods).await;
        assert_eq!(listed.len(), 1);
        assert_eq!(listed[0].name, reused.pod.name);
        assert_eq!(
            get(&mut pods, "ns", "web").await.unwrap_err().code(),
            Code::Unknown
        );
        assert_eq!(sim.terminate_pod("ns", "web"), Vec::<u64>::new());
        let again = sim.allocate_for(&main, RESOURCE, 1).await.unwrap();
        assert_eq!(again.device_ids, ["b"]);

        sim.release(reused.id);
        sim.release(again.id);
        assert_eq!(list(&mut pods).await, vec![]);

        let mut released = Vec::new();
        while let Ok(event) = events.try_recv() {
            if let SimEvent::Released { id, pod, .. } = event {
                released.push((id, pod));
            }
        }
        assert_eq!(
            released,
            vec![
                (first.id, main.clone()),
                (second.id, side),
                (reused.id, reused.pod.clone()),
                (again.id, main),
            ]
        );
    }

    #[tokio::test]
    async fn pod_resources_keep_serving_across_restarts() {
        let (_dir, sim) = simulator().await;
        let plugin = FakePlugin::serve(
            sim.plugin_dir(),
            "fake-1.sock",
            options(false, false),
            vec![
                numa_device("a", HEALTHY, &[1]),
                numa_device("b", HEALTHY, &[0]),
            ],
        );
        plugin.register(sim.socket(), RESOURCE).await.unwrap();
        sim.wait_until(RESOURCE, WAIT, |r| r.snapshots >= 1)
            .await
            .unwrap();
        let worker = PodRef::new("batch", "job-1", "worker");
        sim.allocate_for(&worker, RESOURCE, 1).await.unwrap();
        let mut pods = client(&sim).await;
        let before = list(&mut pods).await;
        assert_eq!(
            before,
            vec![pod(
                "batch",
                "job-1",
                vec![container("worker", vec![entry(RESOURCE, "a", Some(1))])]
            )]
        );

        sim.restart().await.unwrap();
        sim.restart().await.unwrap();
        assert!(sim.pod_resources_socket().exists());
        // The same connection and a new one both still work; the allocation, with its NUMA
        // node, survived (the checkpoint), though no plugin reports devices yet.
        assert_eq!(list(&mut pods).await, before);
        assert_eq!(list(&mut client(&sim).await).await, before);
        let allocatable = pods
            .get_allocatable_resources(AllocatableResourcesRequest {})
            .await
            .unwrap()
            .into_inner();
        assert_eq!(allocatable.devices, vec![]);

        // Once the plugin is back, the held device is still not handed out again.
        drop(plugin);
        let plugin = FakePlugin::serve(
            sim.plugin_dir(),
            "fake-2.sock",
            options(false, false),
            healthy(&["a", "b"]),
        );
        register_retrying(&sim, &plugin).await;
        sim.wait_until(RESOURCE, WAIT, |r| r.registrations == 2 && r.snapshots >= 1)
            .await
            .unwrap();
        assert_eq!(sim.allocate(RESOURCE, 1).await.unwrap().device_ids, ["b"]);
        assert_eq!(list(&mut pods).await.len(), 2);
    }
}

mod plugin_watcher {
    use std::path::{Path, PathBuf};

    use super::*;
    use crate::fake::{RegistryPlugin, device_plugin_info};
    use devicelet_api::pluginregistration::{PluginInfo, RegistrationStatus};

    /// A simulator with the plugin-watcher route on `<tmp>/plugins_registry`.
    pub(super) async fn simulator_with_registry(
        config: SimConfig,
    ) -> (TempDir, Simulator, PathBuf) {
        let dir = TempDir::new().unwrap();
        let registry = dir.path().join("plugins_registry");
        let sim = Simulator::start_with(
            &dir.path().join("device-plugins"),
            SimConfig {
                plugins_registry: Some(registry.clone()),
                registry_retry: Duration::from_millis(50),
                ..config
            },
        )
        .await
        .unwrap();
        (dir, sim, registry)
    }

    fn registered_ok() -> RegistrationStatus {
        RegistrationStatus {
            plugin_registered: true,
            error: String::new(),
        }
    }

    fn attempts_for(sim: &Simulator, socket: &Path) -> Vec<RegistryAttempt> {
        sim.registry_attempts()
            .into_iter()
            .filter(|a| a.socket == socket)
            .collect()
    }

    /// Waits for at least `count` attempts on `socket`. An attempt is recorded once its
    /// `NotifyRegistrationStatus` call returned, so the plugin has received that status then.
    async fn wait_attempts(sim: &Simulator, socket: &Path, count: usize) -> Vec<RegistryAttempt> {
        sim.wait_registry(WAIT, |all| {
            all.iter().filter(|a| a.socket == socket).count() >= count
        })
        .await
        .unwrap();
        attempts_for(sim, socket)
    }

    /// Waits until the fake's ListAndWatch stream was cancelled by the simulator.
    async fn wait_cancelled(fake: &crate::fake::Fake, count: usize) {
        let deadline = std::time::Instant::now() + WAIT;
        while fake.cancelled_streams.load(Ordering::SeqCst) < count {
            assert!(std::time::Instant::now() < deadline, "stream not cancelled");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    #[tokio::test]
    async fn a_registry_socket_serving_both_services_is_registered_and_told_so() {
        let (_dir, sim, registry) = simulator_with_registry(test_config()).await;
        let socket = registry.join("fake.sock");
        let plugin = RegistryPlugin::serve(
            &socket,
            device_plugin_info(RESOURCE),
            options(false, true),
            healthy(&["a", "b"]),
        );

        let state = sim
            .wait_until(RESOURCE, WAIT, |r| r.snapshots >= 1)
            .await
            .unwrap();
        // An empty endpoint means the registration socket itself.
        assert_eq!(state.endpoint, socket.to_str().unwrap());
        assert_eq!(state.options, options(false, true));
        assert_eq!((state.registrations, state.allocatable), (1, 2));
        assert_eq!(
            plugin.fake.calls()[..2],
            [Call::Options, Call::ListAndWatch]
        );
        assert_eq!(
            plugin
                .registrar
                .wait_statuses(WAIT, |s| !s.is_empty())
                .await,
            [registered_ok()]
        );
        let attempts = sim.wait_registry(WAIT, |a| !a.is_empty()).await.unwrap();
        assert_eq!(
            attempts,
            [RegistryAttempt {
                socket: socket.clone(),
                info: Some(device_plugin_info(RESOURCE)),
                error: None,
                notified: Some(Ok(())),
                retry: false,
            }]
        );
        assert_eq!(
            sim.registry_sockets(),
            [(socket.clone(), Some(RESOURCE.to_owned()))].into()
        );
        // The device manager uses it like any registered plugin.
        let allocation = sim.allocate(RESOURCE, 1).await.unwrap();
        assert_eq!(allocation.device_ids, ["a"]);
        assert_eq!(plugin.registrar.get_info_calls.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn plugin_info_the_kubelet_refuses_is_notified_with_the_reason_and_retried() {
        let (_dir, sim, registry) = simulator_with_registry(test_config()).await;
        let info = |r#type: &str, name: &str, versions: &[&str]| PluginInfo {
            r#type: r#type.to_owned(),
            name: name.to_owned(),
            endpoint: String::new(),
            supported_versions: versions.iter().map(|v| (*v).to_owned()).collect(),
        };
        let cases = [
            (
                info("CSIPlugin", RESOURCE, &[VERSION]),
                "no handler registered for plugin type: CSIPlugin",
            ),
            (
                info("deviceplugin", RESOURCE, &[VERSION]),
                "no handler registered for plugin type: deviceplugin",
            ),
            (
                info("DevicePlugin", "fake", &[VERSION]),
                "invalid name of device plugin socket: the ResourceName \"fake\" is invalid",
            ),
            (
                info("DevicePlugin", "kubernetes.io/fake", &[VERSION]),
                "the ResourceName \"kubernetes.io/fake\" is invalid",
            ),
            (
                info("DevicePlugin", RESOURCE, &["v1alpha1"]),
                "manager version, v1beta1, is not among plugin supported versions [\"v1alpha1\"]",
            ),
            (
                info("DevicePlugin", RESOURCE, &[]),
                "is not among plugin supported versions []",
            ),
        ];
        let plugins: Vec<_> = cases
            .iter()
            .enumerate()
            .map(|(i, (info, _))| {
                RegistryPlugin::serve(
                    &registry.join(format!("bad-{i}.sock")),
                    info.clone(),
                    options(false, false),
                    healthy(&["a"]),
                )
            })
            .collect();
        for (plugin, (_, why)) in plugins.iter().zip(&cases) {
            // Retried: refused twice at least, and told so with the reason each time.
            let attempts = wait_attempts(&sim, &plugin.socket, 2).await;
            assert!(attempts.iter().all(|a| !a.registered() && a.retry));
            assert!(attempts.iter().all(|a| a.notified == Some(Ok(()))));
            let statuses = plugin.registrar.statuses();
            assert!(statuses.len() >= attempts.len(), "{statuses:?}");
            for status in &statuses {
                assert!(!status.plugin_registered, "{status:?}");
                assert!(status.error.contains(why), "{why}: {status:?}");
                assert!(status.error.starts_with("RegisterPlugin error -- "));
            }
            assert_eq!(attempts[0].error.as_deref(), Some(&*statuses[0].error));
            // Nothing reached the device manager.
            assert_eq!(plugin.fake.calls(), vec![]);
        }
        assert_eq!(sim.resources(), vec![]);

        // Fixed, the next retry registers it.
        *plugins[4].registrar.info.lock().unwrap() = device_plugin_info(RESOURCE);
        sim.wait_until(RESOURCE, WAIT, |r| r.snapshots >= 1)
            .await
            .unwrap();
        let statuses = plugins[4]
            .registrar
            .wait_statuses(WAIT, |s| s.last() == Some(&registered_ok()))
            .await;
        assert!(statuses.len() >= 3, "{statuses:?}");
    }

    #[tokio::test]
    async fn an_endpoint_path_is_dialed_for_the_device_plugin_api() {
        let (dir, sim, registry) = simulator_with_registry(test_config()).await;
        let endpoint_dir = dir.path().join("vendor");
        std::fs::create_dir(&endpoint_dir).unwrap();
        let device_plugin = FakePlugin::serve(
            &endpoint_dir,
            "dp.sock",
            options(true, false),
            healthy(&["x", "y", "z"]),
        );
        let endpoint = endpoint_dir.join("dp.sock");
        let plugin = RegistryPlugin::serve(
            &registry.join("reg.sock"),
            PluginInfo {
                endpoint: endpoint.to_str().unwrap().to_owned(),
                ..device_plugin_info(RESOURCE)
            },
            options(false, false),
            healthy(&["wrong"]),
        );
        let state = sim
            .wait_until(RESOURCE, WAIT, |r| r.snapshots >= 1)
            .await
            .unwrap();
        assert_eq!(state.endpoint, endpoint.to_str().unwrap());
        assert_eq!(state.options, options(true, false));
        assert_eq!(state.capacity, 3);
        plugin
            .registrar
            .wait_statuses(WAIT, |s| s == [registered_ok()])
            .await;
        assert_eq!(
            device_plugin.fake.calls()[..2],
            [Call::Options, Call::ListAndWatch]
        );
        // The registration socket's own DevicePlugin service is not used.
        assert_eq!(plugin.fake.calls(), vec![]);
    }

    #[tokio::test]
    async fn a_device_manager_failure_is_notified_and_not_retried() {
        let (dir, sim, registry) = simulator_with_registry(test_config()).await;
        let failing = RegistryPlugin::serve(
            &registry.join("failing.sock"),
            device_plugin_info(RESOURCE),
            options(false, false),
            healthy(&["a"]),
        );
        *failing.fake.options_error.lock().unwrap() =
            Some(Status::internal("module fake-gpu trapped"));
        let attempts = wait_attempts(&sim, &failing.socket, 1).await;
        let statuses = failing.registrar.statuses();
        assert_eq!(statuses.len(), 1);
        assert!(!statuses[0].plugin_registered);
        assert!(
            statuses[0].error.contains("plugin registration failed")
                && statuses[0]
                    .error
                    .contains("failed to get device plugin options")
                && statuses[0].error.contains("module fake-gpu trapped"),
            "{statuses:?}"
        );
        assert_eq!(attempts.len(), 1);
        assert!(!attempts[0].retry);
        assert_eq!(attempts[0].error.as_ref(), Some(&statuses[0].error));
        assert!(sim.resource(RESOURCE).is_none());

        // An endpoint nothing serves, and a relative one.
        for (name, endpoint, why) in [
            (
                "nobody.sock",
                dir.path().join("nobody.sock").to_str().unwrap().to_owned(),
                "cannot connect to the device plugin",
            ),
            (
                "relative.sock",
                "dp.sock".to_owned(),
                "not an absolute path",
            ),
        ] {
            let plugin = RegistryPlugin::serve(
                &registry.join(name),
                PluginInfo {
                    endpoint,
                    ..device_plugin_info(RESOURCE)
                },
                options(false, false),
                healthy(&["a"]),
            );
            let attempts = wait_attempts(&sim, &plugin.socket, 1).await;
            assert!(!attempts[0].retry);
            let statuses = plugin.registrar.statuses();
            assert!(!statuses[0].plugin_registered);
            assert!(statuses[0].error.contains(why), "{statuses:?}");
        }
        assert!(sim.resource(RESOURCE).is_none());
        assert_eq!(failing.registrar.get_info_calls.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn removing_the_socket_deregisters_the_plugin() {
        let (_dir, sim, registry) = simulator_with_registry(test_config()).await;
        // In a subdirectory made after the simulator started: watched recursively.
        let socket = registry.join("vendor/fake.sock");
        let plugin = RegistryPlugin::serve(
            &socket,
            device_plugin_info(RESOURCE),
            options(false, false),
            healthy(&["a", "b"]),
        );
        sim.wait_until(RESOURCE, WAIT, |r| r.allocatable == 2)
            .await
            .unwrap();
        let mut events = sim.events();

        std::fs::remove_file(&socket).unwrap();
        let state = sim
            .wait_until(RESOURCE, WAIT, |r| !r.streaming)
            .await
            .unwrap();
        assert_eq!((state.capacity, state.allocatable), (2, 0));
        wait_cancelled(&plugin.fake, 1).await;
        assert!(matches!(
            sim.allocate(RESOURCE, 1).await,
            Err(SimError::Insufficient { available: 0, .. })
        ));
        assert!(sim.registry_sockets().is_empty());
        let mut seen = Vec::new();
        while let Ok(event) = events.try_recv() {
            seen.push(event);
        }
        assert!(
            matches!(&seen[..], [
                SimEvent::StreamEnded { resource, reason },
                SimEvent::RegistryRemoved { socket: removed, resource: Some(name) },
            ] if resource == RESOURCE && reason.contains("removed") && *removed == socket
                && name == RESOURCE),
            "{seen:?}"
        );

        // Served again at the same path: registered again.
        drop(plugin);
        let plugin = RegistryPlugin::serve(
            &socket,
            device_plugin_info(RESOURCE),
            options(false, false),
            healthy(&["a", "b"]),
        );
        sim.wait_until(RESOURCE, WAIT, |r| {
            r.registrations == 2 && r.allocatable == 2
        })
        .await
        .unwrap();
        plugin
            .registrar
            .wait_statuses(WAIT, |s| s == [registered_ok()])
            .await;
    }

    #[tokio::test]
    async fn removing_a_registry_socket_cuts_whichever_client_holds_its_name() {
        // The kubelet's DeRegisterPlugin disconnects the client registered under the name now,
        // even one that a later registration put there.
        let (_dir, sim, registry) = simulator_with_registry(test_config()).await;
        let socket = registry.join("old.sock");
        let _old = RegistryPlugin::serve(
            &socket,
            device_plugin_info(RESOURCE),
            options(false, false),
            healthy(&["a"]),
        );
        sim.wait_until(RESOURCE, WAIT, |r| r.snapshots >= 1)
            .await
            .unwrap();
        let new = FakePlugin::serve(
            sim.plugin_dir(),
            "new.sock",
            options(false, false),
            healthy(&["b"]),
        );
        new.register(sim.socket(), RESOURCE).await.unwrap();
        sim.wait_until(RESOURCE, WAIT, |r| r.registrations == 2 && r.snapshots >= 1)
            .await
            .unwrap();

        std::fs::remove_file(&socket).unwrap();
        let state = sim
            .wait_until(RESOURCE, WAIT, |r| !r.streaming)
            .await
            .unwrap();
        assert_eq!(state.endpoint, "new.sock");
        assert_eq!(state.allocatable, 0);
        wait_cancelled(&new.fake, 1).await;
    }

    #[tokio::test]
    async fn a_restarted_kubelet_finds_registry_plugins_again_by_itself() {
        // kubelet.sock refuses connections for the whole test after the restart: the plugin
        // watcher needs nothing from it.
        let (_dir, sim, registry) = simulator_with_registry(SimConfig {
            accept_delay: Duration::from_secs(600),
            ..test_config()
        })
        .await;
        let socket = registry.join("fake.sock");
        // Serving before the simulator's watcher starts would be found by the start-up scan
        // too; here the restart's scan is the one under test.
        let plugin = RegistryPlugin::serve(
            &socket,
            device_plugin_info(RESOURCE),
            options(false, false),
            healthy(&["a", "b"]),
        );
        sim.wait_until(RESOURCE, WAIT, |r| r.snapshots >= 1)
            .await
            .unwrap();
        let held = sim.allocate(RESOURCE, 1).await.unwrap();

        sim.restart().await.unwrap();
        assert!(socket.exists(), "the restart wiped plugins_registry");
        let state = sim
            .wait_until(RESOURCE, WAIT, |r| r.registrations == 2 && r.snapshots >= 1)
            .await
            .unwrap();
        assert_eq!((state.capacity, state.allocatable), (2, 2));
        let refused = tokio::net::UnixStream::connect(sim.socket()).await;
        assert_eq!(
            refused.unwrap_err().kind(),
            std::io::ErrorKind::ConnectionRefused
        );
        assert_eq!(plugin.registrar.get_info_calls.load(Ordering::SeqCst), 2);
        plugin
            .registrar
            .wait_statuses(WAIT, |s| s == [registered_ok(), registered_ok()])
            .await;
        wait_cancelled(&plugin.fake, 1).await;
        // The allocation survived; the other device is the one left.
        assert_eq!(sim.allocate(RESOURCE, 1).await.unwrap().device_ids, ["b"]);
        assert_eq!(held.device_ids, ["a"]);
    }

    #[tokio::test]
    async fn plugins_already_in_the_registry_are_found_at_start() {
        let dir = TempDir::new().unwrap();
        let registry = dir.path().join("plugins_registry");
        let plugin = RegistryPlugin::serve(
            &registry.join("early.sock"),
            device_plugin_info(RESOURCE),
            options(false, false),
            healthy(&["a"]),
        );
        // A hidden socket is ignored, as by the kubelet.
        let hidden = RegistryPlugin::serve(
            &registry.join(".hidden.sock"),
            device_plugin_info("devicelet.io/hidden"),
            options(false, false),
            healthy(&["h"]),
        );
        let sim = Simulator::start_with(
            &dir.path().join("device-plugins"),
            SimConfig {
                plugins_registry: Some(registry.clone()),
                ..test_config()
            },
        )
        .await
        .unwrap();
        assert_eq!(sim.plugins_registry(), Some(registry.as_path()));
        sim.wait_until(RESOURCE, WAIT, |r| r.snapshots >= 1)
            .await
            .unwrap();
        plugin
            .registrar
            .wait_statuses(WAIT, |s| s == [registered_ok()])
            .await;
        assert_eq!(hidden.registrar.get_info_calls.load(Ordering::SeqCst), 0);
        assert_eq!(
            sim.registry_sockets(),
            [(plugin.socket.clone(), Some(RESOURCE.to_owned()))].into()
        );
    }

    #[tokio::test]
    async fn the_socket_path_is_sent_as_authority() {
        // A tonic server that does not rewrite `:authority` refuses the path the watcher sends,
        // before any service sees the call: what an agent without the rewriter would get from a
        // real kubelet.
        let (_dir, sim, registry) = simulator_with_registry(test_config()).await;
        let plugin = RegistryPlugin::serve_with(
            &registry.join("plain.sock"),
            device_plugin_info(RESOURCE),
            options(false, false),
            healthy(&["a"]),
            false,
        );
        let attempts = sim.wait_registry(WAIT, |a| a.len() >= 2).await.unwrap();
        for attempt in &attempts {
            let error = attempt.error.as_deref().unwrap();
            assert!(
                error.contains("failed to get plugin info using RPC GetInfo"),
                "{attempt:?}"
            );
            assert!(attempt.retry && attempt.info.is_none() && attempt.notified.is_none());
        }
        assert_eq!(plugin.registrar.get_info_calls.load(Ordering::SeqCst), 0);
        assert!(sim.resource(RESOURCE).is_none());
    }
}

mod dra_plugins {
    use std::path::PathBuf;

    use super::*;
    use crate::fake::{FakeDraPlugin, dra_plugin_info};
    use devicelet_api::dra::v1::Claim;

    const DRIVER: &str = "gpu.example.com";

    async fn simulator() -> (TempDir, Simulator, PathBuf) {
        super::plugin_watcher::simulator_with_registry(test_config()).await
    }

    fn claim(uid: &str) -> Claim {
        Claim {
            namespace: "default".into(),
            uid: uid.into(),
            name: format!("claim-{uid}"),
        }
    }

    /// The helper library's layout: `<driver>-reg.sock` in `plugins_registry`, the service on
    /// `plugins/<driver>/dra.sock`.
    fn serve(
        dir: &TempDir,
        registry: &std::path::Path,
        versions: &[&str],
        name: &str,
    ) -> FakeDraPlugin {
        let endpoint = dir.path().join("plugins").join(DRIVER).join(name);
        FakeDraPlugin::serve(
            &registry.join(format!("{DRIVER}-{name}-reg.sock")),
            &endpoint,
            dra_plugin_info(DRIVER, &endpoint, versions),
        )
    }

    async fn registered(sim: &Simulator, count: usize) -> Vec<DraRegistration> {
        sim.wait_registry(WAIT, |a| {
            a.iter().filter(|a| a.registered()).count() >= count
        })
        .await
        .unwrap();
        sim.dra_registrations()
    }

    #[tokio::test]
    async fn a_dra_driver_registers_through_the_plugin_watcher_and_is_called_on_the_service_it_listed_first()
     {
        let (dir, sim, registry) = simulator().await;
        let plugin = serve(
            &dir,
            &registry,
            &["v1beta1.DRAPlugin", "v1.DRAPlugin"],
            "dra.sock",
        );
        let drivers = registered(&sim, 1).await;
        assert_eq!(drivers.len(), 1);
        assert_eq!(drivers[0].driver, DRIVER);
        // The plugin's order decides, not the kubelet's.
        assert_eq!(drivers[0].service, DraService::V1beta1);
        plugin
            .registrar
            .wait_statuses(WAIT, |s| s.iter().any(|s| s.plugin_registered))
            .await;

        let prepared = sim
            .node_prepare_resources(DRIVER, vec![claim("u1"), claim("u2")])
            .await
            .unwrap();
        assert_eq!(prepared.claims.len(), 2);
        let device = &prepared.claims["u1"].devices[0];
        assert_eq!(device.device_name, "dev-u1");
        assert_eq!(device.cdi_device_ids, ["example.com/gpu=u1"]);
        sim.node_unprepare_resources(DRIVER, vec![claim("u1")])
            .await
            .unwrap();
        assert_eq!(
            plugin.calls(),
            [
                ("v1beta1", "prepare", "u1".to_string()),
                ("v1beta1", "prepare", "u2".to_string()),
                ("v1beta1", "unprepare", "u1".to_string()),
            ]
        );
    }

    #[tokio::test]
    async fn services_the_kubelet_does_not_speak_are_refused_in_its_words_and_retried() {
        let (dir, sim, registry) = simulator().await;
        let plugin = serve(&dir, &registry, &["v1alpha4.DRAPlugin"], "dra.sock");
        let attempts = sim.wait_registry(WAIT, |a| a.len() >= 2).await.unwrap();
        let error = attempts[0].error.clone().unwrap();
        assert!(
            error.starts_with("RegisterPlugin error -- plugin validation failed with err: invalid supported gRPC versions of DRA driver plugin gpu.example.com at endpoint "),
            "{error}"
        );
        assert!(
            error.ends_with(
                r#"none of services supported by the plugin (["v1alpha4.DRAPlugin"]) are supported by the kubelet (["v1.DRAPlugin" "v1beta1.DRAPlugin"])"#
            ),
            "{error}"
        );
        assert!(attempts[0].retry);
        assert!(sim.dra_registrations().is_empty());
        let statuses = plugin.registrar.statuses();
        assert!(
            statuses
                .iter()
                .all(|s| !s.plugin_registered && s.error == error)
        );
        // Not registered: the kubelet's GetPlugin wording.
        let err = sim
            .node_prepare_resources(DRIVER, vec![claim("u1")])
            .await
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "DRA driver gpu.example.com is not registered"
        );

        *plugin.registrar.info.lock().unwrap() = dra_plugin_info(
            DRIVER,
            &dir.path().join("plugins").join(DRIVER).join("dra.sock"),
            &[],
        );
        let attempts = sim
            .wait_registry(WAIT, |a| {
                a.last()
                    .and_then(|a| a.error.as_deref())
                    .is_some_and(|e| e.contains("empty list"))
            })
            .await
            .unwrap();
        assert!(
            attempts
                .last()
                .unwrap()
                .error
                .as_deref()
                .unwrap()
                .ends_with("empty list of supported gRPC services (aka supported versions)")
        );
    }

    #[tokio::test]
    async fn during_a_rolling_update_the_newest_connected_endpoint_serves_and_removal_deregisters_only_it()
     {
        let (dir, sim, registry) = simulator().await;
        let old = serve(&dir, &registry, &["v1.DRAPlugin"], "dra-old.sock");
        registered(&sim, 1).await;
        let new = serve(
            &dir,
            &registry,
            &["v1.DRAPlugin", "v1beta1.DRAPlugin"],
            "dra-new.sock",
        );
        let drivers = registered(&sim, 2).await;
        assert_eq!(drivers.len(), 2);
        assert!(drivers.iter().all(|d| d.service == DraService::V1));

        sim.node_prepare_resources(DRIVER, vec![claim("a")])
            .await
            .unwrap();
        assert_eq!(new.calls(), [("v1", "prepare", "a".to_string())]);
        assert!(old.calls().is_empty());

        // The new endpoint stops accepting connections (its pod is going): the old one, still
        // connected, serves.
        drop(new);
        std::fs::remove_file(dir.path().join("plugins").join(DRIVER).join("dra-new.sock")).unwrap();
        sim.node_prepare_resources(DRIVER, vec![claim("b")])
            .await
            .unwrap();
        assert_eq!(old.calls(), [("v1", "prepare", "b".to_string())]);

        // Its registration socket removed: that endpoint alone is deregistered.
        std::fs::remove_file(registry.join(format!("{DRIVER}-dra-new.sock-reg.sock"))).unwrap();
        let deadline = std::time::Instant::now() + WAIT;
        while sim.dra_registrations().len() != 1 {
            assert!(std::time::Instant::now() < deadline, "not deregistered");
            sim.wait_registry(Duration::from_millis(50), |_| false)
                .await
                .ok();
        }
        assert!(
            sim.dra_registrations()[0]
                .endpoint
                .ends_with("dra-old.sock")
        );
    }

    #[tokio::test]
    async fn a_kubelet_restart_forgets_dra_drivers_and_its_scan_registers_them_again() {
        let (dir, sim, registry) = simulator().await;
        let _plugin = serve(&dir, &registry, &["v1.DRAPlugin"], "dra.sock");
        registered(&sim, 1).await;
        sim.restart().await.unwrap();
        registered(&sim, 2).await;
        assert_eq!(sim.dra_registrations().len(), 1);
        sim.node_prepare_resources(DRIVER, vec![claim("u")])
            .await
            .unwrap();
    }
}

mod api_server {
    use serde_json::{Value, json};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use crate::apiserver::{ApiServer, Kind};

    const SLICES: &str = "/apis/resource.k8s.io/v1/resourceslices";
    const CLAIMS: &str = "/apis/resource.k8s.io/v1/namespaces/ns/resourceclaims";

    /// One HTTP/1.1 request as a client library sends it; the status and the JSON answer.
    async fn http(api: &ApiServer, method: &str, path: &str, body: Option<&Value>) -> (u16, Value) {
        http_as(api, method, path, "application/json", body).await
    }

    async fn http_as(
        api: &ApiServer,
        method: &str,
        path: &str,
        content_type: &str,
        body: Option<&Value>,
    ) -> (u16, Value) {
        let addr = api.url().trim_start_matches("http://").to_string();
        let mut stream = tokio::net::TcpStream::connect(&addr).await.unwrap();
        let body = body.map(|b| b.to_string()).unwrap_or_default();
        let request = format!(
            "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nAccept: application/json\r\n\
             Content-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut answer = String::new();
        stream.read_to_string(&mut answer).await.unwrap();
        let status = answer[9..12].parse().unwrap();
        let (_, json) = answer.split_once("\r\n\r\n").unwrap();
        (status, serde_json::from_str(json).unwrap())
    }

    /// Creates a slice as a client does: the status and the object or error.
    async fn post(api: &ApiServer, slice: Value) -> (u16, Value) {
        http(api, "POST", SLICES, Some(&slice)).await
    }

    fn slice(node: &str, driver: &str, devices: usize) -> Value {
        let devices: Vec<Value> = (0..devices)
            .map(|i| json!({"name": format!("gpu-{i}"), "attributes": {"index": {"int": i}}}))
            .collect();
        json!({
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {"generateName": format!("{node}-{driver}-")},
            "spec": {
                "driver": driver,
                "nodeName": node,
                "pool": {"name": node, "generation": 0, "resourceSliceCount": 1},
                "devices": devices,
            }
        })
    }

    #[tokio::test]
    async fn slices_are_created_with_generated_names_and_listed_by_field_selector() {
        let api = ApiServer::start().await.unwrap();
        let (code, created) = post(&api, slice("node-a", "gpu.example.com", 2)).await;
        assert_eq!(code, 201, "{created}");
        let name = created["metadata"]["name"].as_str().unwrap();
        assert!(name.starts_with("node-a-gpu.example.com-"), "{name}");
        assert!(
            created["metadata"]["uid"]
                .as_str()
                .is_some_and(|u| !u.is_empty())
        );
        assert!(created["metadata"]["resourceVersion"].is_string());
        post(&api, slice("node-b", "gpu.example.com", 1)).await;
        post(&api, slice("node-a", "fuse.devicelet.io", 1)).await;

        let (code, list) = http(
            &api,
            "GET",
            &format!(
                "{SLICES}?fieldSelector=spec.driver%3Dgpu.example.com%2Cspec.nodeName%3Dnode-a"
            ),
            None,
        )
        .await;
        assert_eq!(code, 200);
        assert_eq!(list["kind"], "ResourceSliceList");
        let items = list["items"].as_array().unwrap();
        assert_eq!(items.len(), 1);
        assert_eq!(items[0]["metadata"]["name"], name);
        assert_eq!(api.list(Kind::ResourceSlice).len(), 3);

        let (code, status) = http(&api, "GET", &format!("{SLICES}/nope"), None).await;
        assert_eq!((code, status["reason"].as_str()), (404, Some("NotFound")));
        assert_eq!(
            status["message"],
            "resourceslices.resource.k8s.io \"nope\" not found"
        );
        // A watch without a version starts with an ADDED for each object it selects, and ends
        // when its timeoutSeconds is up.
        let addr = api.url().trim_start_matches("http://").to_string();
        let mut stream = tokio::net::TcpStream::connect(&addr).await.unwrap();
        let request = format!(
            "GET {SLICES}?watch=true&timeoutSeconds=1&fieldSelector=spec.driver%3Dgpu.example.com\
             %2Cspec.nodeName%3Dnode-a HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
        );
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut answer = String::new();
        stream.read_to_string(&mut answer).await.unwrap();
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert_eq!(answer.matches(r#""type":"ADDED""#).count(), 1, "{answer}");
        assert!(answer.contains(name), "{answer}");
    }

    #[tokio::test]
    async fn an_update_with_a_stale_resource_version_is_a_conflict() {
        let api = ApiServer::start().await.unwrap();
        let (_, created) = post(&api, slice("node-a", "gpu.example.com", 1)).await;
        let name = created["metadata"]["name"].as_str().unwrap().to_string();
        let mut changed = created.clone();
        changed["spec"]["pool"]["generation"] = json!(1);
        let (code, updated) = http(&api, "PUT", &format!("{SLICES}/{name}"), Some(&changed)).await;
        assert_eq!(code, 200, "{updated}");
        assert_eq!(updated["metadata"]["generation"], 2);
        assert_ne!(
            updated["metadata"]["resourceVersion"],
            created["metadata"]["resourceVersion"]
        );

        // The first copy again: someone else wrote in between.
        let (code, status) = http(&api, "PUT", &format!("{SLICES}/{name}"), Some(&created)).await;
        assert_eq!((code, status["reason"].as_str()), (409, Some("Conflict")));
        assert!(
            status["message"]
                .as_str()
                .unwrap()
                .contains("the object has been modified"),
            "{status}"
        );
    }

    #[tokio::test]
    async fn slices_past_the_api_limits_are_invalid_with_each_field_named() {
        let api = ApiServer::start().await.unwrap();
        let (code, status) = post(&api, slice("node-a", "gpu.example.com", 129)).await;
        assert_eq!((code, status["reason"].as_str()), (422, Some("Invalid")));
        let message = status["message"].as_str().unwrap();
        assert!(
            message.contains("spec.devices: Too many: 129: must have at most 128 items"),
            "{message}"
        );

        let mut bad = slice("node-a", "GPU_example", 2);
        bad["spec"]["devices"][0]["name"] = json!("0000:3b:00.0");
        bad["spec"]["devices"][1]["attributes"]["index"] = json!({"int": 1, "string": "x"});
        bad["spec"]["devices"][1]["attributes"]["example.com/bad-name"] = json!({"bool": true});
        bad["spec"]["allNodes"] = json!(true);
        bad["spec"]["pool"]["resourceSliceCount"] = json!(0);
        bad["spec"]["sharedCounters"] = json!([{"name": "GPU 0", "counters": {}}]);
        let consumption = json!({"counterSet": "gpu-0", "counters": {}});
        bad["spec"]["devices"][1]["consumesCounters"] =
            json!([consumption.clone(), consumption.clone(), consumption]);
        let (code, status) = http(&api, "POST", SLICES, Some(&bad)).await;
        assert_eq!(code, 422);
        let message = status["message"].as_str().unwrap();
        for cause in [
            "spec.driver: Invalid value: \"GPU_example\"",
            "spec.devices[0].name: Invalid value: \"0000:3b:00.0\": a lowercase RFC 1123 label",
            "spec.devices[1].attributes[\"index\"]: Invalid value: [\"int\", \"string\"]: exactly one value",
            "spec.devices[1].attributes[\"example.com/bad-name\"]: Invalid value: \"bad-name\": a C identifier",
            "exactly one of `nodeName`, `nodeSelector`, `allNodes`, `perDeviceNodeSelection` is required",
            "spec.pool.resourceSliceCount: Invalid value: must be greater than zero",
            "spec: Invalid value: only one of `devices` and `sharedCounters` may be set",
            "spec.sharedCounters[0].name: Invalid value: \"GPU 0\"",
            "spec.sharedCounters[0].counters: Invalid value: 0: must have between 1 and 32",
            "spec.devices[1].consumesCounters: Too many: 3: must have at most 2 items",
        ] {
            assert!(message.contains(cause), "{cause:?} not in {message}");
        }
        assert!(api.list(Kind::ResourceSlice).is_empty());
    }

    #[tokio::test]
    async fn taints_are_validated_stamped_and_dropped_when_the_feature_is_off() {
        let api = ApiServer::start().await.unwrap();
        let mut bad = slice("node-a", "gpu.example.com", 65);
        bad["spec"]["devices"][0]["taints"] = json!([
            {"key": "devicelet.io/unhealthy", "value": "xid 79", "effect": "NoSchedule"},
            {"key": "-bad", "effect": "PreferNoSchedule"},
            {"key": "example.com/ok"}
        ]);
        let (code, status) = http(&api, "POST", SLICES, Some(&bad)).await;
        assert_eq!(code, 422);
        let message = status["message"].as_str().unwrap();
        for cause in [
            "spec.devices: Too many: 65: must have at most 64 items",
            "spec.devices[0].taints[0].value: Invalid value: \"xid 79\": a valid label",
            "spec.devices[0].taints[1].key: Invalid value: \"-bad\"",
            "spec.devices[0].taints[1].effect: Unsupported value: \"PreferNoSchedule\"",
            "spec.devices[0].taints[2].effect: Required value",
        ] {
            assert!(message.contains(cause), "{cause:?} not in {message}");
        }

        // Accepted, with the time the server added it.
        let mut good = slice("node-a", "gpu.example.com", 2);
        good["spec"]["devices"][1]["taints"] =
            json!([{"key": "devicelet.io/unhealthy", "value": "xid-79", "effect": "NoSchedule"}]);
        let (code, stored) = post(&api, good.clone()).await;
        assert_eq!(code, 201, "{stored}");
        let time = stored["spec"]["devices"][1]["taints"][0]["timeAdded"]
            .as_str()
            .expect("timeAdded set by the server");
        assert!(time.ends_with('Z') && time.len() == 20, "{time}");

        // With the feature off, a new slice's taints are dropped without a word; a stored
        // slice that already has some keeps them.
        api.drop_device_taints();
        let (code, second) = post(&api, slice_with_taint("node-b")).await;
        assert_eq!(code, 201);
        assert!(
            second["spec"]["devices"][1].get("taints").is_none(),
            "{second}"
        );
        let name = stored["metadata"]["name"].as_str().unwrap();
        let mut again = stored.clone();
        again["spec"]["devices"][0]["taints"] =
            json!([{"key": "devicelet.io/unhealthy", "effect": "NoSchedule"}]);
        let (code, kept) = http(&api, "PUT", &format!("{SLICES}/{name}"), Some(&again)).await;
        assert_eq!(code, 200, "{kept}");
        assert_eq!(
            kept["spec"]["devices"][0]["taints"][0]["key"],
            "devicelet.io/unhealthy"
        );
    }

    fn slice_with_taint(node: &str) -> serde_json::Value {
        let mut s = slice(node, "gpu.example.com", 2);
        s["spec"]["devices"][1]["taints"] =
            json!([{"key": "devicelet.io/unhealthy", "effect": "NoSchedule"}]);
        s
    }

    #[tokio::test]
    async fn claim_status_is_applied_per_field_manager_and_validated() {
        let api = ApiServer::start().await.unwrap();
        let result = |driver: &str, device: &str| json!({"request": "r", "driver": driver, "pool": "node-a", "device": device});
        api.create(
            Kind::ResourceClaim,
            "ns",
            json!({
                "metadata": {"name": "c"},
                "spec": {},
                "status": {"allocation": {"devices": {"results": [
                    result("gpu.example.com", "gpu-0"), result("nic.example.com", "nic-0")
                ]}}}
            }),
        )
        .unwrap();
        let entry = |driver: &str, device: &str, reason: &str| {
            json!({"driver": driver, "pool": "node-a", "device": device,
                   "conditions": [{"type": "Ready", "status": "True", "reason": reason,
                                   "message": "", "lastTransitionTime": "2026-11-28T19:00:00Z"}],
                   "data": {"deviceIDs": ["x"]}})
        };
        let apply = |manager: &str, devices: Value| {
            let body = json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                              "metadata": {"name": "c"}, "status": {"devices": devices}});
            let path = format!("{CLAIMS}/c/status?fieldManager={manager}&force=true");
            let api = &api;
            async move {
                http_as(
                    api,
                    "PATCH",
                    &path,
                    "application/apply-patch+yaml",
                    Some(&body),
                )
                .await
            }
        };
        let (code, _) = apply(
            "gpu.example.com",
            json!([entry("gpu.example.com", "gpu-0", "Prepared")]),
        )
        .await;
        assert_eq!(code, 200);
        let (code, _) = apply(
            "nic.example.com",
            json!([entry("nic.example.com", "nic-0", "Prepared")]),
        )
        .await;
        assert_eq!(code, 200);
        let devices = |api: &ApiServer| -> Vec<String> {
            api.get(Kind::ResourceClaim, "ns", "c").unwrap()["status"]["devices"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|d| d["device"].as_str().unwrap().to_owned())
                .collect()
        };
        assert_eq!(devices(&api), ["gpu-0", "nic-0"]);
        // An empty apply removes only that manager's entries.
        let (code, _) = apply("gpu.example.com", json!([])).await;
        assert_eq!(code, 200);
        assert_eq!(devices(&api), ["nic-0"]);

        // Refused: a device the claim was not allocated, a bad condition; and a merge patch.
        let (code, status) = apply(
            "gpu.example.com",
            json!([entry("gpu.example.com", "gpu-9", "not a reason")]),
        )
        .await;
        assert_eq!(code, 422);
        let message = status["message"].as_str().unwrap();
        for cause in [
            "status.devices[1]: Invalid value: {driver: \"gpu.example.com\", pool: \"node-a\", device: \"gpu-9\"}: must be an allocated device in the claim",
            "status.devices[1].conditions[0].reason: Invalid value: \"not a reason\"",
        ] {
            assert!(message.contains(cause), "{cause:?} not in {message}");
        }
        assert_eq!(
            devices(&api),
            ["nic-0"],
            "nothing of a refused apply is kept"
        );
        let (code, _) = http(
            &api,
            "PATCH",
            &format!("{CLAIMS}/c/status?fieldManager=x"),
            Some(&json!({})),
        )
        .await;
        assert_eq!(code, 415);
        assert!(
            api.rbac_requests()
                .iter()
                .any(|(verb, group, resource)| verb == "patch"
                    && *group == "resource.k8s.io"
                    && resource == "resourceclaims/status")
        );
    }

    #[tokio::test]
    async fn a_node_wipe_deletes_only_its_slices_and_preconditions_guard_single_deletes() {
        let api = ApiServer::start().await.unwrap();
        let (_, mine) = post(&api, slice("node-a", "gpu.example.com", 1)).await;
        post(&api, slice("node-b", "gpu.example.com", 1)).await;
        // The kubelet's wipe at its start: every slice of its node.
        let (code, _) = http(
            &api,
            "DELETE",
            &format!("{SLICES}?fieldSelector=spec.nodeName%3Dnode-a"),
            None,
        )
        .await;
        assert_eq!(code, 200);
        let left = api.list(Kind::ResourceSlice);
        assert_eq!(left.len(), 1);
        assert_eq!(left[0]["spec"]["nodeName"], "node-b");

        let name = left[0]["metadata"]["name"].as_str().unwrap().to_string();
        let wrong = json!({"preconditions": {"uid": mine["metadata"]["uid"]}});
        let (code, status) = http(&api, "DELETE", &format!("{SLICES}/{name}"), Some(&wrong)).await;
        assert_eq!((code, status["reason"].as_str()), (409, Some("Conflict")));
        let (code, _) = http(&api, "DELETE", &format!("{SLICES}/{name}"), None).await;
        assert_eq!(code, 200);
        assert!(api.list(Kind::ResourceSlice).is_empty());
    }

    #[tokio::test]
    async fn while_down_connections_are_refused_and_what_it_held_survives() {
        let api = ApiServer::start().await.unwrap();
        api.create(Kind::Node, "", json!({"metadata": {"name": "node-a"}}))
            .unwrap();
        let claim = json!({"metadata": {"name": "gpu-claim"}, "spec": {}});
        api.create(Kind::ResourceClaim, "default", claim).unwrap();
        api.down().await;
        let addr = api.url().trim_start_matches("http://").to_string();
        assert!(tokio::net::TcpStream::connect(&addr).await.is_err());
        api.up().await.unwrap();
        let (code, node) = http(&api, "GET", "/api/v1/nodes/node-a", None).await;
        assert_eq!(code, 200);
        assert_eq!(node["kind"], "Node");
        let (code, claim) = http(
            &api,
            "GET",
            "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/gpu-claim",
            None,
        )
        .await;
        assert_eq!(code, 200);
        assert_eq!(claim["metadata"]["namespace"], "default");
    }
}
