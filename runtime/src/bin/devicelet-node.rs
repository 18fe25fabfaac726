//! `devicelet-node`: the node agent alone (`run`, `validate`, `status`, `module`, `precompile`),
//! what the image ships as `/usr/bin/devicelet`. The simulator's commands are not reachable from
//! here, so the linker leaves the simulator and the fixture trees out.

use clap::Parser;
use devicelet::cli::{self, NodeCli};

fn main() -> std::process::ExitCode {
    let cli = NodeCli::parse();
    cli::entry(&cli.logging, cli.command.into())
}
