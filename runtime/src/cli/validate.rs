//! `devicelet validate`: everything `run` would check, without serving.

use std::path::PathBuf;

use std::collections::BTreeMap;

use crate::agent::{plan, start_module};
use crate::config::Registry;
use crate::device::{Device, Health};
use crate::resource::backend::DeviceBackend;
use crate::sandbox::cache::CompileCache;
use crate::sandbox::engine::new_engine;
use std::sync::Arc;

#[derive(clap::Args, Debug)]
pub struct ValidateArgs {
    /// The module registry (TOML).
    #[arg(long)]
    pub config: PathBuf,
    /// Where `run` would write CDI spec files (shown for resources whose strategy uses CDI).
    #[arg(long, default_value = crate::cdi::DEFAULT_DIR)]
    pub cdi_dir: PathBuf,
    /// Where the node's container runtime finds CDI specs (repeat for several): CDI names a
    /// module answers with itself (nvidia-gpu's `visible-devices = "cdi"`) must be defined there.
    #[arg(long = "cdi-spec-dir", default_values = crate::cdi::installed::SPEC_DIRS)]
    pub cdi_spec_dirs: Vec<PathBuf>,
    /// A compile cache to use and fill, as `run` does (its own, e.g. /var/lib/devicelet/cache,
    /// under the same trust rules): a module compiled there before, or found in
    /// `--precompiled-dir`, is not compiled again. Without it, modules are compiled in memory
    /// and nothing is written.
    #[arg(long)]
    pub cache_dir: Option<PathBuf>,
    /// With `--cache-dir`: modules compiled ahead of time, looked in when the cache has no entry,
    /// as `run` does (the image's reference modules are there).
    #[arg(long, default_value = "/opt/devicelet/precompiled")]
    pub precompiled_dir: PathBuf,
    #[command(flatten)]
    pub libraries: super::LibraryArgs,
    #[command(flatten)]
    pub registries: super::RegistryArgs,
}

