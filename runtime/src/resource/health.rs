//! Keeping one resource's device snapshot current: re-enumerate at the module's interval and
//! publish a new snapshot only when something changed.
//!
//! A failed enumeration is evidence against the devices (they are reported Unhealthy); one that
//! ran out of time is not. A vendor library that stalls (NVML on a busy or recovering driver)
//! says nothing about any one device, so the last snapshot stands while enumerations keep
//! missing their deadline, for up to [`STALL_LIMIT`]; only a backend that has not answered in
//! all that time has its devices reported Unhealthy.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{Notify, watch};
use tokio::time::Instant;

use super::backend::{BackendError, DeviceBackend};
use super::snapshot::Snapshot;
use crate::device::{Device, Health, Inventory};

/// How long enumerations may keep missing their deadline before the devices are reported
/// Unhealthy: long enough for a driver to come back from a reset or a burst of slow queries, short
/// enough that a wedged one stops pods being sent to its devices.
pub const STALL_LIMIT: Duration = Duration::from_secs(300);

/// The first snapshot. A module that cannot enumerate yet starts with no devices.
async fn initial(backend: &impl DeviceBackend, resource: &str) -> Result<Inventory, BackendError> {
    let found = backend.enumerate(resource).await.map(sorted);
    if let Err(e) = &found {
        tracing::warn!("{e}");
    }
    found
}

/// When to enumerate again before the interval, as the backend's last answer asked. Only an
/// answer may ask: a failing backend is looked at by the interval, never in a loop.
fn recheck_at<T>(
    backend: &impl DeviceBackend,
    resource: &str,
    interval: Duration,
    found: &Result<T, BackendError>,
) -> Option<Instant> {
    found.as_ref().ok()?;
    backend
        .recheck_after(resource)
        .filter(|after| *after < interval)
        .map(|after| Instant::now() + after)
}

fn sorted(mut inventory: Inventory) -> Inventory {
    inventory.sort_by(|a, b| a.id.cmp(&b.id));
    inventory
}

/// Keeps `next` as the current snapshot (status and policies read its attributes), but wakes the
/// ListAndWatch streams only when what the kubelet sees changed: IDs, health or topology.
fn publish(devices: &watch::Sender<Snapshot>, next: Inventory) {
    devices.send_if_modified(|current| {
        if **current == next {
            return false;
        }
        let seen_by_kubelet = |d: &Device| (d.id.clone(), d.health, d.numa_nodes.clone());
        let changed = current.len() != next.len()
            || current
                .iter()
                .zip(next.iter())
                .any(|(a, b)| seen_by_kubelet(a) != seen_by_kubelet(b));
        *current = Arc::new(next);
        changed
    });
}

/// While the module fails, its devices stay listed but Unhealthy, so the kubelet stops
/// admitting pods to them instead of failing admissions in a loop.
fn all_unhealthy(inventory: &Inventory) -> Inventory {
    Inventory {
        devices: inventory
            .iter()
            .map(|d| Device {
                health: Health::Unhealthy,
                ..d.clone()
            })
            .collect(),
        counter_sets: inventory.counter_sets.clone(),
    }
}

/// Resolves at `at`; never without one.
async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
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
    watch_with_limit(backend, resource, interval, devices, signals, STALL_LIMIT).await;
}

