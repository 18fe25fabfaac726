//! The second way to the kubelet: a socket per resource in the plugin watcher's directory
//! (`--registration plugin-watcher`), which the kubelet finds by itself, after its own restarts
//! too, while `kubelet.sock` plays no part.

use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;

use devicelet::kubelet::route::Route;
use devicelet_simulator::{SimConfig, Simulator};
use devicelet_tests::{Node, WAIT, generic_dev, misbehaving};

const FUSE: &str = r#"groups = [{ name = "fuse", paths = ["/dev/fuse"] }]

[module.sharing.resources.fuse]
replicas = 2"#;

/// A node whose kubelet also watches `plugins_registry/`.
async fn watched_node() -> (Node, Simulator, PathBuf) {
    let node = Node::new().await;
    node.add_char("/dev/fuse", 10, 229);
    let registry = node.dir.path().join("plugins_registry");
    let dir = node.dir.path().join("watched").join("device-plugins");
    let kubelet = Simulator::start_with(
        &dir,
        SimConfig {
            plugins_registry: Some(registry.clone()),
            ..SimConfig::default()
        },
    )
    .await
    .expect("the kubelet");
    (node, kubelet, registry)
}

/// The agent on the plugin-watcher route of `kubelet`.
async fn on_watcher(
    node: &Node,
    kubelet: &Simulator,
    registry: &std::path::Path,
    modules: &str,
) -> devicelet::agent::Agent {
    node.start_agent_with(modules, |o| {
        o.plugin_dir = kubelet.plugin_dir().to_owned();
        o.registration = Route::PluginWatcher(registry.to_owned());
    })
    .await
}

/// generic-dev's fuse on the plugin-watcher route, once the kubelet registered it.
async fn fuse_on_watcher(
    node: &Node,
    kubelet: &Simulator,
    registry: &std::path::Path,
) -> devicelet::agent::Agent {
    let agent = on_watcher(node, kubelet, registry, &generic_dev(FUSE)).await;
    kubelet
        .wait_until("devicelet.io/fuse", WAIT, |r| {
            r.registrations == 1 && r.allocatable == 2
        })
        .await
        .expect("registered");
    agent
}

fn our_sockets(registry: &std::path::Path) -> Vec<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir(registry)
        .expect("the registry directory")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "sock"))
        .collect();
    found.sort();
    found
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plugin_watcher_registers_serves_and_survives_a_kubelet_restart_by_itself() {
    let (node, kubelet, registry) = watched_node().await;
    let modules = format!(
        "{}\n{}",
        generic_dev(FUSE),
        misbehaving("other", "resource = \"bad\"", "1s")
    );
    let agent = on_watcher(&node, &kubelet, &registry, &modules).await;
    for resource in ["devicelet.io/fuse", "devicelet.io/bad"] {
        kubelet
            .wait_until(resource, WAIT, |r| {
                r.registrations == 1 && r.streaming && r.allocatable == 2
            })
            .await
            .unwrap_or_else(|e| panic!("{resource} registered through the watcher: {e}"));
    }
    // Our sockets live in the watcher's directory and nothing of ours in the kubelet's.
    let sockets = our_sockets(&registry);
    assert_eq!(sockets.len(), 2, "{sockets:?}");
    let in_plugin_dir: Vec<_> = std::fs::read_dir(kubelet.plugin_dir())
        .expect("the kubelet directory")
        .flatten()
        .map(|e| e.file_name())
        .filter(|n| n.to_string_lossy().starts_with("devicelet-"))
        .collect();
    assert!(in_plugin_dir.is_empty(), "{in_plugin_dir:?}");
    let attempts = kubelet
        .wait_registry(WAIT, |a| a.iter().filter(|a| a.registered()).count() == 2)
        .await
        .expect("both registrations reported");
    assert!(
        attempts.iter().all(|a| a.registered()
            && a.notified == Some(Ok(()))
            && a.info.as_ref().is_some_and(|i| i.r#type == "DevicePlugin"
                && i.supported_versions == ["v1beta1"]
                && std::path::Path::new(&i.endpoint) == a.socket)),
        "{attempts:#?}"
    );
    let fuse = agent.resource("devicelet.io/fuse").expect("served");
    assert!(sockets.contains(&fuse.socket));
    eventually_registered(&fuse).await;

    let allocation = kubelet
        .allocate("devicelet.io/fuse", 1)
        .await
        .expect("allocate through the watcher's registration");
    assert_eq!(allocation.response.devices.len(), 1);

    // The kubelet restarts. Nothing of ours is deleted and `kubelet.sock` is never dialed:
    // the new kubelet finds the same socket files by its start-up scan.
    let inodes: Vec<u64> = sockets
        .iter()
        .map(|s| std::fs::metadata(s).expect("socket").ino())
        .collect();
    kubelet.restart().await.expect("kubelet restart");
    for resource in ["devicelet.io/fuse", "devicelet.io/bad"] {
        kubelet
            .wait_until(resource, WAIT, |r| {
                r.registrations == 2 && r.streaming && r.allocatable == 2
            })
            .await
            .unwrap_or_else(|e| panic!("{resource} found again after the restart: {e}"));
    }
    let after: Vec<u64> = our_sockets(&registry)
        .iter()
        .map(|s| std::fs::metadata(s).expect("socket").ino())
        .collect();
    assert_eq!(after, inodes, "the same socket files, never made again");
    let fuse = agent.resource("devicelet.io/fuse").expect("served");
    devicelet_tests::eventually("the second report", || {
        *fuse.registrations.borrow() == 2 && fuse.registration.registered()
    })
    .await;
    kubelet
        .allocate("devicelet.io/fuse", 1)
        .await
        .expect("allocate through the new kubelet");

    // Stopping removes the sockets: the watcher deregisters both resources.
    agent.shutdown().await;
    kubelet
        .wait_until("devicelet.io/fuse", WAIT, |r| {
            !r.streaming && r.allocatable == 0
        })
        .await
        .expect("deregistered when its socket went");
    assert!(our_sockets(&registry).is_empty());
}

