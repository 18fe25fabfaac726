//! NVIDIA GPUs through Dynamic Resource Allocation's advanced model, against the simulator's
//! API server and scheduler (which allocate partitions by counters and shared devices by
//! capacity as the upstream structured allocator does): MIG with `mig-strategy = "dynamic"` on
//! a fake H100 in MIG mode (the fake NVML models profiles, placements, instance creation and
//! overlap as NVML does), and whole GPUs shared by their memory, each claim choosing its
//! sharing in its config as with NVIDIA's DRA driver.

use devicelet_simulator::DeviceRequest;
use devicelet_simulator::apiserver::Kind;
use devicelet_tests::cdi::resolve;
use devicelet_tests::dra::{DraNode, NODE, registered, wire_claim};
use devicelet_tests::{DYNAMIC_MIG, FakeGpus, h100_with_mig};

const GPU: &str = "gpu.nvidia.com";

fn profile(name: &str) -> DeviceRequest {
    DeviceRequest {
        count: 1,
        attributes: [("profile".to_owned(), name.to_owned())].into(),
        ..DeviceRequest::default()
    }
}

/// The instances the fake H100 holds, as (GI, UUID) of those with a compute instance.
fn made(gpus: &FakeGpus) -> Vec<(u64, String)> {
    gpus.instances(0)
        .iter()
        .filter(|m| m["bare"] != true)
        .map(|m| {
            let gi = m["gi"].as_u64().expect("gi");
            (gi, m["uuid"].as_str().expect("uuid").to_owned())
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mig_on_an_h100_is_allocated_by_counters_and_each_prepare_makes_its_instance() {
    let dra = DraNode::new().await;
    dra.node.add_mig_gpu();
    let gpus = FakeGpus::new(dra.node.dir.path(), &h100_with_mig());
    let library = gpus.library.clone();
    let agent = dra
        .agent_with(DYNAMIC_MIG, move |o| o.libraries.nvml = library)
        .await;
    assert!(agent.load_errors().is_empty(), "{:?}", agent.load_errors());
    registered(&dra.kubelet, 1).await;

    // The GPU's budget in a slice of its own: each memory slice once, seven compute slices.
    let (counters, devices) = devicelet_tests::dra::counters_and_devices(&dra.api).await;
    let set = &counters["spec"]["sharedCounters"][0];
    assert_eq!(set["name"], "gpu-0", "{set}");
    assert_eq!(set["counters"]["compute-slices"]["value"], "7", "{set}");
    for slice in 0..8 {
        assert_eq!(
            set["counters"][format!("memory-slice-{slice}")]["value"],
            "1",
            "{set}"
        );
    }
    // Every placement of every profile: 7 + 4 + 3 + 2 + 1 + 1.
    assert_eq!(devices.len(), 18, "{devices:?}");
    let large = devices
        .iter()
        .find(|d| d["name"] == "mig-0000-07-00-0-3g-40gb-4")
        .expect("the second 3g.40gb placement");
    let consumed = &large["consumesCounters"][0]["counters"];
    for slice in 4..8 {
        assert_eq!(consumed[format!("memory-slice-{slice}")]["value"], "1");
    }
    assert!(consumed["memory-slice-3"].is_null(), "{consumed}");
    assert_eq!(consumed["compute-slices"]["value"], "3");

    devicelet_tests::dra::pool_complete(&dra.api, 2).await;
    // One claim per profile: the scheduler places each where the others leave room, and each
    // prepare makes its instance, whose UUID the container and the claim's status get.
    let scheduler = dra.api.handle();
    let mut prepared_claims = Vec::new();
    for (name, wanted, device) in [
        ("small", "1g.10gb", "mig-0000-07-00-0-1g-10gb-0"),
        ("medium", "2g.20gb", "mig-0000-07-00-0-2g-20gb-2"),
        ("large", "3g.40gb", "mig-0000-07-00-0-3g-40gb-4"),
    ] {
        let claim = scheduler
            .allocate_claim_with("team-a", name, GPU, NODE, &profile(wanted))
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let uid = claim["metadata"]["uid"].as_str().expect("uid").to_owned();
        assert_eq!(
            claim["status"]["allocation"]["devices"]["results"][0]["device"], device,
            "{name}: {claim}"
        );
        let prepared = dra.prepare(GPU, name, &uid).await;
        assert_eq!(prepared.error, "", "{name}: {prepared:?}");
        let status = dra.device_status(name, device).await;
        let uuid = status["data"]["uuid"]
            .as_str()
            .expect("a MIG UUID")
            .to_owned();
        assert!(uuid.starts_with("MIG-"), "{status}");
        assert_eq!(status["data"]["profile"], wanted, "{status}");
        let container = resolve(
            &dra.node.dir.path().join("cdi"),
            &prepared.devices[0].cdi_device_ids,
        );
        assert_eq!(
            container.envs.get("NVIDIA_VISIBLE_DEVICES"),
            Some(&uuid),
            "{name}"
        );
        // The GPU's node and the instance's two capability nodes (its GI's and CI's).
        let gi = status["data"]["gpuInstance"]
            .as_u64()
            .expect("a GPU instance");
        for node in [
            "/dev/nvidia0".to_owned(),
            format!("/dev/nvidia-caps/nvidia-cap{}", 10 + gi * 2),
            format!("/dev/nvidia-caps/nvidia-cap{}", 11 + gi * 2),
        ] {
            assert!(
                container.nodes.iter().any(|(path, _, _)| *path == node),
                "{name}: {node} in {:?}",
                container.nodes
            );
        }
        assert!(made(&gpus).iter().any(|(_, u)| *u == uuid), "{name}");
        prepared_claims.push((name, uid, uuid));
    }
    assert_eq!(made(&gpus).len(), 3);

    // A 4g.40gb has one placement, slices 0-3, which overlaps the 1g and the 2g: the scheduler
    // leaves it unallocated; so is a second 3g.40gb (its other placement overlaps them too).
    for wanted in ["4g.40gb", "3g.40gb", "7g.80gb"] {
        let refused = scheduler
            .allocate_claim_with("team-a", "overlapping", GPU, NODE, &profile(wanted))
            .unwrap_err();
        assert!(refused.contains("cannot allocate"), "{wanted}: {refused}");
    }

    // Unprepared, each claim's instance is destroyed, and only its own.
    for (i, (name, uid, uuid)) in prepared_claims.iter().enumerate() {
        let unprepared = dra
            .kubelet
            .node_unprepare_resources(GPU, vec![wire_claim(name, uid)])
            .await
            .expect("answered");
        assert_eq!(unprepared.claims[uid].error, "", "{name}");
        let left = made(&gpus);
        assert!(!left.iter().any(|(_, u)| u == uuid), "{name}: {left:?}");
        assert_eq!(left.len(), 2 - i, "{name}: {left:?}");
    }
    assert!(gpus.instances(0).is_empty(), "{:?}", gpus.instances(0));
    agent.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_device_plugin_front_end_never_advertises_mig_placements() {
    let node = devicelet_tests::Node::new().await;
    node.add_mig_gpu();
    node.add_char("/dev/nvidia1", 195, 1);
    // Beside the H100 in MIG mode, a second GPU that is not.
    let mut fixture = h100_with_mig();
    let whole = "GPU-0c2d9e6a-0000-4000-8000-000000000001";
    let gpus_list = fixture["gpus"].as_array_mut().expect("gpus");
    gpus_list.push(serde_json::json!({
        "uuid": whole,
        "name": "NVIDIA H100 80GB HBM3",
        "minor": 1,
        "pci-bus-id": "00000000:17:00.0",
        "memory-mib": 81559,
        "numa-node": 0
    }));
    let gpus = FakeGpus::new(node.dir.path(), &fixture);
    let library = gpus.library.clone();
    let modules = DYNAMIC_MIG.replace("front-end = \"dra\"\n", "");
    let agent = node
        .start_agent_with(&modules, move |o| o.libraries.nvml = library)
        .await;
    assert!(agent.load_errors().is_empty(), "{:?}", agent.load_errors());
    // The module lists 18 placements and the whole GPU; the kubelet counts devices, not
    // counters, and would hand out overlapping placements, so it is told of the whole GPU only.
    let listed = node
        .kubelet
        .wait_until("nvidia.com/gpu", devicelet_tests::WAIT, |r| {
            !r.devices.is_empty()
        })
        .await
        .expect("registered with the whole GPU");
    let ids: Vec<&str> = listed.devices.iter().map(|d| d.id.as_str()).collect();
    assert_eq!(ids, [whole]);
    let status = agent.status();
    let served = status
        .resources
        .iter()
        .find(|r| r.name == "nvidia.com/gpu")
        .expect("the resource's status");
    assert_eq!(served.devices.len(), 19, "{:?}", served.devices);
    agent.shutdown().await;
}

/// `mig` links for every module granted `nvml`, so nvidia-gpu loads under `libraries =
/// ["nvml"]`; but without `"nvml-mig"` its calls are refused, and dynamic MIG is refused at
/// start, naming the grant, rather than serving GPUs it could not partition.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dynamic_mig_without_the_nvml_mig_grant_is_refused_naming_it() {
    let node = devicelet_tests::Node::new().await;
    node.add_mig_gpu();
    let gpus = FakeGpus::new(node.dir.path(), &h100_with_mig());
    let library = gpus.library.clone();
    let modules = DYNAMIC_MIG.replace("front-end = \"dra\"\n", "").replace(
        r#"libraries = ["nvml", "nvml-mig"]"#,
        r#"libraries = ["nvml"]"#,
    );
    let agent = node
        .start_agent_with(&modules, move |o| o.libraries.nvml = library)
        .await;
    let errors = agent.load_errors();
    assert!(
        errors.iter().any(|e| e.contains("nvidia-gpu")
            && e.contains("mig-strategy \"dynamic\"")
            && e.contains(r#"libraries = ["nvml", "nvml-mig"]"#)),
        "{errors:?}"
    );
    assert!(gpus.instances(0).is_empty());
    agent.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_claims_share_a_gpus_memory_a_fifth_is_not_allocated_and_mps_limits_each_to_its_share()
{
    let dra = DraNode::new().await;
    dra.node.add_mig_gpu();
    std::fs::create_dir_all(dra.node.tree.path("/run/nvidia/mps")).expect("the MPS directory");
    let mut fixture = h100_with_mig();
    fixture["gpus"][0]["mig"] = serde_json::json!({"enabled": false});
    let gpus = FakeGpus::new(dra.node.dir.path(), &fixture);
    let library = gpus.library.clone();
    let modules = DYNAMIC_MIG
        .replace(
            r#"libraries = ["nvml", "nvml-mig"]"#,
            "libraries = [\"nvml\"]\nmounts = [\"/run/nvidia/mps\"]",
        )
        .replace(
            r#"mig-strategy = "dynamic""#,
            "dra-memory-sharing = true\nmps-pipe-directory = \"/run/nvidia/mps\"",
        );
    let agent = dra
        .agent_with(&modules, move |o| o.libraries.nvml = library)
        .await;
    assert!(agent.load_errors().is_empty(), "{:?}", agent.load_errors());
    registered(&dra.kubelet, 1).await;
    let gpu = devicelet_tests::eventually_some("the GPU published shared", || {
        let slices = dra.api.list(Kind::ResourceSlice);
        let device = slices.first()?["spec"]["devices"].get(0)?.clone();
        (device["allowMultipleAllocations"] == true).then_some(device)
    })
    .await;
    assert_eq!(gpu["capacity"]["memory"]["value"], "81559Mi", "{gpu}");
    devicelet_tests::dra::pool_complete(&dra.api, 1).await;
    let name = gpu["name"].as_str().expect("a name").to_owned();

    // A config the module does not take fails the claim with the module's words.
    let bad = dra.claim(
        GPU,
        "bad",
        &[&name],
        serde_json::json!([{"source": "FromClaim", "requests": [],
            "opaque": {"driver": GPU, "parameters": {"sharing": {"strategy": "Spatial"}}}}]),
    );
    let refused = dra.prepare(GPU, "bad", &bad).await;
    assert!(refused.error.contains("Spatial"), "{refused:?}");
    assert!(dra.api.delete(Kind::ResourceClaim, "team-a", "bad"));

    // Four claims of 20000Mi fit its 81559Mi; the first time-slices, the second is an MPS
    // client limited to its share.
    let scheduler = dra.api.handle();
    let mps = serde_json::json!({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
        "sharing": {"strategy": "MPS"}});
    for i in 0..4 {
        let claim_name = format!("share-{i}");
        let request = DeviceRequest {
            count: 1,
            capacity: [("memory".to_owned(), "20000Mi".to_owned())].into(),
            config: (i == 1).then(|| mps.clone()),
            ..DeviceRequest::default()
        };
        let claim = scheduler
            .allocate_claim_with("team-a", &claim_name, GPU, NODE, &request)
            .unwrap_or_else(|e| panic!("{claim_name}: {e}"));
        let result = &claim["status"]["allocation"]["devices"]["results"][0];
        assert_eq!(result["device"], name.as_str(), "{claim}");
        assert_eq!(result["consumedCapacity"]["memory"], "20000Mi", "{claim}");
        let uid = claim["metadata"]["uid"].as_str().expect("uid");
        let prepared = dra.prepare(GPU, &claim_name, uid).await;
        assert_eq!(prepared.error, "", "{claim_name}: {prepared:?}");
        let container = resolve(
            &dra.node.dir.path().join("cdi"),
            &prepared.devices[0].cdi_device_ids,
        );
        let limit = container.envs.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT");
        if i == 1 {
            assert_eq!(limit.map(String::as_str), Some("0=20000M"), "{container:?}");
            // 20000 of 81559 MiB: a 24% share of the GPU's threads.
            assert_eq!(
                container
                    .envs
                    .get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
                    .map(String::as_str),
                Some("24")
            );
            assert_eq!(
                container
                    .envs
                    .get("CUDA_MPS_PIPE_DIRECTORY")
                    .map(String::as_str),
                Some("/run/nvidia/mps")
            );
            assert_eq!(
                container.envs.get("CUDA_DEVICE_ORDER").map(String::as_str),
                Some("PCI_BUS_ID")
            );
        } else {
            assert_eq!(limit, None, "{claim_name}: time-slicing sets no limit");
            // The module's mps-pipe-directory is the device plugin's; this claim is no client.
            assert_eq!(container.envs.get("CUDA_MPS_PIPE_DIRECTORY"), None);
            assert!(container.mounts.is_empty(), "{:?}", container.mounts);
        }
    }
    let fifth = DeviceRequest {
        count: 1,
        capacity: [("memory".to_owned(), "20000Mi".to_owned())].into(),
        ..DeviceRequest::default()
    };
    let refused = scheduler
        .allocate_claim_with("team-a", "fifth", GPU, NODE, &fifth)
        .unwrap_err();
    assert!(refused.contains("cannot allocate"), "{refused}");

    agent.shutdown().await;
}
