//! Keeping one resource's device snapshot current: re-enumerate at the module's interval and
//! publish a new snapshot only when something changed.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{Notify, watch};

use super::backend::DeviceBackend;
use super::snapshot::Snapshot;
use crate::device::{Device, Health};

/// The first snapshot. A module that cannot enumerate yet starts with no devices.
async fn initial(backend: &impl DeviceBackend, resource: &str) -> Vec<Device> {
    match backend.enumerate(resource).await {
        Ok(devices) => sorted(devices),
        Err(e) => {
            tracing::warn!("{e}");
            Vec::new()
        }
    }
}

fn sorted(mut devices: Vec<Device>) -> Vec<Device> {
    devices.sort_by(|a, b| a.id.cmp(&b.id));
    devices
}

/// Keeps `next` as the current snapshot (status and policies read its attributes), but wakes the
/// ListAndWatch streams only when what the kubelet sees changed: IDs, health or topology.
fn publish(devices: &watch::Sender<Snapshot>, next: Vec<Device>) {
    devices.send_if_modified(|current| {
        if **current == next {
            return false;
        }
        let seen_by_kubelet = |d: &Device| (d.id.clone(), d.health, d.numa_nodes.clone());
        let changed = current.len() != next.len()
            || current
                .iter()
                .zip(&next)
                .any(|(a, b)| seen_by_kubelet(a) != seen_by_kubelet(b));
        *current = Arc::new(next);
        changed
    });
}

/// While the module fails, its devices stay listed but Unhealthy, so the kubelet stops
/// admitting pods to them instead of failing admissions in a loop.
fn all_unhealthy(devices: &[Device]) -> Vec<Device> {
    devices
        .iter()
        .map(|d| Device {
            health: Health::Unhealthy,
            ..d.clone()
        })
        .collect()
}

/// What a device watcher reports to, and is woken by.
pub struct Signals {
    /// Flips to true once the first snapshot is in.
    pub ready: watch::Sender<bool>,
    /// Re-enumerate at once (a device node appeared or vanished under the module's /dev grants,
    /// or a new module version was swapped in).
    pub poke: Arc<Notify>,
    /// Fired after every enumeration, changed or not: the preparer checks its answers then.
    pub enumerated: Arc<Notify>,
    pub stop: watch::Receiver<bool>,
}

/// Takes the first snapshot (then flips `ready`), and re-enumerates at every `interval`, and at
/// once when `poke` fires.
pub async fn watch_devices<B: DeviceBackend>(
    backend: B,
    resource: String,
    interval: Duration,
    devices: watch::Sender<Snapshot>,
    signals: Signals,
) {
    let Signals {
        ready,
        poke,
        enumerated,
        mut stop,
    } = signals;
    let first = tokio::select! {
        first = initial(&backend, &resource) => first,
        _ = stop.wait_for(|s| *s) => return,
    };
    devices.send_replace(Arc::new(first));
    ready.send_replace(true);
    enumerated.notify_one();
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticker.tick().await;
    let mut failing = false;
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            _ = poke.notified() => ticker.reset(),
            _ = stop.wait_for(|s| *s) => return,
        }
        let found = tokio::select! {
            found = backend.enumerate(&resource) => found,
            _ = stop.wait_for(|s| *s) => return,
        };
        let next = match found {
            Ok(found) => {
                if failing {
                    tracing::info!(module = backend.name(), resource, "enumerate works again");
                    failing = false;
                }
                sorted(found)
            }
            Err(e) => {
                if !failing {
                    tracing::warn!(resource, "{e}; reporting its devices Unhealthy");
                    failing = true;
                }
                all_unhealthy(&devices.borrow())
            }
        };
        publish(&devices, next);
        enumerated.notify_one();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn device(id: &str, health: Health, attribute: &str) -> Device {
        Device {
            id: id.into(),
            health,
            numa_nodes: vec![0],
            attributes: vec![("temperature".into(), attribute.into())],
        }
    }

    #[test]
    fn attribute_only_changes_are_kept_but_wake_no_stream() {
        let (tx, mut rx) = watch::channel(Snapshot::default());
        publish(&tx, vec![device("a", Health::Healthy, "40C")]);
        assert!(rx.has_changed().unwrap());
        rx.borrow_and_update();
        publish(&tx, vec![device("a", Health::Healthy, "41C")]);
        assert!(!rx.has_changed().unwrap(), "the kubelet sees nothing new");
        assert_eq!(
            rx.borrow()[0].attributes[0].1,
            "41C",
            "but the host keeps the new value"
        );
        publish(&tx, vec![device("a", Health::Unhealthy, "90C")]);
        assert!(rx.has_changed().unwrap(), "health reaches the kubelet");
    }
}
