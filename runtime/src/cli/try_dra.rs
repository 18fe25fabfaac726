//! `devicelet try` for a module served through DRA (`--dra`, or `front-end = "dra"` in its
//! config): the agent, the simulator's kubelet (plugin watcher and DRA plugin manager), its API
//! server stand-in and the scheduler's allocator, in one process. Each driver's published
//! devices are shown as they change; once a driver publishes `--allocate` devices, a claim for
//! them is allocated as the scheduler would, prepared as the kubelet would (its devices, CDI IDs
//! and the edits its CDI spec gives a container are shown) and unprepared.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, anyhow, bail};
use serde_json::{Value, json};

use super::dra_show::{claim_status, format_prepared, published};
use crate::agent::{Agent, AgentOptions};
use crate::config::Registry;
use crate::dra::api::ApiClient;
use crate::dra::driver::DraOptions;
use crate::kubelet::api::dra::v1::Claim;
use devicelet_simulator::apiserver::{ApiServer, Kind};
use devicelet_simulator::{DraApi, SimConfig, Simulator};

/// The node `try` plays.
pub const NODE: &str = "try-node";
/// How often the drivers' state is looked at.
const POLL: Duration = Duration::from_millis(100);

/// What `try` set up before it knew the front end.
pub struct Trial<'a> {
    pub work: &'a Path,
    pub registry: Registry,
    pub allocate: usize,
    pub once: bool,
    pub libraries: crate::nvml::Libraries,
    /// `try --cache-dir`.
    pub cache_dir: Option<std::path::PathBuf>,
    /// Wakes when the fixture changed (None with `--once`); the caller reloads it.
    pub changed: Option<tokio::sync::mpsc::Receiver<()>>,
    /// Reloads the fixture into the node.
    pub reload: &'a dyn Fn(),
}

pub async fn run(trial: Trial<'_>) -> anyhow::Result<()> {
    let Trial {
        work,
        registry,
        allocate,
        once,
        libraries,
        cache_dir,
        changed,
        reload,
    } = trial;
    let api = ApiServer::start()
        .await
        .context("starting the API server stand-in")?;
    api.create(Kind::Node, "", json!({"metadata": {"name": NODE}}))
        .map_err(|e| anyhow!("creating the Node: {}", e.message))?;
    let kubeconfig = work.join("kubeconfig");
    std::fs::write(&kubeconfig, api.kubeconfig())?;
    let client = ApiClient::connect(Some(&kubeconfig)).await?;
    let registry_dir = work.join("plugins_registry");
    let plugin_dir = work.join("device-plugins");
    let kubelet = Simulator::start_with(
        &plugin_dir,
        SimConfig {
            plugins_registry: Some(registry_dir.clone()),
            dra_api: Some(DraApi {
                server: api.handle(),
                node: NODE.into(),
            }),
            ..SimConfig::default()
        },
    )
    .await?;
    let state_dir = work.join("state");
    let cdi_dir = work.join("cdi");
    let mut options = AgentOptions::new(registry, plugin_dir);
    options.hot_reload = false;
    options.cdi_dir = cdi_dir.clone();
    options.libraries = libraries;
    options.cache_dir = cache_dir;
    options.state_dir = Some(state_dir.clone());
    options.pod_resources = Some(kubelet.pod_resources_socket().to_owned());
    options.dra = Some(DraOptions {
        registry_dir,
        plugins_dir: work.join("plugins"),
        node: NODE.into(),
        api: Some(client),
        state_dir: Some(state_dir),
        cdi_dir: cdi_dir.clone(),
        resync: Duration::from_secs(1),
        events: Default::default(),
        retirees: Default::default(),
    });
    let agent = Agent::start(options).await?;
    let watching = Watching {
        allocate,
        once,
        changed,
        reload,
    };
    let result = serve(&agent, &kubelet, &api, &cdi_dir, watching).await;
    agent.shutdown().await;
    kubelet.shutdown().await;
    result
}

/// What the loop needs of the trial.
struct Watching<'a> {
    allocate: usize,
    once: bool,
    changed: Option<tokio::sync::mpsc::Receiver<()>>,
    reload: &'a dyn Fn(),
}

