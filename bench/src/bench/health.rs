//! Benchmark 5: Health change → new ListAndWatch snapshot at the kubelet: a fixture device node
//! appears or disappears, and the clock runs until the simulated kubelet's device set shows it.
//! The agent re-enumerates at once on inotify events under the module's /dev grants; the
//! `health-interval` is the default 5 s, so a figure far below it can only come from that path.

use std::time::{Duration, Instant};

use super::Settings;
use super::node::{Node, WAIT, generic_dev, resource};
use super::report::Row;
use super::stats::{Samples, duration};
use devicelet_simulator::SimConfig;

const INTERVAL: Duration = Duration::from_secs(5);
const CHANGES: u32 = 50;
const TARGET: Duration = Duration::from_millis(100);

pub async fn run(s: &Settings) -> anyhow::Result<Vec<Row>> {
    let node = Node::start(SimConfig::default()).await?;
    node.add_char("/dev/hc0", 240, 0)?;
    let registry = node.registry(&generic_dev(
        &s.module_dir,
        "generic-dev",
        "hc",
        "/dev/hc*",
        &format!("{}s", INTERVAL.as_secs()),
    ))?;
    let agent = node.start_agent(&registry, None).await?;
    let name = resource("hc");
    node.wait_served(&name).await?;
    let changes = s.n(CHANGES as usize) as u32;
    let mut samples = Vec::new();
    for i in 0..changes {
        // Let the previous change's re-enumeration settle.
        tokio::time::sleep(Duration::from_millis(20)).await;
        let plug = i % 2 == 0;
        let started = Instant::now();
        if plug {
            node.add_char("/dev/hc1", 240, 1)?;
        } else {
            node.tree.remove("/dev/hc1")?;
        }
        let want = if plug { 2 } else { 1 };
        node.sim
            .wait_until(&name, WAIT, |r| r.capacity == want)
            .await?;
        samples.push(started.elapsed());
    }
    agent.shutdown().await;
    let samples = Samples::new(samples);
    Ok(vec![Row::judged(
        format!(
            "5. Health change (device node added/removed) → new snapshot at the kubelet, \
             health-interval {} ({} changes)",
            duration(INTERVAL),
            samples.count()
        ),
        samples.summary(false),
        format!("p50 ≤ {}", duration(TARGET)),
        samples.p50() <= TARGET,
    )])
}
