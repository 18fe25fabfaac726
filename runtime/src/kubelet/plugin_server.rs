//! One resource's `v1beta1.DevicePlugin` service: the kubelet's calls, answered by the module.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;

use tokio::sync::watch;
use tokio_stream::Stream;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::WatchStream;
use tonic::{Request, Response, Status};

use super::api::deviceplugin as api;
use crate::cdi::Naming;
use crate::device::{ContainerEdits, Device, Health};
use crate::ledger::Ledger;
use crate::policy::sharing::physical_id;
use crate::policy::{Preferred, preferred};
use crate::resource::backend::{BackendError, DeviceBackend, Upkeep};
use crate::resource::prepared::Prepared;
use crate::resource::snapshot::{Snapshot, find};

/// What a resource's server follows: its options, the registration its streams belong to, its
/// devices, and the agent's stop.
pub struct Watches {
    pub options: watch::Receiver<api::DevicePluginOptions>,
    pub streams: watch::Receiver<u64>,
    pub devices: watch::Receiver<Snapshot>,
    pub stop: watch::Receiver<bool>,
    /// Answers prepared ahead of time for single devices (empty when the module opted out).
    pub prepared: Prepared,
    /// Who answers GetPreferredAllocation (the module, the host's policy, nobody).
    pub preferred: watch::Receiver<Preferred>,
    /// Whether the devices are replicas (`<id>::<n>`) of shared physical devices.
    pub shared: bool,
    /// A container gets at most one replica of a physical device (WIT 0.3
    /// `one-share-per-container`: MPS clients).
    pub one_share: bool,
    /// How Allocate names devices by CDI, when the resource's strategy uses CDI.
    pub cdi: Option<Naming>,
    /// Where the backend lives: its version (prepared answers of an older one are stale) and
    /// the runtime to serve on.
    pub upkeep: Arc<dyn Upkeep>,
}

/// What the kubelet reaches through one socket.
pub struct ResourcePlugin<B> {
    /// The extended resource name, as the kubelet and the ledger know it.
    resource: Arc<str>,
    /// The backend's own name for the resource (what the module declared in `init`).
    local: Arc<str>,
    backend: B,
    /// Changed by an upgrade whose new version asks for other calls.
    options: watch::Receiver<api::DevicePluginOptions>,
    /// Bumped by the lifecycle when a registration is over: its streams end.
    streams: watch::Receiver<u64>,
    devices: watch::Receiver<Snapshot>,
    ledger: Ledger,
    /// Flips to true when the agent stops, ending every ListAndWatch stream.
    stop: watch::Receiver<bool>,
    prepared: Prepared,
    preferred: watch::Receiver<Preferred>,
    shared: bool,
    one_share: bool,
    cdi: Option<Naming>,
    upkeep: Arc<dyn Upkeep>,
}

impl<B: Clone> Clone for ResourcePlugin<B> {
    fn clone(&self) -> Self {
        ResourcePlugin {
            resource: self.resource.clone(),
            local: self.local.clone(),
            backend: self.backend.clone(),
            options: self.options.clone(),
            streams: self.streams.clone(),
            devices: self.devices.clone(),
            ledger: self.ledger.clone(),
            stop: self.stop.clone(),
            prepared: self.prepared.clone(),
            preferred: self.preferred.clone(),
            shared: self.shared,
            one_share: self.one_share,
            cdi: self.cdi.clone(),
            upkeep: self.upkeep.clone(),
        }
    }
}

