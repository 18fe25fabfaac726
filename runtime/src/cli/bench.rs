//! `devicelet bench` (hidden): runs the benchmarks on this machine, prints the table and writes
//! it, with the machine and the command, to `--out`. `scripts/bench.sh` builds in release mode
//! first; a debug build says so in the header.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;

use crate::bench::{self, Settings, report};

#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    /// Directory holding the compiled guests (`generic_dev.wasm`, `misbehaving.wasm`).
    #[arg(long, default_value = "target/wasm32-wasip2/release")]
    pub module_dir: PathBuf,
    /// Write the Markdown report here too (e.g. BENCHMARKS.md).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// The `devicelet` binary to spawn for start-up and memory; default: this one.
    #[arg(long)]
    pub devicelet: Option<PathBuf>,
    /// Only these benchmarks (comma-separated): allocate, preferred, startup, restart, health,
    /// memory, guest-call.
    #[arg(long, value_delimiter = ',')]
    pub only: Vec<String>,
    /// A tenth of the samples: a smoke run, figures not comparable.
    #[arg(long)]
    pub quick: bool,
}

pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
    let started = Instant::now();
    let machine = report::Machine::here();
    let devicelet = match args.devicelet {
        Some(p) => p,
        None => std::env::current_exe().context("locating this binary")?,
    };
    let settings = Settings {
        module_dir: std::path::absolute(&args.module_dir)?,
        devicelet: std::path::absolute(devicelet)?,
        quick: args.quick,
    };
    for wasm in ["generic_dev.wasm", "misbehaving.wasm"] {
        let path = settings.module_dir.join(wasm);
        anyhow::ensure!(
            path.is_file(),
            "{} is missing: build the guests first (scripts/bench.sh does)",
            path.display()
        );
    }
    let names: Vec<String> = if args.only.is_empty() {
        bench::NAMES.iter().map(|s| s.to_string()).collect()
    } else {
        args.only
    };
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
