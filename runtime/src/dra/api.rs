//! The DRA front end's view of the Kubernetes API server: the ResourceClaims it prepares, the
//! ResourceSlices it publishes and the Node they belong to, through `kube` and the
//! `resource.k8s.io/v1` types of `k8s-openapi`. Every error names what was asked and keeps the
//! server's reason, so a claim's failure says why in the kubelet's event.

use std::path::Path;

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
/// What [`ApiClient::watch_slices`] streams.
pub use kube::api::WatchEvent;
use kube::api::{
    Api, DeleteParams, ListParams, Patch, PatchParams, PostParams, Preconditions, WatchParams,
};
use tokio_stream::StreamExt;

/// The longest any one request to the API server may take, from its start to the last byte of
/// the answer.
pub const CALL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(15);
/// The most of one answer read, refused as it streams past it: well above any real object (etcd
/// stores at most 1.5 MiB of one; a claim holds at most 32 results and 32 configs of 10 KiB) and
/// above a list of one driver's slices on one node.
pub const MAX_ANSWER: usize = 4 << 20;

/// Why a request to the API server gave no object.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// No configuration to reach an API server (no kubeconfig, not in a cluster).
    #[error("no Kubernetes API server to talk to: {0}")]
    Config(String),
    /// The server answered with an error status.
    #[error("{what}: {message} ({reason}, HTTP {code})")]
    Status {
        what: String,
        code: u16,
        reason: String,
        message: String,
    },
    /// No answer: the server could not be reached, or the exchange broke.
    #[error("{what}: the API server did not answer: {message}")]
    Unreachable { what: String, message: String },
    /// No whole answer within [`CALL_TIMEOUT`].
    #[error("{what}: no whole answer from the API server within {CALL_TIMEOUT:?}")]
    Deadline { what: String },
    /// An answer larger than [`MAX_ANSWER`], refused before it was all read.
    #[error("{what}: the API server's answer is larger than {MAX_ANSWER} bytes; refused")]
    TooLarge { what: String },
}

/// Whether `e` is, or was caused by, the cap on an answer's size.
fn too_large(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(e);
    while let Some(e) = next {
        // By type; by its text where a layer between re-wrapped it as a string.
        if e.is::<http_body_util::LengthLimitError>() || e.to_string() == "length limit exceeded" {
            return true;
        }
        next = e.source();
    }
    false
}

/// `call` within [`CALL_TIMEOUT`], from its start to the last byte read.
async fn within<T>(
    what: impl FnOnce() -> String,
    call: impl Future<Output = Result<T, kube::Error>>,
) -> Result<T, ApiError> {
    match tokio::time::timeout(CALL_TIMEOUT, call).await {
        Ok(answer) => answer.map_err(|e| ApiError::of(what(), e)),
        Err(_) => Err(ApiError::Deadline { what: what() }),
    }
}

impl ApiError {
    fn of(what: impl Into<String>, e: kube::Error) -> ApiError {
        let what = what.into();
        match e {
            kube::Error::Api(status) => ApiError::Status {
                what,
                code: status.code,
                reason: crate::text::cut(&status.reason, 200),
                message: crate::text::cut(&status.message, 200),
            },
            other if too_large(&other) => ApiError::TooLarge { what },
            other => ApiError::Unreachable {
                what,
                message: other.to_string(),
            },
        }
    }

    /// 404: the object is not there.
    pub fn is_not_found(&self) -> bool {
        matches!(self, ApiError::Status { code: 404, .. })
    }

    /// 409: someone else wrote it first (a stale resourceVersion, a precondition).
    pub fn is_conflict(&self) -> bool {
        matches!(self, ApiError::Status { code: 409, .. })
    }
}

/// How long one watch of a driver's slices runs before the server ends it and it is opened
/// again from the last version seen.
pub const WATCH_WINDOW: std::time::Duration = std::time::Duration::from_secs(60);

/// The field selector of `driver`'s slices on `node`, as the kubelet-plugin helper selects them.
fn pool_selector(driver: &str, node: &str) -> String {
    format!("spec.driver={driver},spec.nodeName={node}")
}

