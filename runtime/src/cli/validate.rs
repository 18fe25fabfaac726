//! `devicelet validate`: everything `run` would check, without serving.

use std::path::PathBuf;

use crate::agent::start_module;
use crate::config::Registry;
use crate::kubelet::names;
use crate::sandbox::engine::new_engine;

#[derive(clap::Args, Debug)]
pub struct ValidateArgs {
    /// The module registry (TOML).
    #[arg(long)]
    pub config: PathBuf,
}

pub async fn run(args: ValidateArgs) -> anyhow::Result<()> {
    let registry = Registry::load(&args.config)?;
    let engine = new_engine().map_err(|e| anyhow::anyhow!("{e:#}"))?;
    let mut failures = 0;
    for spec in &registry.modules {
        match start_module(&engine, None, spec, &registry.host_root).await {
            Ok(module) => {
                println!("module `{}` ({}): ok", spec.name, spec.path.display());
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
                for r in module.resources() {
                    let name = crate::agent::qualify(&spec.resource_domain, &r.name);
                    match names::validate_resource_name(&name) {
                        Ok(()) => println!(
                            "  resource {name} (prestart: {}, preferred allocation: {})",
                            r.prestart, r.preferred_allocation
                        ),
                        Err(e) => {
                            failures += 1;
                            println!(
                                "  error: module `{}` declared an invalid resource name: {e}",
                                spec.name
                            );
                        }
                    }
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
            }
            Err(e) => {
                failures += 1;
                println!("error: {e}");
            }
        }
    }
    if failures > 0 {
        anyhow::bail!("{}: {failures} problem(s)", args.config.display());
    }
    println!("{}: ok", args.config.display());
    Ok(())
}

fn list_or_nothing(items: &[&str]) -> String {
    if items.is_empty() {
        "nothing".into()
    } else {
        items.join(", ")
    }
}
