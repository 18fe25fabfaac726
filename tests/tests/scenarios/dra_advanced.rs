//! DRA's advanced model from WIT 0.3 modules, against the simulator's API server and its
//! scheduler (which allocates counters and consumable capacity as the upstream structured
//! allocator does): a device shared by capacity (the reference generic-dev's `capacity`),
//! partitions drawing on counters and a module that prepares its claims (the test module
//! `partitions`), each also checked by the agent's own ledger at prepare.

use devicelet_simulator::DeviceRequest;
use devicelet_simulator::apiserver::Kind;
use devicelet_tests::cdi::resolve;
use devicelet_tests::dra::{DraNode, NODE, published, registered};
use serde_json::json;

const FUSE: &str = "fuse.devicelet.io";
const ACC: &str = "acc.devicelet.io";
/// The partitions test module, served through DRA.
const PARTITIONS: &str = r#"[[module]]
name = "partitions"
path = "@MODULES@/partitions.wasm"
health-interval = "100ms"
front-end = "dra"
"#;

async fn serving(dra: &DraNode, modules: &str) -> devicelet::agent::Agent {
    let agent = dra.agent(modules).await;
    assert!(agent.load_errors().is_empty(), "{:?}", agent.load_errors());
    registered(&dra.kubelet, 1).await;
    agent
}

