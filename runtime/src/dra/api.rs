//! The DRA front end's view of the Kubernetes API server: the ResourceClaims it prepares, the
//! ResourceSlices it publishes and the Node they belong to, through `kube` and the
//! `resource.k8s.io/v1` types of `k8s-openapi`. Every error names what was asked and keeps the
//! server's reason, so a claim's failure says why in the kubelet's event.

use std::path::Path;

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kube::api::{Api, DeleteParams, ListParams, PostParams, Preconditions};

/// The longest any one request to the API server may take.
pub const CALL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(15);

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
}

impl ApiError {
    fn of(what: impl Into<String>, e: kube::Error) -> ApiError {
        let what = what.into();
        match e {
            kube::Error::Api(status) => ApiError::Status {
                what,
                code: status.code,
                reason: status.reason.clone(),
                message: status.message.clone(),
            },
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

/// A client of one API server.
#[derive(Clone)]
pub struct ApiClient {
    client: kube::Client,
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
        let client = kube::Client::try_from(config)
            .map_err(|e| ApiError::Config(format!("building the client: {e}")))?;
        Ok(ApiClient { client })
    }

    /// The ResourceClaim `namespace/name`.
    pub async fn claim(&self, namespace: &str, name: &str) -> Result<ResourceClaim, ApiError> {
        Api::<ResourceClaim>::namespaced(self.client.clone(), namespace)
            .get(name)
            .await
            .map_err(|e| ApiError::of(format!("getting ResourceClaim {namespace}/{name}"), e))
    }

    /// The UID of Node `name`, which our slices name as their owner.
    pub async fn node_uid(&self, name: &str) -> Result<String, ApiError> {
        let node = Api::<Node>::all(self.client.clone())
            .get(name)
            .await
            .map_err(|e| ApiError::of(format!("getting Node {name}"), e))?;
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
        let params =
            ListParams::default().fields(&format!("spec.driver={driver},spec.nodeName={node}"));
        self.slices_api()
            .list(&params)
            .await
            .map(|list| list.items)
            .map_err(|e| {
                ApiError::of(
                    format!("listing the ResourceSlices of {driver} on {node}"),
                    e,
                )
            })
    }

    pub async fn create_slice(&self, slice: &ResourceSlice) -> Result<ResourceSlice, ApiError> {
        self.slices_api()
            .create(&PostParams::default(), slice)
            .await
            .map_err(|e| {
                ApiError::of(
                    format!("creating a ResourceSlice of {}", slice.spec.driver),
                    e,
                )
            })
    }

    /// Replaces a slice; its resourceVersion must be current (else a conflict).
    pub async fn replace_slice(&self, slice: &ResourceSlice) -> Result<ResourceSlice, ApiError> {
        let name = slice.metadata.name.clone().unwrap_or_default();
        self.slices_api()
            .replace(&name, &PostParams::default(), slice)
            .await
            .map_err(|e| ApiError::of(format!("updating ResourceSlice {name}"), e))
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
        match self.slices_api().delete(&name, &params).await {
            Ok(_) => Ok(()),
            Err(e) => {
                let e = ApiError::of(format!("deleting ResourceSlice {name}"), e);
                if e.is_not_found() { Ok(()) } else { Err(e) }
            }
        }
    }
}
