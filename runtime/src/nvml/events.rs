//! The node's NVML event thread and the buffer modules read from.
//!
//! One thread per opened library waits on an NVML event set registered for every GPU's critical
//! events (XID errors, double-bit ECC). Each event is appended to a bounded log with a sequence
//! number, and every subscribed module's device watchers are poked, so a health check runs at
//! once instead of at the next interval. Modules read the log through the `nvml` interface
//! without blocking: the wait on NVML happens here, never in a module's call.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use nvml_wrapper::Nvml;
use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::error::NvmlError as Nv;
use tokio::sync::Notify;

/// Events kept for modules to read; older ones are dropped and counted as missed.
pub const CAPACITY: usize = 4096;
/// How long one wait on the event set lasts before the thread looks again.
const WAIT_MS: u32 = 1000;
/// Pause before setting the event set up again after NVML failed it.
const RETRY: Duration = Duration::from_secs(5);
/// While some GPU could not be registered (lost, or not answering), how often the event set is
/// set up again, so a GPU that comes back is watched again.
const RESCAN: Duration = Duration::from_secs(5);
/// A pause between two set-ups without a gap, so a set that fails at once cannot spin.
const RESET: Duration = Duration::from_millis(100);

/// Why the event thread set its events up again without a gap in what it saw.
enum Again {
    /// A watched GPU was lost: its event was recorded; the set is rebuilt without it.
    Lost,
    /// Some GPU was not registered: try again, in case it came back.
    Rescan,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventKind {
    Xid(u64),
    DoubleBitEcc,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    pub seq: u64,
    pub gpu_uuid: String,
    pub kind: EventKind,
    pub age: Duration,
}

/// A MIG instance inside its GPU: (GPU instance ID, compute instance ID).
pub type MigInstance = (u32, u32);

/// What a read of the log returns: see the WIT `events` record.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Events {
    pub events: Vec<Event>,
    pub next: u64,
    pub missed: u64,
}

struct Logged {
    seq: u64,
    gpu_uuid: Arc<str>,
    kind: EventKind,
    at: Instant,
    /// The MIG instance NVML attributed it to, if any.
    instance: Option<MigInstance>,
}

#[derive(Default)]
struct Log {
    entries: VecDeque<Logged>,
    last: u64,
    /// Sequence numbers at which the event thread stopped watching (NVML failed its wait or its
    /// set-up): events may have been lost there. Bounded like the entries.
    gaps: VecDeque<u64>,
}

type Pokes = Vec<Arc<Notify>>;

#[derive(Default)]
pub struct EventLog {
    log: Mutex<Log>,
    subscribers: Mutex<Vec<Weak<Pokes>>>,
    watched: AtomicU32,
}

/// Keeps a module's watchers poked on every event; dropping it unsubscribes.
pub struct Subscription {
    _pokes: Arc<Pokes>,
}

impl EventLog {
    pub fn watched(&self) -> u32 {
        self.watched.load(Ordering::Relaxed)
    }

    pub fn since(&self, after: u64) -> Events {
        let log = self.log.lock().unwrap_or_else(|p| p.into_inner());
        let oldest = log.entries.front().map_or(log.last + 1, |e| e.seq);
        let now = Instant::now();
        Events {
            events: log
                .entries
                .iter()
                .filter(|e| e.seq > after)
                .map(|e| Event {
                    seq: e.seq,
                    gpu_uuid: e.gpu_uuid.to_string(),
                    kind: e.kind,
                    age: now.saturating_duration_since(e.at),
                })
                .collect(),
            next: log.last,
            missed: oldest.saturating_sub(after.saturating_add(1))
                + log.gaps.iter().filter(|&&g| g > after).count() as u64,
        }
    }

    /// The MIG instance event `seq` was raised in; None when it concerns the whole GPU or is no
    /// longer held.
    pub fn instance_of(&self, seq: u64) -> Option<MigInstance> {
        let log = self.log.lock().unwrap_or_else(|p| p.into_inner());
        log.entries
            .iter()
            .find(|e| e.seq == seq)
            .and_then(|e| e.instance)
    }

    pub fn subscribe(&self, pokes: Pokes) -> Subscription {
        let pokes = Arc::new(pokes);
        let mut subscribers = self.subscribers.lock().unwrap_or_else(|p| p.into_inner());
        subscribers.retain(|s| s.strong_count() > 0);
        subscribers.push(Arc::downgrade(&pokes));
        Subscription { _pokes: pokes }
    }

    /// Notes that events may have been lost now, and wakes the modules to notice.
    pub(super) fn gap(&self) {
        {
            let mut log = self.log.lock().unwrap_or_else(|p| p.into_inner());
            log.last += 1;
            let seq = log.last;
            if log.gaps.len() == CAPACITY {
                log.gaps.pop_front();
            }
            log.gaps.push_back(seq);
        }
        self.poke();
    }

    /// Wakes every subscriber's health check, as an event would (NVML just became ready).
    pub(super) fn wake(&self) {
        self.poke();
    }

