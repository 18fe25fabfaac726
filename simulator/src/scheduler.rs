//! What the rest of the control plane does to a node's DRA objects, as the node sees it: the
//! scheduler allocating a claim devices from the node's published pools (the structured
//! allocator reduced to "N devices of a driver on this node"), and the kubelet wiping the node's
//! ResourceSlices (at its start, and 30 s after a driver's last endpoint goes).

use serde_json::{Value, json};

use crate::apiserver::{ApiHandle, Kind, Store};
use crate::claim_allocator::{self, Allocated, DeviceRequest};

impl ApiHandle {
    /// Deletes the ResourceSlices of `node` (of `driver` only, when given), as the kubelet's
    /// `DeleteCollection` with field selector `spec.nodeName=<node>[,spec.driver=<driver>]`
    /// does; how many went.
    pub fn wipe_slices(&self, node: &str, driver: Option<&str>) -> usize {
        let mut store = self.lock();
        let wiped: Vec<_> = store
            .objects
            .iter()
            .filter(|((kind, _, _), object)| {
                *kind == Kind::ResourceSlice
                    && object["spec"]["nodeName"] == node
                    && driver.is_none_or(|d| object["spec"]["driver"] == d)
            })
            .map(|(key, _)| key.clone())
            .collect();
        for key in &wiped {
            store.remove(key);
        }
        wiped.len()
    }

    /// What claims leave of the counter sets and shared capacities of `driver`'s pools on
    /// `node`.
    pub fn left(&self, driver: &str, node: &str) -> claim_allocator::Left {
        let (slices, allocated) = pools_of(&self.lock(), driver, node);
        claim_allocator::left(&slices, &allocated)
    }

    /// Allocates `count` devices of `driver` on `node` to a new ResourceClaim
    /// `namespace/name`, as the scheduler does ([`allocate_claim_with`](Self::allocate_claim_with)
    /// for a request with nothing but a count).
    pub fn allocate_claim(
        &self,
        namespace: &str,
        name: &str,
        driver: &str,
        node: &str,
        count: usize,
    ) -> Result<Value, String> {
        let request = DeviceRequest {
            count,
            ..DeviceRequest::default()
        };
        self.allocate_claim_with(namespace, name, driver, node, &request)
    }

    /// Allocates devices of `driver` on `node` for `request` to a new ResourceClaim
    /// `namespace/name`, as the structured allocator does (`claim_allocator`): the claim has one
    /// request named after the driver's first label (`gpu` for `gpu.example.com`) for the
    /// DeviceClass named after the driver, with the request's tolerations, capacity and
    /// attribute selectors (as CEL expressions), and its
    /// allocation results in `status` (the tolerations copied in; a shared device's `shareID`
    /// and `consumedCapacity`). Err says why nothing could be allocated.
    pub fn allocate_claim_with(
        &self,
        namespace: &str,
        name: &str,
        driver: &str,
        node: &str,
        request: &DeviceRequest,
    ) -> Result<Value, String> {
        let mut store = self.lock();
        let (slices, allocated) = pools_of(&store, driver, node);
        let chosen = claim_allocator::allocate(&slices, &allocated, request, || store.next_uid())
            .map_err(|short| {
            let mut why = format!(
                "cannot allocate {} device(s) of driver {driver} on node {node}: {} free in its \
                 complete pools",
                request.count, short.free
            );
            if short.tainted > 0 {
                why += &format!(
                    " ({} more with taints the claim does not tolerate)",
                    short.tainted
                );
            }
            if short.capacity > 0 {
                why += &format!(
                    " ({} more without the capacity it asks for)",
                    short.capacity
                );
            }
            if !short.invalid.is_empty() {
                why += &format!(
                    "; invalid resource pools were encountered: {}",
                    short.invalid.join("; ")
                );
            }
            why
        })?;
        let label = driver.split('.').next().unwrap_or(driver);
        let results: Vec<Value> = chosen
            .into_iter()
            .map(|((pool, device), share)| {
                let mut result =
                    json!({"request": label, "driver": driver, "pool": pool, "device": device});
                if !request.tolerations.is_empty() {
                    result["tolerations"] = json!(request.tolerations);
                }
                if let Some(share) = share {
                    result["shareID"] = share["shareID"].clone();
                    result["consumedCapacity"] = share["consumedCapacity"].clone();
                }
                result
            })
            .collect();
        let mut exactly = json!({"deviceClassName": driver, "count": request.count});
        if !request.tolerations.is_empty() {
            exactly["tolerations"] = json!(request.tolerations);
        }
        if !request.capacity.is_empty() {
            exactly["capacity"] = json!({"requests": request.capacity});
        }
        if !request.attributes.is_empty() {
            let selectors: Vec<Value> = request
                .attributes
                .iter()
                .map(|(name, value)| {
                    json!({"cel": {"expression":
                        format!("device.attributes[{driver:?}].{name} == {value:?}")}})
                })
                .collect();
            exactly["selectors"] = json!(selectors);
        }
        let config: Vec<Value> = request
            .config
            .iter()
            .map(|parameters| {
                json!({"requests": [label], "opaque": {"driver": driver, "parameters": parameters}})
            })
            .collect();
        let allocated_config: Vec<Value> = config
            .iter()
            .map(|c| {
                let mut c = c.clone();
                c["source"] = json!("FromClaim");
                c
            })
            .collect();
        store
            .create(
                Kind::ResourceClaim,
                namespace,
                json!({
                    "metadata": {"name": name},
                    "spec": {"devices": {"requests": [{"name": label, "exactly": exactly}],
                        "config": config}},
                    "status": {"allocation": {
                        "devices": {"results": results, "config": allocated_config},
                        "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                            {"key": "metadata.name", "operator": "In", "values": [node]}
                        ]}]}
                    }}
                }),
            )
            .map_err(|e| e.message)
    }
}

