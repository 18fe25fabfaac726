//! The fake NVML, loaded as the agent loads the real one: `nvml-wrapper` dlopens the library
//! at a path and resolves its symbols. These checks pin down that the fake answers like NVML,
//! failures included, so scenarios built on it exercise the agent's real error paths.
//!
//! The fake reads its environment at `nvmlInit` and keeps process-global state, and a test
//! binary is one process: everything runs in one `#[test]`, in order.

// `expect_err` needs the `Ok` type to be `Debug`, and nvml-wrapper's `Nvml` and `Device` are not.
#![allow(clippy::err_expect)]

use std::ffi::c_char;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

use devicelet_tests::fake_nvml_lib;
use nvml_wrapper::Nvml;
use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enum_wrappers::device::TopologyLevel;
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::{NvmlError, nvml_try};
use nvml_wrapper::event::EventSet;

const A100: &str = "NVIDIA A100-SXM4-80GB";

/// Four GPUs: 0 and 1 share a board, 0–2 a PCIe switch, 2 and 3 a NUMA node; 0 is split into
/// two MIG devices, 1 supports MIG with it disabled; 0 and 1 are joined by two NVLinks.
const FIXTURE: &str = r#"{
  "driver-version": "550.54.15",
  "gpus": [
    { "uuid": "GPU-00000000-0000-0000-0000-000000000000", "name": "NVIDIA A100-SXM4-80GB",
      "minor": 0, "pci-bus-id": "00000000:07:00.0", "memory-mib": 81920,
      "numa-node": 0, "cpus": [0, 1, 2, 3, 65], "board": "b0", "switch": "sw0",
      "nvlinks": ["00000000:0F:00.0", "00000000:0F:00.0"],
      "mig": { "enabled": true, "devices": [
        { "uuid": "MIG-00000000-0000-0000-0000-000000000001", "gi": 1, "ci": 0,
          "gi-slices": 1, "ci-slices": 1, "memory-mib": 9856 },
        { "uuid": "MIG-00000000-0000-0000-0000-000000000002", "gi": 2, "ci": 0,
          "gi-slices": 3, "ci-slices": 3, "memory-mib": 40192 }
      ] } },
    { "uuid": "GPU-11111111-1111-1111-1111-111111111111", "name": "NVIDIA A100-SXM4-80GB",
      "minor": 1, "pci-bus-id": "00000000:0F:00.0", "memory-mib": 81920,
      "board": "b0", "switch": "sw0",
      "nvlinks": ["00000000:07:00.0", "00000000:07:00.0"],
      "mig": { "enabled": false } },
    { "uuid": "GPU-22222222-2222-2222-2222-222222222222", "name": "NVIDIA L4",
      "minor": 2, "pci-bus-id": "00000000:87:00.0", "memory-mib": 23034,
      "numa-node": 1, "cpus": [64], "switch": "sw0" },
    { "uuid": "GPU-33333333-3333-3333-3333-333333333333", "name": "NVIDIA L4",
      "minor": 3, "pci-bus-id": "00000000:8A:00.0", "memory-mib": 23034,
      "numa-node": 1, "nvlinks": ["not-a-bus-id"] }
  ]
}"#;

struct Files {
    _dir: tempfile::TempDir,
    fixture: PathBuf,
    control: PathBuf,
}

impl Files {
    fn new() -> Files {
        let dir = tempfile::tempdir().expect("tempdir");
        let fixture = dir.path().join("nvml.json");
        let control = dir.path().join("control");
        // SAFETY: this binary's only test sets them, before any thread of its own exists.
        unsafe {
            std::env::set_var("DEVICELET_FAKE_NVML", &fixture);
            std::env::set_var("DEVICELET_FAKE_NVML_CONTROL", &control);
        }
        Files {
            _dir: dir,
            fixture,
            control,
        }
    }

    fn fixture(&self, json: &str) {
        std::fs::write(&self.fixture, json).expect("writing the fixture");
    }

