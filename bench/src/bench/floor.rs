//! Our floor: a DevicePlugin server with nothing behind it, answering every `Allocate` with a
//! constant response and `ListAndWatch` with one constant snapshot, on its own Unix socket. What
//! tonic over a Unix socket costs on this machine, with no module, cell, ledger or validation.

use std::path::Path;
use std::pin::Pin;

use tokio::sync::oneshot;
use tokio_stream::wrappers::UnixListenerStream;
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status};

use devicelet::kubelet::api::deviceplugin as api;
use devicelet::kubelet::api::deviceplugin::device_plugin_server::{
    DevicePlugin, DevicePluginServer,
};
use devicelet::kubelet::uds;

struct Constant {
    answer: api::AllocateResponse,
    devices: Vec<api::Device>,
}

type Empty = Pin<Box<dyn Stream<Item = Result<api::ListAndWatchResponse, Status>> + Send>>;

#[tonic::async_trait]
impl DevicePlugin for Constant {
    async fn get_device_plugin_options(
        &self,
        _: Request<api::Empty>,
    ) -> Result<Response<api::DevicePluginOptions>, Status> {
        Ok(Response::new(api::DevicePluginOptions::default()))
    }

    type ListAndWatchStream = Empty;

    async fn list_and_watch(
        &self,
        _: Request<api::Empty>,
    ) -> Result<Response<Self::ListAndWatchStream>, Status> {
        let snapshot = api::ListAndWatchResponse {
            devices: self.devices.clone(),
        };
        // One snapshot, then the stream stays open, as a plugin's does between changes.
        let stream = tokio_stream::once(Ok(snapshot)).chain(tokio_stream::pending());
        Ok(Response::new(Box::pin(stream)))
    }

    async fn get_preferred_allocation(
        &self,
        _: Request<api::PreferredAllocationRequest>,
    ) -> Result<Response<api::PreferredAllocationResponse>, Status> {
        Err(Status::unimplemented("the floor server only allocates"))
    }

    async fn allocate(
        &self,
        _: Request<api::AllocateRequest>,
    ) -> Result<Response<api::AllocateResponse>, Status> {
        Ok(Response::new(self.answer.clone()))
    }

    async fn pre_start_container(
        &self,
        _: Request<api::PreStartContainerRequest>,
    ) -> Result<Response<api::PreStartContainerResponse>, Status> {
        Ok(Response::new(api::PreStartContainerResponse {}))
    }
}

/// A running floor server; dropping it stops it.
pub struct Floor {
    _stop: oneshot::Sender<()>,
}

/// Serves `answer` to every Allocate, and `devices` as the one ListAndWatch snapshot, on
/// `socket`.
pub fn serve(
    socket: &Path,
    answer: api::AllocateResponse,
    devices: Vec<api::Device>,
) -> std::io::Result<Floor> {
    let listener = uds::bind(socket)?;
    let (stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(DevicePluginServer::new(Constant { answer, devices }))
            .serve_with_incoming_shutdown(UnixListenerStream::new(listener), async {
                let _ = stopped.await;
            }),
    );
    Ok(Floor { _stop: stop })
}
