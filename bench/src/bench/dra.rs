//! Benchmark 11: the DRA front end. The agent runs in this process with its modules served as
//! DRA drivers, against the simulator's kubelet (plugin watcher, DRA plugin manager, wipes) and
//! its API server stand-in:
//!
//! - NodePrepareResources and NodeUnprepareResources of one claim, 1 and 8 devices, through a
//!   tonic `DRAPlugin` client of our own on the driver's `dra.sock` (not the simulator's), each
//!   claim made by the scheduler's allocator beforehand and deleted after;
//! - a device going Unhealthy (amd-gpu, its render node removed: the agent sees it through
//!   inotify) until the health stream says so, and until the pool's slice no longer lists it;
//! - a device plugged in (a FUSE node created) until the pool's slice lists it.
//!
//! The slices are read from the stand-in's store every 500 µs, so those figures are up to that
//! much late.

use std::time::{Duration, Instant};

use anyhow::Context;
use serde_json::json;

use super::Settings;
use super::node::{Node, WAIT, generic_dev};
use super::report::Row;
use super::stats::{Samples, duration};
use devicelet::dra::api::ApiClient;
use devicelet::dra::driver::DraOptions;
use devicelet::kubelet::api::dra::health::dra_resource_health_client::DraResourceHealthClient;
use devicelet::kubelet::api::dra::health::{HealthStatus, NodeWatchResourcesRequest};
use devicelet::kubelet::api::dra::v1::dra_plugin_client::DraPluginClient;
use devicelet::kubelet::api::dra::v1::{
    Claim, NodePrepareResourcesRequest, NodeUnprepareResourcesRequest,
};
use devicelet_simulator::apiserver::{ApiServer, Kind};
use devicelet_simulator::{DraApi, SimConfig};

const NODE: &str = "bench-node";
const FUSE: &str = "fuse.devicelet.io";
const GPU: &str = "gpu.amd.com";
const CLAIMS: usize = 1000;
const CHANGES: usize = 40;
/// How often slices are looked at.
const POLL: Duration = Duration::from_micros(500);
/// The deadline the kubelet sets on each call.
const KUBELET_DEADLINE: Duration = Duration::from_secs(45);

/// A node serving DRA: the kubelet with its plugin watcher and the API server stand-in.
struct DraNode {
    node: Node,
    api: ApiServer,
    /// The kubeconfig and the plugin watcher's directory.
    _scratch: tempfile::TempDir,
    /// Where claims' CDI specs go: tmpfs, as `/var/run/cdi` is on a node.
    cdi: tempfile::TempDir,
    client: ApiClient,
}

impl DraNode {
    async fn start() -> anyhow::Result<DraNode> {
        let api = ApiServer::start().await?;
        api.create(Kind::Node, "", json!({"metadata": {"name": NODE}}))
            .map_err(|e| anyhow::anyhow!("{}", e.message))?;
        let scratch = tempfile::tempdir()?;
        let node = Node::start(SimConfig {
            plugins_registry: Some(scratch.path().join("plugins_registry")),
            dra_api: Some(DraApi {
                server: api.handle(),
                node: NODE.into(),
            }),
            ..SimConfig::default()
        })
        .await?;
        let kubeconfig = scratch.path().join("kubeconfig");
        std::fs::write(&kubeconfig, api.kubeconfig())?;
        let client = ApiClient::connect(Some(&kubeconfig)).await?;
        Ok(DraNode {
            node,
            api,
            _scratch: scratch,
            cdi: tmpfs_cdi()?,
            client,
        })
    }

    async fn agent(&self, modules: &str) -> anyhow::Result<devicelet::agent::Agent> {
        let registry = self.node.registry(modules)?;
        let registry_dir = self
            .node
            .sim
            .plugins_registry()
            .context("the plugin watcher")?
            .to_owned();
        let plugins = self.node.dir.path().join("plugins");
        let cdi = self.cdi.path().to_owned();
        let state = self.node.dir.path().join("state");
        let client = self.client.clone();
        self.node
            .start_agent_with(&registry, move |o| {
                // The agent makes its state directory (0700); the checkpoint goes in it.
                o.state_dir = Some(state.clone());
                o.dra = Some(DraOptions {
                    registry_dir,
                    plugins_dir: plugins,
                    node: NODE.into(),
                    api: Some(client),
                    state_dir: Some(state),
                    cdi_dir: cdi,
                    resync: Duration::from_secs(10),
                    events: Default::default(),
                    retirees: Default::default(),
                });
            })
            .await
    }

