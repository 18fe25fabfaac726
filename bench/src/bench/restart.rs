//! Benchmark 4: Kubelet restart → registered again: the simulated kubelet restarts (every socket in
//! the plugin directory deleted, a new `kubelet.sock`) and the clock runs from the moment the new
//! `kubelet.sock` exists until the resource is registered again with its ListAndWatch stream open
//! and a first snapshot received. Done with the simulator accepting at once and with its default
//! `accept_delay` (the new socket refuses connections for 50 ms, as between the kubelet's bind and
//! listen).

use std::time::{Duration, Instant};

use super::Settings;
use super::node::{Node, WAIT, resource};
use super::report::Row;
use super::stats::{Samples, duration};
use devicelet_simulator::SimConfig;

const RESTARTS: usize = 100;
const TARGET: Duration = Duration::from_millis(20);

pub async fn run(s: &Settings) -> anyhow::Result<Vec<Row>> {
    let mut rows = Vec::new();
    for accept_delay in [Duration::ZERO, SimConfig::default().accept_delay] {
        let samples = restarts(s, accept_delay).await?;
        // The agent cannot register before kubelet.sock accepts, so the target applies to the
        // time after that: the measured p50 less the configured delay.
        let beyond = samples.p50().saturating_sub(accept_delay);
        let (figure, target) = if accept_delay.is_zero() {
            (
                samples.summary(false),
                format!("p50 ≤ {}", duration(TARGET)),
            )
        } else {
            (
                format!(
                    "{} (p50 {} after it accepts)",
                    samples.summary(false),
                    duration(beyond)
                ),
                format!("p50 ≤ {} after kubelet.sock accepts", duration(TARGET)),
            )
        };
        rows.push(Row::judged(
            format!(
                "4. Kubelet restart → re-registered with a snapshot; the new kubelet.sock \
                 accepts after {} ms ({} restarts)",
                accept_delay.as_millis(),
                samples.count()
            ),
            figure,
            target,
            beyond <= TARGET,
        ));
    }
    Ok(rows)
}

async fn restarts(s: &Settings, accept_delay: Duration) -> anyhow::Result<Samples> {
    let node = Node::start(SimConfig {
        accept_delay,
        ..SimConfig::default()
    })
    .await?;
    let registry = node.fuse_registry(&s.module_dir)?;
    let agent = node.start_agent(&registry, None).await?;
    let name = resource("fuse");
    node.wait_served(&name).await?;
    let mut samples = Vec::new();
    for _ in 0..s.n(RESTARTS) {
        let before = node.sim.registrations(&name);
        node.sim.restart().await?;
        let kubelet_back = Instant::now();
        node.sim
            .wait_until(&name, WAIT, |r| {
                r.registrations > before && r.streaming && r.snapshots > 0
            })
            .await?;
        samples.push(kubelet_back.elapsed());
    }
    agent.shutdown().await;
    Ok(Samples::new(samples))
}
