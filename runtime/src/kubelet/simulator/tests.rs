//! The simulated kubelet against a scripted fake plugin.

use std::sync::atomic::Ordering;
use std::time::Duration;

use tempfile::TempDir;
use tonic::{Code, Status};

use super::fake::{AllocateMode, Call, FakePlugin, device, healthy, register};
use super::*;
use crate::kubelet::api::deviceplugin::{
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

async fn simulator() -> (TempDir, Simulator) {
    let dir = TempDir::new().unwrap();
    let sim = Simulator::start_with(
        dir.path(),
        SimConfig {
            dial_timeout: Duration::from_millis(300),
            prestart_timeout: Duration::from_secs(5),
            stall_limit: Duration::from_millis(300),
        },
    )
    .await
    .unwrap();
    (dir, sim)
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
    sim.shutdown().await;
    assert!(!dir.path().join("kubelet.sock").exists());
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

    // The old stream was cancelled; its later end changes nothing.
    for _ in 0..100 {
        if old.fake.cancelled_streams.load(Ordering::SeqCst) == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(old.fake.cancelled_streams.load(Ordering::SeqCst), 1);
    old.fake.set_devices(healthy(&["x", "w"]));
    old.fake.end_streams();

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

#[tokio::test]
async fn restart_deletes_sockets_and_forgets_plugins() {
    let (dir, sim) = simulator().await;
    let plugin = registered(&sim, options(false, false), &["a", "b"]).await;
    let held = sim.allocate(RESOURCE, 1).await.unwrap();
    std::fs::write(dir.path().join(server::CHECKPOINT), "{}").unwrap();

    sim.restart().await.unwrap();
    assert!(!dir.path().join("fake-1.sock").exists());
    assert!(dir.path().join(server::CHECKPOINT).exists());
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
    plugin.register(sim.socket(), RESOURCE).await.unwrap();
    let state = sim
        .wait_until(RESOURCE, WAIT, |r| r.registrations == 2 && r.snapshots >= 1)
        .await
        .unwrap();
    assert_eq!(state.allocatable, 2);
    let next = sim.allocate(RESOURCE, 1).await.unwrap();
    assert_eq!(next.device_ids, ["b"]);
    assert_ne!(held.device_ids, next.device_ids);
}

#[tokio::test]
async fn a_second_simulator_on_a_live_directory_is_refused() {
    let (dir, _sim) = simulator().await;
    let err = Simulator::start(dir.path()).await.err().unwrap();
    assert!(matches!(err, SimError::AlreadyServed { .. }), "{err}");
}

#[tokio::test]
async fn start_deletes_stale_sockets() {
    let dir = TempDir::new().unwrap();
    let stale = dir.path().join("old-plugin.sock");
    let _listener = std::os::unix::net::UnixListener::bind(&stale).unwrap();
    std::fs::write(dir.path().join("notes.txt"), "kept").unwrap();
    let sim = Simulator::start(dir.path()).await.unwrap();
    assert!(!stale.exists());
    assert!(dir.path().join("notes.txt").exists());
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
