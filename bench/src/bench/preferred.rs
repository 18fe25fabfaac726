//! Benchmark 2: GetPreferredAllocation on a 64-device resource spread over two NUMA nodes, with all
//! 64 available and 4 wanted, through the kubelet's client.

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

const DEVICES: usize = 64;
const NUMA: usize = 2;
const SIZE: i32 = 4;

pub async fn run(s: &Settings) -> anyhow::Result<Vec<Row>> {
    let node = Node::start(SimConfig::default()).await?;
    let registry = node.registry(&misbehaving(
        &s.module_dir,
        "numa",
        &format!("resource = \"numa\"\ndevices = {DEVICES}\nnuma = {NUMA}\npreferred = \"ok\""),
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
        state.devices.len() == DEVICES && nodes.len() == NUMA,
        "expected {DEVICES} devices on {NUMA} NUMA nodes, the kubelet sees {} on {nodes:?}",
        state.devices.len()
    );
    let request = PreferredAllocationRequest {
        container_requests: vec![ContainerPreferredAllocationRequest {
            available_device_i_ds: state.devices.iter().map(|d| d.id.clone()).collect(),
            must_include_device_i_ds: Vec::new(),
            allocation_size: SIZE,
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
                && answer.container_responses[0].device_i_ds.len() == SIZE as usize,
            "unexpected answer {answer:?}"
        );
        if i >= s.n(500) {
            samples.push(took);
        }
    }
    let samples = Samples::new(samples);
    drop(client);
    agent.shutdown().await;
    Ok(vec![Row::judged(
        format!(
            "2. GetPreferredAllocation, misbehaving module, {DEVICES} devices on {NUMA} NUMA \
             nodes, all available, size {SIZE} ({} calls)",
            samples.len()
        ),
        samples.summary(false),
        "p99 ≤ 1 ms",
        samples.p99() <= Duration::from_millis(1),
    )])
}
