//! The agent as its own process (`devicelet run`), as on a node: for start-up and memory.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::Context;
use tokio::process::{Child, Command};

use super::node::Node;

/// Where a spawned agent keeps its state and compiled modules.
pub struct AgentDirs {
    pub state: PathBuf,
    pub cache: PathBuf,
    /// `--precompiled-dir`: modules compiled ahead of time, as an image carries them.
    pub precompiled: Option<PathBuf>,
    /// `--nvml-library`, for a registry granting NVML (the fake one).
    pub nvml: Option<PathBuf>,
}

pub struct AgentProcess {
    child: Child,
    pid: u32,
    log: PathBuf,
    /// When the spawn was asked for.
    pub spawned_at: Instant,
}

impl AgentProcess {
    /// `devicelet run` on `node` with `registry`; its log goes to a file in the node's directory.
    pub fn spawn(
        devicelet: &Path,
        node: &Node,
        registry: &Path,
        dirs: &AgentDirs,
    ) -> anyhow::Result<AgentProcess> {
        let log = node.dir.path().join("agent.log");
        let log_file = std::fs::File::create(&log)?;
        let mut command = Command::new(devicelet);
        command
            .arg("run")
            .arg("--config")
            .arg(registry)
            .arg("--kubelet-dir")
            .arg(node.plugin_dir())
            .arg("--state-dir")
            .arg(&dirs.state)
            .arg("--cache-dir")
            .arg(&dirs.cache)
            .arg("--precompiled-dir")
            .arg(
                dirs.precompiled
                    .clone()
                    .unwrap_or_else(|| dirs.state.join("no-precompiled")),
            )
            .arg("--pod-resources-socket")
            .arg(node.sim.pod_resources_socket())
            .args(
                dirs.nvml
                    .iter()
                    .flat_map(|l| [OsStr::new("--nvml-library"), l.as_os_str()]),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log_file)
            .kill_on_drop(true);
        let spawned_at = Instant::now();
        let child = command
            .spawn()
            .with_context(|| format!("spawning {}", devicelet.display()))?;
        let pid = child.id().context("the agent exited at once")?;
        Ok(AgentProcess {
            child,
            pid,
            log,
            spawned_at,
        })
    }

    /// VmRSS from `/proc/<pid>/status`, in bytes.
    pub fn rss(&self) -> anyhow::Result<u64> {
        self.status_bytes("VmRSS:")
    }

    /// RssAnon (heap, stacks, wasm linear memories): the part of VmRSS not backed by files.
    pub fn rss_anon(&self) -> anyhow::Result<u64> {
        self.status_bytes("RssAnon:")
    }

    /// VmHWM: the most VmRSS has been, start-up included.
    pub fn rss_peak(&self) -> anyhow::Result<u64> {
        self.status_bytes("VmHWM:")
    }

    /// RssFile: pages of mapped files (the binary, its libraries, compiled modules).
    pub fn rss_file(&self) -> anyhow::Result<u64> {
        self.status_bytes("RssFile:")
    }

    fn status_bytes(&self, key: &str) -> anyhow::Result<u64> {
        status_bytes(self.pid, key)
    }

    /// The end of its log, for an error message.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }

    /// SIGTERM, as a DaemonSet pod is stopped, and waits for the exit (SIGKILL after 10 s).
    pub async fn terminate(mut self) -> anyhow::Result<()> {
        let pid = libc::pid_t::try_from(self.pid)?;
        // SAFETY: signals our own child, which has not been reaped yet (we hold its Child).
        unsafe { libc::kill(pid, libc::SIGTERM) };
        match tokio::time::timeout(Duration::from_secs(10), self.child.wait()).await {
            Ok(status) => {
                status?;
            }
            Err(_) => {
                self.child.kill().await?;
                anyhow::bail!("the agent ignored SIGTERM for 10 s; killed it");
            }
        }
        Ok(())
    }
}

/// A `kB` line of `/proc/<pid>/status`, in bytes.
pub fn status_bytes(pid: u32, key: &str) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kb = status
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .with_context(|| format!("no {key} in /proc/{pid}/status"))?;
    Ok(kb * 1024)
}

/// Waits until every one of `resources` is registered and streaming with a snapshot; on
/// failure the error carries the agent's log.
pub async fn wait_all(
    node: &Node,
    agent: &AgentProcess,
    resources: &[String],
) -> anyhow::Result<()> {
    for r in resources {
        if let Err(e) = node.wait_served(r).await {
            anyhow::bail!("{e}\nagent log:\n{}", agent.log_tail());
        }
    }
    Ok(())
}
