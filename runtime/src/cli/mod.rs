//! The `devicelet` command line.

mod demo;
mod dra_show;
mod module;
mod precompile;
mod run;
pub mod simulate;
mod simulate_dra;
mod status;
mod try_dra;
mod try_module;
mod validate;

use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(
    name = "devicelet",
    version,
    about = "Kubernetes device plugins as sandboxed WebAssembly modules"
)]
pub struct Cli {
    #[command(flatten)]
    pub logging: Logging,
    #[command(subcommand)]
    pub command: Command,
}

/// The node agent's command line (`devicelet-node`, the image's `/usr/bin/devicelet`): [`Cli`]
/// without the simulator's commands (`simulate`, `demo`, `try`), which a node never runs. Same
/// name, flags and output, so a DaemonSet's arguments mean the same to both.
#[derive(Parser, Debug)]
#[command(
    name = "devicelet",
    version,
    about = "Kubernetes device plugins as sandboxed WebAssembly modules (the node agent)"
)]
pub struct NodeCli {
    #[command(flatten)]
    pub logging: Logging,
    #[command(subcommand)]
    pub command: NodeCommand,
}

/// Every command's logging flags, in both binaries.
#[derive(clap::Args, Debug)]
pub struct Logging {
    /// Log filter, as in RUST_LOG (e.g. `info`, `devicelet=debug`), plus `module=NAME:LEVEL`
    /// for one module's own lines and whatever the agent logs while running its code (e.g.
    /// `warn,module=sriov-vfio:debug`).
    #[arg(long, global = true, default_value = "info")]
    pub log: String,
    /// Log lines as text (coloured only on a terminal) or as one JSON object per line, for log
    /// collectors.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogFormat {
    Text,
    Json,
}

/// Sets up logging to stderr: JSON lines, or text with colour only when stderr is a terminal (a
/// log collector must not get escape codes). A filter that does not parse is an error, never a
/// silent default.
pub fn init_logging(filter: &str, format: LogFormat) -> anyhow::Result<()> {
    use std::io::IsTerminal;
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_new(directives(filter))
        .map_err(|e| anyhow::anyhow!("--log {filter:?}: {e}"))?;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Json => builder.json().init(),
        LogFormat::Text => builder.with_ansi(std::io::stderr().is_terminal()).init(),
    }
    Ok(())
}

/// `--log`'s directives as `EnvFilter` reads them: `module=NAME:LEVEL` becomes
/// `[module{name=NAME}]=LEVEL`, which enables that level inside the span every call into the
/// module runs in (see `sandbox::module`).
fn directives(filter: &str) -> String {
    filter
        .split(',')
        .map(|directive| {
            match directive
                .trim()
                .strip_prefix("module=")
                .and_then(|rest| rest.rsplit_once(':'))
            {
                Some((name, level)) => format!("[module{{name={name}}}]={level}"),
                None => directive.to_owned(),
            }
        })
        .collect::<Vec<_>>()
        .join(",")
}

#[cfg(test)]
mod tests {
    #[test]
    fn module_directives_become_span_filters() {
        assert_eq!(
            super::directives("warn,module=sriov-vfio:debug,devicelet=info"),
            "warn,[module{name=sriov-vfio}]=debug,devicelet=info"
        );
        assert_eq!(super::directives("info"), "info");
    }

    /// A command's one-line summary, shown in its parent's list, names each of its (visible)
    /// subcommands: `devicelet --help` is where a user looks for what exists.
    #[test]
    fn every_summary_names_the_subcommands_under_it() {
        use clap::CommandFactory;
        fn check(command: &clap::Command, missing: &mut Vec<String>) {
            let about = command
                .get_about()
                .map(|a| a.to_string())
                .unwrap_or_default();
            for sub in command.get_subcommands().filter(|s| !s.is_hide_set()) {
                if !command.get_name().starts_with("devicelet") && !about.contains(sub.get_name()) {
                    missing.push(format!(
                        "`{}`'s summary lacks `{}`",
                        command.get_name(),
                        sub.get_name()
                    ));
                }
                check(sub, missing);
            }
        }
        let mut missing = Vec::new();
        check(&super::Cli::command(), &mut missing);
        assert!(missing.is_empty(), "{missing:#?}");
    }
}

/// Where vendor libraries are loaded from, for modules the registry grants them.
#[derive(clap::Args, Debug, Clone)]
pub struct LibraryArgs {
    /// NVIDIA's NVML library: a path, or a file name the dynamic loader searches for. Opened only
    /// when a module is granted `libraries = ["nvml"]`; when it is missing, such modules see
    /// "no NVML on this node" and every other module runs as usual.
    #[arg(long, default_value = crate::nvml::DEFAULT_LIBRARY)]
    pub nvml_library: std::path::PathBuf,
}

impl LibraryArgs {
    pub fn libraries(&self) -> crate::nvml::Libraries {
        crate::nvml::Libraries {
            nvml: self.nvml_library.clone(),
        }
    }
}

/// How modules with a `source` are fetched.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct RegistryArgs {
    /// A registry (`host[:port]`) reached over plain HTTP instead of HTTPS, for modules whose
    /// `source` names it (repeat for several). Every other registry is reached over HTTPS with
    /// the system's roots.
    #[arg(long = "insecure-registry", value_name = "HOST[:PORT]")]
    pub insecure: Vec<String>,
    /// PEM certificates to trust besides the system's roots for registries (a private
    /// registry's CA).
    #[arg(long = "registry-ca", value_name = "FILE")]
    pub ca: Option<std::path::PathBuf>,
    /// Registry credentials: a Docker `config.json` (`auths`, as `docker login` writes it and a
    /// `kubernetes.io/dockerconfigjson` Secret mounts it). Basic credentials, or exchanged for a
    /// bearer token where the registry asks for one.
    #[arg(long = "registry-auth", value_name = "FILE")]
    pub auth: Option<std::path::PathBuf>,
}

