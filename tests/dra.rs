//! A node for DRA scenarios: the kubelet simulator with its plugin watcher and DRA plugin
//! manager, its API server stand-in holding the Node, and the agent serving DRA drivers there.

use devicelet::dra::api::ApiClient;
use devicelet_simulator::apiserver::{ApiServer, Kind};
use serde_json::json;

/// The agent's API client through a kubeconfig naming the stand-in, as `--kubeconfig` does.
pub async fn client(api: &ApiServer) -> (tempfile::TempDir, ApiClient) {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("kubeconfig");
    std::fs::write(&file, api.kubeconfig()).expect("kubeconfig");
    let client = ApiClient::connect(Some(&file)).await.expect("client");
    (dir, client)
}

/// A node whose kubelet watches `plugins_registry/` (its DRA plugin manager behind it), with an
/// API server holding the Node.
pub struct DraNode {
    pub node: crate::Node,
    pub kubelet: devicelet_simulator::Simulator,
    pub api: ApiServer,
    registry: std::path::PathBuf,
}

/// The node's name: its pool's.
pub const NODE: &str = "node-a";
/// How long after a driver's last endpoint goes the kubelet wipes its slices (30 s on a node).
pub const WIPE_DELAY: std::time::Duration = std::time::Duration::from_millis(500);

impl DraNode {
    pub async fn new() -> DraNode {
        DraNode::with_wipe(
            devicelet_simulator::DraWipe::Delayed,
            std::time::Duration::ZERO,
        )
        .await
    }

    /// A node whose kubelet wipes a deregistered driver's slices as `wipe` says: as 1.34 and
    /// later do ([`WIPE_DELAY`] here), or at once, as 1.32–1.33 do; and whose plugin watcher
    /// acts `registry_lag` after a socket event (the kubelet's reconciler: up to 1 s).
    pub async fn with_wipe(
        wipe: devicelet_simulator::DraWipe,
        registry_lag: std::time::Duration,
    ) -> DraNode {
        let node = crate::Node::new().await;
        node.add_char("/dev/fuse", 10, 229);
        let registry = node.dir.path().join("plugins_registry");
        let api = ApiServer::start().await.expect("API server");
        api.create(Kind::Node, "", json!({"metadata": {"name": NODE}}))
            .expect("node");
        let kubelet = devicelet_simulator::Simulator::start_with(
            &node.dir.path().join("kubelet").join("device-plugins"),
            devicelet_simulator::SimConfig {
                plugins_registry: Some(registry.clone()),
                dra_api: Some(devicelet_simulator::DraApi {
                    server: api.handle(),
                    node: NODE.into(),
                }),
                dra_wipe_delay: WIPE_DELAY,
                dra_wipe: wipe,
                registry_lag,
                ..devicelet_simulator::SimConfig::default()
            },
        )
        .await
        .expect("the kubelet");
        DraNode {
            node,
            kubelet,
            api,
            registry,
        }
    }

    /// The plugin watcher's directory, where DRA drivers' registration sockets go.
    pub fn registry_dir(&self) -> &std::path::Path {
        &self.registry
    }

    /// The kubelet's plugins directory, where DRA drivers' service sockets go.
    pub fn plugins_dir(&self) -> std::path::PathBuf {
        self.node.dir.path().join("kubelet").join("plugins")
    }

    /// The agent with `modules`, serving DRA for this node through this API server.
    pub async fn agent(&self, modules: &str) -> devicelet::agent::Agent {
        self.agent_with(modules, |_| {}).await
    }

