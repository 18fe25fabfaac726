//! Allocate measured as on a node: the agent (`devicelet run`), a trivial plugin answering from
//! memory, and the client each in their own process, so the client's calls cross processes the
//! way the kubelet's do and neither server shares a runtime with the caller.
//!
//! The bench binary plays the two helper roles itself: `devicelet-bench floor-process` serves a
//! constant Allocate answer until its stdin closes, and `devicelet-bench client-process` times
//! Allocate calls against both sockets in alternating batches and prints the figures.

use std::path::Path;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Context;
use tokio::io::AsyncReadExt;

use super::floor;
use super::node;
use devicelet::kubelet::api::deviceplugin as api;

/// `devicelet-bench floor-process <socket> <container:host:perm>... [--env K=V]...`.
const FLOOR: &str = "floor-process";
/// `devicelet-bench client-process <ours> <floor> <warmup> <calls> <batch> <id>[,<id>...]`.
const CLIENT: &str = "client-process";

/// Runs a helper role if `args` names one (None: the normal benchmark run).
pub async fn child_main(args: &[String]) -> Option<ExitCode> {
    let role = args.get(1)?;
    let result = match role.as_str() {
        FLOOR => serve_floor(&args[2..]).await,
        CLIENT => run_client(&args[2..]).await,
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
    )?;
    // Serve until the parent closes our stdin (or dies).
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
