use clap::Parser;
use devicelet::cli::{self, Cli};

/// Async workers: the agent's own work (gRPC servers, health watchers, the ledger, metrics) never
/// blocks and is light, and module code runs on threads of its own, so two suffice on any node;
/// tokio's default (one per core) would be 16 idle threads on a 16-core GPU node.
const WORKERS: usize = 2;
/// How long an idle blocking-pool thread (compiles, file writes) stays before it ends.
const BLOCKING_KEEP_ALIVE: std::time::Duration = std::time::Duration::from_secs(2);

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    if let Err(e) = cli::init_logging(&cli.log, cli.log_format) {
        eprintln!("error: {e:#}");
        return std::process::ExitCode::from(2);
    }
    if matches!(cli.command, cli::Command::CompileModule) {
        // The agent's compiler child: no async runtime, no threads but the compiler's.
        return exit(devicelet::sandbox::compiler::serve_child());
    }
    // Compiles for the compile cache run in children of this binary.
    if let Ok(exe) = std::env::current_exe() {
        devicelet::sandbox::compiler::compile_in_children(exe);
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(WORKERS)
        .thread_keep_alive(BLOCKING_KEEP_ALIVE)
        .enable_all()
        .build();
    let result = match runtime {
        Ok(runtime) => runtime.block_on(cli::main(cli)),
        Err(e) => Err(anyhow::Error::from(e).context("starting the async runtime")),
    };
    exit(result)
}

fn exit(result: anyhow::Result<()>) -> std::process::ExitCode {
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
