//! Allocate answers made ahead of time, one per healthy device, so that the kubelet's Allocate of
//! a single device waits for no module call.
//!
//! Most containers ask for one device of a resource. As soon as a device is listed Healthy (and
//! again whenever it changes, or a new module version is swapped in), the preparer asks the
//! module's `allocate` for that device alone, off the kubelet's path, one call at a time (a real
//! Allocate waits behind at most one). A single-device Allocate whose device is exactly as it was
//! prepared for is answered from memory, like a plugin that computed its answers at start.
//! Everything else calls the module: several devices, an answer not ready yet, a device that
//! changed since, a preparation that failed. An error the module returns is not retried until
//! the device or the module changes (the live call reports the module's own error to the
//! kubelet); a crash or a missed deadline stops preparation for that module version, since each
//! costs the kubelet's calls a fresh instance, so asking ahead costs at most one; a module down
//! for the moment is asked again after the next enumeration. Answers are charged to the module's
//! host-memory budget: past it the rest are answered live, and asked again once room is freed.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::{Notify, watch};

use super::backend::{BackendError, DeviceBackend, Upkeep};
use super::snapshot::{Snapshot, find};
use crate::device::{ContainerEdits, Device, Health};

/// One resource's prepared answers, shared by its preparer and its server.
#[derive(Clone)]
pub struct Prepared {
    answers: Arc<Mutex<Answers>>,
    /// Lets status and tests follow the preparer.
    progress: Arc<watch::Sender<Progress>>,
}

/// Where the preparer stands.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Progress {
    /// Answers ready to serve.
    pub ready: usize,
    /// Wakes handled to the end: every device then had its answer, or a failed attempt.
    pub rounds: u64,
}

#[derive(Default)]
struct Answers {
    by_id: HashMap<String, Entry>,
    bytes: usize,
    /// The module version preparation stopped for: it crashed or overran while being prepared,
    /// and a crash costs the kubelet's calls a restart, so it is not asked ahead again.
    stopped: Option<u64>,
}

struct Entry {
    /// The device as it was when the module answered; the answer holds only while it is unchanged.
    device: Device,
    generation: u64,
    kept: Kept,
    bytes: usize,
}

enum Kept {
    /// Shared with the CDI spec writer, which takes every answer each round.
    Answer(Arc<ContainerEdits>),
    /// The module answered with an error: not asked again until the device or the module
    /// changes.
    Failed,
    /// The answer did not fit the module's budget: asked again once room is freed.
    OverBudget,
}

impl Default for Prepared {
    fn default() -> Self {
        Prepared {
            answers: Arc::default(),
            progress: Arc::new(watch::channel(Progress::default()).0),
        }
    }
}

impl std::fmt::Debug for Prepared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prepared")
            .field("progress", &*self.progress.borrow())
            .finish_non_exhaustive()
    }
}

impl Prepared {
    fn lock(&self) -> std::sync::MutexGuard<'_, Answers> {
        self.answers.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The answer prepared for `device` exactly as it is now, from the backend of `generation`.
    pub fn answer(&self, device: &Device, generation: u64) -> Option<ContainerEdits> {
        let answer = {
            let answers = self.lock();
            let entry = answers.by_id.get(&device.id)?;
            match &entry.kept {
                Kept::Answer(a) if entry.generation == generation && entry.device == *device => {
                    a.clone()
                }
                _ => return None,
            }
        };
        Some((*answer).clone())
    }

    /// Every answer that holds for `snapshot` as it is now, from the backend of `generation`, by
    /// device ID (the CDI spec writer builds the spec from them).
    pub fn current(
        &self,
        snapshot: &[Device],
        generation: u64,
    ) -> HashMap<String, Arc<ContainerEdits>> {
        let answers = self.lock();
        answers
            .by_id
            .iter()
            .filter_map(|(id, entry)| match &entry.kept {
                Kept::Answer(a)
                    if entry.generation == generation
                        && find(snapshot, id) == Some(&entry.device) =>
                {
                    Some((id.clone(), a.clone()))
                }
                _ => None,
            })
            .collect()
    }