    /// The driver's service socket.
    fn socket(&self, driver: &str) -> std::path::PathBuf {
        self.node
            .dir
            .path()
            .join("plugins")
            .join(driver)
            .join("dra.sock")
    }

    /// How many devices `driver`'s slices list now.
    fn published(&self, driver: &str) -> usize {
        self.api
            .list(Kind::ResourceSlice)
            .iter()
            .filter(|s| s["spec"]["driver"] == driver)
            .map(|s| s["spec"]["devices"].as_array().map_or(0, Vec::len))
            .sum()
    }

    /// Waits until `driver`'s slices list `count` devices.
    async fn until_published(&self, driver: &str, count: usize) -> anyhow::Result<()> {
        let deadline = Instant::now() + WAIT;
        while self.published(driver) != count {
            anyhow::ensure!(
                Instant::now() < deadline,
                "{driver} never published {count} devices"
            );
            tokio::time::sleep(POLL).await;
        }
        Ok(())
    }
}

/// A scratch CDI directory on tmpfs (`/dev/shm`), as `/var/run/cdi` is on a node; on this
/// machine's disk where there is no `/dev/shm`.
pub fn tmpfs_cdi() -> anyhow::Result<tempfile::TempDir> {
    let shm = std::path::Path::new("/dev/shm");
    Ok(match shm.is_dir() {
        true => tempfile::tempdir_in(shm)?,
        false => tempfile::tempdir()?,
    })
}

pub async fn run(s: &Settings) -> anyhow::Result<Vec<Row>> {
    let mut rows = prepare_rows(s).await?;
    rows.extend(health_rows(s).await?);
    Ok(rows)
}

fn fuse_dra(s: &Settings, paths: &str) -> String {
    generic_dev(&s.module_dir, "generic-dev", "fuse", paths, "5s").replacen(
        "[module.grants]",
        "front-end = \"dra\"\n\n[module.grants]",
        1,
    )
}

async fn prepare_rows(s: &Settings) -> anyhow::Result<Vec<Row>> {
    let dra = DraNode::start().await?;
    dra.node.add_fuses()?;
    let agent = dra.agent(&fuse_dra(s, "/dev/fuse-*")).await?;
    dra.until_published(FUSE, 10).await?;
    let channel = devicelet::kubelet::uds::connect(&dra.socket(FUSE)).await?;
    let mut client = DraPluginClient::new(channel);
    let scheduler = dra.api.handle();
    let mut rows = Vec::new();
    for devices in [1, 8] {
        let n = s.n(CLAIMS);
        let (mut prepare, mut unprepare) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for i in 0..n + n / 10 {
            let name = format!("claim-{devices}-{i}");
            let claim = scheduler
                .allocate_claim("default", &name, FUSE, NODE, devices)
                .map_err(|e| anyhow::anyhow!("{e}"))?;
            let wire = Claim {
                namespace: "default".into(),
                uid: claim["metadata"]["uid"].as_str().unwrap_or_default().into(),
                name: name.clone(),
            };
            let started = Instant::now();
            let mut request = tonic::Request::new(NodePrepareResourcesRequest {
                claims: vec![wire.clone()],
            });
            request.set_timeout(KUBELET_DEADLINE);
            let answer = client.node_prepare_resources(request).await?.into_inner();
            let took = started.elapsed();
            let prepared = answer.claims.get(&wire.uid).context("an entry")?;
            anyhow::ensure!(prepared.error.is_empty(), "prepare: {}", prepared.error);
            anyhow::ensure!(prepared.devices.len() == devices, "{prepared:?}");
            let started = Instant::now();
            let mut request = tonic::Request::new(NodeUnprepareResourcesRequest {
                claims: vec![wire.clone()],
            });
            request.set_timeout(KUBELET_DEADLINE);
            let answer = client.node_unprepare_resources(request).await?.into_inner();
            let took_back = started.elapsed();
            let error = answer.claims.get(&wire.uid).map(|c| c.error.clone());
            anyhow::ensure!(error.as_deref() == Some(""), "unprepare: {error:?}");
            dra.api.delete(Kind::ResourceClaim, "default", &name);
            // The first tenth warms up.
            if i >= n / 10 {
                prepare.push(took);
                unprepare.push(took_back);
            }
        }
        let (prepare, unprepare) = (Samples::new(prepare), Samples::new(unprepare));
        rows.push(Row::info(
            format!(
                "11. DRA NodePrepareResources, one claim of {devices} device(s) of generic-dev \
                 (claim read from the API server stand-in, module's allocate, CDI spec written, \
                 claim journaled on disk), through a DRAPlugin v1 client of our own ({} calls)",
                prepare.count()
            ),
            prepare.summary(true),
        ));
        rows.push(Row::info(
            format!(
                "11. DRA NodeUnprepareResources of that claim ({} calls)",
                unprepare.count()
            ),
            unprepare.summary(true),
        ));
    }

    // Hotplug: a FUSE node appears, until the pool lists it; it goes, until it no longer does.
    let mut plugged = Vec::new();
    for i in 0..s.n(CHANGES) {
        tokio::time::sleep(Duration::from_millis(20)).await;
        let plug = i % 2 == 0;
        let started = Instant::now();
        if plug {
            dra.node.add_char("/dev/fuse-10", 10, 229)?;
        } else {
            dra.node.tree.remove("/dev/fuse-10")?;
        }
        dra.until_published(FUSE, if plug { 11 } else { 10 })
            .await?;
        if plug {
            plugged.push(started.elapsed());
        }
    }
    agent.shutdown().await;
    let plugged = Samples::new(plugged);
    rows.push(Row::info(
        format!(
            "11. DRA publish latency: a device node plugged in → listed in the pool's \
             ResourceSlice at the API server stand-in, health-interval 5 s ({} plugs)",
            plugged.count()
        ),
        plugged.summary(false),
    ));
    Ok(rows)
}

