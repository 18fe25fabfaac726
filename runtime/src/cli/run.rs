//! `devicelet run`: the agent.

use std::path::PathBuf;

use anyhow::Context;

use crate::agent::{Agent, AgentOptions};
use crate::config::Registry;
use crate::kubelet::route::Route;

#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// The module registry (TOML).
    #[arg(long)]
    pub config: PathBuf,
    /// The kubelet's device-plugin directory, where `kubelet.sock` lives.
    #[arg(long, default_value = "/var/lib/kubelet/device-plugins")]
    pub kubelet_dir: PathBuf,
    /// The kubelet's PodResources socket, asked which pod holds which device.
    #[arg(long, default_value = "/var/lib/kubelet/pod-resources/kubelet.sock")]
    pub pod_resources_socket: PathBuf,
    /// Where the allocation ledger and the status socket live (created 0700). It, and every
    /// directory above it, must belong to root or the agent's user and be writable by nobody
    /// else (sticky ones excepted), or the agent refuses to start.
    #[arg(long, default_value = "/var/lib/devicelet")]
    pub state_dir: PathBuf,
    /// Where compiled modules are kept between starts (created 0700; must be ours and, with
    /// every directory above it, writable by nobody else, or it is not used and modules are
    /// compiled in memory). Defaults to `cache` in the state directory: /var/lib/devicelet/cache.
    #[arg(long)]
    pub cache_dir: Option<PathBuf>,
    /// Modules compiled ahead of time (`devicelet precompile`), looked in when the cache has no
    /// entry: the image carries the reference modules there, so a new node's first start
    /// compiles none of them. Used only when it exists, under the cache's trust rules; an entry
    /// made for another wasmtime or other CPU features is not found, and the module compiles.
    #[arg(long, default_value = "/opt/devicelet/precompiled")]
    pub precompiled_dir: PathBuf,
    /// How often the ledger is reconciled with PodResources, e.g. 30s.
    #[arg(long, default_value = "30s", value_parser = crate::config::parse_duration)]
    pub reconcile_interval: std::time::Duration,
    /// Where CDI spec files are written, for resources whose `device-list-strategy` uses CDI
    /// (the directory container runtimes read transient specs from). Nothing is written, and
    /// Allocate lists devices instead, while it or a directory above it is writable by others
    /// than root and the agent's user.
    #[arg(long, default_value = crate::cdi::DEFAULT_DIR)]
    pub cdi_dir: PathBuf,
    /// Ignore edits of the registry and module files until restarted.
    #[arg(long)]
    pub no_hot_reload: bool,
    /// How resources register with the kubelet: `Register` on `kubelet.sock` in the kubelet
    /// directory, or a socket per resource in the plugin watcher's directory, which the kubelet
    /// finds by itself (after its own restarts too).
    #[arg(long, value_enum, default_value_t = RegistrationRoute::KubeletSocket)]
    pub registration: RegistrationRoute,
    /// The kubelet plugin watcher's directory, for `--registration plugin-watcher`.
    #[arg(long, default_value = crate::kubelet::api::pluginregistration::DEFAULT_DIR)]
    pub plugins_registry_dir: PathBuf,
    /// Serve Prometheus metrics on `/metrics` and the liveness and readiness probes on
    /// `/healthz` and `/readyz` at this address (e.g. 0.0.0.0:9310). Off when not given.
    #[arg(long)]
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// This node's name, which the DRA front end needs (its ResourceSlices' pool and
    /// `spec.nodeName`): without it, modules with `front-end = "dra"` are not served. A
    /// DaemonSet sets NODE_NAME from the pod's `spec.nodeName`.
    #[arg(long, env = "NODE_NAME")]
    pub node_name: Option<String>,
    /// A kubeconfig for the DRA front end's API server, to run outside a cluster; in a pod the
    /// service account is used.
    #[arg(long)]
    pub kubeconfig: Option<PathBuf>,
    /// The kubelet's plugins directory, where each DRA driver's service socket goes
    /// (`<dir>/<driver>/dra.sock`); its registration socket goes in `--plugins-registry-dir`.
    #[arg(long, default_value = "/var/lib/kubelet/plugins")]
    pub kubelet_plugins_dir: PathBuf,
    /// How often each DRA driver compares its ResourceSlices with its devices when nothing
    /// changed (slices wiped or edited by others come back within it).
    #[arg(long, default_value = "10s", value_parser = crate::config::parse_duration)]
    pub dra_resync: std::time::Duration,
    #[command(flatten)]
    pub libraries: super::LibraryArgs,
    #[command(flatten)]
    pub registries: super::RegistryArgs,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum RegistrationRoute {
    KubeletSocket,
    PluginWatcher,
}