impl<B: DeviceBackend> ResourcePlugin<B> {
    /// The kubelet only ever names devices we advertised, each once (an Unhealthy one included:
    /// it reuses devices of a finished init container whatever their health). Anything else is
    /// refused before the module sees it, naming the offending IDs.
    /// The host's own preferred allocation for one container request (sharing-aware: replicas
    /// of a device in use count against it).
    fn host_choice(
        &self,
        request: &api::ContainerPreferredAllocationRequest,
        size: u32,
        spread: preferred::Spread,
    ) -> Vec<String> {
        let snapshot = self.devices.borrow().clone();
        let holders;
        let mut usage = preferred::Usage::default();
        if self.shared {
            holders = self.ledger.holders(&self.resource);
            usage.physical = Some(physical_id);
            usage.one_per_device = self.one_share;
            for (id, _) in &holders {
                *usage.in_use.entry(physical_id(id)).or_default() += 1;
            }
        }
        let size = usize::try_from(size).unwrap_or(usize::MAX);
        let chosen = preferred::choose(
            &snapshot,
            &request.available_device_i_ds,
            &request.must_include_device_i_ds,
            size,
            spread,
            &usage,
        );
        crate::policy::groups::keep_whole(
            &snapshot,
            &request.available_device_i_ds,
            &request.must_include_device_i_ds,
            chosen,
            size,
        )
    }

    /// Refuses a request naming two replicas of one physical device for a resource that gives
    /// a container one share at most (WIT 0.3): the module never sees it.
    fn one_share_each(&self, ids: &[String]) -> Result<(), Status> {
        if !(self.shared && self.one_share) {
            return Ok(());
        }
        let mut seen = std::collections::HashSet::new();
        match ids.iter().find(|id| !seen.insert(physical_id(id))) {
            Some(twice) => Err(Status::invalid_argument(format!(
                "{}: a container gets one share of a device at most, and this request names \
                 two of {} ({})",
                self.resource,
                physical_id(twice),
                ids.join(", ")
            ))),
            None => Ok(()),
        }
    }

    /// Refuses a request that would split a device group (WIT 0.2), as the kubelet's error:
    /// the module never sees it. Grouped devices are never replicated, so IDs are their own.
    fn whole_groups(&self, ids: &[String]) -> Result<(), Status> {
        let snapshot = self.devices.borrow().clone();
        let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
        match crate::policy::groups::split(&snapshot, &ids) {
            Some(why) => Err(Status::invalid_argument(format!(
                "{}: {why}",
                self.resource
            ))),
            None => Ok(()),
        }
    }

    fn known(&self, ids: &[String]) -> Result<(), Status> {
        self.known_or(ids, &[])
    }

    /// As [`Self::known`], also accepting `held` (devices allocated earlier that may have left
    /// the snapshot since: PreStartContainer follows Allocate, and a device can vanish between).
    fn known_or(&self, ids: &[String], held: &[String]) -> Result<(), Status> {
        let snapshot = self.devices.borrow().clone();
        let mut seen = std::collections::HashSet::with_capacity(ids.len());
        let mut unknown = Vec::new();
        let mut twice = Vec::new();
        for id in ids {
            if !seen.insert(id.as_str()) {
                twice.push(id.as_str());
            } else if find(&snapshot, id).is_none() && !held.contains(id) {
                unknown.push(id.as_str());
            }
        }
        if unknown.is_empty() && twice.is_empty() {
            return Ok(());
        }
        let show = |ids: &[&str]| {
            let mut text: String = ids
                .iter()
                .take(8)
                .map(|id| format!("{:?}", id.chars().take(64).collect::<String>()))
                .collect::<Vec<_>>()
                .join(", ");
            if ids.len() > 8 {
                text.push_str(&format!(" and {} more", ids.len() - 8));
            }
            text
        };
        let mut problems = Vec::new();
        if !unknown.is_empty() {
            problems.push(format!("devices {} are not advertised", show(&unknown)));
        }
        if !twice.is_empty() {
            problems.push(format!("devices {} are named twice", show(&twice)));
        }
        Err(Status::invalid_argument(format!(
            "{}: {}",
            self.resource,
            problems.join("; ")
        )))
    }

    pub fn upkeep(&self) -> &dyn Upkeep {
        &*self.upkeep
    }

    pub fn new(resource: &str, local: &str, backend: B, ledger: Ledger, watches: Watches) -> Self {
        let Watches {
            options,
            streams,
            devices,
            stop,
            prepared,
            preferred,
            shared,
            one_share,
            cdi,
            upkeep,
        } = watches;
        ResourcePlugin {
            resource: resource.into(),
            local: local.into(),
            backend,
            options,
            streams,
            devices,
            ledger,
            stop,
            prepared,
            preferred,
            shared,
            one_share,
            cdi,
            upkeep,
        }
    }

