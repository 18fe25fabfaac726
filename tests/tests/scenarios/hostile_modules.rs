//! Modules written to attack the host. Each attack is refused, the module's counters say so, and
//! a well-behaved module next to it keeps serving.

use devicelet::agent::Agent;
use devicelet::sandbox::Device;
use devicelet_tests::{
    Node, WAIT, generic_dev, hostile, misbehaving, module_status, probe_error, served_devices,
};

const FUSE: &str = r#"groups = [{ name = "fuse", paths = ["/dev/fuse"] }]

[module.sharing.resources.fuse]
replicas = 2"#;

/// A node with /dev/fuse, /dev/kvm and a granted sysfs file, the hostile module with `attack`
/// and generic-dev serving fuse next to it.
async fn attacked(attack: &str, path: Option<&str>) -> (Node, Agent) {
    let node = Node::new().await;
    node.add_char("/dev/fuse", 10, 229);
    node.add_char("/dev/kvm", 10, 232);
    node.tree
        .write_file("/sys/class/granted/ok", "fine\n")
        .expect("sysfs");
    node.tree
        .write_file("/sys/secret/x", "secret\n")
        .expect("sysfs");
    // Something to find outside /dev, so a refused glob and an empty one differ.
    node.tree
        .write_file("/etc/passwd", "root:x:0:0\n")
        .expect("etc");
    let outside = node.dir.path().join("outside-the-root");
    std::fs::write(&outside, "host secret\n").expect("outside file");
    std::os::unix::fs::symlink(&outside, node.tree.path("/sys/class/granted/escape"))
        .expect("symlink");
    let modules = format!("{}\n{}", generic_dev(FUSE), hostile(attack, path));
    let agent = node.start_agent(&modules).await;
    node.kubelet
        .wait_until("devicelet.io/fuse", WAIT, |r| r.allocatable == 2)
        .await
        .expect("the well-behaved module is served");
    (node, agent)
}

fn hostile_devices(agent: &Agent) -> Vec<Device> {
    served_devices(agent, "devicelet.io/evil")
}

fn violations(agent: &Agent) -> u64 {
    module_status(agent, "hostile").stats.violations
}

