//! Allocating devices to a container the way the kubelet's device manager does (KUBELET.md §4–5,
//! `devicesToAllocate` and `allocateContainerResources`), for a node without a topology manager
//! policy and a container that reuses no devices from init containers.

use std::collections::BTreeSet;

use tracing::{info, warn};

use super::Simulator;
use super::endpoint;
use super::error::SimError;
use super::events::SimEvent;
use super::state::{Allocation, PodRef, Registry};

impl Simulator {
    /// Allocates `count` devices of `resource` to one container, exactly as the kubelet does:
    ///
    /// 1. Candidates are the healthy devices no allocation of this simulator holds, sorted by id;
    ///    fewer than `count` → [`SimError::Insufficient`].
    /// 2. If the plugin's options (from `GetDevicePluginOptions`) ask for it,
    ///    `GetPreferredAllocation` is called with one container request (available = the
    ///    candidates, must-include = [], size = `count`). An error fails the allocation, as in
    ///    the kubelet. The answer is advisory: its ids that are candidates are taken first (in
    ///    the plugin's order, at most `count`), and the rest is filled from the candidates in id
    ///    order — so a valid answer is used as given, and one naming no candidate is ignored.
    /// 3. `Allocate` is called with exactly one `ContainerAllocateRequest`; an empty
    ///    `container_responses` fails admission ([`SimError::EmptyAllocateResponse`]).
    /// 4. The allocation is recorded: its devices are not candidates again until
    ///    [`release`](Self::release).
    /// 5. If the options say `pre_start_required`, `PreStartContainer` is called with the
    ///    allocated ids and the kubelet's 30 s deadline; if it fails the allocation stays
    ///    recorded ([`SimError::PreStart`] carries its id), as the pod was admitted.
    ///
    /// Allocations are admitted one at a time, as the kubelet admits pods one at a time: a plugin
    /// that stalls holds up every other allocation too. The kubelet sets no deadline on the
    /// options, preferred and allocate calls; the simulator reports [`SimError::Stalled`] after
    /// [`SimConfig::stall_limit`](super::SimConfig::stall_limit).
    ///
    /// The container is a new pod's: `default/pod-<allocation id>`, container `main`
    /// ([`PodRef::generated`]). [`allocate_for`](Self::allocate_for) names the container.
    pub async fn allocate(&self, resource: &str, count: usize) -> Result<Allocation, SimError> {
        self.admit(None, resource, count).await
    }

    /// [`allocate`](Self::allocate) for a named container: the allocation is reported under
    /// `pod` by the PodResources API (`List`, `Get`) until [`release`](Self::release) or
    /// [`terminate_pod`](Self::terminate_pod). Several containers of a pod, and several
    /// resources of a container, may hold devices; a container that already holds devices of
    /// `resource` is refused ([`SimError::AlreadyAllocated`]), as the kubelet allocates once per
    /// container and resource. Namespace, pod and container names must not be empty.
    pub async fn allocate_for(
        &self,
        pod: &PodRef,
        resource: &str,
        count: usize,
    ) -> Result<Allocation, SimError> {
        for (what, value) in [
            ("namespace", &pod.namespace),
            ("pod name", &pod.name),
            ("container name", &pod.container),
        ] {
            if value.is_empty() {
                return Err(SimError::InvalidPod {
                    pod: pod.clone(),
                    reason: format!("the {what} is empty"),
                });
            }
        }
        self.admit(Some(pod), resource, count).await
    }

    async fn admit(
        &self,
        pod: Option<&PodRef>,
        resource: &str,
        count: usize,
    ) -> Result<Allocation, SimError> {
        let inner = &self.inner;
        if count == 0 {
            return Err(SimError::ZeroCount {
                resource: resource.to_owned(),
            });
        }
        let admission = inner.admission.lock().await;

        let (mut client, options, candidates) = {
            let registry = inner.lock();
            if let Some(pod) = pod
                && let Some(allocation_id) = registry.held_by(pod, resource)
            {
                return Err(SimError::AlreadyAllocated {
                    pod: pod.clone(),
                    resource: resource.to_owned(),
                    allocation_id,
                });
            }
            let candidates = registry.candidates(resource)?;
            if candidates.len() < count {
                return Err(SimError::Insufficient {
                    resource: resource.to_owned(),
                    requested: count,
                    available: candidates.len(),
                });
            }
            let (client, options) = registry.live_client(resource)?;
            (client, options, candidates)
        };
        let limit = inner.config.stall_limit;

        let preferred = if options.get_preferred_allocation_available {
            let answer =
                endpoint::get_preferred(&mut client, resource, &candidates, count, limit).await?;
            Some(answer)
        } else {
            None
        };
        let device_ids = select(resource, &candidates, preferred.as_deref(), count);

        let response = endpoint::allocate(&mut client, resource, &device_ids, limit).await?;

        // Admission is serialized, so the id peeked here is the one recorded.
        let (id, pod) = {
            let mut registry = inner.lock();
            let pod = pod
                .cloned()
                .unwrap_or_else(|| PodRef::generated(registry.next_allocation_id()));
            let id = registry.record_allocation(pod.clone(), resource, device_ids.clone());
            inner.notify(Some(SimEvent::Allocated {
                id,
                pod: pod.clone(),
                resource: resource.to_owned(),
                device_ids: device_ids.clone(),
            }));
            (id, pod)
        };
        info!("{resource}: allocation {id} of {device_ids:?} to {pod}");
        drop(admission);

        let prestarted = self
            .pre_start(resource, &device_ids)
            .await
            .map_err(|source| SimError::PreStart {
                allocation_id: id,
                source: Box::new(source),
            })?;

        Ok(Allocation {
            id,
            pod,
            resource: resource.to_owned(),
            device_ids,
            preferred,
            response,
            prestarted,
        })
    }