pub async fn run(args: ValidateArgs) -> anyhow::Result<()> {
    let mut registry = Registry::load(&args.config)?;
    // Kept alive while the modules look at it.
    let _scratch = fixture_nodes(&mut registry)?;
    let engine = new_engine().map_err(|e| anyhow::anyhow!("{e:#}"))?;
    let mut failures = 0;
    // Resource name -> the module that declared it first here; `run` serves a name two modules
    // declare from only one of them, so a second declaration is a problem either way.
    let mut taken = BTreeMap::new();
    let libraries = args.libraries.libraries();
    let installed = crate::cdi::installed::Installed::read(&args.cdi_spec_dirs);
    // Modules from registries are pulled into a store of validate's own, removed after.
    let store_dir = std::env::temp_dir().join(format!("devicelet-validate-{}", std::process::id()));
    let fetcher = crate::oci::Fetcher {
        store: crate::oci::store::Store::under(&store_dir),
        access: args.registries.access()?,
    };
    let _remove = RemoveOnDrop(store_dir);
    let cache = args.cache_dir.as_deref().and_then(|dir| {
        CompileCache::open_with_precompiled(dir, Some(&args.precompiled_dir), &|e| {
            println!("warning: {e}")
        })
        .ok()
        .map(Arc::new)
    });
    for spec in &registry.modules {
        let loaded = start_module(
            &engine,
            cache.clone(),
            spec,
            &registry.host_root,
            (&libraries, Some(&fetcher)),
            None,
        )
        .await;
        let module = match loaded {
            Ok(module) => module,
            Err(e) => {
                failures += 1;
                println!("error: {e}");
                continue;
            }
        };
        let from = match &spec.source {
            Some(source) => source.to_string(),
            None => spec.path.display().to_string(),
        };
        println!("module `{}` ({from}): loaded", spec.name);
        // Loading refuses a module from a registry unless this key verified its signature.
        if let (Some(_), Some(key)) = (&spec.source, &spec.verify_key) {
            println!(
                "  signature verified by {} (cosign, ECDSA P-256)",
                key.path.display()
            );
        }
        let interface = module.interface();
        let host: Vec<&str> = interface
            .imports
            .iter()
            .filter(|i| !i.starts_with("wasi:"))
            .map(String::as_str)
            .collect();
        let wasi = interface.imports.len() - host.len();
        println!(
            "  implements devicelet:plugin@{}; imports {} (+{wasi} WASI interfaces, with no files, sockets or environment)",
            interface.version,
            host.join(", ")
        );
        if !module.version().is_empty() {
            println!("  module version {}", module.version());
        }
        let sysfs: Vec<_> = spec.grants.sysfs.iter().map(|p| p.as_str()).collect();
        let dev: Vec<_> = spec.grants.dev.iter().map(|p| p.as_str()).collect();
        println!("  may read sysfs: {}", list_or_nothing(&sysfs));
        println!("  may use device nodes: {}", list_or_nothing(&dev));
        let libraries: Vec<_> = spec.grants.libraries.iter().map(String::as_str).collect();
        println!(
            "  may use vendor libraries: {}",
            list_or_nothing(&libraries)
        );
        let mounts: Vec<_> = spec.grants.mounts.iter().map(|p| p.as_str()).collect();
        println!("  may mount host directories: {}", list_or_nothing(&mounts));
        if let Some(nvml) = module.nvml() {
            println!("  {}", describe_nvml(nvml));
        }
        let (planned, errors) = plan(spec, module.resources(), &taken);
        for e in errors {
            failures += 1;
            println!("  error: {e}");
        }
        let shared = crate::policy::sharing::Replicated::new(module.clone(), spec.sharing.clone());
        // What the front end the registry chose says of each resource, then its devices.
        let kind = crate::agent::front_ends::kind_of(spec);
        let lines = kind.describe(spec, &planned);
        let ahead = kind.answers_ahead();
        for line in lines.iter().filter_map(|l| l.as_ref().err()) {
            failures += 1;
            println!("  error: {line}");
        }
        for (name, info) in planned {
            let headline = lines
                .iter()
                .filter_map(|l| l.as_ref().ok())
                .find(|l| l.starts_with(&format!("resource {name} ")));
            if !ahead {
                if let Some(line) = headline {
                    println!("  {line}");
                }
                match DeviceBackend::enumerate(&module, &info.name).await {
                    Ok(devices) => {
                        print_devices(&devices);
                        print_unpublished(&devices);
                    }
                    Err(e) => {
                        failures += 1;
                        println!(
                            "    error: enumerate failed, so `run` would publish no devices: {e}"
                        );
                    }
                }
                taken.insert(name, spec.name.clone());
                continue;
            }
            if let Some(line) = headline {
                println!("  {line}");
            }
            let kind = match describe_cdi(spec.device_list_strategy, &name, &args.cdi_dir) {
                Ok(kind) => kind,
                Err(e) => {
                    failures += 1;
                    println!("    error: {e}");
                    None
                }
            };
            match DeviceBackend::enumerate(&shared, &info.name).await {
                Ok(devices) => {
                    print_devices(&devices);
                    let answers = answers(&shared, &info.name, &devices).await;
                    if let Some(kind) = kind {
                        print_cdi_spec(&kind, &answers);
                    }
                    failures += check_cdi_names(&answers, &installed);
                }
                Err(e) => {
                    failures += 1;
                    println!("    error: enumerate failed, so `run` would serve no devices: {e}");
                }
            }
            taken.insert(name, spec.name.clone());
        }
    }
    if let Some(cache) = &cache {
        let stats = cache.stats();
        println!(
            "compile cache {}: {} module(s) compiled, {} found compiled",
            cache.dir().display(),
            stats.misses + stats.replaced,
            stats.hits
        );
    }
    if failures > 0 {
        anyhow::bail!("{}: {failures} problem(s)", args.config.display());
    }
    println!("{}: ok", args.config.display());
    Ok(())
}

