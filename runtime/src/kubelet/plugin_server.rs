//! One resource's `v1beta1.DevicePlugin` service: the kubelet's calls, answered by the module.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;

use tokio::sync::{mpsc, watch};
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use super::api::deviceplugin as api;
use super::backend::{BackendError, DeviceBackend};
use crate::device::{ContainerEdits, Device, Health};
use crate::ledger::Ledger;

/// The device set the kubelet sees: replaced as a whole whenever anything in it changes.
pub type Snapshot = Arc<Vec<Device>>;

/// What the kubelet reaches through one socket.
pub struct ResourcePlugin<B> {
    /// The extended resource name, as the kubelet and the ledger know it.
    resource: Arc<str>,
    /// The backend's own name for the resource (what the module declared in `init`).
    local: Arc<str>,
    backend: B,
    options: api::DevicePluginOptions,
    devices: watch::Receiver<Snapshot>,
    ledger: Ledger,
    /// Flips to true when the agent stops, ending every ListAndWatch stream.
    stop: watch::Receiver<bool>,
}

impl<B: Clone> Clone for ResourcePlugin<B> {
    fn clone(&self) -> Self {
        ResourcePlugin {
            resource: self.resource.clone(),
            local: self.local.clone(),
            backend: self.backend.clone(),
            options: self.options,
            devices: self.devices.clone(),
            ledger: self.ledger.clone(),
            stop: self.stop.clone(),
        }
    }
}

impl<B: DeviceBackend> ResourcePlugin<B> {
    pub fn new(
        resource: &str,
        local: &str,
        backend: B,
        options: api::DevicePluginOptions,
        devices: watch::Receiver<Snapshot>,
        ledger: Ledger,
        stop: watch::Receiver<bool>,
    ) -> Self {
        ResourcePlugin {
            resource: resource.into(),
            local: local.into(),
            backend,
            options,
            devices,
            ledger,
            stop,
        }
    }
}

/// Backend failures reach the kubelet (and so the pod's events) with the module named.
fn status(e: BackendError) -> Status {
    match e {
        BackendError::Failed(m) => Status::internal(m),
        BackendError::Deadline(m) => Status::deadline_exceeded(m),
        BackendError::Unavailable(m) => Status::unavailable(m),
    }
}

pub fn to_wire(devices: &[Device]) -> api::ListAndWatchResponse {
    api::ListAndWatchResponse {
        devices: devices
            .iter()
            .map(|d| api::Device {
                id: d.id.clone(),
                health: match d.health {
                    Health::Healthy => api::HEALTHY.into(),
                    Health::Unhealthy => api::UNHEALTHY.into(),
                },
                topology: (!d.numa_nodes.is_empty()).then(|| api::TopologyInfo {
                    nodes: d
                        .numa_nodes
                        .iter()
                        .map(|&id| api::NumaNode { id })
                        .collect(),
                }),
            })
            .collect(),
    }
}

fn edits_to_wire(e: ContainerEdits) -> api::ContainerAllocateResponse {
    api::ContainerAllocateResponse {
        envs: e.envs.into_iter().collect::<HashMap<_, _>>(),
        mounts: e
            .mounts
            .into_iter()
            .map(|m| api::Mount {
                container_path: m.container_path,
                host_path: m.host_path,
                read_only: m.read_only,
            })
            .collect(),
        devices: e
            .devices
            .into_iter()
            .map(|d| api::DeviceSpec {
                container_path: d.container_path,
                host_path: d.host_path,
                permissions: d.permissions,
            })
            .collect(),
        annotations: e.annotations.into_iter().collect::<HashMap<_, _>>(),
        cdi_devices: e
            .cdi_devices
            .into_iter()
            .map(|name| api::CdiDevice { name })
            .collect(),
    }
}

type SnapshotStream = Pin<Box<dyn Stream<Item = Result<api::ListAndWatchResponse, Status>> + Send>>;

#[tonic::async_trait]
impl<B: DeviceBackend> api::device_plugin_server::DevicePlugin for ResourcePlugin<B> {
    async fn get_device_plugin_options(
        &self,
        _: Request<api::Empty>,
    ) -> Result<Response<api::DevicePluginOptions>, Status> {
        Ok(Response::new(self.options))
    }

    type ListAndWatchStream = SnapshotStream;

    async fn list_and_watch(
        &self,
        _: Request<api::Empty>,
    ) -> Result<Response<Self::ListAndWatchStream>, Status> {
        let (tx, rx) = mpsc::channel(4);
        let (mut devices, mut stop) = (self.devices.clone(), self.stop.clone());
        tokio::spawn(async move {
            loop {
                let snapshot = devices.borrow_and_update().clone();
                if tx.send(Ok(to_wire(&snapshot))).await.is_err() {
                    return;
                }
                tokio::select! {
                    changed = devices.changed() => if changed.is_err() { return },
                    _ = stop.wait_for(|s| *s) => return,
                    _ = tx.closed() => return,
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn get_preferred_allocation(
        &self,
        request: Request<api::PreferredAllocationRequest>,
    ) -> Result<Response<api::PreferredAllocationResponse>, Status> {
        let mut container_responses = Vec::new();
        for c in request.into_inner().container_requests {
            let size = u32::try_from(c.allocation_size)
                .map_err(|_| Status::invalid_argument("allocation_size is negative"))?;
            let ids = self
                .backend
                .preferred(
                    &self.local,
                    c.available_device_i_ds,
                    c.must_include_device_i_ds,
                    size,
                )
                .await
                .map_err(status)?;
            container_responses
                .push(api::ContainerPreferredAllocationResponse { device_i_ds: ids });
        }
        Ok(Response::new(api::PreferredAllocationResponse {
            container_responses,
        }))
    }

    async fn allocate(
        &self,
        request: Request<api::AllocateRequest>,
    ) -> Result<Response<api::AllocateResponse>, Status> {
        let mut container_responses = Vec::new();
        for c in request.into_inner().container_requests {
            let edits = self
                .backend
                .allocate(&self.local, c.devices_ids.clone())
                .await
                .map_err(status)?;
            self.ledger.record_deferred(&self.resource, &c.devices_ids);
            container_responses.push(edits_to_wire(edits));
        }
        Ok(Response::new(api::AllocateResponse {
            container_responses,
        }))
    }

    async fn pre_start_container(
        &self,
        request: Request<api::PreStartContainerRequest>,
    ) -> Result<Response<api::PreStartContainerResponse>, Status> {
        self.backend
            .prestart(&self.local, request.into_inner().devices_ids)
            .await
            .map_err(status)?;
        Ok(Response::new(api::PreStartContainerResponse {}))
    }
}
