//! The one path everything builds on: a vendor module in the registry, registered with the
//! kubelet, streaming devices and serving allocations.

use devicelet::kubelet::api::deviceplugin::device_plugin_client::DevicePluginClient;
use devicelet::kubelet::api::deviceplugin::{DeviceSpec, PreStartContainerRequest};
use devicelet::kubelet::uds;
use devicelet_tests::{Node, WAIT, generic_dev, misbehaving};
use std::collections::HashSet;
use std::os::unix::fs::PermissionsExt;

const FUSE_AND_SERIAL: &str = r#"groups = [
  { name = "fuse", paths = ["/dev/fuse"] },
  { name = "serial", paths = ["/dev/ttyUSB*"] },
]

[module.sharing.resources.fuse]
replicas = 3"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn module_registers_and_streams_its_first_snapshot() {
    let node = Node::new().await;
    node.add_char("/dev/fuse", 10, 229);
    node.add_char("/dev/ttyUSB0", 188, 0);
    let agent = node.start_agent(&generic_dev(FUSE_AND_SERIAL)).await;
    assert!(agent.load_errors().is_empty(), "{:?}", agent.load_errors());

    let fuse = node
        .kubelet
        .wait_until("devicelet.io/fuse", WAIT, |r| r.snapshots > 0)
        .await
        .expect("fuse registered with a snapshot");
    let ids: Vec<_> = fuse.devices.iter().map(|d| d.id.as_str()).collect();
    assert_eq!(ids, ["fuse::0", "fuse::1", "fuse::2"]);
    assert!(fuse.devices.iter().all(|d| d.health == "Healthy"));
    assert_eq!((fuse.capacity, fuse.allocatable), (3, 3));
    assert!(!fuse.options.pre_start_required);
    assert!(
        fuse.options.get_preferred_allocation_available,
        "generic-dev has no preference of its own: the host answers"
    );
    assert!(fuse.endpoint.ends_with(".sock") && !fuse.endpoint.contains('/'));
    let mode = std::fs::metadata(node.plugin_dir().join(&fuse.endpoint))
        .expect("our socket exists")
        .permissions()
        .mode();
    assert_eq!(
        mode & 0o777,
        0o600,
        "only the kubelet (root) may talk to a plugin socket"
    );

    let serial = node
        .kubelet
        .wait_until("devicelet.io/serial", WAIT, |r| r.snapshots > 0)
        .await
        .expect("serial registered with a snapshot");
    let ids: Vec<_> = serial.devices.iter().map(|d| d.id.as_str()).collect();
    assert_eq!(ids, ["ttyUSB0"]);
    agent.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_node_appearing_and_disappearing_sends_new_snapshots() {
    let node = Node::new().await;
    node.add_char("/dev/ttyUSB0", 188, 0);
    let agent = node.start_agent(&generic_dev(FUSE_AND_SERIAL)).await;
    node.kubelet
        .wait_until("devicelet.io/serial", WAIT, |r| r.capacity == 1)
        .await
        .expect("one serial device");

    node.add_char("/dev/ttyUSB1", 188, 1);
    let two = node
        .kubelet
        .wait_until("devicelet.io/serial", WAIT, |r| r.capacity == 2)
        .await
        .expect("a plugged-in adapter shows up");
    assert_eq!(two.allocatable, 2);

    node.tree.remove("/dev/ttyUSB0").expect("unplug");
    let one = node
        .kubelet
        .wait_until("devicelet.io/serial", WAIT, |r| r.capacity == 1)
        .await
        .expect("an unplugged adapter goes away");
    assert_eq!(one.devices[0].id, "ttyUSB1");
    agent.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allocation_passes_the_device_nodes_with_their_permissions() {
    let node = Node::new().await;
    node.add_char("/dev/fuse", 10, 229);
    node.add_char("/dev/net/tun", 10, 200);
    let config = r#"groups = [
  { name = "fuse", paths = ["/dev/fuse"] },
  { name = "tun", paths = ["/dev/net/tun"], permissions = "rwm" },
]

[module.sharing.resources.fuse]
replicas = 4"#;
    let agent = node.start_agent(&generic_dev(config)).await;
    node.kubelet
        .wait_until("devicelet.io/fuse", WAIT, |r| r.allocatable == 4)
        .await
        .expect("fuse ready");
    node.kubelet
        .wait_until("devicelet.io/tun", WAIT, |r| r.allocatable == 1)
        .await
        .expect("tun ready");

    let fuse = node
        .kubelet
        .allocate("devicelet.io/fuse", 2)
        .await
        .expect("allocate fuse");
    assert_eq!(fuse.device_ids.len(), 2);
    // Two replicas of one node: the container gets the node once.
    assert_eq!(
        fuse.response.devices,
        [DeviceSpec {
            container_path: "/dev/fuse".into(),
            host_path: "/dev/fuse".into(),
            permissions: "rw".into(),
        }]
    );

    let tun = node
        .kubelet
        .allocate("devicelet.io/tun", 1)
        .await
        .expect("allocate tun");
    assert_eq!(tun.device_ids, ["net-tun"]);
    assert_eq!(
        tun.response.devices,
        [DeviceSpec {
            container_path: "/dev/net/tun".into(),
            host_path: "/dev/net/tun".into(),
            permissions: "rwm".into(),
        }]
    );
    agent.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_adapters_are_spread_by_the_host_and_prestart_reaches_the_module() {
    let node = Node::new().await;
    for (i, path) in ["/dev/ttyUSB0", "/dev/ttyUSB1"].iter().enumerate() {
        node.add_char(path, 188, i as u32);
    }
    let config = r#"groups = [
  { name = "serial", paths = ["/dev/ttyUSB*"], prestart-check = true },
]

[module.sharing.resources.serial]
replicas = 2"#;
    let registry = generic_dev(config).replace(
        "call-deadline = \"2s\"",
        "call-deadline = \"2s\"\nallocation-policy = \"distributed\"",
    );
    let agent = node.start_agent(&registry).await;
    let serial = node
        .kubelet
        .wait_until("devicelet.io/serial", WAIT, |r| r.allocatable == 4)
        .await
        .expect("serial ready");
    assert!(serial.options.pre_start_required);
    assert!(serial.options.get_preferred_allocation_available);

    // The kubelet alone would take the first two ids (both replicas of ttyUSB0); the host's
    // distributed policy spreads over the two adapters.
    let a = node
        .kubelet
        .allocate("devicelet.io/serial", 2)
        .await
        .expect("allocate");
    assert_eq!(
        a.preferred.as_deref(),
        Some(&["ttyUSB0::0".to_string(), "ttyUSB1::0".to_string()][..])
    );
    assert_eq!(a.device_ids, ["ttyUSB0::0", "ttyUSB1::0"]);
    assert!(a.prestarted);

    // PreStart really runs the module's check: with the adapter gone, the container it was
    // allocated to must not start, and the error names the module. (The device has left the
    // snapshot by now; the host still passes it on, as it was allocated.)
    node.tree.remove("/dev/ttyUSB1").expect("unplug");
    let served = agent.resource("devicelet.io/serial").expect("served");
    let mut plugin =
        DevicePluginClient::new(uds::connect(&served.socket).await.expect("dial plugin"));
    let err = plugin
        .pre_start_container(PreStartContainerRequest {
            devices_ids: vec!["ttyUSB1::0".into()],
        })
        .await
        .expect_err("prestart of a vanished adapter must fail");
    assert!(err.message().contains("generic-dev"), "{}", err.message());
    assert!(err.message().contains("/dev/ttyUSB1"), "{}", err.message());
    agent.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_node_plugged_in_is_seen_without_waiting_for_the_poll() {
    let node = Node::new().await;
    node.add_char("/dev/ttyUSB0", 188, 0);
    // An hour between polls: only the inotify watch on /dev can explain a prompt snapshot.
    let modules = generic_dev(FUSE_AND_SERIAL)
        .replace("health-interval = \"100ms\"", "health-interval = \"1h\"");
    let agent = node.start_agent(&modules).await;
    node.kubelet
        .wait_until("devicelet.io/serial", WAIT, |r| r.capacity == 1)
        .await
        .expect("one adapter");
    node.add_char("/dev/ttyUSB1", 188, 1);
    node.kubelet
        .wait_until("devicelet.io/serial", WAIT, |r| r.capacity == 2)
        .await
        .expect("the new adapter is advertised at once");
    node.tree.remove("/dev/ttyUSB0").expect("unplug");
    node.kubelet
        .wait_until("devicelet.io/serial", WAIT, |r| r.capacity == 1)
        .await
        .expect("the unplugged adapter goes at once");
    agent.shutdown().await;
}

/// A valid resource name of 63 characters: its socket path must still fit the 107-byte limit of
/// a Unix socket, however deep the kubelet's directory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sixty_three_character_resource_name_registers() {
    let node = Node::new().await;
    node.add_char("/dev/fuse", 10, 229);
    let name = "a-resource-name-long-enough-to-need-short-socket-x";
    let resource = format!("devicelet.io/{name}");
    assert_eq!(resource.len(), 63);
    let config = format!(
        "groups = [{{ name = \"{name}\", paths = [\"/dev/fuse\"] }}]\n\n\
         [module.sharing]\nreplicas = 2"
    );
    let agent = node.start_agent(&generic_dev(&config)).await;
    let registered = node
        .kubelet
        .wait_until(&resource, WAIT, |r| r.allocatable == 2)
        .await
        .expect("the long-named resource registers");
    assert!(
        node.plugin_dir()
            .join(&registered.endpoint)
            .as_os_str()
            .len()
            <= 107,
        "{}",
        registered.endpoint
    );
    node.kubelet
        .allocate(&resource, 1)
        .await
        .expect("and serves Allocate");
    agent.shutdown().await;
}

