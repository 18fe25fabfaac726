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
                if !complained {
                    tracing::warn!("cannot reconcile the ledger: {e}; will keep trying");
                    complained = true;
                }
                continue;
            }
        };
        complained = false;
        // Only our resources are adopted from PodResources; other plugins' are not our business.
        let ours: Vec<String> = shared.resources().into_iter().map(|r| r.name).collect();
        let report = shared
            .ledger
            .reconcile(&podresources::held(&pods), grace, &|r| {
                ours.iter().any(|n| n == r)
            });
        shared.metrics.reconciled(Some(&report));
        tracing::debug!(%report, "ledger reconciled with PodResources");
    }
}
