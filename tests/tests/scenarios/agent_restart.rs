//! The agent as operators run it (the real binary): killed with SIGKILL and started again, it
//! removes its predecessor's sockets, registers again and restores the same ledger; SIGTERM
//! stops it cleanly.

use std::process::{Child, Command, Stdio};

use devicelet::agent::status;
use devicelet_simulator::PodRef;
use devicelet_tests::{Node, WAIT, devicelet_bin, generic_dev};

const FUSE: &str = r#"groups = [{ name = "fuse", paths = ["/dev/fuse"] }]

[module.sharing.resources.fuse]
replicas = 2"#;

fn spawn_agent(node: &Node, registry: &std::path::Path) -> Child {
    spawn_agent_with(node, registry, &[])
}

/// As [`spawn_agent`], with `extra` arguments. The scenarios' shared compile cache unless they
/// name a `--cache-dir` of their own.
fn spawn_agent_with(node: &Node, registry: &std::path::Path, extra: &[&str]) -> Child {
    spawn_agent_logging(node, registry, extra, Stdio::null())
}

/// As [`spawn_agent_with`], its log (stderr) going to `log`.
fn spawn_agent_logging(
    node: &Node,
    registry: &std::path::Path,
    extra: &[&str],
    log: Stdio,
) -> Child {
    let mut cmd = Command::new(devicelet_bin());
    cmd.arg("run")
        .arg("--config")
        .arg(registry)
        .arg("--kubelet-dir")
        .arg(node.plugin_dir())
        .arg("--state-dir")
        .arg(node.state_dir())
        .arg("--pod-resources-socket")
        .arg(node.kubelet.pod_resources_socket())
        .args(["--reconcile-interval", "100ms"]);
    if !extra.contains(&"--cache-dir") {
        cmd.arg("--cache-dir")
            .arg(devicelet_tests::scenario_cache());
    }
    cmd.args(extra)
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("spawning devicelet run")
}

async fn holder_of(node: &Node, device: &str) -> Option<String> {
    let status = status::read(&node.state_dir()).await.ok()?;
    status
        .resources
        .iter()
        .flat_map(|r| &r.devices)
        .find(|d| d.id == device)
        .and_then(|d| d.holder.as_ref())
        .map(|h| h.to_string())
}

