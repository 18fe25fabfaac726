//! The compile child's system-call filter. Cranelift compiling an untrusted component needs
//! memory, threads, its input and its output, and nothing else: after the filter is applied the
//! child cannot open a file, make a socket, run a program, start a process or signal another
//! one — calls outside the list fail with `EPERM`, which the compiler never needs (the cgroup
//! reads of `available_parallelism` fail quietly and it falls back to the CPU set). `clone` is
//! allowed for threads only (`CLONE_THREAD`); `clone3`, whose flags a filter cannot see, answers
//! `ENOSYS`, on which glibc makes its threads with `clone`. Applied by the child to itself before
//! it reads a byte, with `no_new_privs` already set by [`super::compiler::harden`].

use std::collections::BTreeMap;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};

/// Why the filter could not be made or applied.
#[derive(Debug, thiserror::Error)]
pub enum FilterError {
    #[error("building the compile child's system-call filter: {0}")]
    Build(String),
    #[error("applying the compile child's system-call filter: {0}")]
    Apply(String),
}

/// The calls the compiler makes once the process has started: memory, threads (rayon's pool and
/// the engine's epoch thread), reading stdin, writing stdout and stderr, and ending.
const ALLOWED: &[libc::c_long] = &[
    libc::SYS_read,
    libc::SYS_write,
    libc::SYS_writev,
    libc::SYS_close,
    libc::SYS_mmap,
    libc::SYS_munmap,
    libc::SYS_mremap,
    libc::SYS_mprotect,
    libc::SYS_madvise,
    libc::SYS_brk,
    libc::SYS_futex,
    libc::SYS_sched_yield,
    libc::SYS_sched_getaffinity,
    // Allowed here so the other filter's ENOSYS is what the caller sees: of two filters both
    // answering an error, the kernel takes the last installed one's.
    libc::SYS_clone3,
    libc::SYS_set_robust_list,
    libc::SYS_rseq,
    libc::SYS_rt_sigprocmask,
    libc::SYS_rt_sigaction,
    libc::SYS_rt_sigreturn,
    libc::SYS_restart_syscall,
    libc::SYS_sigaltstack,
    libc::SYS_getrandom,
    libc::SYS_gettid,
    libc::SYS_getpid,
    libc::SYS_clock_gettime,
    libc::SYS_clock_nanosleep,
    libc::SYS_nanosleep,
    libc::SYS_exit,
    libc::SYS_exit_group,
];

/// The filters for this machine's architecture, to be applied in this order (the kernel takes
/// the strictest answer of all); None where seccompiler knows none (the child then runs with its other limits
/// only).
pub fn filters() -> Result<Option<[BpfProgram; 2]>, FilterError> {
    let Ok(arch) = TargetArch::try_from(std::env::consts::ARCH) else {
        return Ok(None);
    };
    let build = |e: seccompiler::BackendError| FilterError::Build(e.to_string());
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> =
        ALLOWED.iter().map(|&call| (call, Vec::new())).collect();
    // Allowed only when the call's first argument compares so.
    let first_arg = |len, op, value| -> Result<Vec<SeccompRule>, FilterError> {
        let condition = SeccompCondition::new(0, len, op, value).map_err(build)?;
        Ok(vec![SeccompRule::new(vec![condition]).map_err(build)?])
    };
    // A thread names itself (std does, for the engine's epoch thread); no other prctl.
    rules.insert(
        libc::SYS_prctl,
        first_arg(
            SeccompCmpArgLen::Dword,
            SeccompCmpOp::Eq,
            libc::PR_SET_NAME as u64,
        )?,
    );
    // abort(): a signal to its own process only.
    rules.insert(
        libc::SYS_tgkill,
        first_arg(
            SeccompCmpArgLen::Dword,
            SeccompCmpOp::Eq,
            std::process::id().into(),
        )?,
    );
    // A thread, never a process.
    rules.insert(
        libc::SYS_clone,
        first_arg(
            SeccompCmpArgLen::Qword,
            SeccompCmpOp::MaskedEq(libc::CLONE_THREAD as u64),
            libc::CLONE_THREAD as u64,
        )?,
    );
    let program = |filter: SeccompFilter| {
        BpfProgram::try_from(filter).map_err(|e| FilterError::Build(e.to_string()))
    };
    let allowed = SeccompFilter::new(
        rules,
        SeccompAction::Errno(libc::EPERM as u32),
        SeccompAction::Allow,
        arch,
    )
    .map_err(build)?;
    let no_clone3 = SeccompFilter::new(
        [(libc::SYS_clone3, Vec::new())].into(),
        SeccompAction::Allow,
        SeccompAction::Errno(libc::ENOSYS as u32),
        arch,
    )
    .map_err(build)?;
    // `clone3` first: applying a filter takes `prctl` and `seccomp`, which the list refuses.
    Ok(Some([program(no_clone3)?, program(allowed)?]))
}

/// Applies [`filters`] to every thread of this process, for good.
pub fn confine() -> Result<(), FilterError> {
    for program in filters()?.into_iter().flatten() {
        seccompiler::apply_filter_all_threads(&program)
            .map_err(|e| FilterError::Apply(e.to_string()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// In a forked child (which calls only async-signal-safe functions after the fork): the
    /// filters applied, what the compiler needs still works and everything else is refused.
    #[test]
    fn the_filters_leave_memory_and_output_and_refuse_files_sockets_exec_processes_and_signals() {
        let Some([no_clone3, allowed]) = filters().expect("the filters build") else {
            return;
        };
        // SAFETY: the child applies the filter and makes raw system calls only, then _exits.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
        if pid == 0 {
            let code = unsafe {
                let errno = || *libc::__errno_location();
                if seccompiler::apply_filter(&no_clone3).is_err()
                    || seccompiler::apply_filter(&allowed).is_err()
                {
                    10
                } else if libc::mmap(
                    std::ptr::null_mut(),
                    4096,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                ) == libc::MAP_FAILED
                {
                    11
                } else if libc::write(2, b"".as_ptr().cast(), 0) != 0 {
                    12
                } else if libc::open(c"/proc/self/status".as_ptr(), libc::O_RDONLY) != -1
                    || errno() != libc::EPERM
                {
                    13
                } else if libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0) != -1
                    || errno() != libc::EPERM
                {
                    14
                } else if libc::execve(c"/bin/true".as_ptr(), std::ptr::null(), std::ptr::null())
                    != -1
                    || errno() != libc::EPERM
                {
                    15
                } else if libc::kill(1, 0) != -1 || errno() != libc::EPERM {
                    16
                } else if libc::prctl(libc::PR_SET_DUMPABLE, 1, 0, 0, 0) != -1 {
                    17
                } else if libc::fork() != -1 || errno() != libc::EPERM {
                    18
                } else if libc::syscall(libc::SYS_clone3, std::ptr::null::<u8>(), 0) != -1
                    || errno() != libc::ENOSYS
                {
                    19
                } else {
                    0
                }
            };
            // SAFETY: ends the forked child without running the test harness's exit code.
            unsafe { libc::_exit(code) };
        }
        let mut status = 0;
        // SAFETY: waits for the child forked above.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(libc::WIFEXITED(status), "the child died: {status:#x}");
        assert_eq!(
            libc::WEXITSTATUS(status),
            0,
            "10 apply, 11 mmap, 12 write, 13 open, 14 socket, 15 exec, 16 kill, 17 prctl, 18 fork, \
             19 clone3"
        );
    }
}
