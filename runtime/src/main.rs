//! `devicelet`: the node agent and the tools for trying modules (the simulator, `demo`, `try`).

use clap::Parser;
use devicelet::cli::{self, Cli};

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    cli::entry(&cli.logging, cli.command)
}
