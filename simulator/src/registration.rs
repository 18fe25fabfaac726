//! The simulated kubelet's `v1beta1.Registration` service (KUBELET.md §1–4, 8).
//!
//! `Register` is synchronous, as in the kubelet: it validates the request, dials the plugin's
//! socket, calls `GetDevicePluginOptions`, and only then answers. A plugin that registers before
//! it serves, or whose options call fails, gets an error back. The ListAndWatch consumer is
//! started in the background once the registration is recorded.

use std::sync::Arc;

use tonic::{Request, Response, Status};
use tracing::{info, warn};

use devicelet_api::deviceplugin::registration_server::Registration;
use devicelet_api::deviceplugin::{Empty, RegisterRequest, VERSION};

use super::events::SimEvent;
use super::{Inner, endpoint};
use devicelet_api::names;

/// Serves `Register` for one incarnation of the simulated kubelet (`epoch`): a registration
/// still in flight when the kubelet restarts is refused rather than recorded.
pub(super) struct RegistrationService {
    pub inner: Arc<Inner>,
    pub epoch: u64,
}

#[tonic::async_trait]
impl Registration for RegistrationService {
    async fn register(&self, request: Request<RegisterRequest>) -> Result<Response<Empty>, Status> {
        let request = request.into_inner();
        info!(
            "registration request for resource {:?} at endpoint {:?} (version {:?})",
            request.resource_name, request.endpoint, request.version
        );
        match self.register_plugin(&request).await {
            Ok(()) => Ok(Response::new(Empty {})),
            Err(status) => {
                warn!(
                    "refused registration of resource {:?} at endpoint {:?}: {}",
                    request.resource_name,
                    request.endpoint,
                    status.message()
                );
                self.inner.notify(Some(SimEvent::Rejected {
                    resource: request.resource_name.clone(),
                    endpoint: request.endpoint.clone(),
                    reason: status.message().to_owned(),
                }));
                Err(status)
            }
        }
    }
}

impl RegistrationService {
    async fn register_plugin(&self, request: &RegisterRequest) -> Result<(), Status> {
        let resource = request.resource_name.as_str();
        validate(request)?;

        let inner = &self.inner;
        let socket = inner.dir.join(&request.endpoint);
        let mut client = endpoint::dial(&socket, inner.config.dial_timeout)
            .await
            .map_err(Status::unknown)?;
        let options = endpoint::get_options(&mut client, resource, inner.config.stall_limit)
            .await
            .map_err(|e| Status::unknown(format!("failed to get device plugin options: {e}")))?;
        if request.options != Some(options) {
            warn!(
                "{resource}: RegisterRequest.options {:?} differ from GetDevicePluginOptions \
                 {options:?}; the kubelet uses GetDevicePluginOptions",
                request.options
            );
        }

        let mut registry = inner.lock();
        if inner.epoch() != self.epoch {
            return Err(Status::unavailable(
                "the kubelet restarted while this registration was in progress; register again",
            ));
        }
        let state = registry.register(
            resource,
            &request.endpoint,
            options,
            client.clone(),
            |generation| {
                tokio::spawn(endpoint::list_and_watch(
                    Arc::clone(inner),
                    resource.to_owned(),
                    generation,
                    client,
                ))
                .abort_handle()
            },
        );
        info!(
            "registered resource {resource} at endpoint {} with options {{pre_start_required: {}, \
             get_preferred_allocation_available: {}}} (registration {})",
            state.endpoint,
            options.pre_start_required,
            options.get_preferred_allocation_available,
            state.registrations
        );
        inner.notify(Some(SimEvent::Registered {
            resource: resource.to_owned(),
            endpoint: state.endpoint,
            options,
            registrations: state.registrations,
        }));
        Ok(())
    }
}

/// The kubelet's checks, in its order: version, resource name; then ours on the endpoint.
fn validate(request: &RegisterRequest) -> Result<(), Status> {
    if request.version != VERSION {
        return Err(Status::invalid_argument(format!(
            "requested API version {:?} is not supported by kubelet. Supported versions are [{VERSION:?}]",
            request.version
        )));
    }
    names::validate_resource_name(&request.resource_name).map_err(|why| {
        Status::invalid_argument(format!(
            "the ResourceName {:?} is invalid: {why}",
            request.resource_name
        ))
    })?;
    names::validate_endpoint(&request.endpoint).map_err(|why| {
        Status::invalid_argument(format!(
            "the endpoint {:?} is invalid: {why}",
            request.endpoint
        ))
    })?;
    Ok(())
}
