//! Tests of the ledger as a whole: persistence, corruption, atomicity, reconciliation.

use std::fs;
use std::io;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use super::checkpoint::temp_files;
use super::*;
use crate::kubelet::api::podresources::{
    ContainerDevices, ContainerResources, ListPodResourcesResponse, PodResources,
};

const FUSE: &str = "devicelet.io/fuse";
const GPU: &str = "vendor.com/gpu";
const HOUR: Duration = Duration::from_secs(3600);

fn ids(ids: &[&str]) -> Vec<String> {
    ids.iter().map(|s| (*s).to_owned()).collect()
}

fn holder(ns: &str, pod: &str, container: &str) -> Holder {
    Holder::container(ns, pod, container)
}

/// (resource, device ids) pairs of one container.
type Devices<'a> = &'a [(&'a str, &'a [&'a str])];

/// A pod with containers, each with (resource, device ids) pairs. Each device gets its own
/// `ContainerDevices`, as the kubelet reports them.
fn pod(ns: &str, name: &str, containers: &[(&str, Devices)]) -> PodResources {
    PodResources {
        name: name.into(),
        namespace: ns.into(),
        containers: containers
            .iter()
            .map(|(cname, devices)| ContainerResources {
                name: (*cname).into(),
                devices: devices
                    .iter()
                    .flat_map(|(resource, ids)| {
                        ids.iter().map(|id| ContainerDevices {
                            resource_name: (*resource).into(),
                            device_ids: vec![(*id).into()],
                            topology: None,
                        })
                    })
                    .collect(),
                ..Default::default()
            })
            .collect(),
    }
}

/// What the device-plugin front end makes of a `List` answer with these pods.
fn list(pods: Vec<PodResources>) -> Vec<Held> {
    crate::kubelet::podresources::held(&ListPodResourcesResponse {
        pod_resources: pods,
    })
}

fn only_fuse(r: &str) -> bool {
    r == FUSE
}

#[test]
fn record_then_reopen_restores_entries_and_next_id() {
    let dir = tempfile::tempdir().unwrap();
    let ledger = Ledger::open(dir.path()).unwrap();
    assert_eq!(ledger.file(), Some(dir.path().join(FILE_NAME).as_path()));
    assert_eq!(ledger.record(FUSE, &ids(&["fuse-0", "fuse-1"])).unwrap(), 1);
    assert_eq!(ledger.record(GPU, &ids(&["gpu-0"])).unwrap(), 2);
    let before = ledger.entries();
    assert_eq!(before.len(), 2);
    assert_eq!(before[0].device_ids, ids(&["fuse-0", "fuse-1"]));
    assert_eq!(before[0].holder, None);
    ledger.write(false).unwrap();
    drop(ledger);

    let reopened = Ledger::open(dir.path()).unwrap();
    assert_eq!(reopened.entries(), before);
    assert_eq!(
        reopened.record(FUSE, &ids(&["fuse-2"])).unwrap(),
        3,
        "ids are never reused"
    );
}

#[test]
fn ids_are_not_reused_after_entries_are_freed() {
    let dir = tempfile::tempdir().unwrap();
    let ledger = Ledger::open(dir.path()).unwrap();
    ledger.record(FUSE, &ids(&["fuse-0"])).unwrap();
    let report = ledger.reconcile(&list(vec![]), Duration::ZERO, &only_fuse);
    assert_eq!(report.freed.len(), 1);
    ledger.write(false).unwrap();
    drop(ledger);
    let reopened = Ledger::open(dir.path()).unwrap();
    assert!(reopened.entries().is_empty());
    assert_eq!(reopened.record(FUSE, &ids(&["fuse-0"])).unwrap(), 2);
}

/// Captures what `tracing` logs while `f` runs.
fn logged<T>(f: impl FnOnce() -> T) -> (T, String) {
    #[derive(Clone, Default)]
    struct Buf(Arc<Mutex<Vec<u8>>>);
    impl io::Write for Buf {
        fn write(&mut self, b: &[u8]) -> io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }
    let buf = Buf::default();
    let writer = buf.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    let out = tracing::subscriber::with_default(subscriber, f);
    let text = String::from_utf8_lossy(&buf.0.lock().unwrap()).into_owned();
    (out, text)
}

#[test]
fn corrupt_checkpoint_is_set_aside_and_logged() {
    for (content, reason) in [
        (
            &b"{\"version\":1,\"next_id\":3,\"entries\":[{\"id\""[..],
            "EOF",
        ),
        (b"\x00\xff not json", "expected value"),
        (
            b"{\"version\":9,\"next_id\":1,\"entries\":[]}",
            "unsupported version 9",
        ),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join(FILE_NAME);
        fs::write(&file, content).unwrap();
        let (ledger, log) = logged(|| Ledger::open(dir.path()).unwrap());
        assert!(ledger.entries().is_empty());
        assert!(!file.exists());
        let aside: Vec<_> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.to_string_lossy().contains("ledger.json.corrupt-"))
            .collect();
        assert_eq!(aside.len(), 1, "{aside:?}");
        assert_eq!(
            fs::read(&aside[0]).unwrap(),
            content,
            "the bad file is kept as it was"
        );
        assert!(log.contains("WARN"), "{log}");
        assert!(log.contains(&file.display().to_string()), "{log}");
        assert!(log.contains(reason), "{log}");

        // The ledger works and its next checkpoint is a fresh, valid one.
        assert_eq!(ledger.record(FUSE, &ids(&["fuse-0"])).unwrap(), 1);
        ledger.write(false).unwrap();
        assert_eq!(
            Ledger::open(dir.path()).unwrap().entries(),
            ledger.entries()
        );
    }
}

#[test]
fn checkpoint_is_always_whole_and_leaves_no_temp_files() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join(FILE_NAME);
    let ledger = Ledger::open(dir.path()).unwrap();
    ledger.record(FUSE, &ids(&["seed"])).unwrap();
    ledger.write(false).unwrap();

    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reader = {
        let (file, stop) = (file.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut reads = 0;
            loop {
                let bytes = fs::read(&file).expect("ledger.json is never missing once written");
                checkpoint::decode(&bytes).expect("ledger.json always parses");
                reads += 1;
                if stop.load(std::sync::atomic::Ordering::Relaxed) {
                    return reads;
                }
            }
        })
    };
    // Two checkpoint writers racing (the writer task and a shutdown flush, say) while four
    // threads record: the file must never go back to an older state.
    let checkpointers: Vec<_> = (0..2)
        .map(|_| {
            let (ledger, stop, file) = (ledger.clone(), stop.clone(), file.clone());
            std::thread::spawn(move || {
                let mut last = 0;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    ledger.write(false).unwrap();
                    let now = checkpoint::decode(&fs::read(&file).unwrap())
                        .unwrap()
                        .next_id;
                    assert!(now >= last, "the checkpoint went back from {last} to {now}");
                    last = now;
                }
            })
        })
        .collect();
    let recorders: Vec<_> = (0..4)
        .map(|w| {
            let ledger = ledger.clone();
            std::thread::spawn(move || {
                for i in 0..25 {
                    ledger.record(FUSE, &[format!("dev-{w}-{i}")]).unwrap();
                }
            })
        })
        .collect();
    for r in recorders {
        r.join().unwrap();
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    assert!(reader.join().unwrap() > 0);
    for c in checkpointers {
        c.join().unwrap();
    }
    ledger.write(false).unwrap();

    assert_eq!(temp_files(dir.path()), Vec::<String>::new());
    let restored = Ledger::open(dir.path()).unwrap().entries();
    assert_eq!(restored.len(), 101);
    assert_eq!(restored, ledger.entries());
    let mut seen: Vec<u64> = restored.iter().map(|e| e.id).collect();
    seen.dedup();
    assert_eq!(seen, (1..=101).collect::<Vec<_>>());
}

