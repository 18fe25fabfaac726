//! What the agent's HTTP endpoint answers: its metrics and the kubelet's liveness and readiness
//! probes.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::Shared;
use crate::metrics::http::Endpoints;

pub(super) struct AgentEndpoints(pub Arc<Shared>);

impl Endpoints for AgentEndpoints {
    fn metrics(&self) -> String {
        metrics(&self.0)
    }

    fn live(&self) -> Result<(), String> {
        live(&self.0)
    }

    fn ready(&self) -> Result<(), String> {
        ready(&self.0)
    }
}

pub(super) fn metrics(shared: &Shared) -> String {
    let status = super::status::collect(shared);
    shared.metrics.render(&status, ready(shared).is_ok())
}

/// Alive while every loop of the agent and every task serving a resource still runs (that this
/// answers at all shows its async workers are not wedged). A module that misbehaves does not
/// make the agent unlive: that is its own resource's business, shown in readiness and metrics.
fn live(shared: &Shared) -> Result<(), String> {
    if shared.stopping.load(Ordering::Relaxed) {
        return Ok(());
    }
    let mut dead: Vec<String> = shared
        .loops
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .filter(|(_, task)| task.is_finished())
        .map(|(name, _)| format!("the agent's {name} loop ended"))
        .collect();
    for module in shared.lock_modules().values() {
        for front_end in &module.front_ends {
            dead.extend(front_end.ended(&module.spec.name));
        }
    }
    if dead.is_empty() {
        Ok(())
    } else {
        Err(dead.join("\n"))
    }
}

/// Ready once every loaded module runs and each of its resources is registered with the
/// kubelet, and no module waits for its first pull from a registry. Modules that failed to load
/// are not counted: they are reported in the load errors and metrics, and must not hold up a
/// rollout of the node's other device types.
pub(super) fn ready(shared: &Shared) -> Result<(), String> {
    if shared.starting.load(Ordering::Relaxed) > 0 {
        return Err("modules are still loading".into());
    }
    // Modules waiting for their first pull; one whose earlier version serves is not missing.
    let mut missing: Vec<String> = shared
        .pending_status()
        .into_iter()
        .filter(|p| !p.running)
        .map(|p| {
            let why = p
                .last_error
                .as_deref()
                .unwrap_or("the first try is under way");
            format!("module `{}` waits for its pull: {why}", p.module)
        })
        .collect();
    for module in shared.lock_modules().values() {
        if let Some(why) = module.handle().failure() {
            missing.push(format!(
                "module `{}` stopped running: {why}",
                module.spec.name
            ));
        }
        if let Some(crate::nvml::Availability::Unavailable(why)) =
            module.handle().nvml().map(|n| n.availability())
        {
            missing.push(format!(
                "module `{}` is waiting for NVML: {why}",
                module.spec.name
            ));
        }
        for front_end in &module.front_ends {
            missing.extend(front_end.not_ready(&module.spec.name));
        }
    }
    if missing.is_empty() {
        Ok(())
    } else {
        Err(missing.join("\n"))
    }
}
