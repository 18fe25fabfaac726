//! The device-plugin front end (`kubelet/`) as the agent holds it: one served resource per
//! planned resource, each with its socket and registration, upgraded in place resource by
//! resource.

use std::any::Any;
use std::sync::Arc;

use tokio::sync::Notify;

use super::{BoxFuture, Context, FrontEnd, FrontEndKind, Stop};
use crate::config::ModuleSpec;
use crate::kubelet::resource::{self, Owner, RunningResource};
use crate::policy::sharing::Replicated;
use crate::resource::backend::Upkeep;
use crate::sandbox::LoadError;
use crate::sandbox::slot::ModuleSlot;

/// Serves modules through the kubelet's device-plugin API.
pub struct DevicePlugin;

impl FrontEndKind for DevicePlugin {
    fn start<'a>(&'a self, cx: &'a Context<'a>) -> BoxFuture<'a, (Box<dyn FrontEnd>, Vec<String>)> {
        Box::pin(async move {
            let mut errors = Vec::new();
            let resources = serve(cx, cx.planned, &mut errors);
            (Box::new(Served { resources }) as Box<dyn FrontEnd>, errors)
        })
    }

    fn describe(
        &self,
        spec: &ModuleSpec,
        planned: &[(String, crate::device::ResourceInfo)],
    ) -> Vec<Result<String, String>> {
        planned
            .iter()
            .map(|(name, info)| {
                let rule = spec.sharing.rule(&info.name);
                let who = resource::who_answers(spec.allocation_policy, info, rule.shares());
                Ok(format!(
                    "resource {name} (prestart: {}, preferred allocation: {}, Allocate answers \
                     prepared ahead: {}, sharing: {})",
                    info.prestart,
                    describe_preferred(who),
                    if spec.allocate_ahead { "yes" } else { "no" },
                    describe_sharing(rule)
                ))
            })
            .collect()
    }

    fn answers_ahead(&self) -> bool {
        true
    }

    fn needs_api_server(&self) -> bool {
        false
    }
}

/// A module's resources served through the device-plugin API.
pub struct Served {
    pub resources: Vec<RunningResource>,
}

impl FrontEnd for Served {
    fn as_any(&self) -> &dyn Any {
        self
    }

    fn resources(&self) -> Vec<String> {
        self.resources
            .iter()
            .map(|r| r.served.name.clone())
            .collect()
    }

    fn names(&self) -> Vec<String> {
        self.resources()
    }

    fn pokes(&self) -> Vec<Arc<Notify>> {
        self.resources.iter().map(|r| r.poke.clone()).collect()
    }

    fn ended(&self, module: &str) -> Vec<String> {
        self.resources
            .iter()
            .filter(|r| r.task_ended())
            .map(|r| format!("a task serving {} (module `{module}`) ended", r.served.name))
            .collect()
    }

    fn not_ready(&self, module: &str) -> Vec<String> {
        self.resources
            .iter()
            .filter(|r| !r.served.registration.registered())
            .map(|r| {
                format!(
                    "{} (module `{module}`) is not registered with the kubelet",
                    r.served.name
                )
            })
            .collect()
    }

    fn status(
        &self,
        _: &str,
        ledger: &crate::ledger::Ledger,
        out: &mut crate::agent::status::Status,
    ) {
        for r in &self.resources {
            out.resources.push(crate::agent::status::resource_status(
                r.served.clone(),
                ledger,
            ));
        }
    }

    fn keeps(&self, _: &ModuleSpec, cx: &Context<'_>) -> bool {
        matches!(cx.spec.front_end, crate::config::FrontEnd::DevicePlugin)
    }

