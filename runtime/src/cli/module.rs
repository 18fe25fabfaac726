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
    /// Sign an artifact with an ECDSA P-256 key as `cosign sign --key` does (a simple-signing
    /// payload at the `sha256-<digest>.sig` tag), for nodes whose registry entry has a
    /// `verify-key`.
    Sign(SignArgs),
}

#[derive(clap::Args, Debug)]
pub struct SignArgs {
    /// `oci://<registry>/<repository>[:tag]@sha256:<digest>`: what to sign.
    pub reference: String,
    /// The private key: PKCS#8 PEM (`-----BEGIN PRIVATE KEY-----`), e.g. from `openssl genpkey
    /// -algorithm EC -pkeyopt ec_paramgen_curve:P-256`. Its public half (`openssl pkey -pubout`)
    /// is the nodes' `verify-key`.
    #[arg(long)]
    pub key: PathBuf,
    #[command(flatten)]
    pub registries: super::RegistryArgs,
}

#[derive(clap::Args, Debug)]
pub struct InspectArgs {
    /// `oci://<registry>/<repository>[:tag]@sha256:<digest>`.
    pub reference: String,
    /// Check its signatures against this public key, as a node with `verify-key` would.
    #[arg(long, value_name = "FILE")]
    pub verify_key: Option<PathBuf>,
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
        ModuleCommand::Sign(args) => sign(args).await,
    }
}

async fn inspect(args: InspectArgs) -> anyhow::Result<()> {
    let source =
        crate::config::oci_source::parse(&args.reference).map_err(|e| anyhow::anyhow!(e))?;
    let key = match &args.verify_key {
        Some(file) => {
            Some(crate::oci::signature::VerifyKey::read(file).map_err(anyhow::Error::msg)?)
        }
        None => None,
    };
    let found = crate::oci::pull::inspect(&source, &args.registries.access()?)
        .await
        .map_err(|e| anyhow::anyhow!("{source}: {e}"))?;
    println!("{source}");
    println!("  manifest: {} (digest checked)", found.manifest_media_type);
    println!("  config: {}", found.config_media_type);
    if let Some((media_type, digest, size)) = &found.layer {
        println!("  layer: {media_type}, {size} bytes, {digest}");
    }
    if let Some(config) = &found.config {
        let (exports, imports) = crate::oci::pull::listed_interface(config).unwrap_or_default();
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
    let tag = crate::oci::signature::signature_tag(&source.digest);
    let signed = match (&found.signatures, &key) {
        (Err(e), _) => {
            println!("  signatures: cannot be read: {e}");
            key.is_none()
        }
        (Ok(signed), None) => {
            println!(
                "  signatures: {} at {tag} (give --verify-key to check them)",
                signed.len()
            );
            true
        }
        (Ok(signed), Some(key)) => {
            match crate::oci::signature::check(key, &source.digest, signed) {
                Ok(()) => {
                    println!("  signatures: signed by {}", key.path.display());
                    true
                }
                Err(e) => {
                    println!("  signatures: {e}");
                    false
                }
            }
        }
    };
    match &found.refused {
        None if signed => println!("  a node would pull and load it"),
        None => println!("  a node with that verify-key would refuse it"),
        Some(why) => println!("  a node would refuse it: {why}"),
    }
    Ok(())
}

async fn sign(args: SignArgs) -> anyhow::Result<()> {
    let source =
        crate::config::oci_source::parse(&args.reference).map_err(|e| anyhow::anyhow!(e))?;
    sign_with(&source, &args.key, &args.registries.access()?)
        .await
        .map_err(|e| anyhow::anyhow!("{source}: {e}"))?;
    println!(
        "signed {source} with {}; stored at {}",
        args.key.display(),
        crate::oci::signature::signature_tag(&source.digest)
    );
    Ok(())
}

/// Signs `source` with the private key at `key`, as `devicelet module sign` does.
pub(super) async fn sign_with(
    source: &crate::config::OciSource,
    key: &std::path::Path,
    access: &crate::oci::access::Access,
) -> anyhow::Result<()> {
    let client = access
        .client(&source.registry)
        .await
        .map_err(anyhow::Error::msg)?;
    let reader = access
        .reader(&source.registry)
        .map_err(anyhow::Error::msg)?;
    crate::oci::signature::sign(source, key, (&reader, &client))
        .await
        .map(drop)
        .map_err(anyhow::Error::msg)
}

/// Pushes the module at `file` to `target`, as `devicelet module push` does.
pub(super) async fn push_file(
    file: &std::path::Path,
    target: &str,
    access: &crate::oci::access::Access,
) -> anyhow::Result<crate::config::OciSource> {
    let bytes = crate::files::read_regular(file, crate::files::MAX_MODULE)
        .with_context(|| format!("reading {}", file.display()))?;
    // Only a valid component is pushed: its imports and exports go in the config.
    let interface = tokio::task::spawn_blocking(move || crate::sandbox::loader::interface(&bytes))
        .await?
        .map_err(|e| anyhow::anyhow!("{}: {e}", file.display()))?;
    crate::oci::push::push(file, target, interface, access)
        .await
        .map_err(anyhow::Error::msg)
}

async fn push(args: PushArgs) -> anyhow::Result<()> {
    let source = push_file(&args.file, &args.target, &args.registries.access()?).await?;
    println!("pushed {} as sha256:{}", args.file.display(), source.digest);
    println!("registry line: source = \"{source}\"");
    Ok(())
}
