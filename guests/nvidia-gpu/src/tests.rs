//! The module against the SDK's fake node: NVML as the test describes it.

use std::time::Duration;

use devicelet_sdk::Health;
use devicelet_sdk::nvml::{EventKind, Gpu, Link, MigDevice, TopologyLevel};
use devicelet_sdk::testing::{FakeHost, FakeNvml, Harness};

use super::NvidiaGpu;

fn uuid(i: u32) -> String {
    format!("GPU-00000000-0000-0000-0000-00000000000{i}")
}

fn gpu(i: u32) -> Gpu {
    Gpu {
        index: i,
        uuid: uuid(i),
        name: "NVIDIA A100-SXM4-80GB".into(),
        minor: i,
        pci_bus_id: format!("00000000:{:02X}:00.0", 7 + i),
        memory_bytes: 81920 << 20,
        numa_node: Some(i64::from(i / 4)),
        cpu_affinity: Vec::new(),
        mig_enabled: false,
    }
}

fn mig(gi: u32, profile: &str, caps: [u32; 2]) -> MigDevice {
    MigDevice {
        index: gi - 1,
        uuid: format!("MIG-0000000{gi}-aaaa-bbbb-cccc-000000000000"),
        gpu_instance_id: gi,
        compute_instance_id: 0,
        profile: profile.into(),
        memory_bytes: 9856 << 20,
        caps_minors: caps.to_vec(),
    }
}

/// Eight GPUs on two NUMA nodes, NVLinked in two islands of four.
fn eight() -> FakeNvml {
    let mut nvml = FakeNvml::new();
    for i in 0..8 {
        nvml = nvml.with_gpu(gpu(i));
    }
    for a in 0..8 {
        for b in a + 1..8 {
            let (level, nvlinks) = if a / 4 == b / 4 {
                (TopologyLevel::Node, 12)
            } else {
                (TopologyLevel::System, 0)
            };
            nvml = nvml.with_link(a, b, Link { level, nvlinks });
        }
    }
    nvml
}

fn node(nvml: FakeNvml) -> FakeHost {
    let mut host = FakeHost::new()
        .grant_dev("/dev/nvidia*")
        .grant_dev("/dev/nvidia-caps/*")
        .grant_nvml(nvml)
        .char_device("/dev/nvidiactl", 195, 255)
        .char_device("/dev/nvidia-uvm", 510, 0)
        .char_device("/dev/nvidia-caps/nvidia-cap12", 511, 12)
        .char_device("/dev/nvidia-caps/nvidia-cap13", 511, 13);
    for i in 0..8 {
        host = host.char_device(&format!("/dev/nvidia{i}"), 195, i);
    }
    host
}

fn health(gpus: &mut Harness<NvidiaGpu>) -> Vec<Health> {
    gpus.enumerate("gpu")
        .unwrap()
        .into_iter()
        .map(|d| d.health)
        .collect()
}

#[test]
fn eight_gpus_by_uuid_with_numa_and_nvml_facts() {
    let mut gpus = Harness::<NvidiaGpu>::init(node(eight()), "{}").unwrap();
    let devices = gpus.enumerate("gpu").unwrap();
    assert_eq!(devices.len(), 8);
    assert_eq!(devices[5].id, uuid(5));
    assert_eq!(devices[5].numa_nodes, vec![1]);
    let attr = |k: &str| devices[5].text(k).map(str::to_owned);
    assert_eq!(attr("memory-mib").as_deref(), Some("81920"));
    assert_eq!(attr("pci-address").as_deref(), Some("0000:0c:00.0"));
    assert!(devices.iter().all(|d| d.health == Health::Healthy));
}

