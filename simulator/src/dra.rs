//! The kubelet's DRA plugin manager (`pkg/kubelet/cm/dra/plugin`, Kubernetes 1.34 to 1.36; the
//! sources are summarised in `docs/design/dra.md` §1), reached through the plugin watcher
//! (`watcher.rs`) for sockets whose `GetInfo` answers type `DRAPlugin`:
//!
//! - **ValidatePlugin** checks only the advertised services, never the driver name: the first
//!   entry of *the plugin's* list that the kubelet supports (`v1.DRAPlugin`, `v1beta1.DRAPlugin`)
//!   is the one used, so the plugin's order decides;
//! - **RegisterPlugin** keeps a list of endpoints per driver (a rolling update registers a second
//!   one beside the first); the same endpoint registered twice for a driver is refused. The
//!   connection is made at once, as the kubelet's `conn.Connect()` does, but a registration does
//!   not wait for it;
//! - calls go to the most recently registered endpoint that accepts connections, else the most
//!   recent one, each under the kubelet's 45 s deadline;
//! - **DeRegisterPlugin** (the registration socket removed) drops that endpoint only.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use tonic::transport::Channel;

use devicelet_api::dra::{self, v1, v1beta1};

/// Which of the kubelet's DRA services a registration uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DraService {
    /// `v1.DRAPlugin` (Kubernetes 1.34 and later).
    V1,
    /// `v1beta1.DRAPlugin`, which the kubelet converts to and from v1.
    V1beta1,
}

/// One registered endpoint of a DRA driver, as a test sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DraRegistration {
    pub driver: String,
    /// The path the kubelet dials (`PluginInfo.endpoint`, or the registration socket).
    pub endpoint: String,
    pub service: DraService,
}

/// One endpoint in the manager, with its client.
struct Plugin {
    registration: DraRegistration,
    channel: Channel,
    /// Order of registration across drivers: the newest usable one serves.
    seq: u64,
    /// The health stream the kubelet keeps open on it (1.36: on every plugin).
    health: Option<tokio::task::AbortHandle>,
}

impl Drop for Plugin {
    fn drop(&mut self) {
        if let Some(task) = self.health.take() {
            task.abort();
        }
    }
}

/// One device's health as the driver last reported it on its health stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DraDeviceHealth {
    pub pool: String,
    pub device: String,
    /// `Healthy`, `Unhealthy` or `Unknown`.
    pub health: String,
    pub message: String,
}

/// The kubelet's per-driver lists of endpoints.
#[derive(Default)]
pub(super) struct DraState {
    drivers: BTreeMap<String, Vec<Plugin>>,
    next_seq: u64,
    /// The last complete health report of each driver.
    pub health: BTreeMap<String, Vec<DraDeviceHealth>>,
    /// Drivers whose slices are to be wiped (their last endpoint went), each with the token of
    /// its one pending wipe; a registration cancels it.
    pub pending_wipes: BTreeMap<String, u64>,
    /// The DRA manager's claims, by UID (`dra_pods.rs`).
    pub claims: BTreeMap<String, super::dra_pods::ClaimInfo>,
}

/// The DRA handler's `ValidatePlugin`, with the kubelet's wording: the service to use, chosen in
/// the plugin's order.
pub(super) fn validate(
    driver: &str,
    endpoint: &str,
    versions: &[String],
) -> Result<DraService, String> {
    let chosen = if versions.is_empty() {
        Err("empty list of supported gRPC services (aka supported versions)".to_string())
    } else {
        versions
            .iter()
            .find_map(|v| match v.as_str() {
                "v1.DRAPlugin" => Some(DraService::V1),
                "v1beta1.DRAPlugin" => Some(DraService::V1beta1),
                _ => None,
            })
            .ok_or_else(|| {
                format!(
                    "none of services supported by the plugin ({}) are supported by the kubelet ({})",
                    go_quoted(versions),
                    go_quoted(&dra::SUPPORTED_VERSIONS)
                )
            })
    };
    chosen.map_err(|e| {
        format!("invalid supported gRPC versions of DRA driver plugin {driver} at endpoint {endpoint}: {e}")
    })
}

/// A string list as Go's `%q` prints it: `["a" "b"]`.
fn go_quoted<S: AsRef<str>>(items: &[S]) -> String {
    let quoted: Vec<String> = items.iter().map(|s| format!("{:?}", s.as_ref())).collect();
    format!("[{}]", quoted.join(" "))
}