impl RegistryArgs {
    pub fn access(&self) -> anyhow::Result<crate::oci::access::Access> {
        crate::oci::access::Access::load(
            self.insecure.clone(),
            self.ca.as_deref(),
            self.auth.as_deref(),
        )
        .map_err(anyhow::Error::msg)
    }
}

/// Every command: the node agent's, and the simulator's tools for trying modules.
#[derive(Subcommand, Debug)]
pub enum Command {
    #[command(flatten)]
    Node(NodeCommand),
    /// Run the built-in kubelet simulator, for trying a module locally.
    Simulate(simulate::SimulateArgs),
    /// The reference module against the simulator and a fixture device tree: through the device
    /// plugin, through DRA, and pulled as a signed OCI artifact from a local `docker-registry`
    /// (skipped when it is not installed).
    Demo(demo::DemoArgs),
    /// One module against a fixture node and the simulator: registration, snapshots, an
    /// allocation, then the fixture watched for changes.
    Try(try_module::TryArgs),
}

/// The node agent's commands: all of [`NodeCli`]'s, and [`Cli`]'s besides the simulator's.
#[derive(Subcommand, Debug)]
pub enum NodeCommand {
    /// Serve every resource of the registry's modules to the kubelet.
    Run(Box<run::RunArgs>),
    /// Check a registry and load its modules without serving anything.
    Validate(validate::ValidateArgs),
    /// Show what a running agent serves: resources, devices, health and holders.
    Status(status::StatusArgs),
    /// Modules in OCI registries: push one, inspect one, or sign one.
    #[command(subcommand)]
    Module(module::ModuleCommand),
    /// Compile modules ahead of time into a directory, for an image to carry (`run
    /// --precompiled-dir`): a new node's first start then compiles nothing.
    Precompile(precompile::PrecompileArgs),
    /// Internal: compiles a component read on stdin for the agent, writing the precompiled form
    /// on stdout (the agent runs it as a child, so the compiler's memory is never its own).
    #[command(hide = true)]
    CompileModule,
}

/// The node agent's commands; reaches none of the simulator's, so `devicelet-node` links none
/// of it.
pub async fn node_main(command: NodeCommand) -> anyhow::Result<()> {
    match command {
        NodeCommand::Run(args) => run::run(*args).await,
        NodeCommand::Validate(args) => validate::run(args).await,
        NodeCommand::Status(args) => status::run(args).await,
        NodeCommand::Module(command) => module::run(command).await,
        NodeCommand::Precompile(args) => precompile::run(args).await,
        NodeCommand::CompileModule => crate::sandbox::compiler::serve_child(),
    }
}

/// Async workers: the agent's own work (gRPC servers, health watchers, the ledger, metrics) never
/// blocks and is light, and module code runs on threads of its own, so two suffice on any node;
/// tokio's default (one per core) would be 16 idle threads on a 16-core GPU node.
const WORKERS: usize = 2;
/// How long an idle blocking-pool thread (compiles, file writes) stays before it ends.
const BLOCKING_KEEP_ALIVE: std::time::Duration = std::time::Duration::from_secs(2);

/// Both binaries' `main`: logging, the compile child (`compile_child`: this process is one), the
/// async runtime, and `command` run on it.
pub fn entry(
    logging: &Logging,
    compile_child: bool,
    command: impl std::future::Future<Output = anyhow::Result<()>>,
) -> std::process::ExitCode {
    if let Err(e) = init_logging(&logging.log, logging.log_format) {
        eprintln!("error: {e:#}");
        return std::process::ExitCode::from(2);
    }
    if compile_child {
        // The agent's compiler child: no async runtime, no threads but the compiler's.
        return exit(crate::sandbox::compiler::serve_child());
    }
    end_quietly_on_a_closed_stdout();
    // Compiles for the compile cache run in children of this binary.
    if let Ok(exe) = std::env::current_exe() {
        crate::sandbox::compiler::compile_in_children(exe);
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(WORKERS)
        .thread_keep_alive(BLOCKING_KEEP_ALIVE)
        .enable_all()
        .build();
    let result = match runtime {
        Ok(runtime) => runtime.block_on(command),
        Err(e) => Err(anyhow::Error::from(e).context("starting the async runtime")),
    };
    exit(result)
}

/// `devicelet validate … | head`: the reader goes away. Rust ignores SIGPIPE, so the next
/// `println!` panics; end instead as any Unix filter does, by SIGPIPE, quietly (status 141 in a
/// shell). Only a write to stdout failing with EPIPE does this: a socket's EPIPE stays an error.
fn end_quietly_on_a_closed_stdout() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let message = info.payload_as_str().unwrap_or_default();
        if message.starts_with("failed printing to stdout") && message.ends_with("(os error 32)") {
            // SAFETY: restores SIGPIPE's default action and raises it on this process.
            unsafe {
                libc::signal(libc::SIGPIPE, libc::SIG_DFL);
                libc::raise(libc::SIGPIPE);
            }
        }
        default(info);
    }));
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

pub async fn main(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Node(command) => node_main(command).await,
        Command::Simulate(args) => simulate::run(args).await,
        Command::Demo(args) => demo::run(args).await,
        Command::Try(args) => try_module::run(args).await,
    }
}

/// Waits for SIGINT or SIGTERM, the ways a DaemonSet pod or a terminal stops us.
pub async fn stop_signal() -> anyhow::Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())?;
    tokio::select! {
        r = tokio::signal::ctrl_c() => r?,
        _ = term.recv() => {}
    }
    Ok(())
}
