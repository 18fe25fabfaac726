//! What the rest of the control plane does to a node's DRA objects, as the node sees it: the
//! scheduler allocating a claim devices from the node's published pools (the structured
//! allocator reduced to "N devices of a driver on this node"), and the kubelet wiping the node's
//! ResourceSlices (at its start, and 30 s after a driver's last endpoint goes).

use std::collections::{BTreeMap, BTreeSet};

use serde_json::{Value, json};

use crate::apiserver::{ApiHandle, Kind};

impl ApiHandle {
    /// Deletes the ResourceSlices of `node` (of `driver` only, when given), as the kubelet's
    /// `DeleteCollection` with field selector `spec.nodeName=<node>[,spec.driver=<driver>]`
    /// does; how many went.
    pub fn wipe_slices(&self, node: &str, driver: Option<&str>) -> usize {
        let mut store = self.lock();
        let before = store.objects.len();
        store.objects.retain(|(kind, _, _), object| {
            !(*kind == Kind::ResourceSlice
                && object["spec"]["nodeName"] == node
                && driver.is_none_or(|d| object["spec"]["driver"] == d))
        });
        let wiped = before - store.objects.len();
        if wiped > 0 {
            store.next_version();
        }
        wiped
    }

    /// Allocates `count` devices of `driver` on `node` to a new ResourceClaim
    /// `namespace/name`, as the scheduler does: only from complete pools (every slice of the
    /// pool's newest generation present), only devices no other claim was allocated (admin
    /// access aside) and whose taints the claim tolerates (it has no tolerations here; see
    /// [`allocate_claim_tolerating`](Self::allocate_claim_tolerating)), in slice order. The claim
    /// has one request named after the driver's first label (`gpu` for `gpu.example.com`) for
    /// the DeviceClass named after the driver, and its allocation results in `status`. Err says
    /// why nothing could be allocated.
    pub fn allocate_claim(
        &self,
        namespace: &str,
        name: &str,
        driver: &str,
        node: &str,
        count: usize,
    ) -> Result<Value, String> {
        self.allocate_claim_tolerating(namespace, name, driver, node, count, &[])
    }

