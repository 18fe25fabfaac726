//! Benchmark 9: the NVIDIA module over the fake NVML library (`tests/fake-nvml`, loaded through
//! the agent's real dlopen path): a critical NVML event → the new snapshot at the kubelet,
//! GetPreferredAllocation on 8 GPUs in two NVLink islands answered by the module, and the
//! kubelet's calls while NVML hangs.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;

use super::Settings;
use super::node::{Node, WAIT};
use super::process::{AgentDirs, AgentProcess};
use super::report::Row;
use super::stats::{Samples, duration};
use devicelet::kubelet::api::deviceplugin::{
    AllocateRequest, ContainerAllocateRequest, ContainerPreferredAllocationRequest,
    PreferredAllocationRequest,
};
use devicelet_simulator::SimConfig;

const RESOURCE: &str = "nvidia.com/gpu";
/// How long an event keeps a GPU Unhealthy; the bench waits it out between samples.
const QUIET: Duration = Duration::from_millis(150);
const EVENTS: usize = 40;
const EVENT_TARGET: Duration = Duration::from_millis(50);
/// Calls of each kind timed with NVML healthy, and again with it hung.
const HUNG_CALLS: usize = 2_000;
/// The module's call deadline in this benchmark (the default).
const DEADLINE: Duration = Duration::from_secs(2);
const HUNG_TARGET: Duration = Duration::from_millis(2);

fn fixture() -> String {
    let bus = |i: u32| format!("00000000:{:02X}:00.0", 0x07 + i * 0x10);
    let gpus: Vec<String> = (0..8u32)
        .map(|i| {
            let links: Vec<String> = (0..8)
                .filter(|&j| j != i && j / 4 == i / 4)
                .map(|j| format!("{:?}", bus(j)))
                .collect();
            format!(
                r#"{{"uuid": "GPU-6c4a5f2e-0000-4000-8000-00000000000{i}", "name": "NVIDIA A100-SXM4-80GB",
                "minor": {i}, "pci-bus-id": {:?}, "memory-mib": 81920, "numa-node": {},
                "nvlinks": [{}]}}"#,
                bus(i),
                i / 4,
                links.join(", ")
            )
        })
        .collect();
    format!(
        r#"{{"driver-version": "550.54.15", "gpus": [{}]}}"#,
        gpus.join(", ")
    )
}

struct Gpus {
    library: PathBuf,
    control: PathBuf,
}

impl Gpus {
    fn new(dir: &Path, fake: &Path) -> anyhow::Result<Gpus> {
        let dir = dir.join("nvml");
        std::fs::create_dir_all(&dir)?;
        let library = dir.join("libnvidia-ml.so.1");
        std::fs::copy(fake, &library).with_context(|| format!("copying {}", fake.display()))?;
        std::fs::write(dir.join("nvml.json"), fixture())?;
        let control = dir.join("nvml.control");
        std::fs::write(&control, "")?;
        Ok(Gpus { library, control })
    }

    fn inject(&self, line: &str) -> anyhow::Result<()> {
        let mut file = std::fs::OpenOptions::new()
            .append(true)
            .open(&self.control)?;
        writeln!(file, "{line}")?;
        Ok(())
    }
}