/// `driver`'s slices on `node`, and what every claim holds of its devices.
fn pools_of(store: &Store, driver: &str, node: &str) -> (Vec<Value>, Allocated) {
    let selector = [
        ("spec.driver".to_owned(), driver.to_owned()),
        ("spec.nodeName".to_owned(), node.to_owned()),
    ];
    let slices = store.list(Kind::ResourceSlice, None, &selector);
    let allocated = Allocated::of(&store.list(Kind::ResourceClaim, None, &[]), driver);
    (slices, allocated)
}

#[cfg(test)]
mod tests {
    use crate::DeviceRequest;
    use crate::apiserver::{ApiServer, Kind};
    use serde_json::{Value, json};

    fn slice(api: &ApiServer, node: &str, generation: i64, count: i64, devices: &[&str]) {
        let devices: Vec<_> = devices.iter().map(|d| json!({"name": d})).collect();
        api.create(
            Kind::ResourceSlice,
            "",
            json!({
                "metadata": {"generateName": format!("{node}-gpu-")},
                "spec": {
                    "driver": "gpu.example.com",
                    "nodeName": node,
                    "pool": {"name": node, "generation": generation, "resourceSliceCount": count},
                    "devices": devices,
                }
            }),
        )
        .expect("slice");
    }

    #[tokio::test]
    async fn only_complete_pools_of_the_newest_generation_on_the_node_are_allocated_from() {
        let api = ApiServer::start().await.expect("api");
        let scheduler = api.handle();
        // node-a: generation 2 is complete; generation 1's leftover is not used.
        slice(&api, "node-a", 1, 1, &["old"]);
        slice(&api, "node-a", 2, 1, &["gpu-0", "gpu-1"]);
        // node-b: one slice of two: incomplete, nothing allocatable.
        slice(&api, "node-b", 1, 2, &["gpu-0"]);
        let claim = scheduler
            .allocate_claim("ns", "two", "gpu.example.com", "node-a", 2)
            .expect("two devices");
        let results = claim["status"]["allocation"]["devices"]["results"]
            .as_array()
            .expect("results")
            .clone();
        let devices: Vec<&str> = results
            .iter()
            .map(|r| r["device"].as_str().unwrap())
            .collect();
        assert_eq!(devices, ["gpu-0", "gpu-1"]);
        assert_eq!(results[0]["request"], "gpu");
        assert!(
            scheduler
                .allocate_claim("ns", "more", "gpu.example.com", "node-a", 1)
                .unwrap_err()
                .contains("0 free")
        );
        assert!(
            scheduler
                .allocate_claim("ns", "b", "gpu.example.com", "node-b", 1)
                .unwrap_err()
                .contains("0 free")
        );
        // A tainted device goes only to a claim that tolerates its taint; `None` binds nobody.
        api.create(
            Kind::ResourceSlice,
            "",
            json!({
                "metadata": {"generateName": "node-c-gpu-"},
                "spec": {
                    "driver": "gpu.example.com",
                    "nodeName": "node-c",
                    "pool": {"name": "node-c", "generation": 1, "resourceSliceCount": 1},
                    "devices": [
                        {"name": "sick", "taints": [
                            {"key": "devicelet.io/unhealthy", "value": "xid-79", "effect": "NoSchedule"}
                        ]},
                        {"name": "noted", "taints": [{"key": "example.com/note", "effect": "None"}]}
                    ],
                }
            }),
        )
        .expect("tainted slice");
        let noted = scheduler
            .allocate_claim("ns", "c1", "gpu.example.com", "node-c", 1)
            .expect("the informational taint binds nobody");
        assert_eq!(
            noted["status"]["allocation"]["devices"]["results"][0]["device"],
            "noted"
        );
        let refused = scheduler
            .allocate_claim("ns", "c2", "gpu.example.com", "node-c", 1)
            .unwrap_err();
        assert!(
            refused.contains("0 free") && refused.contains("1 more with taints"),
            "{refused}"
        );
        let tolerating = |t: Value| DeviceRequest {
            count: 1,
            tolerations: vec![t],
            ..DeviceRequest::default()
        };
        let wrong = tolerating(json!({"key": "devicelet.io/unhealthy", "value": "xid-48"}));
        assert!(
            scheduler
                .allocate_claim_with("ns", "c3", "gpu.example.com", "node-c", &wrong)
                .is_err()
        );
        let exists = tolerating(json!({"key": "devicelet.io/unhealthy", "operator": "Exists"}));
        let sick = scheduler
            .allocate_claim_with("ns", "c4", "gpu.example.com", "node-c", &exists)
            .expect("tolerated");
        let result = &sick["status"]["allocation"]["devices"]["results"][0];
        assert_eq!(result["device"], "sick");
        assert_eq!(result["tolerations"][0]["operator"], "Exists");
        assert_eq!(
            sick["spec"]["devices"]["requests"][0]["exactly"]["tolerations"][0]["key"],
            "devicelet.io/unhealthy"
        );
        // The kubelet's wipe of node-a leaves node-b alone.
        assert_eq!(scheduler.wipe_slices("node-a", None), 2);
        assert_eq!(api.list(Kind::ResourceSlice).len(), 2);
    }

