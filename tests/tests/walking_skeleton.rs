//! The one path everything builds on: a vendor module in the registry, registered with the
//! kubelet, streaming devices and serving allocations.

use devicelet::kubelet::api::deviceplugin::device_plugin_client::DevicePluginClient;
use devicelet::kubelet::api::deviceplugin::{DeviceSpec, PreStartContainerRequest};
use devicelet::kubelet::uds;
use devicelet_tests::{Node, WAIT, generic_dev};
use std::os::unix::fs::PermissionsExt;

const FUSE_AND_SERIAL: &str = r#"groups = [
  { name = "fuse", paths = ["/dev/fuse"], count = 3 },
  { name = "serial", paths = ["/dev/ttyUSB*"] },
]"#;

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
    assert_eq!(ids, ["fuse-0", "fuse-1", "fuse-2"]);
    assert!(fuse.devices.iter().all(|d| d.health == "Healthy"));
    assert_eq!((fuse.capacity, fuse.allocatable), (3, 3));
    assert!(!fuse.options.pre_start_required);
    assert!(!fuse.options.get_preferred_allocation_available);
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
  { name = "fuse", paths = ["/dev/fuse"], count = 4 },
  { name = "tun", paths = ["/dev/net/tun"], permissions = "rwm" },
]"#;
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
async fn preferred_allocation_and_prestart_reach_the_module_when_its_options_ask() {
    let node = Node::new().await;
    for (i, path) in ["/dev/ttyUSB0", "/dev/ttyUSB1"].iter().enumerate() {
        node.add_char(path, 188, i as u32);
    }
    let config = r#"groups = [
  { name = "serial", paths = ["/dev/ttyUSB*"], count = 2, preferred = "spread", prestart-check = true },
]"#;
    let agent = node.start_agent(&generic_dev(config)).await;
    let serial = node
        .kubelet
        .wait_until("devicelet.io/serial", WAIT, |r| r.allocatable == 4)
        .await
        .expect("serial ready");
    assert!(serial.options.pre_start_required);
    assert!(serial.options.get_preferred_allocation_available);

    // The kubelet alone would take the first two ids (both replicas of ttyUSB0); the module
    // spreads over the two adapters.
    let a = node
        .kubelet
        .allocate("devicelet.io/serial", 2)
        .await
        .expect("allocate");
    assert_eq!(
        a.preferred.as_deref(),
        Some(&["ttyUSB0-0".to_string(), "ttyUSB1-0".to_string()][..])
    );
    assert_eq!(a.device_ids, ["ttyUSB0-0", "ttyUSB1-0"]);
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
            devices_ids: vec!["ttyUSB1-0".into()],
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
    let config = format!(r#"groups = [{{ name = "{name}", paths = ["/dev/fuse"], count = 2 }}]"#);
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
