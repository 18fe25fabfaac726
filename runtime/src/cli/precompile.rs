//! `devicelet precompile`: modules compiled ahead of time, for an image to carry (the agent's
//! `--precompiled-dir`), so that a new node's first start deserializes them instead of compiling.

use std::path::PathBuf;

use anyhow::Context;

use crate::sandbox::cache::{CacheOutcome, CompileCache};

#[derive(clap::Args, Debug)]
pub struct PrecompileArgs {
    /// The directory to write them in, in the compile cache's layout (created 0700; the same
    /// trust rules as the cache apply to it).
    #[arg(long)]
    pub out: PathBuf,
    /// The modules (`.wasm` components).
    #[arg(required = true)]
    pub modules: Vec<PathBuf>,
}

pub async fn run(args: PrecompileArgs) -> anyhow::Result<()> {
    tokio::task::spawn_blocking(move || precompile(args)).await?
}

fn precompile(args: PrecompileArgs) -> anyhow::Result<()> {
    let cache = CompileCache::open(&args.out).map_err(anyhow::Error::msg)?;
    let engine = crate::sandbox::engine::new_engine().map_err(|e| anyhow::anyhow!("{e:#}"))?;
    let key = crate::sandbox::cache::engine_key(&engine);
    for file in &args.modules {
        let bytes = crate::files::read_regular(file, crate::files::MAX_MODULE)
            .with_context(|| format!("reading {}", file.display()))?;
        let digest = crate::digest::sha256_hex(&bytes);
        let (_, outcome) = cache.load(&engine, &bytes, &digest).map_err(|e| {
            anyhow::anyhow!(
                "{}: not a module this agent compiles: {e:#}",
                file.display()
            )
        })?;
        let done = match outcome {
            CacheOutcome::Hit => "already there",
            CacheOutcome::Miss => "compiled",
            CacheOutcome::Replaced { .. } => "compiled again (the old entry was unusable)",
        };
        println!("{}: {done}: {digest}-{key}.cwasm", file.display());
    }
    println!(
        "{}: for this wasmtime and CPU features (engine key {key}); a node whose differ compiles",
        args.out.display()
    );
    Ok(())
}
