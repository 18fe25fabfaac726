//! What one driver must prepare for a ResourceClaim: its allocation results for this driver, by
//! request, each with the opaque config meant for it. Everything here is checked against what
//! the kubelet asked for, because the claim is read from the API server and a claim naming
//! another node's devices, or replaced by another of the same name, must not be prepared.

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::{DeviceToleration, ResourceClaim};

use super::prepare::ClaimError;

/// The API's own limits on a claim (`resource.k8s.io/v1` validation): a claim beyond them never
/// came from a real API server, and is refused before it costs the agent anything.
const MAX_REQUESTS: usize = 32;
const MAX_RESULTS: usize = 32;
/// `status.allocation.devices.config`: the class's configs and the claim's, 32 each.
const MAX_CONFIGS: usize = 64;
const MAX_OPAQUE_PARAMETERS: usize = 10 << 10;
/// Tolerations copied into one allocation result (`DeviceTolerationsMaxLength`).
const MAX_TOLERATIONS: usize = 16;
/// Capacities one share can consume: a device has at most 32 attributes and capacities.
const MAX_CONSUMED: usize = 32;

/// Devices of one request (its base name: a subrequest `gpu/large` counts as `gpu`) and the
/// config that applies to them.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestWanted {
    pub request: String,
    /// Device names in this node's pool, in the order allocated.
    pub devices: Vec<String>,
    /// The opaque parameters meant for this driver and request, as JSON; empty when none.
    pub config: String,
    /// Allocated with admin access (monitoring a device that others use): it may be prepared
    /// while another claim holds the device.
    pub admin: bool,
    /// The tolerations the scheduler allocated each device with (those that have any): a
    /// device tainted unhealthy is prepared only for a claim that tolerates its taint.
    pub tolerations: BTreeMap<String, Vec<DeviceToleration>>,
    /// The shares of devices shared by capacity (`allowMultipleAllocations`) the request
    /// holds, in the order allocated: (device name, share ID, consumed capacity).
    pub shares: Vec<WantedShare>,
}

/// One share of a device several claims hold: the scheduler's `shareID` and what it counted
/// the claim as consuming.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WantedShare {
    pub device: String,
    pub share_id: String,
    /// (capacity, quantity), as the allocation result says.
    pub consumed: Vec<(String, String)>,
}

/// This driver's part of `claim`, which the kubelet asked for as `uid`; `pool` is this node's.
/// Err says why the claim cannot be prepared here, naming it.
pub fn wanted(
    claim: &ResourceClaim,
    uid: &str,
    driver: &str,
    pool: &str,
) -> Result<Vec<RequestWanted>, ClaimError> {
    wanted_by(claim, uid, driver, pool).map_err(ClaimError::Refused)
}