    fn poke(&self) {
        let subscribers = self.subscribers.lock().unwrap_or_else(|p| p.into_inner());
        for pokes in subscribers.iter().filter_map(Weak::upgrade) {
            for poke in pokes.iter() {
                poke.notify_one();
            }
        }
    }

    pub(super) fn push(&self, gpu_uuid: Arc<str>, kind: EventKind) {
        self.push_in(gpu_uuid, kind, None);
    }

    pub(super) fn push_in(
        &self,
        gpu_uuid: Arc<str>,
        kind: EventKind,
        instance: Option<MigInstance>,
    ) {
        {
            let mut log = self.log.lock().unwrap_or_else(|p| p.into_inner());
            log.last += 1;
            let seq = log.last;
            if log.entries.len() == CAPACITY {
                log.entries.pop_front();
            }
            log.entries.push_back(Logged {
                seq,
                gpu_uuid,
                kind,
                at: Instant::now(),
                instance,
            });
        }
        self.poke();
    }
}

/// Starts the event thread for `nvml`. It runs for the life of the process, as the library does.
pub(super) fn start(nvml: &'static Nvml, log: Arc<EventLog>) {
    let spawned = std::thread::Builder::new()
        .name("nvml-events".into())
        .spawn(move || {
            loop {
                match watch(nvml, &log) {
                    // Set up again at once: no event went unseen but the few of the moment it
                    // takes, so this is no gap (a gap would make every GPU suspect).
                    Ok(Again::Lost | Again::Rescan) => std::thread::sleep(RESET),
                    Err(e) => {
                        tracing::warn!("NVML events: {e}; setting the event set up again in 5s");
                        // Events may have been lost meanwhile: modules count a gap as missed
                        // events.
                        log.watched.store(0, Ordering::Relaxed);
                        log.gap();
                        std::thread::sleep(RETRY);
                    }
                }
            }
        });
    if let Err(e) = spawned {
        tracing::warn!("cannot start the NVML event thread: {e}; health relies on the interval");
    }
}

fn critical() -> EventTypes {
    EventTypes::CRITICAL_XID_ERROR | EventTypes::DOUBLE_BIT_ECC_ERROR
}

