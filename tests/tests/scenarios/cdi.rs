//! CDI: the agent writes a spec per resource, Allocate names devices per the registry's
//! `device-list-strategy`, and a container runtime resolving those names (here the CDI crate's
//! own cache, reading the spec directory) gives the container what the module answered.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use container_device_interface as cdi_crate;
use devicelet::agent::Agent;
use devicelet::agent::status::CdiStatus;
use devicelet::policy::sharing::physical_id;
use devicelet_simulator::Allocation;
use devicelet_tests::cdi::{Container, resolve};
use devicelet_tests::{Node, WAIT, eventually, eventually_some, generic_dev, misbehaving};

const SERIAL: &str = r#"groups = [{ name = "serial", paths = ["/dev/ttyUSB*"] }]"#;

const SERIAL_AND_FUSE: &str = r#"groups = [
  { name = "serial", paths = ["/dev/ttyUSB*"] },
  { name = "fuse", paths = ["/dev/fuse"] },
]

[module.sharing.resources.fuse]
replicas = 2"#;

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
    // Shared two ways, fuse's spec names its one physical device, which both replicas resolve
    // to (edits common to several devices are lifted to the spec: `cdi::build`'s tests).
    let fuse = spec_with(&node, &agent, "devicelet.io/fuse", 1).await;
    assert!(fuse.get("containerEdits").is_none(), "{fuse}");
    assert_eq!(fuse["devices"][0]["name"], "fuse");
    assert_eq!(
        fuse["devices"][0]["containerEdits"]["deviceNodes"][0]["path"],
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
        // Replicas are named by their physical device, each once.
        let mut expected: Vec<String> = Vec::new();
        for id in &a.device_ids {
            let name = format!("devicelet.{resource}={}", physical_id(id));
            if !expected.contains(&name) {
                expected.push(name);
            }
        }
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
    spec_with(&node, &agent, "devicelet.io/fuse", 1).await;
    agent.shutdown().await;
    // The kubelet restarts containers from the answers it checkpointed, CDI names included,
    // without asking again: the names must still resolve while no agent runs.
    assert!(spec_path(&node, "devicelet.io/serial").exists());
    assert!(spec_path(&node, "devicelet.io/fuse").exists());

    // The next agent no longer serves serial: its spec is stale and goes at start.
    let fuse_only = r#"groups = [{ name = "fuse", paths = ["/dev/fuse"] }]

[module.sharing.resources.fuse]
replicas = 2"#;
    let agent = start(&node, &generic_dev_with("\"cdi-cri\"", fuse_only)).await;
    assert!(!spec_path(&node, "devicelet.io/serial").exists());
    assert!(spec_path(&node, "devicelet.io/fuse").exists());
    spec_with(&node, &agent, "devicelet.io/fuse", 1).await;
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
    allocate_listed(&node).await;
    assert_eq!(cdi_status(&agent, "devicelet.io/serial").unnamed, 1);
    agent.shutdown().await;
}