    /// A resource the new version still declares (same name, same health interval,
    /// `allocate-ahead`, `allocation-policy` and device-list strategy, and the same sharing rule)
    /// keeps its socket, registration and ListAndWatch stream; the others stop.
    fn stop_gone<'a>(&'a mut self, old: &'a ModuleSpec, cx: &'a Context<'a>) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            let spec = cx.spec;
            // The watcher's interval and the preparer are set when a resource starts serving.
            let same_interval = old.health_interval == spec.health_interval
                && old.allocate_ahead == spec.allocate_ahead
                && old.allocation_policy == spec.allocation_policy
                && old.device_list_strategy == spec.device_list_strategy;
            let (kept, gone): (Vec<_>, Vec<_>) = std::mem::take(&mut self.resources)
                .into_iter()
                .partition(|r| {
                    same_interval
                        && old.sharing.rule(r.local()) == spec.sharing.rule(r.local())
                        && cx
                            .planned
                            .iter()
                            .any(|(name, info)| *name == r.served.name && r.same_declaration(info))
                });
            self.resources = kept;
            stop_all(gone, cx.slot, true).await;
        })
    }

    /// Kept resources are re-enumerated at once through the new version (one whose options
    /// changed registers again on the same socket); new ones are served.
    fn resume<'a>(&'a mut self, cx: &'a Context<'a>) -> BoxFuture<'a, Vec<String>> {
        Box::pin(async move {
            for r in &self.resources {
                if let Some((_, info)) = cx.planned.iter().find(|(name, _)| *name == r.served.name)
                {
                    r.set_options(info);
                }
                r.poke.notify_one();
            }
            let fresh: Vec<_> = cx
                .planned
                .iter()
                .filter(|(name, _)| !self.resources.iter().any(|r| r.served.name == *name))
                .cloned()
                .collect();
            let mut errors = Vec::new();
            let started = serve(cx, &fresh, &mut errors);
            self.resources.extend(started);
            errors
        })
    }

    fn stop<'a>(self: Box<Self>, how: Stop<'a>, slot: &'a ModuleSlot) -> BoxFuture<'a, ()> {
        // Leaving for good or for another version: the CDI specs go too.
        let retire = !matches!(how, Stop::Shutdown);
        Box::pin(stop_all(self.resources, slot, retire))
    }
}

async fn stop_all(resources: Vec<RunningResource>, slot: &ModuleSlot, retire: bool) {
    for r in &resources {
        if retire {
            r.retire();
        }
        r.signal_stop();
    }
    for r in resources {
        r.stop(slot).await;
    }
}

fn serve(
    cx: &Context<'_>,
    planned: &[(String, crate::device::ResourceInfo)],
    errors: &mut Vec<String>,
) -> Vec<RunningResource> {
    let spec = cx.spec;
    let mut resources = Vec::new();
    for (_, info) in planned {
        let owner = Owner {
            module: &spec.name,
            resource_domain: &spec.resource_domain,
            health_interval: spec.health_interval,
            allocate_ahead: spec.allocate_ahead,
            allocation_policy: spec.allocation_policy,
            share: spec.sharing.rule(&info.name),
            device_list_strategy: spec.device_list_strategy,
            host_root: cx.host_root,
        };
        let backend = Replicated::new(cx.slot.clone(), spec.sharing.clone());
        let upkeep: Arc<dyn Upkeep> = Arc::new(cx.slot.clone());
        match resource::serve(&backend, &upkeep, &owner, info, cx.at) {
            Ok(r) => resources.push(r),
            Err(message) => errors.push(
                LoadError::Invalid {
                    module: spec.name.clone(),
                    message,
                }
                .to_string(),
            ),
        }
    }
    resources
}

fn describe_preferred(who: crate::policy::Preferred) -> &'static str {
    use crate::policy::{Preferred, preferred::Spread};
    match who {
        Preferred::Module => "the module's",
        Preferred::Host(Spread::Packed) => "the host's, packed",
        Preferred::Host(Spread::Distributed) => "the host's, distributed",
        Preferred::Off => "off",
    }
}

fn describe_sharing(rule: &crate::config::ShareRule) -> String {
    if !rule.shares() {
        return "none".into();
    }
    let mut text = format!("{} replicas per device", rule.replicas);
    for (id, n) in &rule.devices {
        text.push_str(&format!(", {id}: {n}"));
    }
    if rule.rename {
        text.push_str(", served as .shared");
    }
    if rule.fail_requests_greater_than_one {
        text.push_str(", one device per container");
    }
    text
}
