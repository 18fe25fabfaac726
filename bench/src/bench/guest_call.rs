//! Benchmark 7: Guest call overhead: one `allocate` into generic-dev from the host, in this
//! process. Measured twice: through [`devicelet::sandbox::ModuleHandle::allocate`] (the module's
//! kubelet cell: channel, deadline, answer validation, what every gRPC call goes through), and as
//! the bare wasmtime call on an instance made the way a cell makes one, which separates wasm from
//! the rest.

use std::time::{Duration, Instant};

use anyhow::Context;

use super::Settings;
use super::node::Node;
use super::report::Row;
use super::stats::Samples;
use devicelet::agent::start_module;
use devicelet::config::Registry;
use devicelet::sandbox::checks;
use devicelet::sandbox::engine;
use devicelet::sandbox::loader::load;
use devicelet::sandbox::module::instantiate;
use devicelet_simulator::SimConfig;

const CALLS: usize = 10_000;
const WARMUP: usize = 1_000;

pub async fn run(s: &Settings) -> anyhow::Result<Vec<Row>> {
    let node = Node::start(SimConfig::default()).await?;
    let registry = Registry::load(&node.fuse_registry(&s.module_dir)?)?;
    let spec = registry.modules.first().context("no module")?;
    let engine = engine::new_engine().map_err(|e| anyhow::anyhow!("{e:#}"))?;
    let ids = vec!["fuse-0".to_owned()];

    let handle = start_module(
        &engine,
        None,
        spec,
        &registry.host_root,
        (&Default::default(), None),
        None,
    )
    .await?;
    let mut through_cell = Vec::new();
    for i in 0..s.n(WARMUP) + s.n(CALLS) {
        let started = Instant::now();
        let edits = handle.allocate(fuse_request(&ids)).await?;
        let took = started.elapsed();
        std::hint::black_box(edits);
        if i >= s.n(WARMUP) {
            through_cell.push(took);
        }
    }
    let through_cell = Samples::new(through_cell);

    // Resolving the answer's device node beneath the grants, alone.
    let answer = handle.allocate(fuse_request(&ids)).await?;
    let mut resolving = Vec::with_capacity(s.n(CALLS));
    for _ in 0..s.n(CALLS) {
        let mut edits = answer.clone();
        for d in &mut edits.devices {
            d.host_path = d
                .host_path
                .strip_prefix(&registry.host_root.display().to_string())
                .unwrap_or(&d.host_path)
                .to_owned();
        }
        let started = Instant::now();
        checks::resolve_edits(&mut edits, &spec.grants, &registry.host_root)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        resolving.push(started.elapsed());
    }
    let resolving = Samples::new(resolving);

    let bare = bare_calls(s, &engine, spec, &registry, &ids).await?;
    Ok(vec![
        Row::info(
            format!(
                "7. Guest call: host → generic-dev `allocate` through the module's cell, from \
                 the agent's runtime as its servers call it (`ModuleHandle::allocate`; {} calls)",
                through_cell.count()
            ),
            through_cell.summary(false),
        ),
        Row::info(
            format!(
                "7. Resolving the answer's device node beneath the /dev grants, alone ({} calls)",
                resolving.count()
            ),
            resolving.summary(false),
        ),
        Row::info(
            format!(
                "7. Guest call: the bare wasmtime `call_allocate` on a store of our own ({} calls)",
                bare.count()
            ),
            bare.summary(false),
        ),
    ])
}

/// The same call straight into wasmtime on an instance made as a cell makes one: no cell,
/// channel or validation.
async fn bare_calls(
    s: &Settings,
    engine: &devicelet::sandbox::engine::Engine,
    spec: &devicelet::config::ModuleSpec,
    registry: &Registry,
    ids: &[String],
) -> anyhow::Result<Samples> {
    let loaded = load(engine, None, spec, &registry.host_root, &Default::default())?;
    let mut instance = instantiate(
        &loaded,
        &devicelet::device::InitContext {
            config: spec.config.to_string(),
            resource_domain: spec.resource_domain.clone(),
            // As a cell's instance is told, after the module's first one declared it.
            served_as: vec![("fuse".into(), format!("{}/fuse", spec.resource_domain))],
        },
    )
    .await
    .map_err(|e| anyhow::anyhow!("instantiating: {e:?}"))?;
    let mut samples: Vec<Duration> = Vec::new();
    for i in 0..s.n(WARMUP) + s.n(CALLS) {
        let started = Instant::now();
        let edits = instance.allocate_bare("fuse", ids).await?;
        let took = started.elapsed();
        std::hint::black_box(edits);
        if i >= s.n(WARMUP) {
            samples.push(took);
        }
    }
    Ok(Samples::new(samples))
}

/// An Allocate of `ids` of the fuse resource, as the device-plugin front end asks.
fn fuse_request(ids: &[String]) -> devicelet::device::Request {
    devicelet::device::Request::without_config("fuse", ids.to_vec())
}
