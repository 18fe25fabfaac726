//! A scriptable in-test device plugin, served on a socket next to the simulated kubelet.

use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio_stream::wrappers::{ReceiverStream, UnixListenerStream};
use tokio_stream::{Stream, StreamExt};
use tonic::transport::Server;
use tonic::{Request, Response, Status};

use devicelet_api::authority::{LOCALHOST, Rewritten};
use devicelet_api::deviceplugin::device_plugin_server::{DevicePlugin, DevicePluginServer};
use devicelet_api::deviceplugin::registration_client::RegistrationClient;
use devicelet_api::deviceplugin::*;
use devicelet_api::pluginregistration::registration_server::{Registration, RegistrationServer};
use devicelet_api::pluginregistration::{
    DEVICE_PLUGIN, InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse,
};
use devicelet_api::uds;

/// How the fake answers `Allocate`.
#[derive(Clone)]
pub enum AllocateMode {
    /// One container response naming the devices.
    Normal,
    /// No container responses.
    Empty,
    Fail(Status),
    /// Never answers.
    Hang,
}

/// The calls the fake received, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum Call {
    Options,
    ListAndWatch,
    Preferred(Vec<ContainerPreferredAllocationRequest>),
    Allocate(Vec<ContainerAllocateRequest>),
    PreStart(Vec<String>),
}

pub struct Fake {
    pub options: Mutex<DevicePluginOptions>,
    pub options_error: Mutex<Option<Status>>,
    pub preferred: Mutex<Result<Vec<String>, Status>>,
    pub allocate: Mutex<AllocateMode>,
    pub prestart_error: Mutex<Option<Status>>,
    pub calls: Mutex<Vec<Call>>,
    /// ListAndWatch streams the simulated kubelet dropped (cancelled).
    pub cancelled_streams: AtomicUsize,
    devices: watch::Sender<Vec<Device>>,
    /// Bumping it ends every open ListAndWatch stream (cleanly).
    end_streams: watch::Sender<u64>,
}

impl Fake {
    pub fn new(options: DevicePluginOptions, devices: Vec<Device>) -> Arc<Fake> {
        Arc::new(Fake {
            options: Mutex::new(options),
            options_error: Mutex::new(None),
            preferred: Mutex::new(Ok(Vec::new())),
            allocate: Mutex::new(AllocateMode::Normal),
            prestart_error: Mutex::new(None),
            calls: Mutex::new(Vec::new()),
            cancelled_streams: AtomicUsize::new(0),
            devices: watch::Sender::new(devices),
            end_streams: watch::Sender::new(0),
        })
    }

    pub fn calls(&self) -> Vec<Call> {
        self.calls.lock().unwrap().clone()
    }

    fn record(&self, call: Call) {
        self.calls.lock().unwrap().push(call);
    }

    /// Sends a new snapshot on every open stream.
    pub fn set_devices(&self, devices: Vec<Device>) {
        self.devices.send_replace(devices);
    }

    pub fn end_streams(&self) {
        self.end_streams.send_modify(|n| *n += 1);
    }
}

pub fn device(id: &str, health: &str) -> Device {
    Device {
        id: id.to_owned(),
        health: health.to_owned(),
        topology: Some(TopologyInfo {
            nodes: vec![NumaNode { id: 0 }],
        }),
    }
}

pub fn healthy(ids: &[&str]) -> Vec<Device> {
    ids.iter().map(|id| device(id, HEALTHY)).collect()
}

/// A fake plugin serving on `dir/endpoint`.
pub struct FakePlugin {
    pub endpoint: String,
    pub fake: Arc<Fake>,
    server: JoinHandle<()>,
}

impl FakePlugin {
    pub fn serve(
        dir: &Path,
        endpoint: &str,
        options: DevicePluginOptions,
        devices: Vec<Device>,
    ) -> FakePlugin {
        let fake = Fake::new(options, devices);
        let listener = uds::bind(&dir.join(endpoint)).unwrap();
        let service = DevicePluginServer::new(Service(Arc::clone(&fake)));
        let server = tokio::spawn(async move {
            Server::builder()
                .add_service(service)
                .serve_with_incoming(UnixListenerStream::new(listener))
                .await
                .unwrap();
        });
        FakePlugin {
            endpoint: endpoint.to_owned(),
            fake,
            server,
        }
    }