    /// [`agent`](Self::agent), after letting `adjust` change its options.
    pub async fn agent_with(
        &self,
        modules: &str,
        adjust: impl FnOnce(&mut devicelet::agent::AgentOptions),
    ) -> devicelet::agent::Agent {
        let (kubeconfig, client) = client(&self.api).await;
        std::mem::forget(kubeconfig);
        let state = self.node.state_dir();
        let (registry, plugins) = (
            self.registry.clone(),
            self.node.dir.path().join("kubelet").join("plugins"),
        );
        let cdi = self.node.dir.path().join("cdi");
        self.node
            .start_agent_with(modules, move |o| {
                o.state_dir = Some(state.clone());
                o.dra = Some(devicelet::dra::driver::DraOptions {
                    registry_dir: registry,
                    plugins_dir: plugins,
                    node: NODE.into(),
                    api: Some(client),
                    state_dir: Some(state),
                    cdi_dir: cdi,
                    resync: std::time::Duration::from_millis(200),
                    events: Default::default(),
                    retirees: Default::default(),
                });
                adjust(o);
            })
            .await
    }

    /// The kubelet's NodePrepareResources to `driver` for one claim of team-a: that claim's
    /// entry.
    pub async fn prepare(
        &self,
        driver: &str,
        name: &str,
        uid: &str,
    ) -> devicelet::kubelet::api::dra::v1::NodePrepareResourceResponse {
        let mut answer = self
            .kubelet
            .node_prepare_resources(driver, vec![wire_claim(name, uid)])
            .await
            .expect("answered");
        answer.claims.remove(uid).expect("an entry for the claim")
    }

    /// A claim of team-a allocated `devices` of `driver` in this node's pool, as the scheduler
    /// leaves it: one request, named by the driver's first label (`fuse` for
    /// `fuse.devicelet.io`), for the DeviceClass named after the driver. Its UID.
    pub fn claim(
        &self,
        driver: &str,
        name: &str,
        devices: &[&str],
        config: serde_json::Value,
    ) -> String {
        let request = driver.split('.').next().unwrap_or(driver);
        let results: Vec<_> = devices
            .iter()
            .map(|d| json!({"request": request, "driver": driver, "pool": NODE, "device": d}))
            .collect();
        let created = self
            .api
            .create(
                Kind::ResourceClaim,
                "team-a",
                json!({
                    "metadata": {"name": name},
                    "spec": {"devices": {"requests": [{"name": request, "exactly": {"deviceClassName": driver}}]}},
                    "status": {"allocation": {"devices": {"results": results, "config": config}}}
                }),
            )
            .expect("claim");
        created["metadata"]["uid"]
            .as_str()
            .expect("uid")
            .to_string()
    }
}

impl DraNode {
    /// What claim `team-a/name`'s status says of `device`, once it says anything.
    pub async fn device_status(&self, name: &str, device: &str) -> serde_json::Value {
        crate::eventually_some("the claim's status", || {
            let claim = self.api.get(Kind::ResourceClaim, "team-a", name)?;
            claim["status"]["devices"]
                .as_array()?
                .iter()
                .find(|d| d["device"] == device)
                .cloned()
        })
        .await
    }
}

/// Waits until the API server holds a complete pool of `slices` slices: each at the same
/// generation, as many as each says the pool has. A publisher rewrites its slices one by one,
/// and the scheduler skips a pool caught between two generations.
pub async fn pool_complete(api: &ApiServer, slices: usize) {
    crate::eventually("a complete pool", || {
        let listed = api.list(Kind::ResourceSlice);
        let generations: std::collections::BTreeSet<_> = listed
            .iter()
            .map(|s| s["spec"]["pool"]["generation"].as_i64())
            .collect();
        listed.len() == slices
            && generations.len() == 1
            && listed
                .iter()
                .all(|s| s["spec"]["pool"]["resourceSliceCount"].as_u64() == Some(slices as u64))
    })
    .await;
}

/// A pool's two slices once both are published: the one holding its counter sets (the API
/// allows them only in a slice without devices), and the devices of the other.
pub async fn counters_and_devices(api: &ApiServer) -> (serde_json::Value, Vec<serde_json::Value>) {
    let slices = crate::eventually_some("a counters slice and a devices slice", || {
        let slices = api.list(Kind::ResourceSlice);
        (slices.len() == 2).then_some(slices)
    })
    .await;
    let counters = slices
        .iter()
        .find(|s| s["spec"]["sharedCounters"].is_array())
        .cloned()
        .expect("a counters slice");
    let devices = slices
        .iter()
        .find_map(|s| s["spec"]["devices"].as_array().cloned())
        .expect("a devices slice");
    (counters, devices)
}