    /// A slice of node `node`'s pool for `gpu.example.com` holding `spec` (devices or counters).
    fn pool_slice(api: &ApiServer, node: &str, count: i64, spec: Value) {
        let mut body = json!({
            "metadata": {"generateName": format!("{node}-gpu-")},
            "spec": {
                "driver": "gpu.example.com",
                "nodeName": node,
                "pool": {"name": node, "generation": 1, "resourceSliceCount": count},
            }
        });
        for (k, v) in spec.as_object().expect("an object") {
            body["spec"][k] = v.clone();
        }
        api.create(Kind::ResourceSlice, "", body).expect("slice");
    }

    fn devices(claim: &Value) -> Vec<String> {
        claim["status"]["allocation"]["devices"]["results"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|r| r["device"].as_str().unwrap_or_default().to_owned())
            .collect()
    }

    #[tokio::test]
    async fn partitions_are_allocated_while_their_gpus_counters_last() {
        let api = ApiServer::start().await.expect("api");
        let scheduler = api.handle();
        let consumes = |memory: &str, slices: i64| {
            json!([{"counterSet": "gpu-0", "counters": {
                "memory": {"value": memory}, "slices": {"value": slices.to_string()}
            }}])
        };
        // The counters in a slice of their own, as the API wants them from 1.35.
        pool_slice(
            &api,
            "node-a",
            2,
            json!({"sharedCounters": [{"name": "gpu-0", "counters": {
                "memory": {"value": "40Gi"}, "slices": {"value": "7"}
            }}]}),
        );
        pool_slice(
            &api,
            "node-a",
            2,
            json!({"devices": [
                {"name": "gpu-0", "consumesCounters": consumes("40Gi", 7)},
                {"name": "gpu-0-3g-0", "consumesCounters": consumes("20Gi", 3)},
                {"name": "gpu-0-3g-4", "consumesCounters": consumes("20Gi", 3)},
                {"name": "gpu-0-1g-0", "consumesCounters": consumes("5Gi", 1)},
            ]}),
        );
        let one = |name: &str| scheduler.allocate_claim("ns", name, "gpu.example.com", "node-a", 1);
        // The whole GPU first: it takes every counter, so nothing else fits after it.
        assert_eq!(devices(&one("whole").expect("the whole GPU")), ["gpu-0"]);
        let full = one("more").unwrap_err();
        assert!(full.contains("cannot allocate 1 device(s)"), "{full}");
        api.delete(Kind::ResourceClaim, "ns", "whole");
        // Partitions: two 3g (6 of 7 slices, 40Gi of memory), then no 1g (no memory left).
        let two = DeviceRequest {
            count: 2,
            ..DeviceRequest::default()
        };
        let both = scheduler
            .allocate_claim_with("ns", "two", "gpu.example.com", "node-a", &two)
            .expect("two 3g partitions");
        assert_eq!(
            devices(&both),
            ["gpu-0-3g-0", "gpu-0-3g-4"],
            "not the whole GPU: it would leave no room for a second"
        );
        assert!(one("small").is_err(), "the memory is used up");
        api.delete(Kind::ResourceClaim, "ns", "two");
        assert_eq!(devices(&one("small").expect("room again")), ["gpu-0"]);

        // A device consuming a counter set the pool does not define makes the pool invalid.
        pool_slice(
            &api,
            "node-b",
            1,
            json!({"devices": [{"name": "odd", "consumesCounters": [
                {"counterSet": "nowhere", "counters": {"memory": {"value": "1Gi"}}}
            ]}]}),
        );
        let invalid = scheduler
            .allocate_claim("ns", "odd", "gpu.example.com", "node-b", 1)
            .unwrap_err();
        assert!(
            invalid.contains("invalid resource pools were encountered: node-b: device odd consumes counter set \"nowhere\""),
            "{invalid}"
        );
    }

