//! Compiling a component without keeping what the compiler used.
//!
//! Cranelift is the largest thing the agent runs: tens of MiB of heap and its own code pages
//! for a few hundred milliseconds, and a thread per core in rayon's pool, which never lets them
//! go. The agent (`devicelet run`) therefore compiles in a child process of its own binary
//! (`devicelet compile-module`, hidden): the child reads the component on stdin and writes the
//! precompiled form on stdout, the agent writes it into its compile cache and maps it from there
//! as on any warm start. Its resident memory after a cold start is what it is after a warm one,
//! and a module built to make the compiler blow up takes down only the child. The child compiles
//! untrusted input, so it runs with the least it needs: an empty environment, `no_new_privs`, no
//! capabilities (its bounding set emptied, so exec as root grants none), limits on address
//! space, CPU time, open files and core dumps ([`harden`]), and a system-call filter it applies
//! to itself before reading its input (`compile_filter.rs`: memory, threads, stdin and stdout,
//! nothing else — no file, socket, exec or signal to another process). A child the kernel kills (out of
//! memory under node pressure) is tried again after a pause and blamed on the module only when it
//! dies the same way again. Where there is no
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
/// The child's address space: room for Cranelift on the largest module (it reserves no guest
/// memory), far below what would take a node down.
const CHILD_ADDRESS_SPACE: u64 = 4 << 30;
/// Its open files: stdin, stdout, stderr and what the runtime opens itself.
const CHILD_FILES: u64 = 64;
/// How the child's stderr starts a line saying it runs without its system-call filter: the
/// agent logs that line apart from any compile error.
const UNFILTERED: &str = "warning (unfiltered): ";
/// The pauses before trying a child the kernel killed again.
const RETRY_PAUSES: [Duration; 2] = [Duration::from_secs(1), Duration::from_secs(4)];

/// `capset(2)`'s header and data, version 3 (two 32-bit words per set).
#[repr(C)]
struct CapHeader {
    version: u32,
    pid: i32,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

/// Limits `command`'s process to what compiling needs (see the module's doc): applied between
/// fork and exec. A root child whose bounding set cannot be emptied (the agent lacks
/// CAP_SETPCAP) is not started: the compile then runs in the agent, as where no child can run.
/// Limits are never raised past the agent's own hard limits.
pub fn harden(command: &mut Command) {
    use std::os::unix::process::CommandExt;
    command.env_clear();
    // SAFETY: the closure runs in the child between fork and exec and calls only prctl(2),
    // getrlimit(2), setrlimit(2), capset(2) and geteuid(2), which are async-signal-safe; it
    // allocates nothing (an `io::Error` from errno holds no heap).
    unsafe {
        command.pre_exec(|| {
            // Empty the bounding set, so the exec that follows grants root no capability.
            for cap in 0..64 {
                if libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0) != 0
                    && std::io::Error::last_os_error().raw_os_error() == Some(libc::EINVAL)
                {
                    break;
                }
            }
            libc::prctl(
                libc::PR_CAP_AMBIENT,
                libc::PR_CAP_AMBIENT_CLEAR_ALL,
                0,
                0,
                0,
            );
            if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            let cpu = CHILD_LIMIT.as_secs() + 5;
            for (resource, wanted) in [
                (libc::RLIMIT_AS, CHILD_ADDRESS_SPACE),
                (libc::RLIMIT_CPU, cpu),
                (libc::RLIMIT_NOFILE, CHILD_FILES),
                (libc::RLIMIT_CORE, 0),
            ] {
                let mut now = libc::rlimit {
                    rlim_cur: 0,
                    rlim_max: 0,
                };
                if libc::getrlimit(resource, &mut now) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                let limit = wanted.min(now.rlim_max);
                let limit = libc::rlimit {
                    rlim_cur: limit,
                    rlim_max: limit,
                };
                if libc::setrlimit(resource, &limit) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            // Every set emptied, the inheritable one included: for root, exec grants what is
            // inheritable as well as what the bounding set allows.
            let header = CapHeader {
                version: 0x2008_0522,
                pid: 0,
            };
            let none = [CapData {
                effective: 0,
                permitted: 0,
                inheritable: 0,
            }; 2];
            if libc::syscall(libc::SYS_capset, &header, none.as_ptr()) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::geteuid() == 0 {
                for cap in 0..64 {
                    match libc::prctl(libc::PR_CAPBSET_READ, cap, 0, 0, 0) {
                        0 => {}
                        1 => return Err(std::io::Error::from_raw_os_error(libc::EPERM)),
                        _ => break,
                    }
                }
            }
            Ok(())
        });
    }
}

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

/// One child's end.
enum Attempt {
    Done(ChildCompile),
    /// The kernel (or someone) killed it with this signal: not the compiler's verdict.
    Signalled(i32, String),
}

/// Compiles `wasm` in a child process (see the module's doc), trying again after a pause when
/// the child is killed by a signal, and blaming the module when it dies the same way twice.
pub(super) fn compile_in_child(exe: &Path, wasm: &[u8]) -> ChildCompile {
    let mut signals = Vec::new();
    for pause in std::iter::once(None).chain(RETRY_PAUSES.map(Some)) {
        if let Some(pause) = pause {
            std::thread::sleep(pause);
        }
        match attempt(exe, wasm) {
            Attempt::Done(done) => return done,
            Attempt::Signalled(signal, text) => {
                if signals.contains(&signal) {
                    return ChildCompile::Refused(format!(
                        "the compiler process was killed by signal {signal} again ({text}): the \
                         module is too much to compile here"
                    ));
                }
                tracing::warn!(
                    "the compiler process was killed by signal {signal} ({text}); trying again"
                );
                signals.push(signal);
            }
        }
    }
    ChildCompile::Refused(format!(
        "the compiler process was killed by signals {signals:?}, each time another"
    ))
}

/// One child compile.
fn attempt(exe: &Path, wasm: &[u8]) -> Attempt {
    use std::os::unix::process::ExitStatusExt;
    let mut command = Command::new(exe);
    command
        .arg("compile-module")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    harden(&mut command);
    let spawned = command.spawn();
    let mut child = match spawned {
        Ok(child) => child,
        Err(e) => {
            return Attempt::Done(ChildCompile::NotRun(format!(
                "cannot start {}: {e}",
                exe.display()
            )));
        }
    };
    let (Some(mut stdin), Some(stdout), Some(stderr)) =
        (child.stdin.take(), child.stdout.take(), child.stderr.take())
    else {
        let _ = child.kill();
        let _ = child.wait();
        return Attempt::Done(ChildCompile::NotRun("its pipes were not set up".into()));
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
                return Attempt::Done(ChildCompile::NotRun(format!("cannot wait for it: {e}")));
            }
        }
    };
    let _ = feeder.join();
    let bytes = reader.join();
    let stderr = errors.join().unwrap_or_default();
    let (unfiltered, message): (Vec<&str>, Vec<&str>) =
        stderr.lines().partition(|l| l.starts_with(UNFILTERED));
    for line in unfiltered {
        tracing::warn!("the compiler process: {line}");
    }
    let message = message.join("\n").trim().to_owned();
    Attempt::Done(match status {
        Err(why) => ChildCompile::Refused(why),
        Ok(status) if status.success() => match bytes {
            Ok(Ok(bytes)) => ChildCompile::Compiled(bytes),
            _ => ChildCompile::NotRun("its answer could not be read".into()),
        },
        Ok(status) if status.signal().is_some() => {
            let signal = status.signal().unwrap_or_default();
            return Attempt::Signalled(signal, format!("{status}"));
        }
        // Exit 1 is the compiler's refusal; anything else is the module's doing too, and must
        // not be retried in the agent.
        Ok(status) => ChildCompile::Refused(if message.is_empty() {
            format!("the compiler process ended with {status}")
        } else {
            message
        }),
    })
}

