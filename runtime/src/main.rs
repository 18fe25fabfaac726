//! `devicelet`: the node agent and the tools for trying modules (the simulator, `demo`, `try`).

use clap::Parser;
use devicelet::cli::{self, Cli, Command, NodeCommand};

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let compile_child = matches!(cli.command, Command::Node(NodeCommand::CompileModule));
    cli::entry(&cli.logging, compile_child, cli::main(cli.command))
}