#[test]
fn recording_never_waits_for_a_checkpoint_being_written() {
    let dir = tempfile::tempdir().unwrap();
    let ledger = Ledger::open(dir.path()).unwrap();
    // Stand in for a write stuck in fsync: hold the writers' lock.
    let stuck_write = ledger.inner.writing.lock().unwrap();
    let (done, recorded) = std::sync::mpsc::channel();
    let recorder = {
        let ledger = ledger.clone();
        std::thread::spawn(move || {
            let id = ledger.record(FUSE, &ids(&["fuse-0"])).unwrap();
            let report = ledger.reconcile(&list(vec![]), HOUR, &only_fuse);
            done.send((id, report.pending)).unwrap();
        })
    };
    assert_eq!(
        recorded.recv_timeout(Duration::from_secs(30)),
        Ok((1, 1)),
        "record and reconcile waited for the disk"
    );
    drop(stuck_write);
    recorder.join().unwrap();
}

#[test]
fn at_the_cap_the_oldest_unattributed_entries_are_dropped_and_counted() {
    let ledger = Ledger::in_memory();
    ledger.record(FUSE, &ids(&["held"])).unwrap();
    let pods = list(vec![pod("ns", "p", &[("c", &[(FUSE, &["held"])])])]);
    assert_eq!(ledger.reconcile(&pods, HOUR, &only_fuse).attributed, 1);
    for i in 0..MAX_ENTRIES + 9 {
        ledger.record(FUSE, &[format!("dev-{i}")]).unwrap();
    }
    let entries = ledger.entries();
    assert_eq!(entries.len(), MAX_ENTRIES);
    assert_eq!(ledger.dropped(), 10);
    assert_eq!(
        entries[0].device_ids,
        ids(&["held"]),
        "the entry a container holds is kept"
    );
    assert_eq!(entries[1].device_ids, ids(&["dev-10"]), "dev-0..9 went");
    assert_eq!(
        entries.last().unwrap().device_ids,
        [format!("dev-{}", MAX_ENTRIES + 8)]
    );
}