fn asking(bandwidth: Option<&str>) -> DeviceRequest {
    DeviceRequest {
        count: 1,
        capacity: bandwidth
            .map(|b| [("bandwidth".to_owned(), b.to_owned())].into())
            .unwrap_or_default(),
        ..DeviceRequest::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_claims_share_a_device_by_capacity_and_a_fifth_that_would_exceed_it_is_not_allocated()
{
    let dra = DraNode::new().await;
    let agent = serving(
        &dra,
        &devicelet_tests::generic_dev(
            r#"groups = [{ name = "fuse", paths = ["/dev/fuse"], capacity = { name = "bandwidth", value = "10G", default = "1G", step = "1G" } }]"#,
        )
        .replacen("[module.grants]", "front-end = \"dra\"\n\n[module.grants]", 1),
    )
    .await;
    let slice = published(&dra.api).await;
    let device = &slice["spec"]["devices"][0];
    assert_eq!(device["allowMultipleAllocations"], true, "{device}");
    let policy = &device["capacity"]["bandwidth"]["requestPolicy"];
    assert_eq!(policy["default"], "1G", "{device}");
    assert_eq!(policy["validRange"]["step"], "1G", "{device}");

    // 3G, 2500M (rounded up to 3G), 3G and the default 1G: 10G, all of it.
    let scheduler = dra.api.handle();
    let mut uids = Vec::new();
    for (i, ask) in [Some("3G"), Some("2500M"), Some("3G"), None]
        .into_iter()
        .enumerate()
    {
        let name = format!("share-{i}");
        let claim = scheduler
            .allocate_claim_with("team-a", &name, FUSE, NODE, &asking(ask))
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let uid = claim["metadata"]["uid"].as_str().expect("uid").to_owned();
        let prepared = dra.prepare(FUSE, &name, &uid).await;
        assert_eq!(prepared.error, "", "{name}: {prepared:?}");
        let container = resolve(
            &dra.node.dir.path().join("cdi"),
            &prepared.devices[0].cdi_device_ids,
        );
        // As the API server wrote the claim's consumed capacity (in whatever spelling).
        let held = container.envs.get("GENERIC_DEV_BANDWIDTH").cloned();
        let amount = held
            .as_deref()
            .and_then(|h| h.strip_prefix("fuse="))
            .and_then(devicelet_simulator::quantity::parse);
        let want = ["3G", "3G", "3G", "1G"][i];
        assert_eq!(
            amount,
            devicelet_simulator::quantity::parse(want),
            "{name}: {held:?}"
        );
        uids.push((name, uid));
    }
    let refused = scheduler
        .allocate_claim_with("team-a", "fifth", FUSE, NODE, &asking(Some("1G")))
        .unwrap_err();
    assert!(refused.contains("without the capacity"), "{refused}");

    // A claim the scheduler did not count (a stale or hostile allocation) is refused by the
    // agent's own count.
    let created = dra
        .api
        .create(
            Kind::ResourceClaim,
            "team-a",
            json!({
                "metadata": {"name": "stray"},
                "spec": {"devices": {"requests": [{"name": "fuse", "exactly": {"deviceClassName": FUSE}}]}},
                "status": {"allocation": {"devices": {"results": [{
                    "request": "fuse", "driver": FUSE, "pool": NODE, "device": "fuse",
                    "shareID": "0b5e6a2c-9d1f-4e2a-8c3b-7f6e5d4c3b2a",
                    "consumedCapacity": {"bandwidth": "1G"}
                }]}}}
            }),
        )
        .expect("the claim");
    let stray = created["metadata"]["uid"].as_str().expect("uid");
    let refused = dra.prepare(FUSE, "stray", stray).await;
    assert!(
        refused
            .error
            .contains("asks 1G of its bandwidth, and 0 is left"),
        "{refused:?}"
    );
    agent.shutdown().await;
}

/// The claim's `status.devices` entry for `device`, once written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitions_are_allocated_by_counters_and_each_prepare_creates_its_instance() {
    let dra = DraNode::new().await;
    let agent = serving(&dra, PARTITIONS).await;
    // The counter set in a slice of its own, the seven partitions consuming from it.
    let (counters, devices) = devicelet_tests::dra::counters_and_devices(&dra.api).await;
    assert_eq!(
        counters["spec"]["sharedCounters"][0]["counters"]["slices"]["value"],
        "4"
    );
    assert!(counters["spec"]["devices"].is_null(), "{counters}");
    assert_eq!(devices.len(), 7);
    let whole = devices
        .iter()
        .find(|d| d["name"] == "acc-0-4s-0")
        .expect("the whole partition");
    assert_eq!(
        whole["consumesCounters"][0]["counters"]["slices"]["value"],
        "4"
    );

    // Four claims of one partition each take the four slices; a fifth overlaps them all.
    let scheduler = dra.api.handle();
    let mut names = Vec::new();
    for i in 0..4 {
        let name = format!("part-{i}");
        let claim = scheduler
            .allocate_claim_with("team-a", &name, ACC, NODE, &asking(None))
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let uid = claim["metadata"]["uid"].as_str().expect("uid").to_owned();
        let device = claim["status"]["allocation"]["devices"]["results"][0]["device"]
            .as_str()
            .expect("a device")
            .to_owned();
        let prepared = dra.prepare(ACC, &name, &uid).await;
        assert_eq!(prepared.error, "", "{name}: {prepared:?}");
        let container = resolve(
            &dra.node.dir.path().join("cdi"),
            &prepared.devices[0].cdi_device_ids,
        );
        let instance = format!("{uid}/acc");
        assert_eq!(
            container.envs.get("ACC_INSTANCE").map(String::as_str),
            Some(instance.as_str())
        );
        // The module's status data beside the host's.
        let status = dra.device_status(&name, &device).await;
        assert_eq!(status["data"]["instance"], instance.as_str(), "{status}");
        assert_eq!(status["data"]["deviceIDs"], json!([device]), "{status}");
        names.push((name, uid, device));
    }
    let refused = scheduler
        .allocate_claim_with("team-a", "fifth", ACC, NODE, &asking(None))
        .unwrap_err();
    assert!(refused.contains("cannot allocate"), "{refused}");

    // A partition the scheduler did not count is refused by the agent's own count.
    let stray = dra.claim(ACC, "stray", &["acc-0-4s-0"], json!([]));
    let refused = dra.prepare(ACC, "stray", &stray).await;
    assert!(
        refused
            .error
            .contains("would take counter slices of set acc-0 past its 4"),
        "{refused:?}"
    );

    // Unprepared, its slices are free again: the whole partition fits once all four go.
    for (name, uid, _) in &names {
        let unprepared = dra
            .kubelet
            .node_unprepare_resources(ACC, vec![devicelet_tests::dra::wire_claim(name, uid)])
            .await
            .expect("answered");
        assert_eq!(unprepared.claims[uid].error, "");
    }
    let prepared = dra.prepare(ACC, "stray", &stray).await;
    assert_eq!(prepared.error, "", "{prepared:?}");
    agent.shutdown().await;
}

/// A claim's config is the module's `validate-config`'s to judge before anything is reserved
/// or made for it: one it refuses fails the claim with the module's words (the partitions
/// module's `prepare` would take any), and the partition stays free for the next claim.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_config_the_modules_validate_config_refuses_fails_the_claim_before_anything_is_made() {
    let dra = DraNode::new().await;
    let agent = serving(&dra, PARTITIONS).await;
    devicelet_tests::dra::counters_and_devices(&dra.api).await;
    let colour = json!([{"source": "FromClaim", "requests": [],
        "opaque": {"driver": ACC, "parameters": {"colour": "red"}}}]);
    let uid = dra.claim(ACC, "red", &["acc-0-4s-0"], colour);
    let refused = dra.prepare(ACC, "red", &uid).await;
    assert!(
        refused.error.contains("expected no config") && refused.error.contains("colour"),
        "{refused:?}"
    );
    assert!(agent.ledger().claim(&uid).is_none(), "nothing recorded");
    let plain = dra.claim(ACC, "plain", &["acc-0-4s-0"], json!([]));
    let prepared = dra.prepare(ACC, "plain", &plain).await;
    assert_eq!(prepared.error, "", "{prepared:?}");
    agent.shutdown().await;
}

