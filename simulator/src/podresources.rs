//! The simulated kubelet's `v1.PodResourcesLister` (KUBELET.md §9): which container holds which
//! devices, the one way a device plugin learns it.
//!
//! Answers are built the way the kubelet builds them (`containerDevicesFromResourceDeviceInstances`
//! in `pkg/kubelet/cm`): **one `ContainerDevices` per device and NUMA node** — a device on two
//! NUMA nodes appears twice, a device without topology once without `topology` — not one entry
//! per resource. A client must therefore gather all entries of a resource. Unlike the kubelet,
//! whose order follows Go map iteration (random), the simulator answers in a stable order:
//! pods by namespace and name, containers by name, entries by resource, device id, NUMA node.
//!
//! - `List`: every pod holding an allocation, with the containers that hold devices. The
//!   topology is the one recorded with the allocation (the kubelet's checkpoint), so it survives
//!   restarts. CPU, memory and dynamic resources are empty.
//! - `GetAllocatableResources`: the healthy devices of every resource, allocated or not ("more
//!   like the capacity", says the kubelet), with their topology from the last snapshot.
//! - `Get`: one pod, as in `List`. An unknown pod fails as in the kubelet: a plain error, so
//!   gRPC code `Unknown` (not `NotFound`), message `pod <name> in namespace <ns> not found`.
//!   (The real `Get` is behind the `KubeletPodResourcesGet` feature gate; the simulator serves
//!   it as if the gate were on.)

use std::collections::BTreeMap;
use std::sync::Arc;

use tonic::{Request, Response, Status};

use devicelet_api::podresources::pod_resources_lister_server::PodResourcesLister;
use devicelet_api::podresources::{
    AllocatableResourcesRequest, AllocatableResourcesResponse, ContainerDevices,
    ContainerResources, GetPodResourcesRequest, GetPodResourcesResponse, ListPodResourcesRequest,
    ListPodResourcesResponse, NumaNode, PodResources, TopologyInfo,
};

use super::Inner;
use super::state::Registry;

pub(super) struct PodResourcesService {
    pub inner: Arc<Inner>,
}

#[tonic::async_trait]
impl PodResourcesLister for PodResourcesService {
    async fn list(
        &self,
        _: Request<ListPodResourcesRequest>,
    ) -> Result<Response<ListPodResourcesResponse>, Status> {
        let pod_resources = pods(&self.inner.lock(), None);
        Ok(Response::new(ListPodResourcesResponse { pod_resources }))
    }

    async fn get_allocatable_resources(
        &self,
        _: Request<AllocatableResourcesRequest>,
    ) -> Result<Response<AllocatableResourcesResponse>, Status> {
        let devices = allocatable(&self.inner.lock());
        Ok(Response::new(AllocatableResourcesResponse {
            devices,
            ..Default::default()
        }))
    }

    async fn get(
        &self,
        request: Request<GetPodResourcesRequest>,
    ) -> Result<Response<GetPodResourcesResponse>, Status> {
        let request = request.into_inner();
        let pod = pods(
            &self.inner.lock(),
            Some((&request.pod_namespace, &request.pod_name)),
        )
        .into_iter()
        .next();
        match pod {
            Some(pod) => Ok(Response::new(GetPodResourcesResponse {
                pod_resources: Some(pod),
            })),
            None => Err(Status::unknown(format!(
                "pod {} in namespace {} not found",
                request.pod_name, request.pod_namespace
            ))),
        }
    }
}

/// The pods holding allocations (only `only` = (namespace, name) if given), as `List` reports
/// them.
pub(super) fn pods(registry: &Registry, only: Option<(&str, &str)>) -> Vec<PodResources> {
    // (namespace, pod) -> container -> entries
    let mut pods: BTreeMap<(&str, &str), BTreeMap<&str, Vec<Entry>>> = BTreeMap::new();
    for record in registry.allocations.values() {
        let pod = &record.pod;
        if only.is_some_and(|key| key != (pod.namespace.as_str(), pod.name.as_str())) {
            continue;
        }
        let entries = pods
            .entry((&pod.namespace, &pod.name))
            .or_default()
            .entry(&pod.container)
            .or_default();
        for id in &record.device_ids {
            let nodes = record.numa.get(id).map(Vec::as_slice).unwrap_or_default();
            push_device(entries, &record.resource, id, nodes);
        }
    }
    pods.into_iter()
        .map(|((namespace, name), containers)| PodResources {
            name: name.to_owned(),
            namespace: namespace.to_owned(),
            containers: containers
                .into_iter()
                .map(|(name, entries)| ContainerResources {
                    name: name.to_owned(),
                    devices: finish(entries),
                    ..Default::default()
                })
                .collect(),
        })
        .collect()
}

/// `GetAllocatableResources`' devices: every healthy device of every resource.
pub(super) fn allocatable(registry: &Registry) -> Vec<ContainerDevices> {
    let mut entries = Vec::new();
    for (name, resource) in &registry.resources {
        for device in &resource.state.devices {
            if !resource.healthy.contains(&device.id) {
                continue;
            }
            let nodes: Vec<i64> = device
                .topology
                .as_ref()
                .map(|t| t.nodes.iter().map(|n| n.id).collect())
                .unwrap_or_default();
            push_device(&mut entries, name, &device.id, &nodes);
        }
    }
    finish(entries)
}

/// One `ContainerDevices` before sorting: resource, device, NUMA node (None: no topology).
type Entry = (String, String, Option<i64>);

/// The kubelet's entries for one device: one per NUMA node, or one without topology.
fn push_device(entries: &mut Vec<Entry>, resource: &str, id: &str, nodes: &[i64]) {
    if nodes.is_empty() {
        entries.push((resource.to_owned(), id.to_owned(), None));
    }
    for node in nodes {
        entries.push((resource.to_owned(), id.to_owned(), Some(*node)));
    }
}

fn finish(mut entries: Vec<Entry>) -> Vec<ContainerDevices> {
    entries.sort();
    entries.dedup();
    entries
        .into_iter()
        .map(|(resource_name, id, node)| ContainerDevices {
            resource_name,
            device_ids: vec![id],
            topology: node.map(|id| TopologyInfo {
                nodes: vec![NumaNode { id }],
            }),
        })
        .collect()
}
