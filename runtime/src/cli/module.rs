//! `devicelet module`: modules in OCI registries, for vendors.

use std::path::PathBuf;

use anyhow::Context;

#[derive(clap::Subcommand, Debug)]
pub enum ModuleCommand {
    /// Push a module as a wasm component artifact (one `application/wasm` layer, a
    /// `application/vnd.wasm.config.v0+json` config naming its imports and exports) and print
    /// its digest and the registry line that pins it.
    Push(PushArgs),
    /// Show what an artifact is without fetching the module: its media types, size, the
    /// component's imports and exports and the devicelet:plugin version it implements (from its
    /// config), and whether a node would load it.
    Inspect(InspectArgs),
}

#[derive(clap::Args, Debug)]
pub struct InspectArgs {
    /// `oci://<registry>/<repository>[:tag]@sha256:<digest>`.
    pub reference: String,
    #[command(flatten)]
    pub registries: super::RegistryArgs,
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
        ModuleCommand::Inspect(args) => inspect(args).await,
    }
}

async fn inspect(args: InspectArgs) -> anyhow::Result<()> {
    let source = crate::oci::reference::parse(&args.reference).map_err(|e| anyhow::anyhow!(e))?;
    let found = crate::oci::pull::inspect(&source, &args.registries.insecure)
        .await
        .map_err(|e| anyhow::anyhow!("{source}: {e}"))?;
    println!("{source}");
    println!("  manifest: {} (digest checked)", found.manifest_media_type);
    println!("  config: {}", found.config_media_type);
    if let Some((media_type, digest, size)) = &found.layer {
        println!("  layer: {media_type}, {size} bytes, {digest}");
    }
    if let Some(config) = &found.config {
        let list = |key: &str| -> Vec<String> {
            config["component"][key]
                .as_array()
                .map(|a| {
                    a.iter()
                        .filter_map(|v| v.as_str().map(str::to_owned))
                        .collect()
                })
                .unwrap_or_default()
        };
        let (imports, exports) = (list("imports"), list("exports"));
        if let Some(created) = config["created"].as_str() {
            println!("  created: {created}");
        }
        match exports
            .iter()
            .find_map(|e| e.strip_prefix("devicelet:plugin/plugin@"))
        {
            Some(version) => println!("  implements devicelet:plugin@{version}"),
            None => println!("  implements no devicelet:plugin (by its config)"),
        }
        println!("  imports: {}", imports.join(", "));
        println!("  exports: {}", exports.join(", "));
    }
    match &found.refused {
        None => println!("  a node would pull and load it (signatures: not checked yet)"),
        Some(why) => println!("  a node would refuse it: {why}"),
    }
    Ok(())
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