/// One Allocate of the serial port, given the module's answer itself (its one device listed)
/// rather than named by CDI.
async fn allocate_listed(node: &Node) -> Allocation {
    let a = node
        .kubelet
        .allocate("devicelet.io/serial", 1)
        .await
        .expect("allocate");
    assert!(a.response.cdi_devices.is_empty(), "named: {a:?}");
    assert_eq!(a.response.devices.len(), 1, "the module's answer itself");
    a
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
    assert_eq!(spec["kind"], "devicelet.devicelet.io/gpu_dshared");
    assert_eq!(
        spec["cdiVersion"], "0.3.0",
        "no dot in the class: every CDI library reads it"
    );
    check_versions(&cdi_dir(&node));

    let a = node
        .kubelet
        .allocate("devicelet.io/gpu.shared", 1)
        .await
        .expect("a replica");
    let physical = a.device_ids[0].split("::").next().unwrap().to_owned();
    assert_eq!(
        cdi_names(&a),
        [format!("devicelet.devicelet.io/gpu_dshared={physical}")]
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
    use devicelet::device::{ContainerEdits, DeviceNode, Mount};
    let answer = |n: u32| ContainerEdits {
        envs: vec![
            ("DRIVER".to_string(), "x".to_string()),
            (format!("GPU_{n}"), n.to_string()),
        ],
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
            DeviceNode {
                container_path: "/dev/ctl".into(),
                host_path: "/dev/ctl".into(),
                permissions: "rw".into(),
                file: None,
            },
            DeviceNode {
                container_path: format!("/dev/gpu{n}"),
                host_path: format!("/dev/card{n}"),
                permissions: "rwm".into(),
                file: None,
            },
        ],
        ..Default::default()
    };
    let answers: BTreeMap<String, std::sync::Arc<ContainerEdits>> = (0..2)
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
    let listed =
        |e: ContainerEdits| Container::listed(&devicelet::kubelet::plugin_server::edits_to_wire(e));
    for n in 0..2 {
        assert_eq!(
            resolve(dir.path(), &[format!("{kind}=gpu{n}")]),
            listed(answer(n))
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

/// A runtime given a CRI `Device` makes the container's node as the host's is: mode, owner,
/// group (containerd's `DeviceFromPath`). A runtime given a CDI name makes it as the spec says,
/// and where the spec says nothing, as it likes: containerd 2.x gives it to the container's
/// user, podman makes it 0666. So the spec says everything, and a `runAsUser: 1000` pod gets
/// the same `0660 root:20` node either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cdi_and_devices_give_a_container_the_same_node_mode_and_owner() {
    use std::os::unix::fs::MetadataExt;
    let node = Node::new().await;
    node.add_char("/dev/ttyUSB0", 188, 0);
    let host = node.tree.path("/dev/ttyUSB0");
    std::os::unix::fs::chown(&host, Some(0), Some(20)).expect("chown");
    std::fs::set_permissions(&host, std::os::unix::fs::PermissionsExt::from_mode(0o660))
        .expect("chmod");
    let serial = r#"groups = [{ name = "serial", paths = ["/dev/ttyUSB*"] }]"#;
    let agent = start(
        &node,
        &generic_dev_with(r#"["devices", "cdi-cri"]"#, serial),
    )
    .await;
    spec_with(&node, &agent, "devicelet.io/serial", 1).await;
    let a = node
        .kubelet
        .allocate("devicelet.io/serial", 1)
        .await
        .expect("allocate");
    let names = cdi_names(&a);
    assert_eq!(names.len(), 1, "{a:?}");

    // What `devices` gives: the host node's own mode and owner, whoever the container runs as.
    let meta = std::fs::metadata(&host).expect("host node");
    let from_devices = (meta.mode() & 0o7777, Some(meta.uid()), Some(meta.gid()));
    assert_eq!(from_devices, (0o660, Some(0), Some(20)));

    // What CDI gives, applied by the CDI crate to a pod running as 1000:1000.
    let mut oci: oci_spec::runtime::Spec = serde_json::from_value(serde_json::json!({
        "ociVersion": "1.0.2",
        "process": { "user": { "uid": 1000, "gid": 1000 }, "cwd": "/" },
        "linux": {}
    }))
    .expect("an OCI spec");
    let mut cache = cdi_crate::cache::Cache::default();
    cdi_crate::spec_dirs::with_spec_dirs(&[cdi_dir(&node).to_str().unwrap()])(&mut cache);
    cache.refresh().expect("valid specs");
    cache
        .inject_devices(Some(&mut oci), names)
        .expect("the names resolve");
    let devices = oci
        .linux()
        .as_ref()
        .and_then(|l| l.devices().clone())
        .unwrap_or_default();
    let made = devices
        .iter()
        .find(|d| d.path() == std::path::Path::new("/dev/ttyUSB0"))
        .expect("the node is in the container");
    assert_eq!((made.major(), made.minor()), (188, 0));
    assert_eq!(
        (made.file_mode().unwrap_or(0o666), made.uid(), made.gid()),
        from_devices,
        "CDI gives the container what `devices` gives"
    );
    agent.shutdown().await;
}

/// The kubelet checkpoints the first answer a container gets and reuses it when the container
/// restarts; with `cdi-cri` alone, an answer without names would be a container without its
/// device for good. The module takes 300 ms per answer, so the spec is written long after the
/// first snapshot: the resource registers only once it is, naming every device advertised, and
/// the kubelet's very first Allocate names the device.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_allocate_after_registration_already_names_cdi_devices() {
    let node = Node::new().await;
    let registry = misbehaving(
        "gpus",
        "resource = \"gpu\"\ndevices = 2\nallocate = \"slow\"",
        "2s",
    )
    .replace(
        "allocate-ahead = false\n",
        "allocate-ahead = true\ndevice-list-strategy = \"cdi-cri\"\n",
    );
    let agent = start(&node, &registry).await;
    node.kubelet
        .wait_until("devicelet.io/gpu", WAIT, |r| r.allocatable == 2)
        .await
        .expect("registered");
    // By the time the kubelet has it, the spec names every device it advertises.
    let cdi = cdi_status(&agent, "devicelet.io/gpu");
    assert_eq!(
        cdi.devices, 2,
        "registered before its spec was written: {cdi:?}"
    );
    let first = node
        .kubelet
        .allocate("devicelet.io/gpu", 1)
        .await
        .expect("allocate");
    assert_eq!(
        cdi_names(&first),
        [format!(
            "devicelet.devicelet.io/gpu={}",
            first.device_ids[0]
        )],
        "{first:?}"
    );
    assert!(first.response.envs.is_empty(), "named, not listed");
    agent.shutdown().await;
}

/// A node with one serial port, served by generic-dev with `cdi-cri` alone, its spec written.
async fn serial_by_cdi() -> (Node, Agent) {
    let node = Node::new().await;
    node.add_char("/dev/ttyUSB0", 188, 0);
    let agent = start(&node, &generic_dev_with("\"cdi-cri\"", SERIAL)).await;
    spec_with(&node, &agent, "devicelet.io/serial", 1).await;
    (node, agent)
}

/// Once the serial port's devices may be named by CDI again (no error, and the agent names the
/// file on disk: the bytes can be back before it does), one Allocate of it.
async fn allocate_once_named_again(node: &Node, agent: &Agent) -> Allocation {
    eventually("devices named again", || {
        let cdi = cdi_status(agent, "devicelet.io/serial");
        cdi.error.is_none() && cdi.devices == 1
    })
    .await;
    node.kubelet
        .allocate("devicelet.io/serial", 1)
        .await
        .expect("allocate")
}

/// Someone puts a spec of our kind at our path (here: mounting the host's `/etc` writable). No
/// Allocate names the device while that file is there (it is not the one written), and the
/// writer puts ours back, counting the foreign one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spec_replaced_at_our_path_is_never_named_and_is_written_over() {
    let (node, agent) = serial_by_cdi().await;
    let path = spec_path(&node, "devicelet.io/serial");
    let ours = std::fs::read(&path).expect("our spec");
    let theirs = serde_json::json!({
        "cdiVersion": "0.3.0",
        "kind": "devicelet.devicelet.io/serial",
        "devices": [{
            "name": "ttyUSB0",
            "containerEdits": {
                "mounts": [{ "hostPath": "/etc", "containerPath": "/host-etc", "options": ["rbind", "rw"] }]
            }
        }]
    });
    let staged = cdi_dir(&node).join(".theirs");
    std::fs::write(&staged, serde_json::to_vec(&theirs).unwrap()).expect("their spec");
    std::fs::rename(&staged, &path).expect("put over ours");

    // Never named in their file: listed while it is there, or named only once ours is back
    // (the agent may put ours back before this Allocate arrives).
    let a = node
        .kubelet
        .allocate("devicelet.io/serial", 1)
        .await
        .expect("allocate");
    if a.response.cdi_devices.is_empty() {
        assert_eq!(
            a.response.devices.len(),
            1,
            "the module's answer itself: {a:?}"
        );
    } else {
        assert_eq!(
            std::fs::read(&path).expect("a spec"),
            ours,
            "named while their spec was there: {a:?}"
        );
    }
    eventually("our spec to be written back", || {
        std::fs::read(&path).is_ok_and(|now| now == ours)
    })
    .await;
    assert_eq!(cdi_status(&agent, "devicelet.io/serial").foreign, 1);
    node.kubelet.release(a.id);
    let b = allocate_once_named_again(&node, &agent).await;
    assert_eq!(
        resolve(&cdi_dir(&node), &cdi_names(&b)).nodes,
        BTreeSet::from([("/dev/ttyUSB0".into(), "/dev/ttyUSB0".into(), "rw".into())])
    );
    agent.shutdown().await;
}

/// Another file in the directory declaring our kind: runtimes would take either, or refuse both.
/// While it is there, no device is named; once it goes, they are again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn while_another_spec_declares_our_kind_no_device_is_named() {
    let (node, agent) = serial_by_cdi().await;
    let other = cdi_dir(&node).join("zz-other.yaml");
    std::fs::write(
        &other,
        "cdiVersion: 0.3.0\nkind: devicelet.devicelet.io/serial\ndevices:\n- name: ttyUSB0\n  containerEdits:\n    env: [\"X=1\"]\n",
    )
    .expect("another spec");
    let error = eventually_some("the other spec to be noticed", || {
        cdi_status(&agent, "devicelet.io/serial").error
    })
    .await;
    assert!(error.contains("zz-other.yaml"), "{error}");
    let a = node
        .kubelet
        .allocate("devicelet.io/serial", 1)
        .await
        .expect("allocate");
    assert!(a.response.cdi_devices.is_empty(), "{a:?}");
    assert_eq!(cdi_status(&agent, "devicelet.io/serial").foreign, 1);
    node.kubelet.release(a.id);
    std::fs::remove_file(&other).expect("remove it");
    let b = allocate_once_named_again(&node, &agent).await;
    assert_eq!(cdi_names(&b).len(), 1);
    agent.shutdown().await;
}