    /// Whether an answer is ready for the device with this ID, as of the preparer's last round
    /// (status shows it).
    pub fn is_ready(&self, id: &str) -> bool {
        self.lock()
            .by_id
            .get(id)
            .is_some_and(|e| matches!(e.kept, Kept::Answer(_)))
    }

    /// Drops the answers of the devices `which` picks (by device ID): they are asked for again
    /// at the preparer's next round.
    pub fn forget(&self, which: impl Fn(&str) -> bool) {
        let mut answers = self.lock();
        answers.by_id.retain(|id, _| !which(id));
        answers.bytes = answers.by_id.values().map(|e| e.bytes).sum();
        self.publish_count(&answers);
    }

    /// Follows the preparer.
    pub fn progress(&self) -> watch::Receiver<Progress> {
        self.progress.subscribe()
    }

    fn publish_count(&self, answers: &Answers) {
        let ready = answers
            .by_id
            .values()
            .filter(|e| matches!(e.kept, Kept::Answer(_)))
            .count();
        self.progress
            .send_if_modified(|now| std::mem::replace(&mut now.ready, ready) != ready);
    }

    fn round_done(&self) {
        self.progress.send_modify(|now| now.rounds += 1);
    }

    /// Starts a round: drops every entry that no longer holds (device gone or changed, another
    /// module version), charges what is left to the budget (dropping it all when the devices
    /// have grown into the room it took), and returns the Healthy devices to ask for, in order.
    fn begin_round(
        &self,
        upkeep: &dyn Upkeep,
        resource: &str,
        snapshot: &[Device],
        generation: u64,
    ) -> Vec<Device> {
        let mut answers = self.lock();
        let mut freed = false;
        answers.by_id.retain(|id, e| {
            let holds =
                e.generation == generation && find(snapshot, id).is_some_and(|d| *d == e.device);
            freed |= !holds && e.bytes > 0;
            holds
        });
        if freed {
            answers
                .by_id
                .retain(|_, e| !matches!(e.kept, Kept::OverBudget));
        }
        answers.bytes = answers.by_id.values().map(|e| e.bytes).sum();
        if let Err(why) = upkeep.keep_answers(resource, answers.bytes) {
            tracing::debug!(resource, "dropping the prepared Allocate answers: {why}");
            answers.by_id.clear();
            answers.bytes = 0;
            let _ = upkeep.keep_answers(resource, 0);
        }
        self.publish_count(&answers);
        if answers.stopped == Some(generation) {
            return Vec::new();
        }
        // A device whose group has others is never allocated alone: no answer of its own.
        let mut group_sizes: HashMap<&str, usize> = HashMap::new();
        for d in snapshot {
            if let Some(g) = &d.group {
                *group_sizes.entry(g).or_default() += 1;
            }
        }
        let alone = |d: &Device| {
            d.group
                .as_ref()
                .is_none_or(|g| group_sizes.get(g.as_str()) == Some(&1))
        };
        snapshot
            .iter()
            .filter(|d| {
                d.health == Health::Healthy && !answers.by_id.contains_key(&d.id) && alone(d)
            })
            .cloned()
            .collect()
    }

    /// Keeps what the module answered for `device`, if the device and the module are still as
    /// they were when it was asked.
    fn store(
        &self,
        upkeep: &dyn Upkeep,
        resource: &str,
        device: Device,
        generation: u64,
        answer: Option<ContainerEdits>,
        current: &[Device],
    ) {
        let still = find(current, &device.id).is_some_and(|d| *d == device);
        if upkeep.generation() != generation || !still {
            return;
        }
        let mut answers = self.lock();
        let (kept, bytes) = match answer {
            None => (Kept::Failed, 0),
            Some(answer) => {
                let bytes = ContainerEdits::bytes(&answer);
                let total = answers.bytes.saturating_add(bytes);
                match upkeep.keep_answers(resource, total) {
                    Ok(()) => (Kept::Answer(Arc::new(answer)), bytes),
                    Err(why) => {
                        tracing::debug!(resource, "not keeping more Allocate answers: {why}");
                        (Kept::OverBudget, 0)
                    }
                }
            }
        };
        answers.bytes = answers.bytes.saturating_add(bytes);
        answers.by_id.insert(
            device.id.clone(),
            Entry {
                device,
                generation,
                kept,
                bytes,
            },
        );
        self.publish_count(&answers);
    }