#[test]
fn the_checkpoint_is_compact_json() {
    let dir = tempfile::tempdir().unwrap();
    let ledger = Ledger::open(dir.path()).unwrap();
    ledger.record(FUSE, &ids(&["fuse-0"])).unwrap();
    ledger.write(false).unwrap();
    let text = fs::read_to_string(dir.path().join(FILE_NAME)).unwrap();
    assert_eq!(text.lines().count(), 1, "{text}");
    assert!(!text.contains(": ") && !text.contains("  "), "{text}");
}

#[test]
fn a_failed_checkpoint_keeps_the_entry_and_a_later_write_catches_up() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("state");
    let ledger = Ledger::open(&dir).unwrap();
    fs::remove_dir_all(&dir).unwrap();

    ledger.record(FUSE, &ids(&["fuse-0"])).unwrap();
    let err = ledger.write(false).unwrap_err();
    assert!(matches!(err, LedgerError::Io { .. }), "{err:?}");
    assert!(
        err.to_string().contains(&dir.display().to_string()),
        "{err}"
    );
    assert_eq!(ledger.entries().len(), 1, "kept in memory");
    assert!(!ledger.is_written());

    fs::create_dir(&dir).unwrap();
    // Nothing changed since, but the pending write is still due.
    ledger.write(false).unwrap();
    assert!(ledger.is_written());
    assert_eq!(Ledger::open(&dir).unwrap().entries(), ledger.entries());
}

#[tokio::test]
async fn the_writer_retries_a_failed_checkpoint_on_its_own() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("state");
    let ledger = Ledger::open(&dir).unwrap();
    fs::remove_dir_all(&dir).unwrap();
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let writer = tokio::spawn(ledger.clone().run_writer(stopped));
    ledger.record(FUSE, &ids(&["fuse-0"])).unwrap();
    fs::create_dir(&dir).unwrap();
    // No further change: only the writer's retry can write it.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !ledger.is_written() {
        assert!(std::time::Instant::now() < deadline, "never retried");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(Ledger::open(&dir).unwrap().entries(), ledger.entries());
    stop.send(true).unwrap();
    writer.await.unwrap();
}

#[test]
fn in_memory_ledger_never_writes() {
    let ledger = Ledger::in_memory();
    assert_eq!(ledger.file(), None);
    assert_eq!(ledger.record(FUSE, &ids(&["fuse-0"])).unwrap(), 1);
    ledger.flush().unwrap();
    let pods = list(vec![pod("ns", "p", &[("c", &[(FUSE, &["fuse-0"])])])]);
    assert_eq!(ledger.reconcile(&pods, HOUR, &only_fuse).attributed, 1);
}

