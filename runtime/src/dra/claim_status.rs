//! Claim device status (KEP-4817, `status.devices`; beta and on by default since 1.33, GA in
//! 1.37): once a claim is prepared, the driver writes an entry for each device it prepared, so
//! `kubectl get resourceclaim -o yaml` shows which device the pod got (the module's own ID:
//! a GPU's UUID for nvidia-gpu) and the CDI devices its containers see; unprepare removes them.
//!
//! Written by server-side apply on the `status` subresource with the driver's name as field
//! manager, so drivers sharing a claim never overwrite each other's entries. Writing is off the
//! kubelet's path: a prepare is answered once the claim is durable, and its status follows from
//! a queue one task per driver works through in order (a claim's prepare and unprepare entries
//! are never applied out of order). A failed write is retried a few times, then logged and
//! counted as an API error; the claim stays prepared either way.

use std::time::Duration;

use serde_json::{Value, json};
use tokio::sync::mpsc;

use super::api::ApiClient;
use super::events::{DraEvent, DraEvents};
use crate::ledger::ClaimRecord;

/// Writes waiting at most; past it a write is dropped (and logged): status is a report, and a
/// stalled API server must not grow the agent.
const QUEUE: usize = 1024;
/// Tries per write, and the first wait between them (doubling).
const TRIES: u32 = 3;
const FIRST_RETRY: Duration = Duration::from_millis(200);

/// One claim's entries to apply; empty removes this driver's.
struct Write {
    namespace: String,
    name: String,
    devices: Vec<Value>,
}

/// The queue of one driver's status writes. Dropping it ends its task once the queue is done.
pub struct StatusWriter {
    queue: mpsc::Sender<Write>,
    driver: String,
}

impl StatusWriter {
    /// Starts the driver's writer task (on the current runtime).
    pub fn start(api: ApiClient, driver: String, events: DraEvents) -> StatusWriter {
        let (queue, writes) = mpsc::channel(QUEUE);
        tokio::spawn(work(api, driver.clone(), events, writes));
        StatusWriter { queue, driver }
    }

    /// Queues the entries of prepared claim `record` (this node's `pool`).
    pub fn prepared(&self, pool: &str, record: &ClaimRecord) {
        let devices = entries(
            &self.driver,
            pool,
            record,
            &devicelet_api::timestamp::now_rfc3339(),
        );
        self.send(&record.namespace, &record.name, devices);
    }

    /// Queues the removal of this driver's entries from claim `namespace/name`.
    pub fn unprepared(&self, namespace: &str, name: &str) {
        self.send(namespace, name, Vec::new());
    }

    fn send(&self, namespace: &str, name: &str, devices: Vec<Value>) {
        let write = Write {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
            devices,
        };
        if self.queue.try_send(write).is_err() {
            tracing::warn!(
                driver = self.driver,
                claim = format!("{namespace}/{name}"),
                "claim status not written: {QUEUE} writes already wait for the API server"
            );
        }
    }
}

async fn work(
    api: ApiClient,
    driver: String,
    events: DraEvents,
    mut writes: mpsc::Receiver<Write>,
) {
    while let Some(write) = writes.recv().await {
        let mut wait = FIRST_RETRY;
        for attempt in 1..=TRIES {
            let written = api
                .apply_claim_status(
                    &write.namespace,
                    &write.name,
                    &driver,
                    write.devices.clone(),
                )
                .await;
            match written {
                Ok(()) => break,
                // The claim is gone (deleted with its pod): nothing to report on.
                Err(e) if e.is_not_found() => break,
                Err(e) => {
                    events.emit(&driver, DraEvent::ApiError);
                    if attempt == TRIES {
                        tracing::warn!(
                            driver,
                            claim = format!("{}/{}", write.namespace, write.name),
                            "claim status not written: {e}"
                        );
                    } else {
                        tokio::time::sleep(wait).await;
                        wait *= 2;
                    }
                }
            }
        }
    }
}