    /// Appends `text` to the control file, as a test driving the node would.
    fn control(&self, text: &str) {
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.control)
            .and_then(|mut f| f.write_all(text.as_bytes()))
            .expect("appending to the control file");
    }
}

fn init(lib: &Path) -> Result<Nvml, NvmlError> {
    Nvml::builder().lib_path(lib.as_os_str()).init()
}

#[test]
fn fake_nvml_answers_like_nvml() {
    let lib = fake_nvml_lib();
    let files = Files::new();
    init_failures(lib, &files);
    files.fixture(FIXTURE);
    let nvml = init(lib).expect("the fixture initialises");
    inventory(&nvml);
    mig(&nvml);
    topology(&nvml);
    nvlinks(&nvml);
    raw_calls(&nvml);
    events_and_lost_gpus(&nvml, &files);
    hang(&nvml, &files);
    refcount(lib, nvml);
}

/// No driver, no permission, a broken fixture, a wedged driver; none leaves NVML initialised.
fn init_failures(lib: &'static Path, files: &Files) {
    let missing = init(lib).err().expect("no fixture: no driver");
    assert!(matches!(missing, NvmlError::DriverNotLoaded), "{missing:?}");

    files.fixture(r#"{"driver-version": "550.54.15", "init": "no-permission"}"#);
    let denied = init(lib).err().expect("no permission");
    assert!(matches!(denied, NvmlError::NoPermission), "{denied:?}");

    files.fixture(r#"{"driver-version": "550.54.15", "gpus": [], "colour": "green"}"#);
    let invalid = init(lib)
        .err()
        .expect("an invalid fixture reads as no driver");
    assert!(matches!(invalid, NvmlError::DriverNotLoaded), "{invalid:?}");

    // A half-initialised driver: nvmlInit never returns. The thread is left blocked; it holds
    // no lock, so the rest of the test goes on.
    files.fixture(r#"{"driver-version": "550.54.15", "init": "hang"}"#);
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || tx.send(init(lib).is_ok()));
    assert_eq!(
        rx.recv_timeout(Duration::from_millis(200)),
        Err(mpsc::RecvTimeoutError::Timeout),
        "nvmlInit returned on a hung driver"
    );
}

fn inventory(nvml: &Nvml) {
    assert_eq!(nvml.sys_driver_version().unwrap(), "550.54.15");
    assert_eq!(nvml.device_count().unwrap(), 4);

    let gpu0 = nvml.device_by_index(0).unwrap();
    assert_eq!(
        gpu0.uuid().unwrap(),
        "GPU-00000000-0000-0000-0000-000000000000"
    );
    assert_eq!(gpu0.name().unwrap(), A100);
    assert_eq!(gpu0.minor_number().unwrap(), 0);
    assert_eq!(gpu0.index().unwrap(), 0);
    let pci = gpu0.pci_info().unwrap();
    assert_eq!(pci.bus_id, "00000000:07:00.0");
    assert_eq!((pci.domain, pci.bus, pci.device), (0, 7, 0));
    let memory = gpu0.memory_info().unwrap();
    assert_eq!(memory.total, 81920 << 20);
    assert_eq!(memory.free + memory.used + memory.reserved, memory.total);
    assert_eq!(gpu0.numa_node_id().unwrap(), 0);
    assert_eq!(gpu0.cpu_affinity(2).unwrap(), [0b1111, 0b10]);
    assert_eq!(
        gpu0.cpu_affinity(1).unwrap(),
        [0b1111],
        "CPUs beyond the buffer are cut off"
    );

    let gpu1 = nvml.device_by_index(1).unwrap();
    assert_eq!(gpu1.minor_number().unwrap(), 1);
    let no_numa = gpu1.numa_node_id().err().expect("no NUMA node");
    assert!(matches!(no_numa, NvmlError::NotSupported), "{no_numa:?}");
    assert_eq!(gpu1.cpu_affinity(2).unwrap(), [0, 0]);

    let gpu3 = nvml
        .device_by_uuid("GPU-33333333-3333-3333-3333-333333333333")
        .unwrap();
    assert_eq!(gpu3.index().unwrap(), 3);
    assert_eq!(gpu3.pci_info().unwrap().bus_id, "00000000:8A:00.0");
    let unknown = nvml.device_by_uuid("GPU-nope").err().expect("unknown UUID");
    assert!(matches!(unknown, NvmlError::NotFound), "{unknown:?}");
    let past_end = nvml.device_by_index(4).err().expect("index past the end");
    assert!(matches!(past_end, NvmlError::InvalidArg), "{past_end:?}");
}

fn mig(nvml: &Nvml) {
    let gpu0 = nvml.device_by_index(0).unwrap();
    let mode = gpu0.mig_mode().unwrap();
    assert_eq!((mode.current, mode.pending), (1, 1));
    assert_eq!(gpu0.mig_device_count().unwrap(), 7);
    assert!(!gpu0.mig_is_mig_device_handle().unwrap());

    let mig = gpu0.mig_device_by_index(1).unwrap();
    assert!(mig.mig_is_mig_device_handle().unwrap());
    assert_eq!(
        mig.uuid().unwrap(),
        "MIG-00000000-0000-0000-0000-000000000002"
    );
    let attributes = mig.attributes().unwrap();
    assert_eq!(
        (
            attributes.gpu_instance_slice_count,
            attributes.compute_instance_slice_count,
            attributes.memory_size_mb
        ),
        (3, 3, 40192)
    );
    assert_eq!(mig.memory_info().unwrap().total, 40192 << 20);
    let parent = mig.mig_parent_device().unwrap();
    assert_eq!(unsafe { parent.handle() }, unsafe { gpu0.handle() });
    let minor = mig.minor_number().err().expect("MIG devices have no minor");
    assert!(matches!(minor, NvmlError::NotSupported), "{minor:?}");
    // nvml-wrapper has no method for the instance ids: the host calls them raw.
    let (mut gi, mut ci) = (0, 0);
    unsafe {
        nvml_try(nvml.lib().nvmlDeviceGetGpuInstanceId(mig.handle(), &mut gi)).unwrap();
        nvml_try(
            nvml.lib()
                .nvmlDeviceGetComputeInstanceId(mig.handle(), &mut ci),
        )
        .unwrap();
    }
    assert_eq!((gi, ci), (2, 0));
    let by_uuid = nvml
        .device_by_uuid("MIG-00000000-0000-0000-0000-000000000001")
        .unwrap();
    assert_eq!(unsafe { by_uuid.handle() }, unsafe {
        gpu0.mig_device_by_index(0).unwrap().handle()
    });

    let empty = gpu0.mig_device_by_index(2).err().expect("an empty slot");
    assert!(matches!(empty, NvmlError::NotFound), "{empty:?}");
    let not_mig = gpu0
        .attributes()
        .err()
        .expect("attributes are for MIG devices");
    assert!(matches!(not_mig, NvmlError::NotSupported), "{not_mig:?}");
    let code = unsafe {
        nvml.lib()
            .nvmlDeviceGetGpuInstanceId(gpu0.handle(), &mut gi)
    };
    assert!(matches!(nvml_try(code), Err(NvmlError::InvalidArg)));

    let gpu1 = nvml.device_by_index(1).unwrap();
    let mode = gpu1.mig_mode().unwrap();
    assert_eq!((mode.current, mode.pending), (0, 0));
    let disabled = gpu1.mig_device_by_index(0).err().expect("MIG disabled");
    assert!(matches!(disabled, NvmlError::NotFound), "{disabled:?}");

    let gpu2 = nvml.device_by_index(2).unwrap();
    let unsupported = gpu2.mig_mode().err().expect("no MIG support");
    assert!(
        matches!(unsupported, NvmlError::NotSupported),
        "{unsupported:?}"
    );
    let count = gpu2.mig_device_count().err().expect("no MIG support");
    assert!(matches!(count, NvmlError::NotSupported), "{count:?}");
}

fn topology(nvml: &Nvml) {
    let gpu = |i| nvml.device_by_index(i).unwrap();
    let level = |a, b| gpu(a).topology_common_ancestor(gpu(b)).unwrap();
    assert_eq!(level(0, 0), TopologyLevel::Internal, "same GPU");
    assert_eq!(level(0, 1), TopologyLevel::Internal, "same board");
    assert_eq!(level(0, 2), TopologyLevel::Single, "same switch");
    assert_eq!(level(2, 3), TopologyLevel::Node, "same NUMA node");
    assert_eq!(level(0, 3), TopologyLevel::System);
    assert_eq!(level(1, 3), TopologyLevel::System, "no NUMA node");
    assert_eq!(
        nvml.topology_common_ancestor(&gpu(3), &gpu(2)).unwrap(),
        TopologyLevel::Node
    );
}

fn nvlinks(nvml: &Nvml) {
    let gpu0 = nvml.device_by_index(0).unwrap();
    for link in 0..2 {
        let link = gpu0.link_wrapper_for(link);
        assert!(link.is_active().unwrap());
        let remote = link.remote_pci_info().unwrap();
        assert_eq!(remote.bus_id, "00000000:0F:00.0");
        assert_eq!(remote.bus, 0x0f);
    }
    let idle = gpu0
        .link_wrapper_for(2)
        .is_active()
        .err()
        .expect("no link 2");
    assert!(matches!(idle, NvmlError::NotSupported), "{idle:?}");
    let idle = gpu0.link_wrapper_for(2).remote_pci_info().err();
    assert!(matches!(idle, Some(NvmlError::NotSupported)), "{idle:?}");
    let past_max = gpu0.link_wrapper_for(18).is_active().err();
    assert!(
        matches!(past_max, Some(NvmlError::InvalidArg)),
        "{past_max:?}"
    );
    let gpu2 = nvml.device_by_index(2).unwrap();
    let none = gpu2.link_wrapper_for(0).is_active().err();
    assert!(matches!(none, Some(NvmlError::NotSupported)), "{none:?}");
    // A fixture's bad bus id is the driver's problem, not the caller's.
    let gpu3 = nvml.device_by_index(3).unwrap();
    let bad = gpu3.link_wrapper_for(0).remote_pci_info().err();
    assert!(matches!(bad, Some(NvmlError::Unknown)), "{bad:?}");
}

/// `nvmlMemory_v2_t`'s layout, to hand NVML a wrongly versioned one.
#[repr(C)]
#[derive(Default)]
struct MemoryV2 {
    version: u32,
    total: u64,
    reserved: u64,
    free: u64,
    used: u64,
}

/// What the wrapper never does: null pointers, foreign handles, short buffers, old versions.
fn raw_calls(nvml: &Nvml) {
    let lib = nvml.lib();
    let gpu0 = nvml.device_by_index(0).unwrap();
    let fails = |code, expected: fn(&NvmlError) -> bool| {
        let error = nvml_try(code).err().expect("an error");
        assert!(expected(&error), "{error:?}");
    };
    let mut minor = 0;
    let mut uuid = [0 as c_char; 8];
    let mut memory = MemoryV2::default();
    unsafe {
        fails(lib.nvmlDeviceGetCount_v2(std::ptr::null_mut()), |e| {
            matches!(e, NvmlError::InvalidArg)
        });
        fails(
            lib.nvmlDeviceGetMinorNumber(std::ptr::null_mut(), &mut minor),
            |e| matches!(e, NvmlError::InvalidArg),
        );
        fails(
            lib.nvmlDeviceGetMinorNumber(std::ptr::without_provenance_mut(0x42), &mut minor),
            |e| matches!(e, NvmlError::InvalidArg),
        );
        fails(
            lib.nvmlDeviceGetUUID(gpu0.handle(), uuid.as_mut_ptr(), uuid.len() as u32),
            |e| matches!(e, NvmlError::InsufficientSize(_)),
        );
        fails(
            lib.nvmlDeviceGetMemoryInfo_v2(gpu0.handle(), (&raw mut memory).cast()),
            |e| matches!(e, NvmlError::UnexpectedVariant(25)), // ARGUMENT_VERSION_MISMATCH
        );
        fails(lib.nvmlEventSetFree(std::ptr::null_mut()), |e| {
            matches!(e, NvmlError::InvalidArg)
        });
        let text = std::ffi::CStr::from_ptr(lib.nvmlErrorString(15));
        assert_eq!(text.to_str().unwrap(), "GPU is lost");
    }
}

/// The next event of `set`, as (GPU index, type, XID); `gpus` are the GPUs' handles, taken
/// while they were reachable (a lost GPU has no handle to look up).
fn next(
    gpus: &[usize],
    set: &EventSet,
    timeout_ms: u32,
) -> Result<(usize, EventTypes, Option<u64>), NvmlError> {
    let event = set.wait(timeout_ms)?;
    let xid = event.event_data.map(|x| match x {
        XidError::Value(v) => v,
        XidError::Unknown => 999,
    });
    let handle = unsafe { event.device.handle() }.addr();
    let index = gpus
        .iter()
        .position(|&h| h == handle)
        .expect("the event's handle is a GPU's");
    Ok((index, event.event_type, xid))
}

fn events_and_lost_gpus(nvml: &Nvml, files: &Files) {
    let xid = EventTypes::CRITICAL_XID_ERROR;
    let dbe = EventTypes::DOUBLE_BIT_ECC_ERROR;
    let gpu0 = nvml.device_by_index(0).unwrap();
    let gpu1 = nvml.device_by_index(1).unwrap();
    let gpus: Vec<usize> = (0..4)
        .map(|i| unsafe { nvml.device_by_index(i).unwrap().handle() }.addr())
        .collect();
    let next = |set: &EventSet, timeout_ms| next(&gpus, set, timeout_ms);
    assert_eq!(
        gpu0.supported_event_types().unwrap(),
        xid | dbe | EventTypes::SINGLE_BIT_ECC_ERROR
    );
    let unsupported = gpu0
        .register_events(EventTypes::CLOCK_CHANGE, nvml.create_event_set().unwrap())
        .err()
        .expect("clock events are not supported");
    assert!(matches!(unsupported.error, NvmlError::NotSupported));

    // Injected before the set registered: never delivered.
    files.control("xid 0 13\n");
    let set = nvml.create_event_set().unwrap();
    let set = gpu0.register_events(xid | dbe, set).unwrap();
    let set = gpu1.register_events(xid, set).unwrap();
    assert!(matches!(next(&set, 50), Err(NvmlError::Timeout)));

    files.control("dbe 1\nxid 0 79\nreboot the node\ndbe 0\nxid 1 4");
    assert_eq!(next(&set, 1000).unwrap(), (0, xid, Some(79)));
    assert_eq!(
        next(&set, 1000).unwrap(),
        (0, dbe, None),
        "dbe 1 is not watched"
    );
    assert!(
        matches!(next(&set, 50), Err(NvmlError::Timeout)),
        "a partial line waits for its newline"
    );
    files.control("8\n");
    assert_eq!(next(&set, 1000).unwrap(), (1, xid, Some(48)));

    // Each set has its own cursor; a wait returns when an event arrives.
    let late = gpu1
        .register_events(xid, nvml.create_event_set().unwrap())
        .unwrap();
    std::thread::scope(|s| {
        let (tx, rx) = mpsc::channel();
        let waiter = s.spawn(move || {
            tx.send(next(&late, 10_000)).unwrap();
            late
        });
        assert_eq!(
            rx.recv_timeout(Duration::from_millis(100)).err(),
            Some(mpsc::RecvTimeoutError::Timeout),
            "nothing to deliver yet"
        );
        files.control("xid 1 31\n");
        let event = rx
            .recv_timeout(Duration::from_secs(5))
            .expect("the wait returns");
        assert_eq!(event.unwrap(), (1, xid, Some(31)));
        waiter.join().unwrap().release_events().unwrap();
    });
    assert_eq!(next(&set, 1000).unwrap(), (1, xid, Some(31)));

    // A GPU falls off the bus: queries fail, including on its MIG devices, other GPUs answer,
    // and the XID that reported it still arrives.
    let mig = gpu0.mig_device_by_index(0).unwrap();
    files.control("xid 0 79\nlost 0\n");
    let lost = |r: Result<String, NvmlError>| matches!(r, Err(NvmlError::GpuLost));
    assert!(lost(gpu0.uuid()));
    assert!(lost(mig.uuid()));
    assert!(matches!(gpu0.memory_info(), Err(NvmlError::GpuLost)));
    assert!(matches!(nvml.device_by_index(0), Err(NvmlError::GpuLost)));
    assert_eq!(
        gpu1.uuid().unwrap(),
        "GPU-11111111-1111-1111-1111-111111111111"
    );
    assert_eq!(nvml.device_count().unwrap(), 4);
    assert_eq!(next(&set, 1000).unwrap().2, Some(79));
    files.control("found 0\n");
    assert_eq!(
        gpu0.uuid().unwrap(),
        "GPU-00000000-0000-0000-0000-000000000000"
    );
    assert!(mig.uuid().is_ok());
    set.release_events().unwrap();
}

/// A wedged driver: device queries block until `unhang`; the rest answers meanwhile.
fn hang(nvml: &Nvml, files: &Files) {
    files.control("hang\n");
    std::thread::scope(|s| {
        let (tx, rx) = mpsc::channel();
        s.spawn(move || tx.send(nvml.device_by_index(2).and_then(|d| d.uuid())));
        assert_eq!(
            rx.recv_timeout(Duration::from_millis(200)).err(),
            Some(mpsc::RecvTimeoutError::Timeout),
            "a device query returned on a hung driver"
        );
        assert_eq!(nvml.sys_driver_version().unwrap(), "550.54.15");
        let set = nvml.create_event_set().unwrap();
        assert!(matches!(set.wait(10), Err(NvmlError::Timeout)));
        files.control("unhang\n");
        let uuid = rx.recv_timeout(Duration::from_secs(5)).expect("unhung");
        assert_eq!(uuid.unwrap(), "GPU-22222222-2222-2222-2222-222222222222");
    });
    assert_eq!(nvml.device_count().unwrap(), 4);
}

/// Init and shutdown count; at zero every call is `UNINITIALIZED`, and the next init reads the
/// fixture afresh.
fn refcount(lib: &Path, nvml: Nvml) {
    let second = init(lib).expect("a second init");
    second.shutdown().expect("one of two shutdowns");
    assert_eq!(nvml.device_count().unwrap(), 4, "still initialised once");
    unsafe {
        nvml_try(nvml.lib().nvmlShutdown()).expect("the last shutdown");
        let again = nvml_try(nvml.lib().nvmlShutdown());
        assert!(matches!(again, Err(NvmlError::Uninitialized)), "{again:?}");
    }
    let uninitialised = nvml.device_count().err().expect("uninitialised");
    assert!(matches!(uninitialised, NvmlError::Uninitialized));
    let version = nvml.sys_driver_version().err().expect("uninitialised");
    assert!(matches!(version, NvmlError::Uninitialized));
    unsafe { nvml_try(nvml.lib().nvmlInit_v2()).expect("initialised again") };
    assert_eq!(nvml.device_count().unwrap(), 4);
    nvml.shutdown().expect("shut down");
}
