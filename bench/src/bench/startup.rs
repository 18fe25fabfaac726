//! Benchmark 3: Start-up: from spawning `devicelet run` to the simulated kubelet having every
//! resource registered with a first ListAndWatch snapshot, for 1 and 10 modules, with a cold
//! compile cache (a new, empty directory) and a warm one (the same directory again), and a first
//! start on an empty state directory with the modules precompiled, as the image carries them
//! (`--precompiled-dir`: here the warm cache of the same modules, which has the same layout).

use std::path::Path;
use std::time::Duration;

use super::Settings;
use super::node::{Node, fuse_modules};
use super::process::{AgentDirs, AgentProcess, wait_all};
use super::report::Row;
use super::stats::{Samples, duration};
use devicelet_simulator::SimConfig;

const REPEATS: usize = 5;

pub async fn run(s: &Settings) -> anyhow::Result<Vec<Row>> {
    let caches = tempfile::tempdir()?;
    let mut rows = Vec::new();
    for (modules, target) in [
        (1, Duration::from_millis(30)),
        (10, Duration::from_millis(100)),
    ] {
        let (mut cold, mut warm, mut seeded) = (Vec::new(), Vec::new(), Vec::new());
        for rep in 0..s.repeats(REPEATS) {
            let cache = caches.path().join(format!("cache-{modules}-{rep}"));
            cold.push(once(s, modules, &cache, None).await?);
            warm.push(once(s, modules, &cache, None).await?);
            let empty = caches.path().join(format!("empty-{modules}-{rep}"));
            seeded.push(once(s, modules, &empty, Some(&cache)).await?);
        }
        let (cold, warm, seeded) = (Samples::new(cold), Samples::new(warm), Samples::new(seeded));
        let what = |cache: &str| {
            format!(
                "3. Start-up, spawn → every resource registered with a snapshot: {modules} \
                 module{}, {cache} compile cache (median of {})",
                if modules == 1 { "" } else { "s" },
                warm.len()
            )
        };
        rows.push(Row::info(what("cold"), spread(&cold)));
        rows.push(Row::judged(
            what("warm"),
            spread(&warm),
            format!("≤ {}", duration(target)),
            warm.p50() <= target,
        ));
        rows.push(Row::judged(
            format!(
                "3. Start-up, spawn → every resource registered with a snapshot: {modules} \
                 module{}, empty compile cache and state, modules precompiled as the image \
                 carries them (its first start on a new node; median of {})",
                if modules == 1 { "" } else { "s" },
                seeded.len()
            ),
            format!("{}; {:.2}× warm", spread(&seeded), ratio(&seeded, &warm)),
            "≤ 2× warm (issue 35)".to_owned(),
            ratio(&seeded, &warm) <= 2.0,
        ));
    }
    Ok(rows)
}

/// `median 25.1 ms (21.0 ms – 30.2 ms)`.
pub(super) fn spread(s: &Samples) -> String {
    format!(
        "median {} ({} – {})",
        duration(s.p50()),
        duration(s.min()),
        duration(s.max())
    )
}

/// The median of `a` over the median of `b`.
fn ratio(a: &Samples, b: &Samples) -> f64 {
    a.p50().as_secs_f64() / b.p50().as_secs_f64()
}

/// One start of a fresh agent process with `modules` modules on a fresh node.
async fn once(
    s: &Settings,
    modules: usize,
    cache: &Path,
    precompiled: Option<&Path>,
) -> anyhow::Result<Duration> {
    let node = Node::start(SimConfig::default()).await?;
    node.add_fuses()?;
    let (entries, names) = fuse_modules(&s.module_dir, &node.dir.path().join("modules"), modules)?;
    let registry = node.registry(&entries)?;
    let dirs = AgentDirs {
        state: node.dir.path().join("state"),
        cache: cache.to_owned(),
        precompiled: precompiled.map(Path::to_owned),
    };
    let agent = AgentProcess::spawn(&s.devicelet, &node, &registry, &dirs)?;
    wait_all(&node, &agent, &names).await?;
    let took = agent.spawned_at.elapsed();
    agent.terminate().await?;
    Ok(took)
}