fn wanted_by(
    claim: &ResourceClaim,
    uid: &str,
    driver: &str,
    pool: &str,
) -> Result<Vec<RequestWanted>, String> {
    let namespace = claim.metadata.namespace.as_deref().unwrap_or("");
    let name = claim.metadata.name.as_deref().unwrap_or("");
    let at = format!("ResourceClaim {namespace}/{name}");
    let actual = claim.metadata.uid.as_deref().unwrap_or("");
    if actual != uid {
        return Err(format!(
            "{at} got replaced: the kubelet asked for UID {uid}, the API server has {actual}"
        ));
    }
    let devices = claim
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .and_then(|a| a.devices.as_ref())
        .ok_or_else(|| format!("{at} is not allocated"))?;
    let requests = claim
        .spec
        .devices
        .as_ref()
        .and_then(|d| d.requests.as_ref());
    let results = devices.results.as_deref().unwrap_or(&[]);
    let configs = devices.config.as_deref().unwrap_or(&[]);
    for (what, count, max) in [
        ("requests", requests.map_or(0, Vec::len), MAX_REQUESTS),
        ("allocation results", results.len(), MAX_RESULTS),
        ("allocation configs", configs.len(), MAX_CONFIGS),
    ] {
        if count > max {
            return Err(format!(
                "{at} has {count} {what}; the API allows at most {max}"
            ));
        }
    }
    for opaque in configs.iter().filter_map(|c| c.opaque.as_ref()) {
        let size = opaque.parameters.0.to_string().len();
        if opaque.driver == driver && size > MAX_OPAQUE_PARAMETERS {
            return Err(format!(
                "{at}: a config's parameters for {driver} are {size} bytes; the API allows at \
                 most {MAX_OPAQUE_PARAMETERS}"
            ));
        }
    }
    let mut wanted: Vec<RequestWanted> = Vec::new();
    for result in results {
        if result.driver != driver {
            continue;
        }
        if !result
            .request
            .split('/')
            .all(devicelet_api::names::is_dns1123_label)
            || result.request.split('/').count() > 2
        {
            return Err(format!(
                "{at}: request name {:?} is not a DNS label (or `request/subrequest` of two)",
                crate::text::cut(&result.request, 64)
            ));
        }
        if result.pool != pool {
            return Err(format!(
                "{at}: device {} is in pool {:?}, not this node's pool {pool:?}",
                result.device, result.pool
            ));
        }
        let tolerations = result.tolerations.clone().unwrap_or_default();
        if tolerations.len() > MAX_TOLERATIONS {
            return Err(format!(
                "{at}: device {} has {} tolerations; the API allows at most {MAX_TOLERATIONS}",
                crate::text::cut(&result.device, 64),
                tolerations.len()
            ));
        }
        let request = base(&result.request).to_string();
        let admin = result.admin_access == Some(true);
        let share = share_of(&at, result)?;
        let w = match wanted.iter().position(|w| w.request == request) {
            Some(i) => {
                let w = &mut wanted[i];
                // A second share of one device adds a share, not a device.
                if share.is_none() || !w.devices.contains(&result.device) {
                    w.devices.push(result.device.clone());
                }
                w.admin &= admin;
                w
            }
            None => {
                wanted.push(RequestWanted {
                    config: config_for(
                        devices.config.as_deref().unwrap_or(&[]),
                        driver,
                        &result.request,
                    ),
                    request,
                    devices: vec![result.device.clone()],
                    admin,
                    tolerations: BTreeMap::new(),
                    shares: Vec::new(),
                });
                let last = wanted.len() - 1;
                &mut wanted[last]
            }
        };
        if !tolerations.is_empty() {
            w.tolerations.insert(result.device.clone(), tolerations);
        }
        w.shares.extend(share);
    }
    if wanted.is_empty() {
        return Err(format!("{at} has no devices of driver {driver}"));
    }
    // One device allocated twice in a claim, by one request or by two: never from a real
    // scheduler but as shares (each with its own share ID), and the module would be asked
    // for it twice.
    let mut named = std::collections::BTreeSet::new();
    let mut shares = std::collections::BTreeSet::new();
    for w in &wanted {
        for device in &w.devices {
            let shared = w.shares.iter().any(|s| &s.device == device);
            if !shared && !named.insert(device) {
                return Err(format!(
                    "{at}: device {:?} is allocated twice",
                    crate::text::cut(device, 64)
                ));
            }
        }
    }
    for w in &wanted {
        for share in &w.shares {
            if named.contains(&share.device) || !shares.insert((&share.device, &share.share_id)) {
                return Err(format!(
                    "{at}: device {:?} is allocated twice (share {:?})",
                    crate::text::cut(&share.device, 64),
                    crate::text::cut(&share.share_id, 64)
                ));
            }
        }
    }
    Ok(wanted)
}