    /// [`allocate_claim`](Self::allocate_claim) for a request with `tolerations`
    /// (`DeviceToleration` objects): a device with a `NoSchedule` or `NoExecute` taint is
    /// allocated only if one of them tolerates it, and the results carry them, as the
    /// structured allocator does.
    pub fn allocate_claim_tolerating(
        &self,
        namespace: &str,
        name: &str,
        driver: &str,
        node: &str,
        count: usize,
        tolerations: &[Value],
    ) -> Result<Value, String> {
        let mut store = self.lock();
        let selector = [
            ("spec.driver".to_owned(), driver.to_owned()),
            ("spec.nodeName".to_owned(), node.to_owned()),
        ];
        let slices = store.list(Kind::ResourceSlice, None, &selector);
        let mut pools: BTreeMap<String, Vec<&Value>> = BTreeMap::new();
        for slice in &slices {
            let pool = slice["spec"]["pool"]["name"].as_str().unwrap_or_default();
            pools.entry(pool.to_owned()).or_default().push(slice);
        }
        let mut devices = Vec::new();
        let mut tainted = 0usize;
        for (pool, slices) in &pools {
            let newest = slices
                .iter()
                .filter_map(|s| s["spec"]["pool"]["generation"].as_i64())
                .max()
                .unwrap_or(0);
            let current: Vec<&&Value> = slices
                .iter()
                .filter(|s| s["spec"]["pool"]["generation"].as_i64() == Some(newest))
                .collect();
            let expected = current
                .first()
                .and_then(|s| s["spec"]["pool"]["resourceSliceCount"].as_u64())
                .unwrap_or(0);
            if current.len() as u64 != expected {
                continue;
            }
            for slice in current {
                for device in slice["spec"]["devices"].as_array().into_iter().flatten() {
                    if let Some(name) = device["name"].as_str() {
                        let untolerated =
                            device["taints"].as_array().into_iter().flatten().any(|t| {
                                binding(t) && !tolerations.iter().any(|o| tolerates(o, t))
                            });
                        if untolerated {
                            tainted += 1;
                        } else {
                            devices.push((pool.clone(), name.to_owned()));
                        }
                    }
                }
            }
        }
        let taken: BTreeSet<(String, String)> = store
            .list(Kind::ResourceClaim, None, &[])
            .iter()
            .flat_map(|claim| {
                claim["status"]["allocation"]["devices"]["results"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default()
            })
            .filter(|r| r["driver"] == driver && r["adminAccess"] != true)
            .filter_map(|r| {
                Some((
                    r["pool"].as_str()?.to_owned(),
                    r["device"].as_str()?.to_owned(),
                ))
            })
            .collect();
        let free: Vec<(String, String)> =
            devices.into_iter().filter(|d| !taken.contains(d)).collect();
        if free.len() < count {
            return Err(format!(
                "cannot allocate {count} device(s) of driver {driver} on node {node}: {} free in \
                 its complete pools{}",
                free.len(),
                if tainted > 0 {
                    format!(" ({tainted} more with taints the claim does not tolerate)")
                } else {
                    String::new()
                }
            ));
        }
        let request = driver.split('.').next().unwrap_or(driver);
        let results: Vec<Value> = free
            .iter()
            .take(count)
            .map(|(pool, device)| {
                let mut result =
                    json!({"request": request, "driver": driver, "pool": pool, "device": device});
                if !tolerations.is_empty() {
                    result["tolerations"] = json!(tolerations);
                }
                result
            })
            .collect();
        let mut exactly = json!({"deviceClassName": driver, "count": count});
        if !tolerations.is_empty() {
            exactly["tolerations"] = json!(tolerations);
        }
        store
            .create(
                Kind::ResourceClaim,
                namespace,
                json!({
                    "metadata": {"name": name},
                    "spec": {"devices": {"requests": [{"name": request, "exactly": exactly}]}},
                    "status": {"allocation": {
                        "devices": {"results": results},
                        "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                            {"key": "metadata.name", "operator": "In", "values": [node]}
                        ]}]}
                    }}
                }),
            )
            .map_err(|e| e.message)
    }
}

/// A taint the scheduler honours: `NoSchedule` and `NoExecute`; `None` and unknown effects
/// are informational.
fn binding(taint: &Value) -> bool {
    matches!(taint["effect"].as_str(), Some("NoSchedule" | "NoExecute"))
}

/// `resourceclaim.ToleratesTaint`: an empty effect or key matches any; `Exists` any value,
/// `Equal` (the default) the same value; another operator nothing.
fn tolerates(toleration: &Value, taint: &Value) -> bool {
    let text = |v: &Value| v.as_str().unwrap_or_default().to_owned();
    let (effect, key) = (text(&toleration["effect"]), text(&toleration["key"]));
    if !effect.is_empty() && effect != text(&taint["effect"]) {
        return false;
    }
    if !key.is_empty() && key != text(&taint["key"]) {
        return false;
    }
    match text(&toleration["operator"]).as_str() {
        "" | "Equal" => text(&toleration["value"]) == text(&taint["value"]),
        "Exists" => true,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use crate::apiserver::{ApiServer, Kind};
    use serde_json::json;

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
        let wrong = [json!({"key": "devicelet.io/unhealthy", "value": "xid-48"})];
        assert!(
            scheduler
                .allocate_claim_tolerating("ns", "c3", "gpu.example.com", "node-c", 1, &wrong)
                .is_err()
        );
        let tolerating = [json!({"key": "devicelet.io/unhealthy", "operator": "Exists"})];
        let sick = scheduler
            .allocate_claim_tolerating("ns", "c4", "gpu.example.com", "node-c", 1, &tolerating)
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
}
