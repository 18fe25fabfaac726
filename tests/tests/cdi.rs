//! CDI: the agent writes a spec per resource, Allocate names devices per the registry's
//! `device-list-strategy`, and a container runtime resolving those names (here the CDI crate's
//! own cache, reading the spec directory) gives the container what the module answered.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use container_device_interface as cdi_crate;
use devicelet::agent::Agent;
use devicelet::agent::status::CdiStatus;
use devicelet::kubelet::api::deviceplugin::ContainerAllocateResponse;
use devicelet_simulator::Allocation;
use devicelet_tests::{Node, WAIT, eventually, eventually_some, generic_dev, misbehaving};

const SERIAL_AND_FUSE: &str = r#"groups = [
  { name = "serial", paths = ["/dev/ttyUSB*"] },
  { name = "fuse", paths = ["/dev/fuse"], count = 2 },
]"#;

/// generic-dev serving `config`, Allocate answering per `strategy` (a TOML value).
fn generic_dev_with(strategy: &str, config: &str) -> String {
    generic_dev(config).replace(
        "call-deadline = \"2s\"\n",
        &format!("call-deadline = \"2s\"\ndevice-list-strategy = {strategy}\n"),
    )
}

fn cdi_dir(node: &Node) -> PathBuf {
    node.dir.path().join("cdi")
}

async fn start(node: &Node, registry: &str) -> Agent {
    let dir = cdi_dir(node);
    node.start_agent_with(registry, move |o| o.cdi_dir = dir)
        .await
}

fn spec_path(node: &Node, resource: &str) -> PathBuf {
    cdi_dir(node).join(format!("devicelet_{}.json", resource.replace('/', "_")))
}

/// The spec file of `resource` once the agent says it names `devices` devices (Allocate names
/// devices from then on) and the kubelet has the resource, as JSON.
async fn spec_with(
    node: &Node,
    agent: &Agent,
    resource: &str,
    devices: usize,
) -> serde_json::Value {
    eventually(
        &format!("the CDI spec of {resource} with {devices} devices"),
        || {
            agent
                .status()
                .resources
                .iter()
                .find(|r| r.name == resource)
                .and_then(|r| r.cdi.as_ref())
                .is_some_and(|c| c.devices == devices)
        },
    )
    .await;
    // The spec can be written before the kubelet has the resource.
    node.kubelet
        .wait_until(resource, WAIT, |r| r.allocatable > 0)
        .await
        .expect("the resource is served");
    let text = std::fs::read(spec_path(node, resource)).expect("the spec file");
    let spec: serde_json::Value = serde_json::from_slice(&text).expect("JSON");
    assert_eq!(
        spec["devices"].as_array().map(Vec::len),
        Some(devices),
        "{spec}"
    );
    spec
}

fn cdi_status(agent: &Agent, resource: &str) -> CdiStatus {
    agent
        .status()
        .resources
        .into_iter()
        .find(|r| r.name == resource)
        .and_then(|r| r.cdi)
        .expect("CDI status")
}

/// What a container gets: env, device nodes (container path, host path, permissions), mounts
/// (container path, host path, read-only).
#[derive(Debug, Default, PartialEq, Eq)]
struct Container {
    envs: BTreeMap<String, String>,
    nodes: BTreeSet<(String, String, String)>,
    mounts: BTreeSet<(String, String, bool)>,
}

impl Container {
    /// The part of an Allocate answer that lists edits (the `devices` strategy).
    fn listed(r: &ContainerAllocateResponse) -> Container {
        Container {
            envs: r.envs.clone().into_iter().collect(),
            nodes: r
                .devices
                .iter()
                .map(|d| {
                    (
                        d.container_path.clone(),
                        d.host_path.clone(),
                        d.permissions.clone(),
                    )
                })
                .collect(),
            mounts: r
                .mounts
                .iter()
                .map(|m| (m.container_path.clone(), m.host_path.clone(), m.read_only))
                .collect(),
        }
    }