/// The NUMA node the misbehaving module puts `dev-<i>` on, with `numa = 2`.
fn numa_of(id: &str) -> u32 {
    id.trim_start_matches("dev-")
        .parse::<u32>()
        .expect("dev-<i>")
        % 2
}

/// GetPreferredAllocation straight on the resource's socket, as the kubelet asks it.
async fn preferred_on_socket(
    agent: &devicelet::agent::Agent,
    resource: &str,
    available: &[&str],
    must_include: &[&str],
    size: i32,
) -> Vec<String> {
    use devicelet::kubelet::api::deviceplugin::{
        ContainerPreferredAllocationRequest, PreferredAllocationRequest,
    };
    let served = agent.resource(resource).expect("served");
    let mut plugin = DevicePluginClient::new(uds::connect(&served.socket).await.expect("dial"));
    let strings = |ids: &[&str]| ids.iter().map(|s| s.to_string()).collect();
    let answer = plugin
        .get_preferred_allocation(PreferredAllocationRequest {
            container_requests: vec![ContainerPreferredAllocationRequest {
                available_device_i_ds: strings(available),
                must_include_device_i_ds: strings(must_include),
                allocation_size: size,
            }],
        })
        .await
        .expect("preferred allocation")
        .into_inner();
    answer.container_responses[0].device_i_ds.clone()
}

