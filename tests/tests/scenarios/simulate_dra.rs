//! `devicelet simulate --dra` and `devicelet run` as two processes, as a vendor runs them: the
//! agent serves a DRA driver to the simulated kubelet and its API server stand-in, and
//! `--claim` has a claim allocated and prepared.

use std::process::Stdio;

use devicelet::fixture::{FixtureTree, NodeType};
use devicelet_tests::{devicelet_bin, module_dir, read_until as until};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn simulate_dra_shows_a_driver_registering_publishing_and_preparing_a_claim() {
    let dir = tempfile::tempdir().unwrap();
    let path = |p: &str| dir.path().join(p);
    let kubeconfig = path("dra-kubeconfig");
    let mut simulate = Command::new(devicelet_bin())
        .arg("simulate")
        .arg("--dir")
        .arg(path("kubelet/device-plugins"))
        .arg("--plugins-registry-dir")
        .arg(path("kubelet/plugins_registry"))
        .args([
            "--dra",
            "--node-name",
            "node-x",
            "--claim",
            "fuse.devicelet.io=1",
        ])
        .arg("--kubeconfig-out")
        .arg(&kubeconfig)
        .args(["--log", "warn"])
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("devicelet simulate");
    let mut lines = BufReader::new(simulate.stdout.take().unwrap()).lines();
    let mut seen = String::new();
    until(
        &mut lines,
        "serve DRA drivers here with: devicelet run",
        &mut seen,
    )
    .await;

    let tree = FixtureTree::new(&path("node")).unwrap();
    tree.add_node("/dev/fuse", NodeType::Char, 10, 229).unwrap();
    let registry = path("registry.toml");
    std::fs::write(
        &registry,
        format!(
            "host-root = {:?}\n[[module]]\nname = \"generic-dev\"\npath = {:?}\n\
             front-end = \"dra\"\n[module.grants]\ndev = [\"/dev/fuse\"]\n[module.config]\n\
             groups = [{{ name = \"fuse\", paths = [\"/dev/fuse\"] }}]\n",
            tree.root().display().to_string(),
            module_dir().join("generic_dev.wasm").display().to_string()
        ),
    )
    .unwrap();
    let _agent = Command::new(devicelet_bin())
        .arg("run")
        .arg("--config")
        .arg(&registry)
        .args(["--node-name", "node-x"])
        .arg("--kubeconfig")
        .arg(&kubeconfig)
        .arg("--kubelet-dir")
        .arg(path("kubelet/device-plugins"))
        .arg("--pod-resources-socket")
        .arg(path("kubelet/pod-resources/kubelet.sock"))
        .arg("--plugins-registry-dir")
        .arg(path("kubelet/plugins_registry"))
        .arg("--kubelet-plugins-dir")
        .arg(path("kubelet/plugins"))
        .arg("--state-dir")
        .arg(path("state"))
        .arg("--cdi-dir")
        .arg(path("cdi"))
        .args(["--log", "warn"])
        .stdout(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("devicelet run");
    until(
        &mut lines,
        "DRA driver fuse.devicelet.io registered at endpoint",
        &mut seen,
    )
    .await;
    until(
        &mut lines,
        "fuse.devicelet.io: 1 device(s) published",
        &mut seen,
    )
    .await;
    until(
        &mut lines,
        "request fuse: device fuse in pool node-x",
        &mut seen,
    )
    .await;
    assert!(
        seen.contains("prepared by fuse.devicelet.io"),
        "the claim is prepared:\n{seen}"
    );
    assert!(
        seen.contains("CDI k8s.fuse.devicelet.io/fuse="),
        "with its CDI device:\n{seen}"
    );
}
