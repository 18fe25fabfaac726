//! `devicelet try`: one module against a fixture node, the agent and the kubelet simulator in
//! one process, for a vendor trying a module before shipping it. Everything it writes (the node
//! tree, sockets, the ledger and status socket, CDI specs) goes to a scratch directory removed
//! at the end; the fixture itself is only read.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, bail};

use super::simulate::{Shown, format_allocation, show};
use crate::agent::{Agent, AgentOptions};
use crate::config::Registry;
use crate::fixture::FixtureTree;
use devicelet_simulator::{SimEvent, Simulator};

/// Granted when `--config` grants nothing itself: all of the fixture.
const DEFAULT_GRANTS: &str = "[module.grants]\nsysfs = [\"/sys/bus\", \"/sys/class\", \"/sys/devices\"]\ndev = [\"/dev/*\", \"/dev/*/*\"]\n";

/// Keys `try` sets itself: the module is the file given, named after it.
const OWN_KEYS: [&str; 2] = ["name", "path"];

#[derive(clap::Args, Debug)]
pub struct TryArgs {
    /// The module to try (a `.wasm` component); it is named after its file (`my_gpu.wasm`:
    /// `my-gpu`).
    #[arg(long)]
    pub module: PathBuf,
    /// A fixture node: `sys/` (files and relative symlinks, as on a node) and `dev.list` (device
    /// nodes, one per line: `c <major>:<minor> /dev/<path>`). It is only read: edits to it while
    /// `try` runs reach the module.
    #[arg(long)]
    pub fixture: PathBuf,
    /// The module's registry keys, as under `[[module]]` in a registry (`resource-domain`,
    /// `[module.grants]`, `[module.sharing]`, `[module.config]`...), without `name` and `path`.
    /// Without grants, the whole fixture is granted.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// How many devices one container asks for, from each resource.
    #[arg(long, default_value_t = 1)]
    pub allocate: usize,
    /// Stop after the allocations instead of watching the fixture until Ctrl-C.
    #[arg(long)]
    pub once: bool,
    /// Serve the module through DRA (as `front-end = "dra"` in its config does): the kubelet's
    /// DRA plugin manager, an API server stand-in and the scheduler's allocator run in the
    /// process; a claim for `--allocate` devices of each driver is prepared, shown and
    /// unprepared.
    #[arg(long)]
    pub dra: bool,
    /// A compile cache to use and fill, as `run`'s (under the same trust rules): trying a module
    /// again compiles it only if it changed. Without it, the module is compiled in memory.
    #[arg(long)]
    pub cache_dir: Option<PathBuf>,
    #[command(flatten)]
    pub libraries: super::LibraryArgs,
}

/// What the operator's `--config` sets itself (read as TOML first, so a syntax error names
/// their file, line and column).
struct Given {
    grants: bool,
    front_end: bool,
    health_interval: bool,
    /// A key `try` sets itself, if the operator set it too.
    own: Option<&'static str>,
}

fn given(config: &str) -> Result<Given, toml::de::Error> {
    let table: toml::Table = toml::from_str(config)?;
    let in_module = |key: &str| {
        table.contains_key(key)
            || table
                .get("module")
                .and_then(|m| m.as_table())
                .is_some_and(|m| m.contains_key(key))
    };
    Ok(Given {
        grants: in_module("grants"),
        front_end: table.contains_key("front-end"),
        health_interval: table.contains_key("health-interval"),
        own: OWN_KEYS.into_iter().find(|k| table.contains_key(*k)),
    })
}

/// The module's name in the registry `try` makes: its file name, as a module name.
fn module_name(module: &Path) -> String {
    let stem = module
        .file_stem()
        .map(|s| s.to_string_lossy().to_lowercase())
        .unwrap_or_default();
    let name: String = stem
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect();
    let name = name.trim_matches('-');
    if name.starts_with(|c: char| c.is_ascii_lowercase()) {
        name.to_owned()
    } else {
        format!("module-{name}").trim_end_matches('-').to_owned()
    }
}

/// The registry `try` runs: the fixture as host root, the module, then the operator's keys
/// verbatim, so their lines keep their numbers after the header; with how many lines that is.
fn registry_text(
    root: &Path,
    module: &Path,
    config: &str,
    given: &Given,
    dra: bool,
) -> (String, usize) {
    let mut text = format!(
        "host-root = {:?}\n[[module]]\nname = {:?}\npath = {:?}\n",
        root.display().to_string(),
        module_name(module),
        module.display().to_string()
    );
    if dra && !given.front_end {
        text.push_str("front-end = \"dra\"\n");
    }
    if !given.health_interval {
        text.push_str("health-interval = \"1s\"\n");
    }
    let header = text.lines().count();
    text.push_str(config);
    if !given.grants {
        text.push('\n');
        text.push_str(DEFAULT_GRANTS);
    }
    (text, header)
}