/// The share an allocation result holds of a device shared by capacity: Some when the scheduler
/// gave it a `shareID`. Its consumed capacity must be quantities, and few.
fn share_of(
    at: &str,
    result: &k8s_openapi::api::resource::v1::DeviceRequestAllocationResult,
) -> Result<Option<WantedShare>, String> {
    let Some(share_id) = &result.share_id else {
        return Ok(None);
    };
    let consumed = result.consumed_capacity.clone().unwrap_or_default();
    let bad = consumed
        .iter()
        .find(|(_, q)| devicelet_api::quantity::parse(&q.0).is_none_or(|v| v < 0));
    if share_id.is_empty() || share_id.len() > 64 || consumed.len() > MAX_CONSUMED || bad.is_some()
    {
        return Err(format!(
            "{at}: device {}'s share {:?} has an invalid ID or consumed capacity",
            crate::text::cut(&result.device, 64),
            crate::text::cut(share_id, 64)
        ));
    }
    Ok(Some(WantedShare {
        device: result.device.clone(),
        share_id: share_id.clone(),
        consumed: consumed.into_iter().map(|(k, q)| (k, q.0)).collect(),
    }))
}

/// `gpu` of `gpu/large`.
fn base(request: &str) -> &str {
    request.split('/').next().unwrap_or(request)
}