async fn wait_for_holder(node: &Node, device: &str) -> String {
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        if let Some(h) = holder_of(node, device).await {
            return h;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no holder for {device}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_killed_with_sigkill_comes_back_with_the_same_ledger() {
    let node = Node::new().await;
    node.add_char("/dev/fuse", 10, 229);
    let registry = node.registry(&generic_dev(FUSE));

    let mut first = spawn_agent(&node, &registry);
    let before = node
        .kubelet
        .wait_until("devicelet.io/fuse", WAIT, |r| {
            r.registrations == 1 && r.allocatable == 2
        })
        .await
        .expect("the first agent registers");
    let pod = PodRef::new("default", "db", "postgres");
    let allocation = node
        .kubelet
        .allocate_for(&pod, "devicelet.io/fuse", 1)
        .await
        .expect("allocate");
    let device = allocation.device_ids[0].clone();
    let holder = wait_for_holder(&node, &device).await;
    assert_eq!(holder, "default/db/postgres");
    // The entry as the first agent wrote it: an entry adopted afresh from PodResources would
    // have a new `allocated_at`, so this tells a surviving ledger from a rebuilt one.
    let written = devicelet_tests::eventually_some("the holder in ledger.json", || {
        ledger_entry(&node).filter(|e| e["holder"]["container"] == "postgres")
    })
    .await;

    first.kill().expect("SIGKILL");
    first.wait().expect("reaped");
    let stale = node.plugin_dir().join(&before.endpoint);
    assert!(stale.exists(), "a killed agent leaves its socket behind");

    let mut second = spawn_agent(&node, &registry);
    let after = node
        .kubelet
        .wait_until("devicelet.io/fuse", WAIT, |r| {
            r.registrations == 2 && r.streaming && r.endpoint != before.endpoint
        })
        .await
        .expect("the second agent registers again");
    assert!(!stale.exists(), "the predecessor's socket was removed");
    assert_eq!(
        wait_for_holder(&node, &device).await,
        holder,
        "the second agent knows the holder"
    );

    // SIGTERM: streams end, the socket goes, the process exits cleanly.
    // SAFETY: plain kill(2) on our own child's pid.
    unsafe { libc::kill(second.id() as i32, libc::SIGTERM) };
    let exit = second.wait().expect("reaped");
    assert!(exit.success(), "{exit:?}");
    assert!(!node.plugin_dir().join(&after.endpoint).exists());
    assert_eq!(
        ledger_entry(&node),
        Some(written),
        "the ledger survived SIGKILL: the same entry, not one adopted again"
    );
    node.kubelet
        .wait_until("devicelet.io/fuse", WAIT, |r| !r.streaming)
        .await
        .expect("the stream ended");
}

/// What a log collector reads from the binary's stderr: plain text with no colour codes when
/// stderr is not a terminal, or one JSON object per line with `--log-format json`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logs_carry_no_colour_off_a_terminal_and_are_json_lines_on_request() {
    let node = Node::new().await;
    node.add_char("/dev/fuse", 10, 229);
    let registry = node.registry(&generic_dev(FUSE));
    let run = |format: &str| {
        let out = devicelet_tests::validate_command()
            .args(["--log", "debug", "--log-format", format, "--config"])
            .arg(&registry)
            .stdin(Stdio::null())
            .output()
            .expect("running devicelet validate");
        assert!(out.status.success(), "{out:?}");
        String::from_utf8(out.stderr).expect("utf-8 logs")
    };
    let text = run("text");
    assert!(!text.trim().is_empty(), "validate logs at debug level");
    assert!(!text.contains('\u{1b}'), "no escape codes: {text}");
    let json = run("json");
    let lines: Vec<&str> = json.lines().filter(|l| !l.trim().is_empty()).collect();
    assert!(!lines.is_empty());
    for line in lines {
        let value: serde_json::Value = serde_json::from_str(line).expect("a JSON object per line");
        assert!(value.get("level").is_some(), "{line}");
    }
}

/// The only entry of the ledger file, if it has exactly one.
fn ledger_entry(node: &Node) -> Option<serde_json::Value> {
    let bytes = std::fs::read(node.state_dir().join("ledger.json")).ok()?;
    let json: serde_json::Value = serde_json::from_slice(&bytes).ok()?;
    match json["entries"].as_array()?.as_slice() {
        [entry] => Some(entry.clone()),
        _ => None,
    }
}

/// The threads of process `pid`, by name.
fn threads(pid: u32) -> Vec<(String, std::path::PathBuf)> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    tasks
        .flatten()
        .filter_map(|task| {
            let name = std::fs::read_to_string(task.path().join("comm")).ok()?;
            Some((name.trim().to_owned(), task.path()))
        })
        .collect()
}

