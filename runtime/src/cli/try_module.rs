//! `devicelet try`: one module against a fixture node, the agent and the kubelet simulator in
//! one process, for a vendor trying a module before shipping it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, bail};
use tokio::sync::broadcast::error::RecvError;

use super::simulate::{describe, format_allocation};
use crate::agent::{Agent, AgentOptions};
use crate::config::Registry;
use crate::fixture::FixtureTree;
use devicelet_simulator::{SimEvent, Simulator};

/// Granted when `--config` grants nothing itself: all of the fixture.
const DEFAULT_GRANTS: &str = "[module.grants]\nsysfs = [\"/sys/bus\", \"/sys/class\", \"/sys/devices\"]\ndev = [\"/dev/*\", \"/dev/*/*\"]\n";

#[derive(clap::Args, Debug)]
pub struct TryArgs {
    /// The module to try (a `.wasm` component).
    #[arg(long)]
    pub module: PathBuf,
    /// A fixture node: `sys/` (files and symlinks as on a node) and `dev.list` (device nodes, one
    /// per line: `c <major>:<minor> /dev/<path>`). Edits to it while running reach the module.
    #[arg(long)]
    pub fixture: PathBuf,
    /// The module's registry keys, as under `[[module]]` in a registry (`resource-domain`,
    /// `[module.grants]`, `[module.sharing]`, `[module.config]`...). Without `[module.grants]`,
    /// the whole fixture is granted.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// How many devices one container asks for, from each resource.
    #[arg(long, default_value_t = 1)]
    pub allocate: usize,
    /// Stop after the allocations instead of watching the fixture until Ctrl-C.
    #[arg(long)]
    pub once: bool,
}

/// The registry `try` runs: the fixture as host root, the module under a name made from its
/// file name, then the operator's keys.
fn registry_text(root: &Path, module: &Path, config: &str) -> String {
    let stem = module
        .file_stem()
        .map(|s| s.to_string_lossy().to_lowercase())
        .unwrap_or_default();
    let mut name: String = stem
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect();
    name = name.trim_matches('-').to_owned();
    if name.is_empty() || !name.starts_with(|c: char| c.is_ascii_lowercase()) {
        name = format!("module-{name}").trim_end_matches('-').to_owned();
    }
    let mut text = format!(
        "host-root = {:?}\n\n[[module]]\nname = {name:?}\npath = {:?}\n",
        root.display().to_string(),
        module.display().to_string()
    );
    if !config.contains("health-interval") {
        text.push_str("health-interval = \"1s\"\n");
    }
    text.push_str(config);
    if !config.contains("[module.grants]") {
        text.push('\n');
        text.push_str(DEFAULT_GRANTS);
    }
    text
}

