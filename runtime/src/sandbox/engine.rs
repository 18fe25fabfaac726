//! The one wasmtime engine all modules share, and the epoch ticker that bounds their calls.
//!
//! The ticker runs only while some guest code may run: every entry into a guest holds a
//! [`Ticking`] guard, and with none held the ticker thread parks, so an idle agent wakes for
//! nothing (a 10 ms tick is a hundred wake-ups a second on every node).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::Thread;
use std::time::Duration;

pub use wasmtime::Engine;
use wasmtime::{Config, EngineWeak};

/// How often the epoch advances. A running guest yields to the async runtime at every tick, so
/// a call's deadline is enforced with at most this much delay.
pub const EPOCH_TICK: Duration = Duration::from_millis(10);

/// The process's ticker: the engines it advances and how many guest entries are under way.
struct Ticker {
    engines: Mutex<Vec<EngineWeak>>,
    running: AtomicUsize,
    thread: Thread,
}

static TICKER: OnceLock<Ticker> = OnceLock::new();

fn ticker() -> std::io::Result<&'static Ticker> {
    if let Some(ticker) = TICKER.get() {
        return Ok(ticker);
    }
    // Two callers may race to start it; the loser's thread finds another ticker installed and
    // ends.
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let handle = std::thread::Builder::new()
        .name("devicelet-epoch".into())
        .spawn(move || {
            // Told to go on only if its ticker is the one installed; the loser's sender is
            // dropped and its thread ends here.
            if rx.recv().is_ok() {
                tick_forever();
            }
        })?;
    let mine = Ticker {
        engines: Mutex::default(),
        running: AtomicUsize::new(0),
        thread: handle.thread().clone(),
    };
    let installed = TICKER.get_or_init(|| mine);
    if installed.thread.id() == handle.thread().id() {
        let _ = tx.send(());
    }
    Ok(installed)
}

fn tick_forever() {
    let Some(ticker) = TICKER.get() else { return };
    loop {
        if ticker.running.load(Ordering::Acquire) == 0 {
            // An entry that starts now unparks us; one that started just before has left the
            // token, so this returns at once.
            std::thread::park();
            continue;
        }
        {
            let mut engines = ticker.engines.lock().unwrap_or_else(|p| p.into_inner());
            engines.retain(|weak| match weak.upgrade() {
                Some(engine) => {
                    engine.increment_epoch();
                    true
                }
                None => false,
            });
        }
        std::thread::sleep(EPOCH_TICK);
    }
}

/// Held while guest code may run: keeps the epoch advancing, so the guest yields and its
/// deadline can fire.
pub struct Ticking(Disarm);

impl Ticking {
    /// A handle that lets the entry stop counting before the guard is dropped: a cell abandoned
    /// while stuck in a host call must not keep the ticker running for a thread that may never
    /// come back.
    pub fn disarmer(&self) -> Disarm {
        self.0.clone()
    }
}

impl Drop for Ticking {
    fn drop(&mut self) {
        self.0.disarm();
    }
}

/// Ends one guest entry's claim on the ticker, once.
#[derive(Clone)]
pub struct Disarm {
    ticker: &'static Ticker,
    armed: Arc<AtomicBool>,
}

impl Disarm {
    pub fn disarm(&self) {
        if self.armed.swap(false, Ordering::AcqRel) {
            self.ticker.running.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// Starts the ticker for a guest entry, if it is idle.
pub fn ticking() -> Option<Ticking> {
    let ticker = TICKER.get()?;
    if ticker.running.fetch_add(1, Ordering::AcqRel) == 0 {
        ticker.thread.unpark();
    }
    Some(Ticking(Disarm {
        ticker,
        armed: Arc::new(AtomicBool::new(true)),
    }))
}

/// Builds the engine and registers it with the process's epoch ticker.
pub fn new_engine() -> wasmtime::Result<Engine> {
    let mut config = Config::new();
    config.wasm_component_model(true);
    config.epoch_interruption(true);
    let engine = Engine::new(&config)?;
    let ticker = ticker().map_err(wasmtime::Error::from)?;
    ticker
        .engines
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(engine.weak());
    Ok(engine)
}