/// Registers every GPU that supports critical events, then waits for events until NVML fails,
/// a watched GPU is lost, or (while some GPU is not registered) [`RESCAN`] passes. A GPU that
/// cannot be registered (lost, no event support) is skipped, never the others.
fn watch(nvml: &'static Nvml, log: &EventLog) -> Result<Again, Nv> {
    let started = std::time::Instant::now();
    let count = nvml.device_count()?;
    // The handle each event names, with its GPU's UUID read now: a GPU that fell off the bus can
    // no longer be asked for it.
    let mut gpus: Vec<(nvml_wrapper::Device<'static>, EventTypes, usize, Arc<str>)> = Vec::new();
    let mut unwatched = 0;
    for index in 0..count {
        let found = nvml.device_by_index(index).and_then(|device| {
            let types = device.supported_event_types()? & critical();
            let uuid: Arc<str> = device.uuid()?.into();
            Ok((device, types, uuid))
        });
        match found {
            Ok((_, types, _)) if types.is_empty() => {
                tracing::info!(
                    index,
                    "GPU reports no critical events; its health relies on the interval"
                );
            }
            // SAFETY: the handle is only compared with the handles events carry, never called.
            Ok((device, types, uuid)) => {
                let handle = unsafe { device.handle() } as usize;
                gpus.push((device, types, handle, uuid));
            }
            Err(e) => {
                unwatched += 1;
                tracing::debug!(index, "NVML events: not watching GPU {index}: {e}");
            }
        }
    }
    let mut set = nvml.create_event_set()?;
    let mut watched: Vec<(usize, Arc<str>)> = Vec::new();
    for (device, types, handle, uuid) in &gpus {
        match device.register_events(*types, set) {
            Ok(registered) => {
                set = registered;
                watched.push((*handle, uuid.clone()));
            }
            Err(e) => {
                // NVML frees the set on failure: start a new one with the GPUs registered so far.
                tracing::warn!(gpu = &**uuid, "NVML events: cannot register: {}", e.error);
                let mut fresh = nvml.create_event_set()?;
                for (d, t, h, _) in &gpus {
                    if watched.iter().any(|(w, _)| w == h) {
                        fresh = d.register_events(*t, fresh).map_err(|e| e.error)?;
                    }
                }
                set = fresh;
            }
        }
    }
    log.watched.store(watched.len() as u32, Ordering::Relaxed);
    tracing::debug!(gpus = watched.len(), "NVML event thread watching");
    unwatched += gpus.len() - watched.len();
    loop {
        match wait(nvml, &set, WAIT_MS) {
            Ok(raw) => record(log, &watched, raw),
            Err(Nv::Timeout) => {}
            // NVML does not say which GPU: ask each watched one. Only those that answer lost
            // turn Unhealthy; if none does, the wait failed for some other reason.
            Err(Nv::GpuLost) => {
                let lost: Vec<&Arc<str>> = gpus
                    .iter()
                    .filter(|(device, _, handle, _)| {
                        watched.iter().any(|(w, _)| w == handle)
                            && matches!(device.uuid(), Err(Nv::GpuLost))
                    })
                    .map(|(_, _, _, uuid)| uuid)
                    .collect();
                if lost.is_empty() {
                    return Err(Nv::GpuLost);
                }
                for uuid in lost {
                    tracing::warn!(gpu = &**uuid, "NVML: GPU lost");
                    log.push(uuid.clone(), EventKind::Xid(79));
                }
                return Ok(Again::Lost);
            }
            Err(e) => return Err(e),
        }
        if unwatched > 0 && started.elapsed() >= RESCAN {
            return Ok(Again::Rescan);
        }
    }
}

/// One event as NVML's wait gives it, with the MIG instance nvml-wrapper's `EventData` drops.
struct Raw {
    device: usize,
    types: EventTypes,
    data: u64,
    instance: Option<MigInstance>,
}

/// NVML's "not attributed to a MIG instance".
const NO_INSTANCE: u32 = u32::MAX;
/// NVML's own code for an XID it could not read.
const UNKNOWN_XID: u64 = 999;

/// `nvmlEventSetWait_v2`, called directly for the instance IDs of `nvmlEventData_t`.
fn wait(nvml: &Nvml, set: &nvml_wrapper::EventSet<'_>, ms: u32) -> Result<Raw, Nv> {
    let call = nvml_wrapper::error::nvml_sym(nvml.lib().nvmlEventSetWait_v2.as_ref())?;
    // SAFETY: all-zero is a valid nvmlEventData_t (integers and a null handle), which NVML fills.
    let mut data: nvml_wrapper_sys::bindings::nvmlEventData_t = unsafe { std::mem::zeroed() };
    // SAFETY: the set is live (borrowed from its owner for the call) and `data` outlives it.
    nvml_wrapper::error::nvml_try(unsafe { call(set.handle(), &mut data, ms) })?;
    let instance = (data.gpuInstanceId != NO_INSTANCE || data.computeInstanceId != NO_INSTANCE)
        .then_some((data.gpuInstanceId, data.computeInstanceId));
    Ok(Raw {
        device: data.device as usize,
        types: EventTypes::from_bits_truncate(data.eventType),
        data: data.eventData,
        instance,
    })
}

fn record(log: &EventLog, gpus: &[(usize, Arc<str>)], raw: Raw) {
    let Some((_, uuid)) = gpus.iter().find(|(h, _)| *h == raw.device) else {
        return;
    };
    let kind = if raw.types.contains(EventTypes::DOUBLE_BIT_ECC_ERROR) {
        EventKind::DoubleBitEcc
    } else if raw.types.contains(EventTypes::CRITICAL_XID_ERROR) {
        EventKind::Xid(raw.data)
    } else {
        EventKind::Xid(UNKNOWN_XID)
    };
    // Whether an XID is critical is the module's call (its `ignored-xids`); the module logs the
    // ones it acts on at WARN.
    match raw.instance {
        Some((gi, ci)) => {
            tracing::info!(
                gpu = &**uuid,
                ?kind,
                gpu_instance = gi,
                compute_instance = ci,
                "NVML event"
            )
        }
        None => tracing::info!(gpu = &**uuid, ?kind, "NVML event"),
    }
    log.push_in(uuid.clone(), kind, raw.instance);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_are_bounded_and_say_what_was_missed() {
        let log = EventLog::default();
        assert_eq!(log.since(0), Events::default());
        for _ in 0..CAPACITY + 10 {
            log.push("GPU-a".into(), EventKind::Xid(79));
        }
        let all = log.since(0);
        assert_eq!(all.events.len(), CAPACITY);
        assert_eq!(all.missed, 10);
        assert_eq!(all.next, (CAPACITY + 10) as u64);
        assert_eq!(all.events[0].seq, 11);
        let caught_up = log.since(all.next);
        assert!(caught_up.events.is_empty());
        assert_eq!((caught_up.next, caught_up.missed), (all.next, 0));
        log.gap();
        let after_gap = log.since(all.next);
        assert_eq!((after_gap.next, after_gap.missed), (all.next + 1, 1));
        assert_eq!(log.since(after_gap.next).missed, 0);
    }

    #[test]
    fn subscribers_are_poked_until_they_drop() {
        let log = EventLog::default();
        let poke = Arc::new(Notify::new());
        let subscription = log.subscribe(vec![poke.clone()]);
        log.push("GPU-a".into(), EventKind::DoubleBitEcc);
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        rt.block_on(async {
            tokio::time::timeout(Duration::from_secs(5), poke.notified())
                .await
                .expect("poked");
        });
        drop(subscription);
        log.push("GPU-a".into(), EventKind::DoubleBitEcc);
        assert!(log.subscribers.lock().unwrap()[0].upgrade().is_none());
    }
}