/// A `host-root` that is a fixture node as `try` takes it (`sys/` and a `dev.list`, no `dev/`)
/// has no device nodes: every module would find its devices missing and say only that. `run`
/// serves a node's real `/dev`; the fixture is for `try` and `validate`, which make its nodes.
fn refuse_a_bare_fixture(host_root: &std::path::Path) -> anyhow::Result<()> {
    if host_root.join("dev.list").is_file() && !host_root.join("dev").is_dir() {
        anyhow::bail!(
            "host-root {} is a fixture node (a dev.list and no dev/): `run` serves a node's real \
             device nodes, so every device would be missing. Try a module on it with `devicelet \
             try --module M.wasm --fixture {}` (which makes its device nodes), or check a \
             registry with `devicelet validate` (which does too)",
            host_root.display(),
            host_root.display()
        );
    }
    Ok(())
}

/// How long start-up may take before the binary's start-up pages are released anyway: long
/// past any warm start (milliseconds) or cold compile (seconds), and still soon enough that an
/// agent kept unready (a kubelet not up, a failing pull) does not hold them for its lifetime.
const START_UP_LIMIT: std::time::Duration = std::time::Duration::from_secs(120);

pub async fn run(args: RunArgs) -> anyhow::Result<()> {
    let registry = Registry::load(&args.config)?;
    refuse_a_bare_fixture(&registry.host_root)?;
    let mut options = AgentOptions::new(registry, args.kubelet_dir);
    let cache_dir = args
        .cache_dir
        .unwrap_or_else(|| args.state_dir.join("cache"));
    options.cache_dir = Some(cache_dir);
    options.precompiled_dir = Some(args.precompiled_dir);
    options.state_dir = Some(args.state_dir);
    options.pod_resources = Some(args.pod_resources_socket);
    options.reconcile_interval = args.reconcile_interval;
    options.reconcile_grace = args.reconcile_interval * 2;
    options.hot_reload = !args.no_hot_reload;
    options.cdi_dir = args.cdi_dir;
    options.libraries = args.libraries.libraries();
    options.registry_access = args.registries.access()?;
    options.registration = match args.registration {
        RegistrationRoute::KubeletSocket => Route::KubeletSocket,
        RegistrationRoute::PluginWatcher => Route::PluginWatcher(args.plugins_registry_dir.clone()),
    };
    options.metrics_addr = args.metrics_addr;
    if let Some(node) = args.node_name {
        let wanted = options
            .registry
            .modules
            .iter()
            .any(|m| crate::agent::front_ends::kind_of(m).needs_api_server());
        let api = match crate::dra::api::ApiClient::connect(args.kubeconfig.as_deref()).await {
            Ok(api) => Some(api),
            Err(e) if wanted => return Err(e).context("the DRA front end"),
            Err(e) => {
                tracing::warn!("{e}; modules with front-end = \"dra\" would not be served");
                None
            }
        };
        options.dra = Some(crate::dra::driver::DraOptions {
            registry_dir: args.plugins_registry_dir.clone(),
            plugins_dir: args.kubelet_plugins_dir,
            node,
            api,
            state_dir: options.state_dir.clone(),
            cdi_dir: options.cdi_dir.clone(),
            resync: args.dra_resync,
            events: Default::default(),
            retirees: Default::default(),
        });
    }
    // Each module says `serving` (resource, socket) as it starts, in Agent::start.
    let agent = Agent::start(options).await.context("starting the agent")?;
    // Start-up's code (argument parsing, validation, loading and linking modules) is not run
    // again: its pages of the binary leave the resident set once every resource is registered.
    let started_up = agent.started_up(START_UP_LIMIT);
    tokio::spawn(async move {
        started_up.await;
        let released = crate::footprint::release_start_up_pages();
        tracing::debug!(bytes = released, "released the binary's start-up pages");
    });
    super::stop_signal().await?;
    tracing::info!("stopping");
    agent.shutdown().await;
    Ok(())
}