#[test]
fn flush_writes_the_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let ledger = Ledger::open(dir.path()).unwrap();
    assert!(!dir.path().join(FILE_NAME).exists());
    ledger.flush().unwrap();
    let json: serde_json::Value =
        serde_json::from_slice(&fs::read(dir.path().join(FILE_NAME)).unwrap()).unwrap();
    assert_eq!(
        json,
        serde_json::json!({ "version": 1, "next_id": 1, "entries": [] })
    );
}

#[test]
fn reconcile_attributes_holders_and_checkpoints_them() {
    let dir = tempfile::tempdir().unwrap();
    let ledger = Ledger::open(dir.path()).unwrap();
    ledger.record(FUSE, &ids(&["fuse-0", "fuse-1"])).unwrap();
    ledger.record(FUSE, &ids(&["fuse-2"])).unwrap();
    let pods = list(vec![
        pod(
            "default",
            "web",
            &[("app", &[(FUSE, &["fuse-1", "fuse-0"])]), ("side", &[])],
        ),
        pod(
            "batch",
            "job",
            &[("main", &[(GPU, &["gpu-0"]), (FUSE, &["fuse-2"])])],
        ),
    ]);
    let report = ledger.reconcile(&pods, HOUR, &only_fuse);
    assert_eq!(report.attributed, 2);
    assert!(report.freed.is_empty());
    assert!(report.adopted.is_empty(), "the GPU is not ours: {report:?}");
    assert_eq!(report.pending, 0);
    assert_eq!(
        report.to_string(),
        "2 attributed, 0 freed, 0 adopted, 0 pending"
    );

    assert_eq!(
        ledger.holders(FUSE),
        vec![
            ("fuse-0".to_owned(), Some(holder("default", "web", "app"))),
            ("fuse-1".to_owned(), Some(holder("default", "web", "app"))),
            ("fuse-2".to_owned(), Some(holder("batch", "job", "main"))),
        ]
    );
    assert!(ledger.holders(GPU).is_empty());
    assert!(!ledger.is_written(), "reconciling does no I/O");
    ledger.write(false).unwrap();
    assert_eq!(
        Ledger::open(dir.path()).unwrap().entries(),
        ledger.entries()
    );

    // A second identical pass changes nothing.
    let again = ledger.reconcile(&pods, HOUR, &only_fuse);
    assert!(!again.changed(), "{again:?}");
}

#[test]
fn reconcile_frees_entries_whose_pod_vanished() {
    let ledger = Ledger::in_memory();
    ledger.record(FUSE, &ids(&["fuse-0"])).unwrap();
    ledger.record(FUSE, &ids(&["fuse-1"])).unwrap();
    let both = list(vec![
        pod("ns", "a", &[("c", &[(FUSE, &["fuse-0"])])]),
        pod("ns", "b", &[("c", &[(FUSE, &["fuse-1"])])]),
    ]);
    assert_eq!(ledger.reconcile(&both, HOUR, &only_fuse).attributed, 2);

    // Pod a ended: its entry goes at once, whatever the grace.
    let one = list(vec![pod("ns", "b", &[("c", &[(FUSE, &["fuse-1"])])])]);
    let report = ledger.reconcile(&one, HOUR, &only_fuse);
    assert_eq!(report.freed.len(), 1);
    assert_eq!(report.freed[0].device_ids, ids(&["fuse-0"]));
    assert_eq!(report.freed[0].holder, Some(holder("ns", "a", "c")));
    assert_eq!(
        ledger.holders(FUSE),
        vec![("fuse-1".to_owned(), Some(holder("ns", "b", "c")))]
    );
}

#[test]
fn an_entry_is_held_only_by_a_container_with_all_its_devices() {
    let ledger = Ledger::in_memory();
    ledger.record(FUSE, &ids(&["fuse-0", "fuse-1"])).unwrap();
    // Same ids under another resource, and only part of them under ours: no match.
    let pods = list(vec![
        pod("ns", "other", &[("c", &[(GPU, &["fuse-0", "fuse-1"])])]),
        pod("ns", "part", &[("c", &[(FUSE, &["fuse-0"])])]),
    ]);
    let report = ledger.reconcile(&pods, HOUR, &|_| false);
    assert_eq!(report.attributed, 0);
    assert_eq!(report.pending, 1);
    assert_eq!(ledger.entries()[0].holder, None);
}