impl DraState {
    /// `RegisterPlugin`: adds the endpoint to the driver's list and starts connecting to it.
    pub(super) fn register(&mut self, registration: DraRegistration) -> Result<(), String> {
        let list = self.drivers.entry(registration.driver.clone()).or_default();
        if list
            .iter()
            .any(|p| p.registration.endpoint == registration.endpoint)
        {
            return Err(format!(
                "endpoint {} already registered for DRA driver plugin {}",
                registration.endpoint, registration.driver
            ));
        }
        let channel = devicelet_api::uds::connect_lazy(Path::new(&registration.endpoint));
        self.pending_wipes.remove(&registration.driver);
        self.next_seq += 1;
        list.push(Plugin {
            registration,
            channel,
            seq: self.next_seq,
            health: None,
        });
        Ok(())
    }

    /// Records the health stream's task for the endpoint, which ends with its registration.
    pub(super) fn watching(
        &mut self,
        driver: &str,
        endpoint: &str,
        task: tokio::task::AbortHandle,
    ) {
        match self
            .drivers
            .get_mut(driver)
            .and_then(|l| l.iter_mut().find(|p| p.registration.endpoint == endpoint))
        {
            Some(plugin) => plugin.health = Some(task),
            None => task.abort(),
        }
    }

    /// `DeRegisterPlugin`: drops that endpoint of the driver; true if it was registered.
    pub(super) fn deregister(&mut self, driver: &str, endpoint: &str) -> bool {
        let Some(list) = self.drivers.get_mut(driver) else {
            return false;
        };
        let before = list.len();
        list.retain(|p| p.registration.endpoint != endpoint);
        let removed = list.len() != before;
        if list.is_empty() {
            self.drivers.remove(driver);
            self.health.remove(driver);
        }
        removed
    }

    /// Queues a wipe of `driver`'s slices: its token, or None when one is queued already (its
    /// deadline stands, as the kubelet's does).
    pub(super) fn queue_wipe(&mut self, driver: &str) -> Option<u64> {
        if self.pending_wipes.contains_key(driver) {
            return None;
        }
        self.next_seq += 1;
        self.pending_wipes.insert(driver.to_owned(), self.next_seq);
        Some(self.next_seq)
    }

    /// Whether the wipe `token` of `driver` is still due; if so it is taken off the queue.
    pub(super) fn wipe_due(&mut self, driver: &str, token: u64) -> bool {
        let due = self.pending_wipes.get(driver) == Some(&token);
        if due {
            self.pending_wipes.remove(driver);
        }
        due
    }

    /// Whether `driver` has an endpoint registered.
    pub(super) fn has(&self, driver: &str) -> bool {
        self.drivers.contains_key(driver)
    }

    /// Every registered endpoint, by driver and then in registration order.
    pub(super) fn registrations(&self) -> Vec<DraRegistration> {
        self.drivers
            .values()
            .flat_map(|list| list.iter().map(|p| p.registration.clone()))
            .collect()
    }

    /// The endpoints of `driver`, newest first, with their clients: the caller tries them in
    /// that order (connecting is not done under the lock).
    fn candidates(&self, driver: &str) -> Vec<(DraRegistration, Channel)> {
        let mut list: Vec<&Plugin> = self.drivers.get(driver).into_iter().flatten().collect();
        list.sort_by_key(|p| std::cmp::Reverse(p.seq));
        list.into_iter()
            .map(|p| (p.registration.clone(), p.channel.clone()))
            .collect()
    }
}

/// The plugin a call for `driver` goes to: the newest endpoint that accepts connections, else the
/// newest. Errors as the kubelet's `GetPlugin` words them.
async fn pick(inner: &super::Inner, driver: &str) -> Result<(DraRegistration, Channel), String> {
    if driver.is_empty() {
        return Err("DRA driver name is empty".into());
    }
    let candidates = inner.lock().dra.candidates(driver);
    let newest = candidates
        .first()
        .cloned()
        .ok_or_else(|| format!("DRA driver {driver} is not registered"))?;
    for candidate in candidates {
        if tokio::net::UnixStream::connect(&candidate.0.endpoint)
            .await
            .is_ok()
        {
            return Ok(candidate);
        }
    }
    Ok(newest)
}

