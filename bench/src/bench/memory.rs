//! Benchmark 6: Resident memory of `devicelet run` with 1, 10 and 50 modules: VmRSS once every
//! resource is registered and the agent has idled for a second, and again after 10,000 Allocate
//! calls spread round-robin over its resources. The compile cache is warm (primed by one earlier
//! start), as for an agent restarted on a node. The state directory is on tmpfs (`/dev/shm`) when
//! there is one, so that the disk's fsync speed does not set the run time (memory is what is
//! measured); the ledger still holds every entry (reconciliation frees them only after its grace
//! period). Beside them: the trivial plugin process of the start-up floor, and (with
//! `--fake-nvml`) nvidia-gpu serving eight fake GPUs.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;

use super::Settings;
use super::node::{Node, fuse_modules, resource};
use super::nvidia;
use super::process::{AgentDirs, AgentProcess, status_bytes, wait_all};
use super::remote;
use super::report::Row;
use super::stats::{duration, megabytes};
use devicelet::kubelet::api::deviceplugin::{AllocateRequest, ContainerAllocateRequest};
use devicelet_simulator::SimConfig;

const ALLOCATIONS: usize = 10_000;
/// The most modules measured; the priming start compiles every copy into the cache.
const MAX_MODULES: usize = 50;
const MB: u64 = 1_000_000;

pub async fn run(s: &Settings) -> anyhow::Result<Vec<Row>> {
    let cache_root = tempfile::tempdir()?;
    let cache = cache_root.path().join("cache");
    let state_parent = tmpfs_scratch()?;
    prime(s, &cache, state_parent.path()).await?;
    let mut rows = vec![Row::info(
        "6. Resident memory (VmRSS) of the trivial device plugin process (the start-up floor), \
         registered and idle"
            .to_owned(),
        floor_rss().await?,
    )];
    for (modules, target) in [(1, Some(15 * MB)), (10, Some(40 * MB)), (50, None)] {
        let m = measure(s, modules, &cache, state_parent.path()).await?;
        let figure = format!(
            "idle {} / after {} allocations {} (anonymous {} / {}, file-backed {} / {}; peak \
             during start-up {}; the allocations took {})",
            megabytes(m.idle),
            m.allocations,
            megabytes(m.after),
            megabytes(m.idle_anon),
            megabytes(m.after_anon),
            megabytes(m.idle_file),
            megabytes(m.after_file),
            megabytes(m.peak),
            duration(m.took)
        );
        let benchmark = format!(
            "6. Resident memory (VmRSS) of `devicelet run`, {modules} module{}",
            if modules == 1 { "" } else { "s" }
        );
        rows.push(match target {
            Some(t) => Row::judged(
                benchmark,
                figure,
                format!("≤ {}", megabytes(t)),
                m.idle.max(m.after) <= t,
            ),
            None => Row::info(benchmark, figure),
        });
    }
    if let Some(fake) = &s.fake_nvml {
        rows.push(nvidia_rss(s, fake, &cache, state_parent.path()).await?);
    }
    Ok(rows)
}

/// nvidia-gpu over eight fake GPUs, from a warm cache: VmRSS once all eight are listed and the
/// agent has idled for a second.
async fn nvidia_rss(
    s: &Settings,
    fake: &Path,
    cache: &Path,
    state_parent: &Path,
) -> anyhow::Result<Row> {
    let mut figures = None;
    for start in ["prime", "measured"] {
        let node = Node::start(SimConfig::default()).await?;
        let state = state_parent.join(format!("nvidia-{start}"));
        let agent = nvidia::spawn_serving(s, &node, fake, cache, state).await?;
        tokio::time::sleep(Duration::from_secs(1)).await;
        figures = Some((
            agent.rss()?,
            agent.rss_anon()?,
            agent.rss_file()?,
            agent.rss_peak()?,
        ));
        agent.terminate().await?;
    }
    let (rss, anon, file, peak) = figures.context("measured")?;
    Ok(Row::judged(
        "6. Resident memory (VmRSS) of `devicelet run` with nvidia-gpu over the fake NVML (8 \
         GPUs), registered and idle"
            .to_owned(),
        format!(
            "{} (anonymous {}, file-backed {}; peak during start-up {})",
            megabytes(rss),
            megabytes(anon),
            megabytes(file),
            megabytes(peak)
        ),
        format!("≤ {} (issue 35)", megabytes(20 * MB)),
        rss <= 20 * MB,
    ))
}

