//! A lifecycle that never loses a device: kubelet restarts, module crashes, health that
//! recovers, registry edits and the allocation ledger.

use std::time::Duration;

use devicelet_simulator::{RestartOrder, SimEvent};
use devicelet_tests::{Node, WAIT, eventually, generic_dev, misbehaving};

const FUSE: &str = r#"groups = [{ name = "fuse", paths = ["/dev/fuse"] }]

[module.sharing.resources.fuse]
replicas = 2"#;

fn bad_with_switch() -> String {
    misbehaving(
        "flaky",
        r#"resource = "bad"
switch = "/sys/testing/switch""#,
        "500ms",
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubelet_restarts_a_hundred_times_without_losing_a_registration() {
    let node = Node::new().await;
    node.add_char("/dev/fuse", 10, 229);
    let agent = node.start_agent(&generic_dev(FUSE)).await;
    node.kubelet
        .wait_until("devicelet.io/fuse", WAIT, |r| {
            r.registrations == 1 && r.allocatable == 2
        })
        .await
        .expect("first registration");
    for restart in 1..=100u32 {
        node.kubelet.restart().await.expect("kubelet restart");
        node.kubelet
            .wait_until("devicelet.io/fuse", WAIT, |r| {
                r.registrations == restart + 1 && r.streaming && r.allocatable == 2
            })
            .await
            .unwrap_or_else(|e| panic!("registration lost after restart {restart}: {e}"));
    }
    // Devices are still allocatable through the last kubelet.
    node.kubelet
        .allocate("devicelet.io/fuse", 1)
        .await
        .expect("allocate after restarts");
    agent.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubelet_restarts_with_directory_events_in_any_order_register_each_resource_once() {
    let node = Node::new().await;
    node.add_char("/dev/fuse", 10, 229);
    let agent = node.start_agent(&generic_dev(FUSE)).await;
    node.kubelet
        .wait_until("devicelet.io/fuse", WAIT, |r| {
            r.registrations == 1 && r.streaming
        })
        .await
        .expect("first registration");
    let orders = [
        RestartOrder::KubeletFirst,
        RestartOrder::PluginSocketsFirst,
        RestartOrder::SocketsThenKubelet,
    ];
    for (starts, order) in (2u32..).zip(orders.iter().chain(&orders)) {
        node.kubelet
            .restart_in_order(*order, Duration::from_millis(300))
            .await
            .expect("kubelet restart");
        node.kubelet
            .wait_until("devicelet.io/fuse", WAIT, |r| {
                r.registrations == starts && r.streaming && r.allocatable == 2
            })
            .await
            .unwrap_or_else(|e| panic!("not registered after a {order:?} restart: {e}"));
        // A second registration would follow the deletion of our socket, or the agent's grace
        // for a kubelet.sock that appeared beside it (1 s): watch past both.
        let extra = node
            .kubelet
            .wait_until("devicelet.io/fuse", Duration::from_millis(1500), |r| {
                r.registrations > starts
            })
            .await;
        assert!(
            extra.is_err(),
            "registered again after a {order:?} restart: {extra:?}"
        );
    }
    agent.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn module_trapping_in_enumerate_turns_unhealthy_then_recovers_without_touching_others() {
    let node = Node::new().await;
    node.add_char("/dev/fuse", 10, 229);
    let modules = format!("{}\n{}", generic_dev(FUSE), bad_with_switch());
    let agent = node.start_agent(&modules).await;
    node.kubelet
        .wait_until("devicelet.io/bad", WAIT, |r| r.allocatable == 2)
        .await
        .expect("bad healthy");
    let fuse_before = node
        .kubelet
        .wait_until("devicelet.io/fuse", WAIT, |r| r.allocatable == 2)
        .await
        .expect("fuse healthy");

    node.tree
        .write_file("/sys/testing/switch", "trap")
        .expect("switch");
    let down = node
        .kubelet
        .wait_until("devicelet.io/bad", WAIT, |r| {
            r.capacity == 2 && r.allocatable == 0
        })
        .await
        .expect("a crashing module's devices turn Unhealthy");
    assert!(down.devices.iter().all(|d| d.health == "Unhealthy"));
    assert!(
        down.streaming,
        "the stream stays open while the module is down"
    );

    std::fs::remove_file(node.tree.path("/sys/testing/switch")).expect("unswitch");
    node.kubelet
        .wait_until("devicelet.io/bad", WAIT, |r| r.allocatable == 2)
        .await
        .expect("the module recovers and its devices are Healthy again");

    let fuse_after = node
        .kubelet
        .resource("devicelet.io/fuse")
        .expect("fuse known");
    assert!(fuse_after.streaming);
    assert_eq!(fuse_after.registrations, fuse_before.registrations);
    assert_eq!(
        fuse_after.snapshots, fuse_before.snapshots,
        "the other stream saw nothing"
    );
    agent.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_that_becomes_healthy_again_is_advertised_healthy_again() {
    let node = Node::new().await;
    let agent = node.start_agent(&bad_with_switch()).await;
    node.kubelet
        .wait_until("devicelet.io/bad", WAIT, |r| r.allocatable == 2)
        .await
        .expect("healthy at first");
    node.tree
        .write_file("/sys/testing/switch", "unhealthy")
        .expect("switch");
    node.kubelet
        .wait_until("devicelet.io/bad", WAIT, |r| {
            r.capacity == 2 && r.allocatable == 0
        })
        .await
        .expect("unhealthy");
    node.tree
        .write_file("/sys/testing/switch", "ok")
        .expect("switch");
    node.kubelet
        .wait_until("devicelet.io/bad", WAIT, |r| r.allocatable == 2)
        .await
        .expect("healthy again");
    agent.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registry_edit_adds_a_module_while_the_first_stream_stays_open() {
    let node = Node::new().await;
    node.add_char("/dev/fuse", 10, 229);
    let agent = node.start_agent(&generic_dev(FUSE)).await;
    let before = node
        .kubelet
        .wait_until("devicelet.io/fuse", WAIT, |r| r.allocatable == 2)
        .await
        .expect("fuse");

    node.registry(&format!("{}\n{}", generic_dev(FUSE), bad_with_switch()));
    node.kubelet
        .wait_until("devicelet.io/bad", WAIT, |r| r.allocatable == 2)
        .await
        .expect("the added module is served");

    let after = node
        .kubelet
        .resource("devicelet.io/fuse")
        .expect("fuse known");
    assert!(after.streaming);
    assert_eq!(
        after.registrations, before.registrations,
        "fuse was not re-registered"
    );
    assert_eq!(
        after.snapshots, before.snapshots,
        "fuse's stream was not restarted"
    );

    // And removing it again ends only its stream.
    node.registry(&generic_dev(FUSE));
    node.kubelet
        .wait_until("devicelet.io/bad", WAIT, |r| {
            !r.streaming && r.allocatable == 0
        })
        .await
        .expect("the removed module's stream ends");
    assert!(
        node.kubelet
            .resource("devicelet.io/fuse")
            .is_some_and(|r| r.streaming)
    );
    agent.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_registry_edit_is_refused_and_the_running_set_keeps_serving() {
    let node = Node::new().await;
    node.add_char("/dev/fuse", 10, 229);
    let agent = node.start_agent(&generic_dev(FUSE)).await;
    node.kubelet
        .wait_until("devicelet.io/fuse", WAIT, |r| r.allocatable == 2)
        .await
        .expect("fuse");

    node.registry(&generic_dev(FUSE).replace("call-deadline", "cal-deadline"));
    eventually("the edit to be refused", || agent.reload_error().is_some()).await;
    let error = agent.reload_error().unwrap_or_default();
    assert!(
        error.contains("registry.toml:") && error.contains("cal-deadline"),
        "{error}"
    );

    let fuse = node
        .kubelet
        .resource("devicelet.io/fuse")
        .expect("fuse known");
    assert!(fuse.streaming && fuse.registrations == 1);
    node.kubelet
        .allocate("devicelet.io/fuse", 1)
        .await
        .expect("the old set keeps serving");
    agent.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_finished_pod_frees_its_devices_in_the_ledger() {
    use devicelet_simulator::PodRef;
    let node = Node::new().await;
    node.add_char("/dev/fuse", 10, 229);
    let agent = node
        .start_agent_with(&generic_dev(FUSE), node.with_ledger())
        .await;
    node.kubelet
        .wait_until("devicelet.io/fuse", WAIT, |r| r.allocatable == 2)
        .await
        .expect("fuse");

    let pod = PodRef::new("team-a", "trainer", "main");
    let allocation = node
        .kubelet
        .allocate_for(&pod, "devicelet.io/fuse", 1)
        .await
        .expect("allocate");
    let held = &allocation.device_ids[0];
    // Allocate itself recorded it, before the kubelet had the answer (and so before
    // PodResources could show it for the reconciliation to adopt).
    let recorded = agent.ledger().entries();
    assert_eq!(recorded.len(), 1, "{recorded:?}");
    assert_eq!(&recorded[0].device_ids, &allocation.device_ids);
    let holder_of = |agent: &devicelet::agent::Agent| {
        agent
            .status()
            .resources
            .into_iter()
            .flat_map(|r| r.devices)
            .find(|d| &d.id == held)
            .and_then(|d| d.holder)
    };
    eventually("the ledger to learn the holder", || {
        holder_of(&agent).is_some()
    })
    .await;
    let holder = holder_of(&agent).expect("holder");
    assert_eq!(
        holder,
        devicelet::ledger::Holder::container("team-a", "trainer", "main")
    );

    node.kubelet.terminate_pod("team-a", "trainer");
    eventually("the ledger to free the device", || {
        agent
            .ledger()
            .entries()
            .iter()
            .all(|e| !e.device_ids.contains(held))
    })
    .await;
    agent.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replacing_a_module_file_upgrades_it_behind_the_same_registration_and_stream() {
    let node = Node::new().await;
    node.add_char("/dev/fuse", 10, 229);
    let installed = node.dir.path().join("vendor.wasm");
    std::fs::copy(
        devicelet_tests::module_dir().join("misbehaving.wasm"),
        &installed,
    )
    .expect("install v1");
    let entry = misbehaving("vendor", "resource = \"bad\"", "1s")
        .replace(
            "@MODULES@/misbehaving.wasm",
            &installed.display().to_string(),
        )
        .replace(
            "sysfs = [\"/sys/testing\"]",
            "sysfs = [\"/sys/testing\"]\ndev = [\"/dev/fuse\"]",
        );
    let agent = node
        .start_agent(&format!("{}\n{entry}", generic_dev(FUSE)))
        .await;
    let v1 = node
        .kubelet
        .wait_until("devicelet.io/bad", WAIT, |r| r.allocatable == 2)
        .await
        .expect("v1 served");
    assert_eq!(v1.devices[0].id, "dev-0");
    // Modules start in parallel: fuse registers on its own schedule.
    let fuse_before = node
        .kubelet
        .wait_until("devicelet.io/fuse", WAIT, |r| r.allocatable == 2)
        .await
        .expect("fuse served");

    // A vendor ships a new build (here: another module honouring the same config), installed
    // the way package managers do it: written aside, renamed over the old file.
    let mut events = node.kubelet.events();
    let staged = node.dir.path().join("vendor.wasm.new");
    std::fs::copy(devicelet_tests::module_dir().join("hostile.wasm"), &staged).expect("stage v2");
    std::fs::rename(&staged, &installed).expect("install v2");
    let v2 = node
        .kubelet
        .wait_until("devicelet.io/bad", WAIT, |r| {
            r.streaming && r.devices.first().is_some_and(|d| d.id == "evil-0")
        })
        .await
        .expect("the new build serves the resource");
    assert_eq!(
        v2.registrations, v1.registrations,
        "the same registration carries the new build"
    );
    // Everything the kubelet saw of the resource during the upgrade: no stream end, no new
    // registration, never allocatable 0.
    while let Ok(event) = events.try_recv() {
        match event {
            SimEvent::StreamEnded { resource, .. } | SimEvent::Registered { resource, .. }
                if resource == "devicelet.io/bad" =>
            {
                panic!("the upgrade ended the stream or registered again: {resource}")
            }
            SimEvent::Snapshot {
                resource,
                allocatable,
                ..
            } if resource == "devicelet.io/bad" => {
                assert!(
                    allocatable > 0,
                    "allocatable dropped to 0 during the upgrade"
                )
            }
            _ => {}
        }
    }

    let fuse_after = node.kubelet.resource("devicelet.io/fuse").expect("fuse");
    assert_eq!(
        fuse_after.snapshots, fuse_before.snapshots,
        "the untouched module's stream is intact"
    );
    assert_eq!(fuse_after.registrations, fuse_before.registrations);
    agent.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_module_file_keeps_the_running_version_serving() {
    let node = Node::new().await;
    let installed = node.dir.path().join("vendor.wasm");
    std::fs::copy(
        devicelet_tests::module_dir().join("misbehaving.wasm"),
        &installed,
    )
    .expect("install");
    let entry = misbehaving("vendor", "resource = \"bad\"", "1s").replace(
        "@MODULES@/misbehaving.wasm",
        &installed.display().to_string(),
    );
    let agent = node.start_agent(&entry).await;
    let before = node
        .kubelet
        .wait_until("devicelet.io/bad", WAIT, |r| r.allocatable == 2)
        .await
        .expect("served");

    let staged = node.dir.path().join("vendor.wasm.new");
    std::fs::write(&staged, b"a half-copied download").expect("stage");
    std::fs::rename(&staged, &installed).expect("install the broken file");
    eventually("the broken file to be reported", || {
        agent
            .load_errors()
            .iter()
            .any(|e| e.contains("vendor") && e.contains("keeps serving"))
    })
    .await;
    let after = node.kubelet.resource("devicelet.io/bad").expect("known");
    assert!(after.streaming && after.allocatable == 2);
    assert_eq!(after.registrations, before.registrations);
    node.kubelet
        .allocate("devicelet.io/bad", 1)
        .await
        .expect("still allocates");
    agent.shutdown().await;
}

/// Only the registry, the module files and a ConfigMap's `..data` swap make the agent read the
/// registry again: a log file written beside the registry does not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_log_file_beside_the_registry_causes_no_reload() {
    use std::io::Write;
    let node = Node::new().await;
    node.add_char("/dev/fuse", 10, 229);
    let agent = node.start_agent(&generic_dev(FUSE)).await;
    node.kubelet
        .wait_until("devicelet.io/fuse", WAIT, |r| r.allocatable == 2)
        .await
        .expect("fuse");
    let mut log = std::fs::File::create(node.dir.path().join("agent.log")).expect("log file");
    for i in 0..20 {
        writeln!(log, "line {i}").expect("log line");
        log.sync_data().expect("sync");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    // Any reload the log could cause would settle within 150 ms of its last write; the edit
    // below comes after that, so with one reload counted it was the edit's.
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    assert_eq!(agent.reloads(), 0, "the log file caused a reload");
    node.registry(&format!("{}\n{}", generic_dev(FUSE), bad_with_switch()));
    node.kubelet
        .wait_until("devicelet.io/bad", WAIT, |r| r.allocatable == 2)
        .await
        .expect("the edit is applied");
    assert_eq!(agent.reloads(), 1, "only the registry edit caused a reload");
    agent.shutdown().await;
}

/// A Kubernetes ConfigMap volume updates by writing a new `..<timestamp>` directory and swapping
/// the `..data` symlink to it; `registry.toml` itself is a symlink through `..data` and is never
/// written. The swap is seen and applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configmap_style_swap_of_the_registry_is_applied() {
    use std::os::unix::fs::symlink;
    let node = Node::new().await;
    node.add_char("/dev/fuse", 10, 229);
    let volume = node.dir.path().join("configmap");
    let version = |name: &str, modules: &str| {
        let text = std::fs::read_to_string(node.registry(modules)).expect("registry text");
        let dir = volume.join(name);
        std::fs::create_dir_all(&dir).expect("version dir");
        std::fs::write(dir.join("registry.toml"), text).expect("version file");
    };
    version("..2026_11_22_v1", &generic_dev(FUSE));
    symlink("..2026_11_22_v1", volume.join("..data")).expect("..data");
    symlink("..data/registry.toml", volume.join("registry.toml")).expect("registry link");
    let registry = devicelet::config::Registry::load(&volume.join("registry.toml")).expect("load");
    let mut options = node.agent_options(registry);
    options.hot_reload = true;
    let agent = devicelet::agent::Agent::start(options)
        .await
        .expect("agent");
    node.kubelet
        .wait_until("devicelet.io/fuse", WAIT, |r| r.allocatable == 2)
        .await
        .expect("fuse");

    version(
        "..2026_11_22_v2",
        &format!("{}\n{}", generic_dev(FUSE), bad_with_switch()),
    );
    symlink("..2026_11_22_v2", volume.join("..data_tmp")).expect("new link");
    std::fs::rename(volume.join("..data_tmp"), volume.join("..data")).expect("swap");
    std::fs::remove_dir_all(volume.join("..2026_11_22_v1")).expect("old version");
    node.kubelet
        .wait_until("devicelet.io/bad", WAIT, |r| r.allocatable == 2)
        .await
        .expect("the swapped-in registry is applied");
    agent.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_asking_for_other_calls_registers_again_only_after_the_old_stream_ended() {
    let node = Node::new().await;
    let v1 = misbehaving("vendor", "resource = \"bad\"", "1s");
    let agent = node.start_agent(&v1).await;
    let before = node
        .kubelet
        .wait_until("devicelet.io/bad", WAIT, |r| {
            r.allocatable == 2 && r.streaming
        })
        .await
        .expect("v1 served");
    assert!(!before.options.pre_start_required);

    let mut events = node.kubelet.events();
    let v2 = misbehaving("vendor", "resource = \"bad\"\nprestart = \"ok\"", "1s");
    node.registry(&v2);
    let after = node
        .kubelet
        .wait_until("devicelet.io/bad", WAIT, |r| {
            r.options.pre_start_required && r.streaming && r.allocatable == 2
        })
        .await
        .expect("v2 registered with its options");
    assert_eq!(
        after.registrations,
        before.registrations + 1,
        "registered once more"
    );
    assert_eq!(after.endpoint, before.endpoint, "on the same socket");
    let mut ended = false;
    while let Ok(event) = events.try_recv() {
        match event {
            SimEvent::StreamEnded { resource, .. } if resource == "devicelet.io/bad" => {
                ended = true
            }
            SimEvent::Registered { resource, .. } if resource == "devicelet.io/bad" => {
                assert!(ended, "registered again while the old stream was live");
            }
            _ => {}
        }
    }
    assert!(ended, "the old registration's stream ended");
    agent.shutdown().await;
}

/// Allocate of `ids` in one container, straight on the resource's socket as the kubelet sends it.
async fn allocate_on_socket(
    agent: &devicelet::agent::Agent,
    resource: &str,
    ids: &[&str],
) -> devicelet::kubelet::api::deviceplugin::ContainerAllocateResponse {
    let socket = agent.resource(resource).expect("served").socket;
    allocate_at(&socket, ids).await
}

/// Allocate of `ids` in one container on a resource's socket.
async fn allocate_at(
    socket: &std::path::Path,
    ids: &[&str],
) -> devicelet::kubelet::api::deviceplugin::ContainerAllocateResponse {
    use devicelet::kubelet::api::deviceplugin::device_plugin_client::DevicePluginClient;
    use devicelet::kubelet::api::deviceplugin::{AllocateRequest, ContainerAllocateRequest};
    let mut plugin = DevicePluginClient::new(
        devicelet::kubelet::uds::connect(socket)
            .await
            .expect("dial plugin"),
    );
    let answer = plugin
        .allocate(AllocateRequest {
            container_requests: vec![ContainerAllocateRequest {
                devices_ids: ids.iter().map(|s| s.to_string()).collect(),
            }],
        })
        .await
        .expect("allocate")
        .into_inner();
    answer
        .container_responses
        .into_iter()
        .next()
        .expect("one container")
}

/// The env the misbehaving module answers Allocate of `ids` with.
async fn misbehaving_env(agent: &devicelet::agent::Agent, resource: &str, ids: &[&str]) -> String {
    allocate_on_socket(agent, resource, ids).await.envs["MISBEHAVING_DEVICES"].clone()
}

fn allocate_calls(agent: &devicelet::agent::Agent) -> u64 {
    devicelet_tests::module_status(agent, "flaky")
        .stats
        .allocate_calls
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_single_device_allocate_is_answered_from_the_answer_prepared_for_it() {
    let node = Node::new().await;
    let agent = node.start_agent(&bad_with_switch()).await;
    // The kubelet calls Allocate only once the resource registered (its socket is bound after
    // the first snapshot, which can come after the answers were prepared).
    node.kubelet
        .wait_until("devicelet.io/bad", WAIT, |r| r.allocatable == 2)
        .await
        .expect("registered");
    devicelet_tests::prepared_answers(&agent, "devicelet.io/bad", 2).await;
    let prepared = allocate_calls(&agent);
    assert_eq!(prepared, 2, "one call per healthy device, ahead of time");

    for _ in 0..3 {
        let env = misbehaving_env(&agent, "devicelet.io/bad", &["dev-1"]).await;
        assert_eq!(env, "dev-1", "the module's own answer for that device");
    }
    assert_eq!(
        allocate_calls(&agent),
        prepared,
        "no module call on the kubelet's path"
    );
    let env = misbehaving_env(&agent, "devicelet.io/bad", &["dev-0", "dev-1"]).await;
    assert_eq!(env, "dev-0,dev-1");
    assert_eq!(
        allocate_calls(&agent),
        prepared + 1,
        "several devices: the module is asked"
    );

    // A device that changed is never answered from what was prepared for it before.
    node.tree
        .write_file("/sys/testing/switch", "unhealthy")
        .expect("switch");
    node.kubelet
        .wait_until("devicelet.io/bad", WAIT, |r| r.allocatable == 0)
        .await
        .expect("unhealthy");
    devicelet_tests::prepared_answers(&agent, "devicelet.io/bad", 0).await;
    allocate_on_socket(&agent, "devicelet.io/bad", &["dev-1"]).await;
    assert_eq!(allocate_calls(&agent), prepared + 2);

    node.tree
        .write_file("/sys/testing/switch", "ok")
        .expect("switch");
    devicelet_tests::prepared_answers(&agent, "devicelet.io/bad", 2).await;
    let calls = allocate_calls(&agent);
    assert_eq!(calls, prepared + 4, "healthy again: prepared again");
    allocate_on_socket(&agent, "devicelet.io/bad", &["dev-0"]).await;
    assert_eq!(allocate_calls(&agent), calls);
    agent.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_allocate_ahead_off_every_allocate_asks_the_module() {
    let node = Node::new().await;
    let registry = bad_with_switch().replace("allocate-ahead = true", "allocate-ahead = false");
    let agent = node.start_agent(&registry).await;
    node.kubelet
        .wait_until("devicelet.io/bad", WAIT, |r| r.allocatable == 2)
        .await
        .expect("served");
    for expected in 1..=2 {
        allocate_on_socket(&agent, "devicelet.io/bad", &["dev-1"]).await;
        assert_eq!(allocate_calls(&agent), expected);
    }
    let status = agent.status();
    assert!(status.resources[0].devices.iter().all(|d| !d.prepared));
    agent.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_an_upgrade_allocate_answers_as_the_new_version_not_from_the_old_ones_answers() {
    let node = Node::new().await;
    node.add_char("/dev/fuse", 10, 229);
    let agent = node.start_agent(&generic_dev(FUSE)).await;
    node.kubelet
        .wait_until("devicelet.io/fuse", WAIT, |r| r.allocatable == 2)
        .await
        .expect("registered");
    devicelet_tests::prepared_answers(&agent, "devicelet.io/fuse", 2).await;
    let permissions = |a: devicelet::kubelet::api::deviceplugin::ContainerAllocateResponse| {
        a.devices[0].permissions.clone()
    };
    assert_eq!(
        permissions(allocate_on_socket(&agent, "devicelet.io/fuse", &["fuse::0"]).await),
        "rw"
    );

    // The same devices, other answers: only the module's version tells them apart. The socket
    // stays (the agent's own list may not show the resource while it is being upgraded).
    let served = agent.resource("devicelet.io/fuse").expect("served");
    let socket = served.socket.clone();
    node.registry(&generic_dev(
        r#"groups = [{ name = "fuse", paths = ["/dev/fuse"], permissions = "r" }]

[module.sharing.resources.fuse]
replicas = 2"#,
    ));
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let now = permissions(allocate_at(&socket, &["fuse::0"]).await);
        if now == "r" {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "still answering as the old version: {now}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut progress = served.prepared.progress();
    tokio::time::timeout(WAIT, progress.wait_for(|p| p.ready == 2))
        .await
        .expect("answers prepared again in time")
        .expect("the preparer runs");
    for id in ["fuse::0", "fuse::1"] {
        let now = permissions(allocate_at(&socket, &[id]).await);
        assert_eq!(now, "r", "{id}");
    }
    agent.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changing_one_resources_sharing_re_serves_that_resource_only() {
    let node = Node::new().await;
    node.add_char("/dev/fuse", 10, 229);
    node.add_char("/dev/net/tun", 10, 200);
    let config = r#"groups = [
  { name = "fuse", paths = ["/dev/fuse"] },
  { name = "tun", paths = ["/dev/net/tun"] },
]"#;
    let agent = node.start_agent(&generic_dev(config)).await;
    let tun = node
        .kubelet
        .wait_until("devicelet.io/tun", WAIT, |r| r.allocatable == 1)
        .await
        .expect("tun");
    node.kubelet
        .wait_until("devicelet.io/fuse", WAIT, |r| r.allocatable == 1)
        .await
        .expect("fuse");

    node.registry(&format!(
        "{}\n[module.sharing.resources.fuse]\nreplicas = 2\n",
        generic_dev(config)
    ));
    node.kubelet
        .wait_until("devicelet.io/fuse", WAIT, |r| r.allocatable == 2)
        .await
        .expect("fuse shared two ways");
    let after = node.kubelet.resource("devicelet.io/tun").expect("tun");
    assert!(after.streaming);
    assert_eq!(
        (after.registrations, after.snapshots),
        (tun.registrations, tun.snapshots),
        "tun kept its registration and stream"
    );
    agent.shutdown().await;
}

/// A front end of the test's own, registered through the agent's front-end seam: it serves
/// nothing, and records what the agent asks of it.
mod recorder {
    use std::any::Any;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};

    use devicelet::agent::front_ends::{BoxFuture, Context, FrontEnd, FrontEndKind, Stop};
    use devicelet::config::ModuleSpec;
    use devicelet::sandbox::slot::ModuleSlot;
    use tokio::sync::Notify;

    #[derive(Clone, Default)]
    pub struct Recorder {
        pub calls: Arc<Mutex<Vec<String>>>,
        pub registered: Arc<AtomicBool>,
        pub asked_status: Arc<AtomicBool>,
    }

    struct Served {
        recorder: Recorder,
        names: Vec<String>,
    }

    impl Recorder {
        fn note(&self, call: String) {
            self.calls.lock().unwrap().push(call);
        }
    }

    impl FrontEndKind for Recorder {
        fn start<'a>(
            &'a self,
            cx: &'a Context<'a>,
        ) -> BoxFuture<'a, (Box<dyn FrontEnd>, Vec<String>)> {
            let names: Vec<String> = cx.planned.iter().map(|(n, _)| n.clone()).collect();
            self.note(format!("start {} {}", cx.spec.name, names.join(",")));
            let served = Served {
                recorder: self.clone(),
                names,
            };
            Box::pin(async move { (Box::new(served) as Box<dyn FrontEnd>, Vec::new()) })
        }
        fn describe(
            &self,
            _: &ModuleSpec,
            planned: &[(String, devicelet::device::ResourceInfo)],
        ) -> Vec<Result<String, String>> {
            planned
                .iter()
                .map(|(n, _)| Ok(format!("resource {n} recorded")))
                .collect()
        }
        fn needs_api_server(&self) -> bool {
            false
        }
        fn answers_ahead(&self) -> bool {
            false
        }
    }

    impl FrontEnd for Served {
        fn as_any(&self) -> &dyn Any {
            self
        }
        fn resources(&self) -> Vec<String> {
            self.names.clone()
        }
        fn names(&self) -> Vec<String> {
            self.names.clone()
        }
        fn pokes(&self) -> Vec<Arc<Notify>> {
            Vec::new()
        }
        fn ended(&self, _: &str) -> Vec<String> {
            Vec::new()
        }
        fn not_ready(&self, module: &str) -> Vec<String> {
            match self.recorder.registered.load(Ordering::Relaxed) {
                true => Vec::new(),
                false => vec![format!("the recorder has not registered module `{module}`")],
            }
        }
        fn keeps(&self, old: &ModuleSpec, cx: &Context<'_>) -> bool {
            old.health_interval == cx.spec.health_interval
        }
        fn status(
            &self,
            _: &str,
            _: &devicelet::ledger::Ledger,
            _: &mut devicelet::agent::status::Status,
        ) {
            self.recorder.asked_status.store(true, Ordering::Relaxed);
        }
        fn stop_gone<'a>(
            &'a mut self,
            _: &'a ModuleSpec,
            cx: &'a Context<'a>,
        ) -> BoxFuture<'a, ()> {
            let version = devicelet::resource::backend::Upkeep::generation(cx.slot);
            self.recorder.note(format!("stop_gone, version {version}"));
            Box::pin(async {})
        }
        fn resume<'a>(&'a mut self, cx: &'a Context<'a>) -> BoxFuture<'a, Vec<String>> {
            let version = devicelet::resource::backend::Upkeep::generation(cx.slot);
            self.recorder.note(format!("resume, version {version}"));
            Box::pin(async { Vec::new() })
        }
        fn stop<'a>(self: Box<Self>, how: Stop<'a>, _: &'a ModuleSlot) -> BoxFuture<'a, ()> {
            let how = match how {
                Stop::Shutdown => "shutdown",
                Stop::Removed => "removed",
                Stop::Restart(_) => "restart",
            };
            self.recorder.note(format!("stop {how}"));
            Box::pin(async {})
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_front_end_registered_through_the_seam_is_started_upgraded_asked_and_stopped() {
    use devicelet::agent::CustomFrontEnd;
    let node = Node::new().await;
    node.add_char("/dev/fuse", 10, 229);
    let recorder = recorder::Recorder::default();
    let calls = recorder.calls.clone();
    let kind = CustomFrontEnd(std::sync::Arc::new(recorder.clone()));
    let module = |interval: &str, deadline: &str| {
        generic_dev(FUSE)
            .replace("\"100ms\"", &format!("\"{interval}\""))
            .replace(
                "call-deadline = \"2s\"",
                &format!("call-deadline = \"{deadline}\""),
            )
    };
    let agent = node
        .start_agent_with(&module("100ms", "2s"), move |o| o.front_end = Some(kind))
        .await;
    let seen = || calls.lock().unwrap().clone();
    assert_eq!(seen(), ["start generic-dev devicelet.io/fuse"]);
    // Nothing was served through the kubelet's API: the front end was this one.
    assert!(agent.resources().is_empty());
    // Readiness asks the front end.
    let not_ready = agent.ready().unwrap_err();
    assert!(
        not_ready.contains("the recorder has not registered module `generic-dev`"),
        "{not_ready}"
    );
    recorder
        .registered
        .store(true, std::sync::atomic::Ordering::Relaxed);
    agent.ready().expect("ready once the front end says so");
    // Status asks it for its section.
    let _ = agent.status();
    assert!(
        recorder
            .asked_status
            .load(std::sync::atomic::Ordering::Relaxed)
    );

    // An edit it keeps in place: the old version answers while it stops what went, the new
    // one (swapped in between) once it resumes.
    node.registry(&module("100ms", "3s"));
    eventually("an in-place upgrade", || seen().len() == 3).await;
    assert_eq!(seen()[1..], ["stop_gone, version 0", "resume, version 1"]);
    // One it does not keep: stopped, and started again.
    node.registry(&module("200ms", "3s"));
    eventually("a restart on the new version", || seen().len() == 5).await;
    assert_eq!(
        seen()[3..],
        ["stop restart", "start generic-dev devicelet.io/fuse"]
    );
    // The module leaves the registry (another takes its place), then the agent stops.
    node.registry(&module("200ms", "3s").replace("name = \"generic-dev\"", "name = \"other\""));
    eventually("the module's front end stopped", || seen().len() == 7).await;
    let mut last: Vec<String> = seen()[5..].to_vec();
    last.sort();
    assert_eq!(last, ["start other devicelet.io/fuse", "stop removed"]);
    agent.shutdown().await;
    assert_eq!(seen()[7..], ["stop shutdown"]);
}