/// A CDI directory others may write to: no spec is written there (whoever can write there could
/// put theirs in its place), the resource is served all the same, and Allocate lists the
/// module's answer, as `cdi-cri` alone could not otherwise give the device.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cdi_dir_others_may_write_to_gets_no_spec_and_allocate_lists_the_devices() {
    use std::os::unix::fs::PermissionsExt;
    let node = Node::new().await;
    node.add_char("/dev/ttyUSB0", 188, 0);
    std::fs::create_dir(cdi_dir(&node)).expect("cdi dir");
    std::fs::set_permissions(cdi_dir(&node), std::fs::Permissions::from_mode(0o777))
        .expect("chmod");
    let serial = r#"groups = [{ name = "serial", paths = ["/dev/ttyUSB*"] }]"#;
    let agent = start(&node, &generic_dev_with("\"cdi-cri\"", serial)).await;
    node.kubelet
        .wait_until("devicelet.io/serial", WAIT, |r| r.allocatable == 1)
        .await
        .expect("served");
    let error = cdi_status(&agent, "devicelet.io/serial")
        .error
        .expect("the refusal in status");
    assert!(
        error.contains("not writing CDI specs") && error.contains("mode 0777"),
        "{error}"
    );
    assert!(!spec_path(&node, "devicelet.io/serial").exists());
    allocate_listed(&node).await;
    agent.shutdown().await;
}