/// The child's side: `devicelet compile-module`. Reads a component on stdin, writes its
/// precompiled form on stdout; a component that does not compile is an error (exit 1).
pub fn serve_child() -> anyhow::Result<()> {
    if let Err(e) = super::compile_filter::confine() {
        // A kernel without seccomp filters: the child's other limits still stand, and it is
        // still better confined than a compile in the agent. The agent logs this line.
        eprintln!("{UNFILTERED}{e}; compiling without the system-call filter");
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn hardened_output(args: &[&str]) -> String {
        let mut command = Command::new("/bin/cat");
        command.args(args).env("LEAK", "secret");
        harden(&mut command);
        let out = command.output().expect("running cat hardened");
        assert!(out.status.success(), "{out:?}");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// A stand-in for `devicelet compile-module`: a shell script.
    fn script(dir: &Path, body: &str) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let path = dir.join("compiler");
        std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        path
    }

    #[test]
    fn a_child_the_kernel_kills_is_tried_again_and_blamed_only_when_it_dies_so_again() {
        let dir = tempfile::tempdir().unwrap();
        let marker = dir.path().join("killed-once");
        // Killed the first time (as the OOM killer would), fine the second.
        let once = script(
            dir.path(),
            &format!(
                "if [ -e {m} ]; then printf compiled; else : > {m}; kill -9 $$; fi",
                m = marker.display()
            ),
        );
        match compile_in_child(&once, b"wasm") {
            ChildCompile::Compiled(bytes) => assert_eq!(bytes, b"compiled"),
            ChildCompile::Refused(e) | ChildCompile::NotRun(e) => panic!("{e}"),
        }
        let always = script(dir.path(), "kill -9 $$");
        match compile_in_child(&always, b"wasm") {
            ChildCompile::Refused(e) => {
                assert!(e.contains("killed by signal 9 again"), "{e}")
            }
            ChildCompile::Compiled(_) | ChildCompile::NotRun(_) => panic!("not refused"),
        }
    }

    #[test]
    fn the_compile_child_runs_without_environment_privileges_or_unbounded_resources() {
        assert_eq!(
            hardened_output(&["/proc/self/environ"]),
            "",
            "a clean environment"
        );
        let status = hardened_output(&["/proc/self/status"]);
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .map(str::trim)
                .unwrap_or_default()
                .to_owned()
        };
        assert_eq!(field("NoNewPrivs:"), "1", "{status}");
        assert_eq!(field("CapEff:"), "0000000000000000", "{status}");
        if crate::trust::euid() == 0 {
            assert_eq!(field("CapBnd:"), "0000000000000000", "{status}");
        }
        let limits = hardened_output(&["/proc/self/limits"]);
        let limit = |name: &str| {
            limits
                .lines()
                .find(|l| l.starts_with(name))
                .map(|l| {
                    l.split_whitespace()
                        .skip(name.split(' ').count())
                        .take(2)
                        .collect::<Vec<_>>()
                        .join(" ")
                })
                .unwrap_or_default()
        };
        assert_eq!(
            limit("Max address space"),
            format!("{CHILD_ADDRESS_SPACE} {CHILD_ADDRESS_SPACE}"),
            "{limits}"
        );
        assert_eq!(limit("Max cpu time"), "305 305", "{limits}");
        assert_eq!(limit("Max core file size"), "0 0", "{limits}");
    }
}
