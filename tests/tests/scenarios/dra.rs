//! The DRA front end against the kubelet simulator's DRA plugin manager and its API server
//! stand-in.

use devicelet_simulator::DeviceRequest;
use devicelet_simulator::apiserver::{ApiServer, Kind};
use devicelet_tests::dra::{
    DraNode, NODE, assert_rbac_allows, client, published, registered, slice_devices, slice_taints,
    wire_claim,
};
use k8s_openapi::api::resource::v1::{Device, ResourcePool, ResourceSlice, ResourceSliceSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde_json::json;

const DRIVER: &str = "fuse.devicelet.io";

fn slice(node: &str, devices: &[&str]) -> ResourceSlice {
    ResourceSlice {
        metadata: ObjectMeta {
            generate_name: Some(format!("{node}-gpu.example.com-")),
            ..ObjectMeta::default()
        },
        spec: ResourceSliceSpec {
            driver: "gpu.example.com".into(),
            node_name: Some(node.into()),
            pool: ResourcePool {
                name: node.into(),
                generation: 0,
                resource_slice_count: 1,
            },
            devices: Some(
                devices
                    .iter()
                    .map(|name| Device {
                        name: name.to_string(),
                        ..Device::default()
                    })
                    .collect(),
            ),
            ..ResourceSliceSpec::default()
        },
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agents_api_client_reads_claims_and_writes_slices_as_kube_does() {
    let api = ApiServer::start().await.expect("API server");
    let (_dir, client) = client(&api).await;
    api.create(Kind::Node, "", json!({"metadata": {"name": "node-a"}}))
        .expect("node");
    api.create(
        Kind::ResourceClaim,
        "team-a",
        json!({"metadata": {"name": "gpu"}, "spec": {"devices": {"requests": []}}}),
    )
    .expect("claim");

    let uid = client.node_uid("node-a").await.expect("node uid");
    assert_eq!(
        Some(uid.as_str()),
        api.get(Kind::Node, "", "node-a").expect("node")["metadata"]["uid"].as_str()
    );
    let claim = client.claim("team-a", "gpu").await.expect("claim");
    assert_eq!(claim.metadata.namespace.as_deref(), Some("team-a"));
    let missing = client.claim("team-a", "nope").await.unwrap_err();
    assert!(missing.is_not_found(), "{missing}");
    assert!(
        missing
            .to_string()
            .contains("getting ResourceClaim team-a/nope"),
        "{missing}"
    );

    let created = client
        .create_slice(&slice("node-a", &["gpu-0", "gpu-1"]))
        .await
        .expect("created");
    client
        .create_slice(&slice("node-b", &["gpu-0"]))
        .await
        .expect("created");
    let mine = client
        .slices("gpu.example.com", "node-a")
        .await
        .expect("listed");
    assert_eq!(mine.len(), 1);
    assert_eq!(mine[0].metadata.name, created.metadata.name);

    // A stale copy is a conflict; the current one replaces.
    let mut newer = created.clone();
    newer.spec.pool.generation = 1;
    client.replace_slice(&newer).await.expect("replaced");
    let stale = client.replace_slice(&created).await.unwrap_err();
    assert!(stale.is_conflict(), "{stale}");

    // Invalid at the server: its reason and field come through.
    let bad = client
        .create_slice(&slice("node-a", &["0000:3b:00.0"]))
        .await
        .unwrap_err();
    assert!(bad.to_string().contains("spec.devices[0].name"), "{bad}");

    // Deleting what is already gone is fine; a precondition on a replaced copy is a conflict.
    let conflict = client.delete_slice(&created).await.unwrap_err();
    assert!(conflict.is_conflict(), "{conflict}");
    let current = client
        .slices("gpu.example.com", "node-a")
        .await
        .expect("listed");
    client.delete_slice(&current[0]).await.expect("deleted");
    client
        .delete_slice(&current[0])
        .await
        .expect("gone is fine");
    assert!(
        client
            .slices("gpu.example.com", "node-a")
            .await
            .expect("listed")
            .is_empty()
    );

    api.down().await;
    let down = client.claim("team-a", "gpu").await.unwrap_err();
    assert!(
        matches!(down, devicelet::dra::api::ApiError::Unreachable { .. }),
        "{down}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agents_watch_of_its_slices_sees_changes_after_a_list_and_must_list_again_when_too_old()
{
    use devicelet::dra::api::WatchEvent;
    use tokio_stream::StreamExt;
    let api = ApiServer::start().await.expect("API server");
    let (_dir, client) = client(&api).await;
    let version = client
        .slices_version("gpu.example.com", "node-a")
        .await
        .expect("listed");
    let events = client
        .watch_slices("gpu.example.com", "node-a", &version)
        .await
        .expect("watching");
    tokio::pin!(events);
    let created = client
        .create_slice(&slice("node-a", &["gpu-0"]))
        .await
        .expect("created");
    // Another node's slice is not this watch's.
    client
        .create_slice(&slice("node-b", &["gpu-0"]))
        .await
        .expect("created");
    client.delete_slice(&created).await.expect("deleted");
    let mut seen = Vec::new();
    while seen.len() < 2 {
        let event = tokio::time::timeout(devicelet_tests::WAIT, events.next())
            .await
            .expect("an event in time")
            .expect("the watch goes on")
            .expect("an event");
        seen.push(match event {
            WatchEvent::Added(s) => ("added", s.spec.node_name),
            WatchEvent::Deleted(s) => ("deleted", s.spec.node_name),
            other => panic!("unexpected {other:?}"),
        });
    }
    let node_a = Some("node-a".to_owned());
    assert_eq!(seen, [("added", node_a.clone()), ("deleted", node_a)]);
    assert_eq!(api.open_watches(), 1);

    // Thousands of changes later, the first slice's version is older than the server keeps.
    let version = created
        .metadata
        .resource_version
        .clone()
        .expect("a version");
    for _ in 0..2100 {
        let made = client
            .create_slice(&slice("node-b", &["gpu-1"]))
            .await
            .expect("created");
        client.delete_slice(&made).await.expect("deleted");
    }
    let old = client
        .watch_slices("gpu.example.com", "node-a", &version)
        .await
        .expect("watching");
    tokio::pin!(old);
    let expired = tokio::time::timeout(devicelet_tests::WAIT, old.next())
        .await
        .expect("an answer in time")
        .expect("an event")
        .expect("an event");
    match expired {
        WatchEvent::Error(status) => assert_eq!(status.code, 410, "{status:?}"),
        other => panic!("expected 410 Expired, got {other:?}"),
    }

    // A server whose RBAC grants no watch refuses it by name.
    api.refuse_watches(true);
    let refused = client
        .watch_slices("gpu.example.com", "node-a", &version)
        .await
        .err()
        .expect("refused");
    assert!(
        refused.to_string().contains("cannot watch resource"),
        "{refused}"
    );
}

/// A node with two FUSE devices served through DRA, both published.
async fn two_fuses() -> (DraNode, devicelet::agent::Agent) {
    let dra = DraNode::new().await;
    dra.node.add_char("/dev/fuse1", 10, 230);
    let agent = dra
        .agent(&fuse_via("dra", r#""/dev/fuse", "/dev/fuse1""#))
        .await;
    registered(&dra.kubelet, 1).await;
    devicelet_tests::eventually("both devices published", || {
        slice_devices(&dra.api).is_some_and(|d| d.len() == 2)
    })
    .await;
    (dra, agent)
}

/// generic-dev serving `devicelet.io/fuse` from `paths` (TOML strings) through `front_end`.
fn fuse_via(front_end: &str, paths: &str) -> String {
    format!(
        r#"[[module]]
name = "generic-dev"
path = "@MODULES@/generic_dev.wasm"
health-interval = "100ms"
front-end = "{front_end}"

[module.grants]
dev = ["/dev/*"]

[module.config]
groups = [{{ name = "fuse", paths = [{paths}] }}]
"#
    )
}

fn fuse_dra() -> String {
    fuse_via("dra", r#""/dev/fuse""#)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_module_served_through_dra_registers_publishes_and_prepares_claims() {
    let dra = DraNode::new().await;
    let agent = dra.agent(&fuse_dra()).await;
    assert!(agent.load_errors().is_empty(), "{:?}", agent.load_errors());

    // Registered through the plugin watcher as a DRAPlugin, v1 chosen.
    registered(&dra.kubelet, 1).await;
    let drivers = dra.kubelet.dra_registrations();
    assert_eq!(drivers.len(), 1, "{drivers:?}");
    assert_eq!(drivers[0].driver, DRIVER);
    assert_eq!(drivers[0].service, devicelet_simulator::DraService::V1);

    // The pool is published: one slice on this node, owned by the Node.
    let slice = &published(&dra.api).await;
    assert_eq!(slice["spec"]["driver"], DRIVER);
    assert_eq!(slice["spec"]["nodeName"], NODE);
    assert_eq!(slice["spec"]["pool"]["name"], NODE);
    assert_eq!(slice["metadata"]["ownerReferences"][0]["kind"], "Node");
    let device = slice["spec"]["devices"][0]["name"]
        .as_str()
        .expect("a device")
        .to_string();

    // A claim for it is prepared: a CDI spec for the claim, its device named by the claim's UID.
    let uid = dra.claim(DRIVER, "fuse-claim", &[&device], json!([]));
    let prepared = &dra.prepare(DRIVER, "fuse-claim", &uid).await;
    assert_eq!(prepared.error, "", "{prepared:?}");
    assert_eq!(prepared.devices.len(), 1);
    assert_eq!(prepared.devices[0].device_name, device);
    assert_eq!(prepared.devices[0].pool_name, NODE);
    let cdi_id = prepared.devices[0].cdi_device_ids[0].clone();
    assert_eq!(cdi_id, format!("k8s.{DRIVER}/fuse={uid}-fuse"));
    // The claim's status names the device: the module's ID for it, its CDI device, Ready.
    let entries = || {
        let claim = dra.api.get(Kind::ResourceClaim, "team-a", "fuse-claim");
        let devices = claim.map(|c| c["status"]["devices"].clone());
        devices
            .and_then(|d| d.as_array().cloned())
            .unwrap_or_default()
    };
    devicelet_tests::eventually("the claim's status.devices written", || {
        entries().len() == 1
    })
    .await;
    let entry = &entries()[0];
    assert_eq!(
        (&entry["driver"], &entry["pool"], &entry["device"]),
        (&json!(DRIVER), &json!(NODE), &json!(device))
    );
    assert_eq!(entry["data"]["deviceIDs"], json!(["fuse"]), "{entry}");
    assert_eq!(entry["data"]["cdiDeviceIDs"], json!([cdi_id]));
    assert_eq!(entry["conditions"][0]["type"], "Ready");
    assert_eq!(entry["conditions"][0]["status"], "True");
    let spec_file = dra
        .node
        .dir
        .path()
        .join("cdi")
        .join(format!("devicelet-dra_{DRIVER}_{uid}.json"));
    let spec: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&spec_file).expect("the claim's spec"))
            .expect("json");
    assert_eq!(spec["kind"], format!("k8s.{DRIVER}/fuse"));
    assert_eq!(spec["devices"][0]["name"], format!("{uid}-fuse"));
    let nodes = spec["devices"][0]["containerEdits"]["deviceNodes"].to_string();
    assert!(nodes.contains("/dev/fuse"), "{spec}");

    // Asked again (a kubelet restart), the same answer, and the module is not asked again.
    let calls = devicelet_tests::module_status(&agent, "generic-dev")
        .stats
        .allocate_calls;
    let again = dra.prepare(DRIVER, "fuse-claim", &uid).await;
    assert_eq!(again, *prepared);
    assert_eq!(
        devicelet_tests::module_status(&agent, "generic-dev")
            .stats
            .allocate_calls,
        calls
    );
    // Its spec gone (CDI specs live on tmpfs: a reboot), the claim is prepared again.
    std::fs::remove_file(&spec_file).expect("removing the spec");
    let after_reboot = dra.prepare(DRIVER, "fuse-claim", &uid).await;
    assert_eq!(after_reboot, *prepared);
    assert!(spec_file.exists(), "the claim's spec is written again");
    let status = agent.status();
    assert_eq!(status.dra_drivers.len(), 1);
    assert_eq!(status.dra_drivers[0].prepared_claims, 1);
    assert!(status.dra_drivers[0].registered);

    // Unprepared after an agent restart, from the checkpoint alone.
    agent.shutdown().await;
    let agent = dra.agent(&fuse_dra()).await;
    registered(&dra.kubelet, 2).await;
    let unprepared = dra
        .kubelet
        .node_unprepare_resources(DRIVER, vec![wire_claim("fuse-claim", &uid)])
        .await
        .expect("answered");
    assert_eq!(unprepared.claims[&uid].error, "");
    assert!(!spec_file.exists(), "the claim's spec is removed");
    assert_eq!(agent.status().dra_drivers[0].prepared_claims, 0);
    devicelet_tests::eventually("the claim's status.devices removed", || {
        entries().is_empty()
    })
    .await;
    // An unknown UID is fine (idempotent).
    let unknown = dra
        .kubelet
        .node_unprepare_resources(DRIVER, vec![wire_claim("gone", "no-such-uid")])
        .await
        .expect("answered");
    assert_eq!(unknown.claims["no-such-uid"].error, "");
    agent.shutdown().await;
    assert_rbac_allows(&dra.api);
    assert_eq!(
        dra.api.user_agents(),
        [format!("devicelet/{}", env!("CARGO_PKG_VERSION"))].into(),
        "every request names devicelet and its version"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_for_another_node_or_replaced_fails_alone_in_its_own_entry() {
    let dra = DraNode::new().await;
    let agent = dra.agent(&fuse_dra()).await;
    registered(&dra.kubelet, 1).await;
    let slice = published(&dra.api).await;
    let device = slice["spec"]["devices"][0]["name"]
        .as_str()
        .expect("device")
        .to_string();
    let good = dra.claim(DRIVER, "good", &[&device], json!([]));
    // Another node's pool.
    let foreign = {
        let created = dra
            .api
            .create(
                Kind::ResourceClaim,
                "team-a",
                json!({
                    "metadata": {"name": "foreign"},
                    "spec": {"devices": {"requests": []}},
                    "status": {"allocation": {"devices": {"results": [
                        {"request": "fuse", "driver": DRIVER, "pool": "node-b", "device": device}
                    ]}}}
                }),
            )
            .expect("claim");
        created["metadata"]["uid"]
            .as_str()
            .expect("uid")
            .to_string()
    };
    let unknown = dra.claim(DRIVER, "unknown-device", &["no-such-device"], json!([]));
    let second = dra.claim(DRIVER, "second", &[&device], json!([]));
    // Only another driver's devices: not ours to prepare.
    let others = dra.claim("gpu.example.com", "others", &[&device], json!([]));
    let answer = dra
        .kubelet
        .node_prepare_resources(
            DRIVER,
            vec![
                wire_claim("good", &good),
                wire_claim("foreign", &foreign),
                wire_claim("good", "a-stale-uid"),
                wire_claim("unknown-device", &unknown),
                wire_claim("second", &second),
                wire_claim("others", &others),
            ],
        )
        .await
        .expect("answered");
    assert_eq!(answer.claims.len(), 6);
    assert!(
        answer.claims[&others]
            .error
            .contains("has no devices of driver fuse.devicelet.io"),
        "{:?}",
        answer.claims[&others]
    );
    // The claims of one call are prepared concurrently: of the two naming one device, either
    // may win; the other names it.
    let (won, lost, winner) = match answer.claims[&good].error.is_empty() {
        true => (&answer.claims[&good], &answer.claims[&second], "good"),
        false => (&answer.claims[&second], &answer.claims[&good], "second"),
    };
    assert_eq!(won.error, "", "{won:?}");
    assert!(
        lost.error.contains(&format!(
            "is already prepared for ResourceClaim team-a/{winner}"
        )),
        "{lost:?}"
    );
    assert!(
        answer.claims[&foreign]
            .error
            .contains("is in pool \"node-b\", not this node's pool \"node-a\""),
        "{:?}",
        answer.claims[&foreign]
    );
    assert!(answer.claims["a-stale-uid"].error.contains("got replaced"));
    assert!(
        answer.claims[&unknown]
            .error
            .contains("\"no-such-device\" is not one this driver publishes")
    );
    assert_eq!(agent.status().dra_drivers[0].prepared_claims, 1);
    agent.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slices_wiped_by_a_starting_kubelet_are_published_again() {
    let dra = DraNode::new().await;
    let agent = dra.agent(&fuse_dra()).await;
    let first = published(&dra.api).await;
    // A restarting kubelet wipes every slice of its node at once.
    dra.kubelet.restart().await.expect("kubelet restart");
    let again = published(&dra.api).await;
    assert_ne!(again["metadata"]["name"], first["metadata"]["name"]);
    assert!(
        again["spec"]["pool"]["generation"].as_i64() > first["spec"]["pool"]["generation"].as_i64(),
        "the pool's generation moves on: {} then {}",
        first["spec"]["pool"]["generation"],
        again["spec"]["pool"]["generation"]
    );
    // The restarted kubelet's watcher found the driver again.
    devicelet_tests::eventually("the driver registered with the new kubelet", || {
        dra.kubelet.dra_registrations().len() == 1
    })
    .await;
    agent.shutdown().await;

    // The agent stopped for longer than the kubelet's wipe delay: its slices are wiped, and
    // published again when it comes back.
    devicelet_tests::eventually("the stopped driver's slices wiped", || {
        dra.api.list(Kind::ResourceSlice).is_empty()
    })
    .await;
    let agent = dra.agent(&fuse_dra()).await;
    published(&dra.api).await;
    agent.shutdown().await;
}

/// Whenever the kubelet wipes the node's slices (its start may reach the API server long after
/// the driver registered), or someone deletes them: the agent watches its own slices and puts
/// the pool back at once, not at the next resync.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slices_deleted_long_after_registration_are_back_through_the_watch_not_the_resync() {
    let dra = DraNode::new().await;
    let agent = dra
        .agent_with(&fuse_dra(), |o| {
            if let Some(dra) = o.dra.as_mut() {
                // Longer than the test waits: only the watch can bring the pool back.
                dra.resync = std::time::Duration::from_secs(3600);
            }
        })
        .await;
    published(&dra.api).await;
    devicelet_tests::eventually("the agent watching its slices", || {
        dra.api.open_watches() == 1
    })
    .await;
    for wipe in 0..3 {
        let before = dra
            .api
            .list(Kind::ResourceSlice)
            .first()
            .map(|s| s["metadata"]["name"].clone());
        let wiped = std::time::Instant::now();
        assert_eq!(dra.api.handle().wipe_slices(NODE, None), 1);
        let again = published(&dra.api).await;
        eprintln!("wipe {wipe}: the pool was back after {:?}", wiped.elapsed());
        assert_ne!(Some(again["metadata"]["name"].clone()), before);
    }
    agent.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_schedulers_claims_are_prepared_and_no_device_is_allocated_twice() {
    let (dra, agent) = two_fuses().await;
    let scheduler = dra.api.handle();
    let mut devices = Vec::new();
    for name in ["first", "second"] {
        let claim = scheduler
            .allocate_claim("team-a", name, DRIVER, NODE, 1)
            .expect("allocated");
        let uid = claim["metadata"]["uid"].as_str().expect("uid").to_string();
        let prepared = dra.prepare(DRIVER, name, &uid).await;
        assert_eq!(prepared.error, "", "{prepared:?}");
        devices.push(prepared.devices[0].device_name.clone());
    }
    assert_ne!(devices[0], devices[1], "two claims, two devices");
    let none = scheduler
        .allocate_claim("team-a", "third", DRIVER, NODE, 1)
        .unwrap_err();
    assert!(none.contains("0 free"), "{none}");
    agent.shutdown().await;
}

const FLAKY: &str = r#"[[module]]
name = "flaky"
path = "@MODULES@/misbehaving.wasm"
health-interval = "100ms"
front-end = "dra"

[module.grants]
sysfs = ["/sys/testing"]

[module.config]
resource = "bad"
switch = "/sys/testing/switch"
"#;
const BAD: &str = "bad.devicelet.io";

fn health_is(want: &'static str) -> impl Fn(&[devicelet_simulator::DraDeviceHealth]) -> bool {
    move |h| h.len() == 2 && h.iter().all(|d| d.health == want && d.pool == NODE)
}

/// An agent serving the flaky module's two devices through DRA, healthy.
async fn flaky(dra: &DraNode) -> devicelet::agent::Agent {
    dra.node
        .tree
        .write_file("/sys/testing/switch", "ok")
        .expect("switch");
    let agent = dra.agent(FLAKY).await;
    assert!(agent.load_errors().is_empty(), "{:?}", agent.load_errors());
    agent
}

/// Turns the flaky module's devices healthy (`ok`) or not (`unhealthy`); returns once the
/// kubelet's health stream says so.
async fn turn(dra: &DraNode, switch: &str) {
    dra.node
        .tree
        .write_file("/sys/testing/switch", switch)
        .expect("switch");
    let want = if switch == "ok" {
        "Healthy"
    } else {
        "Unhealthy"
    };
    dra.kubelet
        .wait_dra_health(BAD, devicelet_tests::WAIT, health_is(want))
        .await
        .expect("the devices' health on the stream");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unhealthy_device_stays_in_its_slice_tainted_and_only_a_tolerating_claim_gets_it() {
    let dra = DraNode::new().await;
    let agent = flaky(&dra).await;
    let untainted =
        |d: &[(String, Vec<String>)]| d.len() == 2 && d.iter().all(|(_, t)| t.is_empty());
    devicelet_tests::eventually("both devices published untainted", || {
        slice_taints(&dra.api).is_some_and(|d| untainted(&d))
    })
    .await;

    turn(&dra, "unhealthy").await;
    devicelet_tests::eventually("both devices still published, tainted", || {
        slice_taints(&dra.api).is_some_and(|d| {
            d.len() == 2
                && d.iter()
                    .all(|(_, t)| t == &["devicelet.io/unhealthy:NoSchedule".to_owned()])
        })
    })
    .await;
    let taint = &dra.api.list(Kind::ResourceSlice)[0]["spec"]["devices"][0]["taints"][0];
    assert!(taint["timeAdded"].is_string(), "{taint}");
    assert!(taint["value"].is_string(), "the module's reason: {taint}");

    // The scheduler leaves tainted devices to claims that tolerate the taint.
    let scheduler = dra.api.handle();
    let refused = scheduler
        .allocate_claim("team-a", "plain", BAD, NODE, 1)
        .unwrap_err();
    assert!(refused.contains("2 more with taints"), "{refused}");
    let tolerating = DeviceRequest {
        count: 1,
        tolerations: vec![json!({"key": "devicelet.io/unhealthy", "operator": "Exists"})],
        ..DeviceRequest::default()
    };
    let claim = scheduler
        .allocate_claim_with("team-a", "tolerant", BAD, NODE, &tolerating)
        .expect("a tolerating claim gets a tainted device");
    let uid = claim["metadata"]["uid"].as_str().expect("uid").to_string();
    let prepared = dra.prepare(BAD, "tolerant", &uid).await;
    assert_eq!(prepared.error, "", "{prepared:?}");
    assert_eq!(prepared.devices.len(), 1);
    // `devicelet status` lists each device: unhealthy, why, and the claim holding it.
    let states = agent.status().dra_drivers[0].device_states.clone();
    assert_eq!(states.len(), 2, "{states:?}");
    assert!(
        states.iter().all(|d| !d.healthy && d.reason.is_some()),
        "{states:?}"
    );
    let held: Vec<_> = states.iter().filter(|d| !d.holders.is_empty()).collect();
    assert_eq!(held.len(), 1, "{states:?}");
    assert_eq!(held[0].name, prepared.devices[0].device_name);
    assert_eq!(held[0].holders, [format!("team-a/tolerant (claim {uid})")]);
    // A claim allocated the sick device without a toleration (a scheduler that ignores
    // taints) is refused, naming the taint.
    let sick = prepared.devices[0].device_name.as_str();
    let stray_uid = dra.claim(BAD, "stray", &[sick], json!([]));
    let refused = dra.prepare(BAD, "stray", &stray_uid).await;
    assert!(
        refused.error.contains("is unhealthy") && refused.error.contains("devicelet.io/unhealthy"),
        "{refused:?}"
    );

    turn(&dra, "ok").await;
    devicelet_tests::eventually("the taints gone", || {
        slice_taints(&dra.api).is_some_and(|d| untainted(&d))
    })
    .await;
    agent.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_an_api_server_that_drops_taints_an_unhealthy_device_leaves_the_slice_instead() {
    let dra = DraNode::new().await;
    dra.api.drop_device_taints();
    let agent = flaky(&dra).await;
    let devices = |n: usize| move |d: Vec<(String, Vec<String>)>| d.len() == n;
    devicelet_tests::eventually("both devices published", || {
        slice_taints(&dra.api).is_some_and(devices(2))
    })
    .await;
    let dropped = |agent: &devicelet::agent::Agent| agent.status().dra_drivers[0].taints_dropped;
    assert!(!dropped(&agent), "nothing tainted yet");

    turn(&dra, "unhealthy").await;
    devicelet_tests::eventually("unhealthy devices out of the slice", || {
        slice_taints(&dra.api).is_some_and(devices(0))
    })
    .await;
    assert!(dropped(&agent), "devicelet status says why");

    turn(&dra, "ok").await;
    devicelet_tests::eventually("both devices back", || {
        slice_taints(&dra.api).is_some_and(devices(2))
    })
    .await;
    agent.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resource_moved_from_the_device_plugin_to_dra_never_hands_a_held_device_out_twice() {
    let dra = DraNode::new().await;
    dra.node.add_char("/dev/fuse1", 10, 230);
    let modules = |front_end: &str| fuse_via(front_end, r#""/dev/fuse", "/dev/fuse1""#);
    // This node's kubelet serves both APIs: the agent registers its device plugin with it and
    // reconciles its ledger with its PodResources.
    let (plugin_dir, pod_resources) = (
        dra.kubelet.plugin_dir().to_owned(),
        dra.kubelet.pod_resources_socket().to_owned(),
    );
    let agent = dra
        .agent_with(&modules("device-plugin"), move |o| {
            o.plugin_dir = plugin_dir;
            o.pod_resources = Some(pod_resources);
            o.reconcile_interval = std::time::Duration::from_millis(100);
            o.reconcile_grace = std::time::Duration::from_secs(5);
            o.metrics_addr = Some(([127, 0, 0, 1], 0).into());
        })
        .await;
    assert!(agent.load_errors().is_empty(), "{:?}", agent.load_errors());
    dra.kubelet
        .wait_until("devicelet.io/fuse", devicelet_tests::WAIT, |r| {
            r.allocatable == 2
        })
        .await
        .expect("the device plugin serves both devices");
    let pod = devicelet_simulator::PodRef::new("team-a", "trainer", "main");
    let held = dra
        .kubelet
        .allocate_for(&pod, "devicelet.io/fuse", 1)
        .await
        .expect("a container gets one device");
    let held_name = devicelet::dra::names::device_name(&held.device_ids[0]);
    devicelet_tests::eventually("the ledger sees the container holding it", || {
        agent
            .ledger()
            .holders("devicelet.io/fuse")
            .iter()
            .any(|(_, holder)| holder.is_some())
    })
    .await;

    // The operator moves the resource to DRA while the container runs.
    dra.node.registry(&modules("dra"));
    registered(&dra.kubelet, 1).await;
    let published = devicelet_tests::eventually_some("the free device published", || {
        slice_devices(&dra.api).filter(|d| d.len() == 1)
    })
    .await;
    assert!(
        !published.contains(&held_name),
        "the held device stays out of the pool: {published:?}"
    );
    // A claim for it anyway (a stale allocation) is refused, saying why.
    let uid = dra.claim(DRIVER, "early", &[&held_name], json!([]));
    let answer = dra.prepare(DRIVER, "early", &uid).await;
    assert!(
        answer
            .error
            .contains("still held by a container the device-plugin front end allocated it to"),
        "{answer:?}"
    );

    // The container ends: its device joins the pool and can be claimed.
    dra.kubelet.terminate_pod("team-a", "trainer");
    devicelet_tests::eventually("both devices published", || {
        slice_devices(&dra.api).is_some_and(|d| d.len() == 2 && d.contains(&held_name))
    })
    .await;
    let answer = dra.prepare(DRIVER, "early", &uid).await;
    assert_eq!(answer.error, "", "{answer:?}");

    // Metrics: the refused and the prepared claim, the slices written, the driver's figures.
    let samples = devicelet_tests::scrape(agent.metrics_addr().expect("metrics")).await;
    let figure = |name: &str, labels: &[(&str, &str)]| {
        devicelet_tests::metric(&samples, name, labels)
            .unwrap_or_else(|| panic!("{name} {labels:?} is exported"))
    };
    for result in ["ok", "error"] {
        let labels = [("driver", DRIVER), ("result", result)];
        assert_eq!(
            figure("devicelet_dra_prepare_duration_seconds_count", &labels),
            1.0,
            "{result}"
        );
    }
    assert!(figure("devicelet_dra_slice_writes_total", &[("driver", DRIVER)]) >= 2.0);
    let labels = [("driver", DRIVER), ("module", "generic-dev")];
    assert_eq!(figure("devicelet_dra_driver_registered", &labels), 1.0);
    assert_eq!(figure("devicelet_dra_devices_published", &labels), 2.0);
    assert_eq!(figure("devicelet_dra_claims_prepared", &labels), 1.0);
    assert!(figure("devicelet_dra_pool_generation", &labels) >= 2.0);
    agent.shutdown().await;
    assert_rbac_allows(&dra.api);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_server_down_for_a_while_stalls_neither_the_device_plugin_nor_the_kubelet() {
    let dra = DraNode::new().await;
    dra.node.add_char("/dev/net/tun", 10, 200);
    // FUSE through DRA, TUN through the device plugin, in one agent.
    let modules = format!(
        "{}\n{}",
        fuse_via("dra", r#""/dev/fuse", "/dev/fuse1""#),
        devicelet_tests::generic_dev(r#"groups = [{ name = "tun", paths = ["/dev/net/tun"] }]"#)
            .replacen("name = \"generic-dev\"", "name = \"generic-tun\"", 1)
    );
    let plugin_dir = dra.kubelet.plugin_dir().to_owned();
    let agent = dra
        .agent_with(&modules, move |o| {
            o.plugin_dir = plugin_dir;
            o.metrics_addr = Some(([127, 0, 0, 1], 0).into());
        })
        .await;
    assert!(agent.load_errors().is_empty(), "{:?}", agent.load_errors());
    registered(&dra.kubelet, 1).await;
    let device = published(&dra.api).await["spec"]["devices"][0]["name"]
        .as_str()
        .expect("a device")
        .to_string();
    let uid = dra.claim(DRIVER, "while-down", &[&device], json!([]));

    dra.api.down().await;
    // A device arrives: its slice cannot be written, and the publisher keeps trying.
    dra.node.add_char("/dev/fuse1", 10, 230);
    devicelet_tests::eventually("the API error in status", || {
        agent.status().dra_drivers[0].api_error.is_some()
    })
    .await;
    // The kubelet's prepare gets the error in the claim's own entry, at once.
    let answer = dra.prepare(DRIVER, "while-down", &uid).await;
    assert!(
        answer
            .error
            .contains("getting ResourceClaim team-a/while-down"),
        "{answer:?}"
    );
    // The device-plugin resource allocates meanwhile.
    dra.kubelet
        .wait_until("devicelet.io/tun", devicelet_tests::WAIT, |r| {
            r.allocatable == 1
        })
        .await
        .expect("tun registered");
    let tun = dra
        .kubelet
        .allocate("devicelet.io/tun", 1)
        .await
        .expect("TUN allocated while the API server is down");
    assert_eq!(tun.device_ids.len(), 1);
    let samples = devicelet_tests::scrape(agent.metrics_addr().expect("metrics")).await;
    assert!(
        devicelet_tests::metric(
            &samples,
            "devicelet_dra_api_errors_total",
            &[("driver", DRIVER)]
        )
        .is_some_and(|n| n >= 2.0),
        "the publisher's and the claim's errors are counted"
    );

    // Back up: the new device is published and the claim prepared.
    dra.api.up().await.expect("the API server back");
    devicelet_tests::eventually("both devices published", || {
        slice_devices(&dra.api).is_some_and(|d| d.len() == 2)
    })
    .await;
    let answer = dra.prepare(DRIVER, "while-down", &uid).await;
    assert_eq!(answer.error, "", "{answer:?}");
    // Cleared once the publisher's sync ends, which may be after its slice write is seen.
    devicelet_tests::eventually("the API error cleared", || {
        agent.status().dra_drivers[0].api_error.is_none()
    })
    .await;
    agent.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_claims_in_one_call_get_an_answer_each_and_only_the_first_are_tried() {
    let dra = DraNode::new().await;
    let agent = dra.agent(&fuse_dra()).await;
    registered(&dra.kubelet, 1).await;
    let device = published(&dra.api).await["spec"]["devices"][0]["name"]
        .as_str()
        .expect("a device")
        .to_string();
    let uid = dra.claim(DRIVER, "real", &[&device], json!([]));
    let mut claims = vec![wire_claim("real", &uid)];
    claims.extend((1..10_000).map(|i| wire_claim(&format!("flood-{i}"), &format!("uid-{i}"))));
    let gets_before = dra.api.requests().len();

    let answer = dra
        .kubelet
        .node_prepare_resources(DRIVER, claims)
        .await
        .expect("answered within the kubelet's deadline");
    assert_eq!(answer.claims.len(), 10_000, "an entry for every claim");
    assert_eq!(answer.claims[&uid].error, "", "{:?}", answer.claims[&uid]);
    let max = devicelet::dra::prepare::MAX_CLAIMS_PER_CALL;
    let untried = answer
        .claims
        .values()
        .filter(|c| c.error.contains("claims in one call"))
        .count();
    assert_eq!(untried, 10_000 - max);
    // Only the claims it tried were read from the API server.
    let reads = dra.api.requests()[gets_before..]
        .iter()
        .filter(|(verb, kind)| verb == "get" && *kind == Kind::ResourceClaim)
        .count();
    assert_eq!(reads, max);
    assert_eq!(agent.status().dra_drivers[0].prepared_claims, 1);

    // The driver still answers at once.
    let again = dra.prepare(DRIVER, "real", &uid).await;
    assert_eq!(again.error, "");

    // So for unprepare: the first claims are tried (the real one among them), the rest refused.
    let mut claims = vec![wire_claim("real", &uid)];
    claims.extend((1..10_000).map(|i| wire_claim(&format!("flood-{i}"), &format!("uid-{i}"))));
    let answer = dra
        .kubelet
        .node_unprepare_resources(DRIVER, claims)
        .await
        .expect("answered within the kubelet's deadline");
    assert_eq!(answer.claims.len(), 10_000, "an entry for every claim");
    assert_eq!(answer.claims[&uid].error, "", "{:?}", answer.claims[&uid]);
    let untried = answer
        .claims
        .values()
        .filter(|c| c.error.contains("claims in one call"))
        .count();
    assert_eq!(untried, 10_000 - max);
    assert_eq!(agent.status().dra_drivers[0].prepared_claims, 0);
    agent.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registry_edit_upgrades_a_dra_module_in_place_keeping_its_driver_and_claims() {
    let dra = DraNode::new().await;
    dra.node.add_char("/dev/net/tun", 10, 200);
    let groups = |extra: &str| {
        fuse_dra().replace(
            r#"groups = [{ name = "fuse", paths = ["/dev/fuse"] }]"#,
            &format!(r#"groups = [{{ name = "fuse", paths = ["/dev/fuse"] }}{extra}]"#),
        )
    };
    let agent = dra.agent(&groups("")).await;
    registered(&dra.kubelet, 1).await;
    let device = published(&dra.api).await["spec"]["devices"][0]["name"]
        .as_str()
        .expect("a device")
        .to_string();
    let uid = dra.claim(DRIVER, "kept", &[&device], json!([]));
    assert_eq!(dra.prepare(DRIVER, "kept", &uid).await.error, "");
    let generation = || {
        agent
            .status()
            .dra_drivers
            .iter()
            .find(|d| d.driver == DRIVER)
            .map(|d| d.generation)
    };
    let before = generation();
    let attempts_of = |driver: &str| {
        let socket = format!("{driver}-reg.sock");
        dra.kubelet
            .registry_attempts()
            .iter()
            .filter(|a| a.socket.ends_with(&socket))
            .count()
    };
    let attempts = attempts_of(DRIVER);

    // The edit adds a resource: a new driver starts beside the running one, which is not
    // touched (no new registration, same pool generation, its claim still prepared).
    dra.node
        .registry(&groups(r#", { name = "tun", paths = ["/dev/net/tun"] }"#));
    devicelet_tests::eventually("the tun driver registered and published", || {
        dra.kubelet
            .dra_registrations()
            .iter()
            .any(|r| r.driver == "tun.devicelet.io")
            && dra
                .api
                .list(Kind::ResourceSlice)
                .iter()
                .any(|s| s["spec"]["driver"] == "tun.devicelet.io")
    })
    .await;
    devicelet_tests::eventually("the tun driver's registration recorded", || {
        attempts_of("tun.devicelet.io") == 1
    })
    .await;
    assert_eq!(
        attempts_of(DRIVER),
        attempts,
        "the kept driver did not register again: {:?}",
        dra.kubelet.registry_attempts()
    );
    assert_eq!(generation(), before);
    let fuse = agent
        .status()
        .dra_drivers
        .into_iter()
        .find(|d| d.driver == DRIVER)
        .expect("the fuse driver");
    assert_eq!(fuse.prepared_claims, 1);
    // The kept driver still unprepares the claim it prepared before the upgrade.
    let unprepared = dra
        .kubelet
        .node_unprepare_resources(DRIVER, vec![wire_claim("kept", &uid)])
        .await
        .expect("answered");
    assert_eq!(unprepared.claims[&uid].error, "");

    // The edit is undone: the tun driver goes, and its slices with it.
    dra.node.registry(&groups(""));
    devicelet_tests::eventually("the tun driver's slices withdrawn", || {
        dra.api
            .list(Kind::ResourceSlice)
            .iter()
            .all(|s| s["spec"]["driver"] != "tun.devicelet.io")
            && agent.status().dra_drivers.len() == 1
    })
    .await;
    assert_eq!(attempts_of(DRIVER), attempts);
    agent.shutdown().await;
    assert_rbac_allows(&dra.api);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_past_the_apis_device_limit_is_sharded_into_slices_the_api_server_accepts() {
    let dra = DraNode::new().await;
    let agent = dra
        .agent(
            r#"[[module]]
name = "many"
path = "@MODULES@/misbehaving.wasm"
health-interval = "1h"
front-end = "dra"

[module.grants]
sysfs = ["/sys/testing"]

[module.config]
resource = "many"
devices = 300
"#,
        )
        .await;
    assert!(agent.load_errors().is_empty(), "{:?}", agent.load_errors());
    let slices = devicelet_tests::eventually_some("300 devices in three slices", || {
        let slices = dra.api.list(Kind::ResourceSlice);
        let sizes: Vec<usize> = slices
            .iter()
            .map(|s| s["spec"]["devices"].as_array().map_or(0, Vec::len))
            .collect();
        (sizes.iter().sum::<usize>() == 300).then_some(slices)
    })
    .await;
    let mut sizes: Vec<usize> = slices
        .iter()
        .map(|s| s["spec"]["devices"].as_array().map_or(0, Vec::len))
        .collect();
    sizes.sort_unstable();
    assert_eq!(sizes, [44, 128, 128], "sharded at the API's 128");
    for slice in &slices {
        assert_eq!(slice["spec"]["pool"]["resourceSliceCount"], 3);
        assert_eq!(
            slice["spec"]["pool"]["generation"],
            slices[0]["spec"]["pool"]["generation"]
        );
    }
    // The scheduler takes the pool as complete: a claim for all of it is allocated.
    dra.api
        .handle()
        .allocate_claim("team-a", "all", "many.devicelet.io", NODE, 300)
        .expect("the whole pool");
    agent.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_that_gives_one_named_driver_two_resources_is_refused_not_served_twice() {
    let dra = DraNode::new().await;
    dra.node.add_char("/dev/net/tun", 10, 200);
    let named = |groups: &str| {
        fuse_dra()
            .replace(
                "front-end = \"dra\"",
                "front-end = \"dra\"\ndra-driver = \"devices.example.com\"",
            )
            .replace(
                r#"groups = [{ name = "fuse", paths = ["/dev/fuse"] }]"#,
                &format!("groups = [{groups}]"),
            )
    };
    let fuse = r#"{ name = "fuse", paths = ["/dev/fuse"] }"#;
    let agent = dra.agent(&named(fuse)).await;
    devicelet_tests::eventually("the named driver registered", || {
        dra.kubelet
            .dra_registrations()
            .iter()
            .any(|r| r.driver == "devices.example.com")
    })
    .await;
    dra.node.registry(&named(&format!(
        r#"{fuse}, {{ name = "tun", paths = ["/dev/net/tun"] }}"#
    )));
    devicelet_tests::eventually("the edit refused, naming why", || {
        agent
            .load_errors()
            .iter()
            .any(|e| e.contains("`dra-driver` names one driver, but the module serves 2"))
    })
    .await;
    assert!(
        agent.status().dra_drivers.is_empty(),
        "no driver of that name runs twice: {:?}",
        agent.status().dra_drivers
    );
    agent.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_claims_are_prepared_per_driver_unprepared_after_their_last_pod_and_again_after_a_kubelet_restart()
 {
    let (dra, agent) = two_fuses().await;
    let scheduler = dra.api.handle();
    for name in ["own", "shared"] {
        scheduler
            .allocate_claim("team-a", name, DRIVER, NODE, 1)
            .expect("allocated");
    }
    // The driver's prepare calls and claims, as the agent counts them.
    let prepares = || {
        let samples = devicelet_tests::parse_metrics(&agent.metrics());
        devicelet_tests::metric(
            &samples,
            "devicelet_dra_prepare_duration_seconds_count",
            &[("driver", DRIVER), ("result", "ok")],
        )
        .unwrap_or(0.0)
    };
    let prepared = || agent.status().dra_drivers[0].prepared_claims;

    let first = dra
        .kubelet
        .start_pod_with_claims("team-a", "one", &["own", "shared"])
        .await
        .expect("the pod's claims prepared");
    assert_eq!(first.len(), 2);
    assert!(first.iter().all(|c| c.devices[DRIVER].len() == 1));
    assert_eq!((prepares(), prepared()), (2.0, 2));
    // A second pod using the shared claim: prepared already, the driver is not called.
    dra.kubelet
        .start_pod_with_claims("team-a", "two", &["shared"])
        .await
        .expect("the shared claim");
    assert_eq!(prepares(), 2.0);

    // The first pod ends: its own claim goes, the shared one stays for the second pod.
    dra.kubelet
        .end_pod_claims("team-a", "one")
        .await
        .expect("unprepared");
    assert_eq!(prepared(), 1);

    // After a kubelet restart nothing counts as prepared: the next pod has the driver called
    // again for the shared claim, which answers the same.
    dra.kubelet.restart().await.expect("restart");
    devicelet_tests::eventually("the driver registered again", || {
        dra.kubelet.dra_registrations().len() == 1
    })
    .await;
    devicelet_tests::eventually("the pool published again after the wipe", || {
        slice_devices(&dra.api).is_some_and(|d| d.len() == 2)
    })
    .await;
    let third = dra
        .kubelet
        .start_pod_with_claims("team-a", "three", &["shared"])
        .await
        .expect("prepared again");
    assert_eq!(prepares(), 3.0);
    let before = first.iter().find(|c| c.name == "shared").expect("shared");
    assert_eq!(third[0].devices, before.devices, "the same answer");
    for pod in ["two", "three"] {
        dra.kubelet
            .end_pod_claims("team-a", pod)
            .await
            .expect("unprepared");
    }
    assert_eq!(prepared(), 0);

    // What the kubelet refuses before calling anyone.
    let e = dra
        .kubelet
        .start_pod_with_claims("team-a", "four", &["missing"])
        .await
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("failed to fetch ResourceClaim missing"),
        "{e}"
    );
    dra.api
        .create(
            Kind::ResourceClaim,
            "team-a",
            json!({"metadata": {"name": "elsewhere"}, "spec": {"devices": {"requests": []}},
            "status": {"allocation": {"devices": {"results": [
                {"request": "gpu", "driver": "gpu.example.com", "pool": NODE, "device": "gpu-0"}
            ]}}}}),
        )
        .expect("claim");
    let e = dra
        .kubelet
        .start_pod_with_claims("team-a", "five", &["elsewhere"])
        .await
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("DRA driver gpu.example.com is not registered"),
        "{e}"
    );
    agent.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_driver_that_leaves_the_registry_answers_for_its_claims_until_they_are_unprepared() {
    let dra = DraNode::new().await;
    dra.node.add_char("/dev/net/tun", 10, 200);
    let tun =
        devicelet_tests::generic_dev(r#"groups = [{ name = "tun", paths = ["/dev/net/tun"] }]"#)
            .replacen("name = \"generic-dev\"", "name = \"generic-tun\"", 1);
    let both = format!("{}\n{tun}", fuse_dra());
    let agent = dra.agent(&both).await;
    registered(&dra.kubelet, 1).await;
    let device = published(&dra.api).await["spec"]["devices"][0]["name"]
        .as_str()
        .expect("a device")
        .to_string();
    let uid = dra.claim(DRIVER, "in-use", &[&device], json!([]));
    let prepared = dra.prepare(DRIVER, "in-use", &uid).await;
    assert_eq!(prepared.error, "");

    // The operator removes the module while a pod uses the claim.
    dra.node.registry(&tun);
    devicelet_tests::eventually("the driver retiring, its slices gone", || {
        agent
            .status()
            .dra_drivers
            .iter()
            .any(|d| d.driver == DRIVER && d.retiring && d.prepared_claims == 1)
            && dra.api.list(Kind::ResourceSlice).is_empty()
    })
    .await;
    assert_eq!(dra.kubelet.dra_registrations().len(), 1, "still registered");
    // The claim it prepared: the same answer. A new one: refused, saying why.
    assert_eq!(dra.prepare(DRIVER, "in-use", &uid).await, prepared);
    let other = dra.claim(DRIVER, "late", &[&device], json!([]));
    let refused = dra.prepare(DRIVER, "late", &other).await;
    assert!(
        refused.error.contains("left this node's registry"),
        "{refused:?}"
    );
    // The pod ends: the claim is unprepared, and the driver goes with its last claim.
    let unprepared = dra
        .kubelet
        .node_unprepare_resources(DRIVER, vec![wire_claim("in-use", &uid)])
        .await
        .expect("answered");
    assert_eq!(unprepared.claims[&uid].error, "");
    devicelet_tests::eventually(
        "the retired driver gone from status and the kubelet",
        || agent.status().dra_drivers.is_empty() && dra.kubelet.dra_registrations().is_empty(),
    )
    .await;

    // Retiring again, then served again: the new driver takes over its claim.
    dra.node.registry(&both);
    devicelet_tests::eventually("served again", || {
        agent
            .status()
            .dra_drivers
            .iter()
            .any(|d| d.driver == DRIVER && !d.retiring && d.registered)
    })
    .await;
    let device = published(&dra.api).await["spec"]["devices"][0]["name"]
        .as_str()
        .expect("a device")
        .to_string();
    let again = dra.claim(DRIVER, "again", &[&device], json!([]));
    assert_eq!(dra.prepare(DRIVER, "again", &again).await.error, "");
    dra.node.registry(&tun);
    devicelet_tests::eventually("retiring", || {
        agent.status().dra_drivers.iter().any(|d| d.retiring)
    })
    .await;
    dra.node.registry(&both);
    devicelet_tests::eventually("taken over by the new driver", || {
        let drivers = agent.status().dra_drivers;
        drivers.len() == 1
            && !drivers[0].retiring
            && drivers[0].registered
            && drivers[0].prepared_claims == 1
            && dra.kubelet.dra_registrations().len() == 1
    })
    .await;
    let unprepared = dra
        .kubelet
        .node_unprepare_resources(DRIVER, vec![wire_claim("again", &again)])
        .await
        .expect("answered");
    assert_eq!(unprepared.claims[&again].error, "");
    agent.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_naming_one_device_prepared_at_once_leave_it_held_by_exactly_one() {
    let dra = DraNode::new().await;
    let agent = dra.agent(&fuse_dra()).await;
    registered(&dra.kubelet, 1).await;
    let slice = published(&dra.api).await;
    let device = slice["spec"]["devices"][0]["name"]
        .as_str()
        .expect("a device")
        .to_string();
    for round in 0..100 {
        // Four claims a buggy scheduler (or a hostile API server) allocated the same device, whose
        // reads are answered together, so that the four prepares overlap.
        let uids: Vec<String> = (0..4)
            .map(|i| dra.claim(DRIVER, &format!("r{round}-c{i}"), &[&device], json!([])))
            .collect();
        dra.api.release_claim_reads_together(4);
        let call = |i: usize| {
            dra.kubelet.node_prepare_resources(
                DRIVER,
                vec![wire_claim(&format!("r{round}-c{i}"), &uids[i])],
            )
        };
        let (a, b, c, d) = tokio::join!(call(0), call(1), call(2), call(3));
        let answers: Vec<_> = [a, b, c, d]
            .into_iter()
            .zip(&uids)
            .map(|(answer, uid)| answer.expect("answered").claims[uid].clone())
            .collect();
        let prepared: Vec<usize> = (0..4).filter(|&i| answers[i].error.is_empty()).collect();
        assert_eq!(prepared.len(), 1, "round {round}: {answers:?}");
        for (i, answer) in answers.iter().enumerate() {
            if i != prepared[0] {
                assert!(
                    answer.error.contains(&format!(
                        "is already prepared for ResourceClaim team-a/r{round}-c{}",
                        prepared[0]
                    )),
                    "round {round}: {answer:?}"
                );
            }
        }
        assert_eq!(agent.status().dra_drivers[0].prepared_claims, 1);
        let winner = prepared[0];
        let gone = dra
            .kubelet
            .node_unprepare_resources(
                DRIVER,
                vec![wire_claim(&format!("r{round}-c{winner}"), &uids[winner])],
            )
            .await
            .expect("answered");
        assert_eq!(gone.claims[&uids[winner]].error, "");
        for (i, uid) in uids.iter().enumerate() {
            assert!(
                dra.api
                    .delete(Kind::ResourceClaim, "team-a", &format!("r{round}-c{i}")),
                "{uid}"
            );
        }
    }
    assert_eq!(agent.status().dra_drivers[0].prepared_claims, 0);
    agent.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resource_moved_from_dra_to_the_device_plugin_advertises_a_claimed_device_only_once_unprepared()
 {
    let dra = DraNode::new().await;
    dra.node.add_char("/dev/fuse1", 10, 230);
    let modules = |front_end: &str| fuse_via(front_end, r#""/dev/fuse", "/dev/fuse1""#);
    let plugin_dir = dra.kubelet.plugin_dir().to_owned();
    let agent = dra
        .agent_with(&modules("dra"), move |o| o.plugin_dir = plugin_dir)
        .await;
    registered(&dra.kubelet, 1).await;
    let devices = devicelet_tests::eventually_some("both devices published", || {
        slice_devices(&dra.api).filter(|d| d.len() == 2)
    })
    .await;
    let uid = dra.claim(DRIVER, "kept", &[&devices[0]], json!([]));
    let answer = dra.prepare(DRIVER, "kept", &uid).await;
    assert_eq!(answer.error, "", "{answer:?}");

    // The operator moves the resource back to the device plugin while the claim's pod runs.
    dra.node.registry(&modules("device-plugin"));
    let seen = dra
        .kubelet
        .wait_until("devicelet.io/fuse", devicelet_tests::WAIT, |r| {
            r.capacity == 1
        })
        .await
        .expect("the device plugin serves the unclaimed device only");
    assert_eq!(seen.allocatable, 1);
    // The retired driver still answers for its claim; once unprepared, the device is advertised.
    let gone = dra
        .kubelet
        .node_unprepare_resources(DRIVER, vec![wire_claim("kept", &uid)])
        .await
        .expect("answered");
    assert_eq!(gone.claims[&uid].error, "");
    dra.kubelet
        .wait_until("devicelet.io/fuse", devicelet_tests::WAIT, |r| {
            r.capacity == 2 && r.allocatable == 2
        })
        .await
        .expect("the device is advertised once its claim is unprepared");
    agent.shutdown().await;
}

/// A claim of the one fuse device published, padded with an annotation of `pad` bytes (its
/// size, not its meaning, is the point): its UID.
async fn padded_claim(dra: &DraNode, name: &str, pad: usize) -> String {
    registered(&dra.kubelet, 1).await;
    let slice = published(&dra.api).await;
    let device = slice["spec"]["devices"][0]["name"]
        .as_str()
        .expect("a device")
        .to_string();
    let uid = dra.claim(DRIVER, name, &[&device], json!([]));
    let mut claim = dra
        .api
        .get(Kind::ResourceClaim, "team-a", name)
        .expect("the claim");
    claim["metadata"]["annotations"] = json!({"pad": "x".repeat(pad)});
    dra.api
        .update(Kind::ResourceClaim, "team-a", name, claim)
        .expect("padded");
    uid
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_the_api_server_trickles_fails_at_the_deadline_and_its_retry_is_not_held() {
    let dra = DraNode::new().await;
    let agent = dra.agent(&fuse_dra()).await;
    let uid = padded_claim(&dra, "slow", 1500).await;
    // Headers at once, then 40 bytes a second: the whole claim would take about a minute.
    dra.api.trickle_claim_reads(Some(40));
    let started = std::time::Instant::now();
    let first = {
        let kubelet = dra.kubelet.clone();
        let claim = wire_claim("slow", &uid);
        tokio::spawn(async move { kubelet.node_prepare_resources(DRIVER, vec![claim]).await })
    };
    devicelet_tests::eventually("the claim's read under way", || {
        dra.api
            .requests()
            .contains(&("get".to_owned(), Kind::ResourceClaim))
    })
    .await;
    // Another call for the claim meanwhile, with a second to answer: answered within it (the
    // claim is busy), not held behind the first call's read.
    let busy = dra
        .kubelet
        .node_prepare_resources_within(
            DRIVER,
            vec![wire_claim("slow", &uid)],
            std::time::Duration::from_secs(1),
        )
        .await
        .expect("answered within its deadline");
    assert!(
        busy.claims[&uid]
            .error
            .contains("an earlier call for this claim is still running"),
        "{busy:?}"
    );
    let answer = first.await.expect("the first call").expect("answered");
    let answer = &answer.claims[&uid];
    assert!(
        answer
            .error
            .contains("no whole answer from the API server within 15s"),
        "{answer:?}"
    );
    assert!(
        started.elapsed() < std::time::Duration::from_secs(40),
        "held until the server finished: {:?}",
        started.elapsed()
    );
    // The kubelet's retry finds the claim's lock free and the server answering again.
    dra.api.trickle_claim_reads(None);
    let answer = dra.prepare(DRIVER, "slow", &uid).await;
    assert_eq!(answer.error, "", "{answer:?}");
    assert_eq!(answer.devices.len(), 1);
    agent.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_larger_than_any_real_one_is_refused_as_it_streams() {
    let dra = DraNode::new().await;
    let agent = dra.agent(&fuse_dra()).await;
    let uid = padded_claim(&dra, "huge", 5 << 20).await;
    let answer = dra.prepare(DRIVER, "huge", &uid).await;
    assert!(
        answer
            .error
            .contains("the API server's answer is larger than 4194304 bytes"),
        "{answer:?}"
    );
    assert_eq!(agent.status().dra_drivers[0].prepared_claims, 0);
    agent.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_ignoring_field_selectors_never_gets_another_driver_s_slices_touched() {
    let dra = DraNode::new().await;
    // Another driver's slice on this node, and one of ours on another node.
    let theirs = dra
        .api
        .create(
            Kind::ResourceSlice,
            "",
            serde_json::to_value(slice(NODE, &["gpu-0"])).expect("json"),
        )
        .expect("their slice");
    let mut ours_elsewhere = slice("node-b", &["fuse-0"]);
    ours_elsewhere.spec.driver = DRIVER.into();
    let elsewhere = dra
        .api
        .create(
            Kind::ResourceSlice,
            "",
            serde_json::to_value(&ours_elsewhere).expect("json"),
        )
        .expect("a slice of another node");
    dra.api.ignore_field_selectors();
    let agent = dra.agent(&fuse_dra()).await;
    registered(&dra.kubelet, 1).await;
    // Several resyncs (every 200 ms here), each listing every slice there is.
    let lists = |api: &ApiServer| {
        api.requests()
            .iter()
            .filter(|(verb, kind)| verb == "list" && *kind == Kind::ResourceSlice)
            .count()
    };
    devicelet_tests::eventually("five resyncs", || lists(&dra.api) >= 5).await;
    let names: Vec<String> = dra
        .api
        .list(Kind::ResourceSlice)
        .iter()
        .map(|s| s["metadata"]["name"].as_str().unwrap_or("").to_string())
        .collect();
    for kept in [&theirs, &elsewhere] {
        let name = kept["metadata"]["name"].as_str().expect("a name");
        assert!(names.iter().any(|n| n == name), "{name} gone: {names:?}");
        let now = dra
            .api
            .get(Kind::ResourceSlice, "", name)
            .expect("still there");
        assert_eq!(
            now["metadata"]["resourceVersion"], kept["metadata"]["resourceVersion"],
            "{name} was written"
        );
    }
    assert_eq!(names.len(), 3, "ours beside them: {names:?}");
    agent.shutdown().await;
}
