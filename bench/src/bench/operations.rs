//! Benchmark 10: what running it on a cluster costs. Allocate on the plugin-watcher route against
//! the kubelet.sock route in alternating batches (on both, as on every socket of the agent, the
//! connections go through the `:authority` rewriter); and a Prometheus scrape of `/metrics` with
//! ten modules served.

use std::net::SocketAddr;
use std::time::Duration;

use super::Settings;
use super::allocate::measure;
use super::node::{self, Node, resource};
use super::report::Row;
use super::stats::{self, Samples};
use devicelet::kubelet::api::deviceplugin::{AllocateRequest, ContainerAllocateRequest};
use devicelet::kubelet::route::Route;
use devicelet_simulator::SimConfig;

const WARMUP: usize = 1_000;
const BATCH: usize = 500;

pub async fn run(s: &Settings) -> anyhow::Result<Vec<Row>> {
    let mut rows = routes(s).await?;
    rows.extend(scrape(s).await?);
    Ok(rows)
}

async fn routes(s: &Settings) -> anyhow::Result<Vec<Row>> {
    let request = AllocateRequest {
        container_requests: vec![ContainerAllocateRequest {
            devices_ids: vec!["fuse-0".into()],
        }],
    };
    let name = resource("fuse");

    let plain = Node::start(SimConfig::default()).await?;
    let registry = plain.fuse_registry(&s.module_dir)?;
    let _plain_agent = plain.start_agent(&registry, None).await?;
    plain.wait_served(&name).await?;
    let mut direct = plain.client(&name).await?;

    let registry_home = tempfile::tempdir()?;
    let registry_dir = registry_home.path().join("plugins_registry");
    let watched = Node::start(SimConfig {
        plugins_registry: Some(registry_dir.clone()),
        ..SimConfig::default()
    })
    .await?;
    let registry = watched.fuse_registry(&s.module_dir)?;
    let _watched_agent = watched
        .start_agent_with(&registry, |o| {
            o.registration = Route::PluginWatcher(registry_dir.clone())
        })
        .await?;
    watched.wait_served(&name).await?;
    // The endpoint the kubelet dials on this route is the registration socket itself.
    let mut rewritten = watched.client(&name).await?;

    measure(&mut direct, &request, s.n(WARMUP), &mut Vec::new()).await?;
    measure(&mut rewritten, &request, s.n(WARMUP), &mut Vec::new()).await?;
    let calls = s.n(10_000);
    let (mut direct_t, mut rewritten_t) = (Vec::new(), Vec::new());
    let mut batch = 0;
    while rewritten_t.len() < calls {
        let k = BATCH.min(calls - rewritten_t.len());
        for side in [batch % 2, 1 - batch % 2] {
            if side == 0 {
                measure(&mut rewritten, &request, k, &mut rewritten_t).await?;
            } else {
                measure(&mut direct, &request, k, &mut direct_t).await?;
            }
        }
        batch += 1;
    }
    let (rewritten_s, direct_s) = (Samples::new(rewritten_t), Samples::new(direct_t));
    Ok(vec![
        Row::info(
            format!(
                "10. Allocate on the plugin-watcher route (socket in plugins_registry, serving \
                 the registration service too), ledger in memory ({} calls, alternating batches \
                 of {BATCH} with the kubelet.sock route)",
                rewritten_s.count()
            ),
            rewritten_s.summary(true),
        ),
        Row::info(
            format!(
                "10. Allocate on the kubelet.sock route, the same module and node layout ({} \
                 calls)",
                direct_s.count()
            ),
            direct_s.summary(true),
        ),
        Row::judged(
            "10. Plugin-watcher route ÷ kubelet.sock route (p50, p99)",
            format!(
                "{} / {}",
                stats::ratio(stats::div(rewritten_s.p50(), direct_s.p50())),
                stats::ratio(stats::div(rewritten_s.p99(), direct_s.p99()))
            ),
            "p50 ≤ 1.2×",
            stats::div(rewritten_s.p50(), direct_s.p50()) <= 1.2,
        ),
    ])
}

/// `GET /metrics` on a fresh connection (the endpoint serves one request per connection), as
/// Prometheus scrapes it, with ten modules of one resource each.
async fn scrape(s: &Settings) -> anyhow::Result<Vec<Row>> {
    let node = Node::start(SimConfig::default()).await?;
    node.add_fuses()?;
    let (entries, names) = node::fuse_modules(&s.module_dir, &node.dir.path().join("copies"), 10)?;
    let registry = node.registry(&entries)?;
    let agent = node
        .start_agent_with(&registry, |o| {
            o.metrics_addr = Some(SocketAddr::from(([127, 0, 0, 1], 0)))
        })
        .await?;
    for name in &names {
        node.wait_served(name).await?;
    }
    let addr = agent
        .metrics_addr()
        .ok_or_else(|| anyhow::anyhow!("no metrics address"))?;
    let mut size = 0;
    for _ in 0..s.n(100) {
        size = get(addr).await?.len();
    }
    let mut taken = Vec::new();
    for _ in 0..s.n(2_000) {
        let (body, took) = stats::time(get(addr)).await;
        std::hint::black_box(body?);
        taken.push(took);
    }
    let taken = Samples::new(taken);
    Ok(vec![Row::judged(
        format!(
            "10. Prometheus scrape: `GET /metrics` on a new connection, 10 modules of 1 resource \
             ({} scrapes, {} KiB each)",
            taken.count(),
            size / 1024
        ),
        taken.summary(true),
        "p99 ≤ 10 ms",
        taken.p99() <= Duration::from_millis(10),
    )])
}

async fn get(addr: SocketAddr) -> anyhow::Result<String> {
    let (status, body) = devicelet::metrics::http::get(addr, "/metrics").await?;
    anyhow::ensure!(status == 200, "scrape refused: {status}");
    Ok(body)
}