fn context_switches(task: &std::path::Path) -> u64 {
    let status = std::fs::read_to_string(task.join("status")).unwrap_or_default();
    status
        .lines()
        .filter(|l| l.contains("ctxt_switches"))
        .filter_map(|l| l.split_whitespace().last()?.parse::<u64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_agent_holds_two_workers_no_compiler_threads_and_no_ticking_timer() {
    let node = Node::new().await;
    node.add_char("/dev/fuse", 10, 229);
    let registry = node.registry(
        &generic_dev(FUSE).replace("health-interval = \"100ms\"", "health-interval = \"1h\""),
    );
    let mut agent = spawn_agent(&node, &registry);
    node.kubelet
        .wait_until("devicelet.io/fuse", WAIT, |r| r.allocatable == 2)
        .await
        .expect("served");
    // Idle: every answer prepared (no module call is left to make), and the cold start's
    // compiler threads gone.
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let status = status::read(&node.state_dir()).await.ok();
        let prepared = status.is_some_and(|s| {
            s.resources
                .iter()
                .all(|r| !r.devices.is_empty() && r.devices.iter().all(|d| d.prepared))
        });
        if prepared {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "answers never prepared"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    devicelet_tests::eventually("the compiler's threads to end", || {
        !threads(agent.id())
            .iter()
            .any(|(name, _)| name.starts_with("compile-"))
    })
    .await;
    // tokio names its blocking threads as its workers; those end after 2 s idle, the two
    // workers never.
    devicelet_tests::eventually("two async workers and no blocking thread", || {
        let tokio = threads(agent.id())
            .iter()
            .filter(|(name, _)| name.starts_with("tokio-"))
            .count();
        tokio == 2
    })
    .await;
    let named = threads(agent.id());
    let (_, epoch) = named
        .iter()
        .find(|(name, _)| name == "devicelet-epoch")
        .expect("the epoch ticker");
    // With no guest code running the ticker is parked: over a window of 30 ticks it wakes at
    // most for a spurious unpark or two (a ticking one switches at every tick).
    let before = context_switches(epoch);
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let woke = context_switches(epoch) - before;
    assert!(woke <= 2, "the ticker woke {woke} times while idle");
    // And it ticks again for the next guest call: a two-device Allocate asks the module.
    node.kubelet
        .allocate("devicelet.io/fuse", 2)
        .await
        .expect("allocated");
    agent.kill().expect("kill");
    let _ = agent.wait();
}

/// A `kB` figure of `/proc/<pid>/status`, in kB.
fn status_kb(pid: u32, key: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .expect("the agent's status")
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("no {key}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn once_registered_the_agent_releases_the_pages_of_its_binary_that_only_start_up_touched() {
    let node = Node::new().await;
    node.add_char("/dev/fuse", 10, 229);
    let registry = node.registry(&generic_dev(FUSE));
    let log = node.dir.path().join("agent.log");
    let mut agent = spawn_agent_logging(
        &node,
        &registry,
        &["--log", "info,devicelet::cli::run=debug"],
        Stdio::from(std::fs::File::create(&log).expect("log file")),
    );
    node.kubelet
        .wait_until("devicelet.io/fuse", WAIT, |r| r.allocatable == 2)
        .await
        .expect("served");
    let text = devicelet_tests::eventually_some("the release", || {
        let text = std::fs::read_to_string(&log).ok()?;
        text.contains("released the binary's start-up pages")
            .then_some(text)
    })
    .await;
    // After the registration, never before it: start-up is over only then.
    let registered = text
        .find("registered with the kubelet")
        .expect("registered");
    let released = text
        .find("released the binary's start-up pages")
        .expect("released");
    assert!(
        registered < released,
        "released before registering:\n{text}"
    );
    let bytes: u64 = text[released..]
        .lines()
        .next()
        .and_then(|l| l.split("bytes=").nth(1))
        .and_then(|b| b.split_whitespace().next())
        .and_then(|b| b.parse().ok())
        .expect("bytes=N");
    assert!(bytes > 1 << 20, "released only {bytes} bytes");
    // Well below the peak now (the health checks every 100 ms fault back what they use), and
    // the agent still answers.
    let (rss, peak) = (
        status_kb(agent.id(), "VmRSS:"),
        status_kb(agent.id(), "VmHWM:"),
    );
    assert!(rss + 1024 < peak, "VmRSS {rss} kB, start-up peak {peak} kB");
    node.kubelet
        .allocate("devicelet.io/fuse", 2)
        .await
        .expect("allocated after the release");
    agent.kill().expect("kill");
    let _ = agent.wait();
}

/// `devicelet run` serving DRA drivers on `dra`'s node, the state kept in `state`.
fn spawn_dra_agent(
    dra: &devicelet_tests::dra::DraNode,
    registry: &std::path::Path,
    state: &std::path::Path,
) -> Child {
    spawn_dra_agent_resyncing(dra, registry, state, "200ms")
}

/// As [`spawn_dra_agent`], its pool checked against the API server every `resync`.
fn spawn_dra_agent_resyncing(
    dra: &devicelet_tests::dra::DraNode,
    registry: &std::path::Path,
    state: &std::path::Path,
    resync: &str,
) -> Child {
    spawn_dra_agent_logging(
        dra,
        registry,
        state,
        &["--dra-resync", resync],
        Stdio::null(),
    )
}

/// Issue 36's "Done when": an agent killed after NVML made a claim's MIG instance and before
/// it recorded the claim prepared leaves no orphan: the restarted agent finds the write-ahead
/// record and the module's `unprepare` destroys the instance, so the placement can be made
/// again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_killed_between_making_a_mig_instance_and_recording_it_leaves_no_orphan() {
    use devicelet_tests::dra::{DraNode, registered};
    const DRIVER: &str = "gpu.nvidia.com";
    let dra = DraNode::new().await;
    dra.node.add_mig_gpu();
    let gpus =
        devicelet_tests::FakeGpus::new(dra.node.dir.path(), &devicelet_tests::h100_with_mig());
    let registry = dra.node.registry(devicelet_tests::DYNAMIC_MIG);
    let state = dra.node.state_dir();
    let library = gpus.library.to_string_lossy().into_owned();
    let log = |n: usize| dra.node.dir.path().join(format!("agent-{n}.log"));
    let spawn = |n: usize| {
        spawn_dra_agent_logging(
            &dra,
            &registry,
            &state,
            &["--nvml-library", &library],
            Stdio::from(std::fs::File::create(log(n)).expect("log file")),
        )
    };
    let made = || {
        gpus.instances(0)
            .iter()
            .filter(|m| m["bare"] != true)
            .count()
    };
    // NVML makes the instance, then does not return: the agent is killed in between.
    gpus.inject("hang-after-create");
    let mut first = spawn(1);
    registered(&dra.kubelet, 1).await;
    devicelet_tests::dra::counters_and_devices(&dra.api).await;
    let uid = dra.claim(
        DRIVER,
        "half",
        &["mig-0000-07-00-0-3g-40gb-0"],
        serde_json::json!([]),
    );
    let asked = preparing(&dra.kubelet, DRIVER, "half", &uid);
    devicelet_tests::eventually("NVML made the instance", || made() == 1).await;
    first.kill().expect("SIGKILL");
    first.wait().expect("reaped");
    asked.abort();
    assert_eq!(made(), 1, "the instance outlives the agent, as on a GPU");

    gpus.inject("create-returns");
    let mut second = spawn(2);
    registered(&dra.kubelet, 2).await;
    devicelet_tests::eventually("the restarted agent destroyed the orphan", || {
        gpus.instances(0).is_empty()
    })
    .await;
    // The placement is free: the claim, asked for again, makes its instance afresh.
    let uid2 = dra.claim(
        DRIVER,
        "again",
        &["mig-0000-07-00-0-3g-40gb-0"],
        serde_json::json!([]),
    );
    let prepared = dra.prepare(DRIVER, "again", &uid2).await;
    assert_eq!(prepared.error, "", "{prepared:?}");
    assert_eq!(made(), 1);
    second.kill().expect("SIGKILL");
    second.wait().expect("reaped");
}

/// The kubelet's NodePrepareResources for claim `team-a/name`, left running: the agent may be
/// killed before it answers.
fn preparing(
    kubelet: &devicelet_simulator::Simulator,
    driver: &'static str,
    name: &'static str,
    uid: &str,
) -> tokio::task::JoinHandle<
    Result<
        devicelet::kubelet::api::dra::v1::NodePrepareResourcesResponse,
        devicelet_simulator::SimError,
    >,
> {
    let (kubelet, uid) = (kubelet.clone(), uid.to_owned());
    tokio::spawn(async move {
        kubelet
            .node_prepare_resources(driver, vec![devicelet_tests::dra::wire_claim(name, &uid)])
            .await
    })
}

/// As [`spawn_dra_agent`], with `extra` arguments, its log (stderr) going to `log`.
fn spawn_dra_agent_logging(
    dra: &devicelet_tests::dra::DraNode,
    registry: &std::path::Path,
    state: &std::path::Path,
    extra: &[&str],
    log: Stdio,
) -> Child {
    let kubeconfig = dra.node.dir.path().join("kubeconfig");
    std::fs::write(&kubeconfig, dra.api.kubeconfig()).expect("kubeconfig");
    Command::new(devicelet_bin())
        .arg("run")
        .arg("--config")
        .arg(registry)
        .arg("--kubelet-dir")
        .arg(dra.kubelet.plugin_dir())
        .arg("--state-dir")
        .arg(state)
        .arg("--cache-dir")
        .arg(devicelet_tests::scenario_cache())
        .arg("--cdi-dir")
        .arg(dra.node.dir.path().join("cdi"))
        .arg("--plugins-registry-dir")
        .arg(dra.registry_dir())
        .arg("--kubelet-plugins-dir")
        .arg(dra.plugins_dir())
        .args(["--node-name", devicelet_tests::dra::NODE])
        .arg("--kubeconfig")
        .arg(&kubeconfig)
        .args(extra)
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("spawning devicelet run")
}

/// With DRA drivers alone nothing needs PodResources (the kubelet ends each claim itself), so
/// a node where it cannot be reached gets no warning at every start; the attempts still show at
/// debug level and in the metrics.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_only_dra_drivers_an_unreachable_pod_resources_socket_is_no_warning() {
    // DraNode's tree has /dev/fuse.
    let dra = devicelet_tests::dra::DraNode::new().await;
    let fuse = r#"groups = [{ name = "fuse", paths = ["/dev/fuse"] }]"#;
    let registry = dra.node.registry(&generic_dev(fuse).replacen(
        "[module.grants]",
        "front-end = \"dra\"\n\n[module.grants]",
        1,
    ));
    let log = dra.node.dir.path().join("agent.log");
    let missing = dra.node.dir.path().join("no-pod-resources.sock");
    let mut agent = spawn_dra_agent_logging(
        &dra,
        &registry,
        &dra.node.state_dir(),
        &[
            "--pod-resources-socket",
            missing.to_str().expect("a UTF-8 path"),
            "--reconcile-interval",
            "100ms",
            "--log",
            "info,devicelet::agent::ledger_sync=debug",
        ],
        Stdio::from(std::fs::File::create(&log).expect("log file")),
    );
    devicelet_tests::dra::registered(&dra.kubelet, 1).await;
    // Two failed attempts seen: the first could have come before the driver was served.
    let text = devicelet_tests::eventually_some("two unreachable reconciles", || {
        let text = std::fs::read_to_string(&log).ok()?;
        (text.matches("PodResources not reachable").count() >= 2).then_some(text)
    })
    .await;
    assert!(
        !text.contains("cannot reconcile the ledger"),
        "warned:\n{text}"
    );
    agent.kill().expect("kill");
    let _ = agent.wait();
}

/// Killed after a claim's devices were checked and reserved in the ledger but before the claim
/// was recorded prepared (its module's allocate still running), the agent comes back holding
/// nothing for it: the device goes to the next claim that asks, and the first one, asked again,
/// is refused, naming the holder. Never two holders.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_killed_between_check_and_record_holds_nothing_twice_after_restart() {
    use devicelet_tests::dra::{DraNode, registered, wire_claim};
    const DRIVER: &str = "bad.devicelet.io";
    let dra = DraNode::new().await;
    let module = |allocate: &str| {
        devicelet_tests::misbehaving(
            "m",
            &format!("resource = \"bad\"\ndevices = 1\nallocate = \"{allocate}\""),
            "10s",
        )
        // The DRA front end prepares nothing ahead: the key is refused there.
        .replace("allocate-ahead = false\n", "")
        .replacen(
            "[module.grants]",
            "front-end = \"dra\"\n\n[module.grants]",
            1,
        )
    };
    let registry = dra.node.registry(&module("loop"));
    let state = dra.node.state_dir();
    let mut first = spawn_dra_agent(&dra, &registry, &state);
    registered(&dra.kubelet, 1).await;
    let device = devicelet_tests::dra::published(&dra.api).await["spec"]["devices"][0]["name"]
        .as_str()
        .expect("a device")
        .to_string();
    let a = dra.claim(DRIVER, "a", &[&device], serde_json::json!([]));
    let b = dra.claim(DRIVER, "b", &[&device], serde_json::json!([]));
    // Claim a is checked and reserved, then its module's allocate spins.
    let prepare_a = {
        let kubelet = dra.kubelet.clone();
        let a = a.clone();
        tokio::spawn(async move {
            kubelet
                .node_prepare_resources(DRIVER, vec![wire_claim("a", &a)])
                .await
        })
    };
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let calls = status::read(&state)
            .await
            .ok()
            .and_then(|s| s.modules.into_iter().find(|m| m.name == "m"))
            .map_or(0, |m| m.stats.allocate_calls);
        if calls >= 1 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "a's allocate never started"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    first.kill().expect("SIGKILL");
    first.wait().expect("reaped");
    let answer = prepare_a.await.expect("joined");
    assert!(
        answer.is_err()
            || answer
                .as_ref()
                .is_ok_and(|r| !r.claims[&a].error.is_empty()),
        "claim a was never prepared: {answer:?}"
    );

    // Started again (its module behaving now): a's reservation is gone with the process.
    dra.node.registry(&module("ok"));
    let mut second = spawn_dra_agent(&dra, &registry, &state);
    registered(&dra.kubelet, 2).await;
    let prepared_b = dra.prepare(DRIVER, "b", &b).await;
    assert_eq!(prepared_b.error, "", "{prepared_b:?}");
    let again_a = dra.prepare(DRIVER, "a", &a).await;
    assert!(
        again_a.error.contains(&format!(
            "is already prepared for ResourceClaim team-a/b (UID {b})"
        )),
        "{again_a:?}"
    );
    let status = status::read(&state).await.expect("status");
    assert_eq!(status.dra_drivers[0].prepared_claims, 1);
    second.kill().expect("SIGKILL");
    second.wait().expect("reaped");
}

/// Killed with SIGKILL and started again, the agent finds its slices current, then replaces its
/// predecessor's registration socket: a kubelet before 1.34 wipes the driver's slices at once on
/// that de-registration, 1.34 and later cancel the wipe when it registers again. Either way the
/// pool is back long before the next resync (10 s, the default): the agent's watch of its
/// slices sees the wipe, and where the server refuses it that watch, the publisher is woken
/// again in the seconds after the registration.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_wiped_when_a_restarted_agent_replaces_its_socket_is_back_before_the_resync() {
    use devicelet_simulator::DraWipe;
    use devicelet_tests::dra::{DraNode, published, registered, slice_devices};
    for (wipe, watches) in [
        (DraWipe::AtOnce, true),
        (DraWipe::Delayed, true),
        (DraWipe::AtOnce, false),
    ] {
        // The kubelet's reconciler acts on the replaced socket half a second later, as its
        // once-a-second tick does on average: after the restarted agent found its slices current.
        let dra = DraNode::with_wipe(wipe, std::time::Duration::from_millis(500)).await;
        dra.api.refuse_watches(!watches);
        let registry = dra.node.registry(
            &devicelet_tests::generic_dev(r#"groups = [{ name = "fuse", paths = ["/dev/fuse"] }]"#)
                .replacen(
                    "[module.grants]",
                    "front-end = \"dra\"\n\n[module.grants]",
                    1,
                ),
        );
        let state = dra.node.state_dir();
        let mut first = spawn_dra_agent_resyncing(&dra, &registry, &state, "10s");
        registered(&dra.kubelet, 1).await;
        published(&dra.api).await;
        first.kill().expect("SIGKILL");
        first.wait().expect("reaped");

        let mut second = spawn_dra_agent_resyncing(&dra, &registry, &state, "10s");
        registered(&dra.kubelet, 2).await;
        // From the registration on: the longest stretch with no device published, watched for
        // three seconds.
        let (mut gap, mut missing_since) = (std::time::Duration::ZERO, None);
        let watched = std::time::Instant::now();
        while watched.elapsed() < std::time::Duration::from_secs(3) {
            let now = std::time::Instant::now();
            match slice_devices(&dra.api).filter(|d| !d.is_empty()) {
                Some(_) => {
                    if let Some(since) = missing_since.take() {
                        gap = gap.max(now - since);
                    }
                }
                None => {
                    missing_since.get_or_insert(now);
                }
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        assert!(
            missing_since.is_none(),
            "{wipe:?} (watches {watches}): the pool is still missing {:?} after the registration",
            missing_since.map(|s: std::time::Instant| s.elapsed())
        );
        assert!(
            gap < std::time::Duration::from_secs(5),
            "{wipe:?} (watches {watches}): missing for {gap:?}, as long as waiting for the resync"
        );
        second.kill().expect("SIGKILL");
        second.wait().expect("reaped");
    }
}

/// A component holding one core function of `adds` additions: valid, and it keeps the compiler
/// busy for a second or two (it is no module of ours: it fails to load once compiled).
fn slow_component(adds: usize) -> Vec<u8> {
    fn leb(mut n: usize, out: &mut Vec<u8>) {
        loop {
            let byte = (n & 0x7f) as u8;
            n >>= 7;
            if n == 0 {
                out.push(byte);
                return;
            }
            out.push(byte | 0x80);
        }
    }
    fn section(id: u8, body: &[u8], out: &mut Vec<u8>) {
        out.push(id);
        leb(body.len(), out);
        out.extend_from_slice(body);
    }
    // (local.get 0) (i32.const 1) i32.add (local.set 0), `adds` times, with one i32 local.
    let mut body = vec![1, 1, 0x7f];
    for _ in 0..adds {
        body.extend_from_slice(&[0x20, 0, 0x41, 1, 0x6a, 0x21, 0]);
    }
    body.push(0x0b);
    let mut code = vec![1];
    leb(body.len(), &mut code);
    code.extend_from_slice(&body);
    let mut core = b"\0asm\x01\0\0\0".to_vec();
    section(1, &[1, 0x60, 0, 0], &mut core);
    section(3, &[1, 0], &mut core);
    section(10, &code, &mut core);
    let mut component = b"\0asm\x0d\0\x01\0".to_vec();
    section(1, &core, &mut component);
    component
}

/// The agent `parent`'s `compile-module` child, once one runs.
async fn compile_child_of(parent: u32) -> i32 {
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        for entry in std::fs::read_dir("/proc").expect("/proc").flatten() {
            let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
                continue;
            };
            let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
            // pid (comm) state ppid …: the comm may hold spaces; what follows its `)` does not.
            let ppid = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().nth(1))
                .and_then(|p| p.parse::<u32>().ok());
            let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
            if ppid == Some(parent) && String::from_utf8_lossy(&cmdline).contains("compile-module")
            {
                return pid;
            }
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no compile child of {parent}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
    }
}

/// A module whose compile never ends (its compiler stopped, as one built to take minutes
/// holds it) delays no other module's registry edit: the next edit upgrades the other module
/// while that compile is still stopped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_compile_delays_no_other_module_s_registry_edit() {
    let node = Node::new().await;
    node.add_char("/dev/fuse", 10, 229);
    node.add_char("/dev/net/tun", 10, 200);
    let slow = node.dir.path().join("slow.wasm");
    std::fs::write(&slow, slow_component(300_000)).expect("writing the slow component");
    let slow_entry = format!("[[module]]\nname = \"slow\"\npath = {:?}\n", slow.display());
    let fuse = r#"groups = [{ name = "fuse", paths = ["/dev/fuse"] }]"#;
    let registry = node.registry(&generic_dev(fuse));
    // A cache of its own: in the shared one, another run's finished compile would be found.
    let own_cache = node.state_dir().join("cache");
    let own_cache = own_cache.to_str().expect("a UTF-8 path");
    let mut agent = spawn_agent_with(&node, &registry, &["--cache-dir", own_cache]);
    node.kubelet
        .wait_until("devicelet.io/fuse", WAIT, |r| r.allocatable == 1)
        .await
        .expect("served");

    // Edit 1 adds the slow module; its compile child is caught and stopped.
    node.registry(&format!("{}\n{slow_entry}", generic_dev(fuse)));
    let child = compile_child_of(agent.id()).await;
    // SAFETY: kill(2) on a process of our own agent's.
    assert_eq!(unsafe { libc::kill(child, libc::SIGSTOP) }, 0);

    // Edit 2 gives the other module a second resource: served while that compile is stopped.
    let both = r#"groups = [{ name = "fuse", paths = ["/dev/fuse"] }, { name = "tun", paths = ["/dev/net/tun"] }]"#;
    node.registry(&format!("{}\n{slow_entry}", generic_dev(both)));
    node.kubelet
        .wait_until("devicelet.io/tun", WAIT, |r| r.allocatable == 1)
        .await
        .expect("the other module upgraded while the slow compile is stopped");
    let state = std::fs::read_to_string(format!("/proc/{child}/stat")).unwrap_or_default();
    let state = state
        .rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().next())
        .unwrap_or("gone");
    assert_eq!(state, "T", "the slow compile was still stopped");
    node.kubelet
        .allocate("devicelet.io/fuse", 1)
        .await
        .expect("allocated meanwhile");
    // SAFETY: as above.
    unsafe { libc::kill(child, libc::SIGKILL) };
    agent.kill().expect("SIGKILL");
    agent.wait().expect("reaped");
}

