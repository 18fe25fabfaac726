//! A client for the kubelet's PodResources API (`v1.PodResourcesLister`), on its Unix socket
//! (by default `/var/lib/kubelet/pod-resources/kubelet.sock`).

use std::path::Path;
use std::time::Duration;

use crate::kubelet::api::podresources::pod_resources_lister_client::PodResourcesListerClient;
use crate::kubelet::api::podresources::{ListPodResourcesRequest, ListPodResourcesResponse};
use crate::kubelet::uds;
use crate::ledger::{Held, Holder, LedgerError};

/// How long [`list_pods`] waits for the kubelet, connection included.
pub const LIST_TIMEOUT: Duration = Duration::from_secs(5);

/// The largest answer accepted; the kubelet's own client allows 16 MiB, a busy node's `List`
/// can outgrow gRPC's 4 MiB default.
pub const MAX_MESSAGE_SIZE: usize = 16 * 1024 * 1024;

/// Asks the kubelet listening on `socket` which containers hold which devices, giving up after
/// [`LIST_TIMEOUT`].
pub async fn list_pods(socket: &Path) -> Result<ListPodResourcesResponse, LedgerError> {
    list_pods_within(socket, LIST_TIMEOUT).await
}

/// [`list_pods`] with another timeout.
pub async fn list_pods_within(
    socket: &Path,
    timeout: Duration,
) -> Result<ListPodResourcesResponse, LedgerError> {
    let call = async {
        let channel = uds::connect(socket)
            .await
            .map_err(|source| LedgerError::Connect {
                socket: socket.to_owned(),
                source,
            })?;
        let mut client =
            PodResourcesListerClient::new(channel).max_decoding_message_size(MAX_MESSAGE_SIZE);
        client
            .list(ListPodResourcesRequest {})
            .await
            .map(tonic::Response::into_inner)
            .map_err(|status| LedgerError::List {
                socket: socket.to_owned(),
                status: Box::new(status),
            })
    };
    tokio::time::timeout(timeout, call)
        .await
        .map_err(|_| LedgerError::Timeout {
            socket: socket.to_owned(),
            after: timeout,
        })?
}

/// Who holds which devices of which resource, from a PodResources `List` answer: a container's
/// devices of one resource are the union of all its `ContainerDevices` of that resource (the
/// kubelet reports one per device and per NUMA node).
pub fn held(pods: &ListPodResourcesResponse) -> Vec<Held> {
    let mut held = Vec::new();
    for pod in &pods.pod_resources {
        for container in &pod.containers {
            let first = held.len();
            for devices in &container.devices {
                let at = held[first..]
                    .iter()
                    .position(|h: &Held| h.resource == devices.resource_name)
                    .map(|i| first + i);
                let at = at.unwrap_or_else(|| {
                    held.push(Held {
                        holder: Holder::container(&pod.namespace, &pod.name, &container.name),
                        resource: devices.resource_name.clone(),
                        device_ids: Vec::new(),
                    });
                    held.len() - 1
                });
                for id in &devices.device_ids {
                    if !held[at].device_ids.contains(id) {
                        held[at].device_ids.push(id.clone());
                    }
                }
            }
        }
    }
    held.retain(|h| !h.device_ids.is_empty());
    held
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use tokio_stream::wrappers::UnixListenerStream;
    use tonic::{Request, Response, Status};

    use super::*;
    use crate::kubelet::api::podresources::pod_resources_lister_server::{
        PodResourcesLister, PodResourcesListerServer,
    };
    use crate::kubelet::api::podresources::{
        AllocatableResourcesRequest, AllocatableResourcesResponse, ContainerDevices,
        ContainerResources, GetPodResourcesRequest, GetPodResourcesResponse, PodResources,
    };

    struct Fake(ListPodResourcesResponse);

    #[tonic::async_trait]
    impl PodResourcesLister for Fake {
        async fn list(
            &self,
            _: Request<ListPodResourcesRequest>,
        ) -> Result<Response<ListPodResourcesResponse>, Status> {
            Ok(Response::new(self.0.clone()))
        }
        async fn get_allocatable_resources(
            &self,
            _: Request<AllocatableResourcesRequest>,
        ) -> Result<Response<AllocatableResourcesResponse>, Status> {
            Err(Status::unimplemented("fake"))
        }
        async fn get(
            &self,
            _: Request<GetPodResourcesRequest>,
        ) -> Result<Response<GetPodResourcesResponse>, Status> {
            Err(Status::unimplemented("fake"))
        }
    }

    #[tokio::test]
    async fn lists_what_the_kubelet_serves() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("kubelet.sock");
        let answer = ListPodResourcesResponse {
            pod_resources: vec![PodResources {
                name: "p".into(),
                namespace: "ns".into(),
                containers: vec![ContainerResources {
                    name: "c".into(),
                    devices: vec![ContainerDevices {
                        resource_name: "devicelet.io/fuse".into(),
                        device_ids: vec!["fuse-0".into()],
                        topology: None,
                    }],
                    ..Default::default()
                }],
            }],
        };
        let incoming = UnixListenerStream::new(uds::bind(&socket).unwrap());
        let server = tonic::transport::Server::builder()
            .add_service(PodResourcesListerServer::new(Fake(answer.clone())))
            .serve_with_incoming(incoming);
        let server = tokio::spawn(server);
        assert_eq!(list_pods(&socket).await.unwrap(), answer);
        server.abort();
    }

    #[tokio::test]
    async fn nothing_listening_is_a_connect_error_naming_the_socket() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("absent.sock");
        let err = list_pods(&socket).await.unwrap_err();
        assert!(matches!(err, LedgerError::Connect { .. }), "{err:?}");
        assert!(err.to_string().contains("absent.sock"), "{err}");
    }

    #[tokio::test]
    async fn a_silent_kubelet_times_out() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("silent.sock");
        let listener = uds::bind(&socket).unwrap();
        // Accepts connections and never speaks HTTP/2.
        let hold = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((stream, _)) = listener.accept().await {
                held.push(stream);
            }
        });
        let start = Instant::now();
        let err = list_pods_within(&socket, Duration::from_millis(200))
            .await
            .unwrap_err();
        assert!(matches!(err, LedgerError::Timeout { .. }), "{err:?}");
        assert!(start.elapsed() < Duration::from_secs(3));
        hold.abort();
    }
}