async fn serve(
    agent: &Agent,
    kubelet: &Simulator,
    api: &ApiServer,
    cdi_dir: &Path,
    mut trial: Watching<'_>,
) -> anyhow::Result<()> {
    if let Some(e) = agent.load_errors().first() {
        bail!("{e}");
    }
    let mut waiting: Vec<String> = agent
        .status()
        .dra_drivers
        .into_iter()
        .map(|d| d.driver)
        .collect();
    if waiting.is_empty() {
        bail!("the module serves no resource");
    }
    println!(
        "served through DRA as {} on node {NODE} (the simulator's kubelet and API server)",
        waiting.join(", ")
    );
    let stop = super::stop_signal();
    tokio::pin!(stop);
    let mut ticker = tokio::time::interval(POLL);
    let mut shown: BTreeMap<String, String> = BTreeMap::new();
    let mut registered: Vec<String> = Vec::new();
    let mut too_few: Vec<String> = Vec::new();
    let mut watching = false;
    loop {
        let changed = async {
            match trial.changed.as_mut() {
                Some(rx) => rx.recv().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            result = &mut stop => { result?; return Ok(()); }
            Some(()) = changed => {
                // Let an editor finish writing, then bring the node in line.
                tokio::time::sleep(Duration::from_millis(100)).await;
                if let Some(rx) = trial.changed.as_mut() {
                    while rx.try_recv().is_ok() {}
                }
                (trial.reload)();
                continue;
            }
            _ = ticker.tick() => {}
        }
        for driver in agent.status().dra_drivers {
            if driver.registered && !registered.contains(&driver.driver) {
                println!(
                    "registered DRA driver {} with the kubelet (plugin watcher)",
                    driver.driver
                );
                registered.push(driver.driver.clone());
            }
            let slices = published(api, &driver.driver, NODE);
            if driver.generation > 0 && shown.get(&driver.driver) != Some(&slices) {
                println!(
                    "{}: pool generation {}, {} device(s) published{slices}",
                    driver.driver, driver.generation, driver.published
                );
                shown.insert(driver.driver.clone(), slices);
            }
            if !driver.registered || driver.generation == 0 || !waiting.contains(&driver.driver) {
                continue;
            }
            if driver.published < trial.allocate {
                let why = format!(
                    "{}: {} device(s) published, fewer than --allocate {}",
                    driver.driver, driver.published, trial.allocate
                );
                if trial.once {
                    bail!("{why}");
                }
                if !too_few.contains(&driver.driver) {
                    println!("{why}; waiting for more (edit the fixture)");
                    too_few.push(driver.driver.clone());
                }
                continue;
            }
            waiting.retain(|d| *d != driver.driver);
            let outcome = claim(kubelet, api, cdi_dir, &driver.driver, trial.allocate).await;
            match outcome {
                Ok(text) => println!("{text}"),
                Err(e) if trial.once => return Err(e),
                Err(e) => println!("{e:#}"),
            }
        }
        if waiting.is_empty() && !watching {
            if trial.once {
                return Ok(());
            }
            println!("watching the fixture for changes (edits stay in it); Ctrl-C to stop");
            watching = true;
        }
    }
}

/// Allocates a claim for `count` devices of `driver`, prepares and unprepares it; what happened.
async fn claim(
    kubelet: &Simulator,
    api: &ApiServer,
    cdi_dir: &Path,
    driver: &str,
    count: usize,
) -> anyhow::Result<String> {
    let name = format!("try-{}", driver.split('.').next().unwrap_or("claim"));
    let object = api
        .handle()
        .allocate_claim("default", &name, driver, NODE, count)
        .map_err(|e| anyhow!("allocating a claim for {count} device(s) of {driver}: {e}"))?;
    let uid = object["metadata"]["uid"].as_str().unwrap_or_default();
    let wire = Claim {
        namespace: "default".into(),
        uid: uid.into(),
        name: name.clone(),
    };
    let mut answer = kubelet
        .node_prepare_resources(driver, vec![wire.clone()])
        .await
        .with_context(|| format!("NodePrepareResources for claim default/{name}"))?;
    let prepared = answer.claims.remove(uid).unwrap_or_default();
    if !prepared.error.is_empty() {
        bail!(
            "claim default/{name} for {count} device(s) of {driver} failed: {}",
            prepared.error
        );
    }
    let mut text = format_prepared(driver, &name, uid, &prepared);
    text.push_str(&claim_status(api, &name).await);
    let spec = cdi_dir.join(format!("devicelet-dra_{driver}_{uid}.json"));
    text.push_str(&format_spec(&spec));
    let unprepared = kubelet
        .node_unprepare_resources(driver, vec![wire])
        .await
        .with_context(|| format!("NodeUnprepareResources for claim default/{name}"))?;
    match unprepared.claims.get(uid).map(|c| c.error.as_str()) {
        Some("") if spec.exists() => {
            bail!("claim default/{name} unprepared, but its CDI spec is still there")
        }
        Some("") => {
            let _ = write!(text, "\n  unprepared: its CDI spec removed");
        }
        Some(e) => bail!("unpreparing claim default/{name} failed: {e}"),
        None => bail!("unpreparing claim default/{name}: no answer for it"),
    }
    Ok(text)
}

/// What a claim's CDI spec gives a container: its devices' edits.
fn format_spec(path: &PathBuf) -> String {
    let spec: Value = match std::fs::read(path)
        .map_err(|e| e.to_string())
        .and_then(|b| serde_json::from_slice(&b).map_err(|e| e.to_string()))
    {
        Ok(spec) => spec,
        Err(e) => return format!("\n  CDI spec {}: {e}", path.display()),
    };
    let mut text = format!(
        "\n  its CDI spec (kind {}) gives the container:",
        spec["kind"]
    );
    let mut edits: Vec<&Value> = vec![&spec["containerEdits"]];
    edits.extend(
        spec["devices"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|d| &d["containerEdits"]),
    );
    for e in edits {
        for env in e["env"].as_array().into_iter().flatten() {
            let _ = write!(text, "\n    env {}", env.as_str().unwrap_or("?"));
        }
        for n in e["deviceNodes"].as_array().into_iter().flatten() {
            let _ = write!(text, "\n    device {}", n["path"].as_str().unwrap_or("?"));
            if let Some(host) = n["hostPath"].as_str() {
                let _ = write!(text, " (host {host})");
            }
        }
        for m in e["mounts"].as_array().into_iter().flatten() {
            let _ = write!(
                text,
                "\n    mount {} at {}",
                m["hostPath"].as_str().unwrap_or("?"),
                m["containerPath"].as_str().unwrap_or("?")
            );
        }
    }
    text
}
