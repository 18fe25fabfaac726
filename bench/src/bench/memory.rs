//! Benchmark 6: Resident memory of `devicelet run` with 1, 10 and 50 modules: VmRSS once every
//! resource is registered and the agent has idled for a second, and again after 10,000 Allocate
//! calls spread round-robin over its resources. The compile cache is warm (primed by one earlier
//! start), as for an agent restarted on a node. The state directory is on tmpfs (`/dev/shm`) when
//! there is one, so that the disk's fsync speed does not set the run time (memory is what is
//! measured); the ledger still holds every entry (reconciliation frees them only after its grace
//! period).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::Settings;
use super::node::{Node, fuse_modules};
use super::process::{AgentDirs, AgentProcess, wait_all};
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
    let mut rows = Vec::new();
    for (modules, target) in [(1, Some(25 * MB)), (10, Some(40 * MB)), (50, None)] {
        let m = measure(s, modules, &cache, state_parent.path()).await?;
        let figure = format!(
            "idle {} / after {} allocations {} (of which anonymous {} / {}; the allocations \
             took {})",
            megabytes(m.idle),
            m.allocations,
            megabytes(m.after),
            megabytes(m.idle_anon),
            megabytes(m.after_anon),
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
    Ok(rows)
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
    };
    let agent = AgentProcess::spawn(&s.devicelet, &node, &registry, &dirs)?;
    wait_all(&node, &agent, &names).await?;
    agent.terminate().await
}

struct Measured {
    idle: u64,
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
    };
    let agent = AgentProcess::spawn(&s.devicelet, &node, &registry, &dirs)?;
    wait_all(&node, &agent, &names).await?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (idle, idle_anon) = (agent.rss()?, agent.rss_anon()?);

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
    let (after, after_anon) = (agent.rss()?, agent.rss_anon()?);
    agent.terminate().await?;
    Ok(Measured {
        idle,
        idle_anon,
        after,
        after_anon,
        allocations,
        took,
    })
}
