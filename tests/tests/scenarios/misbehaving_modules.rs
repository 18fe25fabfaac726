//! A module that traps or never returns costs its own resource an error, within its deadline,
//! and nothing else: the agent keeps serving every other resource.

use std::time::{Duration, Instant};

use devicelet_tests::{Node, WAIT, generic_dev, misbehaving, module_status};

const FUSE: &str = r#"groups = [{ name = "fuse", paths = ["/dev/fuse"] }]

[module.sharing.resources.fuse]
replicas = 2"#;

async fn assert_other_module_still_allocates(node: &Node) {
    let fuse = node
        .kubelet
        .allocate("devicelet.io/fuse", 1)
        .await
        .expect("the healthy module keeps serving");
    assert_eq!(fuse.response.devices.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trapping_allocate_is_a_grpc_error_naming_the_module() {
    let node = Node::new().await;
    node.add_char("/dev/fuse", 10, 229);
    let modules = format!(
        "{}\n{}",
        generic_dev(FUSE),
        misbehaving(
            "trapper",
            r#"resource = "bad"
allocate = "trap""#,
            "1s"
        )
    );
    let agent = node.start_agent(&modules).await;
    node.kubelet
        .wait_until("devicelet.io/bad", WAIT, |r| r.allocatable == 2)
        .await
        .expect("bad registered");
    node.kubelet
        .wait_until("devicelet.io/fuse", WAIT, |r| r.allocatable == 2)
        .await
        .expect("fuse registered");

    let err = node
        .kubelet
        .allocate("devicelet.io/bad", 1)
        .await
        .expect_err("a trapping allocate fails the admission");
    let msg = err.to_string();
    assert!(
        msg.contains("trapper") && msg.contains("trapped in allocate"),
        "{msg}"
    );

    assert_eq!(module_status(&agent, "trapper").stats.traps, 1);

    // The instance was replaced: a fresh one takes the next call (and traps again, as
    // configured), once the backoff after the crash is over.
    let deadline = Instant::now() + WAIT;
    let again = loop {
        let msg = node
            .kubelet
            .allocate("devicelet.io/bad", 1)
            .await
            .expect_err("still trapping")
            .to_string();
        if !msg.contains("restarting") || Instant::now() > deadline {
            break msg;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(again.contains("trapped in allocate"), "{again}");
    assert_eq!(
        module_status(&agent, "trapper").stats.traps,
        2,
        "a fresh instance ran the second call"
    );
    node.kubelet
        .wait_until("devicelet.io/bad", WAIT, |r| {
            r.streaming && r.allocatable == 2
        })
        .await
        .expect("the trapping module still lists its devices");
    assert_other_module_still_allocates(&node).await;
    agent.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn looping_allocate_fails_within_its_deadline() {
    let node = Node::new().await;
    node.add_char("/dev/fuse", 10, 229);
    let modules = format!(
        "{}\n{}",
        generic_dev(FUSE),
        misbehaving(
            "spinner",
            r#"resource = "bad"
allocate = "loop""#,
            "300ms"
        )
    );
    let agent = node.start_agent(&modules).await;
    node.kubelet
        .wait_until("devicelet.io/bad", WAIT, |r| r.allocatable == 2)
        .await
        .expect("bad registered");

    let err = node
        .kubelet
        .allocate("devicelet.io/bad", 1)
        .await
        .expect_err("a looping allocate fails the admission");
    let msg = err.to_string();
    // Cut off by the module's cell at its own deadline, not by the caller's backstop (which
    // says it was not stopped in time) and not by the kubelet (which has no deadline).
    assert!(
        msg.contains("module `spinner` missed its 300ms deadline in allocate"),
        "{msg}"
    );
    assert!(!msg.contains("not stopped in time"), "{msg}");

    node.kubelet
        .wait_until("devicelet.io/fuse", WAIT, |r| r.allocatable == 2)
        .await
        .expect("fuse registered");
    assert_other_module_still_allocates(&node).await;
    agent.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn module_returning_an_error_is_reported_with_its_message() {
    let node = Node::new().await;
    let agent = node
        .start_agent(&misbehaving(
            "refuser",
            r#"resource = "bad"
allocate = "error""#,
            "1s",
        ))
        .await;
    node.kubelet
        .wait_until("devicelet.io/bad", WAIT, |r| r.allocatable == 2)
        .await
        .expect("bad registered");
    let msg = node
        .kubelet
        .allocate("devicelet.io/bad", 1)
        .await
        .expect_err("the module's error fails the admission")
        .to_string();
    assert!(
        msg.contains("refuser") && msg.contains("requested failure"),
        "{msg}"
    );
    agent.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn module_preferences_are_used_when_offered() {
    let node = Node::new().await;
    let agent = node
        .start_agent(&misbehaving(
            "chooser",
            r#"resource = "bad"
devices = 4
preferred = "ok"
prestart = "ok""#,
            "1s",
        ))
        .await;
    let state = node
        .kubelet
        .wait_until("devicelet.io/bad", WAIT, |r| r.allocatable == 4)
        .await
        .expect("bad registered");
    assert!(state.options.get_preferred_allocation_available && state.options.pre_start_required);
    let a = node
        .kubelet
        .allocate("devicelet.io/bad", 2)
        .await
        .expect("allocate");
    // The module prefers the last ids offered; the kubelet alone would take the first.
    assert_eq!(a.device_ids, ["dev-2", "dev-3"]);
    assert_eq!(
        a.response
            .envs
            .get("MISBEHAVING_DEVICES")
            .map(String::as_str),
        Some("dev-2,dev-3")
    );
    assert!(a.prestarted);
    agent.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_allocate_that_traps_while_prepared_ahead_traps_once_per_module_version() {
    let node = Node::new().await;
    node.add_char("/dev/fuse", 10, 229);
    let bad = misbehaving("trapper", "resource = \"bad\"\nallocate = \"trap\"", "1s")
        .replace("allocate-ahead = false", "allocate-ahead = true");
    let agent = node
        .start_agent(&format!("{}\n{bad}", generic_dev(FUSE)))
        .await;
    let traps = || {
        devicelet_tests::module_status(&agent, "trapper")
            .stats
            .traps
    };
    devicelet_tests::eventually("the first preparation traps", || traps() == 1).await;

    // Enumerations keep coming (every 100 ms): preparation stays stopped for this version, so
    // the kubelet's calls never meet a cell restarting because of it again.
    let mut progress = agent
        .resource("devicelet.io/bad")
        .expect("served")
        .prepared
        .progress();
    let rounds = progress.borrow_and_update().rounds;
    tokio::time::timeout(WAIT, progress.wait_for(|p| p.rounds >= rounds + 5))
        .await
        .expect("the preparer keeps checking")
        .expect("the preparer runs");
    assert_eq!(traps(), 1, "asking ahead cost one crash, no more");
    assert_eq!(progress.borrow().ready, 0, "nothing to serve from memory");

    let msg = node.refused_allocation("devicelet.io/bad").await;
    assert!(msg.contains("trapper"), "{msg}");
    assert_other_module_still_allocates(&node).await;
    agent.shutdown().await;
}
