//! Allocate measured as on a node: the agent (`devicelet run`), a trivial plugin answering from
//! memory, and the client each in their own process, so the client's calls cross processes the
//! way the kubelet's do and neither server shares a runtime with the caller.
//!
//! The bench binary plays the helper roles itself: `devicelet-bench floor-process` serves a
//! constant Allocate answer until its stdin closes, `devicelet-bench client-process` times
//! Allocate calls against both sockets in alternating batches and prints the figures, and
//! `devicelet-bench plugin-process` is the trivial plugin a start-up is measured against: it
//! serves, registers with the kubelet and streams one snapshot.

use std::path::Path;
use std::process::{ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use tokio::io::AsyncReadExt;
use tokio::process::{Child, Command};

use super::floor;
use super::node;
use devicelet::kubelet::api::deviceplugin as api;

/// `devicelet-bench floor-process <socket> <container:host:perm>... [--env K=V]...`.
const FLOOR: &str = "floor-process";
/// `devicelet-bench plugin-process <kubelet dir> <resource> <devices>`.
const PLUGIN: &str = "plugin-process";
/// `devicelet-bench client-process <ours> <floor> <warmup> <calls> <batch> <id>[,<id>...]`.
const CLIENT: &str = "client-process";

/// Runs a helper role if `args` names one (None: the normal benchmark run).
pub async fn child_main(args: &[String]) -> Option<ExitCode> {
    let role = args.get(1)?;
    let result = match role.as_str() {
        FLOOR => serve_floor(&args[2..]).await,
        CLIENT => run_client(&args[2..]).await,
        PLUGIN => serve_plugin(&args[2..]).await,
        _ => return None,
    };
    Some(match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{role}: {e:#}");
            ExitCode::FAILURE
        }
    })
}

/// The command line that serves `answer` (one container's response) from a floor process.
pub fn floor_args(socket: &Path, answer: &api::ContainerAllocateResponse) -> Vec<String> {
    let mut args = vec![FLOOR.to_owned(), socket.display().to_string()];
    for d in &answer.devices {
        args.push(format!(
            "{}:{}:{}",
            d.container_path, d.host_path, d.permissions
        ));
    }
    for (k, v) in &answer.envs {
        args.push(format!("--env={k}={v}"));
    }
    args
}

async fn serve_floor(args: &[String]) -> anyhow::Result<()> {
    let socket = args.first().context("no socket")?;
    let mut answer = api::ContainerAllocateResponse::default();
    for arg in &args[1..] {
        if let Some(env) = arg.strip_prefix("--env=") {
            let (k, v) = env.split_once('=').context("--env=K=V")?;
            answer.envs.insert(k.to_owned(), v.to_owned());
        } else {
            let mut parts = arg.splitn(3, ':');
            answer.devices.push(api::DeviceSpec {
                container_path: parts.next().unwrap_or_default().to_owned(),
                host_path: parts.next().unwrap_or_default().to_owned(),
                permissions: parts.next().unwrap_or_default().to_owned(),
            });
        }
    }
    let _floor = floor::serve(
        Path::new(socket),
        api::AllocateResponse {
            container_responses: vec![answer],
        },
        Vec::new(),
    )?;
    until_stdin_closes().await
}