    /// The physical devices behind `ids`, each once, in order.
    fn physical<'a>(&self, ids: &'a [String]) -> Vec<&'a str> {
        let mut physical: Vec<&str> = Vec::with_capacity(ids.len());
        for id in ids {
            let id = if self.shared { physical_id(id) } else { id };
            if !physical.contains(&id) {
                physical.push(id);
            }
        }
        physical
    }

    /// The answer prepared for a lone device exactly as the snapshot lists it now.
    fn prepared_answer(&self, ids: &[String]) -> Option<ContainerEdits> {
        let [id] = ids else { return None };
        let snapshot = self.devices.borrow().clone();
        self.prepared
            .answer(find(&snapshot, id)?, self.upkeep.generation())
    }
}

/// Backend failures reach the kubelet (and so the pod's events) with the module named.
fn status(e: BackendError) -> Status {
    match e {
        BackendError::Failed(m) => Status::internal(m),
        BackendError::Invalid(m) => Status::invalid_argument(m),
        BackendError::Deadline(m) => Status::deadline_exceeded(m),
        BackendError::Crashed(m) | BackendError::Unavailable(m) => Status::unavailable(m),
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

pub fn edits_to_wire(e: ContainerEdits) -> api::ContainerAllocateResponse {
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
        Ok(Response::new(*self.options.borrow()))
    }

    type ListAndWatchStream = SnapshotStream;

    async fn list_and_watch(
        &self,
        _: Request<api::Empty>,
    ) -> Result<Response<Self::ListAndWatchStream>, Status> {
        // Pulled, not pushed: each time the kubelet is ready for a message it gets the newest
        // snapshot, never a queue of stale ones. The stream ends when the agent stops, and when
        // the registration it belongs to is over (the lifecycle bumps `streams`).
        let snapshots =
            WatchStream::new(self.devices.clone()).map(|snapshot| Some(Ok(to_wire(&snapshot))));
        let stopped = WatchStream::new(self.stop.clone())
            .filter(|stop| *stop)
            .map(|_| None);
        let registration = *self.streams.borrow();
        let reregistering = WatchStream::new(self.streams.clone())
            .filter(move |now| *now != registration)
            .map(|_| None);
        let stream = snapshots
            .merge(stopped)
            .merge(reregistering)
            .take_while(Option::is_some)
            .map(|item| item.unwrap_or_else(|| Err(Status::unavailable("stopping"))));
        Ok(Response::new(Box::pin(stream)))
    }

    async fn get_preferred_allocation(
        &self,
        request: Request<api::PreferredAllocationRequest>,
    ) -> Result<Response<api::PreferredAllocationResponse>, Status> {
        let mut container_responses = Vec::new();
        let who = *self.preferred.borrow();
        for c in request.into_inner().container_requests {
            let size = u32::try_from(c.allocation_size)
                .map_err(|_| Status::invalid_argument("allocation_size is negative"))?;
            self.known(&c.available_device_i_ds)?;
            self.known(&c.must_include_device_i_ds)?;
            let ids = match who {
                Preferred::Host(spread) => self.host_choice(&c, size, spread),
                Preferred::Module => {
                    let asked = self
                        .backend
                        .preferred(
                            &self.local,
                            c.available_device_i_ds.clone(),
                            c.must_include_device_i_ds.clone(),
                            size,
                        )
                        .await;
                    match asked {
                        Ok(ids) => ids,
                        // The kubelet fails the pod's admission on an error here, for what is
                        // only a hint: the host's own choice stands in.
                        Err(e) => {
                            tracing::warn!(
                                resource = &*self.resource,
                                "{e}; answered with the host's packed choice instead"
                            );
                            self.host_choice(&c, size, preferred::Spread::Packed)
                        }
                    }
                }
                Preferred::Off => {
                    return Err(Status::failed_precondition(format!(
                        "{} does not offer preferred allocation",
                        self.resource
                    )));
                }
            };
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
        let requests = request.into_inner().container_requests;
        for c in &requests {
            self.known(&c.devices_ids)?;
            self.whole_groups(&c.devices_ids)?;
            self.one_share_each(&c.devices_ids)?;
            if let Some(conflict) = self.ledger.claimed_of(&self.resource, &c.devices_ids) {
                return Err(Status::failed_precondition(conflict.to_string()));
            }
        }
        let mut container_responses = Vec::with_capacity(requests.len());
        for c in &requests {
            let answer = match self.prepared_answer(&c.devices_ids) {
                Some(answer) => answer,
                None => self
                    .backend
                    .allocate(&self.local, c.devices_ids.clone())
                    .await
                    .map_err(status)?,
            };
            container_responses.push(edits_to_wire(match &self.cdi {
                Some(naming) => naming.shape(&self.physical(&c.devices_ids), answer),
                None => answer,
            }));
        }
        // Only what the kubelet is told succeeded goes into the ledger: a request that fails
        // part-way leaves no entry for its first containers. A DRA claim that took one of the
        // devices meanwhile wins: checked again in the step that records.
        let containers: Vec<Vec<String>> = requests.iter().map(|c| c.devices_ids.clone()).collect();
        self.ledger
            .record_all(&self.resource, &containers)
            .map_err(|conflict| Status::failed_precondition(conflict.to_string()))?;
        Ok(Response::new(api::AllocateResponse {
            container_responses,
        }))
    }

    async fn pre_start_container(
        &self,
        request: Request<api::PreStartContainerRequest>,
    ) -> Result<Response<api::PreStartContainerResponse>, Status> {
        let ids = request.into_inner().devices_ids;
        let held: Vec<String> = self
            .ledger
            .holders(&self.resource)
            .into_iter()
            .map(|(id, _)| id)
            .collect();
        self.known_or(&ids, &held)?;
        self.backend
            .prestart(&self.local, ids)
            .await
            .map_err(status)?;
        Ok(Response::new(api::PreStartContainerResponse {}))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::Inventory;
    use api::device_plugin_server::DevicePlugin;

    /// A backend that answers Allocate for every ID but `fails`, and counts its calls.
    #[derive(Clone)]
    struct Fake {
        fails: &'static str,
        calls: Arc<std::sync::atomic::AtomicUsize>,
    }

    impl DeviceBackend for Fake {
        crate::resource::backend::plain_calls!();

        fn name(&self) -> &str {
            "fake"
        }

        async fn enumerate(&self, _: &str) -> Result<Inventory, BackendError> {
            Ok(Inventory::default())
        }

        async fn allocate(
            &self,
            _: &str,
            ids: Vec<String>,
        ) -> Result<ContainerEdits, BackendError> {
            self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            if ids.iter().any(|id| id == self.fails) {
                Err(BackendError::Failed(format!(
                    "module `fake` cannot allocate {ids:?}"
                )))
            } else {
                Ok(ContainerEdits::default())
            }
        }
    }

    fn plugin(fails: &'static str) -> (ResourcePlugin<Fake>, Arc<std::sync::atomic::AtomicUsize>) {
        let (plugin, calls, _, _) = plugin_with_senders(fails);
        (plugin, calls)
    }

    fn plugin_with_senders(
        fails: &'static str,
    ) -> (
        ResourcePlugin<Fake>,
        Arc<std::sync::atomic::AtomicUsize>,
        watch::Sender<Snapshot>,
        watch::Sender<bool>,
    ) {
        let devices = ["a", "b", "sick"]
            .map(|id| Device {
                id: id.into(),
                health: if id == "sick" {
                    Health::Unhealthy
                } else {
                    Health::Healthy
                },
                numa_nodes: Vec::new(),
                attributes: Vec::new(),
                ..crate::device::Device::new("", crate::device::Health::Healthy)
            })
            .to_vec();
        let (devices_tx, devices) = watch::channel(Arc::new(devices.into()));
        let (stop_tx, stop) = watch::channel(false);
        let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let backend = Fake {
            fails,
            calls: calls.clone(),
        };
        let (_, options) = watch::channel(api::DevicePluginOptions::default());
        let (_, streams) = watch::channel(0);
        let plugin = ResourcePlugin::new(
            "ex.com/dev",
            "dev",
            backend,
            Ledger::in_memory(),
            Watches {
                options,
                streams,
                devices,
                stop,
                prepared: Prepared::default(),
                preferred: watch::channel(Preferred::Module).1,
                shared: false,
                one_share: false,
                cdi: None,
                upkeep: Arc::new(crate::resource::backend::Unkept),
            },
        );
        (plugin, calls, devices_tx, stop_tx)
    }

    fn request(containers: &[&[&str]]) -> Request<api::AllocateRequest> {
        Request::new(api::AllocateRequest {
            container_requests: containers
                .iter()
                .map(|ids| api::ContainerAllocateRequest {
                    devices_ids: ids.iter().map(|s| s.to_string()).collect(),
                })
                .collect(),
        })
    }

    #[tokio::test]
    async fn a_reader_that_stops_reading_gets_the_newest_snapshot_and_the_stream_ends_on_stop() {
        use tokio_stream::StreamExt;
        let (plugin, _, devices, stop) = plugin_with_senders("never");
        let mut stream = plugin
            .list_and_watch(Request::new(api::Empty {}))
            .await
            .expect("stream")
            .into_inner();
        let first = stream.next().await.expect("first").expect("ok");
        assert_eq!(first.devices.len(), 3);
        // The kubelet reads nothing while the devices change three times.
        for n in 1..=3 {
            let ids = (0..n).map(|i| format!("d{i}"));
            devices.send_replace(Arc::new(
                ids.map(|id| Device {
                    id,
                    health: Health::Healthy,
                    numa_nodes: Vec::new(),
                    attributes: Vec::new(),
                    ..crate::device::Device::new("", crate::device::Health::Healthy)
                })
                .collect(),
            ));
        }
        let next = stream.next().await.expect("next").expect("ok");
        assert_eq!(
            next.devices.len(),
            3,
            "the newest, not the first of a queue"
        );
        assert_eq!(next.devices[2].id, "d2");
        stop.send_replace(true);
        let end = tokio::time::timeout(std::time::Duration::from_secs(5), stream.next())
            .await
            .expect("the stream ends promptly");
        assert!(end.is_none(), "{end:?}");
    }

    #[tokio::test]
    async fn a_partly_failed_allocate_leaves_the_ledger_unchanged() {
        let (plugin, calls) = plugin("b");
        let e = plugin
            .allocate(request(&[&["a"], &["b"]]))
            .await
            .expect_err("the second container fails");
        assert!(e.message().contains("fake"), "{e:?}");
        assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 2);
        assert!(
            plugin.ledger.entries().is_empty(),
            "nothing the kubelet was told failed"
        );
        plugin
            .allocate(request(&[&["a"], &["sick"]]))
            .await
            .expect("an unhealthy advertised device may be allocated (init-container reuse)");
        assert_eq!(plugin.ledger.entries().len(), 2);
    }

    #[tokio::test]
    async fn unknown_and_repeated_ids_are_refused_before_the_module_sees_them() {
        let (plugin, calls) = plugin("never");
        let e = plugin
            .allocate(request(&[&["a"], &["ghost", "a", "a"]]))
            .await
            .expect_err("refused");
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        assert!(
            e.message().contains("\"ghost\"") && e.message().contains("named twice"),
            "{e:?}"
        );
        let e = plugin
            .pre_start_container(Request::new(api::PreStartContainerRequest {
                devices_ids: vec!["ghost".into()],
            }))
            .await
            .expect_err("refused");
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        let e = plugin
            .get_preferred_allocation(Request::new(api::PreferredAllocationRequest {
                container_requests: vec![api::ContainerPreferredAllocationRequest {
                    available_device_i_ds: vec!["a".into(), "ghost".into()],
                    must_include_device_i_ds: Vec::new(),
                    allocation_size: 1,
                }],
            }))
            .await
            .expect_err("refused");
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 0);
        assert!(plugin.ledger.entries().is_empty());
    }
}