/// VmRSS of the trivial plugin process once registered and idle for a second.
async fn floor_rss() -> anyhow::Result<String> {
    let node = Node::start(SimConfig::default()).await?;
    let plugin = remote::spawn_plugin(&node, &resource("trivial")).await?;
    let pid = plugin.id().context("the plugin exited at once")?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (rss, anon, file) = (
        status_bytes(pid, "VmRSS:")?,
        status_bytes(pid, "RssAnon:")?,
        status_bytes(pid, "RssFile:")?,
    );
    remote::stop(plugin).await?;
    Ok(format!(
        "{} (anonymous {}, file-backed {}); the bench binary, which links the agent and the \
         simulator",
        megabytes(rss),
        megabytes(anon),
        megabytes(file)
    ))
}

/// Scratch space on tmpfs if the machine has `/dev/shm`, else the default temp directory.
fn tmpfs_scratch() -> std::io::Result<tempfile::TempDir> {
    let shm = Path::new("/dev/shm");
    if shm.is_dir()
        && let Ok(dir) = tempfile::tempdir_in(shm)
    {
        return Ok(dir);
    }
    tempfile::tempdir()
}

/// Compiles every generic-dev copy into `cache` with one throwaway start.
async fn prime(s: &Settings, cache: &Path, state_parent: &Path) -> anyhow::Result<()> {
    let node = Node::start(SimConfig::default()).await?;
    node.add_fuses()?;
    let (entries, names) =
        fuse_modules(&s.module_dir, &node.dir.path().join("modules"), MAX_MODULES)?;
    let registry = node.registry(&entries)?;
    let dirs = AgentDirs {
        state: state_parent.join("prime"),
        cache: cache.to_owned(),
        precompiled: None,
        nvml: None,
    };
    let agent = AgentProcess::spawn(&s.devicelet, &node, &registry, &dirs)?;
    wait_all(&node, &agent, &names).await?;
    agent.terminate().await
}

struct Measured {
    idle: u64,
    idle_file: u64,
    after_file: u64,
    /// VmHWM before the allocations: the start-up's peak.
    peak: u64,
    idle_anon: u64,
    after: u64,
    after_anon: u64,
    allocations: usize,
    took: Duration,
}

async fn measure(
    s: &Settings,
    modules: usize,
    cache: &Path,
    state_parent: &Path,
) -> anyhow::Result<Measured> {
    let node = Node::start(SimConfig::default()).await?;
    node.add_fuses()?;
    let (entries, names) = fuse_modules(&s.module_dir, &node.dir.path().join("modules"), modules)?;
    let registry = node.registry(&entries)?;
    let dirs = AgentDirs {
        state: PathBuf::from(state_parent).join(format!("state-{modules}")),
        cache: cache.to_owned(),
        precompiled: None,
        nvml: None,
    };
    let agent = AgentProcess::spawn(&s.devicelet, &node, &registry, &dirs)?;
    wait_all(&node, &agent, &names).await?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (idle, idle_anon, idle_file) = (agent.rss()?, agent.rss_anon()?, agent.rss_file()?);
    let peak = agent.rss_peak()?;

    let mut clients = Vec::new();
    for name in &names {
        clients.push(node.client(name).await?);
    }
    let allocations = s.n(ALLOCATIONS);
    let started = Instant::now();
    for i in 0..allocations {
        let request = AllocateRequest {
            container_requests: vec![ContainerAllocateRequest {
                devices_ids: vec![format!("fuse-{}", i % 10)],
            }],
        };
        let n = clients.len();
        clients[i % n].allocate(request).await?;
    }
    let took = started.elapsed();
    drop(clients);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (after, after_anon, after_file) = (agent.rss()?, agent.rss_anon()?, agent.rss_file()?);
    agent.terminate().await?;
    Ok(Measured {
        idle,
        idle_file,
        after_file,
        peak,
        idle_anon,
        after,
        after_anon,
        allocations,
        took,
    })
}
