//! The library's process-global state, and the checks every NVML entry point makes before it
//! does anything: initialised, not hung, handles valid, out-pointers non-null.

use std::collections::HashMap;
use std::ffi::c_char;
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;
use std::ptr::NonNull;
use std::sync::{LazyLock, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use nvml_wrapper_sys::bindings::*;

use crate::control::{self, Command, Control};
use crate::fixture::{self, Fixture, Gpu, InitMode, MigDevice};

/// Short names for the `nvmlReturn_t` codes the fake returns.
pub mod code {
    use nvml_wrapper_sys::bindings::*;

    pub const SUCCESS: nvmlReturn_t = nvmlReturn_enum_NVML_SUCCESS;
    pub const UNINITIALIZED: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_UNINITIALIZED;
    pub const INVALID_ARGUMENT: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT;
    pub const NOT_SUPPORTED: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED;
    pub const NO_PERMISSION: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_NO_PERMISSION;
    pub const NOT_FOUND: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_NOT_FOUND;
    pub const INSUFFICIENT_SIZE: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_SIZE;
    pub const DRIVER_NOT_LOADED: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_DRIVER_NOT_LOADED;
    pub const TIMEOUT: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_TIMEOUT;
    pub const GPU_IS_LOST: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_GPU_IS_LOST;
    pub const ARGUMENT_VERSION_MISMATCH: nvmlReturn_t =
        nvmlReturn_enum_NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    pub const UNKNOWN: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_UNKNOWN;
    pub const IN_USE: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_IN_USE;
    pub const INSUFFICIENT_RESOURCES: nvmlReturn_t =
        nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_RESOURCES;
}

/// What an entry point's body returns; `Err` carries the NVML error code.
pub type Result<T = ()> = std::result::Result<T, nvmlReturn_t>;

/// The fixture file, read when the library goes from uninitialised to initialised.
pub const FIXTURE_ENV: &str = "DEVICELET_FAKE_NVML";
/// The control file, optional.
pub const CONTROL_ENV: &str = "DEVICELET_FAKE_NVML_CONTROL";

/// Without the variables, the files of these names beside the library itself: a test that copies
/// the library into a directory of its own gets a node of its own, even in a process where other
/// tests load other copies at the same time (environment variables are process-wide).
pub const FIXTURE_FILE: &str = "nvml.json";
pub const CONTROL_FILE: &str = "nvml.control";

/// The path `env` names, else `file` in the directory this library was loaded from.
fn configured(env: &str, file: &str) -> Option<PathBuf> {
    if let Some(path) = std::env::var_os(env) {
        return Some(PathBuf::from(path));
    }
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: dladdr only reads the loader's tables; the address is a function of this library.
    let found = unsafe { libc::dladdr(configured as *const libc::c_void, &mut info) };
    if found == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dladdr gave a NUL-terminated path owned by the loader, valid while loaded.
    let library = unsafe { std::ffi::CStr::from_ptr(info.dli_fname) };
    let library = std::path::Path::new(std::ffi::OsStr::from_bytes(library.to_bytes()));
    Some(library.parent()?.join(file))
}

/// How often blocked calls (hung queries, event waits) look at the control file again.
pub const POLL: Duration = Duration::from_millis(5);

/// The event types the fake can deliver (and reports as supported).
pub const SUPPORTED_EVENTS: u64 = (nvmlEventTypeXidCriticalError
    | nvmlEventTypeDoubleBitEccError
    | nvmlEventTypeSingleBitEccError) as u64;

/// Device handles are small non-null integers, `HANDLE_BASE + gpu * HANDLE_STRIDE + slot`,
/// where slot 0 is the GPU itself and slot `m + 1` its MIG device `m`: the host can compare
/// and hash them as real NVML handles, and anything else is recognisably invalid.
const HANDLE_BASE: usize = 0x1000;
const HANDLE_STRIDE: usize = 0x100;
/// Event-set handles live above every device handle (`fixture::MAX_GPUS` bounds those).
const SET_BASE: usize = 0x10_0000;

/// A valid device handle, decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dev {
    pub gpu: usize,
    pub mig: Option<usize>,
}

impl Dev {
    pub fn handle(self) -> nvmlDevice_t {
        let slot = self.mig.map_or(0, |m| m + 1);
        std::ptr::without_provenance_mut(HANDLE_BASE + self.gpu * HANDLE_STRIDE + slot)
    }
}

/// An event injected through the control file.
#[derive(Debug, Clone, Copy)]
pub struct Event {
    pub gpu: usize,
    pub kind: u64,
    pub data: u64,
    /// The MIG instance (GPU instance, compute instance) it was raised in, if any.
    pub instance: Option<(u32, u32)>,
}

