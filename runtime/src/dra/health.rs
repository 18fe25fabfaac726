//! `v1alpha1.DRAResourceHealth`: the device-health stream the kubelet opens on every DRA driver
//! (1.36, feature ResourceHealthStatus, beta and on by default) and shows in the status of pods
//! using the devices. Every message is the complete list, sent at once and again on every change
//! of the driver's devices, with the module's reason as the message.

use std::pin::Pin;

use tokio::sync::watch;
use tokio_stream::wrappers::WatchStream;
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status};

use super::units::units;
use crate::resource::snapshot::Snapshot;
use devicelet_api::dra::health::dra_resource_health_server::DraResourceHealth;
use devicelet_api::dra::health::{
    DeviceHealth, DeviceIdentifier, HealthStatus, NodeWatchResourcesRequest,
    NodeWatchResourcesResponse,
};

/// The service name the driver lists in `GetInfo` beside its DRAPlugin versions, as the
/// kubelet-plugin helper does for a driver that implements it.
pub const SERVICE: &str = "v1alpha1.DRAResourceHealth";

pub struct HealthService {
    pub pool: String,
    pub devices: watch::Receiver<Snapshot>,
}

/// The complete health of `snapshot`'s devices, as published (a group as one device).
pub fn report(pool: &str, snapshot: &Snapshot) -> NodeWatchResourcesResponse {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or_default();
    let devices = units(snapshot)
        .into_iter()
        .map(|u| DeviceHealth {
            health: if u.healthy() {
                HealthStatus::Healthy
            } else {
                HealthStatus::Unhealthy
            } as i32,
            message: u.reason().unwrap_or_default(),
            device: Some(DeviceIdentifier {
                pool_name: pool.to_owned(),
                device_name: u.name,
            }),
            last_updated_time: now,
            health_check_timeout_seconds: 0,
        })
        .collect();
    NodeWatchResourcesResponse { devices }
}

type Reports = Pin<Box<dyn Stream<Item = Result<NodeWatchResourcesResponse, Status>> + Send>>;

#[tonic::async_trait]
impl DraResourceHealth for HealthService {
    type NodeWatchResourcesStream = Reports;

    async fn node_watch_resources(
        &self,
        _: Request<NodeWatchResourcesRequest>,
    ) -> Result<Response<Reports>, Status> {
        let pool = self.pool.clone();
        // The current devices first, then every change; it ends when the driver stops.
        let reports = WatchStream::new(self.devices.clone()).map(move |s| Ok(report(&pool, &s)));
        Ok(Response::new(Box::pin(reports)))
    }
}
