//! The reference modules served through the DRA front end, unchanged: each publishes its
//! devices with their typed attributes, and a claim for one is prepared into a CDI spec that
//! resolves, as a runtime resolves it, to what the module answers through the device plugin.

use devicelet_simulator::DeviceRequest;
use devicelet_simulator::apiserver::Kind;
use devicelet_tests::cdi::resolve;
use devicelet_tests::dra::{DraNode, NODE, published, registered};
use devicelet_tests::{FakeGpus, workspace_root};
use serde_json::{Value, json};

/// The attribute `name` of a published device, whatever its type.
fn attribute<'a>(device: &'a Value, name: &str) -> &'a Value {
    let a = &device["attributes"][name];
    ["string", "int", "bool", "version"]
        .iter()
        .map(|k| &a[k])
        .find(|v| !v.is_null())
        .unwrap_or_else(|| panic!("no attribute {name} on {device}"))
}

/// Prepares one claim for `device` of `driver` and resolves its CDI IDs in the node's CDI
/// directory as a runtime would; unprepares it and checks its spec went.
async fn claim_and_resolve(
    dra: &DraNode,
    driver: &str,
    device: &str,
) -> devicelet_tests::cdi::Container {
    let uid = dra.claim(driver, "claim", &[device], json!([]));
    let prepared = dra.prepare(driver, "claim", &uid).await;
    assert_eq!(prepared.error, "", "{prepared:?}");
    assert_eq!(prepared.devices.len(), 1, "{prepared:?}");
    assert_eq!(prepared.devices[0].device_name, device);
    let cdi = dra.node.dir.path().join("cdi");
    let container = resolve(&cdi, &prepared.devices[0].cdi_device_ids);
    let unprepared = dra
        .kubelet
        .node_unprepare_resources(
            driver,
            vec![devicelet_tests::dra::wire_claim("claim", &uid)],
        )
        .await
        .expect("answered");
    assert_eq!(unprepared.claims[&uid].error, "");
    assert!(
        !cdi.join(format!("devicelet-dra_{driver}_{uid}.json"))
            .exists(),
        "the claim's spec goes with it"
    );
    container
}

/// The agent serving `modules` on `dra` (after `adjust`), its driver registered with the kubelet.
async fn serving(
    dra: &DraNode,
    modules: &str,
    adjust: impl FnOnce(&mut devicelet::agent::AgentOptions),
) -> devicelet::agent::Agent {
    let agent = dra.agent_with(modules, adjust).await;
    assert!(agent.load_errors().is_empty(), "{:?}", agent.load_errors());
    registered(&dra.kubelet, 1).await;
    agent
}

/// A node with a reference module's fixture tree loaded.
async fn fixture_node(fixture: &str) -> DraNode {
    let dra = DraNode::new().await;
    dra.node
        .tree
        .load(&workspace_root().join("guests").join(fixture))
        .expect("the fixture");
    dra
}

