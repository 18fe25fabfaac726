//! Compiling a component without keeping what the compiler used.
//!
//! Cranelift is the largest thing the agent runs: tens of MiB of heap and its own code pages
//! for a few hundred milliseconds, and a thread per core in rayon's pool, which never lets them
//! go. The agent (`devicelet run`) therefore compiles in a child process of its own binary
//! (`devicelet compile-module`, hidden): the child reads the component on stdin and writes the
//! precompiled form on stdout, the agent writes it into its compile cache and maps it from there
//! as on any warm start. Its resident memory after a cold start is what it is after a warm one,
//! and a module built to make the compiler blow up takes down only the child. Where there is no
//! child to run (the agent embedded in tests, `validate`, no usable cache), compiles run in a
//! rayon pool of their own, dropped (its threads ending) as soon as the component is ready, and
//! the compiler's freed heap is handed back to the kernel.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use wasmtime::Engine;
use wasmtime::component::Component;

/// The binary whose `compile-module` compiles for this process, once set.
static CHILD: OnceLock<PathBuf> = OnceLock::new();

/// The longest a child compile may take before it is killed.
const CHILD_LIMIT: Duration = Duration::from_secs(300);
/// Largest component the child reads, and largest precompiled answer read back.
const MAX_WASM: u64 = 256 << 20;
const MAX_CWASM: u64 = 256 << 20;
/// The child's error message, as much as is kept.
const MAX_ERROR: u64 = 16 << 10;

/// From now on, compiles for the compile cache run in children: `exe compile-module`. Set once,
/// by the `devicelet` binary.
pub fn compile_in_children(exe: PathBuf) {
    let _ = CHILD.set(exe);
}

pub(super) fn child() -> Option<&'static Path> {
    CHILD.get().map(PathBuf::as_path)
}

/// In this process, in a pool dropped after use.
pub fn compile(engine: &Engine, wasm: &[u8]) -> wasmtime::Result<Component> {
    let pool = rayon::ThreadPoolBuilder::new()
        .thread_name(|i| format!("compile-{i}"))
        .build();
    let component = match pool {
        Ok(pool) => pool.install(|| Component::from_binary(engine, wasm)),
        // No threads to be had: compile on this one.
        Err(_) => Component::from_binary(engine, wasm),
    };
    return_freed_memory();
    component
}

/// How a compile in a child went.
pub(super) enum ChildCompile {
    /// The precompiled component (what `Component::serialize` gives).
    Compiled(Vec<u8>),
    /// The component does not compile: the compiler's own message.
    Refused(String),
    /// The child could not run or did not finish; compiling in this process is still possible.
    NotRun(String),
}

/// Compiles `wasm` in a child process (see the module's doc).
pub(super) fn compile_in_child(exe: &Path, wasm: &[u8]) -> ChildCompile {
    let spawned = Command::new(exe)
        .arg("compile-module")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let mut child = match spawned {
        Ok(child) => child,
        Err(e) => return ChildCompile::NotRun(format!("cannot start {}: {e}", exe.display())),
    };
    let (Some(mut stdin), Some(stdout), Some(stderr)) =
        (child.stdin.take(), child.stdout.take(), child.stderr.take())
    else {
        let _ = child.kill();
        let _ = child.wait();
        return ChildCompile::NotRun("its pipes were not set up".into());
    };
    let wasm = wasm.to_vec();
    let feeder = std::thread::spawn(move || {
        let _ = stdin.write_all(&wasm);
    });
    let reader = std::thread::spawn(move || {
        let mut bytes = Vec::new();
        stdout
            .take(MAX_CWASM)
            .read_to_end(&mut bytes)
            .map(|_| bytes)
    });
    let errors = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr.take(MAX_ERROR).read_to_string(&mut text);
        text
    });
    let started = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break Ok(status),
            Ok(None) if started.elapsed() > CHILD_LIMIT => {
                let _ = child.kill();
                let _ = child.wait();
                break Err(format!("it took over {CHILD_LIMIT:?} and was killed"));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(5)),
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                let _ = (feeder.join(), reader.join(), errors.join());
                return ChildCompile::NotRun(format!("cannot wait for it: {e}"));
            }
        }
    };
    let _ = feeder.join();
    let bytes = reader.join();
    let message = errors.join().unwrap_or_default().trim().to_owned();
    match status {
        Err(why) => ChildCompile::Refused(why),
        Ok(status) if status.success() => match bytes {
            Ok(Ok(bytes)) => ChildCompile::Compiled(bytes),
            _ => ChildCompile::NotRun("its answer could not be read".into()),
        },
        // Exit 1 is the compiler's refusal; anything else (killed, out of memory) is the
        // module's doing too, and must not be retried in the agent.
        Ok(status) => ChildCompile::Refused(if message.is_empty() {
            format!("the compiler process ended with {status}")
        } else {
            message
        }),
    }
}

/// The child's side: `devicelet compile-module`. Reads a component on stdin, writes its
/// precompiled form on stdout; a component that does not compile is an error (exit 1).
pub fn serve_child() -> anyhow::Result<()> {
    let mut wasm = Vec::new();
    std::io::stdin().take(MAX_WASM).read_to_end(&mut wasm)?;
    let engine = super::engine::new_engine().map_err(|e| anyhow::anyhow!("{e:#}"))?;
    let bytes = engine
        .precompile_component(&wasm)
        .map_err(|e| anyhow::anyhow!("{e:#}"))?;
    let mut out = std::io::stdout().lock();
    out.write_all(&bytes)?;
    out.flush()?;
    Ok(())
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub(super) fn return_freed_memory() {
    // SAFETY: malloc_trim only walks glibc's own arenas; it takes no pointers of ours.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub(super) fn return_freed_memory() {}
