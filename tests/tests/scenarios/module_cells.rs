//! Module cells: one vendor's module can never stall another's. Each scenario has an offender
//! and a well-behaved module (generic-dev serving fuse) on the same agent, and asserts both that
//! the offender is cut off and that the healthy module keeps answering Allocate.
//!
//! A host call that blocks for real (a driver that hangs a sysfs read) cannot be made in a fixture
//! tree; the abandonment of a cell whose thread is blocked is shown by the unit tests in
//! `runtime/src/sandbox/cell.rs`, with a thread blocked for real.

use std::time::Duration;

use devicelet::agent::Agent;
use devicelet::sandbox::Device;
use devicelet_tests::{
    Node, WAIT, generic_dev, hostile, misbehaving, module_status, probe_error, served_devices,
};

const FUSE: &str = r#"groups = [{ name = "fuse", paths = ["/dev/fuse"] }]

[module.sharing.resources.fuse]
replicas = 2"#;

fn node_with_fuse(node: &Node) {
    node.add_char("/dev/fuse", 10, 229);
    node.add_char("/dev/kvm", 10, 232);
}

async fn fuse_answers_allocate(node: &Node) {
    node.kubelet
        .wait_until("devicelet.io/fuse", WAIT, |r| r.allocatable >= 1)
        .await
        .expect("fuse served");
    node.kubelet
        .allocate("devicelet.io/fuse", 1)
        .await
        .expect("the healthy module keeps answering Allocate");
}

fn evil_devices(agent: &Agent) -> Vec<Device> {
    served_devices(agent, "devicelet.io/evil")
}

fn mkfifo(path: &std::path::Path) {
    let c = std::ffi::CString::new(path.to_str().expect("utf-8")).expect("no NUL");
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo");
}

/// Before cells, reading a FIFO blocked one of the agent's two workers for good; now the read is
/// refused at once (regular files only) and nothing else notices.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fifo_in_a_granted_sysfs_path_is_refused_not_read() {
    let node = Node::new().await;
    node_with_fuse(&node);
    node.tree
        .write_file("/sys/class/granted/ok", "fine\n")
        .expect("sysfs");
    mkfifo(&node.tree.path("/sys/class/granted/fifo"));
    let modules = format!(
        "{}\n{}",
        generic_dev(FUSE),
        hostile("read-sysfs", Some("/sys/class/granted/fifo"))
    );
    let agent = node.start_agent(&modules).await;
    let error = probe_error(&evil_devices(&agent));
    assert!(error.contains("not a regular file"), "{error}");
    fuse_answers_allocate(&node).await;
    agent.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recursive_globs_are_refused_and_symlink_loops_end() {
    let node = Node::new().await;
    node_with_fuse(&node);
    std::fs::create_dir_all(node.tree.path("/dev/loop")).expect("dir");
    std::os::unix::fs::symlink(".", node.tree.path("/dev/loop/self")).expect("symlink loop");
    let modules = format!(
        "{}\n{}",
        generic_dev(FUSE),
        hostile("glob-dev", Some("/dev/**"))
    );
    let agent = node.start_agent(&modules).await;
    let error = probe_error(&evil_devices(&agent));
    assert!(error.contains("Denied") && error.contains("**"), "{error}");
    agent.shutdown().await;

    // A pattern as deep as it likes through a granted symlink loop: the walk goes exactly as deep
    // as the pattern and ends, with the one path that deep.
    let deep = format!("/dev/loop{}", "/*".repeat(20));
    let modules = format!(
        r#"{}
[[module]]
name = "hostile"
path = "@MODULES@/hostile.wasm"
health-interval = "100ms"

[module.grants]
sysfs = ["/sys/class/granted"]
dev = ["/dev/loop"]

[module.config]
attack = "glob-dev"
path = "{deep}"
"#,
        generic_dev(FUSE)
    );
    let agent = node.start_agent(&modules).await;
    let devices = evil_devices(&agent);
    assert_eq!(probe_error(&devices), "", "the walk succeeded");
    let found: Vec<&Device> = devices
        .iter()
        .filter(|d| d.id.starts_with("found-"))
        .collect();
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(
        found[0].attributes,
        [(
            "path".to_string(),
            format!("/dev/loop{}", "/self".repeat(20)).as_str().into()
        )]
    );
    assert_eq!(module_status(&agent, "hostile").stats.deadlines, 0);
    fuse_answers_allocate(&node).await;
    agent.shutdown().await;
}

