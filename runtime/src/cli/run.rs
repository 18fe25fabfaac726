//! `devicelet run`: the agent.

use std::path::PathBuf;

use anyhow::Context;

use crate::agent::{Agent, AgentOptions};
use crate::config::Registry;

#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// The module registry (TOML).
    #[arg(long)]
    pub config: PathBuf,
    /// The kubelet's device-plugin directory, where `kubelet.sock` lives.
    #[arg(long, default_value = "/var/lib/kubelet/device-plugins")]
    pub kubelet_dir: PathBuf,
}

pub async fn run(args: RunArgs) -> anyhow::Result<()> {
    let registry = Registry::load(&args.config)?;
    let agent = Agent::start(AgentOptions {
        registry,
        plugin_dir: args.kubelet_dir,
    })
    .await
    .context("starting the agent")?;
    for r in agent.resources() {
        tracing::info!(resource = r.name, module = r.module, socket = %r.socket.display(), "serving");
    }
    super::stop_signal().await?;
    tracing::info!("stopping");
    agent.shutdown().await;
    Ok(())
}
