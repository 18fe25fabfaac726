//! The simulated kubelet's side of one plugin: dialing its socket, the calls it makes, and the
//! ListAndWatch consumer.
//!
//! Deadlines follow the kubelet: 10 s to dial, 30 s for `PreStartContainer`, and *none* for
//! `GetDevicePluginOptions`, `GetPreferredAllocation` and `Allocate`. For those the simulator
//! stops waiting after [`SimConfig::stall_limit`](super::SimConfig::stall_limit) and reports
//! [`SimError::Stalled`], because a test that hangs is worse than one that fails saying why.

use std::future::Future;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tonic::transport::Channel;
use tonic::{Code, Response, Status};
use tracing::{info, warn};

use devicelet_api::deviceplugin::device_plugin_client::DevicePluginClient;
use devicelet_api::deviceplugin::{
    AllocateRequest, ContainerAllocateRequest, ContainerAllocateResponse,
    ContainerPreferredAllocationRequest, DevicePluginOptions, Empty, PreStartContainerRequest,
    PreferredAllocationRequest,
};
use devicelet_api::uds;

use super::Inner;
use super::error::SimError;
use super::events::SimEvent;

pub(super) type PluginClient = DevicePluginClient<Channel>;

/// Dials the plugin's socket like the kubelet's blocking `grpc.DialContext`: retrying until a
/// connection is made or `timeout` has passed, so a plugin that binds a moment after it
/// registers still gets through, and one that never serves fails after `timeout`.
pub(super) async fn dial(path: &Path, timeout: Duration) -> Result<PluginClient, String> {
    connect_retrying(path, timeout, uds::connect)
        .await
        .map(DevicePluginClient::new)
        .map_err(|last| {
            format!(
                "cannot connect to the device plugin at {} within {timeout:?}: {last}",
                path.display()
            )
        })
}

/// Connects to `path` with `connect`, retrying (10 ms, doubling up to 500 ms) until it
/// succeeds or `timeout` has passed; the error is the last failure.
pub(super) async fn connect_retrying<'a, F, Fut, E>(
    path: &'a Path,
    timeout: Duration,
    connect: F,
) -> Result<Channel, String>
where
    F: Fn(&'a Path) -> Fut,
    Fut: Future<Output = Result<Channel, E>>,
    E: std::error::Error,
{
    let deadline = Instant::now() + timeout;
    let mut backoff = Duration::from_millis(10);
    loop {
        let last = match tokio::time::timeout_at(deadline, connect(path)).await {
            Ok(Ok(channel)) => return Ok(channel),
            Ok(Err(e)) => error_chain(&e),
            Err(_) => "connection attempt timed out".to_owned(),
        };
        let now = Instant::now();
        if now >= deadline {
            return Err(last);
        }
        tokio::time::sleep(backoff.min(deadline - now)).await;
        backoff = (backoff * 2).min(Duration::from_millis(500));
    }
}

/// Formats an error with its sources: tonic's transport error alone says only "transport error".
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        // Some layers repeat their source in their own message.
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

/// Awaits a call on which the kubelet sets no deadline, giving up after `limit`.
async fn unbounded_call<T>(
    resource: &str,
    call: &'static str,
    limit: Duration,
    fut: impl Future<Output = Result<Response<T>, Status>>,
) -> Result<T, SimError> {
    match tokio::time::timeout(limit, fut).await {
        Ok(Ok(response)) => Ok(response.into_inner()),
        Ok(Err(status)) => Err(SimError::rpc(resource, call, &status)),
        Err(_) => Err(SimError::Stalled {
            resource: resource.to_owned(),
            call,
            after: limit,
        }),
    }
}

pub(super) async fn get_options(
    client: &mut PluginClient,
    resource: &str,
    limit: Duration,
) -> Result<DevicePluginOptions, SimError> {
    unbounded_call(
        resource,
        "GetDevicePluginOptions",
        limit,
        client.get_device_plugin_options(Empty {}),
    )
    .await
}

/// One `GetPreferredAllocation` call with one container request, as the kubelet makes it for a
/// container that reuses no devices: `available` = the candidates, `must_include` = [].
/// Returns the ids of `container_responses[0]` (empty when there is none).
pub(super) async fn get_preferred(
    client: &mut PluginClient,
    resource: &str,
    available: &[String],
    size: usize,
    limit: Duration,
) -> Result<Vec<String>, SimError> {
    let request = PreferredAllocationRequest {
        container_requests: vec![ContainerPreferredAllocationRequest {
            available_device_i_ds: available.to_vec(),
            must_include_device_i_ds: Vec::new(),
            allocation_size: i32::try_from(size).unwrap_or(i32::MAX),
        }],
    };
    let response = unbounded_call(
        resource,
        "GetPreferredAllocation",
        limit,
        client.get_preferred_allocation(request),
    )
    .await?;
    Ok(response
        .container_responses
        .into_iter()
        .next()
        .map(|r| r.device_i_ds)
        .unwrap_or_default())
}

/// One `Allocate` call with exactly one container request; the answer for it is
/// `container_responses[0]`, and an empty list fails admission.
pub(super) async fn allocate(
    client: &mut PluginClient,
    resource: &str,
    device_ids: &[String],
    limit: Duration,
) -> Result<ContainerAllocateResponse, SimError> {
    let request = AllocateRequest {
        container_requests: vec![ContainerAllocateRequest {
            devices_ids: device_ids.to_vec(),
        }],
    };
    let response = unbounded_call(resource, "Allocate", limit, client.allocate(request)).await?;
    let count = response.container_responses.len();
    if count > 1 {
        warn!(
            "{resource}: Allocate returned {count} container responses for one container \
             request; the kubelet uses only the first"
        );
    }
    response
        .container_responses
        .into_iter()
        .next()
        .ok_or_else(|| SimError::EmptyAllocateResponse {
            resource: resource.to_owned(),
        })
}

/// `PreStartContainer` with the kubelet's deadline, sent to the plugin as `grpc-timeout` too.
pub(super) async fn pre_start(
    client: &mut PluginClient,
    resource: &str,
    device_ids: &[String],
    timeout: Duration,
) -> Result<(), SimError> {
    let mut request = tonic::Request::new(PreStartContainerRequest {
        devices_ids: device_ids.to_vec(),
    });
    request.set_timeout(timeout);
    match tokio::time::timeout(timeout, client.pre_start_container(request)).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(status)) => Err(SimError::rpc(resource, "PreStartContainer", &status)),
        Err(_) => Err(SimError::rpc(
            resource,
            "PreStartContainer",
            &Status::new(
                Code::DeadlineExceeded,
                format!(
                    "context deadline exceeded: the kubelet gives PreStartContainer {timeout:?}"
                ),
            ),
        )),
    }
}

