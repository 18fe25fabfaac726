//! How `try --dra` and `simulate --dra` show what a DRA driver publishes and prepares.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde_json::Value;

use crate::kubelet::api::dra::v1::NodePrepareResourceResponse;
use devicelet_simulator::apiserver::{ApiServer, Kind};

/// The devices of `driver`'s slices on `node`, one line each with their attributes,
/// capacities (with what claims left of a shared one), counters consumed and taints; then each
/// counter set with what is left of it.
pub fn published(api: &ApiServer, driver: &str, node: &str) -> String {
    use devicelet_simulator::quantity::format as q;
    let left = api.handle().left(driver, node);
    let mut text = String::new();
    for slice in api
        .list(Kind::ResourceSlice)
        .iter()
        .filter(|s| s["spec"]["driver"] == driver && s["spec"]["nodeName"] == node)
    {
        let pool = slice["spec"]["pool"]["name"].as_str().unwrap_or_default();
        for device in slice["spec"]["devices"].as_array().into_iter().flatten() {
            let name = device["name"].as_str().unwrap_or("?");
            let _ = write!(text, "\n  {name}");
            let attributes: BTreeMap<&String, &Value> = device["attributes"]
                .as_object()
                .map(|a| a.iter().collect())
                .unwrap_or_default();
            for (name, value) in attributes {
                let value = value
                    .as_object()
                    .and_then(|v| v.values().next())
                    .map(|v| v.to_string())
                    .unwrap_or_default();
                let _ = write!(text, " {name}={value}");
            }
            let shared = left.capacity.get(&(pool.to_owned(), name.to_owned()));
            if shared.is_some() {
                text.push_str(" SHARED");
            }
            for (cap, value) in device["capacity"].as_object().into_iter().flatten() {
                let value = value["value"].as_str().unwrap_or("?");
                match shared.and_then(|s| s.get(cap)) {
                    Some((_, rest)) => {
                        let _ = write!(text, " {cap}={value} ({} left)", q(*rest));
                    }
                    None => {
                        let _ = write!(text, " {cap}={value}");
                    }
                }
            }
            for c in device["consumesCounters"].as_array().into_iter().flatten() {
                let counters: Vec<String> = c["counters"]
                    .as_object()
                    .into_iter()
                    .flatten()
                    .map(|(k, v)| format!("{k}={}", v["value"].as_str().unwrap_or("?")))
                    .collect();
                let set = c["counterSet"].as_str().unwrap_or("?");
                let _ = write!(text, " CONSUMES {set}{{{}}}", counters.join(" "));
            }
            for taint in device["taints"].as_array().into_iter().flatten() {
                let _ = write!(
                    text,
                    " TAINT {}={}:{}",
                    taint["key"].as_str().unwrap_or("?"),
                    taint["value"].as_str().unwrap_or(""),
                    taint["effect"].as_str().unwrap_or("?")
                );
            }
        }
    }
    for ((_, set), counters) in &left.counters {
        let amounts: Vec<String> = counters
            .iter()
            .map(|(k, (total, rest))| format!("{k}={} ({} left)", q(*total), q(*rest)))
            .collect();
        let _ = write!(text, "\n  COUNTERS {set}: {}", amounts.join(" "));
    }
    text
}

/// A prepared claim as `try` and `simulate` show it.
pub fn format_prepared(
    driver: &str,
    name: &str,
    uid: &str,
    prepared: &NodePrepareResourceResponse,
) -> String {
    let mut text = format!("claim default/{name} (UID {uid}) prepared by {driver}:");
    for d in &prepared.devices {
        let _ = write!(
            text,
            "\n  request {}: device {} in pool {}, CDI {}",
            d.request_names.join(","),
            d.device_name,
            d.pool_name,
            if d.cdi_device_ids.is_empty() {
                "-".to_owned()
            } else {
                d.cdi_device_ids.join(" ")
            }
        );
    }
    text
}

