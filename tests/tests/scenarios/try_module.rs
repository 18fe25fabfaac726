//! `devicelet try`, as a vendor runs it: the AMD module over one of its fixtures.

use std::process::Stdio;
use std::time::Duration;

use devicelet_tests::{
    devicelet_bin, module_dir, read_until as until, scenario_cache, workspace_root,
};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

const CONFIG: &str = r#"resource-domain = "amd.com"

[module.grants]
sysfs = ["/sys/bus/pci/devices/*"]
dev = ["/dev/kfd", "/dev/dri/*"]
"#;

fn command(fixture: &std::path::Path, config: &std::path::Path) -> Command {
    let mut cmd = Command::new(devicelet_bin());
    cmd.arg("try")
        .arg("--cache-dir")
        .arg(scenario_cache())
        .arg("--module")
        .arg(module_dir().join("amd_gpu.wasm"))
        .arg("--fixture")
        .arg(fixture)
        .arg("--config")
        .arg(config)
        .arg("--log")
        .arg("warn")
        .stdout(Stdio::piped())
        .kill_on_drop(true);
    cmd
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn try_shows_registration_snapshots_and_an_allocation_then_stops() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("amd.toml");
    std::fs::write(&config, CONFIG).unwrap();
    let fixture = workspace_root().join("guests/amd-gpu/fixtures/2-gpus");
    let out = command(&fixture, &config)
        .arg("--allocate")
        .arg("2")
        .arg("--once")
        .output()
        .await
        .expect("running devicelet try");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("registered amd.com/gpu"), "{text}");
    assert!(text.contains("+ 0000:03:00.0 Healthy"), "{text}");
    assert!(text.contains("+ 0000:23:00.0 Healthy"), "{text}");
    assert!(
        text.contains("of amd.com/gpu to pod") && text.contains("0000:03:00.0, 0000:23:00.0"),
        "{text}"
    );
    assert!(text.contains("/dev/kfd"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn try_dra_publishes_the_devices_and_prepares_and_unprepares_a_claim() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("amd.toml");
    std::fs::write(&config, CONFIG).unwrap();
    let fixture = workspace_root().join("guests/amd-gpu/fixtures/2-gpus");
    let run = |allocate: &'static str| {
        let mut cmd = command(&fixture, &config);
        cmd.args(["--dra", "--allocate", allocate, "--once"]);
        async move { cmd.output().await.expect("running devicelet try --dra") }
    };
    let out = run("2").await;
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("registered DRA driver gpu.amd.com with the kubelet"),
        "{text}"
    );
    assert!(
        text.contains("gpu.amd.com: pool generation 1, 2 device(s) published"),
        "{text}"
    );
    assert!(
        text.contains("resource.kubernetes.io/pciBusID=\"0000:23:00.0\""),
        "{text}"
    );
    assert!(text.contains("prepared by gpu.amd.com"), "{text}");
    assert!(text.contains("CDI k8s.gpu.amd.com/gpu="), "{text}");
    assert!(text.contains("device /dev/kfd"), "{text}");
    // The claim's status, as the driver wrote it: Ready, with the module's device IDs.
    assert!(
        text.contains(": Ready=True data {\"cdiDeviceIDs\""),
        "{text}"
    );
    assert!(text.contains("\"deviceIDs\":["), "{text}");
    assert!(text.contains("unprepared: its CDI spec removed"), "{text}");

    let out = run("3").await;
    assert!(!out.status.success());
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(
        e.contains("gpu.amd.com: 2 device(s) published, fewer than --allocate 3"),
        "{e}"
    );
}

