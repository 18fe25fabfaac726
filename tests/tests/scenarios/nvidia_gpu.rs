//! The NVIDIA GPU reference module with the real agent and the kubelet simulator, over the fake
//! NVML library (`tests/fake-nvml`) loaded through the same dlopen path as the real one.

use std::collections::BTreeSet;

use devicelet::kubelet::api::deviceplugin::Device;
use devicelet_tests::{FakeGpus, Node, WAIT, eventually, generic_dev};
use serde_json::{Value, json};

fn uuid(i: u32) -> String {
    format!("GPU-6c4a5f2e-0000-4000-8000-00000000000{i}")
}

fn gpu(i: u32) -> Value {
    // Two NVLink islands of four, one per NUMA node.
    let island: Vec<String> = (0..8)
        .filter(|&j| j != i && j / 4 == i / 4)
        .flat_map(|j| [bus_id(j), bus_id(j), bus_id(j)])
        .collect();
    json!({
        "uuid": uuid(i),
        "name": "NVIDIA A100-SXM4-80GB",
        "minor": i,
        "pci-bus-id": bus_id(i),
        "memory-mib": 81920,
        "numa-node": i / 4,
        "nvlinks": island,
    })
}

fn bus_id(i: u32) -> String {
    format!("00000000:{:02X}:00.0", 0x07 + i * 0x10)
}

fn eight_gpus() -> Value {
    json!({ "driver-version": "550.54.15", "gpus": (0..8).map(gpu).collect::<Vec<_>>() })
}

/// A node with these GPUs: their device nodes in /dev and NVML answering from `fixture`.
async fn gpu_node(fixture: &Value) -> (Node, FakeGpus) {
    let node = Node::new().await;
    node.add_char("/dev/nvidiactl", 195, 255);
    node.add_char("/dev/nvidia-uvm", 510, 0);
    node.add_char("/dev/nvidia-uvm-tools", 510, 1);
    for i in 0..8 {
        node.add_char(&format!("/dev/nvidia{i}"), 195, i);
    }
    let gpus = FakeGpus::new(node.dir.path(), fixture);
    (node, gpus)
}

fn registry(health_interval: &str, config: &str, extra: &str) -> String {
    format!(
        r#"[[module]]
name = "nvidia-gpu"
path = "@MODULES@/nvidia_gpu.wasm"
resource-domain = "nvidia.com"
health-interval = "{health_interval}"
{extra}
[module.grants]
dev = ["/dev/nvidia*", "/dev/nvidia-caps/*"]
libraries = ["nvml"]
mounts = ["/run/nvidia/mps", "/run/nvidia/mps-shm"]

[module.config]
{config}
"#
    )
}

async fn start(node: &Node, gpus: &FakeGpus, modules: &str) -> devicelet::agent::Agent {
    let library = gpus.library.clone();
    let agent = node
        .start_agent_with(modules, |o| o.libraries.nvml = library)
        .await;
    assert!(agent.load_errors().is_empty(), "{:?}", agent.load_errors());
    agent
}

/// Waits until `units` devices of nvidia.com/gpu are served and the NVML event thread has
/// registered `watched` GPUs: an event injected earlier would reach no event set, as with real
/// NVML.
async fn watching(node: &Node, gpus: &FakeGpus, units: usize, watched: u32) {
    node.kubelet
        .wait_until("nvidia.com/gpu", WAIT, |r| r.allocatable == units)
        .await
        .expect("the GPUs served");
    let nvml = devicelet::nvml::open(&gpus.library);
    eventually("the event thread watches every GPU", || {
        nvml.watched_gpus() == watched
    })
    .await;
}

async fn watching_eight(node: &Node, gpus: &FakeGpus) {
    watching(node, gpus, 8, 8).await;
}

/// Eight GPUs, every one watched for events, healthy again 500 ms after a critical event.
async fn eight_watched_recovering_quickly() -> (Node, FakeGpus, devicelet::agent::Agent) {
    let (node, gpus) = gpu_node(&eight_gpus()).await;
    let agent = start(
        &node,
        &gpus,
        &registry("100ms", "quiet-period = \"500ms\"", ""),
    )
    .await;
    watching_eight(&node, &gpus).await;
    (node, gpus, agent)
}

fn numa(d: &Device) -> Vec<i64> {
    d.topology
        .iter()
        .flat_map(|t| t.nodes.iter().map(|n| n.id))
        .collect()
}

