//! The WIT is frozen per published version: a module built against any published version (0.1.x,
//! 0.2.0, 0.3.0 (`guests/testing/partitions`, whose scenarios are in `dra_advanced.rs`) or 0.3.1) keeps loading into
//! today's agent, and one built against a version the agent does not speak is refused by
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

/// The module built straight from `wit/v0.2.0/` (as SDK 0.2 built them), granted `/dev/fuse`.
const WIT_0_2_0: &str = r#"[[module]]
name = "built-02"
path = "@MODULES@/wit_0_2_0.wasm"
health-interval = "100ms"

[module.grants]
dev = ["/dev/fuse"]
"#;

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

/// `module` (a file in the modules directory, built against `from`) with every
/// `devicelet:plugin…` version in its component rewritten to `to` (the same length, so the
/// binary stays well-formed): what a module built against another version of the same line
/// looks like, when it uses only functions both versions have.
fn rewritten(dir: &std::path::Path, module: &str, from: &str, to: &str) -> std::path::PathBuf {
    let mut bytes = std::fs::read(module_dir().join(module)).expect("the module built");
    let mut count = 0;
    for interface in ["plugin", "types", "log", "devnodes"] {
        let from = format!("devicelet:plugin/{interface}@{from}");
        let to = format!("devicelet:plugin/{interface}@{to}");
        let mut at = 0;
        while let Some(i) = bytes[at..]
            .windows(from.len())
            .position(|w| w == from.as_bytes())
        {
            bytes[at + i..at + i + to.len()].copy_from_slice(to.as_bytes());
            at += i + to.len();
            count += 1;
        }
    }
    assert!(count >= 2, "{module} names its export and imports");
    let path = dir.join(format!("{module}-as-{to}.wasm"));
    std::fs::write(&path, bytes).expect("writing the rewritten module");
    path
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_module_built_against_a_newer_minor_is_refused_naming_both_versions() {
    let node = Node::new().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let newer = rewritten(dir.path(), "generic_dev.wasm", LATEST, "0.3.7");
    let newer_01 = rewritten(dir.path(), "wit_0_1_0.wasm", "0.1.0", "0.1.7");
    let modules = format!(
        "{}
{}",
        generic_dev(r#"groups = [{ name = "fuse", paths = ["/dev/fuse"] }]"#)
            .replace("@MODULES@/generic_dev.wasm", &newer.display().to_string()),
        legacy(&newer_01.display().to_string())
    );
    let agent = node.start_agent(&modules).await;
    let errors = agent.load_errors();
    assert_eq!(errors.len(), 2, "{errors:?}");
    for (module, version) in [("generic-dev", "0.3.7"), ("legacy", "0.1.7")] {
        let expected = format!(
            "module `{module}` was built against devicelet:plugin@{version}; this devicelet speaks {}",
            speaks()
        );
        assert!(errors.iter().any(|e| e.contains(&expected)), "{errors:?}");
    }
    assert_eq!(speaks(), "0.1.0 to 0.1.2, 0.2.0, 0.3.0 to 0.3.1");
    agent.shutdown().await;
}

/// A module built against 0.1.0, the same module as built against 0.1.1, one built against 0.2.0
/// (as SDK 0.2 built them) and one built with today's SDK (0.3) serve side by side in one
/// agent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn modules_built_against_0_1_0_0_1_1_0_2_and_0_3_serve_side_by_side() {
    let node = Node::new().await;
    node.add_char("/dev/fuse", 10, 229);
    let dir = tempfile::tempdir().expect("tempdir");
    let as_011 = rewritten(dir.path(), "wit_0_1_0.wasm", "0.1.0", "0.1.1");
    let modules = format!(
        "{}
{}
{}
{}",
        legacy("@MODULES@/wit_0_1_0.wasm"),
        legacy(&as_011.display().to_string()).replace(
            "name = \"legacy\"",
            "name = \"legacy-011\"\nresource-domain = \"old.example\""
        ),
        generic_dev(r#"groups = [{ name = "fuse", paths = ["/dev/fuse"] }]"#),
        WIT_0_2_0
    );
    let agent = node.start_agent(&modules).await;
    assert!(agent.load_errors().is_empty(), "{:?}", agent.load_errors());
    for resource in [
        "devicelet.io/legacy",
        "old.example/legacy",
        "devicelet.io/fuse",
        "devicelet.io/fuse02",
    ] {
        node.kubelet
            .wait_until(resource, WAIT, |r| r.allocatable == 1)
            .await
            .expect("served");
        let a = node
            .kubelet
            .allocate(resource, 1)
            .await
            .unwrap_or_else(|e| panic!("{resource}: {e}"));
        assert_eq!(a.response.devices.len(), 1, "{resource}");
    }
    let mut versions: Vec<String> = agent
        .status()
        .modules
        .iter()
        .map(|m| format!("{}={}", m.name, m.version))
        .collect();
    versions.sort();
    assert_eq!(
        versions,
        [
            "built-02=0.2.0-built",
            "generic-dev=0.1.0",
            "legacy-011=",
            "legacy="
        ]
    );
    agent.shutdown().await;
}