/// A trivial plugin process registering `resource` with 10 healthy devices at `node`'s
/// kubelet; returns once the kubelet has its snapshot. It serves until [`stop`].
pub async fn spawn_plugin(node: &node::Node, resource: &str) -> anyhow::Result<Child> {
    let child = Command::new(std::env::current_exe()?)
        .arg(PLUGIN)
        .arg(node.plugin_dir())
        .arg(resource)
        .arg("10")
        .stdin(Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    node.wait_served(resource).await?;
    Ok(child)
}

/// Closes a helper process's stdin, which ends it, and waits for it.
pub async fn stop(mut child: Child) -> anyhow::Result<()> {
    drop(child.stdin.take());
    child.wait().await?;
    Ok(())
}

/// What a device plugin does at the least: serve its socket in the kubelet's directory, register,
/// stream a snapshot (of `dev-0` ..), and answer Allocate from memory.
async fn serve_plugin(args: &[String]) -> anyhow::Result<()> {
    let [dir, resource, devices] = args else {
        anyhow::bail!("usage: {PLUGIN} <kubelet dir> <resource> <devices>");
    };
    let dir = Path::new(dir);
    let devices = (0..devices.parse::<usize>()?)
        .map(|i| api::Device {
            id: format!("dev-{i}"),
            health: api::HEALTHY.to_owned(),
            ..Default::default()
        })
        .collect();
    let endpoint = format!("trivial-{}.sock", std::process::id());
    let _plugin = floor::serve(
        &dir.join(&endpoint),
        api::AllocateResponse::default(),
        devices,
    )?;
    devicelet::kubelet::registration::register(
        dir,
        &endpoint,
        resource,
        api::DevicePluginOptions::default(),
    )
    .await?;
    until_stdin_closes().await
}

/// Serves until the parent closes our stdin (or dies).
async fn until_stdin_closes() -> anyhow::Result<()> {
    let mut rest = Vec::new();
    tokio::io::stdin().read_to_end(&mut rest).await?;
    Ok(())
}

async fn run_client(args: &[String]) -> anyhow::Result<()> {
    let [ours, floor, warmup, calls, batch, device] = args else {
        anyhow::bail!("usage: {CLIENT} <ours> <floor> <warmup> <calls> <batch> <id>[,<id>...]");
    };
    let (warmup, calls, batch): (usize, usize, usize) =
        (warmup.parse()?, calls.parse()?, batch.parse()?);
    let request = api::AllocateRequest {
        container_requests: vec![api::ContainerAllocateRequest {
            devices_ids: device.split(',').map(str::to_owned).collect(),
        }],
    };
    let mut clients = [
        node::client(Path::new(ours)).await?,
        node::client(Path::new(floor)).await?,
    ];
    for client in &mut clients {
        super::allocate::measure(client, &request, warmup, &mut Vec::new()).await?;
    }
    let mut times: [Vec<Duration>; 2] = [Vec::with_capacity(calls), Vec::with_capacity(calls)];
    let mut round = 0;
    while times[0].len() < calls {
        let k = batch.min(calls - times[0].len());
        for side in [round % 2, 1 - round % 2] {
            super::allocate::measure(&mut clients[side], &request, k, &mut times[side]).await?;
        }
        round += 1;
    }
    for (label, samples) in ["ours", "floor"].iter().zip(&times) {
        let nanos: Vec<String> = samples.iter().map(|d| d.as_nanos().to_string()).collect();
        println!("{label} {}", nanos.join(" "));
    }
    Ok(())
}

/// Parses the client process's output into (ours, floor).
pub fn parse_client_output(text: &str) -> anyhow::Result<(Vec<Duration>, Vec<Duration>)> {
    let mut sides = [Vec::new(), Vec::new()];
    for line in text.lines() {
        let mut words = line.split_whitespace();
        let side = match words.next() {
            Some("ours") => 0,
            Some("floor") => 1,
            _ => continue,
        };
        for w in words {
            sides[side].push(Duration::from_nanos(w.parse()?));
        }
    }
    let [ours, floor] = sides;
    anyhow::ensure!(
        !ours.is_empty() && !floor.is_empty(),
        "no figures in:\n{text}"
    );
    Ok((ours, floor))
}

/// Waits until something accepts connections on `socket`.
pub async fn wait_for_socket(socket: &Path) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(10);
    while tokio::net::UnixStream::connect(socket).await.is_err() {
        anyhow::ensure!(
            Instant::now() < deadline,
            "{} never served",
            socket.display()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Ok(())
}
