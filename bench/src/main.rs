//! `devicelet-bench`: runs the benchmarks on this machine, prints the table and writes it, with
//! the machine and the command, to `--out`. `scripts/bench.sh` builds in release mode first; a
//! debug build says so in the header. Kept out of the agent's library, so what runs on a node is
//! only the agent.

mod bench;

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::Parser;
use tracing_subscriber::EnvFilter;

use crate::bench::{Settings, report};

#[derive(clap::Parser, Debug)]
#[command(
    name = "devicelet-bench",
    about = "Benchmarks devicelet on this machine"
)]
pub struct BenchArgs {
    /// Log filter (tracing's EnvFilter syntax).
    #[arg(long, default_value = "error")]
    pub log: String,
    /// Directory holding the compiled guests (`generic_dev.wasm`, `misbehaving.wasm`).
    #[arg(long, default_value = "target/wasm32-wasip2/release")]
    pub module_dir: PathBuf,
    /// Write the Markdown report here too (e.g. BENCHMARKS.md).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// The `devicelet` binary to spawn for start-up and memory.
    #[arg(long, default_value = "target/release/devicelet")]
    pub devicelet: PathBuf,
    /// Only these benchmarks (comma-separated): allocate, preferred, startup, restart, health,
    /// memory, guest-call, isolation, nvidia, operations, dra.
    #[arg(long, value_delimiter = ',')]
    pub only: Vec<String>,
    /// A tenth of the samples: a smoke run, figures not comparable.
    #[arg(long)]
    pub quick: bool,
    /// The fake NVML library for the NVIDIA benchmark (`cargo build --release -p fake-nvml`).
    #[arg(long)]
    pub fake_nvml: Option<PathBuf>,
    /// The reference Go DRA driver's kubelet plugin (`dra-example-kubeletplugin`, built by
    /// `bench/peer/build-dra-example-driver.sh`): benchmark 11 then also runs it beside
    /// devicelet.
    #[arg(long)]
    pub dra_peer: Option<PathBuf>,
    /// Another build of the agent (e.g. before a change): the start-up benchmark then also
    /// starts both, one module from a warm cache, in interleaved pairs, so that the machine's
    /// load falls on both alike, and prints them side by side.
    #[arg(long)]
    pub compare: Option<PathBuf>,
    /// Other builds of the modules (e.g. before a change), for the compared side of those
    /// pairs: the same agent with `--compare` left out.
    #[arg(long)]
    pub compare_module_dir: Option<PathBuf>,
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let argv: Vec<String> = std::env::args().collect();
    if let Some(code) = bench::remote::child_main(&argv).await {
        return code;
    }
    let args = BenchArgs::parse();
    tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::try_new(&args.log).unwrap_or_else(|_| EnvFilter::new("error")))
        .with_writer(std::io::stderr)
        .init();
    match run(args).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run(args: BenchArgs) -> anyhow::Result<()> {
    let started = Instant::now();
    let machine = report::Machine::here();
    let settings = Settings {
        module_dir: std::path::absolute(&args.module_dir)?,
        devicelet: std::path::absolute(&args.devicelet)?,
        quick: args.quick,
        fake_nvml: args
            .fake_nvml
            .as_deref()
            .map(std::path::absolute)
            .transpose()?,
        dra_peer: args
            .dra_peer
            .as_deref()
            .map(std::path::absolute)
            .transpose()?,
        compare: args
            .compare
            .as_deref()
            .map(std::path::absolute)
            .transpose()?,
        compare_module_dir: args
            .compare_module_dir
            .as_deref()
            .map(std::path::absolute)
            .transpose()?,
    };
    anyhow::ensure!(
        settings.devicelet.is_file(),
        "{} is missing: build devicelet first (scripts/bench.sh does)",
        settings.devicelet.display()
    );
    for wasm in [
        "generic_dev.wasm",
        "misbehaving.wasm",
        "nvidia_gpu.wasm",
        "amd_gpu.wasm",
    ] {
        let path = settings.module_dir.join(wasm);
        anyhow::ensure!(
            path.is_file(),
            "{} is missing: build the guests first (scripts/bench.sh does)",
            path.display()
        );
    }
    if let Some(other) = &settings.compare {
        anyhow::ensure!(other.is_file(), "--compare: {} is missing", other.display());
    }
    if let Some(dir) = &settings.compare_module_dir {
        let path = dir.join("generic_dev.wasm");
        anyhow::ensure!(
            path.is_file(),
            "--compare-module-dir: {} is missing",
            path.display()
        );
    }
    let names: Vec<String> = if args.only.is_empty() {
        bench::NAMES.iter().map(|s| s.to_string()).collect()
    } else {
        args.only
    };
    anyhow::ensure!(
        (settings.compare.is_none() && settings.compare_module_dir.is_none())
            || names.iter().any(|n| n == "startup"),
        "--compare and --compare-module-dir add to the start-up benchmark, which --only leaves out"
    );
    let mut rows = Vec::new();
    for name in &names {
        eprintln!("bench: {name} …");
        let t = Instant::now();
        let got = bench::run(name, &settings)
            .await
            .with_context(|| format!("benchmark {name}"))?;
        eprintln!("bench: {name} took {:.1} s", t.elapsed().as_secs_f64());
        rows.extend(got);
    }
    let argv = std::env::args().collect::<Vec<_>>().join(" ");
    let mut command = match std::env::var("DEVICELET_BENCH_SCRIPT") {
        Ok(script) => format!("`{script}`, which ran `{argv}`"),
        Err(_) => format!("`{argv}`"),
    };
    if settings.quick {
        command.push_str(" — QUICK run: a tenth of the samples, figures not comparable");
    }
    let text = report::render(
        &machine,
        &command,
        &rows,
        started.elapsed(),
        &bench::method(),
    );
    println!("{text}");
    if let Some(out) = &args.out {
        std::fs::write(out, &text).with_context(|| format!("writing {}", out.display()))?;
        eprintln!("bench: wrote {}", out.display());
    }
    Ok(())
}