/// Issue 36's "Done when", through `try --dra`: the NVIDIA module with dynamic MIG on a fake
/// H100 publishes its placements on counters, the claim `try` allocates is prepared by making a
/// MIG instance whose UUID the claim's status shows, and unpreparing it destroys the instance.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn try_dra_on_a_fake_h100_makes_a_mig_instance_for_the_claim_and_destroys_it() {
    let dir = tempfile::tempdir().unwrap();
    let fixture = dir.path().join("node");
    let mut nodes = String::from("c 195:255 /dev/nvidiactl\nc 195:0 /dev/nvidia0\n");
    let (table, minors) = devicelet_tests::mig_minors();
    for minor in minors {
        nodes += &format!("c 511:{minor} /dev/nvidia-caps/nvidia-cap{minor}\n");
    }
    std::fs::create_dir_all(fixture.join("proc/driver/nvidia-caps")).unwrap();
    std::fs::create_dir_all(fixture.join("sys")).unwrap();
    std::fs::write(fixture.join("proc/driver/nvidia-caps/mig-minors"), table).unwrap();
    std::fs::write(fixture.join("dev.list"), nodes).unwrap();
    let gpus = devicelet_tests::FakeGpus::new(dir.path(), &devicelet_tests::h100_with_mig());
    let config = dir.path().join("nvidia.toml");
    std::fs::write(
        &config,
        r#"resource-domain = "nvidia.com"
[module.grants]
dev = ["/dev/nvidia*", "/dev/nvidia-caps/*"]
libraries = ["nvml", "nvml-mig"]
[module.config]
mig-strategy = "dynamic"
"#,
    )
    .unwrap();
    let out = Command::new(devicelet_bin())
        .arg("try")
        .arg("--cache-dir")
        .arg(scenario_cache())
        .arg("--module")
        .arg(module_dir().join("nvidia_gpu.wasm"))
        .arg("--fixture")
        .arg(&fixture)
        .arg("--config")
        .arg(&config)
        .arg("--nvml-library")
        .arg(&gpus.library)
        .args(["--log", "warn", "--dra", "--allocate", "1", "--once"])
        .output()
        .await
        .expect("running devicelet try --dra");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let placement = text
        .lines()
        .find(|l| l.starts_with("  mig-0000-07-00-0-3g-40gb-4 "))
        .unwrap_or_else(|| panic!("the second 3g.40gb placement in {text}"));
    assert!(
        placement.ends_with(
            "CONSUMES gpu-0{compute-slices=3 memory-slice-4=1 memory-slice-5=1 \
             memory-slice-6=1 memory-slice-7=1}"
        ),
        "{placement}"
    );
    assert!(text.contains("COUNTERS gpu-0: compute-slices=7"), "{text}");
    assert!(text.contains("\"uuid\":\"MIG-"), "{text}");
    assert!(text.contains("env NVIDIA_VISIBLE_DEVICES=MIG-"), "{text}");
    assert!(text.contains("unprepared"), "{text}");
    assert!(gpus.instances(0).is_empty(), "{:?}", gpus.instances(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn try_says_what_is_wrong_and_where() {
    let dir = tempfile::tempdir().unwrap();
    let fixture = workspace_root().join("guests/amd-gpu/fixtures/2-gpus");
    let run = |config: &str, allocate: &str| {
        let path = dir.path().join("amd.toml");
        std::fs::write(&path, config).unwrap();
        let mut cmd = command(&fixture, &path);
        cmd.args(["--allocate", allocate, "--once"]);
        async move {
            let out = cmd.output().await.expect("running devicelet try");
            assert!(!out.status.success());
            String::from_utf8_lossy(&out.stderr).into_owned()
        }
    };
    let e = run(CONFIG, "3").await;
    assert!(
        e.contains("amd.com/gpu: 2 allocatable, fewer than --allocate 3"),
        "{e}"
    );
    // The allocation itself is refused (two replicas, where the sharing rule allows one per
    // container): with --once that is the verdict, so `try` fails.
    let shared = format!(
        "{CONFIG}\n[module.sharing]\nreplicas = 2\nfail-requests-greater-than-one = true\n"
    );
    let e = run(&shared, "2").await;
    assert!(e.contains("allocation of 2 amd.com/gpu failed"), "{e}");
    let e = run(&format!("name = \"mine\"\n{CONFIG}"), "1").await;
    assert!(
        e.contains("`name` is set by `try` itself") && e.contains("amd-gpu"),
        "{e}"
    );
    // The module refuses its config: the error names the line of the operator's file.
    let e = run(
        &format!("{CONFIG}\n[module.config]\nresourse = \"x\"\n"),
        "1",
    )
    .await;
    let line = CONFIG.lines().count() + 2;
    assert!(e.contains(&format!("amd.toml:{line})")), "{e}");
    assert!(e.contains("unknown field `resourse`"), "{e}");
    // Only there: neither the error nor the agent's log names try's scratch registry.
    assert!(!e.contains("registry.toml"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn try_follows_edits_of_the_fixture_until_interrupted() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("amd.toml");
    std::fs::write(&config, CONFIG).unwrap();
    // A copy to edit.
    let fixture = dir.path().join("node");
    let status = std::process::Command::new("cp")
        .arg("-a")
        .arg(workspace_root().join("guests/amd-gpu/fixtures/2-gpus"))
        .arg(&fixture)
        .status()
        .unwrap();
    assert!(status.success());
    let mut child = command(&fixture, &config)
        .spawn()
        .expect("spawning devicelet try");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut seen = String::new();
    until(&mut lines, "watching", &mut seen).await;

    // `devicelet status` reaches the agent `try` runs.
    let state_dir = seen
        .lines()
        .find_map(|l| l.split("--state-dir ").nth(1))
        .and_then(|rest| rest.split('`').next())
        .expect("the status hint")
        .to_owned();
    let status = Command::new(devicelet_bin())
        .args(["status", "--state-dir", &state_dir])
        .output()
        .await
        .expect("devicelet status");
    let text = String::from_utf8_lossy(&status.stdout);
    assert!(text.contains("amd.com/gpu (module amd-gpu"), "{text}");

    // The second GPU's render node is unplugged.
    let list = fixture.join("dev.list");
    let text = std::fs::read_to_string(&list).unwrap();
    std::fs::write(&list, text.replace("c 226:129 /dev/dri/renderD129\n", "")).unwrap();
    until(&mut lines, "~ 0000:23:00.0 Healthy -> Unhealthy", &mut seen).await;

    let pid = child.id().expect("running") as i32;
    // SAFETY: signalling a child we spawned and still own.
    unsafe { libc::kill(pid, libc::SIGINT) };
    let status = tokio::time::timeout(Duration::from_secs(20), child.wait())
        .await
        .expect("stops on Ctrl-C")
        .unwrap();
    assert!(status.success(), "{status:?}\n{seen}");
}