/// The last config for this driver that names the request (`gpu/large` itself, or its main
/// request `gpu`) or no request (class configs come before the claim's own, so the claim's
/// win), as dra-example-driver chooses.
fn config_for(
    configs: &[k8s_openapi::api::resource::v1::DeviceAllocationConfiguration],
    driver: &str,
    request: &str,
) -> String {
    let main = base(request);
    configs
        .iter()
        .filter(|c| {
            c.requests
                .as_ref()
                .is_none_or(|r| r.is_empty() || r.iter().any(|n| n == request || n == main))
        })
        .filter_map(|c| c.opaque.as_ref())
        .rfind(|o| o.driver == driver)
        .map(|o| o.parameters.0.to_string())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim(results: serde_json::Value, config: serde_json::Value) -> ResourceClaim {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "gpus", "namespace": "team", "uid": "u-1"},
            "spec": {"devices": {"requests": []}},
            "status": {"allocation": {"devices": {"results": results, "config": config}}}
        }))
        .expect("a claim")
    }

    fn result(request: &str, driver: &str, pool: &str, device: &str) -> serde_json::Value {
        serde_json::json!({"request": request, "driver": driver, "pool": pool, "device": device})
    }

    #[test]
    fn results_are_grouped_by_request_with_the_last_matching_config() {
        let c = claim(
            serde_json::json!([
                result("gpu", "gpu.example.com", "node-a", "gpu-0"),
                result("nic", "nic.example.com", "node-a", "eth-0"),
                result("gpu/large", "gpu.example.com", "node-a", "gpu-1"),
                result("other", "gpu.example.com", "node-a", "gpu-2"),
            ]),
            serde_json::json!([
                {"source": "FromClass", "opaque": {"driver": "gpu.example.com", "parameters": {"mode": "class"}}},
                {"source": "FromClaim", "requests": ["gpu"], "opaque": {"driver": "gpu.example.com", "parameters": {"mode": "claim"}}},
                {"source": "FromClaim", "requests": ["gpu"], "opaque": {"driver": "nic.example.com", "parameters": {"mode": "nic"}}},
            ]),
        );
        let wanted = wanted(&c, "u-1", "gpu.example.com", "node-a").expect("wanted");
        assert_eq!(
            wanted,
            [
                RequestWanted {
                    request: "gpu".into(),
                    devices: vec!["gpu-0".into(), "gpu-1".into()],
                    config: r#"{"mode":"claim"}"#.into(),
                    admin: false,
                    tolerations: BTreeMap::new(),
                    shares: Vec::new(),
                },
                RequestWanted {
                    request: "other".into(),
                    devices: vec!["gpu-2".into()],
                    config: r#"{"mode":"class"}"#.into(),
                    admin: false,
                    tolerations: BTreeMap::new(),
                    shares: Vec::new(),
                },
            ]
        );
    }

    #[test]
    fn a_replaced_unallocated_or_foreign_claim_is_refused_by_name() {
        let c = claim(
            serde_json::json!([result("gpu", "gpu.example.com", "node-b", "gpu-0")]),
            serde_json::json!([]),
        );
        let e = wanted(&c, "u-2", "gpu.example.com", "node-a")
            .unwrap_err()
            .to_string();
        assert!(e.contains("team/gpus got replaced"), "{e}");
        let e = wanted(&c, "u-1", "gpu.example.com", "node-a")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("is in pool \"node-b\", not this node's pool \"node-a\""),
            "{e}"
        );
        let e = wanted(&c, "u-1", "other.example.com", "node-a")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("has no devices of driver other.example.com"),
            "{e}"
        );
        let mut unallocated = c.clone();
        unallocated.status = None;
        let e = wanted(&unallocated, "u-1", "gpu.example.com", "node-a")
            .unwrap_err()
            .to_string();
        assert!(e.ends_with("team/gpus is not allocated"), "{e}");
    }

    #[test]
    fn a_claim_beyond_the_api_s_limits_or_with_a_bad_request_name_is_refused_by_name() {
        let many: Vec<_> = (0..33)
            .map(|i| result("gpu", "gpu.example.com", "node-a", &format!("gpu-{i}")))
            .collect();
        let c = claim(serde_json::json!(many), serde_json::json!([]));
        let e = wanted(&c, "u-1", "gpu.example.com", "node-a")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("has 33 allocation results; the API allows at most 32"),
            "{e}"
        );
        let big = "x".repeat(11 << 10);
        let c = claim(
            serde_json::json!([result("gpu", "gpu.example.com", "node-a", "gpu-0")]),
            serde_json::json!([{"source": "FromClaim", "opaque": {"driver": "gpu.example.com", "parameters": {"p": big}}}]),
        );
        let e = wanted(&c, "u-1", "gpu.example.com", "node-a")
            .unwrap_err()
            .to_string();
        assert!(e.contains("the API allows at most 10240"), "{e}");
        let twice = claim(
            serde_json::json!([
                result("a", "gpu.example.com", "node-a", "gpu-0"),
                result("b", "gpu.example.com", "node-a", "gpu-0"),
            ]),
            serde_json::json!([]),
        );
        let e = wanted(&twice, "u-1", "gpu.example.com", "node-a")
            .unwrap_err()
            .to_string();
        assert!(e.contains("device \"gpu-0\" is allocated twice"), "{e}");
        for bad in ["../../../x", "GPU", "a/b/c", "", "a b"] {
            let c = claim(
                serde_json::json!([result(bad, "gpu.example.com", "node-a", "gpu-0")]),
                serde_json::json!([]),
            );
            let e = wanted(&c, "u-1", "gpu.example.com", "node-a")
                .unwrap_err()
                .to_string();
            assert!(e.contains("is not a DNS label"), "{bad:?}: {e}");
        }
    }

    #[test]
    fn shares_of_one_device_are_one_device_with_each_share_and_a_repeated_share_is_refused() {
        let share = |request: &str, id: &str, memory: &str| {
            let mut r = result(request, "gpu.example.com", "node-a", "gpu-0");
            r["shareID"] = serde_json::json!(id);
            r["consumedCapacity"] = serde_json::json!({"memory": memory});
            r
        };
        let c = claim(
            serde_json::json!([share("gpu", "s-1", "10Gi"), share("gpu", "s-2", "5Gi")]),
            serde_json::json!([]),
        );
        let two = wanted(&c, "u-1", "gpu.example.com", "node-a").expect("two shares");
        assert_eq!(two[0].devices, ["gpu-0"]);
        assert_eq!(
            two[0]
                .shares
                .iter()
                .map(|s| (s.share_id.as_str(), s.consumed[0].1.as_str()))
                .collect::<Vec<_>>(),
            [("s-1", "10Gi"), ("s-2", "5Gi")]
        );
        for results in [
            serde_json::json!([share("gpu", "s-1", "1Gi"), share("gpu", "s-1", "1Gi")]),
            serde_json::json!([
                result("a", "gpu.example.com", "node-a", "gpu-0"),
                share("b", "s-1", "1Gi")
            ]),
            serde_json::json!([share("gpu", "s-1", "-1Gi")]),
        ] {
            let c = claim(results, serde_json::json!([]));
            let e = wanted(&c, "u-1", "gpu.example.com", "node-a")
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("allocated twice") || e.contains("invalid ID or consumed capacity"),
                "{e}"
            );
        }
    }
}