/// A start a later edit no longer wants is never installed, nor is what it reports kept: a
/// module's entry is changed to a file whose compile is stopped, then changed back to what
/// runs; once that compile finishes, the running version serves on with no load error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edit_reverted_while_its_compile_is_stalled_leaves_the_running_version_untouched() {
    let node = Node::new().await;
    node.add_char("/dev/fuse", 10, 229);
    let slow = node.dir.path().join("slow.wasm");
    std::fs::write(&slow, slow_component(300_000)).expect("writing the slow component");
    let fuse = generic_dev(r#"groups = [{ name = "fuse", paths = ["/dev/fuse"] }]"#);
    let registry = node.registry(&fuse);
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let metrics: std::net::SocketAddr = ([127, 0, 0, 1], port).into();
    // A cache of its own: this compile finishes, and would be found by the next run.
    let own_cache = node.state_dir().join("cache");
    let own_cache = own_cache.to_str().expect("a UTF-8 path");
    let mut agent = spawn_agent_with(
        &node,
        &registry,
        &[
            "--metrics-addr",
            &metrics.to_string(),
            "--cache-dir",
            own_cache,
        ],
    );
    node.kubelet
        .wait_until("devicelet.io/fuse", WAIT, |r| r.allocatable == 1)
        .await
        .expect("served");
    let applied = |n: usize| {
        let needle = format!("devicelet_registry_reloads_total{{result=\"applied\"}} {n}");
        async move {
            let deadline = std::time::Instant::now() + WAIT;
            loop {
                let (_, text) = devicelet_tests::http_get(metrics, "/metrics").await;
                if text.contains(&needle) {
                    return;
                }
                assert!(std::time::Instant::now() < deadline, "no {needle}");
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
        }
    };

    // The module's file changed to the slow one: its compile is caught and stopped.
    let slow_path = format!("path = {:?}", slow.display().to_string());
    node.registry(&fuse.replacen("path = \"@MODULES@/generic_dev.wasm\"", &slow_path, 1));
    let child = compile_child_of(agent.id()).await;
    // SAFETY: kill(2) on a process of our own agent's.
    assert_eq!(unsafe { libc::kill(child, libc::SIGSTOP) }, 0);
    applied(1).await;
    // Changed back to what runs: nothing to start, and the stalled start is no longer wanted.
    node.registry(&fuse);
    applied(2).await;
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(child, libc::SIGCONT) }, 0);
    // Ready once that start ended (its errors, were they kept, recorded before).
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let (code, _) = devicelet_tests::http_get(metrics, "/readyz").await;
        if code == 200 {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "never ready again");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let status = status::read(&node.state_dir()).await.expect("status");
    assert!(status.load_errors.is_empty(), "{:?}", status.load_errors);
    let module = status
        .modules
        .iter()
        .find(|m| m.name == "generic-dev")
        .expect("still running");
    let running =
        std::fs::read(devicelet_tests::module_dir().join("generic_dev.wasm")).expect("the module");
    let running = devicelet::digest::sha256_hex(&running);
    assert!(module.digest.contains(&running), "{}", module.digest);
    node.kubelet
        .allocate("devicelet.io/fuse", 1)
        .await
        .expect("the running version serves on");
    agent.kill().expect("SIGKILL");
    agent.wait().expect("reaped");
}

