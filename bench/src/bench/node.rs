//! A fixture node for the benchmarks, laid out as the scenario tests do: a `/` tree with device
//! nodes, the kubelet simulator on its device-plugin directory, and a registry of modules.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use tonic::transport::Channel;

use devicelet::agent::{Agent, AgentOptions};
use devicelet::config::Registry;
use devicelet::fixture::{FixtureTree, NodeType};
use devicelet::kubelet::api::deviceplugin::device_plugin_client::DevicePluginClient;
use devicelet::kubelet::uds;
use devicelet_simulator::{SimConfig, Simulator};

/// Bounds a hang; the benchmarks wait on events, not on this.
pub const WAIT: Duration = Duration::from_secs(30);

/// The resource domain every benchmark registry uses.
pub const DOMAIN: &str = "devicelet.io";

pub struct Node {
    pub dir: tempfile::TempDir,
    pub tree: FixtureTree,
    pub sim: Simulator,
}

impl Node {
    /// A fresh node whose kubelet (the simulator) serves with `config`; its PodResources socket
    /// lives inside the node's directory, so nodes never collide.
    pub async fn start(config: SimConfig) -> anyhow::Result<Node> {
        let dir = tempfile::tempdir().context("creating a scratch directory")?;
        let tree = FixtureTree::new(&dir.path().join("root"))?;
        let config = SimConfig {
            pod_resources_socket: Some(dir.path().join("pod-resources/kubelet.sock")),
            ..config
        };
        let sim = Simulator::start_with(&dir.path().join("device-plugins"), config).await?;
        Ok(Node { dir, tree, sim })
    }

    pub fn plugin_dir(&self) -> PathBuf {
        self.sim.plugin_dir().to_owned()
    }

    pub fn add_char(&self, path: &str, major: u32, minor: u32) -> anyhow::Result<()> {
        Ok(self.tree.add_node(path, NodeType::Char, major, minor)?)
    }

    /// Ten FUSE nodes, `/dev/fuse-0` .. `/dev/fuse-9` (the device IDs generic-dev gives them:
    /// `fuse-0` ..), all 10:229: ten devices a benchmark can name apart, so a two-device
    /// Allocate asks the module for two.
    pub fn add_fuses(&self) -> anyhow::Result<()> {
        for i in 0..10 {
            self.add_char(&format!("/dev/fuse-{i}"), 10, 229)?;
        }
        Ok(())
    }

    /// Writes `registry.toml` (`host-root` = this node's tree) with the given `[[module]]`
    /// entries and returns its path.
    pub fn registry(&self, modules: &str) -> anyhow::Result<PathBuf> {
        let file = self.dir.path().join("registry.toml");
        let text = format!(
            "host-root = {:?}\nresource-domain = {DOMAIN:?}\n\n{modules}",
            self.tree.root().display().to_string(),
        );
        std::fs::write(&file, text).with_context(|| format!("writing {}", file.display()))?;
        Ok(file)
    }

    /// The common case: ten FUSE nodes in the tree ([`Node::add_fuses`]) and generic-dev serving
    /// them as `fuse`, polled every 5 s.
    pub fn fuse_registry(&self, module_dir: &Path) -> anyhow::Result<PathBuf> {
        self.add_fuses()?;
        self.registry(&generic_dev(
            module_dir,
            "generic-dev",
            "fuse",
            "/dev/fuse-*",
            "5s",
        ))
    }

    /// The agent in this process, without hot reload; `state_dir` None keeps the ledger in
    /// memory.
    pub async fn start_agent(
        &self,
        registry: &Path,
        state_dir: Option<PathBuf>,
    ) -> anyhow::Result<Agent> {
        self.start_agent_with(registry, |o| o.state_dir = state_dir)
            .await
    }

    /// [`start_agent`](Self::start_agent), after letting `adjust` change its options.
    pub async fn start_agent_with(
        &self,
        registry: &Path,
        adjust: impl FnOnce(&mut AgentOptions),
    ) -> anyhow::Result<Agent> {
        let registry = Registry::load(registry)?;
        let mut options = AgentOptions::new(registry, self.plugin_dir());
        options.hot_reload = false;
        options.cdi_dir = self.dir.path().join("cdi");
        adjust(&mut options);
        let agent = Agent::start(options).await?;
        if let Some(e) = agent.load_errors().first() {
            anyhow::bail!("{e}");
        }
        Ok(agent)
    }