/// The hostile module granted `/dev/fuse` and `/dev/granted-*`, answering Allocate with `attack`
/// on the kubelet's own call (not prepared ahead, which would meet the same checks first).
fn hostile_edit(attack: &str, path: &str) -> String {
    format!(
        r#"[[module]]
name = "hostile"
path = "@MODULES@/hostile.wasm"
call-deadline = "1s"
allocate-ahead = false

[module.grants]
sysfs = ["/sys/class/granted"]
dev = ["/dev/fuse", "/dev/granted-*"]

[module.config]
attack = "{attack}"
path = "{path}"
"#
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn container_edits_are_checked_where_they_lead_not_as_text() {
    for (attack, path, refused) in [
        (
            "device-node",
            "/dev/granted-link",
            Some("not under the module's /dev grants"),
        ),
        (
            "device-node",
            "/dev/granted-dir",
            Some("not a character or block device"),
        ),
        (
            "device-node",
            "/dev/granted-missing",
            Some("does not resolve"),
        ),
        ("mount-path", "/dev/granted-etc", Some("does not resolve")),
        ("device-node", "/dev/granted-real", None),
    ] {
        let node = Node::new().await;
        node_with_fuse(&node);
        std::os::unix::fs::symlink("kvm", node.tree.path("/dev/granted-link")).expect("symlink");
        std::fs::create_dir_all(node.tree.path("/dev/granted-dir")).expect("dir");
        std::os::unix::fs::symlink("/etc", node.tree.path("/dev/granted-etc")).expect("symlink");
        node.add_char("/dev/granted-real", 10, 200);
        let modules = format!("{}\n{}", generic_dev(FUSE), hostile_edit(attack, path));
        let agent = node.start_agent(&modules).await;
        node.kubelet
            .wait_until("devicelet.io/evil", WAIT, |r| r.allocatable == 2)
            .await
            .expect("evil served");
        let answer = node.kubelet.allocate("devicelet.io/evil", 1).await;
        match refused {
            Some(rule) => {
                let msg = answer.expect_err("refused").to_string();
                assert!(
                    msg.contains("hostile") && msg.contains(rule),
                    "{path}: {msg}"
                );
                assert_eq!(module_status(&agent, "hostile").stats.violations, 1);
            }
            None => {
                answer.expect("a real granted device node is handed out");
            }
        }
        fuse_answers_allocate(&node).await;
        agent.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attribute_flood_is_refused_within_the_host_memory_budget() {
    let node = Node::new().await;
    node_with_fuse(&node);
    let modules = format!(
        "{}\n{}",
        generic_dev(FUSE),
        hostile("attribute-flood", None)
    );
    let agent = node.start_agent(&modules).await;
    let evil = node
        .kubelet
        .wait_until("devicelet.io/evil", WAIT, |r| r.snapshots > 0)
        .await
        .expect("evil registered");
    assert_eq!(evil.capacity, 0, "no device of the refused answer is kept");
    let status = module_status(&agent, "hostile");
    assert!(status.stats.violations >= 1);
    assert_eq!(
        status.host_memory, 0,
        "the refused flood was its only answer: nothing of it is held"
    );
    assert!(
        status.host_memory_limit < 24_000_000,
        "the flood is above the default budget"
    );
    fuse_answers_allocate(&node).await;
    agent.shutdown().await;
}

/// The slow module comes first in the registry; with a serial start-up the healthy one would
/// register only after the slow one's first enumeration gave up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_module_delays_no_other_module_at_start() {
    let node = Node::new().await;
    node_with_fuse(&node);
    // Its first enumeration spins for 10 s: far longer than generic-dev needs to start, even on
    // a loaded machine.
    let slow = misbehaving("slow", "enumerate = \"loop\"", "2s").replace(
        "call-deadline = \"2s\"",
        "call-deadline = \"2s\"\nhealth-deadline = \"10s\"",
    );
    let modules = format!("{slow}\n{}", generic_dev(FUSE));
    let registry = devicelet::config::Registry::load(&node.registry(&modules)).expect("registry");
    let options = node.agent_options(registry);
    let mut starting = tokio::spawn(Agent::start(options));
    node.kubelet
        .wait_until("devicelet.io/fuse", WAIT, |r| r.allocatable == 2)
        .await
        .expect("fuse registers while the slow module is still enumerating");
    assert!(
        node.kubelet.resource("devicelet.io/bad").is_none(),
        "the slow module is not registered yet: its first enumeration is still running"
    );
    fuse_answers_allocate(&node).await;
    let agent = tokio::time::timeout(WAIT, &mut starting)
        .await
        .expect("start-up ends once the slow enumeration hits its deadline")
        .expect("task")
        .expect("agent");
    assert!(module_status(&agent, "slow").stats.deadlines >= 1);
    agent.shutdown().await;
}

/// Kubelet calls and health work run in separate cells: an Allocate never queues behind an
/// enumeration that spins until its (long) health deadline. Allocate is called straight on the
/// plugin socket, as the kubelet would for a device it already holds, for a second while
/// enumerations spin back to back: queued behind one, it would miss its own 1 s deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allocate_never_waits_behind_a_spinning_enumeration() {
    use devicelet::kubelet::api::deviceplugin::{
        AllocateRequest, ContainerAllocateRequest, device_plugin_client::DevicePluginClient,
    };
    let node = Node::new().await;
    node_with_fuse(&node);
    let switch = "/sys/testing/switch";
    let spinner = format!(
        r#"[[module]]
name = "spinner"
path = "@MODULES@/misbehaving.wasm"
health-interval = "100ms"
call-deadline = "1s"
health-deadline = "5s"

[module.grants]
sysfs = ["/sys/testing"]

[module.config]
switch = {switch:?}
"#
    );
    let modules = format!("{spinner}\n{}", generic_dev(FUSE));
    let agent = node.start_agent(&modules).await;
    node.kubelet
        .wait_until("devicelet.io/bad", WAIT, |r| r.allocatable == 2)
        .await
        .expect("spinner served");
    let socket = agent.resource("devicelet.io/bad").expect("served").socket;
    let mut plugin = DevicePluginClient::new(
        devicelet::kubelet::uds::connect(&socket)
            .await
            .expect("dial"),
    );
    node.tree.write_file(switch, "loop").expect("switch");
    devicelet_tests::eventually("an enumeration to spin to its deadline", || {
        module_status(&agent, "spinner").stats.deadlines >= 1
    })
    .await;
    for _ in 0..20 {
        // Two devices: never prepared, so the module's own kubelet cell answers each time.
        let request = AllocateRequest {
            container_requests: vec![ContainerAllocateRequest {
                devices_ids: vec!["dev-0".into(), "dev-1".into()],
            }],
        };
        plugin
            .allocate(request)
            .await
            .expect("Allocate answered while enumerations spin");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    fuse_answers_allocate(&node).await;
    agent.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn module_files_that_are_not_regular_files_are_refused() {
    let node = Node::new().await;
    node_with_fuse(&node);
    let fifo = node.dir.path().join("fifo.wasm");
    mkfifo(&fifo);
    let dir = node.dir.path().join("dir.wasm");
    std::fs::create_dir(&dir).expect("dir");
    let entry = |name: &str, path: &std::path::Path| {
        format!(
            "[[module]]\nname = \"{name}\"\npath = {:?}\n",
            path.display().to_string()
        )
    };
    let modules = format!(
        "{}\n{}\n{}",
        entry("fifo", &fifo),
        entry("dir", &dir),
        generic_dev(FUSE)
    );
    let agent = tokio::time::timeout(WAIT, node.start_agent(&modules))
        .await
        .expect("a FIFO module file must not hang start-up");
    let errors = agent.load_errors();
    assert!(
        errors
            .iter()
            .any(|e| e.contains("`fifo`") && e.contains("not a regular file but a FIFO")),
        "{errors:?}"
    );
    assert!(
        errors
            .iter()
            .any(|e| e.contains("`dir`") && e.contains("not a regular file but a directory")),
        "{errors:?}"
    );
    fuse_answers_allocate(&node).await;
    agent.shutdown().await;
}

/// A module whose Allocate spins is cut off at its deadline, the failure is counted, and its other
/// resource keeps being enumerated by the other cell.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spinning_allocate_is_cut_off_at_its_deadline() {
    let node = Node::new().await;
    node_with_fuse(&node);
    let modules = format!(
        "{}\n{}",
        misbehaving("spinner", "allocate = \"loop\"", "300ms"),
        generic_dev(FUSE)
    );
    let agent = node.start_agent(&modules).await;
    node.kubelet
        .wait_until("devicelet.io/bad", WAIT, |r| r.allocatable == 2)
        .await
        .expect("served");
    let msg = node
        .kubelet
        .allocate("devicelet.io/bad", 1)
        .await
        .expect_err("the spin is cut off")
        .to_string();
    // By its cell at the deadline, not by the caller's backstop.
    assert!(msg.contains("missed its"), "{msg}");
    assert!(!msg.contains("not stopped in time"), "{msg}");
    assert_eq!(module_status(&agent, "spinner").stats.deadlines, 1);
    assert_eq!(
        served_devices(&agent, "devicelet.io/bad").len(),
        2,
        "enumeration is unaffected"
    );
    fuse_answers_allocate(&node).await;
    agent.shutdown().await;
}

/// The same through hot reload: an edit naming a FIFO as a module file is reported, and the
/// running modules keep serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_reload_to_a_fifo_module_file_is_refused_and_others_serve() {
    let node = Node::new().await;
    node_with_fuse(&node);
    let agent = node.start_agent(&generic_dev(FUSE)).await;
    fuse_answers_allocate(&node).await;
    let fifo = node.dir.path().join("new.wasm");
    mkfifo(&fifo);
    node.registry(&format!(
        "{}\n[[module]]\nname = \"newcomer\"\npath = {:?}\n",
        generic_dev(FUSE),
        fifo.display().to_string()
    ));
    devicelet_tests::eventually("the FIFO module file to be reported", || {
        agent
            .load_errors()
            .iter()
            .any(|e| e.contains("`newcomer`") && e.contains("not a regular file but a FIFO"))
    })
    .await;
    fuse_answers_allocate(&node).await;
    agent.shutdown().await;
}