fn health_of(devices: &[Device], id: &str) -> String {
    devices
        .iter()
        .find(|d| d.id == id)
        .map(|d| d.health.clone())
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_gpus_on_two_numa_nodes_register_by_uuid_and_allocate_with_envs_and_nodes() {
    let (node, gpus) = gpu_node(&eight_gpus()).await;
    let _agent = start(&node, &gpus, &registry("1h", "", "")).await;
    let gpu = node
        .kubelet
        .wait_until("nvidia.com/gpu", WAIT, |r| r.allocatable == 8)
        .await
        .expect("eight GPUs");
    for d in &gpu.devices {
        let i: u32 = d.id.chars().last().and_then(|c| c.to_digit(10)).unwrap();
        assert_eq!(d.id, uuid(i));
        assert_eq!(numa(d), vec![i64::from(i / 4)], "{}", d.id);
    }
    assert!(gpu.options.get_preferred_allocation_available);

    let a = node
        .kubelet
        .allocate("nvidia.com/gpu", 2)
        .await
        .expect("two GPUs");
    // The module's NVLink-aware choice keeps the pair on one island.
    let islands: BTreeSet<u32> = a
        .device_ids
        .iter()
        .map(|id| id.chars().last().and_then(|c| c.to_digit(10)).unwrap() / 4)
        .collect();
    assert_eq!(islands.len(), 1, "{:?}", a.device_ids);
    assert_eq!(
        a.response.envs.get("NVIDIA_VISIBLE_DEVICES"),
        Some(&a.device_ids.join(","))
    );
    let nodes: Vec<&str> = a
        .response
        .devices
        .iter()
        .map(|d| d.host_path.as_str())
        .collect();
    assert_eq!(
        &nodes[..3],
        ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]
    );
    assert_eq!(nodes.len(), 5, "{nodes:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn critical_events_make_one_gpu_unhealthy_at_once_while_the_others_keep_allocating() {
    let (node, gpus) = gpu_node(&eight_gpus()).await;
    // The health interval is an hour: only the NVML event can wake the health check.
    let agent = start(&node, &gpus, &registry("1h", "quiet-period = \"1h\"", "")).await;
    watching_eight(&node, &gpus).await;

    // An application error (XID 13) is ignored by default; XID 48 (double-bit ECC) is not.
    gpus.inject("xid 2 13");
    gpus.inject("xid 2 48");
    let after = node
        .kubelet
        .wait_until("nvidia.com/gpu", WAIT, |r| r.allocatable == 7)
        .await
        .expect("GPU 2 unhealthy");
    assert_eq!(health_of(&after.devices, &uuid(2)), "Unhealthy");

    // XID 79: GPU 5 fell off the bus; NVML no longer answers for it.
    gpus.inject("xid 5 79");
    gpus.inject("lost 5");
    let after = node
        .kubelet
        .wait_until("nvidia.com/gpu", WAIT, |r| r.allocatable == 6)
        .await
        .expect("GPU 5 unhealthy");
    assert_eq!(after.devices.len(), 8, "a lost GPU stays listed");
    assert_eq!(health_of(&after.devices, &uuid(5)), "Unhealthy");
    for _ in 0..6 {
        let a = node
            .kubelet
            .allocate("nvidia.com/gpu", 1)
            .await
            .expect("the healthy GPUs still allocate");
        assert!(!a.device_ids.contains(&uuid(5)) && !a.device_ids.contains(&uuid(2)));
    }
    let module = devicelet_tests::module_status(&agent, "nvidia-gpu");
    assert_eq!(module.stats.traps + module.stats.deadlines, 0);
}

/// NVML's event wait fails with GPU_IS_LOST, naming no GPU, once a watched GPU is lost. The agent
/// asks each GPU which one it is: that one turns Unhealthy, the others never do (a failed wait
/// counted as missed events would make every GPU suspect for the quiet period). When it comes
/// back it is registered for events again, so its next fault is seen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpu_lost_while_watched_affects_only_itself_and_is_watched_again_when_found() {
    let (node, gpus, _agent) = eight_watched_recovering_quickly().await;
    gpus.inject("lost 3");
    let after = node
        .kubelet
        .wait_until("nvidia.com/gpu", WAIT, |r| {
            r.devices
                .iter()
                .any(|d| d.id == uuid(3) && d.health == "Unhealthy")
        })
        .await
        .expect("GPU 3 unhealthy");
    for i in (0..8).filter(|&i| i != 3) {
        assert_eq!(health_of(&after.devices, &uuid(i)), "Healthy", "GPU {i}");
    }
    let nvml = devicelet::nvml::open(&gpus.library);
    eventually("the event thread watches the other seven", || {
        nvml.watched_gpus() == 7
    })
    .await;
    let a = node
        .kubelet
        .allocate("nvidia.com/gpu", 7)
        .await
        .expect("the other seven allocate");
    assert!(!a.device_ids.contains(&uuid(3)));
    node.kubelet.release(a.id);

    gpus.inject("found 3");
    eventually("GPU 3 is watched again", || nvml.watched_gpus() == 8).await;
    node.kubelet
        .wait_until("nvidia.com/gpu", WAIT, |r| r.allocatable == 8)
        .await
        .expect("GPU 3 healthy again");
    gpus.inject("dbe 3");
    let faulted = node
        .kubelet
        .wait_until("nvidia.com/gpu", WAIT, |r| r.allocatable == 7)
        .await
        .expect("GPU 3's next fault is seen");
    assert_eq!(health_of(&faulted.devices, &uuid(3)), "Unhealthy");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpu_recovers_after_the_quiet_period_once_nvml_answers_again() {
    let (node, gpus, _agent) = eight_watched_recovering_quickly().await;
    gpus.inject("xid 3 79");
    gpus.inject("lost 3");
    node.kubelet
        .wait_until("nvidia.com/gpu", WAIT, |r| r.allocatable == 7)
        .await
        .expect("GPU 3 unhealthy");
    gpus.inject("found 3");
    let back = node
        .kubelet
        .wait_until("nvidia.com/gpu", WAIT, |r| r.allocatable == 8)
        .await
        .expect("GPU 3 healthy again");
    assert_eq!(health_of(&back.devices, &uuid(3)), "Healthy");
}

fn mig_gpu(i: u32, profiles: &[(u32, u32, u64)]) -> Value {
    let mut g = gpu(i);
    let devices: Vec<Value> = profiles
        .iter()
        .map(|&(gi, slices, mib)| {
            json!({
                "uuid": format!("MIG-0000000{gi}-1111-4000-8000-00000000000{i}"),
                "gi": gi, "ci": 0, "gi-slices": slices, "ci-slices": slices, "memory-mib": mib,
            })
        })
        .collect();
    g["mig"] = json!({ "enabled": true, "devices": devices });
    g
}

/// GPU 0 in MIG mode with a 1g.10gb device and `second`; with `whole`, GPU 1 not in MIG mode.
async fn mig_node(second: (u32, u32, u64), whole: bool) -> (Node, FakeGpus) {
    let mut gpus = vec![mig_gpu(0, &[(1, 1, 9856), second])];
    if whole {
        gpus.push(gpu(1));
    }
    let fixture = json!({ "driver-version": "550.54.15", "gpus": gpus });
    let (node, gpus) = gpu_node(&fixture).await;
    node.tree
        .write_file(
            "/proc/driver/nvidia-caps/mig-minors",
            "config 1\nmonitor 2\ngpu0/gi1/access 12\ngpu0/gi1/ci0/access 13\n\
             gpu0/gi2/access 21\ngpu0/gi2/ci0/access 22\n",
        )
        .expect("mig-minors");
    for minor in [12, 13, 21, 22] {
        node.add_char(&format!("/dev/nvidia-caps/nvidia-cap{minor}"), 511, minor);
    }
    (node, gpus)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_xid_in_one_mig_instance_takes_out_only_that_instance_until_its_quiet_period_ends() {
    let (node, gpus) = mig_node((2, 1, 9856), false).await;
    // A one-hour health interval: only the event, and the module's own recheck when the quiet
    // period ends, make the agent look again.
    let config = "mig-strategy = \"single\"\nquiet-period = \"300ms\"";
    let _agent = start(&node, &gpus, &registry("1h", config, "")).await;
    // Two MIG devices on one GPU.
    watching(&node, &gpus, 2, 1).await;
    // XID 94 (a contained ECC error) raised in GPU instance 2, compute instance 0.
    gpus.inject("xid 0 94 2 0");
    let one = node
        .kubelet
        .wait_until("nvidia.com/gpu", WAIT, |r| r.allocatable == 1)
        .await
        .expect("one MIG device unhealthy");
    let sick: Vec<&str> = one
        .devices
        .iter()
        .filter(|d| d.health == "Unhealthy")
        .map(|d| d.id.as_str())
        .collect();
    assert_eq!(sick.len(), 1, "{sick:?}");
    assert!(sick[0].starts_with("MIG-00000002"), "{sick:?}");
    node.kubelet
        .wait_until("nvidia.com/gpu", WAIT, |r| r.allocatable == 2)
        .await
        .expect("healthy again when its quiet period ends, not at the next interval");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mig_single_serves_mig_devices_as_gpus_with_their_caps_nodes() {
    let (node, gpus) = mig_node((2, 1, 9856), false).await;
    let _agent = start(
        &node,
        &gpus,
        &registry("1h", "mig-strategy = \"single\"", ""),
    )
    .await;
    let gpu = node
        .kubelet
        .wait_until("nvidia.com/gpu", WAIT, |r| r.allocatable == 2)
        .await
        .expect("two MIG devices");
    let migs = gpu
        .devices
        .iter()
        .filter(|d| d.id.starts_with("MIG-"))
        .count();
    assert_eq!(migs, 2, "{:?}", gpu.devices);
    let a = node
        .kubelet
        .allocate("nvidia.com/gpu", 2)
        .await
        .expect("both MIG devices");
    let visible = a
        .response
        .envs
        .get("NVIDIA_VISIBLE_DEVICES")
        .cloned()
        .unwrap_or_default();
    assert_eq!(
        visible
            .split(',')
            .filter(|id| id.starts_with("MIG-"))
            .count(),
        2,
        "{visible}"
    );
    let nodes: BTreeSet<&str> = a
        .response
        .devices
        .iter()
        .map(|d| d.host_path.as_str())
        .collect();
    for minor in [12, 13, 21, 22] {
        let cap = format!("/dev/nvidia-caps/nvidia-cap{minor}");
        assert!(nodes.contains(cap.as_str()), "{cap} in {nodes:?}");
    }
    assert!(nodes.contains("/dev/nvidia0"), "{nodes:?}");
}

/// Waits until `mig_node((2, 2, ..), true)` is served under `mixed`: GPU 1 whole, GPU 0's two
/// MIG devices each as its profile's resource.
async fn serving_gpu_and_two_profiles(node: &Node) {
    for (resource, count) in [
        ("nvidia.com/gpu", 1),
        ("nvidia.com/mig-1g.10gb", 1),
        ("nvidia.com/mig-2g.20gb", 1),
    ] {
        node.kubelet
            .wait_until(resource, WAIT, |r| r.allocatable == count)
            .await
            .unwrap_or_else(|e| panic!("{resource}: {e}"));
    }
}

/// Under `mixed`, the MIG profiles are the module's resources, declared at init: a module that
/// started before NVML answered is started again when it does, and the profiles' resources
/// appear with no registry edit and no restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mig_mixed_profiles_appear_when_the_driver_loads_after_the_agent_started() {
    let (node, gpus) = mig_node((2, 2, 19968), true).await;
    let nvml_json = gpus.library.with_file_name("nvml.json");
    let loaded: Value =
        serde_json::from_str(&std::fs::read_to_string(&nvml_json).expect("fixture")).expect("json");
    let mut not_yet = loaded.clone();
    not_yet["init"] = json!("driver-not-loaded");
    std::fs::write(&nvml_json, not_yet.to_string()).expect("the driver not loaded yet");
    let _agent = start(
        &node,
        &gpus,
        &registry("1h", "mig-strategy = \"mixed\"", ""),
    )
    .await;
    node.kubelet
        .wait_until("nvidia.com/gpu", WAIT, |r| r.snapshots > 0)
        .await
        .expect("nvidia.com/gpu registers with no GPUs");
    assert!(node.kubelet.resource("nvidia.com/mig-1g.10gb").is_none());
    std::fs::write(&nvml_json, loaded.to_string()).expect("the driver loads");
    serving_gpu_and_two_profiles(&node).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mig_mixed_serves_a_resource_per_profile() {
    let (node, gpus) = mig_node((2, 2, 19968), true).await;
    let _agent = start(
        &node,
        &gpus,
        &registry("1h", "mig-strategy = \"mixed\"", ""),
    )
    .await;
    serving_gpu_and_two_profiles(&node).await;
    let a = node
        .kubelet
        .allocate("nvidia.com/mig-2g.20gb", 1)
        .await
        .expect("the 2g.20gb device");
    assert!(
        a.device_ids[0].starts_with("MIG-00000002"),
        "{:?}",
        a.device_ids
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mps_shares_each_gpu_four_ways_with_a_quarter_each_and_one_share_per_container() {
    let (node, gpus) = gpu_node(&eight_gpus()).await;
    for dir in ["/run/nvidia/mps", "/run/nvidia/mps-shm"] {
        std::fs::create_dir_all(node.tree.path(dir)).expect("the MPS directories");
    }
    // As NVIDIA's plugin forces under MPS: one replica per container, refused by the host
    // before the module is asked, so two shares that land on one GPU are refused too.
    let sharing =
        "[module.sharing]\nreplicas = 4\nrename = true\nfail-requests-greater-than-one = true\n";
    let config = "mps-pipe-directory = \"/run/nvidia/mps\"\nmps-shm-directory = \"/run/nvidia/mps-shm\"\n\
                  mps-replicas = 4";
    let _agent = start(&node, &gpus, &registry("1h", config, sharing)).await;
    let shared = node
        .kubelet
        .wait_until("nvidia.com/gpu.shared", WAIT, |r| r.allocatable == 32)
        .await
        .expect("four replicas of eight GPUs");
    assert!(
        shared.devices.iter().all(|d| d.id.contains("::")),
        "{:?}",
        shared.devices[0].id
    );
    let a = node
        .kubelet
        .allocate("nvidia.com/gpu.shared", 1)
        .await
        .expect("one replica");
    assert_eq!(
        a.response
            .envs
            .get("CUDA_MPS_PIPE_DIRECTORY")
            .map(String::as_str),
        Some("/run/nvidia/mps")
    );
    let visible = a
        .response
        .envs
        .get("NVIDIA_VISIBLE_DEVICES")
        .cloned()
        .unwrap_or_default();
    assert!(
        visible.starts_with("GPU-"),
        "the module sees physical IDs: {visible}"
    );
    assert_eq!(a.response.mounts[0].host_path, "/run/nvidia/mps");
    assert!(!a.response.mounts[0].read_only);
    let shm = &a.response.mounts[1];
    assert_eq!(
        (shm.host_path.as_str(), shm.container_path.as_str()),
        ("/run/nvidia/mps-shm", "/dev/shm")
    );
    // A quarter of the GPU's threads and of its 80 GiB.
    let env = |key: &str| a.response.envs.get(key).map(String::as_str);
    assert_eq!(env("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"), Some("25"));
    assert_eq!(env("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"), Some("0=20480M"));
    let two = node
        .kubelet
        .allocate("nvidia.com/gpu.shared", 2)
        .await
        .expect_err("one MPS share per container")
        .to_string();
    assert!(
        two.contains("a container may ask for one device only, not 2"),
        "{two}"
    );
}

/// Under MPS without `fail-requests-greater-than-one`, two shares for one container land on two
/// GPUs (the agent's preferred allocation never picks two of one), and a request for two shares
/// of one GPU (a node with one GPU left) is refused by the agent before the module is asked,
/// as NVIDIA's plugin refuses it: one container is one MPS client of one GPU.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_mps_a_container_never_gets_two_shares_of_one_gpu() {
    let one = json!({ "driver-version": "550.54.15", "gpus": [gpu(0)] });
    let (node, gpus) = gpu_node(&one).await;
    for dir in ["/run/nvidia/mps", "/run/nvidia/mps-shm"] {
        std::fs::create_dir_all(node.tree.path(dir)).expect("the MPS directories");
    }
    let sharing = "[module.sharing]\nreplicas = 4\nrename = true\n";
    let config = "mps-pipe-directory = \"/run/nvidia/mps\"\nmps-shm-directory = \"/run/nvidia/mps-shm\"\n\
                  mps-replicas = 4";
    let _agent = start(&node, &gpus, &registry("1h", config, sharing)).await;
    node.kubelet
        .wait_until("nvidia.com/gpu.shared", WAIT, |r| r.allocatable == 4)
        .await
        .expect("four replicas of one GPU");
    let two = node
        .kubelet
        .allocate("nvidia.com/gpu.shared", 2)
        .await
        .expect_err("two shares of one GPU")
        .to_string();
    // The agent's refusal (InvalidArgument), not the module's.
    assert!(
        two.contains("a container gets one share of a device at most")
            && two.contains("InvalidArgument"),
        "{two}"
    );
    node.kubelet
        .allocate("nvidia.com/gpu.shared", 1)
        .await
        .expect("one share");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cdi_names_for_the_nvidia_toolkit() {
    let (node, gpus) = gpu_node(&eight_gpus()).await;
    let config = "visible-devices = \"cdi\"\ndevice-id-strategy = \"index\"";
    let _agent = start(&node, &gpus, &registry("1h", config, "")).await;
    node.kubelet
        .wait_until("nvidia.com/gpu", WAIT, |r| r.allocatable == 8)
        .await
        .expect("eight GPUs");
    let a = node
        .kubelet
        .allocate("nvidia.com/gpu", 1)
        .await
        .expect("one GPU");
    let names: Vec<&str> = a
        .response
        .cdi_devices
        .iter()
        .map(|d| d.name.as_str())
        .collect();
    assert_eq!(names, [format!("nvidia.com/gpu={}", a.device_ids[0])]);
    assert!(a.response.envs.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpu_lost_before_start_is_listed_unhealthy_and_served_once_found() {
    let (node, gpus) = gpu_node(&eight_gpus()).await;
    // Written before nvmlInit: GPU 3 is off the bus when the driver starts.
    gpus.inject("lost 3");
    let _agent = start(
        &node,
        &gpus,
        &registry("100ms", "quiet-period = \"100ms\"", ""),
    )
    .await;
    let listed = node
        .kubelet
        .wait_until("nvidia.com/gpu", WAIT, |r| {
            r.capacity == 8 && r.allocatable == 7
        })
        .await
        .expect("eight GPUs, one Unhealthy");
    let lost = listed
        .devices
        .iter()
        .find(|d| d.id == "lost-3")
        .expect("listed by its index");
    assert_eq!(lost.health, "Unhealthy");
    gpus.inject("found 3");
    let found = node
        .kubelet
        .wait_until("nvidia.com/gpu", WAIT, |r| r.allocatable == 8)
        .await
        .expect("served once found");
    assert!(found.devices.iter().any(|d| d.id == uuid(3)));
    assert!(found.devices.iter().all(|d| d.id != "lost-3"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn validate_checks_the_cdi_names_the_module_answers_against_the_node_specs() {
    let (node, gpus) = gpu_node(&eight_gpus()).await;
    let file = node.registry(&registry("1h", "visible-devices = \"cdi\"", ""));
    let specs = node.dir.path().join("cdi");
    std::fs::create_dir_all(&specs).expect("spec dir");
    let validate = || {
        devicelet_tests::validate_registry(
            &file,
            &[
                "--nvml-library".as_ref(),
                gpus.library.as_os_str(),
                "--cdi-spec-dir".as_ref(),
                specs.as_os_str(),
            ],
        )
    };
    // No spec defines the GPUs yet: the runtime would refuse every container.
    let (ok, text) = validate();
    assert!(!ok, "{text}");
    assert!(
        text.contains(&format!(
            "device {}: the module names CDI device `nvidia.com/gpu={}`, which no spec in {} defines",
            uuid(3),
            uuid(3),
            specs.display()
        )),
        "{text}"
    );
    assert!(text.contains("nvidia-ctk cdi generate"), "{text}");
    // nvidia-ctk's spec names each GPU by index and by UUID.
    let devices: String = (0..8)
        .flat_map(|i| [i.to_string(), uuid(i)])
        .map(|name| format!("- name: {name}\n  containerEdits: {{}}\n"))
        .collect();
    std::fs::write(
        specs.join("nvidia.yaml"),
        format!(
            "cdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices:\n{devices}containerEdits: {{}}\n"
        ),
    )
    .expect("writing the spec");
    let (ok, text) = validate();
    assert!(ok, "{text}");
    assert!(
        text.contains("CDI names the module answers: 8, each defined by a spec in"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_nvml_zeroes_no_gpu_and_holds_no_kubelet_call_past_its_deadline() {
    let (node, gpus) = gpu_node(&eight_gpus()).await;
    node.add_char("/dev/fuse", 10, 229);
    let modules = format!(
        "{}\n{}",
        registry(
            "100ms",
            "",
            "health-deadline = \"200ms\"\ncall-deadline = \"500ms\"\n"
        ),
        generic_dev(
            r#"groups = [{ name = "fuse", paths = ["/dev/fuse"] }]

[module.sharing.resources.fuse]
replicas = 4"#
        )
    );
    let agent = start(&node, &gpus, &modules).await;
    let before = node
        .kubelet
        .wait_until("nvidia.com/gpu", WAIT, |r| r.allocatable == 8)
        .await
        .expect("eight GPUs");
    devicelet_tests::prepared_answers(&agent, "nvidia.com/gpu", 8).await;
    let deadlines = devicelet_tests::module_status(&agent, "nvidia-gpu")
        .stats
        .deadlines;

    // Every NVML device query now blocks until `unhang`.
    gpus.inject("hang");
    eventually("three enumerations to stall", || {
        devicelet_tests::module_status(&agent, "nvidia-gpu")
            .stats
            .deadlines
            >= deadlines + 3
    })
    .await;
    let during = node.kubelet.resource("nvidia.com/gpu").expect("served");
    assert_eq!(during.allocatable, 8, "a stall is not a fault");
    assert_eq!(
        during.snapshots, before.snapshots,
        "no snapshot was sent while NVML stalled"
    );

    // Preferred allocation (from what its instance learnt at init) and a one-GPU Allocate
    // (answered from the answer prepared for it) need no NVML: answered while it hangs.
    let one = node
        .kubelet
        .allocate("nvidia.com/gpu", 1)
        .await
        .expect("a prepared answer while NVML hangs");
    assert_eq!(one.device_ids.len(), 1);
    // Two GPUs: the module is asked, and answers from the GPUs its instance has seen, with no
    // NVML query, as NVIDIA's Allocate does: multi-GPU pods still start.
    let two = node
        .kubelet
        .allocate("nvidia.com/gpu", 2)
        .await
        .expect("two GPUs while NVML hangs");
    assert_eq!(two.device_ids.len(), 2);
    for _ in 0..3 {
        node.kubelet
            .allocate("devicelet.io/fuse", 1)
            .await
            .expect("the other module keeps allocating");
    }
    let stuck = devicelet_tests::module_status(&agent, "nvidia-gpu");
    assert_eq!(stuck.stats.abandoned_cells, 0, "{:?}", stuck.stats);
    assert_eq!(stuck.stats.traps, 0, "{:?}", stuck.stats);

    gpus.inject("unhang");
    let two = node
        .kubelet
        .allocate("nvidia.com/gpu", 2)
        .await
        .expect("two GPUs once NVML answers");
    assert_eq!(two.device_ids.len(), 2);
    let after = node.kubelet.resource("nvidia.com/gpu").expect("served");
    assert_eq!(after.capacity, 8);
    agent.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_nvml_the_gpu_resource_waits_with_no_devices_and_the_others_serve() {
    let node = Node::new().await;
    node.add_char("/dev/fuse", 10, 229);
    let modules = format!(
        "{}\n{}",
        registry("1h", "", ""),
        generic_dev(r#"groups = [{ name = "fuse", paths = ["/dev/fuse"] }]"#)
    );
    let missing = node.dir.path().join("no-driver/libnvidia-ml.so.1");
    let agent = node
        .start_agent_with(&modules, |o| o.libraries.nvml = missing.clone())
        .await;
    node.kubelet
        .wait_until("devicelet.io/fuse", WAIT, |r| r.allocatable == 1)
        .await
        .expect("the other module serves");
    let gpus = node
        .kubelet
        .wait_until("nvidia.com/gpu", WAIT, |r| r.snapshots > 0)
        .await
        .expect("nvidia.com/gpu registers while NVML is missing");
    assert!(gpus.devices.is_empty(), "{:?}", gpus.devices);
    assert!(agent.load_errors().is_empty(), "{:?}", agent.load_errors());
    let why = agent.ready().expect_err("not ready while waiting for NVML");
    assert!(
        why.contains("module `nvidia-gpu` is waiting for NVML"),
        "{why}"
    );
    assert!(why.contains("no-driver/libnvidia-ml.so.1"), "{why}");
    let module = devicelet_tests::module_status(&agent, "nvidia-gpu");
    assert!(
        matches!(&module.nvml, Some(devicelet::nvml::Availability::Unavailable(w)) if w.contains("no-driver")),
        "{:?}",
        module.nvml
    );
    let metrics = devicelet_tests::parse_metrics(&agent.metrics());
    assert_eq!(
        devicelet_tests::metric(
            &metrics,
            "devicelet_module_nvml_ready",
            &[("module", "nvidia-gpu")]
        ),
        Some(0.0)
    );
}

/// The driver's kernel module loads after the agent started: `nvmlInit` fails with "driver not
/// loaded" until it does, and the agent keeps trying.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_driver_loaded_after_the_agent_started_is_retried_until_nvml_answers() {
    let mut fixture = eight_gpus();
    fixture["init"] = json!("driver-not-loaded");
    let (node, gpus) = gpu_node(&fixture).await;
    let agent = start(&node, &gpus, &registry("1h", "", "")).await;
    node.kubelet
        .wait_until("nvidia.com/gpu", WAIT, |r| r.snapshots > 0)
        .await
        .expect("nvidia.com/gpu registers with no GPUs");
    let why = agent.ready().expect_err("waiting for NVML");
    assert!(why.contains("driver"), "{why}");
    let nvml_json = gpus.library.with_file_name("nvml.json");
    std::fs::write(&nvml_json, eight_gpus().to_string()).expect("the driver loads");
    node.kubelet
        .wait_until("nvidia.com/gpu", WAIT, |r| r.allocatable == 8)
        .await
        .expect("the GPUs appear once NVML answers");
}

/// An `nvmlInit` slower than the 10 s a module load waits for it is not given up on: the GPUs
/// appear when it returns. Meanwhile it holds back no other module: FUSE registers and allocates
/// while the agent is still waiting for NVML.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_nvml_init_slower_than_the_load_limit_delays_no_other_module_and_is_then_served() {
    let mut fixture = eight_gpus();
    fixture["init-delay-ms"] = json!(12_000);
    let (node, gpus) = gpu_node(&fixture).await;
    node.add_char("/dev/fuse", 10, 229);
    let modules = format!(
        "{}\n{}",
        registry("1h", "", ""),
        generic_dev(r#"groups = [{ name = "fuse", paths = ["/dev/fuse"] }]"#)
    );
    let starting = start(&node, &gpus, &modules);
    tokio::pin!(starting);
    tokio::select! {
        _ = &mut starting => panic!("the agent's start ended before FUSE registered"),
        fuse = node.kubelet.wait_until("devicelet.io/fuse", WAIT, |r| r.allocatable == 1) => {
            fuse.expect("FUSE registers while NVML's init is still running");
        }
    }
    let fuse = node
        .kubelet
        .allocate("devicelet.io/fuse", 1)
        .await
        .expect("FUSE allocates while NVML's init is still running");
    assert_eq!(fuse.device_ids.len(), 1, "{fuse:?}");
    let agent = starting.await;
    let module = devicelet_tests::module_status(&agent, "nvidia-gpu");
    assert!(
        matches!(&module.nvml, Some(devicelet::nvml::Availability::Unavailable(w)) if w.contains("did not return within 10s")),
        "{:?}",
        module.nvml
    );
    node.kubelet
        .wait_until("nvidia.com/gpu", WAIT, |r| r.allocatable == 8)
        .await
        .expect("the GPUs appear once the slow init returns");
}

/// The GPU Operator's driver container installs NVML after the agent started: the agent keeps
/// opening it, and the GPUs appear as soon as it answers, with no registry edit and no restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_driver_installed_after_the_agent_started_is_picked_up_without_a_restart() {
    let (node, gpus) = gpu_node(&eight_gpus()).await;
    let later = gpus.library.with_extension("installing");
    std::fs::rename(&gpus.library, &later).expect("hide the library");
    let agent = start(&node, &gpus, &registry("1h", "", "")).await;
    node.kubelet
        .wait_until("nvidia.com/gpu", WAIT, |r| r.snapshots > 0)
        .await
        .expect("nvidia.com/gpu registers with no GPUs");
    assert!(agent.ready().is_err());
    std::fs::rename(&later, &gpus.library).expect("install the library");
    let served = node
        .kubelet
        .wait_until("nvidia.com/gpu", WAIT, |r| r.allocatable == 8)
        .await
        .expect("the GPUs appear once NVML answers");
    assert_eq!(served.devices.len(), 8);
    eventually("the agent is ready", || agent.ready().is_ok()).await;
    let module = devicelet_tests::module_status(&agent, "nvidia-gpu");
    assert!(
        matches!(
            module.nvml,
            Some(devicelet::nvml::Availability::Ready { gpus: 8, .. })
        ),
        "{:?}",
        module.nvml
    );
}