async fn eventually_registered(r: &devicelet::agent::ServedResource) {
    devicelet_tests::eventually("the kubelet's report", || r.registration.registered()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registry_socket_deleted_by_someone_is_served_again() {
    let (node, kubelet, registry) = watched_node().await;
    let agent = fuse_on_watcher(&node, &kubelet, &registry).await;
    let socket = agent.resource("devicelet.io/fuse").expect("served").socket;
    std::fs::remove_file(&socket).expect("delete our socket");
    kubelet
        .wait_until("devicelet.io/fuse", WAIT, |r| {
            r.registrations == 2 && r.streaming && r.allocatable == 2
        })
        .await
        .expect("served again and registered again");
    assert!(socket.exists(), "served again on the same path");
    agent.shutdown().await;
}

/// The kubelet does not retry a registration its device manager failed (it counts the socket
/// as handled): the agent, told of the failure and not registered after a backoff, serves on a
/// new file, which the watcher registers anew.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_registration_report_makes_the_agent_serve_on_a_new_file() {
    use devicelet::kubelet::api::pluginregistration::RegistrationStatus;
    use devicelet::kubelet::api::pluginregistration::registration_client::RegistrationClient;
    let (node, kubelet, registry) = watched_node().await;
    let agent = fuse_on_watcher(&node, &kubelet, &registry).await;
    let fuse = agent.resource("devicelet.io/fuse").expect("served");
    let inode = std::fs::metadata(&fuse.socket).expect("socket").ino();
    // The watcher's report of the first registration reaches the agent after the simulator
    // counts it: wait for it, or it could land after the failure below and cancel the retry.
    devicelet_tests::eventually("the first registration reported", || {
        fuse.registration.registered()
    })
    .await;

    // What the kubelet's watcher sends when its device manager failed: on its own connection,
    // with the socket's path as `:authority`, as grpc-go does.
    let path = fuse.socket.display().to_string();
    let channel = devicelet::kubelet::api::authority::connect(&fuse.socket, &path)
        .await
        .expect("dial the registration socket");
    RegistrationClient::new(channel)
        .notify_registration_status(RegistrationStatus {
            plugin_registered: false,
            error: "RegisterPlugin error -- plugin registration failed".into(),
        })
        .await
        .expect("the report is taken");
    devicelet_tests::eventually("the failure counted", || {
        fuse.registration.failures() == 1 && !fuse.registration.registered()
    })
    .await;

    kubelet
        .wait_until("devicelet.io/fuse", WAIT, |r| {
            r.registrations == 2 && r.streaming && r.allocatable == 2
        })
        .await
        .expect("registered again from a new file");
    let now = std::fs::metadata(&fuse.socket).expect("socket").ino();
    assert_ne!(now, inode, "served on a new file");
    devicelet_tests::eventually("registered again", || fuse.registration.registered()).await;
    agent.shutdown().await;
}
