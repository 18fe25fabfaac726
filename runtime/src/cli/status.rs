//! `devicelet status`: what a running agent serves, and who holds what.

use std::path::PathBuf;

use crate::agent::status::{self, Status};
use crate::ledger::Holder;

#[derive(clap::Args, Debug)]
pub struct StatusArgs {
    /// The running agent's state directory.
    #[arg(long, default_value = "/var/lib/devicelet")]
    pub state_dir: PathBuf,
    /// Print the raw JSON document.
    #[arg(long)]
    pub json: bool,
}

pub async fn run(args: StatusArgs) -> anyhow::Result<()> {
    let status = status::read(&args.state_dir).await?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&status)?);
    } else {
        print!("{}", render(&status));
    }
    Ok(())
}

fn render(status: &Status) -> String {
    let mut out = String::new();
    for m in &status.modules {
        let s = m.stats;
        out += &format!(
            "module {}{} (sha256 {}…): {} traps, {} missed deadlines, {} refused answers, {} errors, \
             {} cells abandoned, {} log lines dropped; {} allocate calls; host memory {} of {} \
             bytes\n",
            m.name,
            if m.version.is_empty() {
                String::new()
            } else {
                format!(" {}", m.version)
            },
            m.digest.get(..12).unwrap_or(&m.digest),
            s.traps,
            s.deadlines,
            s.violations,
            s.errors,
            s.abandoned_cells,
            s.log_lines_dropped,
            s.allocate_calls,
            m.host_memory,
            m.host_memory_limit
        );
        match &m.nvml {
            Some(crate::nvml::Availability::Ready { driver, gpus }) => {
                out += &format!("  NVML ready: driver {driver}, {gpus} GPU(s)\n");
            }
            Some(crate::nvml::Availability::Unavailable(why)) => {
                out += &format!("  waiting for NVML (tried again until it answers): {why}\n");
            }
            None => {}
        }
        if let Some(failed) = &m.failed {
            out += &format!("  FAILED: {failed}\n");
        }
    }
    for d in &status.dra_drivers {
        out += &format!(
            "DRA driver {} for {} (module {}, {} devices, {} healthy, {} published, {}registered \
             with the kubelet; pool generation {} in {} slice(s), {} claim(s) prepared{})\n",
            d.driver,
            d.resource,
            d.module,
            d.devices,
            d.healthy,
            d.published,
            if d.registered { "" } else { "not " },
            d.generation,
            d.slices,
            d.prepared_claims,
            d.api_error
                .as_deref()
                .map(|e| format!("; API error: {e}"))
                .unwrap_or_default()
        );
        for device in &d.device_states {
            let health = if device.healthy {
                "Healthy"
            } else {
                "Unhealthy"
            };
            let held = if device.holders.is_empty() {
                "free".to_owned()
            } else {
                device.holders.join(", ")
            };
            out += &format!(
                "  {:<24} {:<9} {held} (module IDs {})\n",
                device.name,
                health,
                device.ids.join(" ")
            );
            if let Some(reason) = device.reason.as_ref().filter(|_| !device.healthy) {
                out += &format!("    unhealthy: {reason}\n");
            }
        }
        if d.taints_dropped {
            out += "  the API server drops device taints (DRADeviceTaints off): unhealthy devices \
                    are withdrawn from the pool instead of tainted\n";
        }
        if d.counters_dropped {
            out += "  the API server drops counters (DRAPartitionableDevices off): partitions are \
                    withdrawn from the pool\n";
        }
        if d.shared_dropped {
            out += "  the API server drops allowMultipleAllocations (DRAConsumableCapacity off): \
                    devices shared by capacity are published whole, one claim each\n";
        }
        if d.retiring {
            out += "  RETIRING: left the registry; answers only for the claims it prepared, until \
                    they are unprepared\n";
        }
    }
    for r in &status.resources {
        let healthy = r.devices.iter().filter(|d| d.healthy).count();
        let prepared = r.devices.iter().filter(|d| d.prepared).count();
        out += &format!(
            "{} (module {}, socket {}, {} devices, {healthy} healthy, {prepared} with an Allocate \
             answer ready, registered {} time(s){})\n",
            r.name,
            r.module,
            r.socket.file_name().unwrap_or_default().to_string_lossy(),
            r.devices.len(),
            r.registrations,
            if r.registered {
                ""
            } else {
                ", not registered now"
            }
        );
        for d in &r.devices {
            let health = if d.healthy { "Healthy" } else { "Unhealthy" };
            let holder = match (&d.holder, d.allocated) {
                (
                    Some(Holder::Container {
                        namespace,
                        pod,
                        container,
                    }),
                    _,
                ) => format!("{namespace}/{pod} container {container}"),
                (Some(claim), _) => claim.to_string(),
                (None, true) => "allocated, pod not yet known".into(),
                (None, false) => "free".into(),
            };
            out += &format!("  {:<24} {:<9} {holder}\n", d.id, health);
            if let Some(reason) = d.reason.as_ref().filter(|_| !d.healthy) {
                out += &format!("    unhealthy: {reason}\n");
            }
            if !d.attributes.is_empty() {
                out += &format!("    {}\n", d.attributes.join(", "));
            }
        }
        if r.shared {
            out += &replicas_in_use(&r.devices);
        }
        if let Some(c) = &r.cdi {
            out += &format!(
                "  CDI ({}): {} with {} devices; {} containers named by CDI, {} given the module's answer itself\n",
                c.strategy,
                c.spec.display(),
                c.devices,
                c.named,
                c.unnamed
            );
            if let Some(e) = &c.error {
                out += &format!("  CDI names not given: {e}\n");
            }
            if c.foreign > 0 {
                out += &format!(
                    "  CDI: {} spec file(s) of its kind found that the agent did not write\n",
                    c.foreign
                );
            }
        }
    }
    let l = &status.ledger;
    out += &format!(
        "ledger: {} entries{}{}\n",
        l.entries,
        if l.written {
            ""
        } else {
            ", not yet all written"
        },
        if l.dropped > 0 {
            format!(
                ", {} dropped at the cap (is PodResources reachable?)",
                l.dropped
            )
        } else {
            String::new()
        }
    );
    if let Some(c) = &status.cache {
        out += &match &c.refused {
            Some(why) => format!("compile cache NOT USED (modules compiled in memory): {why}\n"),
            None => format!(
                "compile cache: {} modules loaded precompiled, {} compiled, {} cached copies \
                 replaced{}\n",
                c.hits,
                c.misses,
                c.replaced,
                match c.waited {
                    0 => String::new(),
                    n => format!(
                        "; {n} load(s) waited for another process compiling the same module"
                    ),
                }
            ),
        };
    }
    for p in &status.pending {
        out += &format!(
            "PENDING module `{}`: pulling {} for {}s{}{}\n",
            p.module,
            p.source,
            p.waiting_ms / 1000,
            if p.running {
                " (its earlier version keeps serving)"
            } else {
                ""
            },
            match (&p.last_error, p.next_attempt_in_ms) {
                (Some(e), Some(next)) => format!(
                    "; try {} failed: {e}; next in {}s",
                    p.attempts,
                    next.div_ceil(1000)
                ),
                _ => String::new(),
            }
        );
    }
    for e in &status.load_errors {
        out += &format!("not served: {e}\n");
    }
    if let Some(e) = &status.reload_error {
        out += &format!("last registry edit refused: {e}\n");
    }
    out
}

