//! The simulated kubelet's `v1beta1.Registration` service (KUBELET.md §1–4, 8).
//!
//! `Register` is synchronous, as in the kubelet: it validates the request, dials the plugin's
//! socket, calls `GetDevicePluginOptions`, and only then answers. A plugin that registers before
//! it serves, or whose options call fails, gets an error back. The ListAndWatch consumer is
//! started in the background once the registration is recorded.

use std::path::Path;
use std::sync::Arc;

use tonic::{Request, Response, Status};
use tracing::{info, warn};

use devicelet_api::deviceplugin::registration_server::Registration;
use devicelet_api::deviceplugin::{DevicePluginOptions, Empty, RegisterRequest, VERSION};
use devicelet_api::names;

use super::events::SimEvent;
use super::state::Registry;
use super::{Inner, endpoint};

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
        validate(request)?;
        let socket = self.inner.dir.join(&request.endpoint);
        let epoch = self.epoch;
        let options = connect_client(
            &self.inner,
            &request.resource_name,
            &socket,
            &request.endpoint,
            |inner, _| inner.epoch() == epoch,
        )
        .await?;
        if request.options != Some(options) {
            warn!(
                "{}: RegisterRequest.options {:?} differ from GetDevicePluginOptions \
                 {options:?}; the kubelet uses GetDevicePluginOptions",
                request.resource_name, request.options
            );
        }
        Ok(())
    }
}

/// The device manager's side of a registration, the same for both routes (`Register` on
/// `kubelet.sock` and the plugin watcher): dials `socket` (retrying for
/// [`SimConfig::dial_timeout`](super::SimConfig::dial_timeout)), calls
/// `GetDevicePluginOptions`, records the client under `resource` (replacing an earlier one) and
/// starts consuming ListAndWatch. `endpoint` is what [`ResourceState::endpoint`] shows: the file
/// name sent in `Register`, or the full path the plugin watcher dialed.
///
/// `still_wanted` is asked with the registry locked, just before recording: false (the kubelet
/// restarted, the plugin's socket went away) abandons the registration, unrecorded.
///
/// [`ResourceState::endpoint`]: super::ResourceState::endpoint
pub(super) async fn connect_client(
    inner: &Arc<Inner>,
    resource: &str,
    socket: &Path,
    endpoint: &str,
    still_wanted: impl FnOnce(&Inner, &mut Registry) -> bool,
) -> Result<DevicePluginOptions, Status> {
    let mut client = endpoint::dial(socket, inner.config.dial_timeout)
        .await
        .map_err(Status::unknown)?;
    let options = endpoint::get_options(&mut client, resource, inner.config.stall_limit)
        .await
        .map_err(|e| Status::unknown(format!("failed to get device plugin options: {e}")))?;

    let mut registry = inner.lock();
    if !still_wanted(inner, &mut registry) {
        return Err(Status::unavailable(
            "the kubelet restarted while this registration was in progress; register again",
        ));
    }
    let state = registry.register(resource, endpoint, options, client.clone(), |generation| {
        tokio::spawn(endpoint::list_and_watch(
            Arc::clone(inner),
            resource.to_owned(),
            generation,
            client,
        ))
        .abort_handle()
    });
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
    Ok(options)
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
