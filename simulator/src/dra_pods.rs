//! The kubelet's DRA manager for pods (`pkg/kubelet/cm/dra/manager.go`, 1.34–1.36; summarised
//! in `docs/design/dra.md` §4):
//!
//! - **Prepare**, when a pod's sandbox is made: every claim of the pod is read from the API
//!   server (it must be allocated), the drivers its results name must be registered, and then
//!   one `NodePrepareResources` per driver carries all of the pod's claims for that driver not
//!   yet prepared, the drivers one after another. Any claim's error fails the pod (in the
//!   kubelet's words) and no claim of that call is marked prepared.
//! - **Unprepare**, when the pod has ended: a claim other pods still reference only loses this
//!   pod's reference; the rest go in one `NodeUnprepareResources` per driver, and are forgotten
//!   once it succeeds.
//! - **Restart**: the claims are kept (the kubelet's checkpoint) but no longer count as
//!   prepared, so the next pod using one has its driver called again — why drivers must be
//!   idempotent.

use std::collections::{BTreeMap, BTreeSet};

use devicelet_api::dra::v1;

use crate::apiserver::Kind;
use crate::{SimError, Simulator};

/// A claim the kubelet knows of (its `ClaimInfo`).
#[derive(Debug, Clone)]
pub(crate) struct ClaimInfo {
    namespace: String,
    name: String,
    /// The drivers its allocation results name.
    drivers: BTreeSet<String>,
    /// `namespace/name` of the pods using it.
    pods: BTreeSet<String>,
    prepared: bool,
    /// What each driver answered for it.
    devices: BTreeMap<String, Vec<v1::Device>>,
}

/// One claim of a pod, as prepared: the devices each driver answered, with their CDI IDs.
#[derive(Debug, Clone, PartialEq)]
pub struct PodClaim {
    pub name: String,
    pub uid: String,
    pub devices: BTreeMap<String, Vec<v1::Device>>,
}

impl Simulator {
    /// Prepares the claims `claims` (names in `namespace`) of pod `namespace/pod` as the kubelet
    /// does when it makes the pod's sandbox (see the module docs). Needs
    /// [`SimConfig::dra_api`](crate::SimConfig::dra_api). Err ([`SimError::Dra`]) in the
    /// kubelet's words: a claim missing or not allocated, a driver not registered, a call or a
    /// claim that failed.
    pub async fn start_pod_with_claims(
        &self,
        namespace: &str,
        pod: &str,
        claims: &[&str],
    ) -> Result<Vec<PodClaim>, SimError> {
        let api = self
            .inner
            .config
            .dra_api
            .clone()
            .ok_or_else(|| SimError::Dra("the simulated kubelet has no API server".into()))?;
        let pod_key = format!("{namespace}/{pod}");
        // Validation first, before the cache is touched.
        let mut found = Vec::new();
        for name in claims {
            let object = api
                .server
                .lock()
                .objects
                .get(&(Kind::ResourceClaim, namespace.into(), (*name).into()))
                .cloned()
                .ok_or_else(|| {
                    SimError::Dra(format!(
                        "failed to fetch ResourceClaim {name} referenced by pod {pod_key}: \
                         resourceclaims.resource.k8s.io {name:?} not found"
                    ))
                })?;
            let results = object["status"]["allocation"]["devices"]["results"]
                .as_array()
                .cloned()
                .ok_or_else(|| {
                    SimError::Dra(format!("ResourceClaim {namespace}/{name} is not allocated"))
                })?;
            let drivers: BTreeSet<String> = results
                .iter()
                .filter_map(|r| r["driver"].as_str().map(str::to_owned))
                .collect();
            for driver in &drivers {
                if !self.inner.lock().dra.has(driver) {
                    return Err(SimError::Dra(format!(
                        "DRA driver {driver} is not registered"
                    )));
                }
            }
            let uid = object["metadata"]["uid"].as_str().unwrap_or_default();
            found.push((name.to_string(), uid.to_owned(), drivers));
        }
        let mut batches: BTreeMap<String, Vec<v1::Claim>> = BTreeMap::new();
        {
            let mut registry = self.inner.lock();
            let infos = &mut registry.dra.claims;
            for (name, uid, drivers) in &found {
                if let Some((old, _)) = infos
                    .iter()
                    .find(|(u, i)| *u != uid && i.namespace == namespace && i.name == *name)
                {
                    return Err(SimError::Dra(format!(
                        "old ResourceClaim with same name {name} and different UID {old} still \
                         exists (previous pod may be stuck)"
                    )));
                }
                let info = infos.entry(uid.clone()).or_insert_with(|| ClaimInfo {
                    namespace: namespace.into(),
                    name: name.clone(),
                    drivers: drivers.clone(),
                    pods: BTreeSet::new(),
                    prepared: false,
                    devices: BTreeMap::new(),
                });
                info.pods.insert(pod_key.clone());
                if info.prepared {
                    continue;
                }
                for driver in drivers {
                    batches.entry(driver.clone()).or_default().push(v1::Claim {
                        namespace: namespace.into(),
                        uid: uid.clone(),
                        name: name.clone(),
                    });
                }
            }
        }
        let mut answered: BTreeMap<String, BTreeMap<String, Vec<v1::Device>>> = BTreeMap::new();
        for (driver, batch) in batches {
            let asked = batch.len();
            let names: BTreeMap<String, String> = batch
                .iter()
                .map(|c| (c.uid.clone(), c.name.clone()))
                .collect();
            let answer = self
                .node_prepare_resources(&driver, batch)
                .await
                .map_err(|e| SimError::Dra(format!("NodePrepareResources: {e}")))?;
            for (uid, claim) in &answer.claims {
                let Some(name) = names.get(uid) else {
                    return Err(SimError::Dra(format!(
                        "NodePrepareResources returned result for unknown claim UID {uid}"
                    )));
                };
                if !claim.error.is_empty() {
                    return Err(SimError::Dra(format!(
                        "NodePrepareResources failed for ResourceClaim {name}: {}",
                        claim.error
                    )));
                }
                answered
                    .entry(uid.clone())
                    .or_default()
                    .insert(driver.clone(), claim.devices.clone());
            }
            if answer.claims.len() < asked {
                return Err(SimError::Dra(format!(
                    "NodePrepareResources skipped {} ResourceClaims",
                    asked - answer.claims.len()
                )));
            }
        }
        let mut registry = self.inner.lock();
        let mut out = Vec::new();
        for (name, uid, _) in found {
            let Some(info) = registry.dra.claims.get_mut(&uid) else {
                continue;
            };
            if let Some(devices) = answered.remove(&uid) {
                info.devices.extend(devices);
            }
            info.prepared = true;
            out.push(PodClaim {
                name,
                uid,
                devices: info.devices.clone(),
            });
        }
        Ok(out)
    }