    /// Registers with the kubelet at `kubelet_sock`, sending `options` as the request's.
    pub async fn register_as(
        &self,
        kubelet_sock: &Path,
        version: &str,
        resource: &str,
        options: DevicePluginOptions,
    ) -> Result<(), Status> {
        register(kubelet_sock, version, &self.endpoint, resource, options).await
    }

    /// Registers `resource` properly: the request's options are the ones the plugin answers.
    pub async fn register(&self, kubelet_sock: &Path, resource: &str) -> Result<(), Status> {
        let options = *self.fake.options.lock().unwrap();
        self.register_as(kubelet_sock, VERSION, resource, options)
            .await
    }
}

impl Drop for FakePlugin {
    fn drop(&mut self) {
        self.server.abort();
    }
}

pub async fn register(
    kubelet_sock: &Path,
    version: &str,
    endpoint: &str,
    resource: &str,
    options: DevicePluginOptions,
) -> Result<(), Status> {
    // Connecting fails while `kubelet.sock` does not accept connections (after a restart).
    let channel = uds::connect(kubelet_sock)
        .await
        .map_err(|e| Status::unavailable(format!("cannot connect to the kubelet: {e:?}")))?;
    RegistrationClient::new(channel)
        .register(RegisterRequest {
            version: version.to_owned(),
            endpoint: endpoint.to_owned(),
            resource_name: resource.to_owned(),
            options: Some(options),
        })
        .await
        .map(|_| ())
}

struct Service(Arc<Fake>);

type DeviceStream = Pin<Box<dyn Stream<Item = Result<ListAndWatchResponse, Status>> + Send>>;

#[tonic::async_trait]
impl DevicePlugin for Service {
    async fn get_device_plugin_options(
        &self,
        _: Request<Empty>,
    ) -> Result<Response<DevicePluginOptions>, Status> {
        self.0.record(Call::Options);
        if let Some(status) = self.0.options_error.lock().unwrap().clone() {
            return Err(status);
        }
        Ok(Response::new(*self.0.options.lock().unwrap()))
    }

    type ListAndWatchStream = DeviceStream;

