//! The VFIO passthrough reference module with the real agent and the kubelet simulator, over its
//! fixture node (`guests/vfio-pci/fixtures/sriov-node`): X710 VFs and RTX A6000 GPUs with their
//! audio functions on `vfio-pci`, decoys on other drivers and vendors.

use devicelet_simulator::SimError;
use devicelet_tests::{Node, WAIT, host_paths, served_devices, validate_registry, workspace_root};

/// A vfio-pci entry named `name` under `domain`, serving `resources` (TOML tables).
fn entry(name: &str, domain: &str, resources: &str) -> String {
    format!(
        r#"[[module]]
name = "{name}"
path = "@MODULES@/vfio_pci.wasm"
resource-domain = "{domain}"
health-interval = "100ms"

[module.grants]
sysfs = ["/sys/bus/pci/devices/*", "/sys/kernel/iommu_groups/*"]
dev = ["/dev/vfio/*"]
{resources}
"#
    )
}

/// The X710's VFs as `intel.com/x710-vf`, and the A6000s with their audio functions as
/// `nvidia.com/ga102gl` (another vendor's domain: a second entry of the same file).
fn registry() -> String {
    let vfs = entry(
        "vfio-pci",
        "intel.com",
        "[[module.config.resources]]\nname = \"x710-vf\"\nids = [\"8086:154c\"]\nvfs-only = true\n",
    );
    let gpus = entry(
        "vfio-pci-gpu",
        "nvidia.com",
        "[[module.config.resources]]\nname = \"ga102gl\"\nids = [\"10de:2230\", \"10de:1aef\"]\n",
    );
    format!("{vfs}\n{gpus}")
}

const VF: &str = "intel.com/x710-vf";
const GPU: &str = "nvidia.com/ga102gl";

