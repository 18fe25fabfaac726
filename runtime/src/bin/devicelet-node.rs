//! `devicelet-node`: the node agent alone (`run`, `validate`, `status`, `module`, `precompile`),
//! what the image ships as `/usr/bin/devicelet`. The simulator's commands are not reachable from
//! here, so the linker leaves the simulator and the fixture trees out.

use clap::Parser;
use devicelet::cli::{self, NodeCli, NodeCommand};

fn main() -> std::process::ExitCode {
    let cli = NodeCli::parse();
    let compile_child = matches!(cli.command, NodeCommand::CompileModule);
    cli::entry(&cli.logging, compile_child, cli::node_main(cli.command))
}