/// An event set: what it listens to, and how far into the event log it has looked.
#[derive(Debug, Default)]
pub struct EventSet {
    /// `(gpu, event types, first log index it may receive)`: a set sees only events injected
    /// after it registered the GPU, as with real NVML.
    watches: Vec<(usize, u64, usize)>,
    cursor: usize,
}

#[derive(Debug, Default)]
pub struct State {
    /// `nvmlInit` minus `nvmlShutdown` calls; 0 is uninitialised.
    refs: u32,
    pub fixture: Option<Fixture>,
    control: Control,
    lost: Vec<bool>,
    hung: bool,
    /// Each GPU's MIG instances now, and where they are kept between processes (see `mig.rs`).
    pub migs: crate::mig::Instances,
    /// Set by `hang-after-create`: the next compute instance made blocks its caller afterwards.
    pub hang_after_create: bool,
    /// Every event injected since `nvmlInit`; sets keep their own cursors into it.
    log: Vec<Event>,
    sets: HashMap<usize, EventSet>,
    next_set: usize,
}

static STATE: LazyLock<Mutex<State>> = LazyLock::new(Mutex::default);

/// The state, whatever a panicking thread left (no code path panics while holding it, and a
/// poisoned fake is more useful than an aborting one).
fn lock() -> MutexGuard<'static, State> {
    STATE.lock().unwrap_or_else(PoisonError::into_inner)
}

/// `nvmlInit`: the first call (re)reads the fixture and control file, so one process can see
/// several fixtures in turn; later calls only count.
pub fn init() -> nvmlReturn_t {
    let mut state = lock();
    if state.refs > 0 {
        state.refs = state.refs.saturating_add(1);
        state.poll();
        return code::SUCCESS;
    }
    let path = configured(FIXTURE_ENV, FIXTURE_FILE);
    let Some(fixture) = path.as_deref().and_then(Fixture::load) else {
        return code::DRIVER_NOT_LOADED;
    };
    match fixture.init {
        InitMode::Ok if fixture.init_delay_ms > 0 => {
            drop(state);
            std::thread::sleep(Duration::from_millis(fixture.init_delay_ms));
            state = lock();
        }
        InitMode::Ok => {}
        InitMode::DriverNotLoaded => return code::DRIVER_NOT_LOADED,
        InitMode::NoPermission => return code::NO_PERMISSION,
        InitMode::Hang => {
            drop(state);
            loop {
                std::thread::sleep(Duration::from_secs(3600));
            }
        }
    }
    *state = State {
        refs: 1,
        lost: vec![false; fixture.gpus.len()],
        migs: crate::mig::Instances::load(path.as_deref(), &fixture),
        fixture: Some(fixture),
        control: Control::new(configured(CONTROL_ENV, CONTROL_FILE)),
        ..State::default()
    };
    state.poll();
    code::SUCCESS
}

/// `nvmlShutdown`.
pub fn shutdown() -> nvmlReturn_t {
    let mut state = lock();
    if state.refs == 0 {
        return code::UNINITIALIZED;
    }
    state.refs -= 1;
    code::SUCCESS
}

/// Runs `body` on the state if the library is initialised, after applying new control lines.
pub fn call(body: impl FnOnce(&mut State) -> Result) -> nvmlReturn_t {
    let mut state = lock();
    if state.refs == 0 {
        return code::UNINITIALIZED;
    }
    state.poll();
    result(body(&mut state))
}

/// Like [`call`], for device queries: while the node is hung, waits (without the lock, so
/// other threads and the control file go on) until it is not.
pub fn device_call(body: impl FnOnce(&mut State) -> Result) -> nvmlReturn_t {
    loop {
        let mut state = lock();
        if state.refs == 0 {
            return code::UNINITIALIZED;
        }
        state.poll();
        if !state.hung {
            return result(body(&mut state));
        }
        drop(state);
        std::thread::sleep(POLL);
    }
}

/// Blocks (without the lock, applying control lines) while `until_not` holds.
pub fn wait_while(until_not: impl Fn(&State) -> bool) {
    loop {
        let mut state = lock();
        state.poll();
        if !until_not(&state) {
            return;
        }
        drop(state);
        std::thread::sleep(POLL);
    }
}

fn result(r: Result) -> nvmlReturn_t {
    r.err().unwrap_or(code::SUCCESS)
}

impl State {
    fn gpus(&self) -> &[Gpu] {
        self.fixture.as_ref().map_or(&[], |f| &f.gpus)
    }

    pub fn driver_version(&self) -> &str {
        self.fixture.as_ref().map_or("", |f| &f.driver_version)
    }

    pub fn count(&self) -> usize {
        self.gpus().len()
    }

