//! The DRA front end (`dra/`) as the agent holds it: one driver per planned resource (the
//! registry's `dra-driver` for a module with one resource, else each resource's name turned
//! around), upgraded in place driver by driver.

use std::any::Any;
use std::collections::BTreeMap;
use std::sync::Arc;

use tokio::sync::Notify;

use super::{BoxFuture, Context, FrontEnd, FrontEndKind, Stop};
use crate::config::ModuleSpec;
use crate::device::ResourceInfo;
use crate::dra::HeldElsewhere;
use crate::dra::driver::{DriverSpec, RunningDriver};
use crate::policy::sharing::physical_id;
use crate::resource::backend::Upkeep;
use crate::sandbox::slot::ModuleSlot;

/// Serves modules as DRA drivers.
pub struct Dra;

impl FrontEndKind for Dra {
    fn start<'a>(&'a self, cx: &'a Context<'a>) -> BoxFuture<'a, (Box<dyn FrontEnd>, Vec<String>)> {
        Box::pin(async move {
            let mut errors = Vec::new();
            let drivers = start_drivers(cx, cx.planned, cx.taken, &mut errors).await;
            (Box::new(Drivers { drivers }) as Box<dyn FrontEnd>, errors)
        })
    }

    fn describe(
        &self,
        spec: &ModuleSpec,
        planned: &[(String, ResourceInfo)],
    ) -> Vec<Result<String, String>> {
        let (drivers, errors) = driver_names(spec, planned);
        drivers
            .into_iter()
            .map(|(driver, name, _)| {
                Ok(format!(
                    "resource {name} served as DRA driver {driver} (front-end = \"dra\"; \
                     `run` needs --node-name)"
                ))
            })
            .chain(errors.into_iter().map(Err))
            .collect()
    }

    fn answers_ahead(&self) -> bool {
        false
    }

    fn needs_api_server(&self) -> bool {
        true
    }
}

/// The driver each of `planned` is served as (the registry's `dra-driver` for a module with one
/// resource, else the resource's name turned around), and why the others have none.
fn driver_names<'a>(
    spec: &ModuleSpec,
    planned: &'a [(String, ResourceInfo)],
) -> (Vec<(String, &'a String, &'a ResourceInfo)>, Vec<String>) {
    let explicit = explicit(spec);
    if explicit.is_some() && planned.len() > 1 {
        let names: Vec<&str> = planned.iter().map(|(n, _)| n.as_str()).collect();
        let error = format!(
            "module `{}`: `dra-driver` names one driver, but the module serves {} resources ({}); \
             drop it to serve each as its own driver (the resource name turned around)",
            spec.name,
            planned.len(),
            names.join(", ")
        );
        return (Vec::new(), vec![error]);
    }
    let mut drivers = Vec::new();
    let mut errors = Vec::new();
    for (name, info) in planned {
        match crate::dra::names::driver_name(explicit, name) {
            Ok(driver) => drivers.push((driver, name, info)),
            Err(e) => errors.push(format!(
                "module `{}`: {name} makes no DRA driver name ({e}); set `dra-driver`",
                spec.name
            )),
        }
    }
    (drivers, errors)
}

/// A module's resources served as DRA drivers.
pub struct Drivers {
    pub drivers: Vec<RunningDriver>,
}

/// How a DRA driver's name is kept among the served names, apart from resource names.
pub fn driver_key(driver: &str) -> String {
    format!("DRA driver {driver}")
}

/// The registry's `dra-driver`, when the module has `front-end = "dra"`.
fn explicit(spec: &ModuleSpec) -> Option<&str> {
    match &spec.front_end {
        crate::config::FrontEnd::Dra { driver } => driver.as_deref(),
        crate::config::FrontEnd::DevicePlugin => None,
    }
}

impl FrontEnd for Drivers {
    fn as_any(&self) -> &dyn Any {
        self
    }

    fn resources(&self) -> Vec<String> {
        self.drivers.iter().map(|d| d.name.clone()).collect()
    }

    fn names(&self) -> Vec<String> {
        self.drivers
            .iter()
            .flat_map(|d| [d.name.clone(), driver_key(&d.driver)])
            .collect()
    }

    fn pokes(&self) -> Vec<Arc<Notify>> {
        self.drivers.iter().map(|d| d.poke.clone()).collect()
    }

    fn ended(&self, module: &str) -> Vec<String> {
        self.drivers
            .iter()
            .filter(|d| d.task_ended())
            .map(|d| {
                format!(
                    "a task serving DRA driver {} (module `{module}`) ended",
                    d.driver
                )
            })
            .collect()
    }

    fn not_ready(&self, module: &str) -> Vec<String> {
        self.drivers
            .iter()
            .filter(|d| !d.registered.get())
            .map(|d| {
                format!(
                    "DRA driver {} (module `{module}`) is not registered with the kubelet",
                    d.driver
                )
            })
            .collect()
    }

    fn status(
        &self,
        module: &str,
        ledger: &crate::ledger::Ledger,
        out: &mut crate::agent::status::Status,
    ) {
        for d in &self.drivers {
            out.dra_drivers
                .push(crate::agent::status::driver_status(d, module, ledger));
        }
    }

    /// In place while the module stays on DRA with drivers running and the health interval
    /// their watchers were started with.
    fn keeps(&self, old: &ModuleSpec, cx: &Context<'_>) -> bool {
        matches!(cx.spec.front_end, crate::config::FrontEnd::Dra { .. })
            && !self.drivers.is_empty()
            && old.health_interval == cx.spec.health_interval
    }