/// The one slice, once it lists `count` devices.
async fn slice_of(dra: &DraNode, count: usize) -> Value {
    devicelet_tests::eventually_some(&format!("{count} devices published"), || {
        let slices = dra
            .api
            .list(devicelet_simulator::apiserver::Kind::ResourceSlice);
        slices.into_iter().find(|s| {
            s["spec"]["devices"]
                .as_array()
                .is_some_and(|d| d.len() == count)
        })
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amd_gpus_are_published_by_pci_address_and_a_claim_gets_kfd_and_its_render_nodes() {
    let dra = fixture_node("amd-gpu/fixtures/2-gpus").await;
    let agent = serving(
        &dra,
        r#"[[module]]
name = "amd-gpu"
path = "@MODULES@/amd_gpu.wasm"
resource-domain = "amd.com"
health-interval = "100ms"
front-end = "dra"

[module.grants]
sysfs = ["/sys/bus/pci/devices/*"]
dev = ["/dev/kfd", "/dev/dri/*"]
"#,
        |_| {},
    )
    .await;
    let slice = published(&dra.api).await;
    assert_eq!(slice["spec"]["driver"], "gpu.amd.com");
    let devices = slice["spec"]["devices"].as_array().expect("devices");
    let buses: Vec<&Value> = devices
        .iter()
        .map(|d| attribute(d, "resource.kubernetes.io/pciBusID"))
        .collect();
    assert_eq!(buses, [&json!("0000:03:00.0"), &json!("0000:23:00.0")]);
    // Each under its own root complex, as the fixture's sysfs links say.
    let roots: Vec<&Value> = devices
        .iter()
        .map(|d| attribute(d, "resource.kubernetes.io/pcieRoot"))
        .collect();
    assert_eq!(roots, [&json!("pci0000:02"), &json!("pci0000:22")]);

    let device = devices[0]["name"].as_str().expect("a name");
    let container = claim_and_resolve(&dra, "gpu.amd.com", device).await;
    let hosts: Vec<&str> = container.nodes.iter().map(|(_, h, _)| h.as_str()).collect();
    assert!(hosts.contains(&"/dev/kfd"), "{hosts:?}");
    assert_eq!(
        hosts.len(),
        3,
        "kfd, the card and the render node: {hosts:?}"
    );
    agent.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nvidia_gpus_are_published_by_uuid_a_claim_gets_its_gpu_and_an_xid_taints_one() {
    let dra = DraNode::new().await;
    for (path, major, minor) in [
        ("/dev/nvidiactl", 195, 255),
        ("/dev/nvidia-uvm", 510, 0),
        ("/dev/nvidia-uvm-tools", 510, 1),
        ("/dev/nvidia0", 195, 0),
        ("/dev/nvidia1", 195, 1),
    ] {
        dra.node.add_char(path, major, minor);
    }
    let uuid = |i: u32| format!("GPU-6c4a5f2e-0000-4000-8000-00000000000{i}");
    let gpus = FakeGpus::new(
        dra.node.dir.path(),
        &json!({
            "driver-version": "550.54.15",
            "gpus": (0..2).map(|i| json!({
                "uuid": uuid(i),
                "name": "NVIDIA A100-SXM4-80GB",
                "minor": i,
                "pci-bus-id": format!("00000000:{:02X}:00.0", 0x07 + i * 0x10),
                "memory-mib": 81920,
                "numa-node": 0,
            })).collect::<Vec<_>>(),
        }),
    );
    let library = gpus.library.clone();
    let agent = serving(
        &dra,
        r#"[[module]]
name = "nvidia-gpu"
path = "@MODULES@/nvidia_gpu.wasm"
resource-domain = "nvidia.com"
health-interval = "1h"
front-end = "dra"

[module.grants]
dev = ["/dev/nvidia*", "/dev/nvidia-caps/*"]
libraries = ["nvml"]
"#,
        move |o| o.libraries.nvml = library,
    )
    .await;
    let slice = slice_of(&dra, 2).await;
    assert_eq!(slice["spec"]["driver"], "gpu.nvidia.com");
    let first = &slice["spec"]["devices"]
        .as_array()
        .expect("devices")
        .iter()
        .find(|d| *attribute(d, "uuid") == json!(uuid(0)))
        .expect("GPU 0 by its UUID")
        .clone();
    assert_eq!(*attribute(first, "name"), json!("NVIDIA A100-SXM4-80GB"));
    assert_eq!(
        *attribute(first, "resource.kubernetes.io/pciBusID"),
        json!("0000:07:00.0")
    );

    let device = first["name"].as_str().expect("a name");
    let container = claim_and_resolve(&dra, "gpu.nvidia.com", device).await;
    assert_eq!(
        container.envs.get("NVIDIA_VISIBLE_DEVICES"),
        Some(&uuid(0)),
        "{container:?}"
    );
    let hosts: Vec<&str> = container.nodes.iter().map(|(_, h, _)| h.as_str()).collect();
    assert!(
        hosts.contains(&"/dev/nvidia0") && !hosts.contains(&"/dev/nvidia1"),
        "{hosts:?}"
    );

    // An XID on GPU 1 keeps it in the slice, tainted: the scheduler gives it to no claim but
    // one that tolerates the taint, and that claim is prepared.
    gpus.inject("xid 1 79");
    let gpu1_taint = || {
        let slices = dra.api.list(Kind::ResourceSlice);
        slices
            .iter()
            .flat_map(|s| s["spec"]["devices"].as_array().cloned().unwrap_or_default())
            .find(|d| *attribute(d, "uuid") == json!(uuid(1)))
            .map(|d| d["taints"][0].clone())
            .unwrap_or_default()
    };
    devicelet_tests::eventually("GPU 1 tainted after its XID", || {
        gpu1_taint()["key"] == "devicelet.io/unhealthy"
    })
    .await;
    let taint = gpu1_taint();
    assert_eq!(taint["effect"], "NoSchedule");
    assert_eq!(taint["value"], "XID-79", "the XID in the taint's value");
    let scheduler = dra.api.handle();
    let refused = scheduler
        .allocate_claim("team-a", "plain", "gpu.nvidia.com", NODE, 1)
        .unwrap_err();
    assert!(refused.contains("1 more with taints"), "{refused}");
    let tolerating = DeviceRequest {
        count: 1,
        tolerations: vec![json!({"key": "devicelet.io/unhealthy", "operator": "Exists"})],
        ..DeviceRequest::default()
    };
    let claim = scheduler
        .allocate_claim_with("team-a", "tolerant", "gpu.nvidia.com", NODE, &tolerating)
        .expect("the tolerating claim gets GPU 1");
    let uid = claim["metadata"]["uid"].as_str().expect("uid");
    let prepared = dra.prepare("gpu.nvidia.com", "tolerant", uid).await;
    assert_eq!(prepared.error, "", "{prepared:?}");
    agent.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vfio_gpu_and_its_audio_function_are_one_dra_device_prepared_whole() {
    let dra = fixture_node("vfio-pci/fixtures/sriov-node").await;
    let agent = serving(
        &dra,
        r#"[[module]]
name = "vfio-pci-gpu"
path = "@MODULES@/vfio_pci.wasm"
resource-domain = "nvidia.com"
health-interval = "100ms"
front-end = "dra"

[module.grants]
sysfs = ["/sys/bus/pci/devices/*", "/sys/kernel/iommu_groups/*"]
dev = ["/dev/vfio/*"]

[[module.config.resources]]
name = "ga102gl"
ids = ["10de:2230", "10de:1aef"]
"#,
        |_| {},
    )
    .await;
    // Two GPUs with their audio functions: four functions, two IOMMU groups, two DRA devices.
    let slice = slice_of(&dra, 2).await;
    const DRIVER: &str = "ga102gl.nvidia.com";
    assert_eq!(slice["spec"]["driver"], DRIVER);
    // Typed attributes keep their types: the IOMMU group an int, virtualFunction a bool.
    let first = &slice["spec"]["devices"][0];
    assert!(first["attributes"]["iommuGroup"]["int"].is_i64(), "{first}");
    assert_eq!(
        first["attributes"]["virtualFunction"]["bool"], false,
        "{first}"
    );
    let device = first["name"].as_str().expect("a name");
    let container = claim_and_resolve(&dra, DRIVER, device).await;
    let listed = container
        .envs
        .get("PCIDEVICE_NVIDIA_COM_GA102GL")
        .expect("the PCI addresses");
    let functions: Vec<&str> = listed.split(',').collect();
    assert_eq!(
        functions.len(),
        2,
        "the GPU and its audio function: {listed}"
    );
    assert_eq!(
        functions[0].rsplit_once('.').map(|(slot, _)| slot),
        functions[1].rsplit_once('.').map(|(slot, _)| slot),
        "one IOMMU group: {listed}"
    );
    assert_eq!(
        container.nodes.len(),
        2,
        "the container node and one group: {:?}",
        container.nodes
    );
    agent.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_module_built_against_wit_0_1_0_serves_claims_through_dra_and_refuses_their_config() {
    let dra = DraNode::new().await;
    let agent = serving(
        &dra,
        r#"[[module]]
name = "legacy"
path = "@MODULES@/wit_0_1_0.wasm"
health-interval = "100ms"
front-end = "dra"

[module.grants]
dev = ["/dev/fuse"]
"#,
        |_| {},
    )
    .await;
    const DRIVER: &str = "legacy.devicelet.io";
    let slice = published(&dra.api).await;
    assert_eq!(slice["spec"]["driver"], DRIVER);
    assert_eq!(slice["spec"]["devices"][0]["name"], "fuse");

    let container = claim_and_resolve(&dra, DRIVER, "fuse").await;
    assert_eq!(
        container.envs.get("LEGACY_DEVICES").map(String::as_str),
        Some("fuse")
    );
    let hosts: Vec<&str> = container.nodes.iter().map(|(_, h, _)| h.as_str()).collect();
    assert_eq!(hosts, ["/dev/fuse"]);

    // A 0.1 module takes no config: a claim that carries one fails in its own entry.
    let config = json!([{
        "source": "FromClaim",
        "requests": [],
        "opaque": {"driver": DRIVER, "parameters": {"mode": "fast"}}
    }]);
    let uid = dra.claim(DRIVER, "configured", &["fuse"], config);
    let refused = dra.prepare(DRIVER, "configured", &uid).await;
    assert!(
        refused.error.contains("takes no request config"),
        "{refused:?}"
    );
    agent.shutdown().await;
}

/// A module built as SDK 0.2 built them (WIT 0.2.0, no SDK) serves through DRA in an agent
/// speaking 0.3 as it did before: its typed attribute and capacity published, a claim's config
/// passed to its `allocate`, its refusal of a bad config in the claim's own entry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_module_built_against_wit_0_2_0_serves_claims_through_dra_unchanged() {
    let dra = DraNode::new().await;
    let agent = serving(
        &dra,
        r#"[[module]]
name = "built-02"
path = "@MODULES@/wit_0_2_0.wasm"
health-interval = "100ms"
front-end = "dra"

[module.grants]
dev = ["/dev/fuse"]
"#,
        |_| {},
    )
    .await;
    const DRIVER: &str = "fuse02.devicelet.io";
    let slice = published(&dra.api).await;
    assert_eq!(slice["spec"]["driver"], DRIVER);
    let device = &slice["spec"]["devices"][0];
    assert_eq!(device["name"], "fuse");
    assert_eq!(attribute(device, "generation"), 2);
    assert_eq!(device["capacity"]["streams"]["value"], "4");
    assert!(
        device.get("allowMultipleAllocations").is_none() && device.get("taints").is_none(),
        "nothing of 0.3 on a 0.2 device: {device}"
    );

    let config = |tag: &str| {
        json!([{
            "source": "FromClaim",
            "requests": [],
            "opaque": {"driver": DRIVER, "parameters": {"tag": tag}}
        }])
    };
    let uid = dra.claim(DRIVER, "tagged", &["fuse"], config("blue"));
    let prepared = dra.prepare(DRIVER, "tagged", &uid).await;
    assert_eq!(prepared.error, "", "{prepared:?}");
    let container = resolve(
        &dra.node.dir.path().join("cdi"),
        &prepared.devices[0].cdi_device_ids,
    );
    assert_eq!(
        container.envs.get("FUSE02_TAG").map(String::as_str),
        Some("blue")
    );
    let unprepared = dra
        .kubelet
        .node_unprepare_resources(
            DRIVER,
            vec![devicelet_tests::dra::wire_claim("tagged", &uid)],
        )
        .await
        .expect("answered");
    assert_eq!(unprepared.claims[&uid].error, "");
    let uid = dra.claim(DRIVER, "bad", &["fuse"], config("no good"));
    let refused = dra.prepare(DRIVER, "bad", &uid).await;
    assert!(refused.error.contains("expected {\"tag\""), "{refused:?}");
    agent.shutdown().await;
}
