//! Benchmark 2: GetPreferredAllocation through the kubelet's client, answered by a module (64
//! devices on two NUMA nodes, 4 wanted) and by the host's policy (256 devices on eight nodes, 8
//! wanted), and the host's choice alone.

use std::time::{Duration, Instant};

use anyhow::Context;

use super::Settings;
use super::node::{Node, misbehaving, resource};
use super::report::Row;
use super::stats::Samples;
use devicelet::kubelet::api::deviceplugin::{
    ContainerPreferredAllocationRequest, PreferredAllocationRequest,
};
use devicelet_simulator::SimConfig;

/// A resource as a row measures it: its devices and NUMA nodes, the size asked, and whether the
/// module answers (`preferred = "ok"`) or the host's policy does.
struct Case {
    devices: usize,
    numa: usize,
    size: i32,
    module_answers: bool,
}

pub async fn run(s: &Settings) -> anyhow::Result<Vec<Row>> {
    let mut rows = Vec::new();
    for case in [
        Case {
            devices: 64,
            numa: 2,
            size: 4,
            module_answers: true,
        },
        Case {
            devices: 256,
            numa: 8,
            size: 8,
            module_answers: false,
        },
    ] {
        let samples = through_grpc(s, &case).await?;
        let who = if case.module_answers {
            "misbehaving module"
        } else {
            "the host's packed policy (module without preferred)"
        };
        rows.push(Row::judged(
            format!(
                "2. GetPreferredAllocation, {who}, {} devices on {} NUMA nodes, all available, \
                 size {} ({} calls)",
                case.devices,
                case.numa,
                case.size,
                samples.count()
            ),
            samples.summary(false),
            "p99 ≤ 1 ms",
            samples.p99() <= Duration::from_millis(1),
        ));
    }
    rows.push(policy_alone(s));
    Ok(rows)
}

/// The host's choice alone, no gRPC: 64 physical devices on 8 NUMA nodes, 4 replicas each (256
/// IDs), replica 0 of every device but those on node 7 held, a must-include replica, 8 wanted.
fn policy_alone(s: &Settings) -> Row {
    use devicelet::device::{Device, Health};
    use devicelet::policy::preferred::{Spread, Usage, choose};
    use devicelet::policy::sharing::physical_id;
    let mut devices: Vec<Device> = (0..64)
        .flat_map(|gpu: i64| {
            (0..4).map(move |r| Device {
                id: format!("gpu-{gpu:02}::{r}"),
                health: Health::Healthy,
                numa_nodes: vec![gpu % 8],
                attributes: Vec::new(),
                ..devicelet::device::Device::new("", devicelet::device::Health::Healthy)
            })
        })
        .collect();
    devices.sort_by(|a, b| a.id.cmp(&b.id));
    let held = |d: &Device| d.numa_nodes[0] != 7 && d.id.ends_with("::0");
    let available: Vec<String> = devices
        .iter()
        .filter(|d| !held(d))
        .map(|d| d.id.clone())
        .collect();
    let usage = Usage {
        physical: Some(physical_id),
        in_use: devices
            .iter()
            .filter(|d| held(d))
            .map(|d| (physical_id(&d.id), 1))
            .collect(),
        one_per_device: false,
    };
    let must = vec![available[3].clone()];
    let calls = s.n(10_000);
    let mut samples = Vec::with_capacity(calls);
    for spread in [Spread::Packed, Spread::Distributed] {
        for _ in 0..calls / 2 {
            let started = Instant::now();
            let chosen = choose(&devices, &available, &must, 8, spread, &usage);
            samples.push(started.elapsed());
            std::hint::black_box(chosen);
        }
    }
    let samples = Samples::new(samples);
    Row::judged(
        format!(
            "2. Host preferred allocation alone (`policy::preferred::choose`, no gRPC): 64 \
             devices × 4 replicas on 8 NUMA nodes, a quarter held, one must-include, size 8, \
             packed and distributed ({} calls)",
            samples.count()
        ),
        samples.summary(false),
        "p99 ≤ 1 ms (issue 10)",
        samples.p99() <= Duration::from_millis(1),
    )
}

async fn through_grpc(s: &Settings, case: &Case) -> anyhow::Result<Samples> {
    let (devices, numa, size) = (case.devices, case.numa, case.size);
    let node = Node::start(SimConfig::default()).await?;
    let preferred = if case.module_answers {
        "\npreferred = \"ok\""
    } else {
        ""
    };
    let registry = node.registry(&misbehaving(
        &s.module_dir,
        "numa",
        &format!("resource = \"numa\"\ndevices = {devices}\nnuma = {numa}{preferred}"),
    ))?;
    let agent = node.start_agent(&registry, None).await?;
    let name = resource("numa");
    node.wait_served(&name).await?;
    let state = node.sim.resource(&name).context("the resource vanished")?;
    let nodes: std::collections::BTreeSet<i64> = state
        .devices
        .iter()
        .flat_map(|d| d.topology.iter().flat_map(|t| t.nodes.iter().map(|n| n.id)))
        .collect();
    anyhow::ensure!(
        state.devices.len() == devices && nodes.len() == numa,
        "expected {devices} devices on {numa} NUMA nodes, the kubelet sees {} on {nodes:?}",
        state.devices.len()
    );
    let request = PreferredAllocationRequest {
        container_requests: vec![ContainerPreferredAllocationRequest {
            available_device_i_ds: state.devices.iter().map(|d| d.id.clone()).collect(),
            must_include_device_i_ds: Vec::new(),
            allocation_size: size,
        }],
    };
    let mut client = node.client(&name).await?;
    let calls = s.n(10_000);
    let mut samples = Vec::with_capacity(calls);
    for i in 0..s.n(500) + calls {
        let request = request.clone();
        let started = Instant::now();
        let answer = client.get_preferred_allocation(request).await?.into_inner();
        let took = started.elapsed();
        anyhow::ensure!(
            answer.container_responses.len() == 1
                && answer.container_responses[0].device_i_ds.len() == size as usize,
            "unexpected answer {answer:?}"
        );
        if i >= s.n(500) {
            samples.push(took);
        }
    }
    drop(client);
    agent.shutdown().await;
    Ok(Samples::new(samples))
}