    /// A driver the new version still serves (same driver name, same resource) keeps its
    /// sockets, registration, health streams, pool and claims; the others stop and take their
    /// slices with them.
    fn stop_gone<'a>(&'a mut self, _: &'a ModuleSpec, cx: &'a Context<'a>) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            let explicit = explicit(cx.spec);
            let wanted: Vec<(String, &String, &ResourceInfo)> = cx
                .planned
                .iter()
                .filter_map(|(name, info)| {
                    let driver = crate::dra::names::driver_name(explicit, name).ok()?;
                    Some((driver, name, info))
                })
                .collect();
            // One `dra-driver` for several resources is refused by `start_drivers`, which must
            // then see them all: nothing is kept.
            let keep_any = explicit.is_none() || cx.planned.len() <= 1;
            let (kept, gone): (Vec<_>, Vec<_>) = std::mem::take(&mut self.drivers)
                .into_iter()
                .partition(|d| {
                    keep_any
                        && wanted.iter().any(|(driver, name, info)| {
                            *driver == d.driver && **name == d.name && info.name == d.local
                        })
                });
            self.drivers = kept;
            // Gone ones stop while the old version still answers their last calls.
            for driver in gone {
                driver.stop(true).await;
            }
        })
    }

    /// Kept drivers enumerate again at once through the new version, which answers their next
    /// prepare and unprepare; new ones start.
    fn resume<'a>(&'a mut self, cx: &'a Context<'a>) -> BoxFuture<'a, Vec<String>> {
        Box::pin(async move {
            for d in &self.drivers {
                d.poke.notify_one();
            }
            let fresh: Vec<(String, ResourceInfo)> = cx
                .planned
                .iter()
                .filter(|(name, _)| !self.drivers.iter().any(|d| d.name == *name))
                .cloned()
                .collect();
            // The kept drivers' names are taken: a fresh resource may not start a second one.
            let mut taken = cx.taken.clone();
            for d in &self.drivers {
                taken.insert(driver_key(&d.driver), cx.spec.name.clone());
            }
            let mut errors = Vec::new();
            let started = start_drivers(cx, &fresh, &taken, &mut errors).await;
            self.drivers.extend(started);
            errors
        })
    }

    fn stop<'a>(self: Box<Self>, how: Stop<'a>, _: &'a ModuleSlot) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            // Starting again on DRA: a driver the new version still serves keeps its slices (it
            // is served again at once); any other takes them with it, so its devices are not
            // advertised while they may be served otherwise. Prepared claims stay in the
            // ledger either way.
            let staying: Vec<String> = match &how {
                Stop::Restart(next) => match &next.spec.front_end {
                    crate::config::FrontEnd::Dra { driver } => next
                        .planned
                        .iter()
                        .filter_map(|(name, _)| {
                            crate::dra::names::driver_name(driver.as_deref(), name).ok()
                        })
                        .collect(),
                    crate::config::FrontEnd::DevicePlugin => Vec::new(),
                },
                Stop::Shutdown | Stop::Removed => Vec::new(),
            };
            for driver in self.drivers {
                let retire = match &how {
                    Stop::Shutdown => false,
                    Stop::Removed => true,
                    Stop::Restart(_) => !staying.contains(&driver.driver),
                };
                driver.stop(retire).await;
            }
        })
    }
}

/// Serves each of `planned` as a DRA driver.
async fn start_drivers(
    cx: &Context<'_>,
    planned: &[(String, ResourceInfo)],
    taken: &BTreeMap<String, String>,
    errors: &mut Vec<String>,
) -> Vec<RunningDriver> {
    let spec = cx.spec;
    let Some(options) = cx.dra else {
        errors.push(format!(
            "module `{}` has `front-end = \"dra\"`, but the agent serves no DRA drivers: give it \
             the node's name (--node-name, or NODE_NAME as a DaemonSet sets it from the pod's \
             spec.nodeName)",
            spec.name
        ));
        return Vec::new();
    };
    let ledger = cx.at.ledger;
    let (named, refused) = driver_names(spec, planned);
    errors.extend(refused);
    let mut drivers = Vec::new();
    for (driver, name, info) in named {
        if let Some(owner) = taken.get(&driver_key(&driver)) {
            errors.push(format!(
                "module `{}`: DRA driver {driver} (for {name}) is already served by module \
                 `{owner}`; give one of them another `dra-driver`",
                spec.name
            ));
            continue;
        }
        // A driver of this name still answering for claims after it left the registry hands
        // over: the new one answers for them (they are in the ledger).
        options.retirees.take_over(&driver).await;
        let upkeep: Arc<dyn Upkeep> = Arc::new(cx.slot.clone());
        // What the device-plugin front end handed out under the same name stays out of the
        // pool until the kubelet reports its container gone (see `HeldElsewhere`).
        let held: HeldElsewhere = {
            // Under its own name, and as the device plugin served it shared and renamed.
            let ledger = ledger.clone();
            let names = [
                name.clone(),
                format!("{name}{}", crate::policy::sharing::RENAMED_SUFFIX),
            ];
            Arc::new(move || {
                names
                    .iter()
                    .flat_map(|n| ledger.holders(n))
                    .map(|(id, _)| physical_id(&id).to_owned())
                    .collect()
            })
        };
        let started = crate::dra::driver::start(
            cx.slot,
            &upkeep,
            DriverSpec {
                driver: &driver,
                name,
                local: &info.name,
                health_interval: spec.health_interval,
                host_root: cx.host_root.to_owned(),
                held,
                ledger: ledger.clone(),
            },
            options,
        );
        match started {
            Ok(d) => drivers.push(d),
            Err(e) => errors.push(format!("module `{}`: {e}", spec.name)),
        }
    }
    drivers
}
