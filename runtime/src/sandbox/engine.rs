//! The one wasmtime engine all modules share, and the epoch ticker that bounds their calls.

use std::time::Duration;

use wasmtime::Config;
pub use wasmtime::Engine;

/// How often the epoch advances. A running guest yields to the async runtime at every tick, so
/// a call's deadline is enforced with at most this much delay.
pub const EPOCH_TICK: Duration = Duration::from_millis(10);

/// Builds the engine and starts its epoch ticker. The ticker thread holds only a weak reference
/// and ends when the last clone of the engine is dropped.
pub fn new_engine() -> wasmtime::Result<Engine> {
    let mut config = Config::new();
    config.wasm_component_model(true);
    config.epoch_interruption(true);
    let engine = Engine::new(&config)?;
    let weak = engine.weak();
    std::thread::Builder::new()
        .name("devicelet-epoch".into())
        .spawn(move || {
            while let Some(engine) = weak.upgrade() {
                engine.increment_epoch();
                drop(engine);
                std::thread::sleep(EPOCH_TICK);
            }
        })
        .map_err(wasmtime::Error::from)?;
    Ok(engine)
}