/// The one slice of the API server, once it lists a device.
pub async fn published(api: &ApiServer) -> serde_json::Value {
    crate::eventually_some("a published slice with the device", || {
        let slices = api.list(Kind::ResourceSlice);
        match slices.as_slice() {
            [one]
                if one["spec"]["devices"]
                    .as_array()
                    .is_some_and(|d| !d.is_empty()) =>
            {
                Some(one.clone())
            }
            _ => None,
        }
    })
    .await
}

/// Waits until the kubelet registered the driver `count` times in all (once per agent start),
/// and holds it now.
pub async fn registered(kubelet: &devicelet_simulator::Simulator, count: usize) {
    kubelet
        .wait_registry(crate::WAIT, |a| {
            a.iter().filter(|a| a.registered()).count() >= count
        })
        .await
        .expect("registered");
    crate::eventually("the driver held by the kubelet", || {
        kubelet.dra_registrations().len() == 1
    })
    .await;
}

pub fn wire_claim(name: &str, uid: &str) -> devicelet::kubelet::api::dra::v1::Claim {
    devicelet::kubelet::api::dra::v1::Claim {
        namespace: "team-a".into(),
        uid: uid.into(),
        name: name.into(),
    }
}

/// Every request the agent made of the API server is one the ClusterRole in
/// `deploy/dra/rbac.yaml` allows: the manifests grant what the code asks.
pub fn assert_rbac_allows(api: &ApiServer) {
    use serde::Deserialize;
    let file = crate::workspace_root().join("deploy/dra/rbac.yaml");
    let text = std::fs::read_to_string(&file).expect("deploy/dra/rbac.yaml");
    let role = serde_yaml_ng::Deserializer::from_str(&text)
        .map(|doc| serde_json::Value::deserialize(doc).expect("YAML"))
        .find(|doc| doc["kind"] == "ClusterRole")
        .expect("a ClusterRole");
    let has = |list: &serde_json::Value, want: &str| {
        list.as_array()
            .is_some_and(|l| l.iter().any(|v| v == want || v == "*"))
    };
    let requests = api.rbac_requests();
    assert!(
        !requests.is_empty(),
        "the agent asked the API server nothing"
    );
    for (verb, group, resource) in requests {
        let allowed = role["rules"].as_array().is_some_and(|rules| {
            rules.iter().any(|r| {
                has(&r["apiGroups"], group)
                    && has(&r["resources"], &resource)
                    && has(&r["verbs"], &verb)
            })
        });
        assert!(
            allowed,
            "{}: the agent's {verb} of {resource} is not allowed",
            file.display(),
        );
    }
}

/// The devices the API server's one slice lists; None unless there is exactly one slice.
fn one_slice_devices(api: &ApiServer) -> Option<Vec<serde_json::Value>> {
    let slices = api.list(Kind::ResourceSlice);
    let [one] = slices.as_slice() else {
        return None;
    };
    Some(
        one["spec"]["devices"]
            .as_array()
            .cloned()
            .unwrap_or_default(),
    )
}

/// The names of the devices the API server's one slice lists.
pub fn slice_devices(api: &ApiServer) -> Option<Vec<String>> {
    let devices = one_slice_devices(api)?;
    Some(
        devices
            .iter()
            .filter_map(|d| d["name"].as_str().map(str::to_owned))
            .collect(),
    )
}

/// Each device of the API server's one slice with its taints as `key:effect`.
pub fn slice_taints(api: &ApiServer) -> Option<Vec<(String, Vec<String>)>> {
    let devices = one_slice_devices(api)?;
    let text = |v: &serde_json::Value| v.as_str().unwrap_or_default().to_owned();
    Some(
        devices
            .iter()
            .map(|d| {
                let taints = d["taints"].as_array().into_iter().flatten();
                let taints = taints
                    .map(|t| format!("{}:{}", text(&t["key"]), text(&t["effect"])))
                    .collect();
                (text(&d["name"]), taints)
            })
            .collect(),
    )
}
