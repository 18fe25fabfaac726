//! `devicelet module`: modules in OCI registries, for vendors.

use std::path::PathBuf;

use anyhow::Context;

#[derive(clap::Subcommand, Debug)]
pub enum ModuleCommand {
    /// Push a module as a wasm component artifact (one `application/wasm` layer, a
    /// `application/vnd.wasm.config.v0+json` config naming its imports and exports) and print
    /// its digest and the registry line that pins it.
    Push(PushArgs),
}

#[derive(clap::Args, Debug)]
pub struct PushArgs {
    /// The module (a `.wasm` component).
    pub file: PathBuf,
    /// Where to: `oci://<registry>/<repository>[:tag]` (`latest` when no tag).
    pub target: String,
    #[command(flatten)]
    pub registries: super::RegistryArgs,
}

pub async fn run(command: ModuleCommand) -> anyhow::Result<()> {
    match command {
        ModuleCommand::Push(args) => push(args).await,
    }
}

async fn push(args: PushArgs) -> anyhow::Result<()> {
    let bytes = crate::files::read_regular(&args.file, crate::files::MAX_MODULE)
        .with_context(|| format!("reading {}", args.file.display()))?;
    // Only a component the agent can load is pushed: its imports and exports go in the config.
    let interface = tokio::task::spawn_blocking(move || crate::sandbox::loader::interface(&bytes))
        .await?
        .map_err(|e| anyhow::anyhow!("{}: {e}", args.file.display()))?;
    let source = crate::oci::push::push(
        &args.file,
        &args.target,
        interface,
        &args.registries.insecure,
    )
    .await
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    println!("pushed {} as sha256:{}", args.file.display(), source.digest);
    println!("registry line: source = \"{source}\"");
    Ok(())
}