/// One line per physical device of a shared resource: how many of its replicas are held.
fn replicas_in_use(devices: &[status::DeviceStatus]) -> String {
    let mut per_device: std::collections::BTreeMap<&str, (usize, usize)> = Default::default();
    for d in devices {
        let counts = per_device
            .entry(crate::policy::sharing::physical_id(&d.id))
            .or_default();
        counts.1 += 1;
        counts.0 += usize::from(d.allocated);
    }
    per_device
        .into_iter()
        .map(|(id, (used, all))| format!("  {id}: {used} of {all} replicas in use\n"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::status::{DeviceStatus, LedgerStatus, ResourceStatus};

    #[test]
    fn a_shared_resource_shows_the_replicas_in_use_per_device() {
        let device = |id: &str, allocated: bool| DeviceStatus {
            id: id.into(),
            healthy: true,
            allocated,
            holder: None,
            prepared: true,
            reason: None,
            attributes: Vec::new(),
        };
        let status = Status {
            modules: Vec::new(),
            resources: vec![ResourceStatus {
                name: "ex.com/gpu.shared".into(),
                module: "gpus".into(),
                socket: "devicelet-x.sock".into(),
                registrations: 1,
                registered: true,
                kubelet_restarts: 0,
                registration_failures: 0,
                devices: vec![
                    device("gpu-0::0", true),
                    device("gpu-0::1", true),
                    device("gpu-1::0", false),
                    device("gpu-1::1", false),
                ],
                shared: true,
                cdi: Some(crate::agent::status::CdiStatus {
                    strategy: "cdi-cri".into(),
                    spec: "/var/run/cdi/devicelet_ex.com_gpu.shared.json".into(),
                    devices: 2,
                    named: 5,
                    unnamed: 1,
                    error: Some("cannot write it: read-only file system".into()),
                    foreign: 1,
                }),
            }],
            load_errors: Vec::new(),
            reload_error: None,
            ledger: LedgerStatus::default(),
            cache: Some(crate::agent::status::CacheStatus {
                refused: Some("compile cache /x: /x has mode 0777".into()),
                ..Default::default()
            }),
            dra_drivers: Vec::new(),
            pending: vec![crate::agent::PendingStatus {
                module: "gpus".into(),
                source: format!("oci://r.io/v/gpu@sha256:{}", "a".repeat(64)),
                running: true,
                waiting_ms: 12_500,
                attempts: 3,
                last_error: Some("fetching the manifest: connection refused".into()),
                next_attempt_in_ms: Some(7_001),
            }],
        };
        let text = render(&status);
        assert!(
            text.contains(&format!(
                "PENDING module `gpus`: pulling oci://r.io/v/gpu@sha256:{} for 12s (its earlier \
                 version keeps serving); try 3 failed: fetching the manifest: connection refused; \
                 next in 8s\n",
                "a".repeat(64)
            )),
            "{text}"
        );
        assert!(text.contains("  gpu-0: 2 of 2 replicas in use\n"), "{text}");
        assert!(text.contains("  gpu-1: 0 of 2 replicas in use\n"), "{text}");
        assert!(text.contains("4 with an Allocate answer ready"), "{text}");
        assert!(
            text.contains("compile cache NOT USED (modules compiled in memory): compile cache /x"),
            "{text}"
        );
        assert!(
            text.contains(
                "  CDI (cdi-cri): /var/run/cdi/devicelet_ex.com_gpu.shared.json with 2 devices; 5 \
                 containers named by CDI, 1 given the module's answer itself\n  CDI names not \
                 given: cannot write it: read-only file system\n  CDI: 1 spec file(s) of its \
                 kind found that the agent did not write\n"
            ),
            "{text}"
        );

        // Loads that waited for another process's compile, in the status and the metrics.
        let mut waited = status;
        waited.cache = Some(crate::agent::status::CacheStatus {
            hits: 1,
            misses: 1,
            waited: 2,
            ..Default::default()
        });
        let text = render(&waited);
        assert!(
            text.contains(
                "compile cache: 1 modules loaded precompiled, 1 compiled, 0 cached copies \
                 replaced; 2 load(s) waited for another process compiling the same module\n"
            ),
            "{text}"
        );
        let metrics = crate::metrics::Metrics::default().render(&waited, true);
        assert!(
            metrics.contains("\ndevicelet_compile_cache_waits_total 2\n"),
            "{metrics}"
        );
    }
}
