//! How `try --dra` and `simulate --dra` show what a DRA driver publishes and prepares.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde_json::Value;

use crate::kubelet::api::dra::v1::NodePrepareResourceResponse;
use devicelet_simulator::apiserver::{ApiServer, Kind};

/// The devices of `driver`'s slices, one line each with their attributes and taints.
pub fn published(api: &ApiServer, driver: &str) -> String {
    let mut text = String::new();
    for slice in api
        .list(Kind::ResourceSlice)
        .iter()
        .filter(|s| s["spec"]["driver"] == driver)
    {
        for device in slice["spec"]["devices"].as_array().into_iter().flatten() {
            let _ = write!(text, "\n  {}", device["name"].as_str().unwrap_or("?"));
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
            super::published(&api, "gpu.example.com"),
            "\n  gpu-0 index=0\n  gpu-1 TAINT devicelet.io/unhealthy=XID-79:NoSchedule"
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