/// Rewrites `registry:<line>` in a message as `config:<line - header>`, so an error points into
/// the operator's file rather than the scratch registry (which is gone by the time they read it).
fn relocate(message: &str, registry: &Path, config: Option<&Path>, header: usize) -> String {
    let Some(config) = config else {
        return message.to_owned();
    };
    let marker = format!("{}:", registry.display());
    let mut out = String::new();
    let mut rest = message;
    while let Some(at) = rest.find(&marker) {
        out.push_str(&rest[..at]);
        let after = &rest[at + marker.len()..];
        let digits = after.bytes().take_while(u8::is_ascii_digit).count();
        match after[..digits].parse::<usize>() {
            Ok(line) if line > header => {
                out.push_str(&format!("{}:{}", config.display(), line - header));
            }
            _ => out.push_str(&format!("{marker}{}", &after[..digits])),
        }
        rest = &after[digits..];
    }
    out.push_str(rest);
    out
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
    let config_path = args.config.as_deref();
    let keys = given(&config).with_context(|| match config_path {
        Some(path) => format!("{} is not valid TOML", path.display()),
        None => "the module config is not valid TOML".into(),
    })?;
    if let (Some(key), Some(path)) = (keys.own, config_path) {
        bail!(
            "{}: `{key}` is set by `try` itself (the module is the file given, named after it: \
             {}); leave `name` and `path` out",
            path.display(),
            module_name(&module)
        );
    }
    let work = tempfile::tempdir().context("creating a scratch directory")?;
    let tree = FixtureTree::new(&work.path().join("node"))?;
    tree.load(&fixture)
        .with_context(|| format!("loading the fixture {}", fixture.display()))?;
    let registry_file = work.path().join("registry.toml");
    let (text, header) = registry_text(tree.root(), &module, &config, &keys, args.dra);
    std::fs::write(&registry_file, text)?;
    let mut registry = Registry::load(&registry_file).map_err(|e| {
        anyhow::anyhow!(relocate(
            &e.to_string(),
            &registry_file,
            config_path,
            header
        ))
    })?;
    // Every error the agent logs about the entry names the operator's file, not the scratch
    // copy (gone by the time they read it).
    if let Some(config) = config_path {
        for spec in &mut registry.modules {
            for at in [&mut spec.config_at, &mut spec.entry_at] {
                *at = relocate(at, &registry_file, Some(config), header);
                if at.starts_with(&registry_file.display().to_string()) {
                    // A line try wrote itself: the operator's file as a whole.
                    *at = config.display().to_string();
                }
            }
        }
    }
    if let Some(spec) = registry.modules.first()
        && crate::agent::front_ends::kind_of(spec).needs_api_server()
    {
        println!(
            "trying {} (as module `{}`) on the fixture {}",
            module.display(),
            module_name(&module),
            fixture.display()
        );
        let (changed_tx, changed) = tokio::sync::mpsc::channel::<()>(1);
        let _watch = if args.once {
            None
        } else {
            Some(watch_fixture(&fixture, changed_tx)?)
        };
        let reload = || match tree.load(&fixture) {
            Ok(()) => println!("fixture changed: reloaded"),
            Err(e) => println!("fixture changed, but cannot be loaded: {e}"),
        };
        return super::try_dra::run(super::try_dra::Trial {
            work: work.path(),
            registry,
            allocate: args.allocate,
            once: args.once,
            libraries: args.libraries.libraries(),
            cache_dir: args.cache_dir.clone(),
            changed: (!args.once).then_some(changed),
            reload: &reload,
        })
        .await
        .map_err(|e| {
            anyhow::anyhow!(relocate(
                &format!("{e:#}"),
                &registry_file,
                config_path,
                header
            ))
        });
    } else if args.dra {
        bail!("`front-end` in the config says otherwise; leave it out with --dra");
    }

    let plugin_dir = work.path().join("device-plugins");
    let kubelet = Simulator::start(&plugin_dir).await?;
    let mut events = kubelet.events();
    let mut options = AgentOptions::new(registry, plugin_dir);
    options.hot_reload = false;
    options.cdi_dir = work.path().join("cdi");
    options.libraries = args.libraries.libraries();
    options.cache_dir = args.cache_dir.clone();
    let state_dir = work.path().join("state");
    options.state_dir = Some(state_dir.clone());
    options.pod_resources = Some(kubelet.pod_resources_socket().to_owned());
    println!(
        "trying {} (as module `{}`) on the fixture {}",
        module.display(),
        module_name(&module),
        fixture.display()
    );
    println!(
        "meanwhile, `devicelet status --state-dir {}` shows what the agent serves",
        state_dir.display()
    );
    let agent = Agent::start(options).await?;
    if let Some(e) = agent.load_errors().first() {
        agent.shutdown().await;
        bail!("{}", relocate(e, &registry_file, config_path, header));
    }
    let mut waiting: Vec<String> = agent.resources().into_iter().map(|r| r.name).collect();
    if waiting.is_empty() {
        agent.shutdown().await;
        bail!("the module serves no resource");
    }
    let mut too_few: Vec<String> = Vec::new();

    let (changed_tx, mut changed) = tokio::sync::mpsc::channel::<()>(1);
    let _watch = if args.once {
        None
    } else {
        Some(watch_fixture(&fixture, changed_tx)?)
    };
    let stop = super::stop_signal();
    tokio::pin!(stop);
    let mut last_devices = BTreeMap::new();
    let mut failed = None;
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
        let event = match show(event, &mut last_devices) {
            Shown::Event(event) => event,
            Shown::Skip => continue,
            Shown::Closed => break,
        };
        let SimEvent::Snapshot {
            resource,
            allocatable,
            ..
        } = &event
        else {
            continue;
        };
        if !waiting.contains(resource) {
            continue;
        }
        if *allocatable < args.allocate {
            let why = format!(
                "{resource}: {allocatable} allocatable, fewer than --allocate {}",
                args.allocate
            );
            if args.once {
                failed = Some(why);
                break;
            }
            if !too_few.contains(resource) {
                println!("{why}; waiting for more (edit the fixture)");
                too_few.push(resource.clone());
            }
            continue;
        }
        waiting.retain(|r| r != resource);
        match kubelet.allocate(resource, args.allocate).await {
            Ok(allocation) => println!("{}", format_allocation(&allocation)),
            Err(e) => {
                let why = format!("allocation of {} {resource} failed: {e}", args.allocate);
                println!("{why}");
                // With --once the allocation is the verdict: a script must see it fail.
                if args.once {
                    failed.get_or_insert(why);
                }
            }
        }
        if waiting.is_empty() {
            if args.once {
                break;
            }
            println!(
                "watching {} for changes (edits stay in the fixture); Ctrl-C to stop",
                fixture.display()
            );
        }
    }
    agent.shutdown().await;
    kubelet.shutdown().await;
    match failed {
        Some(why) => bail!("{why}"),
        None => Ok(()),
    }
}

