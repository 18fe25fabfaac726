//! What WIT 0.2 lets a module say, as the agent acts on it: devices with their own edits
//! (no `allocate` call), device groups (never split), exclusive devices (never shared), typed
//! attributes, and the module's own version. The reference generic-dev says each through its
//! config (`own-edits`, `together`, `exclusive`).

use devicelet_simulator::SimError;
use devicelet_tests::{Node, WAIT, generic_dev};

const SERIAL: &str = r#"groups = [{ name = "serial", paths = ["/dev/ttyUSB*"], OPTION = true }]"#;

fn serial_with(option: &str) -> String {
    generic_dev(&SERIAL.replace("OPTION", option))
}

fn serial_node(node: &Node) {
    node.add_char("/dev/ttyUSB0", 188, 0);
    node.add_char("/dev/ttyUSB1", 188, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn devices_with_their_own_edits_are_allocated_without_calling_the_module() {
    let node = Node::new().await;
    serial_node(&node);
    let agent = node.start_agent(&serial_with("own-edits")).await;
    node.kubelet
        .wait_until("devicelet.io/serial", WAIT, |r| r.allocatable == 2)
        .await
        .expect("served");
    let a = node
        .kubelet
        .allocate("devicelet.io/serial", 2)
        .await
        .expect("allocate");
    let mut nodes: Vec<_> = a
        .response
        .devices
        .iter()
        .map(|d| (d.host_path.as_str(), d.permissions.as_str()))
        .collect();
    nodes.sort();
    assert_eq!(nodes, [("/dev/ttyUSB0", "rw"), ("/dev/ttyUSB1", "rw")]);
    node.kubelet.release(a.id);
    let one = node
        .kubelet
        .allocate("devicelet.io/serial", 1)
        .await
        .expect("allocate one");
    assert_eq!(one.response.devices.len(), 1);
    let status = agent.status();
    let module = &status.modules[0];
    assert_eq!(
        module.stats.allocate_calls, 0,
        "no allocate call, ahead of time or not"
    );
    assert_eq!(module.version, "0.1.0", "generic-dev's crate version");
    agent.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_is_never_split_and_its_refusal_is_not_the_modules_error() {
    let node = Node::new().await;
    serial_node(&node);
    let agent = node.start_agent(&serial_with("together")).await;
    node.kubelet
        .wait_until("devicelet.io/serial", WAIT, |r| r.allocatable == 2)
        .await
        .expect("served");
    match node.kubelet.allocate("devicelet.io/serial", 1).await {
        Err(SimError::Rpc { code, message, .. }) => {
            assert_eq!(code, tonic::Code::InvalidArgument, "{message}");
            assert!(message.contains("allocated together"), "{message}");
        }
        other => panic!("one device of a group of two: {other:?}"),
    }
    let both = node
        .kubelet
        .allocate("devicelet.io/serial", 2)
        .await
        .expect("the whole group");
    assert_eq!(both.response.devices.len(), 2);
    let stats = agent.status().modules[0].stats;
    assert_eq!((stats.errors, stats.violations), (0, 0), "{stats:?}");
    agent.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sharing_an_exclusive_device_is_refused_by_run_and_validate() {
    let node = Node::new().await;
    serial_node(&node);
    let registry = format!(
        "{}\n[module.sharing]\nreplicas = 2\n",
        serial_with("exclusive")
    );
    let file = node.registry(&registry);
    let (ok, text) = devicelet_tests::validate_registry(&file, &[]);
    assert!(!ok, "{text}");
    assert!(
        text.contains("marks device \"ttyUSB0\" exclusive (never shared)"),
        "{text}"
    );
    // A grouped device is never shared either.
    let grouped = node.registry(&registry.replace("exclusive = true", "together = true"));
    let (ok, text) = devicelet_tests::validate_registry(&grouped, &[]);
    assert!(!ok, "{text}");
    assert!(
        text.contains("marks device \"ttyUSB0\" in a device group"),
        "{text}"
    );
    let agent = node.start_agent(&registry).await;
    // The resource registers, and its first snapshot (from the refused enumeration) lists
    // none of the devices that would have been advertised twice.
    let serial = node
        .kubelet
        .wait_until("devicelet.io/serial", WAIT, |r| r.snapshots > 0)
        .await
        .expect("registered");
    assert!(serial.devices.is_empty(), "{:?}", serial.devices);
    agent.shutdown().await;
}

#[tokio::test]
async fn validate_shows_typed_facts_groups_and_the_modules_version() {
    let node = Node::new().await;
    serial_node(&node);
    let file = node.registry(&serial_with("together"));
    let (ok, text) = devicelet_tests::validate_registry(&file, &[]);
    assert!(ok, "{text}");
    assert!(text.contains("implements devicelet:plugin@0.3.1"), "{text}");
    assert!(text.contains("module version 0.1.0"), "{text}");
    assert!(
        text.contains("ttyUSB0 Healthy {path=/dev/ttyUSB0, dev=188:0} group serial"),
        "{text}"
    );
}
