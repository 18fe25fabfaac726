//! Benchmark 3: Start-up: from spawning `devicelet run` to the simulated kubelet having every
//! resource registered with a first ListAndWatch snapshot, for 1 and 10 modules, with a cold
//! compile cache and state directory (new, empty ones) and warm ones (the same directories
//! again: the agent restarted on its node), and a first start on an empty state directory with
//! the modules precompiled, as the image carries them (`--precompiled-dir`: here the warm cache
//! of the same modules, which has the same layout).
//! Beside them, the floor: a trivial tonic device plugin process (`devicelet-bench
//! plugin-process`) spawned and timed the same way; and, with `--fake-nvml`, nvidia-gpu serving
//! eight fake GPUs from a warm cache.

use std::path::Path;
use std::time::{Duration, Instant};

use super::Settings;
use super::node::{Node, fuse_modules, resource};
use super::nvidia;
use super::process::{AgentDirs, AgentProcess, wait_all};
use super::remote;
use super::report::Row;
use super::stats::{Samples, duration};
use devicelet_simulator::SimConfig;

const REPEATS: usize = 5;
/// Pairs of warm starts with `--compare`: start-up medians move by more than a change's gain
/// from one run to the next on a shared machine, so only interleaved samples compare.
const PAIRS: usize = 30;
/// Issue 35: a warm start of one module within this, and within [`FLOOR_RATIO`] of the floor.
const WARM_TARGET: Duration = Duration::from_millis(8);
const FLOOR_RATIO: f64 = 1.2;

pub async fn run(s: &Settings) -> anyhow::Result<Vec<Row>> {
    let caches = tempfile::tempdir()?;
    let mut floor = Vec::new();
    for _ in 0..s.repeats(REPEATS) {
        floor.push(floor_once().await?);
    }
    let floor = Samples::new(floor);
    let mut rows = vec![Row::info(
        format!(
            "3. Start-up floor: a trivial device plugin process (tonic; serve, Register, one \
             snapshot of 10 devices), spawn → registered with a snapshot (median of {})",
            floor.count()
        ),
        spread(&floor),
    )];
    for modules in [1, 10] {
        let (mut cold, mut warm, mut seeded) = (Vec::new(), Vec::new(), Vec::new());
        for rep in 0..s.repeats(REPEATS) {
            let cache = caches.path().join(format!("cache-{modules}-{rep}"));
            let state = caches.path().join(format!("state-{modules}-{rep}"));
            cold.push(once(s, modules, (&cache, &state), None).await?);
            warm.push(once(s, modules, (&cache, &state), None).await?);
            let empty = caches.path().join(format!("empty-{modules}-{rep}"));
            let new_state = caches.path().join(format!("new-state-{modules}-{rep}"));
            seeded.push(once(s, modules, (&empty, &new_state), Some(&cache)).await?);
        }
        let (cold, warm, seeded) = (Samples::new(cold), Samples::new(warm), Samples::new(seeded));
        let what = |cache: &str| {
            format!(
                "3. Start-up, spawn → every resource registered with a snapshot: {modules} \
                 module{}, {cache} compile cache and state directory (median of {})",
                if modules == 1 { "" } else { "s" },
                warm.count()
            )
        };
        rows.push(Row::info(what("cold"), spread(&cold)));
        rows.push(if modules == 1 {
            let versus = ratio(&warm, &floor);
            Row::judged(
                what("warm"),
                format!("{}; {versus:.2}× the floor", spread(&warm)),
                format!(
                    "≤ {} and ≤ {FLOOR_RATIO}× the floor (issue 35)",
                    duration(WARM_TARGET)
                ),
                warm.p50() <= WARM_TARGET && versus <= FLOOR_RATIO,
            )
        } else {
            Row::judged(
                what("warm"),
                spread(&warm),
                format!("≤ {}", duration(Duration::from_millis(100))),
                warm.p50() <= Duration::from_millis(100),
            )
        });
        rows.push(Row::judged(
            format!(
                "3. Start-up, spawn → every resource registered with a snapshot: {modules} \
                 module{}, empty compile cache and state, modules precompiled as the image \
                 carries them (its first start on a new node; median of {})",
                if modules == 1 { "" } else { "s" },
                seeded.count()
            ),
            format!("{}; {:.2}× warm", spread(&seeded), ratio(&seeded, &warm)),
            "≤ 2× warm (issue 35)".to_owned(),
            ratio(&seeded, &warm) <= 2.0,
        ));
    }
    if s.compare.is_some() || s.compare_module_dir.is_some() {
        rows.push(compare(s, caches.path()).await?);
    }
    if let Some(fake) = &s.fake_nvml {
        let cache = caches.path().join("cache-nvidia");
        let state = caches.path().join("state-nvidia");
        nvidia_once(s, fake, (&cache, &state)).await?; // compiles nvidia-gpu into the cache
        let mut warm = Vec::new();
        for _ in 0..s.repeats(REPEATS) {
            warm.push(nvidia_once(s, fake, (&cache, &state)).await?);
        }
        let warm = Samples::new(warm);
        rows.push(Row::info(
            format!(
                "3. Start-up, spawn → nvidia.com/gpu registered with 8 GPUs in its snapshot: \
                 nvidia-gpu over the fake NVML, warm compile cache and state directory (median \
                 of {})",
                warm.count()
            ),
            format!("{}; {:.2}× the floor", spread(&warm), ratio(&warm, &floor)),
        ));
    }
    Ok(rows)
}