/// Wakes `changed` whenever something under the fixture is created, written, renamed or removed
/// (inotify); reads, `try`'s own included, are not changes.
fn watch_fixture(
    fixture: &Path,
    changed: tokio::sync::mpsc::Sender<()>,
) -> anyhow::Result<notify::RecommendedWatcher> {
    use notify::{EventKind, Watcher};
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        if let Ok(event) = event
            && matches!(
                event.kind,
                EventKind::Create(_) | EventKind::Modify(_) | EventKind::Remove(_)
            )
        {
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
    use super::{given, module_name, registry_text, relocate};
    use std::path::Path;

    /// The registry and its header's length.
    fn made(module: &str, config: &str) -> (String, usize) {
        let keys = given(config).unwrap();
        registry_text(Path::new("/tmp/n"), Path::new(module), config, &keys, false)
    }

    fn text(module: &str, config: &str) -> String {
        made(module, config).0
    }

    #[test]
    fn the_registry_names_the_module_after_its_file_and_grants_the_fixture_by_default() {
        let plain = text("/m/amd_gpu.wasm", "");
        assert!(plain.contains("name = \"amd-gpu\""), "{plain}");
        assert!(plain.contains("[module.grants]"), "{plain}");
        let own =
            "health-interval = \"5s\"\n[module.grants]\nsysfs = [\"/sys/bus/pci/devices/*\"]\n";
        let mine = text("/m/9x.wasm", own);
        assert_eq!(module_name(Path::new("/m/9x.wasm")), "module-9x");
        assert_eq!(mine.matches("[module.grants]").count(), 1, "{mine}");
        assert_eq!(mine.matches("health-interval").count(), 1, "{mine}");
        let inline = text("/m/a.wasm", "grants = { dev = [\"/dev/x\"] }\n");
        assert!(!inline.contains("[module.grants]"), "{inline}");
        assert!(given("[module.grants\n").is_err());
        assert_eq!(given("name = \"x\"\n").unwrap().own, Some("name"));
    }

    #[test]
    fn errors_point_into_the_operators_file() {
        let config = "resource-domain = \"a.com\"\n[module.config]\nresourse = 1\n";
        let (registry, header) = made("/m/a.wasm", config);
        // The operator's line 2 is the registry's line header + 2.
        assert_eq!(registry.lines().nth(header + 1), Some("[module.config]"));
        let message = format!(
            "module `a` refused its [module.config] (/tmp/s/registry.toml:{}): unknown field",
            header + 2
        );
        assert_eq!(
            relocate(
                &message,
                Path::new("/tmp/s/registry.toml"),
                Some(Path::new("a.toml")),
                header
            ),
            "module `a` refused its [module.config] (a.toml:2): unknown field"
        );
    }
}