#[test]
fn reconcile_respects_grace_for_fresh_entries() {
    let mut state = state::State::default();
    let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
    state.push(FUSE, ids(&["fuse-0"]), None, t0);
    let grace = Duration::from_secs(30);
    let empty = list(vec![]);

    let report = state.reconcile(&empty, grace, t0 + Duration::from_secs(29), &only_fuse);
    assert_eq!((report.pending, report.freed.len()), (1, 0));
    // A clock that went backwards makes the entry young, not old.
    let report = state.reconcile(&empty, grace, t0 - HOUR, &only_fuse);
    assert_eq!((report.pending, report.freed.len()), (1, 0));
    let report = state.reconcile(&empty, grace, t0 + grace, &only_fuse);
    assert_eq!((report.pending, report.freed.len()), (0, 1));
    assert!(state.entries.is_empty());
}

#[test]
fn a_fresh_entry_that_shows_up_is_attributed_within_grace() {
    let mut state = state::State::default();
    let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
    state.push(FUSE, ids(&["fuse-0"]), None, t0);
    let pods = list(vec![pod("ns", "p", &[("c", &[(FUSE, &["fuse-0"])])])]);
    let report = state.reconcile(&pods, Duration::from_secs(30), t0 + HOUR, &only_fuse);
    assert_eq!(report.attributed, 1);
    assert!(report.freed.is_empty());
}

#[test]
fn reconcile_adopts_unknown_allocations_of_our_resources_only() {
    let ledger = Ledger::in_memory();
    ledger.record(FUSE, &ids(&["fuse-0"])).unwrap();
    let pods = list(vec![
        // fuse-0 is known; fuse-1 in the same container is not.
        pod("ns", "known", &[("c", &[(FUSE, &["fuse-0", "fuse-1"])])]),
        pod(
            "ns",
            "lost",
            &[("c", &[(FUSE, &["fuse-3", "fuse-2"]), (GPU, &["gpu-0"])])],
        ),
    ]);
    let report = ledger.reconcile(&pods, HOUR, &only_fuse);
    assert_eq!(report.attributed, 1);
    let adopted: Vec<_> = report
        .adopted
        .iter()
        .map(|e| (e.id, e.resource.as_str(), e.device_ids.clone()))
        .collect();
    assert_eq!(
        adopted,
        vec![
            (2, FUSE, ids(&["fuse-1"])),
            (3, FUSE, ids(&["fuse-3", "fuse-2"]))
        ]
    );
    assert_eq!(report.adopted[1].holder, Some(holder("ns", "lost", "c")));
    assert_eq!(ledger.entries().len(), 3);
    assert!(ledger.holders(GPU).is_empty());

    // Adopted entries are ordinary entries: stable on the next pass, freed when the pod ends.
    assert!(!ledger.reconcile(&pods, HOUR, &only_fuse).changed());
    let report = ledger.reconcile(&list(vec![]), HOUR, &only_fuse);
    assert_eq!(report.freed.len(), 3);
    assert!(ledger.entries().is_empty());
}

#[test]
fn a_newer_allocation_of_a_device_supersedes_the_older_entry_at_once() {
    let ledger = Ledger::in_memory();
    // Init container got fuse-0; the app container reused it and got fuse-1 too.
    ledger.record(FUSE, &ids(&["fuse-0"])).unwrap();
    ledger.record(FUSE, &ids(&["fuse-0", "fuse-1"])).unwrap();
    assert_eq!(
        ledger.entries().iter().map(|e| e.id).collect::<Vec<_>>(),
        vec![2],
        "the kubelet's newest word on fuse-0 is the only one kept"
    );
    let pods = list(vec![pod(
        "ns",
        "p",
        &[("app", &[(FUSE, &["fuse-0", "fuse-1"])])],
    )]);
    let report = ledger.reconcile(&pods, HOUR, &only_fuse);
    assert!(report.freed.is_empty() && report.adopted.is_empty());
    assert_eq!(report.attributed, 1);

    // However many pods come and go unreported, one entry per device.
    for _ in 0..100 {
        ledger.record(FUSE, &ids(&["fuse-2"])).unwrap();
    }
    assert_eq!(ledger.entries().len(), 2);
}