/// A `host-root` that is a fixture node (`sys/` and a `dev.list`, as `try` takes) has no real
/// device nodes, only their list: they are made in a scratch copy of the fixture, which the
/// modules then see, as `try` does. Returns the scratch directory (gone when dropped).
fn fixture_nodes(registry: &mut Registry) -> anyhow::Result<Option<tempfile::TempDir>> {
    use anyhow::Context;
    let fixture = registry.host_root.clone();
    if fixture == std::path::Path::new("/") || !fixture.join("dev.list").is_file() {
        return Ok(None);
    }
    let scratch = tempfile::tempdir().context("creating a scratch directory")?;
    let tree = crate::fixture::FixtureTree::new(&scratch.path().join("node"))?;
    tree.load(&fixture).with_context(|| {
        format!(
            "host-root {} is a fixture (it has a dev.list): making its device nodes (needs root \
             or CAP_MKNOD)",
            fixture.display()
        )
    })?;
    println!(
        "host-root {} is a fixture: its dev.list made into device nodes in {} for this check",
        fixture.display(),
        tree.root().display()
    );
    registry.host_root = tree.root().to_owned();
    Ok(Some(scratch))
}

/// What the kubelet would be told, one line per device.
fn print_devices(devices: &[Device]) {
    if devices.is_empty() {
        println!(
            "    0 devices now (warning: if this node has the hardware, check the module's grants)"
        );
        return;
    }
    let healthy = devices
        .iter()
        .filter(|d| d.health == Health::Healthy)
        .count();
    println!("    {} devices, {healthy} healthy:", devices.len());
    if healthy == 0 {
        println!(
            "    warning: none is Healthy, so the kubelet would offer none: check the device \
             nodes under the module's /dev grants and its log lines above"
        );
    }
    for d in devices {
        let health = match d.health {
            Health::Healthy => "Healthy",
            Health::Unhealthy => "Unhealthy",
        };
        let numa = if d.numa_nodes.is_empty() {
            String::new()
        } else {
            let nodes: Vec<String> = d.numa_nodes.iter().map(i64::to_string).collect();
            format!(" NUMA {}", nodes.join(","))
        };
        let facts = crate::device::describe_facts(d);
        let attributes = if facts.is_empty() {
            String::new()
        } else {
            format!(" {{{}}}", facts.join(", "))
        };
        let extra = [
            d.group.as_ref().map(|g| format!(" group {g}")),
            d.exclusive.then(|| " exclusive".to_owned()),
            d.edits.as_ref().map(|_| " (own edits)".to_owned()),
            d.health_reason.as_ref().map(|r| format!(": {r}")),
        ]
        .into_iter()
        .flatten()
        .collect::<String>();
        println!("    {} {health}{numa}{attributes}{extra}", d.id);
    }
}

/// The device-list strategy, and where the CDI spec would go: its kind, or why the resource
/// cannot have one.
fn describe_cdi(
    strategy: crate::cdi::DeviceListStrategy,
    resource: &str,
    dir: &std::path::Path,
) -> Result<Option<String>, String> {
    if !strategy.uses_cdi() {
        println!("    device list: {strategy} (no CDI spec)");
        return Ok(None);
    }
    let kind = crate::cdi::spec::kind_of(resource)
        .map_err(|e| format!("cannot have a CDI spec for {resource}: {e}"))?;
    println!(
        "    device list: {strategy}; CDI spec {} (kind {kind}, annotation {})",
        crate::cdi::spec_path(dir, resource).display(),
        crate::cdi::annotation_key(resource)
    );
    if !strategy.devices {
        println!(
            "    warning: only CDI names the devices; containerd before 1.7 ignores CDI names \
             without a word and starts the container with no device: list \"devices\" too \
             unless every node's runtime applies CDI"
        );
    }
    Ok(Some(kind))
}

/// The module's answer for each healthy physical device alone, as the preparer asks for them,
/// and the devices whose Allocate failed.
struct Answers {
    each: BTreeMap<String, std::sync::Arc<crate::device::ContainerEdits>>,
    failed: Vec<String>,
}