/// A module that creates something for each claim (WIT 0.3 `claims`, here the test module
/// `partitions`) has the agent's guarantee of `unprepare`: an agent killed with SIGKILL after
/// the module created an instance, before the claim was recorded prepared, undoes it when it
/// starts again, and the kubelet's retry prepares the claim afresh.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_killed_inside_a_modules_prepare_has_it_undone_after_restart() {
    use devicelet_tests::dra::{DraNode, registered};
    const DRIVER: &str = "acc.devicelet.io";
    let dra = DraNode::new().await;
    let registry = dra.node.registry(
        r#"[[module]]
name = "partitions"
path = "@MODULES@/partitions.wasm"
health-interval = "100ms"
front-end = "dra"
"#,
    );
    let state = dra.node.state_dir();
    let log = |n: usize| dra.node.dir.path().join(format!("agent-{n}.log"));
    let spawn = |n: usize| {
        spawn_dra_agent_logging(
            &dra,
            &registry,
            &state,
            &[],
            Stdio::from(std::fs::File::create(log(n)).expect("log file")),
        )
    };
    let mut first = spawn(1);
    registered(&dra.kubelet, 1).await;
    devicelet_tests::dra::counters_and_devices(&dra.api).await;
    let slow = serde_json::json!([{
        "source": "FromClaim",
        "requests": [],
        "opaque": {"driver": DRIVER, "parameters": {"slow": true}}
    }]);
    let uid = dra.claim(DRIVER, "half", &["acc-0-2s-0"], slow);
    let asked = preparing(&dra.kubelet, DRIVER, "half", &uid);
    let created = format!("created instance {uid}/acc");
    devicelet_tests::eventually("the module created its instance", || {
        std::fs::read_to_string(log(1)).is_ok_and(|t| t.contains(&created))
    })
    .await;
    first.kill().expect("SIGKILL");
    first.wait().expect("reaped");
    asked.abort();

    let mut second = spawn(2);
    registered(&dra.kubelet, 2).await;
    let destroyed = format!("destroyed instance {uid}/acc");
    devicelet_tests::eventually("the restarted agent undid the instance", || {
        std::fs::read_to_string(log(2)).is_ok_and(|t| t.contains(&destroyed))
    })
    .await;
    // The claim, asked for again (without the slow config), is prepared afresh.
    let uid2 = dra.claim(DRIVER, "again", &["acc-0-2s-0"], serde_json::json!([]));
    let prepared = dra.prepare(DRIVER, "again", &uid2).await;
    assert_eq!(prepared.error, "", "{prepared:?}");
    second.kill().expect("SIGKILL");
    second.wait().expect("reaped");
}