/// A resource's strategy changed from CDI to `devices` while no agent ran: its old spec would
/// still resolve, with the old edits. The next agent removes it at start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spec_of_a_resource_no_longer_named_by_cdi_goes_at_start() {
    let (node, agent) = serial_by_cdi().await;
    agent.shutdown().await;
    let path = spec_path(&node, "devicelet.io/serial");
    assert!(path.exists(), "kept while no agent runs");
    let agent = start(&node, &generic_dev_with("\"devices\"", SERIAL)).await;
    assert!(!path.exists(), "removed at start");
    agent.shutdown().await;
}

/// A device node whose mode changes after its answer was prepared (a driver reloaded, udev
/// rules applied): the spec does not keep giving containers the old mode. Its answer is asked
/// again and the spec rewritten with the node as it is now.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_node_that_changes_is_not_named_with_its_old_mode() {
    use std::os::unix::fs::PermissionsExt;
    let node = Node::new().await;
    node.add_char("/dev/ttyUSB0", 188, 0);
    let host = node.tree.path("/dev/ttyUSB0");
    std::fs::set_permissions(&host, std::fs::Permissions::from_mode(0o660)).expect("chmod");
    let serial = r#"groups = [{ name = "serial", paths = ["/dev/ttyUSB*"] }]"#;
    let agent = start(&node, &generic_dev_with("\"cdi-cri\"", serial)).await;
    let spec = spec_with(&node, &agent, "devicelet.io/serial", 1).await;
    let mode = |spec: &serde_json::Value| {
        spec["devices"][0]["containerEdits"]["deviceNodes"][0]["fileMode"].as_u64()
    };
    assert_eq!(mode(&spec), Some(0o660));
    std::fs::set_permissions(&host, std::fs::Permissions::from_mode(0o666)).expect("chmod");
    eventually("the spec to give the node's new mode", || {
        std::fs::read(spec_path(&node, "devicelet.io/serial"))
            .ok()
            .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
            .is_some_and(|spec| mode(&spec) == Some(0o666))
    })
    .await;
    agent.shutdown().await;
}