/// The `status.devices` entries for prepared claim `record`: one per device name, Ready, with
/// the module's IDs of the device (a group's every member) and the CDI devices of its request.
/// A device shared by capacity gets one entry per share (with its `shareID`), and the module's
/// own status data (WIT 0.3 `prepare`) goes into `data` beside the host's keys.
fn entries(driver: &str, pool: &str, record: &ClaimRecord, now: &str) -> Vec<Value> {
    struct One<'a> {
        device: &'a str,
        share: Option<&'a str>,
        ids: Vec<&'a str>,
        request: &'a crate::ledger::PreparedRequest,
    }
    let mut out: Vec<One> = Vec::new();
    for request in &record.requests {
        for (device, id) in &request.devices {
            let shares: Vec<Option<&str>> = match request
                .shares
                .iter()
                .filter(|s| &s.device == id)
                .map(|s| Some(s.share_id.as_str()))
                .collect::<Vec<_>>()
            {
                none if none.is_empty() => vec![None],
                some => some,
            };
            for share in shares {
                match out
                    .iter_mut()
                    .find(|o| o.device == device && o.share == share)
                {
                    Some(one) => one.ids.push(id),
                    None => out.push(One {
                        device,
                        share,
                        ids: vec![id],
                        request,
                    }),
                }
            }
        }
    }
    out.into_iter()
        .map(|one| {
            let mut data = serde_json::Map::new();
            for (id, own) in &one.request.status {
                if one.ids.contains(&id.as_str())
                    && let Ok(Value::Object(own)) = serde_json::from_str::<Value>(own)
                {
                    data.extend(own);
                }
            }
            data.insert("deviceIDs".into(), json!(one.ids));
            data.insert("cdiDeviceIDs".into(), json!(one.request.cdi_ids));
            let mut entry = json!({
                "driver": driver,
                "pool": pool,
                "device": one.device,
                "conditions": [{
                    "type": "Ready",
                    "status": "True",
                    "reason": "Prepared",
                    "message": format!("prepared for request {}", one.request.request),
                    "lastTransitionTime": now,
                }],
                "data": data,
            });
            if let Some(share) = one.share {
                entry["shareID"] = json!(share);
            }
            entry
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::PreparedRequest;

    #[test]
    fn each_prepared_device_gets_one_ready_entry_with_its_ids_and_cdi_devices() {
        let request = |name: &str, devices: &[(&str, &str)], cdi: &str| PreparedRequest {
            request: name.into(),
            devices: devices
                .iter()
                .map(|(d, i)| (d.to_string(), i.to_string()))
                .collect(),
            config: String::new(),
            cdi_ids: vec![cdi.into()],
            admin: false,
            shares: Vec::new(),
            status: Vec::new(),
        };
        let record = ClaimRecord {
            driver: "gpu.example.com".into(),
            resource: "example.com/gpu".into(),
            namespace: "team-a".into(),
            name: "claim".into(),
            requests: vec![
                // A group: one DRA device, two module devices.
                request(
                    "gpu",
                    &[("gpu-0", "GPU-aaaa"), ("gpu-0", "GPU-aaaa-audio")],
                    "k8s.gpu.example.com/claim=uid-gpu",
                ),
                request(
                    "nic",
                    &[("nic-3", "0000:3b:00.1")],
                    "k8s.gpu.example.com/claim=uid-nic",
                ),
            ],
            spec_file: None,
            preparing: false,
            by_module: false,
        };
        let entries = entries("gpu.example.com", "node-a", &record, "2026-11-28T19:00:00Z");
        assert_eq!(entries.len(), 2);
        assert_eq!(entries[0]["device"], "gpu-0");
        assert_eq!(entries[0]["pool"], "node-a");
        assert_eq!(
            entries[0]["data"]["deviceIDs"],
            json!(["GPU-aaaa", "GPU-aaaa-audio"])
        );
        assert_eq!(
            entries[1]["data"]["cdiDeviceIDs"],
            json!(["k8s.gpu.example.com/claim=uid-nic"])
        );
        let ready = &entries[1]["conditions"][0];
        assert_eq!(
            (
                ready["type"].as_str(),
                ready["status"].as_str(),
                ready["reason"].as_str()
            ),
            (Some("Ready"), Some("True"), Some("Prepared"))
        );
        assert_eq!(ready["lastTransitionTime"], "2026-11-28T19:00:00Z");
    }
}
