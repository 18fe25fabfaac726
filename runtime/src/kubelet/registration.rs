//! Registering a served resource with the kubelet's `kubelet.sock`.

use std::path::Path;

use super::api::deviceplugin::{self as api, registration_client::RegistrationClient};
use super::uds;

#[derive(Debug, thiserror::Error)]
pub enum RegistrationError {
    #[error("cannot reach the kubelet at {path}: {source}")]
    Unreachable {
        path: String,
        source: tonic::transport::Error,
    },
    #[error("the kubelet refused to register {resource}: {status}")]
    Refused {
        resource: String,
        status: tonic::Status,
    },
    #[error("the kubelet did not answer Register within {0:?}")]
    Timeout(std::time::Duration),
}

/// Registers `resource`, served on `plugin_dir/endpoint`. The kubelet dials us back inside this
/// call, so the socket must already be serving.
pub async fn register(
    plugin_dir: &Path,
    endpoint: &str,
    resource: &str,
    options: api::DevicePluginOptions,
) -> Result<(), RegistrationError> {
    let kubelet = plugin_dir.join(api::KUBELET_SOCKET);
    let channel =
        uds::connect(&kubelet)
            .await
            .map_err(|source| RegistrationError::Unreachable {
                path: kubelet.display().to_string(),
                source,
            })?;
    RegistrationClient::new(channel)
        .register(api::RegisterRequest {
            version: api::VERSION.into(),
            endpoint: endpoint.into(),
            resource_name: resource.into(),
            options: Some(options),
        })
        .await
        .map_err(|status| RegistrationError::Refused {
            resource: resource.into(),
            status,
        })?;
    Ok(())
}
