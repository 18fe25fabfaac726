//! A ResourceClaim's `status.devices` (KEP-4817: each driver's word on the devices it
//! prepared), written the way drivers write it: server-side apply on the `status` subresource
//! with a field manager of their own, so that drivers sharing a claim never overwrite each
//! other's entries. The stand-in implements the part of apply that field needs: the list is a
//! map keyed by (driver, pool, device); an apply replaces the entries it names (taking them
//! over, as `force=true` does) and removes the entries its manager applied before and leaves
//! out now; other managers' entries stay. Anything else in the applied status is refused.

use serde_json::{Value, json};

use crate::apiserver::{ApiError, Kind, Store};
use crate::validation;

type EntryKey = (String, String, String);

fn key_of(entry: &Value) -> EntryKey {
    let text = |f: &str| entry[f].as_str().unwrap_or_default().to_owned();
    (text("driver"), text("pool"), text("device"))
}

impl Store {
    /// `PATCH …/resourceclaims/<name>/status` with an apply patch from `manager`.
    pub(crate) fn apply_claim_status(
        &mut self,
        namespace: &str,
        name: &str,
        manager: &str,
        patch: Value,
    ) -> Result<Value, ApiError> {
        let bad = |m: &str| ApiError {
            code: 400,
            reason: "BadRequest",
            message: m.to_owned(),
        };
        if patch["apiVersion"] != "resource.k8s.io/v1" || patch["kind"] != "ResourceClaim" {
            return Err(bad(
                "an apply patch must name apiVersion resource.k8s.io/v1 and kind ResourceClaim",
            ));
        }
        if let Some(given) = patch["metadata"]["name"].as_str()
            && given != name
        {
            return Err(bad(&format!(
                "the name of the object ({given}) does not match the name on the URL ({name})"
            )));
        }
        let status = patch["status"].as_object().cloned().unwrap_or_default();
        if let Some(other) = status.keys().find(|k| *k != "devices") {
            return Err(invalid(
                name,
                vec![format!(
                    "status.{other}: Forbidden: the stand-in applies only status.devices"
                )],
            ));
        }
        let key = (Kind::ResourceClaim, namespace.to_owned(), name.to_owned());
        let mut claim = self
            .objects
            .get(&key)
            .cloned()
            .ok_or_else(|| ApiError::not_found(Kind::ResourceClaim, name))?;
        let given: Vec<Value> = status
            .get("devices")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        let mut owners = self.status_owners.get(&key).cloned().unwrap_or_default();
        let named: Vec<EntryKey> = given.iter().map(key_of).collect();
        let mut devices: Vec<Value> = claim["status"]["devices"]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .into_iter()
            .filter(|entry| {
                let k = key_of(entry);
                // Left out by the manager that applied it: removed.
                named.contains(&k) || owners.get(&k).is_none_or(|m| m != manager)
            })
            .collect();
        for entry in given {
            let k = key_of(&entry);
            match devices.iter_mut().find(|d| key_of(d) == k) {
                Some(old) => *old = entry,
                None => devices.push(entry),
            }
            owners.insert(k, manager.to_owned());
        }
        owners.retain(|k, m| m != manager || named.contains(k));
        let causes = validation::claim_device_statuses(&claim, &devices);
        if !causes.is_empty() {
            return Err(invalid(name, causes));
        }
        if devices.is_empty() {
            if let Some(status) = claim["status"].as_object_mut() {
                status.remove("devices");
            }
        } else {
            claim["status"]["devices"] = json!(devices);
        }
        claim["metadata"]["resourceVersion"] = json!(self.next_version());
        self.record(&key, "MODIFIED", &claim);
        self.objects.insert(key.clone(), claim.clone());
        self.status_owners.insert(key, owners);
        Ok(claim)
    }
}

fn invalid(name: &str, causes: Vec<String>) -> ApiError {
    ApiError {
        code: 422,
        reason: "Invalid",
        message: format!(
            "ResourceClaim.resource.k8s.io {name:?} is invalid: {}",
            causes.join(", ")
        ),
    }
}