async fn still_serves_fuse(node: &Node) {
    node.kubelet
        .allocate("devicelet.io/fuse", 1)
        .await
        .expect("the other module keeps serving");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_outside_the_grants_are_denied() {
    for path in [
        "/sys/../etc/passwd",
        "/etc/passwd",
        "/sys/secret/x",
        "/sys/class/granted/escape",
    ] {
        let (node, agent) = attacked("read-sysfs", Some(path)).await;
        let devices = hostile_devices(&agent);
        assert!(devices.iter().all(|d| d.id != "leaked"), "{path} was read");
        let error = probe_error(&devices);
        assert!(error.contains("Denied"), "{path}: {error}");
        still_serves_fuse(&node).await;
        agent.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_granted_read_works_which_shows_the_denials_are_real() {
    let (_node, agent) = attacked("read-sysfs", Some("/sys/class/granted/ok")).await;
    assert!(hostile_devices(&agent).iter().any(|d| d.id == "leaked"));
    agent.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_globs_see_only_granted_nodes() {
    let (_node, agent) = attacked("glob-dev", Some("/dev/*")).await;
    let found: Vec<String> = hostile_devices(&agent)
        .iter()
        .filter(|d| d.id.starts_with("found-"))
        .flat_map(|d| {
            d.attributes
                .iter()
                .filter(|(k, _)| k == "path")
                .map(|(_, v)| v.to_string())
        })
        .collect();
    assert_eq!(found, ["/dev/fuse"], "/dev/kvm exists but is not granted");
    agent.shutdown().await;

    let (_node, agent) = attacked("glob-dev", Some("/dev/../etc/*")).await;
    let devices = hostile_devices(&agent);
    assert!(devices.iter().all(|d| !d.id.starts_with("found-")));
    let error = probe_error(&devices);
    assert!(error.contains("Denied"), "/etc/passwd exists: {error}");
    agent.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forbidden_container_edits_are_refused() {
    for (attack, rule) in [
        ("dev-mem", "/dev/mem"),
        ("mount-root", "mount"),
        ("huge-string", "at most"),
        ("bad-env", "not a valid variable name"),
        ("bad-cdi", "CDI device"),
    ] {
        let (node, agent) = attacked(attack, None).await;
        let msg = node.refused_allocation("devicelet.io/evil").await;
        assert!(
            msg.contains("hostile") && msg.contains(rule),
            "{attack}: {msg}"
        );
        assert!(
            msg.len() < 2000,
            "{attack}: the error must not carry the payload"
        );
        assert_eq!(violations(&agent), 1, "{attack}");
        still_serves_fuse(&node).await;
        agent.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_device_lists_are_refused() {
    for attack in ["many-devices", "invalid-ids", "duplicate-ids"] {
        let (node, agent) = attacked(attack, None).await;
        let evil = node
            .kubelet
            .wait_until("devicelet.io/evil", WAIT, |r| r.snapshots > 0)
            .await
            .expect("evil registered");
        assert_eq!(
            evil.capacity, 0,
            "{attack}: no device of a refused list is advertised"
        );
        assert!(violations(&agent) >= 1, "{attack}");
        still_serves_fuse(&node).await;
        agent.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_module_flooding_stdout_keeps_serving() {
    let (node, agent) = attacked("stdout-flood", None).await;
    node.kubelet
        .wait_until("devicelet.io/evil", WAIT, |r| r.allocatable == 2)
        .await
        .expect("the flooding module still serves");
    // The module printed 20,000 lines: all but the allowance (a burst of 50, then 5 a second)
    // were dropped, and counted.
    let dropped = devicelet_tests::module_status(&agent, "hostile")
        .stats
        .log_lines_dropped;
    assert!(dropped >= 19_000, "only {dropped} of 20,000 lines dropped");
    still_serves_fuse(&node).await;
    agent.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_memory_bomb_hits_the_limit_and_traps() {
    let node = Node::new().await;
    node.add_char("/dev/fuse", 10, 229);
    let modules = format!(
        "{}\n{}",
        generic_dev(FUSE),
        misbehaving("bomb", "resource = \"bad\"\nallocate = \"memory\"", "5s")
    );
    let agent = node.start_agent(&modules).await;
    let msg = node.refused_allocation("devicelet.io/bad").await;
    assert!(msg.contains("bomb") && msg.contains("trapped"), "{msg}");
    let traps = agent
        .status()
        .modules
        .iter()
        .find(|m| m.name == "bomb")
        .map(|m| m.stats.traps);
    assert_eq!(traps, Some(1));
    node.kubelet
        .wait_until("devicelet.io/fuse", WAIT, |r| r.allocatable == 2)
        .await
        .expect("fuse");
    still_serves_fuse(&node).await;
    agent.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_infinite_loop_in_any_export_is_cut_at_the_deadline() {
    // init: the module is refused at load, the other one served.
    let node = Node::new().await;
    node.add_char("/dev/fuse", 10, 229);
    let modules = format!(
        "{}\n{}",
        generic_dev(FUSE),
        misbehaving("spin-init", "init = \"loop\"", "300ms")
    );
    let agent = node.start_agent(&modules).await;
    let errors = agent.load_errors();
    assert!(
        errors
            .iter()
            .any(|e| e.contains("spin-init") && e.contains("deadline")),
        "{errors:?}"
    );
    still_serves_fuse_after_ready(&node).await;
    agent.shutdown().await;

    // enumerate: registered with no devices; prestart: the allocation fails; preferred: the
    // host's own choice stands in (the kubelet would fail the admission on an error).
    for (call, config) in [
        ("enumerate", "enumerate = \"loop\""),
        ("prestart", "prestart = \"loop\""),
        ("preferred", "preferred = \"loop\""),
    ] {
        let node = Node::new().await;
        node.add_char("/dev/fuse", 10, 229);
        let modules = format!(
            "{}\n{}",
            generic_dev(FUSE),
            misbehaving("spinner", config, "300ms")
        );
        let agent = node.start_agent(&modules).await;
        let bad = node
            .kubelet
            .wait_until("devicelet.io/bad", WAIT, |r| r.snapshots > 0)
            .await
            .expect("registered");
        if call == "enumerate" {
            assert_eq!(bad.capacity, 0);
        } else if call == "preferred" {
            node.kubelet
                .allocate("devicelet.io/bad", 1)
                .await
                .expect("a looping preferred leaves the host's choice in its place");
        } else {
            let msg = node
                .kubelet
                .allocate("devicelet.io/bad", 1)
                .await
                .expect_err("a looping call fails the allocation")
                .to_string();
            // Cut off in the cell at the deadline, not by the caller's backstop.
            assert!(
                msg.contains(&format!(
                    "module `spinner` missed its 300ms deadline in {call}"
                )),
                "{call}: {msg}"
            );
            assert!(!msg.contains("not stopped in time"), "{call}: {msg}");
        }
        let deadlines = agent
            .status()
            .modules
            .iter()
            .find(|m| m.name == "spinner")
            .map(|m| m.stats.deadlines);
        assert!(deadlines.unwrap_or_default() >= 1, "{call}");
        still_serves_fuse_after_ready(&node).await;
        agent.shutdown().await;
    }
}

async fn still_serves_fuse_after_ready(node: &Node) {
    node.kubelet
        .wait_until("devicelet.io/fuse", WAIT, |r| r.allocatable == 2)
        .await
        .expect("fuse");
    still_serves_fuse(node).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_module_cannot_take_over_another_resource() {
    let node = Node::new().await;
    let modules = format!(
        "{}\n{}\n{}",
        misbehaving("owner", "resource = \"bad\"", "1s"),
        misbehaving("squatter", "resource = \"bad\"", "1s"),
        misbehaving("impostor", "resource = \"nvidia.com/gpu\"", "1s"),
    );
    let agent = node.start_agent(&modules).await;
    let served = node
        .kubelet
        .wait_until("devicelet.io/bad", WAIT, |r| r.allocatable == 2)
        .await
        .expect("one of the two claimants serves the resource");
    // Modules start in parallel: whichever is ready first claims the name, the other is refused.
    let owner = agent
        .resource("devicelet.io/bad")
        .map(|r| r.module)
        .expect("served");
    let loser = if owner == "owner" {
        "squatter"
    } else {
        "owner"
    };
    let errors = agent.load_errors();
    assert!(
        errors.iter().any(|e| e.contains("registry.toml:")
            && e.contains(&format!(": module `{loser}` declared"))
            && e.contains(&format!("module `{owner}` already serves"))),
        "{errors:?}"
    );
    assert!(
        errors
            .iter()
            .any(|e| e.contains("impostor") && e.contains("outside its resource domain")),
        "{errors:?}"
    );
    assert!(node.kubelet.resource("nvidia.com/gpu").is_none());
    assert_eq!(served.registrations, 1);
    agent.shutdown().await;
}