/// A module's prepare that outlasts the time the kubelet gave the call: the kubelet is
/// answered within it ("still being prepared"), and the claim's work goes on to its end — here
/// the module's call deadline, after which what it began stays recorded until an unprepare
/// undoes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prepare_outlasting_the_kubelets_deadline_is_answered_in_time_and_undone_after_it() {
    let dra = DraNode::new().await;
    let agent = serving(
        &dra,
        &PARTITIONS.replace("front-end", "call-deadline = \"8s\"\nfront-end"),
    )
    .await;
    devicelet_tests::dra::counters_and_devices(&dra.api).await;
    let slow = json!([{"source": "FromClaim", "requests": [],
        "opaque": {"driver": ACC, "parameters": {"slow": true}}}]);
    let uid = dra.claim(ACC, "slow", &["acc-0-4s-0"], slow);
    let answer = dra
        .kubelet
        .node_prepare_resources_within(
            ACC,
            vec![devicelet_tests::dra::wire_claim("slow", &uid)],
            std::time::Duration::from_secs(5),
        )
        .await
        .expect("answered within the call's deadline");
    let error = &answer.claims[&uid].error;
    assert!(error.contains("still being prepared"), "{error}");
    assert!(
        agent.ledger().claim(&uid).is_some(),
        "the claim is held while the module works on it"
    );
    devicelet_tests::eventually("the module's prepare cut off at its call deadline", || {
        agent.status().modules[0].stats.deadlines == 1
    })
    .await;
    // What the module began stays recorded until an unprepare undoes it: the agent's own undo
    // right after the failure (when the module's cell is back in time), else the kubelet's
    // (here, once the pod is gone) or the next prepare's.
    assert!(agent.ledger().claim(&uid).is_none_or(|c| c.preparing));
    let mut tries = 0;
    loop {
        let answer = dra
            .kubelet
            .node_unprepare_resources(ACC, vec![devicelet_tests::dra::wire_claim("slow", &uid)])
            .await
            .expect("answered");
        tries += 1;
        if answer.claims[&uid].error.is_empty() {
            break;
        }
        // The kubelet tries again (the module's cell may still be starting afresh).
        assert!(tries < 50, "{answer:?}");
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    assert!(agent.ledger().claim(&uid).is_none(), "undone");
    agent.shutdown().await;
}

/// What a module that prepares claims made stays made until its `unprepare` succeeds: one that
/// fails leaves the claim recorded (and its partition held), the kubelet is told, and its next
/// NodeUnprepareResources undoes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_unprepare_keeps_the_claim_until_the_kubelets_retry_succeeds() {
    let dra = DraNode::new().await;
    let agent = serving(&dra, PARTITIONS).await;
    devicelet_tests::dra::counters_and_devices(&dra.api).await;
    let stuck = json!([{"source": "FromClaim", "requests": [],
        "opaque": {"driver": ACC, "parameters": {"stuck": true}}}]);
    let uid = dra.claim(ACC, "stuck", &["acc-0-4s-0"], stuck);
    let prepared = dra.prepare(ACC, "stuck", &uid).await;
    assert_eq!(prepared.error, "", "{prepared:?}");
    let unprepare = || {
        dra.kubelet
            .node_unprepare_resources(ACC, vec![devicelet_tests::dra::wire_claim("stuck", &uid)])
    };
    let first = unprepare().await.expect("answered");
    let error = &first.claims[&uid].error;
    assert!(
        error.contains("unprepare failed") && error.contains("busy"),
        "{error}"
    );
    assert!(agent.ledger().claim(&uid).is_some(), "the claim stays");
    // Its slices are still held: a partition overlapping them is refused by the agent's count.
    let overlapping = dra.claim(ACC, "overlapping", &["acc-0-2s-2"], json!([]));
    let refused = dra.prepare(ACC, "overlapping", &overlapping).await;
    assert!(refused.error.contains("counter slices"), "{refused:?}");

    let second = unprepare().await.expect("answered");
    assert_eq!(second.claims[&uid].error, "");
    assert!(agent.ledger().claim(&uid).is_none());
    let prepared = dra.prepare(ACC, "overlapping", &overlapping).await;
    assert_eq!(prepared.error, "", "{prepared:?}");
    agent.shutdown().await;
}