    /// Waits until the simulated kubelet has `resource` registered, streaming, with a snapshot.
    pub async fn wait_served(&self, resource: &str) -> anyhow::Result<()> {
        self.sim
            .wait_until(resource, WAIT, |r| r.streaming && r.snapshots > 0)
            .await?;
        Ok(())
    }

    /// A kubelet-style client on the socket `resource` registered with.
    pub async fn client(&self, resource: &str) -> anyhow::Result<DevicePluginClient<Channel>> {
        let state = self
            .sim
            .resource(resource)
            .with_context(|| format!("{resource} is not registered"))?;
        client(&self.plugin_dir().join(state.endpoint)).await
    }
}

/// The kubelet's client: tonic over a Unix socket.
pub async fn client(socket: &Path) -> anyhow::Result<DevicePluginClient<Channel>> {
    let channel = uds::connect(socket)
        .await
        .with_context(|| format!("connecting to {}", socket.display()))?;
    Ok(DevicePluginClient::new(channel))
}

/// `DOMAIN/suffix`.
pub fn resource(suffix: &str) -> String {
    format!("{DOMAIN}/{suffix}")
}

/// A generic-dev entry named `name` serving one group `group` of the nodes matching `paths`,
/// re-enumerated every `health_interval`.
pub fn generic_dev(
    module_dir: &Path,
    name: &str,
    group: &str,
    paths: &str,
    health_interval: &str,
) -> String {
    format!(
        r#"[[module]]
name = "{name}"
path = "{}"
health-interval = "{health_interval}"

[module.grants]
dev = ["/dev/*"]

[module.config]
groups = [{{ name = "{group}", paths = ["{paths}"] }}]

"#,
        module_dir.join("generic_dev.wasm").display()
    )
}

/// A misbehaving entry named `name` with `config` (TOML key/values for `[module.config]`).
pub fn misbehaving(module_dir: &Path, name: &str, config: &str) -> String {
    format!(
        r#"[[module]]
name = "{name}"
path = "{}"

[module.grants]
sysfs = ["/sys/testing"]

[module.config]
{config}

"#,
        module_dir.join("misbehaving.wasm").display()
    )
}

/// `count` generic-dev modules `gd-0` .. on `/dev/fuse-*`, serving `fuse0` ..; returns the
/// registry entries and the resource names. Each module is its own file in `copies` (generic-dev
/// with a custom section naming the copy), so each has its own digest and is compiled, cached
/// and held in memory on its own, as distinct vendors' modules are.
pub fn fuse_modules(
    module_dir: &Path,
    copies: &Path,
    count: usize,
) -> anyhow::Result<(String, Vec<String>)> {
    let original = std::fs::read(module_dir.join("generic_dev.wasm"))?;
    std::fs::create_dir_all(copies)?;
    let mut entries = String::new();
    for i in 0..count {
        let copy = copies.join(format!("gd-{i}.wasm"));
        std::fs::write(&copy, with_custom_section(&original, &format!("copy-{i}")))?;
        let entry = generic_dev(
            module_dir,
            &format!("gd-{i}"),
            &format!("fuse{i}"),
            "/dev/fuse-*",
            "5s",
        );
        entries += &entry.replace(
            &module_dir.join("generic_dev.wasm").display().to_string(),
            &copy.display().to_string(),
        );
    }
    let names = (0..count).map(|i| resource(&format!("fuse{i}"))).collect();
    Ok((entries, names))
}

/// `wasm` with a custom section `devicelet-bench` holding `payload` appended: the same code, a
/// different file.
fn with_custom_section(wasm: &[u8], payload: &str) -> Vec<u8> {
    const NAME: &[u8] = b"devicelet-bench";
    let mut body = vec![NAME.len() as u8];
    body.extend_from_slice(NAME);
    body.extend_from_slice(payload.as_bytes());
    let mut out = wasm.to_vec();
    out.push(0); // custom section id
    let mut size = body.len();
    loop {
        let byte = (size & 0x7f) as u8;
        size >>= 7;
        if size == 0 {
            out.push(byte);
            break;
        }
        out.push(byte | 0x80);
    }
    out.extend_from_slice(&body);
    out
}