async fn health_rows(s: &Settings) -> anyhow::Result<Vec<Row>> {
    let dra = DraNode::start().await?;
    dra.node.tree.load(
        &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../guests/amd-gpu/fixtures/2-gpus"),
    )?;
    let agent = dra
        .agent(&format!(
            r#"[[module]]
name = "amd-gpu"
path = "{}"
resource-domain = "amd.com"
health-interval = "5s"
front-end = "dra"

[module.grants]
sysfs = ["/sys/bus/pci/devices/*"]
dev = ["/dev/kfd", "/dev/dri/*"]
"#,
            s.module_dir.join("amd_gpu.wasm").display()
        ))
        .await?;
    dra.until_published(GPU, 2).await?;
    let channel = devicelet::kubelet::uds::connect(&dra.socket(GPU)).await?;
    let mut health = DraResourceHealthClient::new(channel)
        .node_watch_resources(NodeWatchResourcesRequest {})
        .await?
        .into_inner();
    // The first message is the current state.
    health.message().await?.context("the health stream")?;
    let (healthy, unhealthy) = (HealthStatus::Healthy as i32, HealthStatus::Unhealthy as i32);
    let (mut streamed, mut sliced) = (Vec::new(), Vec::new());
    let render = dra.node.tree.path("/dev/dri/renderD129");
    let (major, minor) = {
        use std::os::unix::fs::MetadataExt;
        let rdev = std::fs::metadata(&render)?.rdev();
        (libc::major(rdev), libc::minor(rdev))
    };
    for _ in 0..s.n(CHANGES) {
        tokio::time::sleep(Duration::from_millis(20)).await;
        let started = Instant::now();
        dra.node.tree.remove("/dev/dri/renderD129")?;
        loop {
            let report = tokio::time::timeout(WAIT, health.message())
                .await
                .context("the health stream said nothing")??
                .context("the health stream ended")?;
            if report.devices.iter().any(|d| d.health == unhealthy) {
                break;
            }
        }
        streamed.push(started.elapsed());
        dra.until_published(GPU, 1).await?;
        sliced.push(started.elapsed());
        dra.node.add_char("/dev/dri/renderD129", major, minor)?;
        dra.until_published(GPU, 2).await?;
        // Read up to the healthy report.
        loop {
            let report = tokio::time::timeout(WAIT, health.message())
                .await
                .context("the health stream said nothing")??
                .context("the health stream ended")?;
            if report.devices.iter().all(|d| d.health == healthy) {
                break;
            }
        }
    }
    agent.shutdown().await;
    let (streamed, sliced) = (Samples::new(streamed), Samples::new(sliced));
    Ok(vec![
        Row::info(
            format!(
                "11. DRA device Unhealthy (amd-gpu render node removed) → Unhealthy on the \
                 DRAResourceHealth stream, health-interval 5 s ({} changes)",
                streamed.count()
            ),
            streamed.summary(false),
        ),
        Row::info(
            format!(
                "11. DRA device Unhealthy → left the pool's ResourceSlice at the API server \
                 stand-in ({} changes; read every {})",
                sliced.count(),
                duration(POLL)
            ),
            sliced.summary(false),
        ),
    ])
}