pub(super) async fn prepare(
    inner: &super::Inner,
    driver: &str,
    claims: Vec<v1::Claim>,
    deadline: Duration,
) -> Result<v1::NodePrepareResourcesResponse, String> {
    let (registration, channel) = pick(inner, driver).await?;
    let call = async {
        match registration.service {
            DraService::V1 => {
                let request = with_deadline(v1::NodePrepareResourcesRequest { claims }, deadline);
                v1::dra_plugin_client::DraPluginClient::new(channel)
                    .node_prepare_resources(request)
                    .await
                    .map(|r| r.into_inner())
            }
            DraService::V1beta1 => {
                let claims = claims.into_iter().map(Into::into).collect();
                let request =
                    with_deadline(v1beta1::NodePrepareResourcesRequest { claims }, deadline);
                v1beta1::dra_plugin_client::DraPluginClient::new(channel)
                    .node_prepare_resources(request)
                    .await
                    .map(|r| r.into_inner().into())
            }
        }
    };
    answer(driver, "NodePrepareResources", deadline, call).await
}

pub(super) async fn unprepare(
    inner: &super::Inner,
    driver: &str,
    claims: Vec<v1::Claim>,
    deadline: Duration,
) -> Result<v1::NodeUnprepareResourcesResponse, String> {
    let (registration, channel) = pick(inner, driver).await?;
    let call = async {
        match registration.service {
            DraService::V1 => {
                let request = with_deadline(v1::NodeUnprepareResourcesRequest { claims }, deadline);
                v1::dra_plugin_client::DraPluginClient::new(channel)
                    .node_unprepare_resources(request)
                    .await
                    .map(|r| r.into_inner())
            }
            DraService::V1beta1 => {
                let claims = claims.into_iter().map(Into::into).collect();
                let request =
                    with_deadline(v1beta1::NodeUnprepareResourcesRequest { claims }, deadline);
                v1beta1::dra_plugin_client::DraPluginClient::new(channel)
                    .node_unprepare_resources(request)
                    .await
                    .map(|r| r.into_inner().into())
            }
        }
    };
    answer(driver, "NodeUnprepareResources", deadline, call).await
}

fn with_deadline<T>(message: T, deadline: Duration) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request.set_timeout(deadline);
    request
}

/// The call's answer, or why there is none in the kubelet's words (its status, the deadline).
async fn answer<T>(
    driver: &str,
    what: &str,
    deadline: Duration,
    call: impl std::future::Future<Output = Result<T, tonic::Status>>,
) -> Result<T, String> {
    match tokio::time::timeout(deadline, call).await {
        Ok(Ok(answer)) => Ok(answer),
        Ok(Err(status)) => Err(format!(
            "{what} for DRA driver {driver}: rpc error: code = {:?} desc = {}",
            status.code(),
            status.message()
        )),
        Err(_) => Err(format!(
            "{what} for DRA driver {driver}: context deadline exceeded (no answer within {deadline:?})"
        )),
    }
}

/// The kubelet's health stream on one endpoint (`NodeWatchResources`, opened for every DRA
/// plugin, retried every `retry` after it fails or ends, as the kubelet does every 5 s):
/// every report replaces the driver's recorded health.
pub(super) async fn watch_health(
    inner: std::sync::Arc<super::Inner>,
    driver: String,
    endpoint: String,
    retry: Duration,
) {
    use devicelet_api::dra::health::dra_resource_health_client::DraResourceHealthClient;
    use devicelet_api::dra::health::{HealthStatus, NodeWatchResourcesRequest};
    let channel = devicelet_api::uds::connect_lazy(Path::new(&endpoint));
    loop {
        let mut client = DraResourceHealthClient::new(channel.clone());
        if let Ok(stream) = client
            .node_watch_resources(NodeWatchResourcesRequest {})
            .await
        {
            let mut stream = stream.into_inner();
            while let Ok(Some(report)) = stream.message().await {
                let devices = report
                    .devices
                    .into_iter()
                    .map(|d| {
                        let id = d.device.unwrap_or_default();
                        DraDeviceHealth {
                            pool: id.pool_name,
                            device: id.device_name,
                            health: match HealthStatus::try_from(d.health) {
                                Ok(HealthStatus::Healthy) => "Healthy",
                                Ok(HealthStatus::Unhealthy) => "Unhealthy",
                                _ => "Unknown",
                            }
                            .to_string(),
                            message: d.message,
                        }
                    })
                    .collect();
                let mut registry = inner.lock();
                registry.dra.health.insert(driver.clone(), devices);
                inner.notify(None);
            }
        }
        tokio::time::sleep(retry).await;
    }
}
