//! What the simulated kubelet knows: registered resources, their devices, and allocations.
//!
//! The device bookkeeping mirrors the kubelet's device manager: per resource a set of healthy and
//! a set of unhealthy device ids, replaced wholesale by every ListAndWatch message; capacity is
//! the size of both sets, allocatable the size of the healthy one. When the stream ends every
//! healthy device is moved to the unhealthy set (`markResourceUnhealthy`), so allocatable drops
//! to 0 at once while capacity stays.

use std::collections::{BTreeMap, BTreeSet};

use tokio::task::AbortHandle;
use tonic::transport::Channel;

use crate::kubelet::api::deviceplugin::device_plugin_client::DevicePluginClient;
use crate::kubelet::api::deviceplugin::{
    ContainerAllocateResponse, Device, DevicePluginOptions, HEALTHY,
};

use super::error::SimError;

/// A snapshot of what the simulated kubelet knows about one resource.
#[derive(Debug, Clone, PartialEq)]
pub struct ResourceState {
    /// The extended resource name, e.g. `devicelet.io/fuse`.
    pub name: String,
    /// The socket file name the plugin registered (inside the plugin directory).
    pub endpoint: String,
    /// The options the plugin answered to `GetDevicePluginOptions` — the ones the kubelet uses,
    /// whatever the `RegisterRequest` carried.
    pub options: DevicePluginOptions,
    /// How many times the resource was registered successfully (re-registrations included).
    pub registrations: u32,
    /// The devices of the last snapshot, sorted by id (one entry per id, the last one sent). Kept
    /// as last reported when the stream ends: see `allocatable` for what can be used.
    pub devices: Vec<Device>,
    /// ListAndWatch messages received on the current stream (0 right after a registration).
    pub snapshots: u64,
    /// Whether the current ListAndWatch stream is open.
    pub streaming: bool,
    /// What the node would advertise as capacity: all devices of the last snapshot (0 after a
    /// simulated kubelet restart until the plugin registers again).
    pub capacity: usize,
    /// What the node would advertise as allocatable: devices whose health is exactly
    /// `"Healthy"`; 0 as soon as the stream ends.
    pub allocatable: usize,
}

impl ResourceState {
    fn new(name: &str) -> Self {
        ResourceState {
            name: name.to_owned(),
            endpoint: String::new(),
            options: DevicePluginOptions::default(),
            registrations: 0,
            devices: Vec::new(),
            snapshots: 0,
            streaming: false,
            capacity: 0,
            allocatable: 0,
        }
    }
}

/// One container's devices, as the simulated kubelet allocated them.
#[derive(Debug, Clone, PartialEq)]
pub struct Allocation {
    /// Handle for [`Simulator::release`](super::Simulator::release).
    pub id: u64,
    /// The resource allocated from.
    pub resource: String,
    /// The devices sent in the `Allocate` call, sorted.
    pub device_ids: Vec<String>,
    /// What `GetPreferredAllocation` answered, if the plugin's options asked for that call.
    pub preferred: Option<Vec<String>>,
    /// The plugin's answer for the container (`container_responses[0]`).
    pub response: ContainerAllocateResponse,
    /// Whether `PreStartContainer` was called (and succeeded).
    pub prestarted: bool,
}

/// The plugin client of the current registration of a resource.
pub(super) struct Endpoint {
    pub client: DevicePluginClient<Channel>,
    /// Identifies this registration; stream tasks of older ones see a different value and stop.
    pub generation: u64,
    /// The ListAndWatch consumer task, aborted when the resource is registered again.
    pub stream: AbortHandle,
    /// The stream ended: the kubelet calls this a stopped endpoint.
    pub stopped: bool,
}

pub(super) struct Resource {
    pub state: ResourceState,
    /// Ids the kubelet counts as healthy (allocatable).
    pub healthy: BTreeSet<String>,
    /// Ids the kubelet counts as unhealthy; capacity = healthy + unhealthy.
    pub unhealthy: BTreeSet<String>,
    /// None until the first registration, and after a simulated kubelet restart.
    pub endpoint: Option<Endpoint>,
}

impl Resource {
    fn recount(&mut self) {
        self.state.capacity = self.healthy.len() + self.unhealthy.len();
        self.state.allocatable = self.healthy.len();
    }
}

/// What a snapshot changed, for the log and the event stream.
pub(super) struct SnapshotSummary {
    pub number: u64,
    pub capacity: usize,
    pub allocatable: usize,
    pub duplicates: usize,
}

struct AllocationRecord {
    resource: String,
    device_ids: Vec<String>,
}

/// Everything behind the simulator's lock.
#[derive(Default)]
pub(super) struct Registry {
    pub resources: BTreeMap<String, Resource>,
    allocations: BTreeMap<u64, AllocationRecord>,
    next_allocation: u64,
    next_generation: u64,
}

impl Registry {
    pub fn snapshot(&self, name: &str) -> Option<ResourceState> {
        self.resources.get(name).map(|r| r.state.clone())
    }

