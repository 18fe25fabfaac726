//! Benchmark 12: the nvidia-gpu module from an OCI registry (Debian's `docker-registry` on
//! 127.0.0.1, plain HTTP): a cold start (pull, every check, compile, init) into an empty store
//! and compile cache, and a warm start from the module store beside the same module's warm
//! start from a file, in alternating samples.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use devicelet::config::{ModuleSpec, Registry};
use devicelet::nvml::Libraries;
use devicelet::oci::Fetcher;
use devicelet::oci::access::Access;
use devicelet::oci::store::Store;
use devicelet::sandbox::cache::CompileCache;

use super::Settings;
use super::report::Row;
use super::startup::spread;
use super::stats::{Samples, div, ratio};

const COLD: usize = 10;
const WARM: usize = 60;
/// A warm start from the store does what one from a file does, plus reading and hashing the
/// manifest and the module once more.
const WARM_RATIO_TARGET: f64 = 1.1;

/// A registry process, killed when dropped.
struct RegistryProcess {
    addr: String,
    child: Child,
}

impl Drop for RegistryProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_registry(dir: &Path) -> anyhow::Result<RegistryProcess> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let addr = format!("127.0.0.1:{port}");
    let config = dir.join("registry.yml");
    std::fs::write(
        &config,
        format!(
            "version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n    rootdirectory: {}\n\
             http:\n  addr: {addr}\n",
            dir.join("data").display()
        ),
    )?;
    let child = Command::new("docker-registry")
        .arg("serve")
        .arg(&config)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("starting docker-registry (apt-get install docker-registry)")?;
    let registry = RegistryProcess { addr, child };
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(&registry.addr).is_err() {
        anyhow::ensure!(Instant::now() < deadline, "docker-registry never answered");
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(registry)
}

fn spec(dir: &Path, entry: &str) -> anyhow::Result<ModuleSpec> {
    let text = format!(
        "host-root = {:?}\n[[module]]\nname = \"nvidia-gpu\"\n{entry}\nresource-domain = \"nvidia.com\"\n\
         [module.grants]\nsysfs = [\"/sys/bus/pci/devices/*\"]\ndev = [\"/dev/nvidia*\"]\n\
         libraries = [\"nvml\"]\n[module.config]\nresource = \"gpu\"\n",
        dir.display().to_string()
    );
    let registry = Registry::parse(&text, &dir.join("registry.toml"))?;
    registry
        .modules
        .into_iter()
        .next()
        .context("the registry's module")
}

/// Starting the module as the agent does, then letting it go.
struct WayIn {
    engine: devicelet::sandbox::engine::Engine,
    libraries: Libraries,
    root: std::path::PathBuf,
}

impl WayIn {
    async fn start(
        &self,
        spec: &ModuleSpec,
        cache: Arc<CompileCache>,
        fetcher: &Fetcher,
    ) -> anyhow::Result<()> {
        let handle = devicelet::agent::start_module(
            &self.engine,
            Some(cache),
            spec,
            &self.root,
            (&self.libraries, Some(fetcher)),
            None,
        )
        .await?;
        drop(handle);
        Ok(())
    }
}

pub async fn run(s: &Settings) -> anyhow::Result<Vec<Row>> {
    let dir = tempfile::tempdir()?;
    let registry = start_registry(dir.path())?;
    let wasm = s.module_dir.join("nvidia_gpu.wasm");
    let bytes = std::fs::read(&wasm)?;
    let interface = devicelet::sandbox::loader::interface(&bytes).map_err(anyhow::Error::msg)?;
    let access =
        Access::load(vec![registry.addr.clone()], None, None).map_err(anyhow::Error::msg)?;
    let source = devicelet::oci::push::push(
        &wasm,
        &format!("oci://{}/devicelet/nvidia-gpu:bench", registry.addr),
        interface,
        &access,
    )
    .await
    .map_err(anyhow::Error::msg)?;
    let from_registry = spec(dir.path(), &format!("source = \"{source}\""))?;
    let from_file = spec(
        dir.path(),
        &format!("path = {:?}", wasm.display().to_string()),
    )?;
    let way_in = WayIn {
        engine: devicelet::sandbox::engine::new_engine().map_err(|e| anyhow::anyhow!("{e:#}"))?,
        // The host's NVML is absent here: the module starts without it, as on a node without
        // the driver; what is measured is the module's way in, not NVML.
        libraries: Libraries::default(),
        root: dir.path().to_owned(),
    };

    // Cold: an empty store and an empty compile cache for each sample.
    let (mut cold, mut pulls) = (Vec::new(), Vec::new());
    for i in 0..s.repeats(COLD) {
        let state = dir.path().join(format!("cold-{i}"));
        let fetcher = Fetcher {
            store: Store::under(&state),
            access: access.clone(),
        };
        let cache = Arc::new(CompileCache::open(&state.join("cache"))?);
        let started = Instant::now();
        let source = from_registry.source.as_ref().context("a source")?;
        fetcher
            .pull(source, &from_registry)
            .await
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        pulls.push(started.elapsed());
        way_in.start(&from_registry, cache, &fetcher).await?;
        cold.push(started.elapsed());
    }

    // Warm: the store and cache filled once; the two ways in alternate.
    let state = dir.path().join("warm");
    let fetcher = Fetcher {
        store: Store::under(&state),
        access,
    };
    let cache = Arc::new(CompileCache::open(&state.join("cache"))?);
    for spec in [&from_registry, &from_file] {
        way_in.start(spec, cache.clone(), &fetcher).await?;
    }
    drop(registry);
    let (mut store, mut file) = (Vec::new(), Vec::new());
    for i in 0..s.n(WARM) * 2 {
        let (spec, out) = if i % 2 == 0 {
            (&from_registry, &mut store)
        } else {
            (&from_file, &mut file)
        };
        let started = Instant::now();
        way_in.start(spec, cache.clone(), &fetcher).await?;
        out.push(started.elapsed());
    }

    let (cold, pulls) = (Samples::new(cold), Samples::new(pulls));
    let (store, file) = (Samples::new(store), Samples::new(file));
    let size = bytes.len() / 1024;
    let warm_ratio = div(store.p50(), file.p50());
    Ok(vec![
        Row::info(
            format!(
                "12. nvidia-gpu ({size} KiB) from a local registry, cold: pull, every check, \
                 compile, init, into an empty store and compile cache (median of {})",
                cold.count()
            ),
            spread(&cold),
        ),
        Row::info(
            "12. … of which the pull (manifest, config, module, each checked; stored)",
            spread(&pulls),
        ),
        Row::info(
            format!(
                "12. Warm start from the module store, registry down: store read and checked, \
                 precompiled, init ({} samples)",
                store.count()
            ),
            store.summary(false),
        ),
        Row::info(
            format!(
                "12. Warm start of the same module from a file (alternating with the row above, \
                 {} samples)",
                file.count()
            ),
            file.summary(false),
        ),
        Row::judged(
            "12. Warm start from the store ÷ from a file (p50)",
            ratio(warm_ratio),
            format!("≤ {WARM_RATIO_TARGET}×"),
            warm_ratio <= WARM_RATIO_TARGET,
        ),
    ])
}