pub async fn run(args: TryArgs) -> anyhow::Result<()> {
    let module = std::path::absolute(&args.module)?;
    if !module.is_file() {
        bail!("{}: no such module file", module.display());
    }
    let fixture = std::path::absolute(&args.fixture)?;
    let config = match &args.config {
        Some(path) => {
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?
        }
        None => String::new(),
    };
    let work = tempfile::tempdir().context("creating a scratch directory")?;
    let tree = FixtureTree::new(&work.path().join("node"))?;
    tree.load(&fixture)
        .with_context(|| format!("loading the fixture {}", fixture.display()))?;
    let registry_file = work.path().join("registry.toml");
    std::fs::write(&registry_file, registry_text(tree.root(), &module, &config))?;
    let registry = Registry::load(&registry_file).with_context(|| match &args.config {
        Some(path) => format!(
            "the registry `try` made from {} (its lines follow a 5-line header)",
            path.display()
        ),
        None => "the registry `try` made".into(),
    })?;

    let plugin_dir = work.path().join("device-plugins");
    let kubelet = Simulator::start(&plugin_dir).await?;
    let mut events = kubelet.events();
    let mut options = AgentOptions::new(registry, plugin_dir);
    options.hot_reload = false;
    options.cdi_dir = work.path().join("cdi");
    println!(
        "trying {} on the fixture {} (scratch: {})",
        module.display(),
        fixture.display(),
        work.path().display()
    );
    let agent = Agent::start(options).await?;
    if let Some(e) = agent.load_errors().first() {
        agent.shutdown().await;
        bail!("{e}");
    }
    let mut waiting: Vec<String> = agent.resources().into_iter().map(|r| r.name).collect();
    if waiting.is_empty() {
        agent.shutdown().await;
        bail!("the module serves no resource");
    }

    let (changed_tx, mut changed) = tokio::sync::mpsc::channel::<()>(1);
    let _watch = if args.once {
        None
    } else {
        Some(watch_fixture(&fixture, changed_tx)?)
    };
    let stop = super::stop_signal();
    tokio::pin!(stop);
    let mut last_devices = BTreeMap::new();
    loop {
        let event = tokio::select! {
            result = &mut stop => { result?; break; }
            Some(()) = changed.recv() => {
                // Let an editor finish writing, then bring the node in line.
                tokio::time::sleep(Duration::from_millis(100)).await;
                while changed.try_recv().is_ok() {}
                match tree.load(&fixture) {
                    Ok(()) => println!("fixture changed: reloaded"),
                    Err(e) => println!("fixture changed, but cannot be loaded: {e}"),
                }
                continue;
            }
            event = events.recv() => event,
        };
        let event = match event {
            Ok(event) => event,
            Err(RecvError::Lagged(missed)) => {
                println!("(output fell behind: {missed} events not shown)");
                continue;
            }
            Err(RecvError::Closed) => break,
        };
        if let Some(text) = describe(&event, &mut last_devices) {
            println!("{text}");
        }
        if let SimEvent::Snapshot {
            resource,
            allocatable,
            ..
        } = &event
            && waiting.contains(resource)
            && *allocatable >= args.allocate
        {
            waiting.retain(|r| r != resource);
            match kubelet.allocate(resource, args.allocate).await {
                Ok(allocation) => println!("{}", format_allocation(&allocation)),
                Err(e) => println!("allocation of {} {resource} failed: {e}", args.allocate),
            }
            if args.once && waiting.is_empty() {
                break;
            }
            if waiting.is_empty() {
                println!("watching {} for changes; Ctrl-C to stop", fixture.display());
            }
        }
    }
    agent.shutdown().await;
    kubelet.shutdown().await;
    Ok(())
}

/// Wakes `changed` whenever something under the fixture changes (inotify).
fn watch_fixture(
    fixture: &Path,
    changed: tokio::sync::mpsc::Sender<()>,
) -> anyhow::Result<notify::RecommendedWatcher> {
    use notify::Watcher;
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        if event.is_ok() {
            let _ = changed.try_send(());
        }
    })?;
    watcher
        .watch(fixture, notify::RecursiveMode::Recursive)
        .with_context(|| format!("watching {}", fixture.display()))?;
    Ok(watcher)
}

#[cfg(test)]
mod tests {
    use super::registry_text;
    use std::path::Path;

    #[test]
    fn the_registry_names_the_module_after_its_file_and_grants_the_fixture_by_default() {
        let text = registry_text(Path::new("/tmp/n"), Path::new("/m/amd_gpu.wasm"), "");
        assert!(text.contains("name = \"amd-gpu\""), "{text}");
        assert!(text.contains("[module.grants]"), "{text}");
        let own = "[module.grants]\nsysfs = [\"/sys/bus/pci/devices/*\"]\n";
        let text = registry_text(Path::new("/tmp/n"), Path::new("/m/9x.wasm"), own);
        assert!(text.contains("name = \"module-9x\""), "{text}");
        assert_eq!(text.matches("[module.grants]").count(), 1, "{text}");
    }
}