#[test]
fn a_container_gets_visible_devices_and_its_nodes() {
    let mut gpus = Harness::<NvidiaGpu>::init(node(eight()), "{}").unwrap();
    let (a, b) = (uuid(1), uuid(2));
    let edits = gpus.allocate("gpu", &[&a, &b]).unwrap();
    assert_eq!(
        edits.envs,
        vec![("NVIDIA_VISIBLE_DEVICES".into(), format!("{a},{b}"))]
    );
    let nodes: Vec<&str> = edits.devices.iter().map(|d| d.host_path.as_str()).collect();
    // nvidia-uvm-tools and nvidia-modeset are absent on this node, so they are left out rather
    // than refused.
    assert_eq!(
        nodes,
        [
            "/dev/nvidiactl",
            "/dev/nvidia-uvm",
            "/dev/nvidia1",
            "/dev/nvidia2"
        ]
    );
    let mut by_index =
        Harness::<NvidiaGpu>::init(node(eight()), r#"{"device-id-strategy": "index"}"#).unwrap();
    assert_eq!(by_index.enumerate("gpu").unwrap()[3].id, "3");
    let mut cdi =
        Harness::<NvidiaGpu>::init(node(eight()), r#"{"visible-devices": "cdi"}"#).unwrap();
    let edits = cdi.allocate("gpu", &[&a]).unwrap();
    assert_eq!(edits.cdi_devices, vec![format!("nvidia.com/gpu={a}")]);
    assert!(edits.envs.is_empty() && edits.devices.is_empty());
}

#[test]
fn control_nodes_are_optional_and_modeset_is_handed_over_when_present() {
    let a = uuid(0);
    // No nvidiactl at all: NVIDIA's plugin still allocates, and so do we.
    let mut bare = FakeHost::new()
        .grant_dev("/dev/nvidia*")
        .grant_nvml(eight())
        .char_device("/dev/nvidia0", 195, 0);
    let mut gpus = Harness::<NvidiaGpu>::init(bare, "{}").unwrap();
    let edits = gpus.allocate("gpu", &[&a]).unwrap();
    let nodes: Vec<&str> = edits.devices.iter().map(|d| d.host_path.as_str()).collect();
    assert_eq!(nodes, ["/dev/nvidia0"]);
    bare = node(eight()).char_device("/dev/nvidia-modeset", 195, 254);
    let mut gpus = Harness::<NvidiaGpu>::init(bare, "{}").unwrap();
    let edits = gpus.allocate("gpu", &[&a]).unwrap();
    let nodes: Vec<&str> = edits.devices.iter().map(|d| d.host_path.as_str()).collect();
    assert_eq!(
        nodes,
        [
            "/dev/nvidiactl",
            "/dev/nvidia-uvm",
            "/dev/nvidia-modeset",
            "/dev/nvidia0"
        ]
    );
}

#[test]
fn critical_events_make_one_gpu_unhealthy_and_ignored_xids_do_not() {
    let mut gpus = Harness::<NvidiaGpu>::init(node(eight()), r#"{"quiet-period": "1h"}"#).unwrap();
    gpus.host().nvml_event(&uuid(2), EventKind::Xid(13));
    assert!(health(&mut gpus).iter().all(|h| *h == Health::Healthy));
    gpus.host().nvml_event(&uuid(2), EventKind::Xid(48));
    gpus.host().nvml_event(&uuid(6), EventKind::DoubleBitEcc);
    let now = health(&mut gpus);
    let sick: Vec<usize> = (0..8).filter(|&i| now[i] == Health::Unhealthy).collect();
    assert_eq!(sick, vec![2, 6]);
    // Each says why: the latest critical event (and so its DRA taint's value).
    let devices = gpus.enumerate("gpu").unwrap();
    let why = |i: usize| devices[i].health_reason.clone();
    assert_eq!(
        (why(2), why(6), why(0)),
        (
            Some("XID 48".into()),
            Some("double-bit ECC error".into()),
            None
        )
    );
    // A fresh instance (after a crash) rebuilds the same health from the agent's buffer.
    let mut fresh = gpus.another(r#"{"quiet-period": "1h"}"#).unwrap();
    assert_eq!(health(&mut fresh), now);
}

#[test]
fn a_gpu_off_the_bus_stays_listed_unhealthy_and_recovers_after_the_quiet_period() {
    let mut gpus =
        Harness::<NvidiaGpu>::init(node(eight()), r#"{"quiet-period": "50ms"}"#).unwrap();
    assert_eq!(health(&mut gpus)[3], Health::Healthy);
    gpus.host().nvml_event(&uuid(3), EventKind::Xid(79));
    gpus.host().set_gpu_lost(3, true);
    let devices = gpus.enumerate("gpu").unwrap();
    assert_eq!(devices.len(), 8);
    assert_eq!(
        (devices[3].id.clone(), devices[3].health),
        (uuid(3), Health::Unhealthy)
    );
    let why = devices[3].health_reason.clone().unwrap_or_default();
    assert!(why.starts_with("lost:"), "{why}");
    assert!(gpus.allocate("gpu", &[&uuid(3)]).is_err());
    assert!(gpus.allocate("gpu", &[&uuid(4)]).is_ok());
    gpus.host().set_gpu_lost(3, false);
    // Answering again is not enough: the quiet period runs from the last critical sign.
    assert_eq!(health(&mut gpus)[3], Health::Unhealthy);
    std::thread::sleep(Duration::from_millis(60));
    assert_eq!(health(&mut gpus)[3], Health::Healthy);
}

#[test]
fn a_gpu_lost_before_start_is_listed_unhealthy_by_its_index_until_it_answers() {
    let mut gpus = Harness::<NvidiaGpu>::init(
        node(eight().with_lost_gpu(3)),
        r#"{"quiet-period": "50ms"}"#,
    )
    .unwrap();
    let devices = gpus.enumerate("gpu").unwrap();
    assert_eq!(devices.len(), 8, "the lost GPU counts");
    let lost = devices.iter().find(|d| d.id == "lost-3").expect("listed");
    assert_eq!(lost.health, Health::Unhealthy);
    assert_eq!(
        lost.health_reason.as_deref(),
        Some("lost: NVML never answered for it")
    );
    assert!(gpus.allocate("gpu", &["lost-3"]).is_err());
    assert!(gpus.allocate("gpu", &[&uuid(4)]).is_ok());
    // Once it answers, it is listed by its UUID instead, as any GPU is.
    gpus.host().set_gpu_lost(3, false);
    let devices = gpus.enumerate("gpu").unwrap();
    assert_eq!(devices.len(), 8);
    assert!(devices.iter().all(|d| d.id != "lost-3"));
    let back = devices.iter().find(|d| d.id == uuid(3)).expect("by UUID");
    assert_eq!(back.health, Health::Healthy);
}

/// GPU 0 in MIG mode with two MIG devices; with `whole`, GPU 1 beside it, not in MIG mode.
fn mig_node(second_profile: &str, whole: bool) -> FakeHost {
    let mut a = gpu(0);
    a.mig_enabled = true;
    let mut nvml = FakeNvml::new()
        .with_gpu(a)
        .with_mig_device(0, mig(1, "1g.10gb", [12, 13]))
        .with_mig_device(0, mig(2, second_profile, [14, 15]));
    if whole {
        nvml = nvml.with_gpu(gpu(1));
    }
    node(nvml)
}

#[test]
fn an_xid_in_one_mig_instance_makes_only_that_mig_device_unhealthy() {
    let mut gpus = Harness::<NvidiaGpu>::init(
        mig_node("1g.10gb", false),
        r#"{"mig-strategy": "single", "quiet-period": "1h"}"#,
    )
    .unwrap();
    let health = |gpus: &mut Harness<NvidiaGpu>| -> Vec<(String, Health)> {
        gpus.enumerate("gpu")
            .unwrap()
            .into_iter()
            .map(|d| (d.id, d.health))
            .collect()
    };
    assert!(health(&mut gpus).iter().all(|(_, h)| *h == Health::Healthy));
    // Raised in GPU instance 2, compute instance 0: the second MIG device only.
    gpus.host()
        .nvml_mig_event(&uuid(0), EventKind::Xid(94), 2, 0);
    let now = health(&mut gpus);
    assert_eq!(now[0].1, Health::Healthy, "{now:?}");
    assert_eq!(now[1].1, Health::Unhealthy, "{now:?}");
    assert!(now[1].0.starts_with("MIG-00000002"), "{now:?}");
    // About the whole GPU: every MIG device of it.
    gpus.host().nvml_event(&uuid(0), EventKind::Xid(48));
    assert!(
        health(&mut gpus)
            .iter()
            .all(|(_, h)| *h == Health::Unhealthy)
    );
}

#[test]
fn the_host_is_asked_to_look_again_when_the_quiet_period_ends() {
    let mut gpus = Harness::<NvidiaGpu>::init(node(eight()), r#"{"quiet-period": "10m"}"#).unwrap();
    gpus.enumerate("gpu").unwrap();
    assert_eq!(gpus.host().take_recheck(), None, "nothing to wait for");
    gpus.host().nvml_event(&uuid(3), EventKind::Xid(48));
    gpus.enumerate("gpu").unwrap();
    let asked = gpus
        .host()
        .take_recheck()
        .expect("a recheck at the quiet period's end");
    assert!(
        asked <= Duration::from_secs(600) + Duration::from_millis(1)
            && asked > Duration::from_secs(590),
        "{asked:?}"
    );
}

#[test]
fn a_gpu_lost_before_start_does_not_fail_mig_single() {
    // GPU 0 in MIG mode, GPU 1 lost before NVML ever answered for it: nothing says GPU 1 is
    // not in MIG mode, so "single" still serves GPU 0's MIG devices.
    let mut a = gpu(0);
    a.mig_enabled = true;
    let nvml = FakeNvml::new()
        .with_gpu(a)
        .with_mig_device(0, mig(1, "1g.10gb", [12, 13]))
        .with_mig_device(0, mig(2, "1g.10gb", [14, 15]))
        .with_gpu(gpu(1))
        .with_lost_gpu(1);
    let mut gpus = Harness::<NvidiaGpu>::init(node(nvml), r#"{"mig-strategy": "single"}"#).unwrap();
    let devices = gpus.enumerate("gpu").unwrap();
    let healthy = devices
        .iter()
        .filter(|d| d.health == Health::Healthy)
        .count();
    assert_eq!(healthy, 2, "{devices:?}");
    assert!(devices.iter().any(|d| d.id == "lost-1"), "{devices:?}");
}

#[test]
fn mig_single_serves_mig_devices_under_gpu_with_their_caps_nodes() {
    let mut gpus =
        Harness::<NvidiaGpu>::init(mig_node("1g.10gb", false), r#"{"mig-strategy": "single"}"#)
            .unwrap();
    let ids: Vec<String> = gpus
        .enumerate("gpu")
        .unwrap()
        .into_iter()
        .map(|d| d.id)
        .collect();
    assert_eq!(ids.len(), 2, "{ids:?}");
    assert!(ids[0].starts_with("MIG-00000001"), "{ids:?}");
    let mut by_index = gpus
        .another(r#"{"mig-strategy": "single", "device-id-strategy": "index"}"#)
        .unwrap();
    let ids_by_index: Vec<String> = by_index
        .enumerate("gpu")
        .unwrap()
        .into_iter()
        .map(|d| d.id)
        .collect();
    assert_eq!(ids_by_index, ["0:0", "0:1"]);
    let edits = gpus.allocate("gpu", &[&ids[0]]).unwrap();
    let nodes: Vec<&str> = edits.devices.iter().map(|d| d.host_path.as_str()).collect();
    assert!(nodes.contains(&"/dev/nvidia0"), "{nodes:?}");
    assert!(
        nodes.contains(&"/dev/nvidia-caps/nvidia-cap12"),
        "{nodes:?}"
    );
    assert!(
        nodes.contains(&"/dev/nvidia-caps/nvidia-cap13"),
        "{nodes:?}"
    );
    let names: Vec<String> = gpus
        .enumerate("gpu")
        .unwrap()
        .into_iter()
        .filter_map(|d| d.text("name").map(str::to_owned))
        .collect();
    assert_eq!(names[0], "NVIDIA A100-SXM4-80GB MIG 1g.10gb");
    let e = Harness::<NvidiaGpu>::init(mig_node("1g.10gb", true), r#"{"mig-strategy": "single"}"#)
        .err()
        .unwrap();
    assert!(e.to_string().contains("every GPU in MIG mode"), "{e}");
    let e = Harness::<NvidiaGpu>::init(mig_node("2g.20gb", false), r#"{"mig-strategy": "single"}"#)
        .err()
        .unwrap();
    assert!(e.to_string().contains("use \"mixed\""), "{e}");
}

#[test]
fn a_mig_device_without_caps_minors_is_refused_clearly() {
    let mut a = gpu(0);
    a.mig_enabled = true;
    let mut uncapped = mig(1, "1g.10gb", [0, 0]);
    uncapped.caps_minors.clear();
    let nvml = FakeNvml::new().with_gpu(a).with_mig_device(0, uncapped);
    let mut gpus = Harness::<NvidiaGpu>::init(node(nvml), r#"{"mig-strategy": "single"}"#).unwrap();
    let id = gpus.enumerate("gpu").unwrap()[0].id.clone();
    let e = gpus.allocate("gpu", &[&id]).unwrap_err();
    assert!(e.to_string().contains("no nvidia-caps minors"), "{e}");
}

#[test]
fn mig_mixed_serves_one_resource_per_profile() {
    let gpus =
        Harness::<NvidiaGpu>::init(mig_node("2g.20gb", true), r#"{"mig-strategy": "mixed"}"#)
            .unwrap();
    let names: Vec<&str> = gpus.resources().iter().map(|r| r.name.as_str()).collect();
    assert_eq!(names, ["gpu", "mig-1g.10gb", "mig-2g.20gb"]);
    let mut gpus = gpus;
    assert_eq!(gpus.enumerate("gpu").unwrap().len(), 1);
    assert_eq!(gpus.enumerate("mig-2g.20gb").unwrap().len(), 1);
}

#[test]
fn mps_hands_over_the_pipe_directory() {
    let config =
        r#"{"mps-pipe-directory": "/run/nvidia/mps", "mps-shm-directory": "/run/nvidia/mps/shm"}"#;
    let mut gpus = Harness::<NvidiaGpu>::init(node(eight()), config).unwrap();
    let edits = gpus.allocate("gpu", &[&uuid(0)]).unwrap();
    assert!(
        edits
            .envs
            .contains(&("CUDA_MPS_PIPE_DIRECTORY".into(), "/run/nvidia/mps".into()))
    );
    assert_eq!(edits.mounts[0].host_path, "/run/nvidia/mps");
    assert!(!edits.mounts[0].read_only);
    assert_eq!(
        (
            edits.mounts[1].host_path.as_str(),
            edits.mounts[1].container_path.as_str()
        ),
        ("/run/nvidia/mps/shm", "/dev/shm")
    );
}

#[test]
fn mps_gives_each_container_its_share_and_one_gpu_only() {
    let config = r#"{"mps-pipe-directory": "/run/nvidia/mps", "mps-replicas": 4}"#;
    let mut gpus = Harness::<NvidiaGpu>::init(node(eight()), config).unwrap();
    let edits = gpus.allocate("gpu", &[&uuid(0)]).unwrap();
    let env = |key: &str| {
        edits
            .envs
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.clone())
    };
    assert_eq!(
        env("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE").as_deref(),
        Some("25")
    );
    // 80 GiB in four shares.
    assert_eq!(
        env("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT").as_deref(),
        Some("0=20480M")
    );
    let two = gpus
        .allocate("gpu", &[&uuid(0), &uuid(1)])
        .expect_err("MPS serves one share per container");
    assert!(
        format!("{two:?}").contains("one share of one GPU"),
        "{two:?}"
    );
    let same = gpus
        .allocate("gpu", &[&uuid(0), &uuid(0)])
        .expect_err("two shares of one GPU are refused too");
    assert!(format!("{same:?}").contains("not 2"), "{same:?}");
}

#[test]
fn mps_replicas_are_checked() {
    for (config, says) in [
        (r#"{"mps-replicas": 4}"#, "needs mps-pipe-directory"),
        (
            r#"{"mps-pipe-directory": "/run/nvidia/mps", "mps-replicas": 0}"#,
            "not between 1 and 48",
        ),
        (
            r#"{"mps-pipe-directory": "/run/nvidia/mps", "mps-replicas": 49}"#,
            "not between 1 and 48",
        ),
    ] {
        let error = Harness::<NvidiaGpu>::init(node(eight()), config)
            .err()
            .expect("refused");
        assert!(format!("{error:?}").contains(says), "{config}: {error:?}");
    }
}

#[test]
fn preferred_keeps_a_request_on_one_nvlink_island() {
    let mut gpus = Harness::<NvidiaGpu>::init(node(eight()), "{}").unwrap();
    let all: Vec<String> = (0..8).map(uuid).collect();
    let offered: Vec<&str> = all.iter().map(String::as_str).collect();
    let chosen = gpus.preferred("gpu", &offered, &[&all[6]], 4).unwrap();
    let mut expected: Vec<String> = (4..8).map(uuid).collect();
    let mut got = chosen.clone();
    expected.sort();
    got.sort();
    assert_eq!(got, expected);
}

#[test]
fn bad_config_is_clear_and_without_nvml_the_gpu_resource_waits_with_no_devices() {
    let e = Harness::<NvidiaGpu>::init(node(eight()), r#"{"mig-strategy": "some"}"#)
        .err()
        .unwrap();
    assert!(e.to_string().contains("invalid config"), "{e}");
    let e = Harness::<NvidiaGpu>::init(node(eight()), r#"{"quiet-period": "soon"}"#)
        .err()
        .unwrap();
    assert!(e.to_string().contains("quiet-period"), "{e}");
    // No NVML yet (a driver container still installing it): the module serves `gpu` with no
    // devices rather than failing, and lists the GPUs once NVML answers.
    let mut waiting = Harness::<NvidiaGpu>::init(FakeHost::new(), "{}").unwrap();
    let names: Vec<&str> = waiting
        .resources()
        .iter()
        .map(|r| r.name.as_str())
        .collect();
    assert_eq!(names, ["gpu"]);
    assert!(waiting.enumerate("gpu").unwrap().is_empty());
}

/// An H100's geometry as NVML gives it: 8 memory slices, 7 compute slices, and the placements
/// of `1g.10gb` (7), `3g.40gb` (2) and `7g.80gb` (1).
fn h100_layout() -> devicelet_sdk::mig::MigLayout {
    use devicelet_sdk::mig::{MigLayout, MigPlacement};
    let placement = |profile: &str, start, size, compute_slices, gib: u64| MigPlacement {
        profile: profile.into(),
        start,
        size,
        compute_slices,
        memory_bytes: gib << 30,
    };
    let mut placements: Vec<MigPlacement> =
        (0..7).map(|s| placement("1g.10gb", s, 1, 1, 10)).collect();
    placements.push(placement("3g.40gb", 0, 4, 3, 40));
    placements.push(placement("3g.40gb", 4, 4, 3, 40));
    placements.push(placement("7g.80gb", 0, 8, 7, 80));
    MigLayout {
        memory_slices: 8,
        compute_slices: 7,
        placements,
    }
}

fn claim(ids: &[&str]) -> devicelet_sdk::Request {
    devicelet_sdk::Request {
        resource_name: "gpu".into(),
        ids: ids.iter().map(|s| s.to_string()).collect(),
        config: String::new(),
        key: "uid-1/gpu".into(),
        shares: Vec::new(),
    }
}

#[test]
fn dynamic_mig_publishes_placements_on_counters_and_makes_each_instance_at_prepare() {
    let mut h100 = gpu(0);
    h100.mig_enabled = true;
    let nvml = FakeNvml::new()
        .with_gpu(h100)
        .with_gpu(gpu(1))
        .with_mig_layout(0, h100_layout());
    let host = node(nvml)
        .char_device("/dev/nvidia-caps/nvidia-cap11", 511, 11)
        .char_device("/dev/nvidia-caps/nvidia-cap12", 511, 12);
    let mut gpus = Harness::<NvidiaGpu>::init(host, r#"{"mig-strategy": "dynamic"}"#).unwrap();
    assert!(gpus.resources()[0].prepares_claims);
    let devices = gpus.enumerate("gpu").unwrap();
    // Ten placements of GPU 0, and GPU 1 whole.
    assert_eq!(devices.len(), 11);
    let large = devices
        .iter()
        .find(|d| d.id == "mig-0000-07-00-0-3g-40gb-4")
        .expect("the second 3g.40gb placement");
    assert_eq!(large.consumes[0].counter_set, "gpu-0");
    let counters: Vec<(&str, &str)> = large.consumes[0]
        .counters
        .iter()
        .map(|a| (a.name.as_str(), a.value.as_str()))
        .collect();
    assert_eq!(
        counters,
        [
            ("memory-slice-4", "1"),
            ("memory-slice-5", "1"),
            ("memory-slice-6", "1"),
            ("memory-slice-7", "1"),
            ("compute-slices", "3")
        ]
    );
    assert!(
        devices
            .iter()
            .any(|d| d.id == uuid(1) && d.consumes.is_empty())
    );
    let sets = gpus.counter_sets("gpu").unwrap();
    assert_eq!(sets.len(), 1);
    assert_eq!(sets[0].counters.len(), 9);

    // The device plugin cannot make an instance.
    let refused = gpus
        .allocate("gpu", &["mig-0000-07-00-0-1g-10gb-0"])
        .unwrap_err();
    assert!(
        format!("{refused:?}").contains("is made when"),
        "{refused:?}"
    );

    let prepared = gpus
        .prepare(&claim(&["mig-0000-07-00-0-1g-10gb-0"]))
        .unwrap();
    let made = gpus.host().mig_instances(0);
    assert_eq!(made.len(), 1);
    let status = &prepared.status[0];
    assert_eq!(status.id, "mig-0000-07-00-0-1g-10gb-0");
    let data: serde_json::Value = serde_json::from_str(&status.data).unwrap();
    let uuid = data["uuid"].as_str().unwrap();
    assert!(uuid.starts_with("MIG-"), "{data}");
    assert!(
        prepared
            .edits
            .envs
            .contains(&("NVIDIA_VISIBLE_DEVICES".to_owned(), uuid.to_owned())),
        "{:?}",
        prepared.edits.envs
    );
    // Its slice is taken: the 7g.80gb cannot be made while it lives.
    let overlapping = gpus
        .prepare(&claim(&["mig-0000-07-00-0-7g-80gb-0"]))
        .unwrap_err();
    assert!(
        format!("{overlapping:?}").contains("insufficient resources"),
        "{overlapping:?}"
    );

    gpus.unprepare(&claim(&["mig-0000-07-00-0-1g-10gb-0"]))
        .unwrap();
    assert!(gpus.host().mig_instances(0).is_empty());
    // Again, as after an agent restart: nothing to undo, and no error.
    gpus.unprepare(&claim(&["mig-0000-07-00-0-1g-10gb-0"]))
        .unwrap();
    gpus.prepare(&claim(&["mig-0000-07-00-0-7g-80gb-0"]))
        .unwrap();
}

#[test]
fn dynamic_mig_with_cdi_names_is_refused_naming_why() {
    let config = r#"{"mig-strategy": "dynamic", "visible-devices": "cdi"}"#;
    let Err(e) = Harness::<NvidiaGpu>::init(node(eight()), config) else {
        panic!("dynamic MIG with CDI names started");
    };
    assert!(
        format!("{e:?}").contains("visible-devices = \\\"envvar\\\""),
        "{e:?}"
    );
}