    /// Applies the control lines written since the last look.
    pub fn poll(&mut self) {
        for line in self.control.read_new() {
            match control::parse(&line, self.count()) {
                Some(Command::Xid(gpu, code)) => {
                    self.push(gpu, nvmlEventTypeXidCriticalError, code)
                }
                Some(Command::MigXid(gpu, code, gi, ci)) => {
                    self.push_in(gpu, nvmlEventTypeXidCriticalError, code, Some((gi, ci)))
                }
                Some(Command::Dbe(gpu)) => self.push(gpu, nvmlEventTypeDoubleBitEccError, 0),
                Some(Command::Lost(gpu)) => self.lost[gpu] = true,
                Some(Command::Found(gpu)) => self.lost[gpu] = false,
                Some(Command::Hang) => self.hung = true,
                Some(Command::Unhang) => self.hung = false,
                Some(Command::HangAfterCreate) => self.hang_after_create = true,
                Some(Command::CreateReturns) => self.hang_after_create = false,
                None => eprintln!("fake-nvml: ignoring control line {line:?}"),
            }
        }
    }

    fn push(&mut self, gpu: usize, kind: u32, data: u64) {
        self.push_in(gpu, kind, data, None);
    }

    fn push_in(&mut self, gpu: usize, kind: u32, data: u64, instance: Option<(u32, u32)>) {
        let kind = u64::from(kind);
        self.log.push(Event {
            gpu,
            kind,
            data,
            instance,
        });
    }

    /// The GPU with fixture index `index`, if it is reachable.
    pub fn by_index(&self, index: usize) -> Result<Dev> {
        if index >= self.count() {
            return Err(code::INVALID_ARGUMENT);
        }
        self.reachable(Dev {
            gpu: index,
            mig: None,
        })
    }

    /// Decodes a device handle: `INVALID_ARGUMENT` unless it is one this node handed out,
    /// `GPU_IS_LOST` if its GPU fell off the bus.
    pub fn device(&self, handle: nvmlDevice_t) -> Result<Dev> {
        let offset = handle
            .addr()
            .checked_sub(HANDLE_BASE)
            .ok_or(code::INVALID_ARGUMENT)?;
        let gpu = offset / HANDLE_STRIDE;
        let mig = match offset % HANDLE_STRIDE {
            0 => None,
            slot => Some(slot - 1),
        };
        let exists = gpu < self.count() && mig.is_none_or(|m| m < self.mig_devices(gpu).count());
        if !exists {
            return Err(code::INVALID_ARGUMENT);
        }
        self.reachable(Dev { gpu, mig })
    }

    fn reachable(&self, dev: Dev) -> Result<Dev> {
        if self.lost[dev.gpu] {
            return Err(code::GPU_IS_LOST);
        }
        Ok(dev)
    }

    /// A full GPU handle (not a MIG device), else `error`.
    pub fn physical(&self, handle: nvmlDevice_t, error: nvmlReturn_t) -> Result<Dev> {
        let dev = self.device(handle)?;
        if dev.mig.is_some() {
            return Err(error);
        }
        Ok(dev)
    }

    pub fn gpu(&self, dev: Dev) -> &Gpu {
        &self.gpus()[dev.gpu]
    }

    pub fn mig(&self, dev: Dev) -> Option<&MigDevice> {
        self.mig_devices(dev.gpu).nth(dev.mig?)
    }

    /// The MIG devices NVML exposes for GPU `gpu`: none unless MIG mode is enabled, and only
    /// instances with a compute instance.
    pub fn mig_devices(&self, gpu: usize) -> impl Iterator<Item = &MigDevice> {
        let enabled = self.gpus().get(gpu).is_some_and(Gpu::mig_enabled);
        self.migs.of(gpu).iter().filter(move |m| enabled && !m.bare)
    }

    /// Finds a GPU or MIG device by UUID.
    pub fn by_uuid(&self, uuid: &str) -> Result<Dev> {
        for (gpu, g) in self.gpus().iter().enumerate() {
            if g.uuid == uuid {
                return self.reachable(Dev { gpu, mig: None });
            }
            if let Some(m) = self.mig_devices(gpu).position(|m| m.uuid == uuid) {
                return self.reachable(Dev { gpu, mig: Some(m) });
            }
        }
        Err(code::NOT_FOUND)
    }

    pub fn create_set(&mut self) -> nvmlEventSet_t {
        let id = self.next_set;
        self.next_set += 1;
        self.sets.insert(id, EventSet::default());
        std::ptr::without_provenance_mut(SET_BASE + id)
    }

    fn set_id(&self, set: nvmlEventSet_t) -> Result<usize> {
        set.addr()
            .checked_sub(SET_BASE)
            .filter(|id| self.sets.contains_key(id))
            .ok_or(code::INVALID_ARGUMENT)
    }

    pub fn free_set(&mut self, set: nvmlEventSet_t) -> Result {
        let id = self.set_id(set)?;
        self.sets.remove(&id);
        Ok(())
    }