/// Warm starts of one module, this agent and modules against the compared ones, in
/// interleaved pairs (which starts first alternates), each side on its own warm cache and state
/// directory.
async fn compare(s: &Settings, dirs: &Path) -> anyhow::Result<Row> {
    let pairs = s.n(PAIRS);
    let that = Settings {
        devicelet: s.compare.clone().unwrap_or_else(|| s.devicelet.clone()),
        module_dir: s
            .compare_module_dir
            .clone()
            .unwrap_or_else(|| s.module_dir.clone()),
        ..s.clone()
    };
    let dirs_of = |name: &str| {
        (
            dirs.join(format!("cache-{name}")),
            dirs.join(format!("state-{name}")),
        )
    };
    let (a, b) = (dirs_of("this"), dirs_of("other"));
    let this = || once(s, 1, (&a.0, &a.1), None);
    let other = || once(&that, 1, (&b.0, &b.1), None);
    // Each compiles its module into its own cache first.
    this().await?;
    other().await?;
    let (mut ours, mut theirs, mut faster) = (Vec::new(), Vec::new(), 0);
    for pair in 0..pairs {
        let (x, y) = if pair % 2 == 0 {
            let x = this().await?;
            (x, other().await?)
        } else {
            let y = other().await?;
            (this().await?, y)
        };
        faster += usize::from(x < y);
        ours.push(x);
        theirs.push(y);
    }
    let (ours, theirs) = (Samples::new(ours), Samples::new(theirs));
    Ok(Row::info(
        format!(
            "3. Start-up, 1 module, warm: this build beside the compared one ({} with modules \
             from {}), {pairs} interleaved pairs",
            that.devicelet.display(),
            that.module_dir.display()
        ),
        format!(
            "{} · compared: {}; {:.2}× the compared build's median, faster in {faster} of \
             {pairs} pairs",
            spread(&ours),
            spread(&theirs),
            ratio(&ours, &theirs)
        ),
    ))
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

/// One start of a fresh agent process with `modules` modules on a fresh node (kubelet and
/// devices), with the compile cache and state directory `(cache, state)`.
async fn once(
    s: &Settings,
    modules: usize,
    (cache, state): (&Path, &Path),
    precompiled: Option<&Path>,
) -> anyhow::Result<Duration> {
    let node = Node::start(SimConfig::default()).await?;
    node.add_fuses()?;
    let (entries, names) = fuse_modules(&s.module_dir, &node.dir.path().join("modules"), modules)?;
    let registry = node.registry(&entries)?;
    let dirs = AgentDirs {
        state: state.to_owned(),
        cache: cache.to_owned(),
        precompiled: precompiled.map(Path::to_owned),
        nvml: None,
    };
    let agent = AgentProcess::spawn(&s.devicelet, &node, &registry, &dirs)?;
    wait_all(&node, &agent, &names).await?;
    let took = agent.spawned_at.elapsed();
    agent.terminate().await?;
    Ok(took)
}

/// One start of nvidia-gpu over eight fake GPUs on a fresh node, until all eight are listed.
async fn nvidia_once(
    s: &Settings,
    fake: &Path,
    (cache, state): (&Path, &Path),
) -> anyhow::Result<Duration> {
    let node = Node::start(SimConfig::default()).await?;
    let agent = nvidia::spawn_serving(s, &node, fake, cache, state.to_owned()).await?;
    let took = agent.spawned_at.elapsed();
    agent.terminate().await?;
    Ok(took)
}

/// One start of the trivial plugin process on a fresh node, until its snapshot arrives.
async fn floor_once() -> anyhow::Result<Duration> {
    let node = Node::start(SimConfig::default()).await?;
    let spawned_at = Instant::now();
    let plugin = remote::spawn_plugin(&node, &resource("trivial")).await?;
    let took = spawned_at.elapsed();
    remote::stop(plugin).await?;
    Ok(took)
}