#[test]
fn the_current_holder_is_kept_when_several_containers_qualify() {
    let ledger = Ledger::in_memory();
    ledger.record(FUSE, &ids(&["fuse-0"])).unwrap();
    let b = pod("ns", "b", &[("c", &[(FUSE, &["fuse-0"])])]);
    let a = pod("ns", "a", &[("c", &[(FUSE, &["fuse-0"])])]);
    ledger.reconcile(&list(vec![b.clone()]), HOUR, &only_fuse);
    let report = ledger.reconcile(&list(vec![a, b]), HOUR, &only_fuse);
    assert_eq!(report.attributed, 0);
    assert_eq!(ledger.entries()[0].holder, Some(holder("ns", "b", "c")));
}

#[test]
fn an_entry_without_devices_is_never_held() {
    let ledger = Ledger::in_memory();
    ledger.record(FUSE, &[]).unwrap();
    let pods = list(vec![pod("ns", "p", &[("c", &[(FUSE, &["fuse-0"])])])]);
    let report = ledger.reconcile(&pods, HOUR, &|_| false);
    assert_eq!((report.attributed, report.pending), (0, 1));
}

#[test]
fn ledger_is_send_sync_and_clones_share_state() {
    fn assert_send_sync<T: Send + Sync + Clone + 'static>() {}
    assert_send_sync::<Ledger>();
    let a = Ledger::in_memory();
    let b = a.clone();
    a.record(FUSE, &ids(&["fuse-0"])).unwrap();
    assert_eq!(b.entries().len(), 1);
}

#[tokio::test]
async fn records_reach_the_checkpoint_through_the_writer() {
    let dir = tempfile::tempdir().unwrap();
    let ledger = Ledger::open(dir.path()).unwrap();
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let flusher = tokio::spawn(ledger.clone().run_writer(stopped));
    for i in 0..50 {
        ledger.record(FUSE, &[format!("fuse-{i}")]).unwrap();
    }
    // The burst is written without stopping the writer.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        if Ledger::open(dir.path()).unwrap().entries().len() == 50 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the flusher never wrote"
        );
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    ledger.record(FUSE, &ids(&["last"])).unwrap();
    stop.send(true).unwrap();
    flusher.await.unwrap();
    assert_eq!(
        Ledger::open(dir.path()).unwrap().entries().len(),
        51,
        "stopping flushes"
    );
}

fn claim_of(resource: &str, name: &str, devices: &[&str], admin: bool) -> ClaimRecord {
    ClaimRecord {
        driver: "fuse.devicelet.io".into(),
        resource: resource.into(),
        namespace: "team".into(),
        name: name.into(),
        requests: vec![PreparedRequest {
            request: "fuse".into(),
            devices: devices
                .iter()
                .map(|d| (d.to_string(), d.to_string()))
                .collect(),
            config: String::new(),
            cdi_ids: Vec::new(),
            admin,
            shares: Vec::new(),
            status: Vec::new(),
        }],
        spec_file: None,
        preparing: false,
        by_module: false,
    }
}

#[test]
fn of_claims_racing_for_one_device_exactly_one_holds_it_every_round() {
    let ledger = Ledger::in_memory();
    for round in 0..100 {
        let barrier = std::sync::Arc::new(std::sync::Barrier::new(6));
        let won: Vec<bool> = (0..6)
            .map(|i| {
                let (ledger, barrier) = (ledger.clone(), barrier.clone());
                std::thread::spawn(move || {
                    let uid = format!("r{round}-c{i}");
                    barrier.wait();
                    ledger
                        .reserve_claim(&uid, claim_of(FUSE, &uid, &["fuse-0"], false))
                        .is_ok()
                })
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|t| t.join().unwrap())
            .collect();
        assert_eq!(
            won.iter().filter(|w| **w).count(),
            1,
            "round {round}: {won:?}"
        );
        let winner = won.iter().position(|w| *w).unwrap();
        ledger.drop_claim(&format!("r{round}-c{winner}"));
    }
    // Admin access holds nothing: it is never refused and never refuses another.
    ledger
        .reserve_claim("plain", claim_of(FUSE, "plain", &["fuse-0"], false))
        .unwrap();
    ledger
        .reserve_claim("monitor", claim_of(FUSE, "monitor", &["fuse-0"], true))
        .unwrap();
    let e = ledger
        .reserve_claim("late", claim_of(FUSE, "late", &["fuse-0"], false))
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "device \"fuse-0\" of devicelet.io/fuse is already prepared for ResourceClaim team/plain (UID plain)"
    );
}