    /// Registers `types` events of `dev` with `set`, from the next injected event on.
    pub fn register(&mut self, dev: Dev, types: u64, set: nvmlEventSet_t) -> Result {
        let id = self.set_id(set)?;
        let from = self.log.len();
        if let Some(set) = self.sets.get_mut(&id) {
            set.watches.push((dev.gpu, types, from));
        }
        Ok(())
    }

    /// The next event `set` has not yet delivered, if one was injected.
    /// The next event the set watches, once every earlier one is delivered; then, as NVML's
    /// wait does, `GPU_IS_LOST` while a GPU the set watches is lost (without saying which).
    pub fn next_event(&mut self, set: nvmlEventSet_t) -> Result<Option<Event>> {
        let id = self.set_id(set)?;
        let (log, lost) = (&self.log, &self.lost);
        let Some(set) = self.sets.get_mut(&id) else {
            return Err(code::INVALID_ARGUMENT);
        };
        while let Some(&event) = log.get(set.cursor) {
            let index = set.cursor;
            set.cursor += 1;
            let wanted = set.watches.iter().any(|&(gpu, types, from)| {
                gpu == event.gpu && types & event.kind != 0 && index >= from
            });
            if wanted {
                return Ok(Some(event));
            }
        }
        if set.watches.iter().any(|&(gpu, _, _)| lost[gpu]) {
            return Err(code::GPU_IS_LOST);
        }
        Ok(None)
    }
}

/// An out-pointer from the caller, checked for null once at the boundary.
pub struct Out<T>(NonNull<T>);

impl<T> Out<T> {
    /// `INVALID_ARGUMENT` when `ptr` is null.
    ///
    /// # Safety
    /// `ptr` is null or valid for reads and writes of a `T` until the entry point returns
    /// (nvml.h's contract for every out-parameter).
    pub unsafe fn new(ptr: *mut T) -> Result<Out<T>> {
        NonNull::new(ptr).map(Out).ok_or(code::INVALID_ARGUMENT)
    }

    pub fn set(self, value: T) -> Result {
        // SAFETY: valid for writes, per `new`'s contract.
        unsafe { self.0.write(value) };
        Ok(())
    }

    pub fn get(&self) -> T
    where
        T: Copy,
    {
        // SAFETY: valid for reads, per `new`'s contract; NVML in-out structs are plain data.
        unsafe { self.0.read() }
    }
}

/// A caller's `char *buf, unsigned int length` pair.
pub struct OutStr<'a>(&'a mut [c_char]);

impl OutStr<'_> {
    /// `INVALID_ARGUMENT` when `ptr` is null.
    ///
    /// # Safety
    /// `ptr` is null or valid for writes of `len` chars until the entry point returns.
    pub unsafe fn new<'a>(ptr: *mut c_char, len: u32) -> Result<OutStr<'a>> {
        if ptr.is_null() {
            return Err(code::INVALID_ARGUMENT);
        }
        // SAFETY: non-null and valid for `len` chars, per the contract.
        Ok(OutStr(unsafe {
            std::slice::from_raw_parts_mut(ptr, len as usize)
        }))
    }

    /// Writes `value` and its NUL; `INSUFFICIENT_SIZE` when the buffer is too small.
    pub fn set(self, value: &str) -> Result {
        copy_cstr(self.0, value).map_err(|_| code::INSUFFICIENT_SIZE)
    }
}

/// Copies `value` and a NUL into `buf`; `UNKNOWN` when it does not fit.
pub fn copy_cstr(buf: &mut [c_char], value: &str) -> Result {
    let bytes = value.as_bytes();
    if bytes.len() >= buf.len() {
        return Err(code::UNKNOWN);
    }
    for (dst, &src) in buf.iter_mut().zip(bytes) {
        *dst = src as c_char;
    }
    buf[bytes.len()] = 0;
    Ok(())
}

/// The PCI info NVML reports for bus id `id`; `UNKNOWN` when the fixture's string is not one.
pub fn pci_info(id: &str) -> Result<nvmlPciInfo_t> {
    let parsed = fixture::parse_bus_id(id).ok_or(code::UNKNOWN)?;
    let mut info = nvmlPciInfo_t {
        busIdLegacy: [0; NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE as usize],
        domain: parsed.domain,
        bus: parsed.bus,
        device: parsed.device,
        pciDeviceId: 0,
        pciSubSystemId: 0,
        busId: [0; NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE as usize],
    };
    copy_cstr(&mut info.busId, id)?;
    // The legacy form drops the domain's upper digits: `0000:07:00.0`.
    let legacy = id.get(id.len().saturating_sub(12)..).ok_or(code::UNKNOWN)?;
    copy_cstr(&mut info.busIdLegacy, legacy)?;
    Ok(info)
}
