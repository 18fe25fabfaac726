//! The WIT is frozen per published version: a module built against an older 0.1.x keeps loading
//! into today's agent, and one built against a version the agent does not speak is refused by
//! name before anything links.

use devicelet::sandbox::bindings::imports::{LATEST, speaks};
use devicelet_tests::{Node, WAIT, generic_dev, module_dir};

/// The module built straight from `wit/v0.1.0/` (no SDK), granted `/dev/fuse`.
fn legacy(path: &str) -> String {
    format!(
        r#"[[module]]
name = "legacy"
path = "{path}"
health-interval = "100ms"

[module.grants]
dev = ["/dev/fuse"]
"#
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_module_built_against_wit_0_1_0_registers_and_allocates_in_todays_agent() {
    let node = Node::new().await;
    node.add_char("/dev/fuse", 10, 229);
    let agent = node.start_agent(&legacy("@MODULES@/wit_0_1_0.wasm")).await;
    assert!(agent.load_errors().is_empty(), "{:?}", agent.load_errors());

    let fuse = node
        .kubelet
        .wait_until("devicelet.io/legacy", WAIT, |r| r.snapshots > 0)
        .await
        .expect("the 0.1.0 module registered with a snapshot");
    let ids: Vec<_> = fuse.devices.iter().map(|d| d.id.as_str()).collect();
    assert_eq!(ids, ["fuse"]);

    let a = node
        .kubelet
        .allocate("devicelet.io/legacy", 1)
        .await
        .expect("an allocation from the 0.1.0 module");
    assert_eq!(
        a.response.envs.get("LEGACY_DEVICES").map(String::as_str),
        Some("fuse")
    );
    let nodes: Vec<_> = a
        .response
        .devices
        .iter()
        .map(|d| d.host_path.as_str())
        .collect();
    assert_eq!(nodes, ["/dev/fuse"]);
    agent.shutdown().await;
}

#[tokio::test]
async fn validate_says_which_version_a_module_implements() {
    let node = Node::new().await;
    let file = node.registry(&legacy("@MODULES@/wit_0_1_0.wasm"));
    let (ok, text) = devicelet_tests::validate_registry(&file, &[]);
    assert!(ok, "{text}");
    assert!(text.contains("implements devicelet:plugin@0.1.0"), "{text}");
    assert!(text.contains("devicelet:plugin/devnodes@0.1.0"), "{text}");
}

/// generic-dev (built with today's SDK, against the latest WIT) with every `devicelet:plugin…`
/// version in its component rewritten to `version` (the same length, so the binary stays
/// well-formed): what a module built with another SDK looks like, when it uses only functions
/// both versions have.
fn built_against(dir: &std::path::Path, version: &str) -> std::path::PathBuf {
    let mut bytes =
        std::fs::read(module_dir().join("generic_dev.wasm")).expect("generic-dev built");
    let mut rewritten = 0;
    for interface in ["plugin", "types", "log", "devnodes"] {
        let from = format!("devicelet:plugin/{interface}@{LATEST}");
        let to = format!("devicelet:plugin/{interface}@{version}");
        let mut at = 0;
        while let Some(i) = bytes[at..]
            .windows(from.len())
            .position(|w| w == from.as_bytes())
        {
            bytes[at + i..at + i + to.len()].copy_from_slice(to.as_bytes());
            at += i + to.len();
            rewritten += 1;
        }
    }
    assert!(rewritten >= 2, "generic-dev names its export and imports");
    let path = dir.join(format!("built-against-{version}.wasm"));
    std::fs::write(&path, bytes).expect("writing the rewritten module");
    path
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_module_built_against_a_newer_minor_is_refused_naming_both_versions() {
    let node = Node::new().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let newer = built_against(dir.path(), "0.1.7");
    let modules = generic_dev(r#"groups = [{ name = "fuse", paths = ["/dev/fuse"] }]"#)
        .replace("@MODULES@/generic_dev.wasm", &newer.display().to_string());
    let agent = node.start_agent(&modules).await;
    let errors = agent.load_errors();
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(
        errors[0].contains(&format!(
            "module `generic-dev` was built against devicelet:plugin@0.1.7; this devicelet speaks {}",
            speaks()
        )),
        "{errors:?}"
    );
    assert_eq!(speaks(), "0.1.0 to 0.1.2");
    agent.shutdown().await;
}

/// A module built with the 0.1.1 SDK (before `schedule` and `nvml.event-instance`) loads and
/// serves in today's agent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_module_built_against_0_1_1_still_loads_and_allocates() {
    let node = Node::new().await;
    node.add_char("/dev/fuse", 10, 229);
    let dir = tempfile::tempdir().expect("tempdir");
    let older = built_against(dir.path(), "0.1.1");
    let modules = generic_dev(r#"groups = [{ name = "fuse", paths = ["/dev/fuse"] }]"#)
        .replace("@MODULES@/generic_dev.wasm", &older.display().to_string());
    let agent = node.start_agent(&modules).await;
    assert!(agent.load_errors().is_empty(), "{:?}", agent.load_errors());
    node.kubelet
        .wait_until("devicelet.io/fuse", WAIT, |r| r.allocatable == 1)
        .await
        .expect("served");
    node.kubelet
        .allocate("devicelet.io/fuse", 1)
        .await
        .expect("a 0.1.1 module allocates");
    agent.shutdown().await;
}