    /// Records a successful registration; `spawn_stream` starts the ListAndWatch consumer for the
    /// generation it is given. The previous client's stream task is aborted. Devices and health
    /// are kept until the new stream's first snapshot, as in the kubelet.
    pub fn register(
        &mut self,
        name: &str,
        endpoint: &str,
        options: DevicePluginOptions,
        client: DevicePluginClient<Channel>,
        spawn_stream: impl FnOnce(u64) -> AbortHandle,
    ) -> ResourceState {
        self.next_generation += 1;
        let generation = self.next_generation;
        let stream = spawn_stream(generation);
        let resource = self
            .resources
            .entry(name.to_owned())
            .or_insert_with(|| Resource {
                state: ResourceState::new(name),
                healthy: BTreeSet::new(),
                unhealthy: BTreeSet::new(),
                endpoint: None,
            });
        if let Some(old) = resource.endpoint.replace(Endpoint {
            client,
            generation,
            stream,
            stopped: false,
        }) {
            old.stream.abort();
        }
        let state = &mut resource.state;
        state.endpoint = endpoint.to_owned();
        state.options = options;
        state.registrations += 1;
        state.snapshots = 0;
        state.streaming = false;
        state.clone()
    }

    /// The resource's current registration, if it is `generation`.
    fn current(&mut self, name: &str, generation: u64) -> Option<&mut Resource> {
        self.resources
            .get_mut(name)
            .filter(|r| r.endpoint.as_ref().map(|e| e.generation) == Some(generation))
    }

    /// The ListAndWatch call of `generation` returned a stream; false if it is stale.
    pub fn stream_opened(&mut self, name: &str, generation: u64) -> bool {
        match self.current(name, generation) {
            Some(resource) => {
                resource.state.streaming = true;
                true
            }
            None => false,
        }
    }

    /// Replaces the device set with one ListAndWatch message; None if `generation` is stale.
    pub fn apply_snapshot(
        &mut self,
        name: &str,
        generation: u64,
        devices: Vec<Device>,
    ) -> Option<SnapshotSummary> {
        let resource = self.current(name, generation)?;
        let mut all = BTreeMap::new();
        let mut duplicates = 0;
        resource.healthy.clear();
        resource.unhealthy.clear();
        for device in devices {
            // Exactly "Healthy" counts; "healthy", "" or anything else is unhealthy.
            if device.health == HEALTHY {
                resource.healthy.insert(device.id.clone());
            } else {
                resource.unhealthy.insert(device.id.clone());
            }
            if all.insert(device.id.clone(), device).is_some() {
                duplicates += 1;
            }
        }
        resource.state.devices = all.into_values().collect();
        resource.state.snapshots += 1;
        resource.state.streaming = true;
        resource.recount();
        Some(SnapshotSummary {
            number: resource.state.snapshots,
            capacity: resource.state.capacity,
            allocatable: resource.state.allocatable,
            duplicates,
        })
    }

    /// The stream of `generation` ended: allocatable drops to 0 at once; false if stale.
    pub fn stream_ended(&mut self, name: &str, generation: u64) -> bool {
        let Some(resource) = self.current(name, generation) else {
            return false;
        };
        let healthy = std::mem::take(&mut resource.healthy);
        resource.unhealthy.extend(healthy);
        resource.state.streaming = false;
        if let Some(endpoint) = resource.endpoint.as_mut() {
            endpoint.stopped = true;
        }
        resource.recount();
        true
    }

    /// A kubelet restart: every client is dropped and every stream stopped; resources stay known
    /// (from the checkpoint) with capacity 0 until their plugins register again. Allocations
    /// survive.
    pub fn forget_endpoints(&mut self) {
        for resource in self.resources.values_mut() {
            if let Some(endpoint) = resource.endpoint.take() {
                endpoint.stream.abort();
            }
            resource.healthy.clear();
            resource.unhealthy.clear();
            resource.state.devices.clear();
            resource.state.snapshots = 0;
            resource.state.streaming = false;
            resource.recount();
        }
    }

    /// Stops every stream task (shutdown).
    pub fn abort_streams(&mut self) {
        for resource in self.resources.values_mut() {
            if let Some(endpoint) = resource.endpoint.as_mut() {
                endpoint.stream.abort();
                endpoint.stopped = true;
            }
            resource.state.streaming = false;
        }
    }

    /// Healthy devices of `name` not held by any allocation, sorted.
    pub fn candidates(&self, name: &str) -> Result<Vec<String>, SimError> {
        let resource = self
            .resources
            .get(name)
            .ok_or_else(|| SimError::UnknownResource {
                resource: name.to_owned(),
            })?;
        let in_use: BTreeSet<&str> = self
            .allocations
            .values()
            .filter(|a| a.resource == name)
            .flat_map(|a| a.device_ids.iter().map(String::as_str))
            .collect();
        Ok(resource
            .healthy
            .iter()
            .filter(|id| !in_use.contains(id.as_str()))
            .cloned()
            .collect())
    }

    /// The client and options to call the plugin of `name` with, unless its endpoint is stopped.
    pub fn live_client(
        &self,
        name: &str,
    ) -> Result<(DevicePluginClient<Channel>, DevicePluginOptions), SimError> {
        let resource = self
            .resources
            .get(name)
            .ok_or_else(|| SimError::UnknownResource {
                resource: name.to_owned(),
            })?;
        match &resource.endpoint {
            Some(endpoint) if !endpoint.stopped => {
                Ok((endpoint.client.clone(), resource.state.options))
            }
            _ => Err(SimError::EndpointStopped {
                resource: name.to_owned(),
            }),
        }
    }

    pub fn record_allocation(&mut self, resource: &str, device_ids: Vec<String>) -> u64 {
        self.next_allocation += 1;
        let id = self.next_allocation;
        self.allocations.insert(
            id,
            AllocationRecord {
                resource: resource.to_owned(),
                device_ids,
            },
        );
        id
    }

    /// Frees an allocation; the resource and devices it held, if it existed.
    pub fn release(&mut self, id: u64) -> Option<(String, Vec<String>)> {
        self.allocations
            .remove(&id)
            .map(|a| (a.resource, a.device_ids))
    }
}