const EIGHT_ON_TWO_NODES: &str = "resource = \"gpu\"\ndevices = 8\nnuma = 2";
const ALL: [&str; 8] = [
    "dev-0", "dev-1", "dev-2", "dev-3", "dev-4", "dev-5", "dev-6", "dev-7",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_module_without_preferred_gets_the_hosts_numa_aligned_preference() {
    let node = Node::new().await;
    let agent = node
        .start_agent(&misbehaving(
            "gpus",
            &format!("{EIGHT_ON_TWO_NODES}\nswitch = \"/sys/testing/switch\""),
            "1s",
        ))
        .await;
    let gpu = node
        .kubelet
        .wait_until("devicelet.io/gpu", WAIT, |r| r.allocatable == 8)
        .await
        .expect("served");
    assert!(
        gpu.options.get_preferred_allocation_available,
        "the host offers the call the module does not"
    );

    // Through the kubelet's own selection: it takes the preference.
    let first = node
        .kubelet
        .allocate("devicelet.io/gpu", 3)
        .await
        .expect("allocate");
    assert_eq!(first.preferred.as_deref(), Some(&first.device_ids[..]));
    let nodes: HashSet<u32> = first.device_ids.iter().map(|id| numa_of(id)).collect();
    assert_eq!(nodes.len(), 1, "one NUMA node: {:?}", first.device_ids);

    // A device reused from an init container pulls the rest to its node.
    let chosen = preferred_on_socket(&agent, "devicelet.io/gpu", &ALL, &["dev-5"], 3).await;
    assert_eq!(chosen[0], "dev-5");
    assert!(chosen.iter().all(|id| numa_of(id) == 1), "{chosen:?}");

    // A device gone Unhealthy is passed over; the others are still chosen.
    node.tree
        .write_file("/sys/testing/switch", "unhealthy")
        .expect("switch");
    node.kubelet
        .wait_until("devicelet.io/gpu", WAIT, |r| r.allocatable == 0)
        .await
        .expect("unhealthy");
    let chosen = preferred_on_socket(&agent, "devicelet.io/gpu", &ALL, &[], 2).await;
    assert!(
        chosen.is_empty(),
        "no healthy device to prefer, and no error: {chosen:?}"
    );
    agent.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_registry_picks_who_answers_preferred_allocation() {
    let modules_own = format!("{EIGHT_ON_TWO_NODES}\npreferred = \"ok\"");
    for (policy, expect) in [
        // The module's own answer: the last `size` IDs offered, across both nodes.
        ("module", Some(vec!["dev-6", "dev-7"])),
        ("packed", None),
        ("distributed", None),
    ] {
        let node = Node::new().await;
        let registry = misbehaving("gpus", &modules_own, "1s").replace(
            "memory-limit =",
            &format!("allocation-policy = \"{policy}\"\nmemory-limit ="),
        );
        let agent = node.start_agent(&registry).await;
        node.kubelet
            .wait_until("devicelet.io/gpu", WAIT, |r| r.allocatable == 8)
            .await
            .expect("served");
        let chosen = preferred_on_socket(&agent, "devicelet.io/gpu", &ALL, &[], 2).await;
        match expect {
            Some(ids) => assert_eq!(chosen, ids, "{policy}"),
            None => {
                let nodes: HashSet<u32> = chosen.iter().map(|id| numa_of(id)).collect();
                assert_eq!((chosen.len(), nodes.len()), (2, 1), "{policy}: {chosen:?}");
            }
        }
        agent.shutdown().await;
    }

    let node = Node::new().await;
    let registry = misbehaving("gpus", &modules_own, "1s").replace(
        "memory-limit =",
        "allocation-policy = \"none\"\nmemory-limit =",
    );
    let _agent = node.start_agent(&registry).await;
    let gpu = node
        .kubelet
        .wait_until("devicelet.io/gpu", WAIT, |r| r.allocatable == 8)
        .await
        .expect("served");
    assert!(
        !gpu.options.get_preferred_allocation_available,
        "none: the kubelet chooses"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generic_dev_devices_carry_the_numa_node_sysfs_gives_their_device_node() {
    let node = Node::new().await;
    node.add_char("/dev/fuse", 10, 229);
    node.add_char("/dev/net/tun", 10, 200);
    node.tree
        .write_file("/sys/dev/char/10:229/device/numa_node", "1\n")
        .expect("sysfs");
    node.tree
        .write_file("/sys/dev/char/10:200/device/numa_node", "-1\n")
        .expect("sysfs");
    let config = r#"groups = [
  { name = "fuse", paths = ["/dev/fuse"] },
  { name = "tun", paths = ["/dev/net/tun"] },
]

[module.sharing.resources.fuse]
replicas = 2"#;
    let agent = node.start_agent(&generic_dev(config)).await;
    let fuse = node
        .kubelet
        .wait_until("devicelet.io/fuse", WAIT, |r| r.allocatable == 2)
        .await
        .expect("fuse");
    for d in &fuse.devices {
        let nodes: Vec<i64> = d
            .topology
            .iter()
            .flat_map(|t| t.nodes.iter().map(|n| n.id))
            .collect();
        assert_eq!(nodes, [1], "{}: the node of /dev/fuse", d.id);
    }
    let tun = node
        .kubelet
        .wait_until("devicelet.io/tun", WAIT, |r| r.allocatable == 1)
        .await
        .expect("tun");
    assert!(tun.devices[0].topology.is_none(), "-1: no NUMA node");
    agent.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_devices_are_replicas_and_the_module_sees_physical_ids() {
    let node = Node::new().await;
    let registry = format!(
        "{}\n[module.sharing]\nreplicas = 3\nrename = true\nfail-requests-greater-than-one = true\n",
        misbehaving("gpus", "resource = \"gpu\"\ndevices = 2", "1s")
    );
    let agent = node.start_agent(&registry).await;
    let gpu = node
        .kubelet
        .wait_until("devicelet.io/gpu.shared", WAIT, |r| r.allocatable == 6)
        .await
        .expect("served as .shared, three replicas of each device");
    let ids: Vec<&str> = gpu.devices.iter().map(|d| d.id.as_str()).collect();
    assert_eq!(
        ids,
        [
            "dev-0::0", "dev-0::1", "dev-0::2", "dev-1::0", "dev-1::1", "dev-1::2"
        ]
    );
    assert!(
        gpu.options.get_preferred_allocation_available,
        "the host prefers for shared resources"
    );

    // Least used first: two containers land on two different devices.
    let env = |a: &devicelet_simulator::Allocation| a.response.envs["MISBEHAVING_DEVICES"].clone();
    let first = node
        .kubelet
        .allocate("devicelet.io/gpu.shared", 1)
        .await
        .expect("first");
    let second = node
        .kubelet
        .allocate("devicelet.io/gpu.shared", 1)
        .await
        .expect("second");
    let mut physical = [env(&first), env(&second)];
    physical.sort();
    assert_eq!(
        physical,
        ["dev-0", "dev-1"],
        "the module sees physical IDs only"
    );

    let refused = node
        .kubelet
        .allocate("devicelet.io/gpu.shared", 2)
        .await
        .expect_err("two replicas for one container are refused")
        .to_string();
    assert!(
        refused.contains("fail-requests-greater-than-one"),
        "{refused}"
    );

    let status = agent.status();
    let served = &status.resources[0];
    assert_eq!(served.name, "devicelet.io/gpu.shared");
    assert_eq!(served.devices.iter().filter(|d| d.allocated).count(), 2);
    agent.shutdown().await;
}

/// Tools dial plugin sockets and `kubelet.sock` with whatever `:authority` their gRPC library
/// picks: `localhost`, none, or the socket's path (grpc-go's default for a custom dialer, and
/// what NVIDIA's device plugin sends to `kubelet.sock`). Every socket answers them all: here the
/// agent's plugin socket on the `kubelet.sock` route, and the simulated kubelet, which takes a
/// `Register` sent with its own path as authority.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_socket_answers_whatever_authority_the_client_sends() {
    use devicelet::kubelet::api::authority;
    use devicelet::kubelet::api::deviceplugin::registration_client::RegistrationClient;
    use devicelet::kubelet::api::deviceplugin::{Empty, RegisterRequest};
    let node = Node::new().await;
    node.add_char("/dev/fuse", 10, 229);
    let agent = node
        .start_agent(&generic_dev(
            r#"groups = [{ name = "fuse", paths = ["/dev/fuse"] }]"#,
        ))
        .await;
    let fuse = node
        .kubelet
        .wait_until("devicelet.io/fuse", WAIT, |r| r.allocatable == 1)
        .await
        .expect("registered");
    let socket = agent.resource("devicelet.io/fuse").expect("served").socket;
    let as_path = socket.to_str().expect("utf-8");
    let mut plugin = DevicePluginClient::new(
        authority::connect(&socket, as_path)
            .await
            .expect("dial with the path"),
    );
    plugin
        .get_device_plugin_options(Empty {})
        .await
        .expect("answered with the socket path as authority");

    let kubelet_sock = node.kubelet.socket().to_owned();
    let mut registration = RegistrationClient::new(
        authority::connect(&kubelet_sock, kubelet_sock.to_str().expect("utf-8"))
            .await
            .expect("dial kubelet.sock with its path"),
    );
    registration
        .register(RegisterRequest {
            version: "v1beta1".into(),
            endpoint: fuse.endpoint.clone(),
            resource_name: "devicelet.io/fuse".into(),
            options: Some(fuse.options),
        })
        .await
        .expect("the simulated kubelet takes a Register sent with its path as authority");
    node.kubelet
        .wait_until("devicelet.io/fuse", WAIT, |r| {
            r.registrations == fuse.registrations + 1 && r.allocatable == 1
        })
        .await
        .expect("registered again");
    agent.shutdown().await;
}

/// `devicelet demo`, the README's first command: the reference module through the device-plugin
/// API (registration, allocations, a hot-unplug), then through DRA (a driver, its slice, a
/// claim prepared with its CDI devices and status, then unprepared), then as a signed OCI
/// artifact in a local registry, pulled by digest and served (the tests install Debian's
/// docker-registry, as the demo does).
#[test]
fn the_demo_shows_the_module_through_both_kubelet_apis() {
    let out = std::process::Command::new(devicelet_tests::devicelet_bin())
        .args(["--log", "error", "demo", "--module-dir"])
        .arg(devicelet_tests::module_dir())
        .output()
        .expect("running devicelet demo");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for step in [
        "registered devicelet.io/fuse",
        "allocated 2 × devicelet.io/fuse",
        "PreStartContainer: ok",
        "new snapshot of devicelet.io/serial: ttyUSB0 (Healthy)",
        "registered DRA driver serial.devicelet.io with the kubelet",
        "serial.devicelet.io: pool generation 1, 1 device(s) published",
        "prepared by serial.devicelet.io",
        "Ready=True",
        "unprepared: its CDI spec removed",
        "pushed ",
        "signed it with ",
        "checked its signature against ",
        "allocated 1 × devicelet.io/fuse from the pulled module",
        "\ndone",
    ] {
        assert!(text.contains(step), "{step:?} in:\n{text}");
    }
}