pub async fn run(s: &Settings) -> anyhow::Result<Vec<Row>> {
    let fake = s
        .fake_nvml
        .as_deref()
        .context("the nvidia benchmark needs --fake-nvml (scripts/bench.sh builds it)")?;
    let node = Node::start(SimConfig::default()).await?;
    let (registry, gpus) = eight_gpus(s, &node, fake)?;
    let library = gpus.library.clone();
    let agent = node
        .start_agent_with(&registry, |o| o.libraries.nvml = library)
        .await?;
    node.sim
        .wait_until(RESOURCE, WAIT, |r| r.allocatable == 8)
        .await?;
    let nvml = devicelet::nvml::open(&gpus.library);
    let began = Instant::now();
    while nvml.watched_gpus() < 8 {
        anyhow::ensure!(
            began.elapsed() < WAIT,
            "the NVML event thread never watched 8 GPUs"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let mut rows = vec![
        event_to_snapshot(s, &node, &gpus).await?,
        preferred(s, &node).await?,
    ];
    rows.extend(while_hung(s, &node, &gpus, &agent).await?);
    agent.shutdown().await;
    Ok(rows)
}

/// Eight fake GPUs on `node` (device nodes, the fake NVML library and its fixture) and a
/// registry serving them with the nvidia-gpu module, health checked by events only.
fn eight_gpus(s: &Settings, node: &Node, fake: &Path) -> anyhow::Result<(PathBuf, Gpus)> {
    node.add_char("/dev/nvidiactl", 195, 255)?;
    for i in 0..8 {
        node.add_char(&format!("/dev/nvidia{i}"), 195, i)?;
    }
    let gpus = Gpus::new(node.dir.path(), fake)?;
    let registry = node.registry(&format!(
        r#"[[module]]
name = "nvidia-gpu"
path = "{}"
resource-domain = "nvidia.com"
health-interval = "1h"

[module.grants]
dev = ["/dev/nvidia*"]
libraries = ["nvml"]

[module.config]
quiet-period = "{}ms"
"#,
        s.module_dir.join("nvidia_gpu.wasm").display(),
        QUIET.as_millis()
    ))?;
    Ok((registry, gpus))
}

/// `devicelet run`, as a process, serving eight fake GPUs on `node` ([`eight_gpus`]); returns
/// once all eight are allocatable.
pub(super) async fn spawn_serving(
    s: &Settings,
    node: &Node,
    fake: &Path,
    cache: &Path,
    state: PathBuf,
) -> anyhow::Result<AgentProcess> {
    let (registry, gpus) = eight_gpus(s, node, fake)?;
    let dirs = AgentDirs {
        state,
        cache: cache.to_owned(),
        precompiled: None,
        nvml: Some(gpus.library),
    };
    let agent = AgentProcess::spawn(&s.devicelet, node, &registry, &dirs)?;
    if let Err(e) = node
        .sim
        .wait_until(RESOURCE, WAIT, |r| r.streaming && r.allocatable == 8)
        .await
    {
        anyhow::bail!("{e}\nagent log:\n{}", agent.log_tail());
    }
    Ok(agent)
}

/// An XID 79 on one GPU until the kubelet sees it Unhealthy. With a one-hour health interval
/// only the event can wake the check. Between samples the GPU recovers: after the quiet period
/// an ignored XID (13) wakes the check again.
async fn event_to_snapshot(s: &Settings, node: &Node, gpus: &Gpus) -> anyhow::Result<Row> {
    let mut samples = Vec::new();
    for i in 0..s.n(EVENTS) {
        let gpu = i % 8;
        let started = Instant::now();
        gpus.inject(&format!("xid {gpu} 79"))?;
        node.sim
            .wait_until(RESOURCE, WAIT, |r| r.allocatable == 7)
            .await?;
        samples.push(started.elapsed());
        tokio::time::sleep(QUIET).await;
        gpus.inject(&format!("xid {gpu} 13"))?;
        node.sim
            .wait_until(RESOURCE, WAIT, |r| r.allocatable == 8)
            .await?;
    }
    let samples = Samples::new(samples);
    Ok(Row::judged(
        format!(
            "9. NVML critical event (XID 79, fake NVML) → GPU Unhealthy in the kubelet's snapshot, \
             health-interval 1h ({} events)",
            samples.count()
        ),
        samples.summary(false),
        format!("p50 ≤ {}", duration(EVENT_TARGET)),
        samples.p50() <= EVENT_TARGET,
    ))
}

/// GetPreferredAllocation through the kubelet's client: 8 GPUs in two NVLink islands, 4 wanted.
async fn preferred(s: &Settings, node: &Node) -> anyhow::Result<Row> {
    let state = node
        .sim
        .resource(RESOURCE)
        .context("the resource vanished")?;
    let request = PreferredAllocationRequest {
        container_requests: vec![ContainerPreferredAllocationRequest {
            available_device_i_ds: state.devices.iter().map(|d| d.id.clone()).collect(),
            must_include_device_i_ds: vec![state.devices[5].id.clone()],
            allocation_size: 4,
        }],
    };
    let mut client = node.client(RESOURCE).await?;
    let calls = s.n(5_000);
    let mut samples = Vec::with_capacity(calls);
    for i in 0..s.n(200) + calls {
        let started = Instant::now();
        let answer = client
            .get_preferred_allocation(request.clone())
            .await?
            .into_inner();
        let took = started.elapsed();
        let chosen = &answer.container_responses[0].device_i_ds;
        // The island of the must-include GPU (4-7): every chosen ID ends in 4..=7.
        anyhow::ensure!(
            chosen.len() == 4 && chosen.iter().all(|id| id.ends_with(['4', '5', '6', '7'])),
            "not one NVLink island: {chosen:?}"
        );
        if i >= s.n(200) {
            samples.push(took);
        }
    }
    let samples = Samples::new(samples);
    Ok(Row::judged(
        format!(
            "9. GetPreferredAllocation, the NVIDIA module's NVLink-aware choice, 8 GPUs in two \
             islands, one must-include, size 4 ({} calls)",
            samples.count()
        ),
        samples.summary(false),
        "p99 ≤ 1 ms",
        samples.p99() <= Duration::from_millis(1),
    ))
}

/// The kubelet's quick calls, with NVML healthy and then hung: one-GPU Allocates (answered from
/// the answers prepared ahead of time) alternating with GetPreferredAllocation, on one
/// connection. While hung, a two-GPU Allocate on that same connection is stuck in NVML at every
/// moment (one after another, each failing at the module's deadline), as when the kubelet admits
/// a pod while the driver is wedged.
async fn while_hung(
    s: &Settings,
    node: &Node,
    gpus: &Gpus,
    agent: &devicelet::agent::Agent,
) -> anyhow::Result<Vec<Row>> {
    let mut progress = agent
        .resource(RESOURCE)
        .context("the resource vanished")?
        .prepared
        .progress();
    tokio::time::timeout(WAIT, progress.wait_for(|p| p.ready == 8))
        .await
        .context("answers never prepared")??;
    let ids: Vec<String> = node
        .sim
        .resource(RESOURCE)
        .context("the resource vanished")?
        .devices
        .iter()
        .map(|d| d.id.clone())
        .collect();
    let client = node.client(RESOURCE).await?;
    let (healthy_allocate, healthy_preferred) =
        quick_calls(s, &client, &ids, Duration::ZERO).await?;

    gpus.inject("hang")?;
    let over = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stuck = {
        let (mut client, pair) = (client.clone(), ids[..2].to_vec());
        let over = over.clone();
        tokio::spawn(async move {
            let mut longest = Duration::ZERO;
            let mut failed = 0usize;
            while !over.load(std::sync::atomic::Ordering::SeqCst) {
                let started = Instant::now();
                let answer = client
                    .allocate(AllocateRequest {
                        container_requests: vec![ContainerAllocateRequest {
                            devices_ids: pair.clone(),
                        }],
                    })
                    .await;
                longest = longest.max(started.elapsed());
                if answer.is_err() {
                    failed += 1;
                }
            }
            (failed, longest)
        })
    };
    // The first two-GPU Allocate is inside NVML now.
    tokio::time::sleep(Duration::from_millis(100)).await;
    // For longer than a deadline, so stuck Allocates end at theirs meanwhile.
    let (hung_allocate, hung_preferred) =
        quick_calls(s, &client, &ids, DEADLINE * 2 + DEADLINE / 2).await?;
    over.store(true, std::sync::atomic::Ordering::SeqCst);
    gpus.inject("unhang")?;
    let (stuck_failed, stuck_longest) = stuck.await?;

    let label = |what: &str, hung: bool, n: usize| {
        format!(
            "9. {what}, NVML {} ({n} calls alternating on one connection, 2 s call deadline{})",
            if hung { "hung" } else { "healthy" },
            if hung {
                format!(
                    "; meanwhile {stuck_failed} two-GPU Allocates stuck in NVML on the same \
                     connection failed, the longest after {}",
                    duration(stuck_longest)
                )
            } else {
                String::new()
            }
        )
    };
    let summary = |samples: &Samples| {
        format!(
            "{}, max {}",
            samples.summary(false),
            duration(samples.max())
        )
    };
    let judged = |what: &str, samples: &Samples| {
        Row::judged(
            label(what, true, samples.count()),
            summary(samples),
            format!(
                "p99 ≤ {}, none past the {} deadline",
                duration(HUNG_TARGET),
                duration(DEADLINE)
            ),
            samples.p99() <= HUNG_TARGET
                && samples.max() < DEADLINE
                && stuck_longest < DEADLINE + Duration::from_millis(100),
        )
    };
    Ok(vec![
        Row::info(
            label(
                "Allocate of one GPU (prepared answer)",
                false,
                healthy_allocate.count(),
            ),
            summary(&healthy_allocate),
        ),
        judged("Allocate of one GPU (prepared answer)", &hung_allocate),
        Row::info(
            label(
                "GetPreferredAllocation, size 2",
                false,
                healthy_preferred.count(),
            ),
            summary(&healthy_preferred),
        ),
        judged("GetPreferredAllocation, size 2", &hung_preferred),
    ])
}

/// One-GPU Allocates (each GPU in turn) alternating with GetPreferredAllocation of 2: the
/// settings' number of calls, and for `at_least` in all.
async fn quick_calls(
    s: &Settings,
    client: &devicelet::kubelet::api::deviceplugin::device_plugin_client::DevicePluginClient<
        tonic::transport::Channel,
    >,
    ids: &[String],
    at_least: Duration,
) -> anyhow::Result<(Samples, Samples)> {
    let mut client = client.clone();
    let (mut allocates, mut preferreds) = (Vec::new(), Vec::new());
    let warmup = s.n(100);
    let began = Instant::now();
    let mut i = 0;
    while i < warmup + s.n(HUNG_CALLS) || began.elapsed() < at_least {
        let started = Instant::now();
        client
            .allocate(AllocateRequest {
                container_requests: vec![ContainerAllocateRequest {
                    devices_ids: vec![ids[i % ids.len()].clone()],
                }],
            })
            .await?;
        let allocate = started.elapsed();
        let started = Instant::now();
        client
            .get_preferred_allocation(PreferredAllocationRequest {
                container_requests: vec![ContainerPreferredAllocationRequest {
                    available_device_i_ds: ids.to_vec(),
                    must_include_device_i_ds: Vec::new(),
                    allocation_size: 2,
                }],
            })
            .await?;
        let preferred = started.elapsed();
        if i >= warmup {
            allocates.push(allocate);
            preferreds.push(preferred);
        }
        i += 1;
    }
    Ok((Samples::new(allocates), Samples::new(preferreds)))
}
