//! The AMD GPU reference module with the real agent and the kubelet simulator, over its fixture
//! nodes (`guests/amd-gpu/fixtures`).

use devicelet::fixture::NodeType;
use devicelet::kubelet::api::deviceplugin::Device;
use devicelet_tests::{Node, WAIT, workspace_root};

const AMD_GPU: &str = r#"[[module]]
name = "amd-gpu"
path = "@MODULES@/amd_gpu.wasm"
resource-domain = "amd.com"
health-interval = "100ms"

[module.grants]
sysfs = ["/sys/bus/pci/devices/*"]
dev = ["/dev/kfd", "/dev/dri/*"]
"#;

async fn node_with(fixture: &str) -> Node {
    let node = Node::new().await;
    node.tree
        .load(
            &workspace_root()
                .join("guests/amd-gpu/fixtures")
                .join(fixture),
        )
        .expect("loading the fixture");
    node
}

fn numa(d: &Device) -> Vec<i64> {
    d.topology
        .iter()
        .flat_map(|t| t.nodes.iter().map(|n| n.id))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gpus_register_with_their_numa_nodes_and_an_unplugged_render_node_is_unhealthy_until_back()
 {
    let node = node_with("2-gpus").await;
    let agent = node.start_agent(AMD_GPU).await;
    assert!(agent.load_errors().is_empty(), "{:?}", agent.load_errors());
    let gpu = node
        .kubelet
        .wait_until("amd.com/gpu", WAIT, |r| r.allocatable == 2)
        .await
        .expect("two GPUs");
    let seen: Vec<(&str, Vec<i64>)> = gpu
        .devices
        .iter()
        .map(|d| (d.id.as_str(), numa(d)))
        .collect();
    assert_eq!(seen, [("0000:03:00.0", vec![0]), ("0000:23:00.0", vec![1])]);

    let a = node
        .kubelet
        .allocate("amd.com/gpu", 1)
        .await
        .expect("one GPU");
    let nodes: Vec<&str> = a
        .response
        .devices
        .iter()
        .map(|d| d.host_path.as_str())
        .collect();
    assert_eq!(nodes[0], "/dev/kfd");
    assert_eq!(
        nodes.len(),
        3,
        "kfd, the card and the render node: {nodes:?}"
    );

    node.tree.remove("/dev/dri/renderD129").expect("unplug");
    let down = node
        .kubelet
        .wait_until("amd.com/gpu", WAIT, |r| {
            r.devices.iter().any(|d| d.health == "Unhealthy")
        })
        .await
        .expect("the GPU without its render node is Unhealthy");
    let sick: Vec<&str> = down
        .devices
        .iter()
        .filter(|d| d.health == "Unhealthy")
        .map(|d| d.id.as_str())
        .collect();
    assert_eq!(sick, ["0000:23:00.0"]);
    node.tree
        .add_node("/dev/dri/renderD129", NodeType::Char, 226, 129)
        .expect("plug back");
    node.kubelet
        .wait_until("amd.com/gpu", WAIT, |r| {
            r.devices.iter().all(|d| d.health == "Healthy") && r.devices.len() == 2
        })
        .await
        .expect("Healthy again");
    agent.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_of_eight_gpus_come_from_one_numa_node() {
    let node = node_with("8-gpus").await;
    let agent = node.start_agent(AMD_GPU).await;
    let gpu = node
        .kubelet
        .wait_until("amd.com/gpu", WAIT, |r| r.allocatable == 8)
        .await
        .expect("eight GPUs");
    assert!(
        gpu.options.get_preferred_allocation_available,
        "the host prefers for a module without its own preference"
    );
    let numa_of = |id: &str| {
        gpu.devices
            .iter()
            .find(|d| d.id == id)
            .map(numa)
            .unwrap_or_default()
    };
    for _ in 0..3 {
        let a = node
            .kubelet
            .allocate("amd.com/gpu", 2)
            .await
            .expect("two GPUs");
        assert!(a.preferred.is_some(), "GetPreferredAllocation was asked");
        let nodes: Vec<Vec<i64>> = a.device_ids.iter().map(|id| numa_of(id)).collect();
        assert_eq!(
            nodes[0], nodes[1],
            "one NUMA node: {:?} on {nodes:?}",
            a.device_ids
        );
    }
    agent.shutdown().await;
}