#[test]
fn a_container_and_a_claim_racing_for_one_device_one_wins_the_other_is_told_who() {
    for round in 0..100 {
        let ledger = Ledger::in_memory();
        let barrier = std::sync::Arc::new(std::sync::Barrier::new(2));
        let container = {
            let (ledger, barrier) = (ledger.clone(), barrier.clone());
            // The device plugin serves it shared and renamed: replicas of the module's device.
            std::thread::spawn(move || {
                barrier.wait();
                ledger.record(&format!("{FUSE}.shared"), &ids(&["fuse-0::3"]))
            })
        };
        let claim = {
            let ledger = ledger.clone();
            std::thread::spawn(move || {
                barrier.wait();
                ledger.reserve_claim("u", claim_of(FUSE, "c", &["fuse-0"], false))
            })
        };
        let (container, claim) = (container.join().unwrap(), claim.join().unwrap());
        match (container, claim) {
            (Ok(_), Err(e)) => assert!(
                e.to_string()
                    .contains("held by a container the kubelet has not reported yet"),
                "{e}"
            ),
            (Err(e), Ok(())) => assert!(
                e.to_string()
                    .contains("already prepared for ResourceClaim team/c"),
                "{e}"
            ),
            other => panic!("round {round}: both or neither won: {other:?}"),
        }
    }
}

#[test]
fn prepared_claims_reach_the_checkpoint_and_reservations_do_not() {
    let tmp = tempfile::tempdir().unwrap();
    let ledger = Ledger::open(tmp.path()).unwrap();
    ledger
        .reserve_claim("done", claim_of(FUSE, "done", &["fuse-0"], false))
        .unwrap();
    ledger.prepare_claim("done", claim_of(FUSE, "done", &["fuse-0"], false));
    ledger
        .reserve_claim("half", claim_of(FUSE, "half", &["fuse-1"], false))
        .unwrap();
    ledger.flush().unwrap();
    // As after a SIGKILL between reserving and preparing: only what was prepared is held.
    let again = Ledger::open(tmp.path()).unwrap();
    assert!(again.claim("done").is_some());
    assert!(again.claim("half").is_none());
    assert_eq!(
        again.claimed(FUSE).into_iter().collect::<Vec<_>>(),
        ["fuse-0"]
    );
    let e = again.record(FUSE, &ids(&["fuse-0"])).unwrap_err();
    assert!(e.to_string().contains("team/done"), "{e}");
    again.record(FUSE, &ids(&["fuse-1"])).unwrap();
    assert_eq!(
        again.drop_claim("done").map(|c| c.name),
        Some("done".into())
    );
    again.flush().unwrap();
    assert!(Ledger::open(tmp.path()).unwrap().claimed(FUSE).is_empty());
}

#[test]
fn a_claims_change_costs_one_journal_line_and_survives_a_restart_without_a_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let ledger = Ledger::open(tmp.path()).unwrap();
    ledger.record(FUSE, &ids(&["fuse-9"])).unwrap();
    ledger.flush().unwrap();
    let checkpoint = fs::read(ledger.file().unwrap()).unwrap();
    for (uid, device) in [("a", "fuse-0"), ("b", "fuse-1")] {
        ledger
            .reserve_claim(uid, claim_of(FUSE, uid, &[device], false))
            .unwrap();
        ledger.prepare_claim(uid, claim_of(FUSE, uid, &[device], false));
        ledger.persist().unwrap();
    }
    ledger.drop_claim("a");
    ledger.persist().unwrap();
    assert!(ledger.is_written());
    // The checkpoint was not rewritten: three lines went to the journal.
    assert_eq!(fs::read(ledger.file().unwrap()).unwrap(), checkpoint);
    let journal = fs::read_to_string(tmp.path().join("ledger.journal")).unwrap();
    assert_eq!(journal.lines().count(), 3, "{journal}");

    // As after a SIGKILL: the checkpoint plus the journal.
    let again = Ledger::open(tmp.path()).unwrap();
    assert!(again.claim("a").is_none());
    assert_eq!(again.claim("b").map(|c| c.name), Some("b".into()));
    assert_eq!(again.entries().len(), 1);
    // A checkpoint holds everything, and the journal starts again empty.
    again.flush().unwrap();
    assert_eq!(fs::read(tmp.path().join("ledger.journal")).unwrap(), b"");
    assert!(Ledger::open(tmp.path()).unwrap().claim("b").is_some());
}

