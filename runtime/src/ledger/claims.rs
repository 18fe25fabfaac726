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
    /// Recorded before the module's `prepare` (WIT 0.3 `claims`) was called, and not yet known
    /// prepared: after a restart its requests are unprepared, whatever the module created.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub preparing: bool,
    /// Prepared by the module's own `prepare` (WIT 0.3 `claims`), so undone by its `unprepare`
    /// whatever the module (or a new version of it) says later.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub by_module: bool,
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
    /// Its parts of devices shared by capacity (WIT 0.3): such a device is held by share, not
    /// exclusively.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub shares: Vec<HeldShare>,
    /// What the module's `prepare` said for the claim's status: (device ID, JSON object).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub status: Vec<(String, String)>,
}

/// A part of a device shared by capacity that one request holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeldShare {
    /// The module's device ID.
    pub device: String,
    /// The scheduler's `shareID`.
    pub share_id: String,
    /// (capacity, quantity).
    pub consumed: Vec<(String, String)>,
}

impl PreparedRequest {
    /// Whether it holds device `id` by share.
    fn shares_device(&self, id: &str) -> bool {
        self.shares.iter().any(|s| s.device == id)
    }
}

impl ClaimRecord {
    /// The module device IDs it holds exclusively (admin requests hold none; a shared device
    /// is held by share).
    pub(crate) fn held(&self) -> impl Iterator<Item = &str> {
        self.requests.iter().filter(|r| !r.admin).flat_map(|r| {
            r.devices
                .iter()
                .map(|(_, id)| id.as_str())
                .filter(|id| !r.shares_device(id))
        })
    }

    /// Its shares of devices shared by capacity (admin requests hold none).
    pub(crate) fn shares(&self) -> impl Iterator<Item = &HeldShare> {
        self.requests
            .iter()
            .filter(|r| !r.admin)
            .flat_map(|r| &r.shares)
    }

    /// Every device it holds, exclusively or by share.
    fn holds(&self) -> impl Iterator<Item = &str> {
        self.held().chain(self.shares().map(|s| s.device.as_str()))
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
    #[error(
        "device {device:?} of {resource} is allocated as a share, but its module does not share it by capacity"
    )]
    NotShared { resource: String, device: String },
    #[error(
        "device {device:?} of {resource}: the claim's share asks {asked} of its {capacity}, and {left} is left"
    )]
    Capacity {
        resource: String,
        device: String,
        capacity: String,
        asked: String,
        left: String,
    },
    #[error(
        "device {device:?} of {resource} would take counter {counter} of set {counter_set} past its {total}, with the partitions other claims hold"
    )]
    Counters {
        resource: String,
        device: String,
        counter_set: String,
        counter: String,
        total: String,
    },
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

    /// The first device `record` asks for that another claim holds: exclusively, or (for a
    /// device `record` wants whole) by share.
    pub fn conflict(&self, uid: &str, record: &ClaimRecord) -> Option<Conflict> {
        let found = |id: &str, other: &String, held: &ClaimRecord| Conflict::Claim {
            resource: record.resource.clone(),
            device: id.to_owned(),
            namespace: held.namespace.clone(),
            name: held.name.clone(),
            uid: other.clone(),
        };
        for id in record.holds() {
            let key = (record.resource.clone(), id.to_owned());
            if let Some(other) = self.index.get(&key).filter(|o| *o != uid)
                && let Some(held) = self.by_uid.get(other)
            {
                return Some(found(id, other, &held.record));
            }
        }
        for id in record.held() {
            if let Some((other, held)) = self.sharing(&record.resource, id).find(|(o, _)| *o != uid)
            {
                return Some(found(id, other, held));
            }
        }
        None
    }

    /// The claims holding shares of device `id` of `resource`, and their records.
    pub fn sharing<'a>(
        &'a self,
        resource: &str,
        id: &str,
    ) -> impl Iterator<Item = (&'a String, &'a ClaimRecord)> + use<'a> {
        let (resource, id) = (resource.to_owned(), id.to_owned());
        self.by_uid
            .iter()
            .filter(move |(_, c)| {
                c.record.resource == resource && c.record.shares().any(|s| s.device == id)
            })
            .map(|(uid, c)| (uid, &c.record))
    }

    /// The claim holding device `id` (a module ID, or a replica of one) of `resource` as the
    /// device-plugin front end serves it (its own name, or the `.shared` one).
    pub fn holder_of(&self, resource: &str, id: &str) -> Option<(&String, &ClaimRecord)> {
        let base = resource.strip_suffix(RENAMED_SUFFIX).unwrap_or(resource);
        let id = physical_id(id);
        match self.index.get(&(base.to_owned(), id.to_owned())) {
            Some(uid) => self.by_uid.get(uid).map(|c| (uid, &c.record)),
            None => self.sharing(base, id).next(),
        }
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

    /// Module IDs of `resource` that claims hold, exclusively or by share.
    pub fn held_ids(&self, resource: &str) -> std::collections::BTreeSet<String> {
        let shared = self
            .by_uid
            .values()
            .filter(|c| c.record.resource == resource)
            .flat_map(|c| c.record.shares().map(|s| s.device.clone()));
        self.index
            .keys()
            .filter(|(r, _)| r == resource)
            .map(|(_, id)| id.clone())
            .chain(shared)
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
    for id in record.holds() {
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