async fn watch_with_limit<B: DeviceBackend>(
    backend: B,
    resource: String,
    interval: Duration,
    devices: watch::Sender<Snapshot>,
    signals: Signals,
    stall_limit: Duration,
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
    // When the backend asked to be enumerated again, sooner than the interval.
    let mut recheck = recheck_at(&backend, &resource, interval, &first);
    devices.send_replace(Arc::new(first.unwrap_or_default()));
    ready.send_replace(true);
    enumerated.notify_one();
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticker.tick().await;
    let mut failing = false;
    // When enumerations started missing their deadline, while they keep doing so.
    let mut stalled_since: Option<Instant> = None;
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            _ = poke.notified() => ticker.reset(),
            () = sleep_until(recheck) => ticker.reset(),
            _ = stop.wait_for(|s| *s) => return,
        }
        let found = tokio::select! {
            found = backend.enumerate(&resource) => found,
            _ = stop.wait_for(|s| *s) => return,
        };
        recheck = recheck_at(&backend, &resource, interval, &found);
        let next = match found {
            Ok(found) => {
                if failing || stalled_since.is_some() {
                    tracing::info!(module = backend.name(), resource, "enumerate works again");
                    failing = false;
                    stalled_since = None;
                }
                sorted(found)
            }
            Err(e @ BackendError::Deadline(_))
                if stalled_since.is_none_or(|since| since.elapsed() < stall_limit) =>
            {
                if stalled_since.is_none() {
                    tracing::warn!(
                        resource,
                        "{e}; keeping its last snapshot while it is slow (devices turn Unhealthy \
                         only if it stays so for {stall_limit:?})"
                    );
                    stalled_since = Some(Instant::now());
                }
                continue;
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
    use std::collections::VecDeque;
    use std::sync::Mutex;

    type Answer = Result<Inventory, BackendError>;

    /// Answers enumerate from a script, one entry per call; the last entry repeats. Counts calls.
    #[derive(Clone)]
    struct Scripted {
        script: Arc<Mutex<VecDeque<Answer>>>,
        calls: watch::Sender<usize>,
    }

    impl DeviceBackend for Scripted {
        crate::resource::backend::plain_calls!();

        fn name(&self) -> &str {
            "scripted"
        }

        async fn enumerate(&self, _: &str) -> Result<Inventory, BackendError> {
            self.calls.send_modify(|n| *n += 1);
            let mut script = self.script.lock().unwrap();
            if script.len() > 1 {
                script.pop_front().unwrap()
            } else {
                script.front().cloned().unwrap()
            }
        }

        async fn allocate(
            &self,
            _: &str,
            _: Vec<String>,
        ) -> Result<crate::device::ContainerEdits, BackendError> {
            Err(BackendError::Failed("not asked here".into()))
        }
    }

    /// Runs a watcher over `script` (every 5 ms) until it has enumerated `calls` times, and
    /// returns every snapshot the kubelet's streams were woken for after the first.
    async fn published(
        script: Vec<Result<Inventory, BackendError>>,
        calls: usize,
        stall_limit: Duration,
    ) -> Vec<Vec<Device>> {
        let backend = Scripted {
            script: Arc::new(Mutex::new(script.into())),
            calls: watch::Sender::new(0),
        };
        let mut counted = backend.calls.subscribe();
        let (devices, mut snapshot) = watch::channel(Snapshot::default());
        let (stop_tx, stop) = watch::channel(false);
        let signals = Signals {
            ready: watch::Sender::new(false),
            poke: Arc::default(),
            enumerated: Arc::default(),
            stop,
        };
        let watcher = tokio::spawn(watch_with_limit(
            backend,
            "r".into(),
            Duration::from_millis(5),
            devices,
            signals,
            stall_limit,
        ));
        let mut seen = Vec::new();
        snapshot.changed().await.unwrap();
        snapshot.borrow_and_update();
        loop {
            tokio::select! {
                _ = snapshot.changed() => seen.push(snapshot.borrow_and_update().to_vec()),
                _ = counted.wait_for(|n| *n >= calls) => break,
            }
        }
        let _ = stop_tx.send(true);
        watcher.await.unwrap();
        seen
    }

    fn slow() -> Result<Inventory, BackendError> {
        Err(BackendError::Deadline("missed its deadline".into()))
    }

    #[tokio::test]
    async fn a_stall_keeps_the_last_snapshot_and_a_failure_does_not() {
        let healthy = vec![device("a", Health::Healthy, "40C")];
        let seen = published(vec![Ok(healthy.clone().into()), slow()], 6, STALL_LIMIT).await;
        assert!(seen.is_empty(), "stalls changed nothing: {seen:?}");
        let failed = Err(BackendError::Failed("no such device".into()));
        let seen = published(vec![Ok(healthy.into()), slow(), failed], 4, STALL_LIMIT).await;
        assert_eq!(seen.len(), 1, "{seen:?}");
        assert_eq!(
            seen[0][0].health,
            Health::Unhealthy,
            "a failure is evidence"
        );
    }

    #[tokio::test]
    async fn stalls_past_the_limit_turn_the_devices_unhealthy() {
        let healthy = vec![device("a", Health::Healthy, "40C")];
        let limit = Duration::from_millis(30);
        // 5 ms apart, the twentieth enumeration comes well past the limit.
        let seen = published(vec![Ok(healthy.into()), slow()], 20, limit).await;
        assert_eq!(seen.len(), 1, "{seen:?}");
        assert_eq!(seen[0][0].health, Health::Unhealthy);
    }

    fn device(id: &str, health: Health, attribute: &str) -> Device {
        Device {
            id: id.into(),
            health,
            numa_nodes: vec![0],
            attributes: vec![("temperature".into(), attribute.into())],
            ..crate::device::Device::new("", crate::device::Health::Healthy)
        }
    }

    #[test]
    fn attribute_only_changes_are_kept_but_wake_no_stream() {
        let (tx, mut rx) = watch::channel(Snapshot::default());
        publish(&tx, vec![device("a", Health::Healthy, "40C")].into());
        assert!(rx.has_changed().unwrap());
        rx.borrow_and_update();
        publish(&tx, vec![device("a", Health::Healthy, "41C")].into());
        assert!(!rx.has_changed().unwrap(), "the kubelet sees nothing new");
        assert_eq!(
            rx.borrow()[0].attributes[0].1,
            crate::device::AttributeValue::from("41C"),
            "but the host keeps the new value"
        );
        publish(&tx, vec![device("a", Health::Unhealthy, "90C")].into());
        assert!(rx.has_changed().unwrap(), "health reaches the kubelet");
    }
}