/// An API server without DRAConsumableCapacity drops `allowMultipleAllocations` on write: the
/// publisher sees it, says so, and publishes the shared device whole (one claim at a time)
/// rather than rewriting the slice at every resync.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_consumable_capacity_a_shared_device_is_published_whole_and_left_alone() {
    let dra = DraNode::new().await;
    dra.api.drop_consumable_capacity();
    let agent = serving(
        &dra,
        &devicelet_tests::generic_dev(
            r#"groups = [{ name = "fuse", paths = ["/dev/fuse"], capacity = { name = "bandwidth", value = "10G", default = "1G", step = "1G" } }]"#,
        )
        .replacen("[module.grants]", "front-end = \"dra\"\n\n[module.grants]", 1),
    )
    .await;
    devicelet_tests::eventually("the fallback said", || {
        agent.status().dra_drivers[0].shared_dropped
    })
    .await;
    let slice = published(&dra.api).await;
    let device = &slice["spec"]["devices"][0];
    assert!(device["allowMultipleAllocations"].is_null(), "{device}");
    assert_eq!(device["capacity"]["bandwidth"]["value"], "10G", "{device}");
    assert!(
        device["capacity"]["bandwidth"]["requestPolicy"].is_null(),
        "{device}"
    );
    // Three more resyncs (each lists the pool) write nothing.
    let lists = || {
        dra.api
            .requests()
            .iter()
            .filter(|(verb, kind)| verb == "list" && *kind == Kind::ResourceSlice)
            .count()
    };
    let (writes, seen) = (agent.status().dra_drivers[0].api_writes, lists());
    devicelet_tests::eventually("three more resyncs", || lists() >= seen + 3).await;
    assert_eq!(agent.status().dra_drivers[0].api_writes, writes);
    // A claim gets the device whole, and a second none.
    let scheduler = dra.api.handle();
    scheduler
        .allocate_claim_with("team-a", "whole", FUSE, NODE, &asking(None))
        .expect("the device, whole");
    let refused = scheduler
        .allocate_claim_with("team-a", "second", FUSE, NODE, &asking(None))
        .unwrap_err();
    assert!(refused.contains("cannot allocate"), "{refused}");
    agent.shutdown().await;
}

/// A module's own NoExecute taint keeps claims away in the scheduler and, for an allocation
/// that ignored it, at prepare; a claim that tolerates it gets the device.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_modules_own_taint_admits_only_claims_that_tolerate_it() {
    let dra = DraNode::new().await;
    let agent = serving(
        &dra,
        &format!("{PARTITIONS}\n[module.config]\ntaint = \"acc-0-4s-0\"\n"),
    )
    .await;
    let whole = devicelet_tests::eventually_some("the tainted partition published", || {
        let slices = dra.api.list(Kind::ResourceSlice);
        slices
            .iter()
            .flat_map(|s| s["spec"]["devices"].as_array().cloned().unwrap_or_default())
            .find(|d| d["name"] == "acc-0-4s-0")
    })
    .await;
    assert_eq!(
        whole["taints"][0]["key"], "example.com/maintenance",
        "{whole}"
    );
    assert_eq!(whole["taints"][0]["effect"], "NoExecute", "{whole}");

    let scheduler = dra.api.handle();
    let four = |tolerations: Vec<serde_json::Value>| DeviceRequest {
        count: 1,
        tolerations,
        attributes: [("profile".to_owned(), "4s".to_owned())].into(),
        ..DeviceRequest::default()
    };
    // Once the pool is complete (its counters and devices at one generation), the scheduler
    // counts the partition as tainted, and allocates nothing.
    devicelet_tests::eventually("the scheduler refuses it for its taint", || {
        scheduler
            .allocate_claim_with("team-a", "untolerating", ACC, NODE, &four(Vec::new()))
            .is_err_and(|e| e.contains("1 more with taints the claim does not tolerate"))
    })
    .await;
    // An allocation that ignored the taint is refused by the agent too.
    let stray = dra.claim(ACC, "stray", &["acc-0-4s-0"], json!([]));
    let refused = dra.prepare(ACC, "stray", &stray).await;
    assert!(
        refused.error.contains("example.com/maintenance")
            && refused.error.contains("does not tolerate"),
        "{refused:?}"
    );
    assert!(dra.api.delete(Kind::ResourceClaim, "team-a", "stray"));

    let tolerating = json!({"key": "example.com/maintenance", "operator": "Exists",
        "effect": "NoExecute"});
    let claim = scheduler
        .allocate_claim_with("team-a", "tolerating", ACC, NODE, &four(vec![tolerating]))
        .expect("a claim that tolerates the taint");
    let uid = claim["metadata"]["uid"].as_str().expect("uid");
    let prepared = dra.prepare(ACC, "tolerating", uid).await;
    assert_eq!(prepared.error, "", "{prepared:?}");
    agent.shutdown().await;
}