    /// Container start: `PreStartContainer` if the plugin's current options require it. The
    /// kubelet uses the endpoint registered at that moment, and fails if it is stopped.
    async fn pre_start(&self, resource: &str, device_ids: &[String]) -> Result<bool, SimError> {
        let (mut client, options) = self.inner.lock().live_client(resource)?;
        if !options.pre_start_required {
            return Ok(false);
        }
        let timeout = self.inner.config.prestart_timeout;
        endpoint::pre_start(&mut client, resource, device_ids, timeout).await?;
        info!("{resource}: PreStartContainer for {device_ids:?} succeeded");
        Ok(true)
    }

    /// Frees one allocation, as when its pod terminates: its devices are candidates again and
    /// the PodResources API no longer reports them (the pod disappears from `List` once it holds
    /// nothing). The plugin is not told, as in the kubelet (KUBELET.md §9). Unknown ids are
    /// ignored.
    ///
    /// The kubelet frees devices per pod; for a pod with several allocations (several
    /// containers or resources, see [`allocate_for`](Self::allocate_for)) use
    /// [`terminate_pod`](Self::terminate_pod). For a pod made by [`allocate`](Self::allocate)
    /// the two are the same.
    pub fn release(&self, allocation_id: u64) {
        let mut registry = self.inner.lock();
        self.release_locked(&mut registry, allocation_id);
    }

    /// Pod `namespace/name` terminated: every allocation of any of its containers is freed (see
    /// [`release`](Self::release)). Returns the ids freed, in order; empty if the pod held
    /// nothing.
    pub fn terminate_pod(&self, namespace: &str, name: &str) -> Vec<u64> {
        let mut registry = self.inner.lock();
        let ids = registry.allocations_of_pod(namespace, name);
        for id in &ids {
            self.release_locked(&mut registry, *id);
        }
        if !ids.is_empty() {
            info!("pod {namespace}/{name} terminated: allocations {ids:?} released");
        }
        ids
    }

    fn release_locked(&self, registry: &mut Registry, allocation_id: u64) {
        if let Some(record) = registry.release(allocation_id) {
            info!(
                "{}: released allocation {allocation_id} of {:?} ({})",
                record.resource, record.device_ids, record.pod
            );
            self.inner.notify(Some(SimEvent::Released {
                id: allocation_id,
                pod: record.pod,
                resource: record.resource,
                device_ids: record.device_ids,
            }));
        }
    }
}

/// The kubelet's choice: the preferred ids that are candidates first, then the candidates in
/// order, until `count`; returned sorted.
fn select(
    resource: &str,
    candidates: &[String],
    preferred: Option<&[String]>,
    count: usize,
) -> Vec<String> {
    let available: BTreeSet<&str> = candidates.iter().map(String::as_str).collect();
    let mut chosen: BTreeSet<&str> = BTreeSet::new();
    if let Some(preferred) = preferred {
        for id in preferred {
            if chosen.len() == count {
                break;
            }
            if available.contains(id.as_str()) {
                chosen.insert(id);
            }
        }
        let distinct: BTreeSet<&str> = preferred.iter().map(String::as_str).collect();
        let usable = distinct.len() == preferred.len()
            && preferred.len() == count
            && distinct.iter().all(|id| available.contains(id));
        if !usable {
            warn!(
                "{resource}: GetPreferredAllocation answered {preferred:?} for {count} of \
                 {candidates:?}; the kubelet treats the answer as advisory and fills up from the \
                 available devices"
            );
        }
    }
    for id in candidates {
        if chosen.len() == count {
            break;
        }
        chosen.insert(id);
    }
    chosen.into_iter().map(str::to_owned).collect()
}

#[cfg(test)]
mod tests {
    use super::select;

    fn ids(ids: &[&str]) -> Vec<String> {
        ids.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn selection_follows_the_kubelet() {
        let candidates = ids(&["a", "b", "c", "d"]);
        let pick = |preferred: Option<&[&str]>, count| {
            let preferred = preferred.map(ids);
            select("r", &candidates, preferred.as_deref(), count)
        };
        assert_eq!(pick(None, 2), ids(&["a", "b"]));
        assert_eq!(pick(Some(&["d", "c"]), 2), ids(&["c", "d"]));
        // Nothing usable: ignored.
        assert_eq!(pick(Some(&["x", "y"]), 2), ids(&["a", "b"]));
        assert_eq!(pick(Some(&[]), 2), ids(&["a", "b"]));
        // Partly usable: the usable ids first, then filled up.
        assert_eq!(pick(Some(&["d", "x"]), 2), ids(&["a", "d"]));
        assert_eq!(pick(Some(&["d", "d"]), 2), ids(&["a", "d"]));
        // Too many: the first `count` usable ones.
        assert_eq!(pick(Some(&["d", "c", "b"]), 2), ids(&["c", "d"]));
    }
}