/// `claim_of`, holding `device` by a share that consumes `memory`.
fn share_of(name: &str, device: &str, memory: &str) -> ClaimRecord {
    let mut record = claim_of(GPU, name, &[device], false);
    record.requests[0].shares = vec![HeldShare {
        device: device.into(),
        share_id: format!("{name}-share"),
        consumed: vec![("memory".into(), memory.into())],
    }];
    record
}

#[test]
fn shares_of_a_device_fit_its_capacity_and_a_whole_claim_or_container_waits_for_them() {
    use crate::device::{CounterSet, CounterUse, Device, Health, Shared};
    let mut gpu = Device::new("gpu-0", Health::Healthy);
    gpu.capacities = vec![("memory".into(), "40Gi".into())];
    gpu.shared = Some(Shared::default());
    let budget = Budget::of(&[gpu], &[]);
    let ledger = Ledger::in_memory();
    for (i, memory) in ["10Gi", "10Gi", "10Gi", "10Gi"].iter().enumerate() {
        let name = format!("s{i}");
        ledger
            .reserve_claim_within(&name, share_of(&name, "gpu-0", memory), &budget)
            .unwrap_or_else(|e| panic!("share {i}: {e}"));
    }
    let e = ledger
        .reserve_claim_within("s4", share_of("s4", "gpu-0", "1Gi"), &budget)
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "device \"gpu-0\" of vendor.com/gpu: the claim's share asks 1Gi of its memory, and 0 is left"
    );
    // Whole, it waits for every share to go; so does a container of the device plugin.
    let e = ledger
        .reserve_claim_within("whole", claim_of(GPU, "whole", &["gpu-0"], false), &budget)
        .unwrap_err();
    assert!(e.to_string().contains("team/s"), "{e}");
    assert!(ledger.claimed(GPU).contains("gpu-0"));
    ledger.drop_claim("s0");
    ledger
        .reserve_claim_within("s5", share_of("s5", "gpu-0", "10Gi"), &budget)
        .expect("room again");
    // A share of a device the module does not share is refused by name.
    let e = ledger
        .reserve_claim_within("odd", share_of("odd", "gpu-9", "1Gi"), &budget)
        .unwrap_err();
    assert!(
        e.to_string().contains("does not share it by capacity"),
        "{e}"
    );

    // Partitions: two halves and a whole draw on one set of 2 memory slices.
    let part = |id: &str, slices: &str| {
        let mut d = Device::new(id, Health::Healthy);
        d.consumes = vec![CounterUse {
            counter_set: "gpu-1".into(),
            counters: vec![("memory-slices".into(), slices.into())],
        }];
        d
    };
    let set = CounterSet {
        name: "gpu-1".into(),
        counters: vec![("memory-slices".into(), "2".into())],
    };
    let budget = Budget::of(
        &[part("half-a", "1"), part("half-b", "1"), part("whole", "2")],
        &[set],
    );
    let ledger = Ledger::in_memory();
    ledger
        .reserve_claim_within("a", claim_of(GPU, "a", &["half-a"], false), &budget)
        .expect("a half");
    let e = ledger
        .reserve_claim_within("w", claim_of(GPU, "w", &["whole"], false), &budget)
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "device \"whole\" of vendor.com/gpu would take counter memory-slices of set gpu-1 past its 2, with the partitions other claims hold"
    );
    ledger
        .reserve_claim_within("b", claim_of(GPU, "b", &["half-b"], false), &budget)
        .expect("the other half");
}