    /// No more asking ahead for this module version.
    fn stop(&self, generation: u64) {
        self.lock().stopped = Some(generation);
    }
}

/// Prepares answers for `resource` whenever `wake` fires (after every enumeration), until `stop`.
pub async fn prepare_answers<B: DeviceBackend>(
    backend: B,
    upkeep: Arc<dyn Upkeep>,
    resource: String,
    devices: watch::Receiver<Snapshot>,
    wake: Arc<Notify>,
    prepared: Prepared,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        tokio::select! {
            _ = wake.notified() => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        let snapshot = devices.borrow().clone();
        let generation = upkeep.generation();
        for device in prepared.begin_round(&*upkeep, &resource, &snapshot, generation) {
            let id = device.id.clone();
            let asked = tokio::select! {
                asked = backend.allocate(&resource, vec![id.clone()]) => asked,
                _ = stop.wait_for(|s| *s) => return,
            };
            let answer = match asked {
                Ok(edits) => Some(edits),
                Err(BackendError::Failed(_) | BackendError::Invalid(_)) => None,
                // Down for now, the call not run (restarting after a crash): try again after the
                // next enumeration.
                Err(BackendError::Unavailable(_)) => break,
                Err(e @ (BackendError::Crashed(_) | BackendError::Deadline(_))) => {
                    tracing::warn!(
                        module = backend.name(),
                        resource,
                        device = id,
                        "preparing the Allocate answer failed ({e}); no more answers are prepared \
                         for this module version: each Allocate asks the module"
                    );
                    prepared.stop(generation);
                    break;
                }
            };
            let current = devices.borrow().clone();
            prepared.store(&*upkeep, &resource, device, generation, answer, &current);
        }
        prepared.round_done();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::ContainerEdits;
    use crate::device::Inventory;
    use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

    /// Answers `DEV=<id>@<version>`; returns an error for `broken`, crashes on `crash`; keeps at
    /// most `budget` bytes.
    #[derive(Clone)]
    struct Fake {
        version: Arc<AtomicU64>,
        calls: Arc<AtomicUsize>,
        broken: &'static str,
        crash: &'static str,
        budget: usize,
        down: Arc<AtomicBool>,
    }

    impl Fake {
        fn new(budget: usize) -> Fake {
            Fake {
                version: Arc::default(),
                calls: Arc::default(),
                broken: "broken",
                crash: "crash",
                budget,
                down: Arc::default(),
            }
        }

        fn calls(&self) -> usize {
            self.calls.load(Ordering::SeqCst)
        }
    }

    impl DeviceBackend for Fake {
        crate::resource::backend::plain_calls!();

        fn name(&self) -> &str {
            "fake"
        }

        async fn enumerate(&self, _: &str) -> Result<Inventory, BackendError> {
            Ok(Inventory::default())
        }

        async fn allocate(
            &self,
            _: &str,
            ids: Vec<String>,
        ) -> Result<ContainerEdits, BackendError> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            if self.down.load(Ordering::SeqCst) {
                return Err(BackendError::Unavailable("restarting".into()));
            }
            if ids.iter().any(|id| id == self.broken) {
                return Err(BackendError::Failed("no such device".into()));
            }
            if ids.iter().any(|id| id == self.crash) {
                return Err(BackendError::Crashed("trapped on this device".into()));
            }
            let version = self.version.load(Ordering::SeqCst);
            Ok(ContainerEdits {
                envs: vec![("DEV".into(), format!("{}@{version}", ids.join(",")))],
                ..ContainerEdits::default()
            })
        }
    }

    impl Upkeep for Fake {
        fn generation(&self) -> u64 {
            self.version.load(Ordering::SeqCst)
        }

        fn keep_answers(&self, _: &str, bytes: usize) -> Result<(), String> {
            if bytes > self.budget {
                return Err(format!("{bytes} bytes is over {}", self.budget));
            }
            Ok(())
        }
    }

    fn device(id: &str, health: Health, temperature: &str) -> Device {
        Device {
            id: id.into(),
            health,
            numa_nodes: vec![0],
            attributes: vec![("temperature".into(), temperature.into())],
            ..crate::device::Device::new("", crate::device::Health::Healthy)
        }
    }

    struct Running {
        devices: watch::Sender<Snapshot>,
        wake: Arc<Notify>,
        prepared: Prepared,
        progress: watch::Receiver<Progress>,
        _stop: watch::Sender<bool>,
    }

    impl Running {
        fn start(backend: &Fake, snapshot: Vec<Device>) -> Running {
            let (devices, devices_rx) = watch::channel(Arc::new(snapshot.into()));
            let (stop, stop_rx) = watch::channel(false);
            let wake = Arc::new(Notify::new());
            let prepared = Prepared::default();
            tokio::spawn(prepare_answers(
                backend.clone(),
                Arc::new(backend.clone()),
                "r".into(),
                devices_rx,
                wake.clone(),
                prepared.clone(),
                stop_rx,
            ));
            let progress = prepared.progress();
            Running {
                devices,
                wake,
                prepared,
                progress,
                _stop: stop,
            }
        }

        /// Publishes a new snapshot and wakes the preparer, as the watcher does; waits until it
        /// has handled the wake, and checks that `n` answers are then ready.
        async fn enumerated(&mut self, snapshot: Option<Vec<Device>>, n: usize) {
            if let Some(s) = snapshot {
                self.devices.send_replace(Arc::new(s.into()));
            }
            let rounds = self.progress.borrow_and_update().rounds;
            self.wake.notify_one();
            let now = *tokio::time::timeout(
                std::time::Duration::from_secs(10),
                self.progress.wait_for(|p| p.rounds > rounds),
            )
            .await
            .expect("the preparer settles")
            .expect("the preparer runs");
            assert_eq!(now.ready, n, "answers ready");
        }

        fn env(&self, d: &Device, generation: u64) -> Option<String> {
            self.prepared
                .answer(d, generation)
                .and_then(|a| a.envs.into_iter().find(|(k, _)| k == "DEV"))
                .map(|(_, v)| v)
        }
    }

    #[tokio::test]
    async fn every_healthy_device_gets_its_own_answer_once() {
        let fake = Fake::new(usize::MAX);
        let a = device("a", Health::Healthy, "40C");
        let sick = device("sick", Health::Unhealthy, "90C");
        let mut r = Running::start(&fake, vec![a.clone(), sick.clone()]);
        r.enumerated(None, 1).await;
        assert_eq!(r.env(&a, 0).as_deref(), Some("a@0"));
        assert_eq!(r.env(&sick, 0), None, "an Unhealthy device is not prepared");
        r.enumerated(None, 1).await;
        // The second wake has nothing to do: the answer holds.
        r.enumerated(None, 1).await;
        assert_eq!(fake.calls(), 1);
    }

    #[tokio::test]
    async fn a_changed_device_or_a_new_module_version_is_asked_again() {
        let fake = Fake::new(usize::MAX);
        let a = device("a", Health::Healthy, "40C");
        let mut r = Running::start(&fake, vec![a.clone()]);
        r.enumerated(None, 1).await;
        let warmer = device("a", Health::Healthy, "41C");
        assert_eq!(
            r.env(&warmer, 0),
            None,
            "an answer holds only for the device as it was"
        );
        r.enumerated(Some(vec![warmer.clone()]), 1).await;
        assert_eq!(r.env(&warmer, 0).as_deref(), Some("a@0"));
        assert_eq!(fake.calls(), 2);

        fake.version.store(1, Ordering::SeqCst);
        assert_eq!(
            r.env(&warmer, 1),
            None,
            "the old version's answer is not served"
        );
        r.enumerated(None, 1).await;
        assert_eq!(r.env(&warmer, 1).as_deref(), Some("a@1"));

        r.enumerated(Some(Vec::new()), 0).await;
        assert!(
            !r.prepared.is_ready("a"),
            "a device gone takes its answer along"
        );
    }

    #[tokio::test]
    async fn a_failed_preparation_is_not_kept_nor_retried_until_the_device_changes() {
        let fake = Fake::new(usize::MAX);
        let broken = device("broken", Health::Healthy, "40C");
        let a = device("a", Health::Healthy, "40C");
        let mut r = Running::start(&fake, vec![a.clone(), broken.clone()]);
        r.enumerated(None, 1).await;
        assert_eq!(r.env(&broken, 0), None);
        let calls = fake.calls();
        r.enumerated(None, 1).await;
        r.enumerated(None, 1).await;
        assert_eq!(
            fake.calls(),
            calls,
            "no retry storm against a failing module"
        );
        let changed = device("broken", Health::Healthy, "41C");
        r.enumerated(Some(vec![a, changed]), 1).await;
        assert_eq!(fake.calls(), calls + 1, "asked again once it changed");
    }

    #[tokio::test]
    async fn a_crash_while_preparing_stops_preparation_until_the_next_version() {
        let fake = Fake::new(usize::MAX);
        let b = device("b", Health::Healthy, "40C");
        let crash = device("crash", Health::Healthy, "40C");
        let mut r = Running::start(&fake, vec![b.clone(), crash.clone()]);
        r.enumerated(None, 1).await;
        assert_eq!(fake.calls(), 2, "b prepared, then the crash");
        // Readings that change at every enumeration ask nothing more of this version.
        for t in ["41C", "42C", "43C"] {
            let warmer = vec![
                device("b", Health::Healthy, t),
                device("crash", Health::Healthy, t),
            ];
            r.enumerated(Some(warmer), 0).await;
        }
        assert_eq!(fake.calls(), 2, "at most one crash per module version");
        fake.version.store(1, Ordering::SeqCst);
        r.enumerated(None, 1).await;
        assert_eq!(fake.calls(), 4, "a new version is asked again");
    }

    #[tokio::test]
    async fn a_module_down_for_now_is_asked_again_after_the_next_enumeration() {
        let fake = Fake::new(usize::MAX);
        let a = device("a", Health::Healthy, "40C");
        let mut r = Running::start(&fake, vec![a.clone()]);
        fake.down.store(true, Ordering::SeqCst);
        r.enumerated(None, 0).await;
        fake.down.store(false, Ordering::SeqCst);
        r.enumerated(None, 1).await;
        assert_eq!(r.env(&a, 0).as_deref(), Some("a@0"));
    }

    #[tokio::test]
    async fn answers_past_the_budget_are_not_kept() {
        let one = ContainerEdits::bytes(&ContainerEdits {
            envs: vec![("DEV".into(), "d0@0".into())],
            ..ContainerEdits::default()
        });
        let fake = Fake::new(one * 2 + one / 2);
        let devices: Vec<Device> = (0..4)
            .map(|i| device(&format!("d{i}"), Health::Healthy, "40C"))
            .collect();
        let mut r = Running::start(&fake, devices.clone());
        r.enumerated(None, 2).await;
        let ready: Vec<_> = devices.iter().filter(|d| r.env(d, 0).is_some()).collect();
        assert_eq!(
            ready.len(),
            2,
            "two answers fit the budget, the others are served live"
        );
        let calls = fake.calls();
        r.enumerated(None, 2).await;
        assert_eq!(fake.calls(), calls, "no room, nothing asked again");

        let gone = ready[0].id.clone();
        let fewer: Vec<Device> = devices.iter().filter(|d| d.id != gone).cloned().collect();
        r.enumerated(Some(fewer.clone()), 2).await;
        let now_ready = fewer.iter().filter(|d| r.env(d, 0).is_some()).count();
        assert_eq!(now_ready, 2, "the room a device freed is used for another");
    }
}