    /// Applies CDI container edits, read back as JSON (the crate keeps their fields private).
    fn apply(&mut self, edits: &cdi_crate::specs::config::ContainerEdits) {
        let edits = serde_json::to_value(edits).expect("edits serialise");
        for env in edits["env"].as_array().into_iter().flatten() {
            let (k, v) = env.as_str().unwrap().split_once('=').expect("KEY=value");
            self.envs.insert(k.into(), v.into());
        }
        for n in edits["deviceNodes"].as_array().into_iter().flatten() {
            let path = n["path"].as_str().unwrap().to_owned();
            let host = n["hostPath"].as_str().unwrap_or(&path).to_owned();
            let permissions = n["permissions"].as_str().unwrap_or_default().to_owned();
            self.nodes.insert((path, host, permissions));
        }
        for m in edits["mounts"].as_array().into_iter().flatten() {
            let options: Vec<&str> = m["options"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|o| o.as_str())
                .collect();
            self.mounts.insert((
                m["containerPath"].as_str().unwrap().into(),
                m["hostPath"].as_str().unwrap().into(),
                options.contains(&"ro"),
            ));
        }
    }
}

/// Resolves fully qualified CDI names as a runtime does: every spec in `dir` read and validated
/// (a single invalid spec fails the test), each name looked up, each spec's own edits applied
/// once, then each device's.
fn resolve(dir: &Path, names: &[String]) -> Container {
    let mut cache = cdi_crate::cache::Cache::default();
    cdi_crate::spec_dirs::with_spec_dirs(&[dir.to_str().unwrap()])(&mut cache);
    cache
        .refresh()
        .unwrap_or_else(|e| panic!("the CDI specs in {} are invalid: {e}", dir.display()));
    let mut container = Container::default();
    let mut specs_applied = BTreeSet::new();
    for name in names {
        let device = cache
            .get_device(name)
            .unwrap_or_else(|| panic!("{name} is in no spec"))
            .clone();
        let mut spec = device.get_spec();
        if specs_applied.insert(spec.get_path())
            && let Some(edits) = spec.edits()
        {
            container.apply(&edits.container_edits);
        }
        container.apply(&device.edits().container_edits);
    }
    container
}

/// Every spec in the directory is valid and declares the lowest version that covers it.
fn check_versions(dir: &Path) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let spec = cdi_crate::spec::read_spec(&path, 0)
            .unwrap_or_else(|e| panic!("{} is not a valid CDI spec: {e:#}", path.display()));
        let lowest = cdi_crate::version::minimum_required_version(&spec.cdi_spec).unwrap();
        let declared: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        assert_eq!(
            declared["cdiVersion"].as_str().unwrap(),
            lowest.to_string(),
            "{}",
            path.display()
        );
    }
}