    #[tokio::test]
    async fn claims_share_a_device_by_capacity_until_it_is_used_up() {
        let api = ApiServer::start().await.expect("api");
        let scheduler = api.handle();
        pool_slice(
            &api,
            "node-a",
            1,
            json!({"devices": [{
                "name": "gpu-0",
                "allowMultipleAllocations": true,
                "capacity": {"memory": {"value": "40Gi", "requestPolicy": {
                    "default": "10Gi", "validRange": {"min": "1Gi", "max": "40Gi", "step": "1Gi"}
                }}}
            }, {"name": "small", "capacity": {"memory": {"value": "8Gi"}}}]}),
        );
        let asking = |memory: Option<&str>| DeviceRequest {
            count: 1,
            capacity: memory
                .map(|m| [("memory".to_owned(), m.to_owned())].into())
                .unwrap_or_default(),
            ..DeviceRequest::default()
        };
        let mut shares = std::collections::BTreeSet::new();
        // Four claims of 10Gi: the default, then asked for, then 9.5Gi rounded up to 10Gi.
        for (i, memory) in [None, Some("10Gi"), Some("9728Mi"), Some("10Gi")]
            .into_iter()
            .enumerate()
        {
            let claim = scheduler
                .allocate_claim_with(
                    "ns",
                    &format!("c{i}"),
                    "gpu.example.com",
                    "node-a",
                    &asking(memory),
                )
                .expect("a share of gpu-0");
            let result = &claim["status"]["allocation"]["devices"]["results"][0];
            assert_eq!(result["device"], "gpu-0");
            assert_eq!(result["consumedCapacity"]["memory"], "10Gi", "{result}");
            assert!(shares.insert(result["shareID"].as_str().expect("a share ID").to_owned()));
            assert_eq!(
                claim["spec"]["devices"]["requests"][0]["exactly"]["capacity"]["requests"],
                memory.map_or(json!(null), |m| json!({"memory": m}))
            );
        }
        // A fifth does not fit in gpu-0, nor in `small` (8Gi, not shared: its whole capacity).
        let fifth = scheduler
            .allocate_claim_with(
                "ns",
                "c4",
                "gpu.example.com",
                "node-a",
                &asking(Some("10Gi")),
            )
            .unwrap_err();
        assert!(
            fifth.contains("0 free") && fifth.contains("2 more without the capacity"),
            "{fifth}"
        );
        // Over the policy's max is no share at all; a small request still fits `small` whole.
        let over = scheduler
            .allocate_claim_with(
                "ns",
                "c5",
                "gpu.example.com",
                "node-a",
                &asking(Some("41Gi")),
            )
            .unwrap_err();
        assert!(over.contains("0 free"), "{over}");
        let whole = scheduler
            .allocate_claim_with(
                "ns",
                "c6",
                "gpu.example.com",
                "node-a",
                &asking(Some("4Gi")),
            )
            .expect("small, whole");
        let result = &whole["status"]["allocation"]["devices"]["results"][0];
        assert_eq!(result["device"], "small");
        assert!(result.get("shareID").is_none() && result.get("consumedCapacity").is_none());
        // One share gone, there is room for one more.
        api.delete(Kind::ResourceClaim, "ns", "c0");
        scheduler
            .allocate_claim_with("ns", "c7", "gpu.example.com", "node-a", &asking(None))
            .expect("room for one more share");
    }
}
