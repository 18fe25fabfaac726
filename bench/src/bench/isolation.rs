//! Benchmark 8: a healthy module's Allocate while two other modules on the same agent keep their
//! cells busy (enumerate spinning until its health deadline), beside the same agent with the two
//! modules idle. What it shows: no queue and no shared worker between modules; what is left is
//! CPU contention on this machine.

use std::time::Duration;

use super::Settings;
use super::node::{Node, generic_dev, resource};
use super::report::Row;
use super::stats::{self, Samples};
use devicelet::kubelet::api::deviceplugin::{AllocateRequest, ContainerAllocateRequest};
use devicelet_simulator::SimConfig;

/// How long each spinning enumeration runs before its deadline; the busy phase fits inside it.
const SPIN: &str = "5s";
const SWITCH: &str = "/sys/testing/switch";

fn spinner(s: &Settings, name: &str) -> String {
    format!(
        r#"[[module]]
name = "{name}"
path = "{}"
health-interval = "100ms"
health-deadline = "{SPIN}"

[module.grants]
sysfs = ["/sys/testing"]

[module.config]
resource = "{name}"
switch = "{SWITCH}"

"#,
        s.module_dir.join("misbehaving.wasm").display()
    )
}

pub async fn run(s: &Settings) -> anyhow::Result<Vec<Row>> {
    let node = Node::start(SimConfig::default()).await?;
    node.add_fuses()?;
    let registry = node.registry(&format!(
        "{}{}{}",
        generic_dev(&s.module_dir, "generic-dev", "fuse", "/dev/fuse-*", "5s"),
        spinner(s, "stuck-a"),
        spinner(s, "stuck-b"),
    ))?;
    let agent = node.start_agent(&registry, None).await?;
    let name = resource("fuse");
    for r in [&name, &resource("stuck-a"), &resource("stuck-b")] {
        node.wait_served(r).await?;
    }
    let mut client = node.client(&name).await?;
    let request = AllocateRequest {
        container_requests: vec![ContainerAllocateRequest {
            devices_ids: vec!["fuse-0".into()],
        }],
    };
    let calls = s.n(4_000);
    let mut idle = Vec::new();
    super::allocate::measure(&mut client, &request, s.n(1_000), &mut Vec::new()).await?;
    super::allocate::measure(&mut client, &request, calls, &mut idle).await?;

    // Both spinners start an enumeration that spins for SPIN within a health interval.
    node.tree.write_file(SWITCH, "loop")?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut busy = Vec::new();
    let started = std::time::Instant::now();
    super::allocate::measure(&mut client, &request, calls, &mut busy).await?;
    let measured_in = started.elapsed();
    std::fs::remove_file(node.tree.path(SWITCH))?;
    let deadlines: u64 = agent
        .status()
        .modules
        .iter()
        .map(|m| m.stats.deadlines)
        .sum();
    // Let the spins end before the next benchmark runs on this machine.
    tokio::time::sleep(Duration::from_secs(6)).await;
    drop(client);
    agent.shutdown().await;

    let (idle, busy) = (Samples::new(idle), Samples::new(busy));
    let ratio = stats::div(busy.p50(), idle.p50());
    let p99_ratio = stats::div(busy.p99(), idle.p99());
    Ok(vec![
        Row::info(
            format!(
                "8. Allocate on generic-dev, two other modules idle ({} calls)",
                idle.count()
            ),
            idle.summary(true),
        ),
        Row::judged(
            format!(
                "8. Allocate on generic-dev while two other modules spin in enumerate until \
                 their {SPIN} health deadline ({} calls in {measured_in:.1?}; {deadlines} \
                 deadlines hit before the busy phase ended)",
                busy.count()
            ),
            busy.summary(true),
            "p99 ≤ 1 ms",
            busy.p99() <= Duration::from_millis(1),
        ),
        Row::judged(
            "8. Allocate with two modules busy ÷ idle (p50, p99)",
            format!("{} / {}", stats::ratio(ratio), stats::ratio(p99_ratio)),
            "p50 ≤ 1.2×",
            ratio <= 1.2,
        ),
    ])
}
