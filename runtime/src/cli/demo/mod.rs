//! `devicelet demo`: the agent with the reference module, a fixture device tree and the kubelet
//! simulator, all in one process, showing registration, devices, allocations and a hot-unplug
//! through the device-plugin API; then the same module through Dynamic Resource Allocation: a
//! driver registered, its ResourceSlice published, a claim allocated by the scheduler's rules,
//! prepared (CDI devices, the claim's status) and unprepared; then the module pushed to a local
//! OCI registry, signed, and pulled by digest with its signature checked (`oci.rs`).

mod oci;

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;

use crate::agent::{Agent, AgentOptions};
use crate::config::Registry;
use crate::fixture::{FixtureTree, NodeType};
use crate::kubelet::api::deviceplugin::{ContainerAllocateResponse, Device};
use crate::metrics::http::get;
use devicelet_simulator::Simulator;

const REGISTRY: &str = include_str!("registry.toml");
const DRA_REGISTRY: &str = include_str!("dra.toml");
const WAIT: Duration = Duration::from_secs(10);

#[derive(clap::Args, Debug)]
pub struct DemoArgs {
    /// Directory holding the compiled reference modules (`generic_dev.wasm`).
    #[arg(long, default_value = "target/wasm32-wasip2/release")]
    pub module_dir: PathBuf,
}

pub async fn run(args: DemoArgs) -> anyhow::Result<()> {
    let work = tempfile::tempdir().context("creating a scratch directory")?;
    let tree = FixtureTree::new(&work.path().join("node"))?;
    tree.add_node("/dev/fuse", NodeType::Char, 10, 229)?;
    tree.add_node("/dev/net/tun", NodeType::Char, 10, 200)?;
    tree.add_node("/dev/ttyUSB0", NodeType::Char, 188, 0)?;
    tree.add_node("/dev/ttyUSB1", NodeType::Char, 188, 1)?;
    println!("fixture node tree: {}", tree.root().display());

    let module_dir = std::path::absolute(&args.module_dir)?;
    let registry_of = |text: &str, file: std::path::PathBuf| -> anyhow::Result<Registry> {
        std::fs::write(
            &file,
            text.replace("@HOST_ROOT@", &tree.root().display().to_string())
                .replace("@MODULE_DIR@", &module_dir.display().to_string()),
        )?;
        Ok(Registry::load(&file)?)
    };
    let registry = registry_of(REGISTRY, work.path().join("registry.toml"))?;

    let plugin_dir = work.path().join("device-plugins");
    let kubelet = Simulator::start(&plugin_dir).await?;
    println!(
        "kubelet simulator listening on {}",
        plugin_dir.join("kubelet.sock").display()
    );

    // One compile cache for the three parts: the module is compiled once, by the first (the
    // OCI part pulls the same bytes).
    let cache = work.path().join("cache");
    let mut options = AgentOptions::new(registry, plugin_dir.clone());
    options.hot_reload = false;
    options.cdi_dir = work.path().join("cdi");
    options.cache_dir = Some(cache.clone());
    options.metrics_addr = Some(std::net::SocketAddr::from(([127, 0, 0, 1], 0)));
    let agent = Agent::start(options).await?;
    if let Some(e) = agent.load_errors().first() {
        anyhow::bail!("{e}");
    }
    for served in agent.resources() {
        let state = kubelet
            .wait_until(&served.name, WAIT, |r| r.streaming && r.snapshots > 0)
            .await?;
        println!(
            "\nregistered {} (module {}, endpoint {})\n  capacity {}, allocatable {}: {}",
            state.name,
            served.module,
            state.endpoint,
            state.capacity,
            state.allocatable,
            devices(&state.devices)
        );
    }

    for served in agent.resources() {
        let Some(cdi) = &served.cdi else { continue };
        let mut view = cdi.naming.view.clone();
        let view = tokio::time::timeout(WAIT, view.wait_for(|v| v.is_some())).await??;
        let devices = view.as_ref().map_or(0, |v| v.len());
        println!(
            "CDI spec for {}: {} ({devices} devices)",
            served.name,
            cdi.path.display()
        );
    }

    for (resource, count) in [("devicelet.io/fuse", 2), ("devicelet.io/serial", 1)] {
        let a = kubelet.allocate(resource, count).await?;
        println!("\nallocated {count} × {resource}: {:?}", a.device_ids);
        if let Some(p) = &a.preferred {
            println!("  GetPreferredAllocation answered {p:?}");
        }
        print_response(&a.response);
        if a.prestarted {
            println!("  PreStartContainer: ok");
        }
    }

    println!("\nunplugging /dev/ttyUSB1 …");
    tree.remove("/dev/ttyUSB1")?;
    let state = kubelet
        .wait_until("devicelet.io/serial", WAIT, |r| r.capacity == 1)
        .await?;
    println!(
        "  new snapshot of devicelet.io/serial: {}",
        devices(&state.devices)
    );

    if let Some(addr) = agent.metrics_addr() {
        println!(
            "\nhttp://{addr}/readyz: {}",
            get(addr, "/readyz").await?.1.trim()
        );
        println!("http://{addr}/metrics (devices and calls):");
        let (_, metrics) = get(addr, "/metrics").await?;
        for line in metrics.lines().filter(|l| {
            l.starts_with("devicelet_resource_devices")
                || l.starts_with("devicelet_module_call_duration_seconds_count")
        }) {
            println!("  {line}");
        }
    }

    agent.shutdown().await;
    kubelet.shutdown().await;

    println!("\n— the same module through Dynamic Resource Allocation —");
    let dra = work.path().join("dra");
    std::fs::create_dir_all(&dra)?;
    let registry = registry_of(DRA_REGISTRY, dra.join("registry.toml"))?;
    super::try_dra::run(super::try_dra::Trial {
        work: &dra,
        registry,
        allocate: 1,
        once: true,
        libraries: crate::nvml::Libraries::default(),
        cache_dir: Some(cache.clone()),
        changed: None,
        reload: &|| {},
    })
    .await
    .context("the DRA part")?;
    let oci = work.path().join("oci");
    std::fs::create_dir_all(&oci)?;
    oci::run(&oci, &cache, &module_dir, tree.root())
        .await
        .context("the OCI part")?;
    println!("\ndone");
    Ok(())
}

fn devices(devices: &[Device]) -> String {
    devices
        .iter()
        .map(|d| format!("{} ({})", d.id, d.health))
        .collect::<Vec<_>>()
        .join(", ")
}

fn print_response(r: &ContainerAllocateResponse) {
    for d in &r.devices {
        println!(
            "  device {} -> {} ({})",
            d.host_path, d.container_path, d.permissions
        );
    }
    for m in &r.mounts {
        println!(
            "  mount {} -> {} (read-only: {})",
            m.host_path, m.container_path, m.read_only
        );
    }
    let mut envs: Vec<_> = r.envs.iter().collect();
    envs.sort();
    for (k, v) in envs {
        println!("  env {k}={v}");
    }
    for c in &r.cdi_devices {
        println!("  cdi {}", c.name);
    }
}