fn cdi_names(a: &Allocation) -> Vec<String> {
    a.response
        .cdi_devices
        .iter()
        .map(|c| c.name.clone())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_strategy_at_once_names_devices_that_resolve_to_what_the_module_answered() {
    let node = Node::new().await;
    node.add_char("/dev/ttyUSB0", 188, 0);
    node.add_char("/dev/ttyUSB1", 188, 1);
    node.add_char("/dev/fuse", 10, 229);
    let strategy = r#"["devices", "cdi-cri", "cdi-annotations"]"#;
    let agent = start(&node, &generic_dev_with(strategy, SERIAL_AND_FUSE)).await;
    let serial = spec_with(&node, &agent, "devicelet.io/serial", 2).await;
    assert_eq!(serial["kind"], "devicelet.devicelet.io/serial");
    assert_eq!(serial["cdiVersion"], "0.3.0");
    // Both fuse IDs share their one node; lifting it would leave them empty, which CDI refuses.
    let fuse = spec_with(&node, &agent, "devicelet.io/fuse", 2).await;
    assert!(fuse.get("containerEdits").is_none(), "{fuse}");
    assert_eq!(
        fuse["devices"][1]["containerEdits"]["deviceNodes"][0]["path"],
        "/dev/fuse"
    );
    check_versions(&cdi_dir(&node));

    for (resource, count) in [
        ("devicelet.io/serial", 1),
        ("devicelet.io/serial", 1),
        ("devicelet.io/fuse", 2),
    ] {
        let a = node
            .kubelet
            .allocate(resource, count)
            .await
            .expect("allocate");
        let names = cdi_names(&a);
        let expected: Vec<String> = a
            .device_ids
            .iter()
            .map(|id| format!("devicelet.{resource}={id}"))
            .collect();
        assert_eq!(names, expected, "cdi_devices");
        let key = format!("cdi.k8s.io/devicelet_{}", resource.replace('/', "_"));
        let annotated = cdi_crate::annotations::parse_annotations(&HashMap::from([(
            key.clone(),
            a.response.annotations[&key].clone(),
        )]))
        .expect("the annotation parses");
        assert_eq!(
            annotated.1, expected,
            "the annotation names the same devices"
        );
        let listed = Container::listed(&a.response);
        assert!(!listed.nodes.is_empty(), "`devices` lists the nodes too");
        assert_eq!(
            resolve(&cdi_dir(&node), &names),
            listed,
            "the runtime's CDI devices give the container what the module answered"
        );
    }
    let cdi = cdi_status(&agent, "devicelet.io/serial");
    assert_eq!((cdi.devices, cdi.named, cdi.unnamed), (2, 2, 0), "{cdi:?}");
    agent.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn specs_outlive_an_agent_stop_and_go_with_their_resource() {
    let node = Node::new().await;
    node.add_char("/dev/ttyUSB0", 188, 0);
    node.add_char("/dev/fuse", 10, 229);
    let agent = start(&node, &generic_dev_with("\"cdi-cri\"", SERIAL_AND_FUSE)).await;
    spec_with(&node, &agent, "devicelet.io/serial", 1).await;
    spec_with(&node, &agent, "devicelet.io/fuse", 2).await;
    agent.shutdown().await;
    // The kubelet restarts containers from the answers it checkpointed, CDI names included,
    // without asking again: the names must still resolve while no agent runs.
    assert!(spec_path(&node, "devicelet.io/serial").exists());
    assert!(spec_path(&node, "devicelet.io/fuse").exists());

    // The next agent no longer serves serial: its spec is stale and goes at start.
    let fuse_only = r#"groups = [{ name = "fuse", paths = ["/dev/fuse"], count = 2 }]"#;
    let agent = start(&node, &generic_dev_with("\"cdi-cri\"", fuse_only)).await;
    assert!(!spec_path(&node, "devicelet.io/serial").exists());
    assert!(spec_path(&node, "devicelet.io/fuse").exists());
    spec_with(&node, &agent, "devicelet.io/fuse", 2).await;
    agent.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unwritable_cdi_dir_is_reported_and_allocate_lists_the_devices_instead() {
    let node = Node::new().await;
    node.add_char("/dev/ttyUSB0", 188, 0);
    // A regular file where the directory should be.
    std::fs::write(cdi_dir(&node), "not a directory").unwrap();
    let serial = r#"groups = [{ name = "serial", paths = ["/dev/ttyUSB*"] }]"#;
    let agent = start(&node, &generic_dev_with("\"cdi-cri\"", serial)).await;
    let error = eventually_some("the write error in status", || {
        cdi_status(&agent, "devicelet.io/serial").error
    })
    .await;
    assert!(error.contains("cannot write"), "{error}");
    node.kubelet
        .wait_until("devicelet.io/serial", WAIT, |r| r.allocatable == 1)
        .await
        .expect("served all the same");
    let a = node
        .kubelet
        .allocate("devicelet.io/serial", 1)
        .await
        .expect("allocate");
    assert!(a.response.cdi_devices.is_empty());
    assert_eq!(a.response.devices.len(), 1, "the module's answer itself");
    assert_eq!(cdi_status(&agent, "devicelet.io/serial").unnamed, 1);
    agent.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cdi_alone_names_the_devices_instead_of_listing_them() {
    let node = Node::new().await;
    node.add_char("/dev/ttyUSB0", 188, 0);
    node.add_char("/dev/fuse", 10, 229);
    let cri = generic_dev_with(
        "\"cdi-cri\"",
        r#"groups = [{ name = "serial", paths = ["/dev/ttyUSB*"] }]"#,
    );
    let annotations = generic_dev_with(
        "\"cdi-annotations\"",
        r#"groups = [{ name = "fuse", paths = ["/dev/fuse"] }]"#,
    )
    .replace("name = \"generic-dev\"", "name = \"generic-dev-2\"");
    let agent = start(&node, &format!("{cri}\n{annotations}")).await;
    spec_with(&node, &agent, "devicelet.io/serial", 1).await;
    spec_with(&node, &agent, "devicelet.io/fuse", 1).await;

    let serial = node
        .kubelet
        .allocate("devicelet.io/serial", 1)
        .await
        .expect("serial");
    assert_eq!(Container::listed(&serial.response), Container::default());
    assert!(serial.response.annotations.is_empty());
    let names = cdi_names(&serial);
    assert_eq!(names, ["devicelet.devicelet.io/serial=ttyUSB0"]);
    let container = resolve(&cdi_dir(&node), &names);
    assert_eq!(
        container.nodes,
        BTreeSet::from([("/dev/ttyUSB0".into(), "/dev/ttyUSB0".into(), "rw".into())])
    );

    let fuse = node
        .kubelet
        .allocate("devicelet.io/fuse", 1)
        .await
        .expect("fuse");
    assert!(fuse.response.cdi_devices.is_empty() && fuse.response.devices.is_empty());
    let (_, names) = cdi_crate::annotations::parse_annotations(
        &fuse.response.annotations.clone().into_iter().collect(),
    )
    .expect("a CDI annotation");
    assert_eq!(names, ["devicelet.devicelet.io/fuse=fuse"]);
    assert_eq!(
        resolve(&cdi_dir(&node), &names).nodes,
        BTreeSet::from([("/dev/fuse".into(), "/dev/fuse".into(), "rw".into())])
    );
    agent.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_for_several_devices_that_is_not_the_sum_of_theirs_is_given_as_answered() {
    let node = Node::new().await;
    // The misbehaving module answers MISBEHAVING_DEVICES=<every id, joined>: for two devices
    // that is neither device's own value, which no spec can express.
    let registry = misbehaving("gpus", "resource = \"gpu\"\ndevices = 2", "1s").replace(
        "allocate-ahead = true\n",
        "allocate-ahead = true\ndevice-list-strategy = \"cdi-cri\"\n",
    );
    let agent = start(&node, &registry).await;
    let spec = spec_with(&node, &agent, "devicelet.io/gpu", 2).await;
    assert_eq!(
        spec["devices"][0]["containerEdits"]["env"][0],
        "MISBEHAVING_DEVICES=dev-0"
    );
    check_versions(&cdi_dir(&node));

    let one = node
        .kubelet
        .allocate("devicelet.io/gpu", 1)
        .await
        .expect("one");
    assert!(one.response.envs.is_empty(), "named, not listed");
    let container = resolve(&cdi_dir(&node), &cdi_names(&one));
    assert_eq!(
        container.envs["MISBEHAVING_DEVICES"], one.device_ids[0],
        "resolves to the module's answer for that device"
    );

    node.kubelet.release(one.id);
    let two = node
        .kubelet
        .allocate("devicelet.io/gpu", 2)
        .await
        .expect("two");
    assert!(two.response.cdi_devices.is_empty(), "not named: {two:?}");
    assert_eq!(two.response.envs["MISBEHAVING_DEVICES"], "dev-0,dev-1");
    let cdi = cdi_status(&agent, "devicelet.io/gpu");
    assert_eq!((cdi.named, cdi.unnamed), (1, 1), "{cdi:?}");
    agent.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_resource_names_its_physical_devices() {
    let node = Node::new().await;
    let registry = format!(
        "{}\n[module.sharing]\nreplicas = 2\nrename = true\n",
        misbehaving("gpus", "resource = \"gpu\"\ndevices = 2", "1s").replace(
            "allocate-ahead = true\n",
            "allocate-ahead = true\ndevice-list-strategy = \"cdi-cri\"\n",
        )
    );
    let agent = start(&node, &registry).await;
    let spec = spec_with(&node, &agent, "devicelet.io/gpu.shared", 2).await;
    let names: Vec<&str> = spec["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        ["dev-0", "dev-1"],
        "one CDI device per physical device"
    );
    assert_eq!(spec["cdiVersion"], "0.6.0", "a dotted class needs 0.6.0");
    check_versions(&cdi_dir(&node));

    let a = node
        .kubelet
        .allocate("devicelet.io/gpu.shared", 1)
        .await
        .expect("a replica");
    let physical = a.device_ids[0].split("::").next().unwrap().to_owned();
    assert_eq!(
        cdi_names(&a),
        [format!("devicelet.devicelet.io/gpu.shared={physical}")]
    );
    let container = resolve(&cdi_dir(&node), &cdi_names(&a));
    assert_eq!(container.envs["MISBEHAVING_DEVICES"], physical);
    agent.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_spec_follows_the_devices_and_goes_when_cdi_is_turned_off() {
    let node = Node::new().await;
    node.add_char("/dev/ttyUSB0", 188, 0);
    node.add_char("/dev/ttyUSB1", 188, 1);
    let serial = r#"groups = [{ name = "serial", paths = ["/dev/ttyUSB*"] }]"#;
    let agent = start(&node, &generic_dev_with("\"cdi-cri\"", serial)).await;
    spec_with(&node, &agent, "devicelet.io/serial", 2).await;

    node.tree.remove("/dev/ttyUSB1").expect("unplug");
    let spec = spec_with(&node, &agent, "devicelet.io/serial", 1).await;
    assert_eq!(spec["devices"][0]["name"], "ttyUSB0");
    check_versions(&cdi_dir(&node));

    // Back to listing devices: the resource is served anew, and its spec removed.
    node.registry(&generic_dev_with("\"devices\"", serial));
    let spec = cdi_dir(&node).join("devicelet_devicelet.io_serial.json");
    eventually("the spec is removed", || !spec.exists()).await;
    // Served anew: registered a second time, on a fresh stream.
    node.kubelet
        .wait_until("devicelet.io/serial", WAIT, |r| {
            r.registrations >= 2 && r.streaming && r.allocatable == 1
        })
        .await
        .expect("served again");
    let a = node
        .kubelet
        .allocate("devicelet.io/serial", 1)
        .await
        .expect("serial");
    assert!(a.response.cdi_devices.is_empty());
    assert_eq!(a.response.devices.len(), 1);
    agent.shutdown().await;
}

/// Edits every device shares, lifted to the top, and mounts: what the reference modules do not
/// answer, checked through the CDI crate all the same.
#[test]
fn lifted_edits_and_mounts_resolve_to_each_devices_own_answer() {
    use devicelet::kubelet::api::deviceplugin::{DeviceSpec, Mount};
    let answer = |n: u32| ContainerAllocateResponse {
        envs: HashMap::from([
            ("DRIVER".to_string(), "x".to_string()),
            (format!("GPU_{n}"), n.to_string()),
        ]),
        mounts: vec![
            Mount {
                container_path: "/usr/lib/vendor".into(),
                host_path: "/opt/vendor/lib".into(),
                read_only: true,
            },
            Mount {
                container_path: format!("/var/gpu{n}"),
                host_path: format!("/run/gpu{n}"),
                read_only: false,
            },
        ],
        devices: vec![
            DeviceSpec {
                container_path: "/dev/ctl".into(),
                host_path: "/dev/ctl".into(),
                permissions: "rw".into(),
            },
            DeviceSpec {
                container_path: format!("/dev/gpu{n}"),
                host_path: format!("/dev/card{n}"),
                permissions: "rwm".into(),
            },
        ],
        ..Default::default()
    };
    let answers: BTreeMap<String, std::sync::Arc<ContainerAllocateResponse>> = (0..2)
        .map(|n| (format!("gpu{n}"), std::sync::Arc::new(answer(n))))
        .collect();
    let kind = "devicelet.a.com/gpu";
    let (spec, _) = devicelet::cdi::build(kind, &answers).expect("a spec");
    assert!(!spec.container_edits.is_empty(), "something lifted");
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("devicelet_a.com_gpu.json"),
        serde_json::to_vec_pretty(&spec).unwrap(),
    )
    .unwrap();
    check_versions(dir.path());
    for n in 0..2 {
        assert_eq!(
            resolve(dir.path(), &[format!("{kind}=gpu{n}")]),
            Container::listed(&answer(n))
        );
    }
    let both = resolve(
        dir.path(),
        &[format!("{kind}=gpu0"), format!("{kind}=gpu1")],
    );
    assert_eq!(both.nodes.len(), 3, "the shared node once: {both:?}");
    assert_eq!(both.mounts.len(), 3, "{both:?}");
    assert_eq!(both.envs.len(), 3, "{both:?}");
}