    /// Pod `namespace/pod` ended: its claims are unprepared as the kubelet does (see the
    /// module docs). Err as for [`start_pod_with_claims`](Self::start_pod_with_claims); the
    /// claims then stay, as the kubelet keeps them to try again.
    pub async fn end_pod_claims(&self, namespace: &str, pod: &str) -> Result<(), SimError> {
        let pod_key = format!("{namespace}/{pod}");
        let mut batches: BTreeMap<String, Vec<v1::Claim>> = BTreeMap::new();
        {
            let mut registry = self.inner.lock();
            for (uid, info) in registry.dra.claims.iter_mut() {
                if !info.pods.remove(&pod_key) || !info.pods.is_empty() {
                    continue;
                }
                for driver in &info.drivers {
                    batches.entry(driver.clone()).or_default().push(v1::Claim {
                        namespace: info.namespace.clone(),
                        uid: uid.clone(),
                        name: info.name.clone(),
                    });
                }
            }
        }
        let mut done = Vec::new();
        for (driver, batch) in batches {
            let uids: Vec<String> = batch.iter().map(|c| c.uid.clone()).collect();
            let answer = self
                .node_unprepare_resources(&driver, batch)
                .await
                .map_err(|e| SimError::Dra(format!("NodeUnprepareResources: {e}")))?;
            for uid in &uids {
                match answer.claims.get(uid) {
                    Some(c) if c.error.is_empty() => done.push(uid.clone()),
                    Some(c) => {
                        return Err(SimError::Dra(format!(
                            "NodeUnprepareResources failed for claim {uid}: {}",
                            c.error
                        )));
                    }
                    None => {
                        return Err(SimError::Dra(format!(
                            "NodeUnprepareResources skipped claim {uid}"
                        )));
                    }
                }
            }
        }
        let mut registry = self.inner.lock();
        for uid in done {
            registry.dra.claims.remove(&uid);
        }
        Ok(())
    }
}

/// A restarted kubelet reads its claims back from its checkpoint, none of them prepared.
pub(crate) fn restarted(claims: &mut BTreeMap<String, ClaimInfo>) {
    for info in claims.values_mut() {
        info.prepared = false;
    }
}