    async fn list_and_watch(
        &self,
        _: Request<Empty>,
    ) -> Result<Response<Self::ListAndWatchStream>, Status> {
        self.0.record(Call::ListAndWatch);
        let (tx, rx) = mpsc::channel(16);
        let fake = Arc::clone(&self.0);
        let mut devices = fake.devices.subscribe();
        let mut end = fake.end_streams.subscribe();
        tokio::spawn(async move {
            loop {
                let snapshot = devices.borrow_and_update().clone();
                if tx
                    .send(Ok(ListAndWatchResponse { devices: snapshot }))
                    .await
                    .is_err()
                {
                    fake.cancelled_streams.fetch_add(1, Ordering::SeqCst);
                    return;
                }
                tokio::select! {
                    _ = tx.closed() => {
                        fake.cancelled_streams.fetch_add(1, Ordering::SeqCst);
                        return;
                    }
                    _ = end.changed() => return,
                    _ = devices.changed() => {}
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn get_preferred_allocation(
        &self,
        request: Request<PreferredAllocationRequest>,
    ) -> Result<Response<PreferredAllocationResponse>, Status> {
        self.0
            .record(Call::Preferred(request.into_inner().container_requests));
        let answer = self.0.preferred.lock().unwrap().clone()?;
        Ok(Response::new(PreferredAllocationResponse {
            container_responses: vec![ContainerPreferredAllocationResponse {
                device_i_ds: answer,
            }],
        }))
    }

    async fn allocate(
        &self,
        request: Request<AllocateRequest>,
    ) -> Result<Response<AllocateResponse>, Status> {
        let requests = request.into_inner().container_requests;
        self.0.record(Call::Allocate(requests.clone()));
        let mode = self.0.allocate.lock().unwrap().clone();
        match mode {
            AllocateMode::Normal => Ok(Response::new(AllocateResponse {
                container_responses: requests
                    .iter()
                    .map(|r| ContainerAllocateResponse {
                        envs: [("FAKE_DEVICES".to_owned(), r.devices_ids.join(","))].into(),
                        mounts: vec![Mount {
                            container_path: "/fake".to_owned(),
                            host_path: "/var/fake".to_owned(),
                            read_only: true,
                        }],
                        devices: vec![DeviceSpec {
                            container_path: "/dev/fake".to_owned(),
                            host_path: "/dev/fake".to_owned(),
                            permissions: "rw".to_owned(),
                        }],
                        annotations: [("fake".to_owned(), "yes".to_owned())].into(),
                        cdi_devices: vec![CdiDevice {
                            name: "example.com/fake=all".to_owned(),
                        }],
                    })
                    .collect(),
            })),
            AllocateMode::Empty => Ok(Response::new(AllocateResponse {
                container_responses: Vec::new(),
            })),
            AllocateMode::Fail(status) => Err(status),
            AllocateMode::Hang => {
                tokio::time::sleep(Duration::from_secs(3600)).await;
                Err(Status::internal("unreachable"))
            }
        }
    }

    async fn pre_start_container(
        &self,
        request: Request<PreStartContainerRequest>,
    ) -> Result<Response<PreStartContainerResponse>, Status> {
        self.0
            .record(Call::PreStart(request.into_inner().devices_ids));
        if let Some(status) = self.0.prestart_error.lock().unwrap().clone() {
            return Err(status);
        }
        Ok(Response::new(PreStartContainerResponse {}))
    }
}

/// The plugin-watcher side of a fake plugin: `pluginregistration.Registration`, answering
/// `GetInfo` with a scripted `PluginInfo` and keeping every `RegistrationStatus` it is told.
pub struct Registrar {
    pub info: Mutex<PluginInfo>,
    pub get_info_calls: AtomicUsize,
    /// Every `NotifyRegistrationStatus`, in order.
    statuses: watch::Sender<Vec<RegistrationStatus>>,
}

impl Registrar {
    pub fn statuses(&self) -> Vec<RegistrationStatus> {
        self.statuses.borrow().clone()
    }

    /// Waits until `pred` holds for the statuses received (at most `timeout`).
    pub async fn wait_statuses(
        &self,
        timeout: Duration,
        pred: impl Fn(&[RegistrationStatus]) -> bool,
    ) -> Vec<RegistrationStatus> {
        let mut rx = self.statuses.subscribe();
        let waited = tokio::time::timeout(timeout, rx.wait_for(|s| pred(s))).await;
        match waited {
            Ok(Ok(statuses)) => statuses.clone(),
            _ => panic!(
                "statuses not as expected after {timeout:?}: {:?}",
                self.statuses()
            ),
        }
    }
}

struct RegistrarService(Arc<Registrar>);

#[tonic::async_trait]
impl Registration for RegistrarService {
    async fn get_info(&self, _: Request<InfoRequest>) -> Result<Response<PluginInfo>, Status> {
        self.0.get_info_calls.fetch_add(1, Ordering::SeqCst);
        Ok(Response::new(self.0.info.lock().unwrap().clone()))
    }

    async fn notify_registration_status(
        &self,
        request: Request<RegistrationStatus>,
    ) -> Result<Response<RegistrationStatusResponse>, Status> {
        let status = request.into_inner();
        self.0.statuses.send_modify(|s| s.push(status));
        Ok(Response::new(RegistrationStatusResponse {}))
    }
}

/// `PluginInfo` of a device plugin serving `resource`, `endpoint` "" (the registration socket).
pub fn device_plugin_info(resource: &str) -> PluginInfo {
    PluginInfo {
        r#type: DEVICE_PLUGIN.to_owned(),
        name: resource.to_owned(),
        endpoint: String::new(),
        supported_versions: vec![VERSION.to_owned()],
    }
}

/// A fake plugin for the plugin-watcher route: `pluginregistration.Registration` and
/// `v1beta1.DevicePlugin` on one socket, as a plugin whose `PluginInfo.endpoint` is empty
/// serves them. Like the agent, it wraps every accepted connection in the server side of
/// `devicelet_api::authority`, since the kubelet's watcher sends the socket path as
/// `:authority`, which tonic's HTTP/2 server refuses; `rewrite: false` leaves that out.
pub struct RegistryPlugin {
    pub socket: PathBuf,
    pub registrar: Arc<Registrar>,
    pub fake: Arc<Fake>,
    server: JoinHandle<()>,
}

impl RegistryPlugin {
    pub fn serve(
        socket: &Path,
        info: PluginInfo,
        options: DevicePluginOptions,
        devices: Vec<Device>,
    ) -> RegistryPlugin {
        Self::serve_with(socket, info, options, devices, true)
    }

    pub fn serve_with(
        socket: &Path,
        info: PluginInfo,
        options: DevicePluginOptions,
        devices: Vec<Device>,
        rewrite: bool,
    ) -> RegistryPlugin {
        let fake = Fake::new(options, devices);
        let registrar = Arc::new(Registrar {
            info: Mutex::new(info),
            get_info_calls: AtomicUsize::new(0),
            statuses: watch::Sender::new(Vec::new()),
        });
        if let Some(parent) = socket.parent() {
            std::fs::create_dir_all(parent).unwrap();
        }
        let listener = uds::bind(socket).unwrap();
        let router = Server::builder()
            .add_service(RegistrationServer::new(RegistrarService(Arc::clone(
                &registrar,
            ))))
            .add_service(DevicePluginServer::new(Service(Arc::clone(&fake))));
        let server = tokio::spawn(async move {
            let incoming = UnixListenerStream::new(listener);
            if rewrite {
                let incoming = incoming
                    .map(|accepted| accepted.map(|stream| Rewritten::server(stream, LOCALHOST)));
                router.serve_with_incoming(incoming).await.unwrap();
            } else {
                router.serve_with_incoming(incoming).await.unwrap();
            }
        });
        RegistryPlugin {
            socket: socket.to_owned(),
            registrar,
            fake,
            server,
        }
    }
}

impl Drop for RegistryPlugin {
    fn drop(&mut self) {
        self.server.abort();
    }
}

/// A fake DRA driver: the registration socket (`Registration`, type `DRAPlugin`) and, on its
/// endpoint, `v1.DRAPlugin` and `v1beta1.DRAPlugin`. It answers every claim with one device
/// named after the claim's UID and records the claims it was sent, per service.
pub struct FakeDraPlugin {
    pub registrar: Arc<Registrar>,
    /// `("v1" | "v1beta1", "prepare" | "unprepare", claim UID)` for every claim received.
    pub calls: DraCalls,
    servers: Vec<JoinHandle<()>>,
}

impl FakeDraPlugin {
    /// Serves `info` on `registration` and both DRA services on `endpoint` (the registration
    /// socket itself when they are the same path).
    pub fn serve(registration: &Path, endpoint: &Path, info: PluginInfo) -> FakeDraPlugin {
        use devicelet_api::dra::{v1, v1beta1};
        let registrar = Arc::new(Registrar {
            info: Mutex::new(info),
            get_info_calls: AtomicUsize::new(0),
            statuses: watch::Sender::new(Vec::new()),
        });
        let calls = Arc::new(Mutex::new(Vec::new()));
        let dra = Server::builder()
            .add_service(v1::dra_plugin_server::DraPluginServer::new(DraV1(
                calls.clone(),
            )))
            .add_service(v1beta1::dra_plugin_server::DraPluginServer::new(
                DraV1beta1(calls.clone()),
            ));
        let mut servers = Vec::new();
        let serve = |socket: &Path, router: tonic::transport::server::Router| {
            if let Some(parent) = socket.parent() {
                std::fs::create_dir_all(parent).unwrap();
            }
            let listener = uds::bind(socket).unwrap();
            tokio::spawn(async move {
                let incoming = UnixListenerStream::new(listener)
                    .map(|accepted| accepted.map(|stream| Rewritten::server(stream, LOCALHOST)));
                router.serve_with_incoming(incoming).await.unwrap();
            })
        };
        let registration_service = RegistrationServer::new(RegistrarService(registrar.clone()));
        if registration == endpoint {
            servers.push(serve(registration, dra.add_service(registration_service)));
        } else {
            servers.push(serve(endpoint, dra));
            servers.push(serve(
                registration,
                Server::builder().add_service(registration_service),
            ));
        }
        FakeDraPlugin {
            registrar,
            calls,
            servers,
        }
    }

    pub fn calls(&self) -> Vec<(&'static str, &'static str, String)> {
        self.calls.lock().unwrap().clone()
    }
}

impl Drop for FakeDraPlugin {
    fn drop(&mut self) {
        for server in &self.servers {
            server.abort();
        }
    }
}

/// `(service version, call, claim UID)` in the order received.
pub type DraCalls = Arc<Mutex<Vec<(&'static str, &'static str, String)>>>;

struct DraV1(DraCalls);
struct DraV1beta1(DraCalls);

/// What the fake answers for `claims`, recorded as received through `version`.
fn fake_prepare(
    calls: &DraCalls,
    version: &'static str,
    claims: Vec<devicelet_api::dra::v1::Claim>,
) -> devicelet_api::dra::v1::NodePrepareResourcesResponse {
    use devicelet_api::dra::v1::*;
    let mut answers = std::collections::HashMap::new();
    for claim in claims {
        calls
            .lock()
            .unwrap()
            .push((version, "prepare", claim.uid.clone()));
        let device = Device {
            request_names: vec!["gpu".into()],
            pool_name: "node-a".into(),
            device_name: format!("dev-{}", claim.uid),
            cdi_device_ids: vec![format!("example.com/gpu={}", claim.uid)],
            share_id: None,
        };
        let answer = NodePrepareResourceResponse {
            devices: vec![device],
            error: String::new(),
        };
        answers.insert(claim.uid, answer);
    }
    NodePrepareResourcesResponse { claims: answers }
}

/// Every claim answered without error, recorded as received through `version`.
fn fake_unprepare(
    calls: &DraCalls,
    version: &'static str,
    claims: Vec<devicelet_api::dra::v1::Claim>,
) -> devicelet_api::dra::v1::NodeUnprepareResourcesResponse {
    use devicelet_api::dra::v1::*;
    let mut answers = std::collections::HashMap::new();
    for claim in claims {
        calls
            .lock()
            .unwrap()
            .push((version, "unprepare", claim.uid.clone()));
        answers.insert(claim.uid, NodeUnprepareResourceResponse::default());
    }
    NodeUnprepareResourcesResponse { claims: answers }
}

#[tonic::async_trait]
impl devicelet_api::dra::v1::dra_plugin_server::DraPlugin for DraV1 {
    async fn node_prepare_resources(
        &self,
        request: Request<devicelet_api::dra::v1::NodePrepareResourcesRequest>,
    ) -> Result<Response<devicelet_api::dra::v1::NodePrepareResourcesResponse>, Status> {
        let claims = request.into_inner().claims;
        Ok(Response::new(fake_prepare(&self.0, "v1", claims)))
    }

    async fn node_unprepare_resources(
        &self,
        request: Request<devicelet_api::dra::v1::NodeUnprepareResourcesRequest>,
    ) -> Result<Response<devicelet_api::dra::v1::NodeUnprepareResourcesResponse>, Status> {
        let claims = request.into_inner().claims;
        Ok(Response::new(fake_unprepare(&self.0, "v1", claims)))
    }
}

/// The same answers through `v1beta1`, converted as the kubelet's wrapper converts them.
#[tonic::async_trait]
impl devicelet_api::dra::v1beta1::dra_plugin_server::DraPlugin for DraV1beta1 {
    async fn node_prepare_resources(
        &self,
        request: Request<devicelet_api::dra::v1beta1::NodePrepareResourcesRequest>,
    ) -> Result<Response<devicelet_api::dra::v1beta1::NodePrepareResourcesResponse>, Status> {
        let claims = request.into_inner().claims.into_iter().map(Into::into);
        let answer = fake_prepare(&self.0, "v1beta1", claims.collect());
        Ok(Response::new(answer.into()))
    }

    async fn node_unprepare_resources(
        &self,
        request: Request<devicelet_api::dra::v1beta1::NodeUnprepareResourcesRequest>,
    ) -> Result<Response<devicelet_api::dra::v1beta1::NodeUnprepareResourcesResponse>, Status> {
        let claims = request.into_inner().claims.into_iter().map(Into::into);
        let answer = fake_unprepare(&self.0, "v1beta1", claims.collect());
        Ok(Response::new(answer.into()))
    }
}

/// `PluginInfo` of a DRA driver advertising `versions`, at `endpoint`.
pub fn dra_plugin_info(driver: &str, endpoint: &Path, versions: &[&str]) -> PluginInfo {
    PluginInfo {
        r#type: devicelet_api::dra::DRA_PLUGIN.to_owned(),
        name: driver.to_owned(),
        endpoint: endpoint.to_string_lossy().into_owned(),
        supported_versions: versions.iter().map(|v| v.to_string()).collect(),
    }
}
