//! Prometheus metrics: what operators graph and alert on.
//!
//! Two kinds of figures. Events (calls into modules, reconciliations, registry reloads) are
//! counted as they happen in [`Metrics`], which lives as long as the agent, so a module's
//! counters survive its upgrades. Everything else (devices, health, allocations, registrations,
//! what the sandbox caught) is read from the agent's [`Status`] at each scrape, so it can never
//! disagree with `devicelet status`.

pub mod http;

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::Registry;

use crate::agent::status::Status;
use crate::dra::events::{DraEvent, DraEvents};
use crate::ledger::ReconcileReport;
use crate::sandbox::{CallKind, CallObserver, Outcome};

/// Upper bounds of the call-latency buckets, in seconds: from a prepared answer's tens of
/// microseconds to the longest call deadlines.
const CALL_BUCKETS: [f64; 16] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0,
];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CallLabels {
    module: String,
    call: String,
    outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ModuleLabels {
    module: String,
}

/// What runs under a module's name: its own version (WIT 0.2; empty for 0.1) and its digest.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ModuleInfoLabels {
    module: String,
    version: String,
    digest: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResourceLabels {
    resource: String,
    module: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DriverLabels {
    driver: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ClaimLabels {
    driver: String,
    result: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DraDriverLabels {
    driver: String,
    resource: String,
    module: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    result: String,
}

fn call_histogram() -> Histogram {
    Histogram::new(CALL_BUCKETS)
}

/// The agent's event counters. Cheap to clone: clones share the counts.
#[derive(Clone)]
pub struct Metrics {
    calls: Family<CallLabels, Histogram, fn() -> Histogram>,
    reconciles: Family<ResultLabels, Counter>,
    reconciled: Family<ResultLabels, Counter>,
    reloads: Family<ResultLabels, Counter>,
    prepares: Family<ClaimLabels, Histogram, fn() -> Histogram>,
    unprepares: Family<ClaimLabels, Histogram, fn() -> Histogram>,
    slice_writes: Family<DriverLabels, Counter>,
    api_errors: Family<DriverLabels, Counter>,
    pulls: Family<PullLabels, Counter>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PendingLabels {
    module: String,
    running: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PullLabels {
    module: String,
    result: String,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            calls: Family::new_with_constructor(call_histogram),
            reconciles: Family::default(),
            reconciled: Family::default(),
            reloads: Family::default(),
            prepares: Family::new_with_constructor(call_histogram),
            unprepares: Family::new_with_constructor(call_histogram),
            slice_writes: Family::default(),
            api_errors: Family::default(),
            pulls: Family::default(),
        }
    }
}

impl Metrics {
    /// Counts `module`'s calls, by kind and outcome, with their latency.
    pub fn observer(&self, module: &str) -> CallObserver {
        let (calls, module) = (self.calls.clone(), module.to_owned());
        Arc::new(move |kind: CallKind, outcome: Outcome, took: Duration| {
            calls
                .get_or_create(&CallLabels {
                    module: module.clone(),
                    call: kind.to_string(),
                    outcome: outcome.as_str().into(),
                })
                .observe(took.as_secs_f64());
        })
    }

    /// One reconciliation with PodResources: done (with what it changed) or not (unreachable).
    pub fn reconciled(&self, report: Option<&ReconcileReport>) {
        let result = |r: &str| ResultLabels { result: r.into() };
        let Some(report) = report else {
            self.reconciles.get_or_create(&result("unreachable")).inc();
            return;
        };
        self.reconciles.get_or_create(&result("ok")).inc();
        for (change, n) in [
            ("attributed", report.attributed),
            ("freed", report.freed.len()),
            ("adopted", report.adopted.len()),
        ] {
            self.reconciled
                .get_or_create(&result(change))
                .inc_by(n as u64);
        }
    }

    /// Counts what DRA drivers report, by driver.
    pub fn dra_events(&self) -> DraEvents {
        let me = self.clone();
        DraEvents::new(move |driver: &str, event: DraEvent| {
            let claim = |ok: bool| ClaimLabels {
                driver: driver.to_owned(),
                result: if ok { "ok" } else { "error" }.into(),
            };
            let by_driver = DriverLabels {
                driver: driver.to_owned(),
            };
            match event {
                DraEvent::Prepared { ok, took } => me
                    .prepares
                    .get_or_create(&claim(ok))
                    .observe(took.as_secs_f64()),
                DraEvent::Unprepared { ok, took } => me
                    .unprepares
                    .get_or_create(&claim(ok))
                    .observe(took.as_secs_f64()),
                DraEvent::SliceWrites(n) => {
                    me.slice_writes.get_or_create(&by_driver).inc_by(n);
                }
                DraEvent::ApiError => {
                    me.api_errors.get_or_create(&by_driver).inc();
                }
            }
        })
    }

    /// One pull of a module from its OCI registry: `ok`, `failed` (tried again) or `refused`
    /// (what the digest pins cannot load).
    pub fn pulled(&self, module: &str, result: &str) {
        self.pulls
            .get_or_create(&PullLabels {
                module: module.into(),
                result: result.into(),
            })
            .inc();
    }

    /// A registry edit read: `applied`, or `refused` (the running set kept serving).
    pub fn reloaded(&self, applied: bool) {
        let result = if applied { "applied" } else { "refused" };
        self.reloads
            .get_or_create(&ResultLabels {
                result: result.into(),
            })
            .inc();
    }

    /// The Prometheus text exposition of every figure, `status` being the agent's now.
    pub fn render(&self, status: &Status, ready: bool) -> String {
        let mut registry = Registry::with_prefix("devicelet");
        self.register_events(&mut registry);
        register_status(&mut registry, status, ready);
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &registry).is_err() {
            // Writing to a String cannot fail; an encoder error would be a bug in a metric.
            let _ = writeln!(out, "# encoding failed");
        }
        out
    }

    fn register_events(&self, registry: &mut Registry) {
        registry.register(
            "module_call_duration_seconds",
            "Calls into modules by kind and outcome (ok, error, trap, deadline, violation, unavailable, cancelled), with the time the caller waited",
            self.calls.clone(),
        );
        registry.register(
            "reconciles",
            "Reconciliations of the ledger with the kubelet's PodResources, by result (ok, unreachable)",
            self.reconciles.clone(),
        );
        registry.register(
            "reconciled_entries",
            "Ledger entries changed by reconciliation: attributed to a pod, freed, adopted",
            self.reconciled.clone(),
        );
        registry.register(
            "registry_reloads",
            "Edits of the registry or module files read, by result (applied, refused)",
            self.reloads.clone(),
        );
        registry.register(
            "dra_prepare_duration_seconds",
            "Claims answered in the kubelet's NodePrepareResources calls, by DRA driver and result (ok, error), with the time each took",
            self.prepares.clone(),
        );
        registry.register(
            "dra_unprepare_duration_seconds",
            "Claims answered in the kubelet's NodeUnprepareResources calls, by DRA driver and result, with the time each took",
            self.unprepares.clone(),
        );
        registry.register(
            "dra_slice_writes",
            "ResourceSlices created, replaced or deleted, by DRA driver",
            self.slice_writes.clone(),
        );
        registry.register(
            "dra_api_errors",
            "Requests to the API server that failed (unreachable, refused, conflicts), by DRA driver: the publisher's (retried with backoff) and claims read for NodePrepareResources (that claim's entry fails)",
            self.api_errors.clone(),
        );
        registry.register(
            "module_pulls",
            "Pulls of modules from their OCI registry, by module and result (ok; failed, tried again with backoff; refused, what the digest pins cannot load)",
            self.pulls.clone(),
        );
    }
}

/// Registers a family of gauges, one per label set, for figures read at scrape time.
fn gauges<L>(registry: &mut Registry, name: &str, help: &str, values: Vec<(L, u64)>)
where
    L: Clone + std::hash::Hash + Eq + EncodeLabelSet + std::fmt::Debug + Send + Sync + 'static,
{
    let family = Family::<L, Gauge>::default();
    for (labels, v) in values {
        family.get_or_create(&labels).set(clamp(v));
    }
    registry.register(name, help, family);
}

/// Registers a family of counters, one per label set, for totals read at scrape time.
fn counters<L>(registry: &mut Registry, name: &str, help: &str, values: Vec<(L, u64)>)
where
    L: Clone + std::hash::Hash + Eq + EncodeLabelSet + std::fmt::Debug + Send + Sync + 'static,
{
    let family = Family::<L, Counter>::default();
    for (labels, v) in values {
        family.get_or_create(&labels).inc_by(v);
    }
    registry.register(name, help, family);
}

fn clamp(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

fn gauge(v: u64) -> Gauge {
    let g = Gauge::default();
    g.set(clamp(v));
    g
}

fn counter(v: u64) -> Counter {
    let c = Counter::default();
    c.inc_by(v);
    c
}

/// A figure read at scrape time: its name, its help, and how to read it off a resource's or a
/// module's status.
type Figure<'a, T> = (&'a str, &'a str, &'a dyn Fn(&T) -> u64);

fn register_status(registry: &mut Registry, status: &Status, ready: bool) {
    registry.register(
        "build",
        "The agent's version and the WIT package its modules implement",
        Info::new(vec![
            ("version", env!("CARGO_PKG_VERSION")),
            ("wit", crate::sandbox::bindings::imports::PLUGIN),
        ]),
    );
    registry.register(
        "ready",
        "1 when every loaded module serves and every resource is registered with the kubelet",
        gauge(u64::from(ready)),
    );
    registry.register(
        "module_load_errors",
        "Modules or resources of the registry that are not served",
        gauge(status.load_errors.len() as u64),
    );
    gauges(
        registry,
        "module_pending",
        "1 while a module waits for a pull from its OCI registry (running: 1 when an earlier version serves meanwhile)",
        status
            .pending
            .iter()
            .map(|p| {
                let labels = PendingLabels {
                    module: p.module.clone(),
                    running: u8::from(p.running).to_string(),
                };
                (labels, 1)
            })
            .collect(),
    );

    use crate::agent::status::{DeviceStatus, ModuleStatus, ResourceStatus};
    let by_resource = |f: &dyn Fn(&ResourceStatus) -> u64| {
        status
            .resources
            .iter()
            .map(|r| {
                let labels = ResourceLabels {
                    resource: r.name.clone(),
                    module: r.module.clone(),
                };
                (labels, f(r))
            })
            .collect::<Vec<_>>()
    };
    let count = |r: &ResourceStatus, f: &dyn Fn(&DeviceStatus) -> bool| {
        r.devices.iter().filter(|d| f(d)).count() as u64
    };
    let resource_gauges: [Figure<ResourceStatus>; 4] = [
        (
            "resource_devices",
            "Devices advertised to the kubelet (replicas, for a shared resource)",
            &|r| r.devices.len() as u64,
        ),
        (
            "resource_devices_healthy",
            "Advertised devices that are Healthy: the resource's allocatable",
            &|r| count(r, &|d| d.healthy),
        ),
        (
            "resource_devices_allocated",
            "Advertised devices the ledger holds as allocated",
            &|r| count(r, &|d| d.allocated),
        ),
        (
            "resource_registered",
            "1 while the kubelet holds the resource's registration",
            &|r| u64::from(r.registered),
        ),
    ];
    for (name, help, f) in resource_gauges {
        gauges(registry, name, help, by_resource(f));
    }
    // A figure only some resources have: read off those alone.
    let by_resource_if = |keep: &dyn Fn(&ResourceStatus) -> bool,
                          f: &dyn Fn(&ResourceStatus) -> u64| {
        by_resource(f)
            .into_iter()
            .zip(&status.resources)
            .filter(|(_, r)| keep(r))
            .map(|(v, _)| v)
            .collect::<Vec<_>>()
    };
    gauges(
        registry,
        "resource_replicas_in_use",
        "For a shared resource: physical devices with at least one replica allocated",
        by_resource_if(&|r| r.shared, &physical_in_use),
    );
    let resource_counters: [Figure<ResourceStatus>; 3] = [
        (
            "resource_registrations",
            "Registrations the kubelet accepted (one per kubelet start)",
            &|r| u64::from(r.registrations),
        ),
        (
            "resource_registration_failures",
            "Registrations the kubelet refused or reported failed",
            &|r| r.registration_failures,
        ),
        (
            "kubelet_restarts_seen",
            "Kubelet restarts the resource noticed (each made it serve and register again)",
            &|r| r.kubelet_restarts,
        ),
    ];
    for (name, help, f) in resource_counters {
        counters(registry, name, help, by_resource(f));
    }
    let with_cdi = |f: &dyn Fn(&crate::agent::status::CdiStatus) -> u64| {
        by_resource_if(&|r| r.cdi.is_some(), &|r| r.cdi.as_ref().map_or(0, f))
    };
    gauges(
        registry,
        "resource_cdi_naming",
        "For a resource with a CDI strategy: 1 while Allocate may name its devices by CDI, 0 while it lists them instead (the spec cannot be written, its directory is not trusted, another spec declares its kind; `devicelet status` says why)",
        with_cdi(&|c| u64::from(c.error.is_none())),
    );
    let cdi_counters: [Figure<crate::agent::status::CdiStatus>; 3] = [
        (
            "resource_cdi_named",
            "Containers whose devices Allocate named by CDI",
            &|c| c.named,
        ),
        (
            "resource_cdi_unnamed",
            "Containers of a CDI resource given the module's answer itself",
            &|c| c.unnamed,
        ),
        (
            "resource_cdi_foreign_specs",
            "Spec files of the resource's CDI kind the agent did not write (replaced, or refused)",
            &|c| c.foreign,
        ),
    ];
    for (name, help, f) in cdi_counters {
        counters(registry, name, help, with_cdi(f));
    }

    let by_module = |f: &dyn Fn(&ModuleStatus) -> u64| {
        status
            .modules
            .iter()
            .map(|m| {
                let labels = ModuleLabels {
                    module: m.name.clone(),
                };
                (labels, f(m))
            })
            .collect::<Vec<_>>()
    };
    let module_counters: [Figure<ModuleStatus>; 8] = [
        ("module_traps", "Calls that trapped", &|m| m.stats.traps),
        (
            "module_deadlines",
            "Calls that missed their deadline",
            &|m| m.stats.deadlines,
        ),
        (
            "module_violations",
            "Answers refused because they broke a rule",
            &|m| m.stats.violations,
        ),
        ("module_errors", "Errors the module reported itself", &|m| {
            m.stats.errors
        }),
        (
            "module_unavailable",
            "Calls refused while the module was down",
            &|m| m.stats.unavailable,
        ),
        (
            "module_restarts",
            "Instances made again after a trap or failed call in the same cell",
            &|m| m.stats.restarts,
        ),
        (
            "module_abandoned_cells",
            "Cells abandoned because a call was stuck in a host call",
            &|m| m.stats.abandoned_cells,
        ),
        (
            "module_log_lines_dropped",
            "Log lines dropped over the rate limit",
            &|m| m.stats.log_lines_dropped,
        ),
    ];
    gauges(
        registry,
        "module_info",
        "1 for each running module, labelled with its own version (WIT 0.2 modules) and the sha256 of its file",
        status
            .modules
            .iter()
            .map(|m| {
                let labels = ModuleInfoLabels {
                    module: m.name.clone(),
                    version: m.version.clone(),
                    digest: m.digest.clone(),
                };
                (labels, 1)
            })
            .collect(),
    );
    for (name, help, f) in module_counters {
        let help = format!("{help}, since the running version loaded");
        counters(registry, name, &help, by_module(f));
    }
    let module_gauges: [Figure<ModuleStatus>; 3] = [
        (
            "module_host_memory_bytes",
            "Agent memory the module's answers hold",
            &|m| m.host_memory,
        ),
        (
            "module_host_memory_limit_bytes",
            "The module's host-memory budget",
            &|m| m.host_memory_limit,
        ),
        (
            "module_failed",
            "1 once the module stopped running for good (too many stuck cells)",
            &|m| u64::from(m.failed.is_some()),
        ),
    ];
    for (name, help, f) in module_gauges {
        gauges(registry, name, help, by_module(f));
    }
    let with_nvml: Vec<_> = status
        .modules
        .iter()
        .filter_map(|m| {
            let ready = matches!(m.nvml.as_ref()?, crate::nvml::Availability::Ready { .. });
            let labels = ModuleLabels {
                module: m.name.clone(),
            };
            Some((labels, u64::from(ready)))
        })
        .collect();
    gauges(
        registry,
        "module_nvml_ready",
        "For a module granted NVML: 1 once NVML answers, 0 while the agent is still opening it (`devicelet status` says why)",
        with_nvml,
    );

    if let Some(cache) = &status.cache {
        registry.register(
            "compile_cache_usable",
            "1 when the compile cache directory is used; 0 when it was refused (modules are compiled in memory; `devicelet status` says why)",
            gauge(u64::from(cache.refused.is_none())),
        );
        counters(
            registry,
            "compile_cache_loads",
            "Module loads by how the compile cache served them: hit (precompiled), miss (compiled and cached), replaced (a bad cached copy compiled again)",
            vec![
                (
                    ResultLabels {
                        result: "hit".into(),
                    },
                    cache.hits,
                ),
                (
                    ResultLabels {
                        result: "miss".into(),
                    },
                    cache.misses,
                ),
                (
                    ResultLabels {
                        result: "replaced".into(),
                    },
                    cache.replaced,
                ),
            ],
        );
        registry.register(
            "compile_cache_waits",
            "Module loads that found another process (a validate, a precompile, another agent) compiling the same module into the cache, and waited for it",
            counter(cache.waited),
        );
    }
    let drivers: [Figure<crate::agent::status::DraDriverStatus>; 6] = [
        (
            "dra_driver_registered",
            "1 while the kubelet holds the DRA driver's registration",
            &|d| u64::from(d.registered),
        ),
        ("dra_devices", "The DRA driver's devices", &|d| {
            d.devices as u64
        }),
        (
            "dra_devices_published",
            "Devices in the DRA driver's ResourceSlices: healthy, and held by no device-plugin container",
            &|d| d.published as u64,
        ),
        (
            "dra_pool_generation",
            "The generation of the DRA driver's pool last published",
            &|d| u64::try_from(d.generation).unwrap_or(0),
        ),
        (
            "dra_slices",
            "ResourceSlices the DRA driver's pool has",
            &|d| d.slices as u64,
        ),
        (
            "dra_claims_prepared",
            "Claims prepared and not yet unprepared (in the driver's checkpoint)",
            &|d| d.prepared_claims as u64,
        ),
    ];
    for (name, help, f) in drivers {
        let values = status
            .dra_drivers
            .iter()
            .map(|d| {
                let labels = DraDriverLabels {
                    driver: d.driver.clone(),
                    resource: d.resource.clone(),
                    module: d.module.clone(),
                };
                (labels, f(d))
            })
            .collect();
        gauges(registry, name, help, values);
    }
    registry.register(
        "ledger_entries",
        "Allocations the ledger holds",
        gauge(status.ledger.entries),
    );
    registry.register(
        "ledger_dropped",
        "Ledger entries dropped at its cap",
        counter(status.ledger.dropped),
    );
    registry.register(
        "ledger_written",
        "1 when every ledger change is in the checkpoint file",
        gauge(u64::from(status.ledger.written)),
    );
}

/// Physical devices (`<id>` of replica `<id>::<n>`) with a replica allocated.
fn physical_in_use(r: &crate::agent::status::ResourceStatus) -> u64 {
    let held: std::collections::BTreeSet<&str> = r
        .devices
        .iter()
        .filter(|d| d.allocated)
        .map(|d| d.id.split_once("::").map_or(d.id.as_str(), |(id, _)| id))
        .collect();
    held.len() as u64
}
