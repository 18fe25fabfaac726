//! Benchmark 11, beside the peer: devicelet's DRA front end and the reference Go driver
//! (kubernetes-sigs/dra-example-driver, built on the official `kubeletplugin` helper; see
//! `bench/peer/build-dra-example-driver.sh`), each in a process of its own as on a node, against
//! one API server stand-in and the simulator's kubelet, driven by one client making the
//! kubelet's calls: for each of 300 one-device claims per driver, interleaved (the order
//! swapped every round), a claim allocated to the driver's device is created, then one
//! NodePrepareResources and one NodeUnprepareResources are timed through tonic's DRAPlugin v1
//! client on the driver's `dra.sock`, then the claim is deleted. Both write their CDI specs in
//! one tmpfs directory, as on a node (`/var/run/cdi`), and keep their claims on this machine's
//! disk (devicelet's ledger in its state directory, the peer's `checkpoint.json` in its plugin
//! directory).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::Context;
use serde_json::json;
use tokio::process::{Child, Command};

use super::Settings;
use super::node::{Node, generic_dev};
use super::remote::wait_for_socket;
use super::report::Row;
use super::stats::Samples;
use devicelet::kubelet::api::dra::v1::dra_plugin_client::DraPluginClient;
use devicelet::kubelet::api::dra::v1::{
    Claim, NodePrepareResourcesRequest, NodeUnprepareResourcesRequest,
};
use devicelet_simulator::apiserver::{ApiServer, Kind};
use devicelet_simulator::{DraApi, SimConfig};

const NODE: &str = "bench-node";
const OURS: &str = "fuse.devicelet.io";
const PEER: &str = "gpu.example.com";
const CLAIMS: usize = 300;
const DEADLINE: Duration = Duration::from_secs(45);

/// One driver under test: its client and how its claims are made.
struct Driver {
    name: &'static str,
    client: DraPluginClient<tonic::transport::Channel>,
    /// The device its claims are allocated.
    device: String,
    prepare: Vec<Duration>,
    unprepare: Vec<Duration>,
}

pub async fn run(s: &Settings, peer: &Path) -> anyhow::Result<Vec<Row>> {
    let api = ApiServer::start().await?;
    api.create(Kind::Node, "", json!({"metadata": {"name": NODE}}))
        .map_err(|e| anyhow::anyhow!("{}", e.message))?;
    let scratch = tempfile::tempdir()?;
    let registry_dir = scratch.path().join("plugins_registry");
    std::fs::create_dir_all(&registry_dir)?;
    let node = Node::start(SimConfig {
        plugins_registry: Some(registry_dir.clone()),
        dra_api: Some(DraApi {
            server: api.handle(),
            node: NODE.into(),
        }),
        ..SimConfig::default()
    })
    .await?;
    node.add_fuses()?;
    let kubeconfig = scratch.path().join("kubeconfig");
    std::fs::write(&kubeconfig, api.kubeconfig())?;
    let plugins = scratch.path().join("plugins");
    let cdi_dir = super::dra::tmpfs_cdi()?;
    let cdi = cdi_dir.path().to_owned();
    let modules = generic_dev(&s.module_dir, "generic-dev", "fuse", "/dev/fuse-*", "5s").replacen(
        "[module.grants]",
        "front-end = \"dra\"\n\n[module.grants]",
        1,
    );
    let registry = node.registry(&modules)?;
    let log = std::fs::File::create(scratch.path().join("devicelet.log"))?;
    let ours = spawn(
        Command::new(&s.devicelet)
            .arg("run")
            .arg("--config")
            .arg(&registry)
            .arg("--kubelet-dir")
            .arg(node.plugin_dir())
            .arg("--state-dir")
            .arg(scratch.path().join("state"))
            .arg("--cdi-dir")
            .arg(&cdi)
            .arg("--plugins-registry-dir")
            .arg(&registry_dir)
            .arg("--kubelet-plugins-dir")
            .arg(&plugins)
            .arg("--node-name")
            .arg(NODE)
            .arg("--kubeconfig")
            .arg(&kubeconfig)
            .arg("--log")
            .arg("error")
            .stderr(log),
    )?;
    let log = std::fs::File::create(scratch.path().join("peer.log"))?;
    let theirs = spawn(
        Command::new(peer)
            .arg("--node-name")
            .arg(NODE)
            .arg("--kubeconfig")
            .arg(&kubeconfig)
            .arg("--driver-name")
            .arg(PEER)
            .arg("--num-devices")
            .arg("10")
            .arg("--kubelet-registrar-directory-path")
            .arg(&registry_dir)
            .arg("--kubelet-plugins-directory-path")
            .arg(&plugins)
            .arg("--cdi-root")
            .arg(&cdi)
            // Its client's defaults (5 QPS, burst 10) would throttle every claim read.
            .arg("--kube-api-qps")
            .arg("100000")
            .arg("--kube-api-burst")
            .arg("100000")
            .stderr(log),
    )?;
    let result = measure(s, &api, &plugins).await;
    for mut child in [ours, theirs] {
        let _ = child.start_kill();
        let _ = child.wait().await;
    }
    let mut drivers = result.with_context(|| {
        let tail = |f: &str| std::fs::read_to_string(scratch.path().join(f)).unwrap_or_default();
        format!(
            "devicelet's log:\n{}\nthe peer's log:\n{}",
            tail("devicelet.log"),
            tail("peer.log")
        )
    })?;
    let peer_cycle = cycles(&drivers[1]);
    let ours_cycle = cycles(&drivers[0]);
    let ratio =
        |p: f64| ours_cycle.percentile(p).as_secs_f64() / peer_cycle.percentile(p).as_secs_f64();
    let (p50, p99) = (ratio(50.0), ratio(99.0));
    let n = drivers[0].prepare.len();
    let mut rows = vec![
        Row::info(
            format!(
                "11. DRA NodePrepareResources + NodeUnprepareResources of one one-device \
                 claim, devicelet (`devicelet run`, generic-dev) and the reference Go driver \
                 (dra-example-driver on the kubeletplugin helper), each its own process, same \
                 client and API server stand-in, interleaved ({n} claims each)"
            ),
            format!(
                "devicelet {} · Go {}",
                ours_cycle.summary(true),
                peer_cycle.summary(true)
            ),
        ),
        Row::judged(
            "11. devicelet ÷ Go reference driver, prepare + unprepare (p50, p99)",
            format!("{p50:.2}× / {p99:.2}×"),
            "≤ 0.8× at both",
            p50 <= 0.8 && p99 <= 0.8,
        ),
    ];
    for d in &mut drivers {
        let (prepare, unprepare) = (
            Samples::new(std::mem::take(&mut d.prepare)),
            Samples::new(std::mem::take(&mut d.unprepare)),
        );
        rows.push(Row::info(
            format!(
                "11. … {}: NodePrepareResources / NodeUnprepareResources",
                d.name
            ),
            format!("{} · {}", prepare.summary(true), unprepare.summary(true)),
        ));
    }
    Ok(rows)
}