async fn answers(backend: &impl DeviceBackend, resource: &str, devices: &[Device]) -> Answers {
    let mut each = BTreeMap::new();
    let mut failed = Vec::new();
    for d in devices.iter().filter(|d| d.health == Health::Healthy) {
        let id = crate::policy::sharing::physical_id(&d.id);
        if each.contains_key(id) {
            continue;
        }
        match backend.allocate(resource, vec![d.id.clone()]).await {
            Ok(edits) => {
                each.insert(id.to_owned(), std::sync::Arc::new(edits));
            }
            Err(e) => failed.push(format!("{id}: {e}")),
        }
    }
    Answers { each, failed }
}

/// The CDI names the module answers with itself must be defined by a spec the runtime reads
/// (`installed`), or the runtime refuses the container. Prints what it found; returns the
/// number of problems.
fn check_cdi_names(answers: &Answers, installed: &crate::cdi::installed::Installed) -> usize {
    let named: Vec<(&String, &String)> = answers
        .each
        .iter()
        .flat_map(|(id, edits)| edits.cdi_devices.iter().map(move |name| (id, name)))
        .collect();
    if named.is_empty() {
        return 0;
    }
    let dirs: Vec<String> = installed
        .dirs
        .iter()
        .map(|d| d.display().to_string())
        .collect();
    for problem in &installed.problems {
        println!("    warning: CDI spec {problem}");
    }
    let missing: Vec<_> = named
        .iter()
        .filter(|(_, name)| !installed.contains(name))
        .collect();
    if missing.is_empty() {
        println!(
            "    CDI names the module answers: {}, each defined by a spec in {}",
            named.len(),
            dirs.join(", ")
        );
        return 0;
    }
    for (id, name) in &missing {
        println!(
            "    error: device {id}: the module names CDI device `{name}`, which no spec in {} \
             defines, so the runtime would refuse the container ({} device(s) defined there; \
             for NVIDIA GPUs generate the spec with `nvidia-ctk cdi generate \
             --output=/var/run/cdi/nvidia.yaml --device-name-strategy=uuid`, or `=index` for \
             `device-id-strategy = \"index\"`)",
            dirs.join(", "),
            installed.len()
        );
    }
    missing.len()
}

/// The CDI spec `run` would write, from the module's answer for each device alone.
fn print_cdi_spec(kind: &str, answers: &Answers) {
    let Answers {
        each: answers,
        failed,
    } = answers;
    match crate::cdi::build(kind, answers) {
        Some((spec, view)) => println!(
            "    CDI spec: cdiVersion {}, {} of {} devices named{}",
            spec.version,
            view.len(),
            answers.len(),
            if spec.container_edits.is_empty() {
                ""
            } else {
                ", with edits common to all"
            }
        ),
        None => println!("    CDI spec: no device to name yet (none written)"),
    }
    for f in failed {
        println!("    warning: Allocate for {f} failed, so it is not in the spec");
    }
}

/// One line on NVML as the module will find it, naming the library it was loaded from.
pub fn describe_nvml(nvml: &crate::nvml::NvmlNode) -> String {
    match nvml.availability() {
        crate::nvml::Availability::Ready { driver, gpus } => format!(
            "NVML: driver {driver}, {gpus} GPU(s), from {}",
            nvml.library().display()
        ),
        crate::nvml::Availability::Unavailable(why) => format!("NVML: unavailable: {why}"),
    }
}

fn list_or_nothing(items: &[&str]) -> String {
    if items.is_empty() {
        "nothing".into()
    } else {
        items.join(", ")
    }
}

/// Removes a scratch directory when dropped.
struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The attributes and capacities a DRA driver would leave out of its slices, and why: one line
/// per (name, reason), with how many devices carry it.
fn print_unpublished(devices: &[crate::device::Device]) {
    let mut dropped: std::collections::BTreeMap<(String, String), usize> = Default::default();
    for d in devices {
        for key in crate::dra::slices::dropped(d) {
            *dropped.entry(key).or_default() += 1;
        }
    }
    for ((name, why), count) in dropped {
        println!(
            "    attribute {:?} not published ({count} device(s)): {why}",
            crate::text::cut(&name, 64)
        );
    }
}
