//! `devicelet simulate --dra`: an API server stand-in beside the simulated kubelet, and a
//! transcript of the DRA drivers that register: their endpoints, what they publish, and the
//! claims `--claim` has allocated and prepared.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use anyhow::{Context, anyhow, bail};
use serde_json::json;

use super::dra_show::{claim_status, device_count, format_prepared, published};
use super::simulate::{ClaimRequest, SimulateArgs};
use crate::kubelet::api::dra::v1::Claim;
use devicelet_simulator::apiserver::{ApiServer, Kind};
use devicelet_simulator::{DraService, Simulator};

/// How often the drivers are looked at.
const POLL: Duration = Duration::from_millis(250);

/// Starts the API server stand-in with the node, writes its kubeconfig and says how to serve
/// DRA drivers against it.
pub async fn start(args: &SimulateArgs) -> anyhow::Result<ApiServer> {
    let Some(registry) = &args.plugins_registry_dir else {
        bail!(
            "--dra needs --plugins-registry-dir: DRA drivers register only by the plugin watcher"
        );
    };
    if !devicelet_api::names::is_dns1123_subdomain(&args.node_name) {
        bail!(
            "--node-name {:?} is not a node name (a DNS subdomain)",
            args.node_name
        );
    }
    let api = ApiServer::start()
        .await
        .context("starting the API server stand-in")?;
    api.create(
        Kind::Node,
        "",
        json!({"metadata": {"name": args.node_name}}),
    )
    .map_err(|e| anyhow!("creating the Node: {}", e.message))?;
    let kubeconfig = args.kubeconfig_out.clone().unwrap_or_else(|| {
        args.dir
            .parent()
            .unwrap_or(&args.dir)
            .join("dra-kubeconfig")
    });
    crate::files::write_file_atomically(&kubeconfig, api.kubeconfig().as_bytes(), 0o600)
        .with_context(|| format!("writing {}", kubeconfig.display()))?;
    println!(
        "API server stand-in on {} holding node {}; its kubeconfig: {}",
        api.url(),
        args.node_name,
        kubeconfig.display()
    );
    println!(
        "serve DRA drivers here with: devicelet run --config <registry> --node-name {} \
         --kubeconfig {} --plugins-registry-dir {} --kubelet-plugins-dir <a directory>",
        args.node_name,
        kubeconfig.display(),
        registry.display()
    );
    Ok(api)
}

/// Prints the DRA side of the node until dropped.
pub struct Transcript(tokio::task::JoinHandle<()>);

impl Drop for Transcript {
    fn drop(&mut self) {
        self.0.abort();
    }
}

pub fn watch(
    api: ApiServer,
    sim: Simulator,
    node: String,
    claims: Vec<ClaimRequest>,
) -> Transcript {
    Transcript(tokio::spawn(transcript(api, sim, node, claims)))
}

async fn transcript(api: ApiServer, sim: Simulator, node: String, claims: Vec<ClaimRequest>) {
    // Each request, and whether its failure to allocate was said.
    let mut claims: Vec<(ClaimRequest, bool)> = claims.into_iter().map(|c| (c, false)).collect();
    let mut endpoints: BTreeSet<(String, String)> = BTreeSet::new();
    let mut shown: BTreeMap<String, String> = BTreeMap::new();
    let mut made = 0u32;
    let mut ticker = tokio::time::interval(POLL);
    loop {
        ticker.tick().await;
        let registrations = sim.dra_registrations();
        let now: BTreeSet<(String, String)> = registrations
            .iter()
            .map(|r| (r.driver.clone(), r.endpoint.clone()))
            .collect();
        for r in &registrations {
            if !endpoints.contains(&(r.driver.clone(), r.endpoint.clone())) {
                let service = match r.service {
                    DraService::V1 => "v1.DRAPlugin",
                    DraService::V1beta1 => "v1beta1.DRAPlugin",
                };
                println!(
                    "DRA driver {} registered at endpoint {} ({service})",
                    r.driver, r.endpoint
                );
            }
        }
        for (driver, endpoint) in endpoints.difference(&now) {
            println!("DRA driver {driver}: endpoint {endpoint} deregistered");
        }
        endpoints = now;
        let mut drivers: BTreeSet<String> = endpoints.iter().map(|(d, _)| d.clone()).collect();
        drivers.extend(
            api.list(Kind::ResourceSlice)
                .iter()
                .filter_map(|s| s["spec"]["driver"].as_str().map(str::to_owned)),
        );
        drivers.extend(shown.keys().cloned());
        for driver in &drivers {
            let text = published(&api, driver, &node);
            if shown.get(driver) != Some(&text) {
                println!(
                    "{driver}: {} device(s) published{text}",
                    device_count(&api, driver)
                );
                shown.insert(driver.clone(), text);
            }
        }
        let ready: Vec<(ClaimRequest, bool)>;
        (ready, claims) = claims.into_iter().partition(|(c, _)| {
            endpoints.iter().any(|(d, _)| *d == c.driver)
                && device_count(&api, &c.driver) >= c.count
        });
        for (request, said) in ready {
            let name = format!("sim-claim-{}", made + 1);
            match claim(&api, &sim, &node, &name, &request).await {
                Ok(text) => {
                    made += 1;
                    println!("{text}");
                }
                // Not allocatable yet (an incomplete pool, an older generation's slices):
                // tried again at the next look, said once.
                Err(e) => {
                    if !said {
                        println!("{e}; trying again as the pool changes");
                    }
                    claims.push((request, true));
                }
            }
        }
    }
}

/// Allocates and prepares one claim: what happened, or Err when nothing could be allocated.
async fn claim(
    api: &ApiServer,
    sim: &Simulator,
    node: &str,
    name: &str,
    request: &ClaimRequest,
) -> Result<String, String> {
    let ClaimRequest {
        driver,
        count,
        request,
    } = request;
    let object = api
        .handle()
        .allocate_claim_with("default", name, driver, node, request)
        .map_err(|e| format!("claim for {count} device(s) of {driver}: {e}"))?;
    let uid = object["metadata"]["uid"].as_str().unwrap_or_default();
    let wire = Claim {
        namespace: "default".into(),
        uid: uid.into(),
        name: name.into(),
    };
    Ok(match sim.node_prepare_resources(driver, vec![wire]).await {
        Ok(mut answer) => match answer.claims.remove(uid) {
            Some(prepared) if prepared.error.is_empty() => {
                format_prepared(driver, name, uid, &prepared) + &claim_status(api, name).await
            }
            Some(prepared) => format!("claim default/{name} failed: {}", prepared.error),
            None => format!("claim default/{name}: the driver answered nothing for it"),
        },
        Err(e) => format!("NodePrepareResources for claim default/{name} failed: {e}"),
    })
}
