//! Benchmark 7: Guest call overhead: one `allocate` into generic-dev from the host, in this
//! process. Measured twice: through [`crate::sandbox::ModuleHandle::allocate`] (the module's
//! actor: queue, deadline, answer validation, what every gRPC call goes through), and as the bare
//! wasmtime call on a store of our own (instantiated the way the actor does it), which separates
//! wasm from the rest.

use std::time::{Duration, Instant};

use anyhow::Context;
use wasmtime::{Store, StoreLimitsBuilder};

use super::Settings;
use super::node::Node;
use super::report::Row;
use super::stats::Samples;
use crate::agent::start_module;
use crate::config::Registry;
use crate::kubelet::simulator::SimConfig;
use crate::sandbox::engine;
use crate::sandbox::host::HostState;
use crate::sandbox::loader::load;

const CALLS: usize = 10_000;
const WARMUP: usize = 1_000;

pub async fn run(s: &Settings) -> anyhow::Result<Vec<Row>> {
    let node = Node::start(SimConfig::default()).await?;
    let registry = Registry::load(&node.fuse_registry(&s.module_dir)?)?;
    let spec = registry.modules.first().context("no module")?;
    let engine = engine::new_engine().map_err(|e| anyhow::anyhow!("{e:#}"))?;
    let ids = vec!["fuse-0".to_owned()];

    let handle = start_module(&engine, None, spec, &registry.host_root).await?;
    let mut through_actor = Vec::new();
    for i in 0..s.n(WARMUP) + s.n(CALLS) {
        let started = Instant::now();
        let edits = handle.allocate("fuse", ids.clone()).await?;
        let took = started.elapsed();
        std::hint::black_box(edits);
        if i >= s.n(WARMUP) {
            through_actor.push(took);
        }
    }
    let through_actor = Samples::new(through_actor);

    let bare = bare_calls(s, &engine, spec, &registry, &ids).await?;
    Ok(vec![
        Row::info(
            format!(
                "7. Guest call: host → generic-dev `allocate` through the module's actor \
                 (`ModuleHandle::allocate`; {} calls)",
                through_actor.len()
            ),
            through_actor.summary(false),
        ),
        Row::info(
            format!(
                "7. Guest call: the bare wasmtime `call_allocate` on a store of our own ({} calls)",
                bare.len()
            ),
            bare.summary(false),
        ),
    ])
}

/// The same call straight into wasmtime, no actor, channel or validation.
async fn bare_calls(
    s: &Settings,
    engine: &wasmtime::Engine,
    spec: &crate::config::ModuleSpec,
    registry: &Registry,
    ids: &[String],
) -> anyhow::Result<Samples> {
    let loaded = load(engine, None, spec, &registry.host_root)?;
    let limits = StoreLimitsBuilder::new()
        .memory_size(usize::try_from(spec.memory_limit).unwrap_or(usize::MAX))
        .trap_on_grow_failure(true)
        .build();
    let state = HostState::new(
        loaded.name.clone(),
        loaded.host_root.clone(),
        loaded.grants.clone(),
        limits,
    );
    let mut store = Store::new(engine, state);
    store.limiter(|s| &mut s.limits);
    store.set_epoch_deadline(1);
    store.epoch_deadline_async_yield_and_update(1);
    let plugin = loaded.pre.instantiate_async(&mut store).await?;
    let guest = plugin.devicelet_plugin_plugin();
    guest
        .call_init(&mut store, &spec.config.to_string())
        .await?
        .map_err(|e| anyhow::anyhow!("init: {e:?}"))?;
    let mut samples: Vec<Duration> = Vec::new();
    for i in 0..s.n(WARMUP) + s.n(CALLS) {
        let started = Instant::now();
        let edits = guest.call_allocate(&mut store, "fuse", ids).await?;
        let took = started.elapsed();
        std::hint::black_box(edits.map_err(|e| anyhow::anyhow!("allocate: {e:?}"))?);
        if i >= s.n(WARMUP) {
            samples.push(took);
        }
    }
    Ok(Samples::new(samples))
}