fn spawn(command: &mut Command) -> anyhow::Result<Child> {
    command
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .context("spawning a driver")
}

/// Prepare + unprepare of each claim.
fn cycles(d: &Driver) -> Samples {
    Samples::new(
        d.prepare
            .iter()
            .zip(&d.unprepare)
            .map(|(p, u)| *p + *u)
            .collect(),
    )
}

async fn measure(s: &Settings, api: &ApiServer, plugins: &Path) -> anyhow::Result<Vec<Driver>> {
    let socket = |driver: &str| -> PathBuf { plugins.join(driver).join("dra.sock") };
    let mut drivers = Vec::new();
    for (name, device) in [(OURS, None), (PEER, Some("gpu-0".to_owned()))] {
        wait_for_socket(&socket(name)).await?;
        let channel = devicelet::kubelet::uds::connect(&socket(name)).await?;
        let device = match device {
            Some(device) => device,
            // devicelet's pool as it published it: its first device.
            None => published_device(api, name).await?,
        };
        drivers.push(Driver {
            name: if name == OURS {
                "devicelet"
            } else {
                "Go reference driver"
            },
            client: DraPluginClient::new(channel),
            device,
            prepare: Vec::new(),
            unprepare: Vec::new(),
        });
    }
    let n = s.n(CLAIMS);
    for i in 0..n + n / 10 {
        let order: [usize; 2] = if i % 2 == 0 { [0, 1] } else { [1, 0] };
        for at in order {
            let d = &mut drivers[at];
            let driver = if at == 0 { OURS } else { PEER };
            let name = format!("claim-{at}-{i}");
            let uid = claim(api, &name, driver, &d.device)?;
            let wire = Claim {
                namespace: "default".into(),
                uid: uid.clone(),
                name: name.clone(),
            };
            let started = Instant::now();
            let mut request = tonic::Request::new(NodePrepareResourcesRequest {
                claims: vec![wire.clone()],
            });
            request.set_timeout(DEADLINE);
            let answer = d.client.node_prepare_resources(request).await?.into_inner();
            let took = started.elapsed();
            let prepared = answer.claims.get(&uid).context("an entry")?;
            anyhow::ensure!(
                prepared.error.is_empty() && prepared.devices.len() == 1,
                "{driver}: prepare: {prepared:?}"
            );
            let started = Instant::now();
            let mut request =
                tonic::Request::new(NodeUnprepareResourcesRequest { claims: vec![wire] });
            request.set_timeout(DEADLINE);
            let answer = d
                .client
                .node_unprepare_resources(request)
                .await?
                .into_inner();
            let took_back = started.elapsed();
            let error = answer.claims.get(&uid).map(|c| c.error.clone());
            anyhow::ensure!(
                error.as_deref() == Some(""),
                "{driver}: unprepare: {error:?}"
            );
            api.delete(Kind::ResourceClaim, "default", &name);
            // The first tenth warms up.
            if i >= n / 10 {
                d.prepare.push(took);
                d.unprepare.push(took_back);
            }
        }
    }
    Ok(drivers)
}

/// A claim allocated `device` of `driver` in this node's pool, as the scheduler leaves it; its
/// UID.
fn claim(api: &ApiServer, name: &str, driver: &str, device: &str) -> anyhow::Result<String> {
    let request = driver.split('.').next().unwrap_or(driver);
    let created = api
        .create(
            Kind::ResourceClaim,
            "default",
            json!({
                "metadata": {"name": name},
                "spec": {"devices": {"requests": [{"name": request, "exactly": {"deviceClassName": driver}}]}},
                "status": {"allocation": {"devices": {"results": [
                    {"request": request, "driver": driver, "pool": NODE, "device": device}
                ]}}}
            }),
        )
        .map_err(|e| anyhow::anyhow!("{}", e.message))?;
    created["metadata"]["uid"]
        .as_str()
        .map(str::to_owned)
        .context("a UID")
}

/// The first device `driver`'s slices list, once they list one.
async fn published_device(api: &ApiServer, driver: &str) -> anyhow::Result<String> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let found = api
            .list(Kind::ResourceSlice)
            .iter()
            .filter(|s| s["spec"]["driver"] == driver)
            .find_map(|s| s["spec"]["devices"][0]["name"].as_str().map(str::to_owned));
        if let Some(device) = found {
            return Ok(device);
        }
        anyhow::ensure!(Instant::now() < deadline, "{driver} never published");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