/// A client of one API server.
#[derive(Clone)]
pub struct ApiClient {
    client: kube::Client,
    /// The same server for watches, whose answers may rest silent for a whole
    /// [`WATCH_WINDOW`].
    watcher: kube::Client,
}

impl std::fmt::Debug for ApiClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ApiClient")
    }
}

impl ApiClient {
    /// From `kubeconfig` when given (for running outside a cluster), else the pod's in-cluster
    /// service account. Connecting is lazy: an unreachable server fails the first request, not
    /// this.
    pub async fn connect(kubeconfig: Option<&Path>) -> Result<ApiClient, ApiError> {
        // Err: a provider is installed already, which is as good.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let mut config = match kubeconfig {
            Some(path) => {
                let file = kube::config::Kubeconfig::read_from(path)
                    .map_err(|e| ApiError::Config(format!("{}: {e}", path.display())))?;
                kube::Config::from_custom_kubeconfig(file, &Default::default())
                    .await
                    .map_err(|e| ApiError::Config(format!("{}: {e}", path.display())))?
            }
            None => kube::Config::incluster().map_err(|e| {
                ApiError::Config(format!(
                    "not in a cluster ({e}); give --kubeconfig to run outside one"
                ))
            })?,
        };
        // A server that stops answering must fail the call, not hold it: a claim's GET has to
        // fit in the kubelet's 45 s, and a stuck publisher would hold up stopping a driver.
        config.connect_timeout = Some(CALL_TIMEOUT);
        config.read_timeout = Some(CALL_TIMEOUT);
        config.write_timeout = Some(CALL_TIMEOUT);
        config.reset_reader_on_write = true;
        // Named in the API server's audit log and by API priority and fairness.
        config.headers.push((
            http::header::USER_AGENT,
            http::HeaderValue::from_static(devicelet_api::USER_AGENT),
        ));
        // Every answer's body capped as it streams: kube reads it whole before parsing.
        let cap = tower::util::MapResponseLayer::new(|r: http::Response<_>| {
            r.map(|body| http_body_util::Limited::new(body, MAX_ANSWER))
        });
        let build = |config: kube::Config| {
            kube::client::ClientBuilder::try_from(config)
                .map_err(|e| ApiError::Config(format!("building the client: {e}")))
                .map(|builder| builder.with_layer(&cap).build())
        };
        let client = build(config.clone())?;
        // A watch's stream is capped the same way (it is then opened again), and may be quiet
        // until the server ends it.
        config.read_timeout = Some(WATCH_WINDOW + CALL_TIMEOUT);
        let watcher = build(config)?;
        Ok(ApiClient { client, watcher })
    }

    /// Makes `devices` (`AllocatedDeviceStatus` objects) the entries of ResourceClaim
    /// `namespace/name`'s `status.devices` that `manager` owns, by server-side apply: entries
    /// other drivers applied stay, and this manager's entries left out are removed (so an
    /// empty list removes them all).
    pub async fn apply_claim_status(
        &self,
        namespace: &str,
        name: &str,
        manager: &str,
        devices: Vec<serde_json::Value>,
    ) -> Result<(), ApiError> {
        let api = Api::<ResourceClaim>::namespaced(self.client.clone(), namespace);
        let patch = serde_json::json!({
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name},
            "status": {"devices": devices},
        });
        let params = PatchParams::apply(manager).force();
        within(
            || format!("writing the status of ResourceClaim {namespace}/{name}"),
            api.patch_status(name, &params, &Patch::Apply(&patch)),
        )
        .await
        .map(|_| ())
    }

    /// The ResourceClaim `namespace/name`.
    pub async fn claim(&self, namespace: &str, name: &str) -> Result<ResourceClaim, ApiError> {
        let api = Api::<ResourceClaim>::namespaced(self.client.clone(), namespace);
        within(
            || format!("getting ResourceClaim {namespace}/{name}"),
            api.get(name),
        )
        .await
    }

    /// The UID of Node `name`, which our slices name as their owner.
    pub async fn node_uid(&self, name: &str) -> Result<String, ApiError> {
        let api = Api::<Node>::all(self.client.clone());
        let node = within(|| format!("getting Node {name}"), api.get(name)).await?;
        node.metadata.uid.ok_or_else(|| ApiError::Status {
            what: format!("getting Node {name}"),
            code: 200,
            reason: "NoUID".into(),
            message: "the Node has no metadata.uid".into(),
        })
    }

    fn slices_api(&self) -> Api<ResourceSlice> {
        Api::all(self.client.clone())
    }

    /// The slices of `driver` on `node`, as the kubelet-plugin helper selects them.
    pub async fn slices(&self, driver: &str, node: &str) -> Result<Vec<ResourceSlice>, ApiError> {
        let params = ListParams::default().fields(&pool_selector(driver, node));
        let api = self.slices_api();
        within(
            || format!("listing the ResourceSlices of {driver} on {node}"),
            api.list(&params),
        )
        .await
        .map(|list| list.items)
    }

    /// The version of the API server's list of `driver`'s slices on `node`: where a watch of
    /// them starts.
    pub async fn slices_version(&self, driver: &str, node: &str) -> Result<String, ApiError> {
        let params = ListParams::default().fields(&pool_selector(driver, node));
        let api = self.slices_api();
        let list = within(
            || format!("listing the ResourceSlices of {driver} on {node}"),
            api.list(&params),
        )
        .await?;
        Ok(list.metadata.resource_version.unwrap_or_default())
    }

    /// Changes to `driver`'s slices on `node` after `version`, until the server ends the watch
    /// (it is asked to after [`WATCH_WINDOW`]; the caller holds it to that).
    pub async fn watch_slices(
        &self,
        driver: &str,
        node: &str,
        version: &str,
    ) -> Result<
        impl tokio_stream::Stream<Item = Result<WatchEvent<ResourceSlice>, ApiError>> + use<>,
        ApiError,
    > {
        let what = format!("watching the ResourceSlices of {driver} on {node}");
        let params = WatchParams::default()
            .fields(&pool_selector(driver, node))
            .timeout(WATCH_WINDOW.as_secs() as u32);
        let api = Api::<ResourceSlice>::all(self.watcher.clone());
        let events = within(|| what.clone(), api.watch(&params, version)).await?;
        Ok(events.map(move |event| event.map_err(|e| ApiError::of(what.clone(), e))))
    }

    pub async fn create_slice(&self, slice: &ResourceSlice) -> Result<ResourceSlice, ApiError> {
        let api = self.slices_api();
        within(
            || format!("creating a ResourceSlice of {}", slice.spec.driver),
            api.create(&PostParams::default(), slice),
        )
        .await
    }

    /// Replaces a slice; its resourceVersion must be current (else a conflict).
    pub async fn replace_slice(&self, slice: &ResourceSlice) -> Result<ResourceSlice, ApiError> {
        let name = slice.metadata.name.clone().unwrap_or_default();
        let api = self.slices_api();
        within(
            || format!("updating ResourceSlice {name}"),
            api.replace(&name, &PostParams::default(), slice),
        )
        .await
    }

    /// Deletes a slice if it is still the one we saw (UID and resourceVersion); one already gone
    /// is fine.
    pub async fn delete_slice(&self, slice: &ResourceSlice) -> Result<(), ApiError> {
        let name = slice.metadata.name.clone().unwrap_or_default();
        let params = DeleteParams {
            preconditions: Some(Preconditions {
                uid: slice.metadata.uid.clone(),
                resource_version: slice.metadata.resource_version.clone(),
            }),
            ..DeleteParams::default()
        };
        let api = self.slices_api();
        match within(
            || format!("deleting ResourceSlice {name}"),
            api.delete(&name, &params),
        )
        .await
        {
            Ok(_) => Ok(()),
            Err(e) if e.is_not_found() => Ok(()),
            Err(e) => Err(e),
        }
    }
}