/// Consumes the plugin's ListAndWatch stream for one registration (`generation`): every message
/// replaces the device set; when the stream ends or fails, allocatable drops to 0. Stops quietly
/// once a newer registration has replaced this one (it is also aborted then).
pub(super) async fn list_and_watch(
    inner: Arc<Inner>,
    resource: String,
    generation: u64,
    mut client: PluginClient,
) {
    let reason = match client.list_and_watch(Empty {}).await {
        Err(status) => format!("ListAndWatch failed: {}", status_text(&status)),
        Ok(response) => {
            if !inner.lock().stream_opened(&resource, generation) {
                return;
            }
            inner.notify(None);
            let mut stream = response.into_inner();
            loop {
                match stream.message().await {
                    Ok(Some(message)) => {
                        if !snapshot(&inner, &resource, generation, message.devices) {
                            return;
                        }
                    }
                    Ok(None) => break "ListAndWatch stream closed by the plugin".to_owned(),
                    Err(status) => {
                        break format!("ListAndWatch stream failed: {}", status_text(&status));
                    }
                }
            }
        }
    };
    let mut registry = inner.lock();
    if registry.stream_ended(&resource, generation) {
        warn!("{resource}: {reason}; allocatable is now 0 until the plugin registers again");
        inner.notify(Some(SimEvent::StreamEnded {
            resource: resource.clone(),
            reason,
        }));
    }
}

/// Applies one snapshot; false if this registration has been replaced.
fn snapshot(
    inner: &Inner,
    resource: &str,
    generation: u64,
    devices: Vec<devicelet_api::deviceplugin::Device>,
) -> bool {
    let mut registry = inner.lock();
    let Some(summary) = registry.apply_snapshot(resource, generation, devices) else {
        return false;
    };
    info!(
        "{resource}: snapshot {} with {} devices, {} healthy",
        summary.number, summary.capacity, summary.allocatable
    );
    if summary.duplicates > 0 {
        warn!(
            "{resource}: snapshot {} lists {} device ids more than once; the kubelet keeps one \
             entry per id",
            summary.number, summary.duplicates
        );
    }
    let devices = registry
        .resources
        .get(resource)
        .map(|r| r.state.devices.clone())
        .unwrap_or_default();
    inner.notify(Some(SimEvent::Snapshot {
        resource: resource.to_owned(),
        number: summary.number,
        devices,
        capacity: summary.capacity,
        allocatable: summary.allocatable,
    }));
    true
}

fn status_text(status: &Status) -> String {
    format!("{:?}: {}", status.code(), status.message())
}
