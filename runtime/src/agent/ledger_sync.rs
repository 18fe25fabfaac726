//! Keeping the ledger true to the kubelet: the plugin is never told when a container ends, so
//! the kubelet's PodResources `List` is asked periodically which pod holds which device.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use super::Shared;
use crate::kubelet::podresources;

pub async fn run(
    shared: Arc<Shared>,
    socket: PathBuf,
    interval: Duration,
    grace: Duration,
    mut stop: watch::Receiver<bool>,
) {
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut complained = false;
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        let pods = match podresources::list_pods(&socket).await {
            Ok(pods) => pods,
            Err(e) => {
                shared.metrics.reconciled(None);
                if !needs_pod_resources(&shared) {
                    // DRA drivers alone: the kubelet ends each claim itself, and no device
                    // plugin allocation waits to be freed. Nothing is wrong yet.
                    tracing::debug!("PodResources not reachable ({e}); no allocation needs it");
                } else if !complained {
                    tracing::warn!("cannot reconcile the ledger: {e}; will keep trying");
                    complained = true;
                }
                continue;
            }
        };
        complained = false;
        // Only our resources are adopted from PodResources; other plugins' are not our business.
        // A resource served through DRA counts too: allocations its device plugin made (before a
        // move, or before the ledger was lost) keep its devices out of the pool until they end.
        let mut ours: Vec<String> = shared.resources().into_iter().map(|r| r.name).collect();
        for name in shared.dra_resources() {
            ours.push(format!("{name}{}", crate::policy::sharing::RENAMED_SUFFIX));
            ours.push(name);
        }
        let report = shared
            .ledger
            .reconcile(&podresources::held(&pods), grace, &|r| {
                ours.iter().any(|n| n == r)
            });
        shared.metrics.reconciled(Some(&report));
        if !report.freed.is_empty() {
            // Devices held through the device plugin may have been freed: DRA pools take them in.
            shared.republish_drivers();
        }
        tracing::debug!(%report, "ledger reconciled with PodResources");
    }
}

/// Only allocations made through the device plugin end by disappearing from PodResources: it is
/// needed while a device-plugin resource is served or the ledger holds such an allocation
/// (made before a resource moved to DRA, kept out of the DRA pool until it ends).
fn needs_pod_resources(shared: &Shared) -> bool {
    !shared.resources().is_empty() || shared.ledger.entry_count() > 0
}
