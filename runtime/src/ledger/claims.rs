//! DRA claims in the ledger: what each prepared claim holds, and the index that makes "is this
//! device free?" one lookup for both front ends.
//!
//! A claim is *reserved* (its devices taken, nothing written) before the module is asked, and
//! *prepared* once its answer and CDI spec exist; only prepared claims reach the checkpoint. So
//! an agent killed between the two leaves nothing behind that claims a device, and the
//! kubelet's retry prepares the claim afresh.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::entry::Entry;
use crate::policy::sharing::{RENAMED_SUFFIX, physical_id};

/// One claim as a driver prepared it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClaimRecord {
    /// The DRA driver that prepared it.
    pub driver: String,
    /// The resource's served name (`devicelet.io/fuse`): the key the device-plugin front end
    /// records its containers under, so that one device is never held through both.
    pub resource: String,
    pub namespace: String,
    pub name: String,
    pub requests: Vec<PreparedRequest>,
    /// The claim's CDI spec file; None when no request needed one.
    pub spec_file: Option<PathBuf>,
}

/// One request of a prepared claim.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PreparedRequest {
    pub request: String,
    /// (device name in the ResourceSlice, the module's device ID).
    pub devices: Vec<(String, String)>,
    /// The opaque config the module was given (JSON, or empty).
    pub config: String,
    /// What the kubelet was told: the CDI device IDs a container using the request gets.
    pub cdi_ids: Vec<String>,
    /// Allocated with admin access (monitoring a device others use): holds nothing.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub admin: bool,
}

impl ClaimRecord {
    /// The module device IDs it holds exclusively (admin requests hold none).
    fn held(&self) -> impl Iterator<Item = &str> {
        self.requests
            .iter()
            .filter(|r| !r.admin)
            .flat_map(|r| r.devices.iter().map(|(_, id)| id.as_str()))
    }
}

/// Who already holds a device someone asked for.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Conflict {
    #[error(
        "device {device:?} of {resource} is already prepared for ResourceClaim {namespace}/{name} (UID {uid})"
    )]
    Claim {
        resource: String,
        device: String,
        namespace: String,
        name: String,
        uid: String,
    },
    #[error(
        "device {device:?} of {resource} is held by {holder}, to which the device-plugin front \
         end allocated it; it is free once that container ends"
    )]
    Container {
        resource: String,
        device: String,
        holder: String,
    },
    #[error("ResourceClaim UID {uid} is being prepared already")]
    Busy { uid: String },
}

/// A claim and whether it is prepared yet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Claim {
    pub record: ClaimRecord,
    pub prepared: bool,
}

/// Every claim, by UID, with an index of the devices they hold.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Claims {
    pub by_uid: BTreeMap<String, Claim>,
    /// (resource, module device ID) → the UID holding it exclusively. Derived from `by_uid`.
    index: HashMap<(String, String), String>,
}

impl Claims {
    /// The table holding `prepared` claims (a restored checkpoint), or why it cannot be trusted.
    pub fn restore(prepared: BTreeMap<String, ClaimRecord>) -> Result<Claims, String> {
        let mut claims = Claims::default();
        for (uid, record) in prepared {
            if let Some(conflict) = claims.conflict(&uid, &record) {
                return Err(format!("two claims hold one device: {conflict}"));
            }
            claims.insert(uid, record, true);
        }
        Ok(claims)
    }

    /// The first device `record` asks for that another claim holds.
    pub fn conflict(&self, uid: &str, record: &ClaimRecord) -> Option<Conflict> {
        for id in record.held() {
            let key = (record.resource.clone(), id.to_owned());
            if let Some(other) = self.index.get(&key).filter(|o| *o != uid)
                && let Some(held) = self.by_uid.get(other)
            {
                return Some(Conflict::Claim {
                    resource: record.resource.clone(),
                    device: id.to_owned(),
                    namespace: held.record.namespace.clone(),
                    name: held.record.name.clone(),
                    uid: other.clone(),
                });
            }
        }
        None
    }

    /// The claim holding device `id` (a module ID, or a replica of one) of `resource` as the
    /// device-plugin front end serves it (its own name, or the `.shared` one).
    pub fn holder_of(&self, resource: &str, id: &str) -> Option<(&String, &ClaimRecord)> {
        let base = resource.strip_suffix(RENAMED_SUFFIX).unwrap_or(resource);
        let uid = self
            .index
            .get(&(base.to_owned(), physical_id(id).to_owned()))?;
        self.by_uid.get(uid).map(|c| (uid, &c.record))
    }

    /// The first of `ids` (as the device-plugin front end serves `resource`) a claim holds.
    pub fn claim_holding(&self, resource: &str, ids: &[String]) -> Option<Conflict> {
        ids.iter().find_map(|id| {
            let (uid, held) = self.holder_of(resource, id)?;
            Some(Conflict::Claim {
                resource: held.resource.clone(),
                device: id.clone(),
                namespace: held.namespace.clone(),
                name: held.name.clone(),
                uid: uid.clone(),
            })
        })
    }

    /// Module IDs of `resource` that claims hold.
    pub fn held_ids(&self, resource: &str) -> std::collections::BTreeSet<String> {
        self.index
            .keys()
            .filter(|(r, _)| r == resource)
            .map(|(_, id)| id.clone())
            .collect()
    }

    pub fn insert(&mut self, uid: String, record: ClaimRecord, prepared: bool) {
        self.remove(&uid);
        for id in record.held() {
            self.index
                .insert((record.resource.clone(), id.to_owned()), uid.clone());
        }
        self.by_uid.insert(uid, Claim { record, prepared });
    }

    pub fn remove(&mut self, uid: &str) -> Option<Claim> {
        let gone = self.by_uid.remove(uid)?;
        for id in gone.record.held() {
            let key = (gone.record.resource.clone(), id.to_owned());
            if self.index.get(&key).is_some_and(|u| u == uid) {
                self.index.remove(&key);
            }
        }
        Some(gone)
    }

    /// The prepared claims, as the checkpoint keeps them.
    pub fn prepared(&self) -> BTreeMap<&String, &ClaimRecord> {
        self.by_uid
            .iter()
            .filter(|(_, c)| c.prepared)
            .map(|(uid, c)| (uid, &c.record))
            .collect()
    }
}

/// The first of `record`'s devices a container entry holds (under the resource's own name, or
/// shared and renamed), as a conflict.
pub(crate) fn container_holding(entries: &[Entry], record: &ClaimRecord) -> Option<Conflict> {
    let shared = format!("{}{RENAMED_SUFFIX}", record.resource);
    for id in record.held() {
        let holding = entries.iter().rev().find(|e| {
            (e.resource == record.resource || e.resource == shared)
                && e.device_ids.iter().any(|d| physical_id(d) == id)
        });
        if let Some(entry) = holding {
            return Some(Conflict::Container {
                resource: record.resource.clone(),
                device: id.to_owned(),
                holder: match &entry.holder {
                    Some(h) => format!("container {h}"),
                    None => "a container the kubelet has not reported yet".to_owned(),
                },
            });
        }
    }
    None
}