/// How long `try` and `simulate` wait for a prepared claim's status, which the driver writes
/// after answering the kubelet.
const STATUS_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// Claim `default/name`'s `status.devices` once the driver has written it (or why not), one
/// line per device.
pub async fn claim_status(api: &ApiServer, name: &str) -> String {
    let started = std::time::Instant::now();
    loop {
        let devices = api
            .get(Kind::ResourceClaim, "default", name)
            .and_then(|c| c["status"]["devices"].as_array().cloned())
            .unwrap_or_default();
        if !devices.is_empty() {
            return format_claim_status(&devices);
        }
        if started.elapsed() > STATUS_WAIT {
            return format!("\n  status: none written within {STATUS_WAIT:?}");
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

fn format_claim_status(devices: &[Value]) -> String {
    let mut text = String::new();
    for d in devices {
        let conditions: Vec<String> = d["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|c| {
                format!(
                    "{}={}",
                    c["type"].as_str().unwrap_or("?"),
                    c["status"].as_str().unwrap_or("?")
                )
            })
            .collect();
        let _ = write!(
            text,
            "\n  status of {}: {} data {}",
            d["device"].as_str().unwrap_or("?"),
            conditions.join(" "),
            d["data"]
        );
    }
    text
}

/// How many devices `driver`'s slices list.
pub fn device_count(api: &ApiServer, driver: &str) -> usize {
    api.list(Kind::ResourceSlice)
        .iter()
        .filter(|s| s["spec"]["driver"] == driver)
        .map(|s| s["spec"]["devices"].as_array().map_or(0, Vec::len))
        .sum()
}

#[cfg(test)]
mod tests {
    use devicelet_simulator::apiserver::{ApiServer, Kind};
    use serde_json::json;

    #[tokio::test]
    async fn a_tainted_device_is_shown_with_its_taint() {
        let api = ApiServer::start().await.expect("api");
        api.create(
            Kind::ResourceSlice,
            "",
            json!({
                "metadata": {"generateName": "n-"},
                "spec": {
                    "driver": "gpu.example.com",
                    "nodeName": "n",
                    "pool": {"name": "n", "generation": 1, "resourceSliceCount": 1},
                    "devices": [
                        {"name": "gpu-0", "attributes": {"index": {"int": 0}}},
                        {"name": "gpu-1", "taints": [
                            {"key": "devicelet.io/unhealthy", "value": "XID-79", "effect": "NoSchedule"}
                        ]}
                    ]
                }
            }),
        )
        .expect("slice");
        assert_eq!(
            super::published(&api, "gpu.example.com", "n"),
            "\n  gpu-0 index=0\n  gpu-1 TAINT devicelet.io/unhealthy=XID-79:NoSchedule"
        );
        // A pool with counters, a partition, and a device claims share by capacity: what is
        // left of each after one claim for a 10Gi share and one for the partition.
        let slice = |spec: serde_json::Value| {
            let mut body = json!({"metadata": {"generateName": "m-"}, "spec": {
                "driver": "mig.example.com", "nodeName": "n",
                "pool": {"name": "n", "generation": 1, "resourceSliceCount": 2}}});
            for (k, v) in spec.as_object().unwrap() {
                body["spec"][k] = v.clone();
            }
            api.create(Kind::ResourceSlice, "", body).expect("slice");
        };
        slice(
            json!({"sharedCounters": [{"name": "gpu-0", "counters": {"memory": {"value": "40Gi"}}}]}),
        );
        slice(json!({"devices": [
            {"name": "part", "consumesCounters": [{"counterSet": "gpu-0", "counters": {"memory": {"value": "10Gi"}}}]},
            {"name": "whole", "allowMultipleAllocations": true, "capacity": {"memory": {"value": "40Gi"}}}
        ]}));
        let scheduler = api.handle();
        scheduler
            .allocate_claim("default", "p", "mig.example.com", "n", 1)
            .expect("the partition");
        let share = devicelet_simulator::DeviceRequest {
            count: 1,
            capacity: [("memory".to_owned(), "10Gi".to_owned())].into(),
            ..Default::default()
        };
        scheduler
            .allocate_claim_with("default", "s", "mig.example.com", "n", &share)
            .expect("a share");
        assert_eq!(
            super::published(&api, "mig.example.com", "n"),
            "\n  part CONSUMES gpu-0{memory=10Gi}\n  whole SHARED memory=40Gi (30Gi left)\
             \n  COUNTERS gpu-0: memory=40Gi (30Gi left)"
        );
        let status = [
            json!({"device": "gpu-0", "conditions": [{"type": "Ready", "status": "True"}],
                             "data": {"deviceIDs": ["GPU-1"]}}),
        ];
        assert_eq!(
            super::format_claim_status(&status),
            "\n  status of gpu-0: Ready=True data {\"deviceIDs\":[\"GPU-1\"]}"
        );
        assert_eq!(
            super::claim_status(&api, "none").await,
            "\n  status: none written within 2s"
        );
    }
}