async fn sriov_node() -> Node {
    let node = Node::new().await;
    node.tree
        .load(&workspace_root().join("guests/vfio-pci/fixtures/sriov-node"))
        .expect("loading the fixture");
    node
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vfs_are_passed_through_with_their_groups_and_an_unbound_one_is_unhealthy_with_why() {
    let node = sriov_node().await;
    let agent = node.start_agent(&registry()).await;
    assert!(agent.load_errors().is_empty(), "{:?}", agent.load_errors());
    let vfs = node
        .kubelet
        .wait_until(VF, WAIT, |r| r.allocatable == 3)
        .await
        .expect("the three VFs on vfio-pci");
    let ids: Vec<&str> = vfs.devices.iter().map(|d| d.id.as_str()).collect();
    assert_eq!(ids, ["0000:3b:02.0", "0000:3b:02.1", "0000:3b:02.2"]);

    let a = node.kubelet.allocate(VF, 2).await.expect("two VFs");
    let mut nodes = host_paths(&a.response);
    nodes.sort();
    assert_eq!(
        nodes.len(),
        3,
        "the container node and two groups: {nodes:?}"
    );
    assert_eq!(nodes[2], "/dev/vfio/vfio");
    let listed = a.response.envs.get("PCIDEVICE_INTEL_COM_X710-VF");
    assert_eq!(listed, Some(&a.device_ids.join(",")));
    assert_eq!(
        a.response.envs.get("PCI_RESOURCE_INTEL_COM_X710-VF"),
        listed,
        "KubeVirt's variable too"
    );

    // The operator rebinds a VF to the host driver: the kernel drops its group node.
    let real = "/sys/devices/pci0000:3a/0000:3a:00.0/0000:3b:02.2";
    node.tree.remove(&format!("{real}/driver")).expect("unbind");
    std::os::unix::fs::symlink(
        "../../../../bus/pci/drivers/iavf",
        node.tree.path(&format!("{real}/driver")),
    )
    .expect("bind to iavf");
    node.tree.remove("/dev/vfio/43").expect("group node gone");
    node.kubelet
        .wait_until(VF, WAIT, |r| {
            r.devices
                .iter()
                .any(|d| d.id == "0000:3b:02.2" && d.health == "Unhealthy")
        })
        .await
        .expect("the rebound VF is Unhealthy");
    let reason = served_devices(&agent, VF)
        .into_iter()
        .find(|d| d.id == "0000:3b:02.2")
        .and_then(|d| d.health_reason);
    assert_eq!(reason.as_deref(), Some("bound to iavf, not vfio-pci"));
    agent.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpu_goes_with_its_audio_function_and_is_never_split() {
    let node = sriov_node().await;
    let agent = node.start_agent(&registry()).await;
    let gpus = node
        .kubelet
        .wait_until(GPU, WAIT, |r| r.allocatable == 4)
        .await
        .expect("two GPUs with their audio functions");
    assert!(gpus.options.get_preferred_allocation_available);

    let a = node.kubelet.allocate(GPU, 2).await.expect("one GPU whole");
    let group = |id: &str| id.rsplit_once('.').map(|(slot, _)| slot.to_owned());
    assert_eq!(
        group(&a.device_ids[0]),
        group(&a.device_ids[1]),
        "the preferred allocation keeps the IOMMU group whole: {:?}",
        a.device_ids
    );
    let nodes: Vec<&str> = a
        .response
        .devices
        .iter()
        .map(|d| d.host_path.as_str())
        .collect();
    assert_eq!(
        nodes.len(),
        2,
        "the container node and one group: {nodes:?}"
    );
    assert!(
        a.response.envs.contains_key("PCIDEVICE_NVIDIA_COM_GA102GL"),
        "{:?}",
        a.response.envs
    );

    match node.kubelet.allocate(GPU, 1).await {
        Err(SimError::Rpc { code, message, .. }) => {
            assert_eq!(code, tonic::Code::InvalidArgument, "{message}");
        }
        other => panic!("half a group: {other:?}"),
    }
    let stats = devicelet_tests::module_status(&agent, "vfio-pci-gpu").stats;
    assert_eq!((stats.errors, stats.violations), (0, 0), "{stats:?}");
    agent.shutdown().await;
}

#[tokio::test]
async fn sharing_a_vfio_resource_is_refused_by_validate() {
    let node = sriov_node().await;
    let shared = registry().replace(
        "vfs-only = true\n",
        "vfs-only = true\n\n[module.sharing]\nreplicas = 2\n",
    );
    let (ok, text) = validate_registry(&node.registry(&shared), &[]);
    assert!(!ok, "{text}");
    assert!(text.contains("exclusive (never shared)"), "{text}");
    let (ok, text) = validate_registry(&node.registry(&registry()), &[]);
    assert!(ok, "{text}");
    assert!(text.contains("group iommu-50"), "{text}");
}

/// The deploy ConfigMap's vfio-pci entry, commented out there (its IDs are the operator's),
/// validates once uncommented, on the fixture node.
#[tokio::test]
async fn the_configmaps_commented_vfio_entry_validates() {
    let node = sriov_node().await;
    let configmap = std::fs::read_to_string(workspace_root().join("deploy/base/configmap.yaml"))
        .expect("the ConfigMap");
    let (_, tail) = configmap
        .split_once("# VFIO passthrough")
        .expect("the vfio-pci example");
    let entry: String = tail
        .lines()
        .filter_map(|l| l.trim_start().strip_prefix('#'))
        .skip_while(|l| !l.starts_with(" [[module]]"))
        .map(|l| format!("{}\n", l.strip_prefix(' ').unwrap_or(l)))
        .collect::<String>()
        .replace(
            "/opt/devicelet/modules/vfio-pci.wasm",
            "@MODULES@/vfio_pci.wasm",
        );
    assert!(entry.contains("name = \"vfio-pci\""), "{entry}");
    let (ok, text) = validate_registry(&node.registry(&entry), &[]);
    assert!(ok, "{text}");
    assert!(text.contains("resource intel.com/x710-vf"), "{text}");
    assert!(text.contains("3 devices, 3 healthy"), "{text}");
}
