//! A deliberately bad devicelet module, for exercising the host's sandbox in tests: it traps,
//! spins, fails or eats memory on demand. Never deploy it.
//!
//! It imports `devicelet:plugin/log` and `devicelet:plugin/sysfs` (for the `switch` file, so
//! its registry entry needs a sysfs grant) and serves one resource of made-up devices.
//!
//! # Config
//!
//! The registry's `[module.config]` table, every key optional; unknown keys are refused with
//! [`PluginError::InvalidConfig`]:
//!
//! ```toml
//! [module.config]
//! resource = "bad"      # the resource name init returns
//! devices = 2           # how many devices enumerate lists: dev-0 .. dev-{N-1}
//! numa = 0              # NUMA nodes to spread the devices over: dev-i is on node i % numa;
//!                       # 0 (the default) reports no topology
//! also-declare = 0      # declare this many more resources, `<resource>-extra-<i>` (the host
//!                       # serves at most 64 per module); calls on them fail as unknown
//! init = "ok"           # a mode (below) for each call
//! enumerate = "ok"
//! allocate = "ok"
//! prestart = "ok"
//! preferred = "ok"
//! switch = "/sys/testing/switch"  # optional: a granted sysfs file whose content, read at every
//!                                 # enumerate, overrides the enumerate mode while it exists
//! ```
//!
//! Modes, applied at the start of each call (for `init`, once the config has parsed):
//!
//! - `"ok"`: behave (see below);
//! - `"trap"`: panic, which traps the instance;
//! - `"loop"`: spin forever without returning, so the host's deadline has to interrupt it;
//! - `"error"`: return `PluginError::Failed("requested failure")`;
//! - `"memory"`: allocate and touch 1 MiB blocks, keeping them all, until allocation fails
//!   (which traps); meant for `allocate`, accepted for every call;
//! - `"unhealthy"`: like `"ok"`, but enumerate reports every device Unhealthy;
//! - `"slow"`: spin for 300 ms (by the monotonic clock), then behave like `"ok"`: a call that
//!   takes its time but finishes well inside its deadline.
//!
//! Setting `prestart` or `preferred` at all (to any mode, `"ok"` included) makes the resource ask
//! the kubelet for the call (`ResourceInfo::prestart` / `preferred_allocation`); leaving the key
//! out keeps the flag false.
//!
//! Behaviour in mode `"ok"`:
//!
//! - `enumerate`: `devices` healthy devices `dev-0` .. `dev-{N-1}`, with `numa` > 0 each on
//!   NUMA node `i % numa` (benchmarks use it for a resource spread over NUMA nodes);
//! - `allocate`: container edits with the single env `MISBEHAVING_DEVICES=<IDs joined by ,>`;
//! - `prestart`: succeeds;
//! - `preferred`: the *last* `size` IDs of `available` (ignoring `must-include`), so tests can
//!   tell the module's answer from the kubelet's default choice.
//!
//! Every method answers a resource name other than `resource` with
//! `PluginError::UnknownResource` (after applying its mode).

use devicelet_sdk::{ContainerEdits, Device, Plugin, PluginError, ResourceInfo, export_plugin};
use serde::Deserialize;

/// What a call does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "kebab-case")]
enum Mode {
    #[default]
    Ok,
    Trap,
    Loop,
    Error,
    Memory,
    Unhealthy,
    Slow,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct Config {
    #[serde(default = "default_resource")]
    resource: String,
    #[serde(default = "default_devices")]
    devices: u32,
    /// NUMA nodes the devices are spread over (device i on node i % numa); 0: no topology.
    #[serde(default)]
    numa: u32,
    /// More resources to declare, `<resource>-extra-<i>`, to test the host's cap.
    #[serde(default)]
    also_declare: u32,
    #[serde(default)]
    init: Mode,
    #[serde(default)]
    enumerate: Mode,
    #[serde(default)]
    allocate: Mode,
    /// `Some` asks for prestart calls.
    #[serde(default)]
    prestart: Option<Mode>,
    /// `Some` asks for preferred-allocation calls.
    #[serde(default)]
    preferred: Option<Mode>,
    /// A sysfs file overriding `enumerate` while it exists, so a test can change the module's
    /// behaviour at run time.
    #[serde(default)]
    switch: Option<String>,
}

fn default_resource() -> String {
    "bad".to_string()
}

fn default_devices() -> u32 {
    2
}

/// Runs `mode` for the call named `call`; returns only for [`Mode::Ok`].
fn misbehave(call: &str, mode: Mode) -> Result<(), PluginError> {
    match mode {
        Mode::Ok | Mode::Unhealthy => Ok(()),
        Mode::Error => Err(PluginError::Failed("requested failure".to_string())),
        Mode::Trap => panic!("misbehaving: {call} traps as configured"),
        Mode::Loop => spin(),
        Mode::Memory => memory_bomb(),
        Mode::Slow => {
            let started = std::time::Instant::now();
            while started.elapsed() < std::time::Duration::from_millis(300) {
                std::hint::spin_loop();
            }
            Ok(())
        }
    }
}

/// Spins forever; `black_box` keeps the optimiser from proving the loop side-effect free.
fn spin() -> ! {
    let mut counter = 0u64;
    loop {
        counter = std::hint::black_box(counter).wrapping_add(1);
    }
}

/// Allocates 1 MiB blocks filled with non-zero bytes (so every page is really touched) and keeps
/// them all, until the allocator fails and the instance traps.
fn memory_bomb() -> ! {
    const BLOCK: usize = 1 << 20;
    let mut hoard: Vec<Vec<u8>> = Vec::new();
    loop {
        let block = vec![0xa5u8; BLOCK];
        hoard.push(std::hint::black_box(block));
        std::hint::black_box(&mut hoard);
    }
}

struct Misbehaving {
    config: Config,
    ids: Vec<String>,
}

/// The NUMA node of device `index`, if the config spreads devices over any.
fn numa_node(index: usize, numa: u32) -> Option<i64> {
    (numa > 0).then(|| (index as u64 % u64::from(numa)) as i64)
}

impl Misbehaving {
    fn check(&self, call: &str, mode: Mode, resource: &str) -> Result<(), PluginError> {
        misbehave(call, mode)?;
        if resource == self.config.resource {
            Ok(())
        } else {
            Err(PluginError::UnknownResource(resource.to_string()))
        }
    }
}

fn parse_config(config: &str) -> Result<Config, PluginError> {
    let text = if config.trim().is_empty() {
        "{}"
    } else {
        config
    };
    serde_json::from_str(text).map_err(|e| PluginError::InvalidConfig(e.to_string()))
}

impl Plugin for Misbehaving {
    fn init(config: &str) -> Result<(Self, Vec<ResourceInfo>), PluginError> {
        let config = parse_config(config)?;
        misbehave("init", config.init)?;
        let ids = (0..config.devices).map(|i| format!("dev-{i}")).collect();
        let info = ResourceInfo::new(config.resource.clone())
            .with_prestart(config.prestart.is_some())
            .with_preferred_allocation(config.preferred.is_some());
        devicelet_sdk::info!(
            "misbehaving: serving {} with {} devices as configured: {config:?}",
            config.resource,
            config.devices
        );
        let extra = (0..config.also_declare)
            .map(|i| ResourceInfo::new(format!("{}-extra-{i}", config.resource)));
        let declared = std::iter::once(info).chain(extra).collect();
        Ok((Misbehaving { config, ids }, declared))
    }

    fn enumerate(&mut self, resource: &str) -> Result<Vec<Device>, PluginError> {
        let mode = match &self.config.switch {
            Some(file) => match devicelet_sdk::sysfs::read_to_string(file) {
                Ok(text) => serde_json::from_value(serde_json::Value::String(text))
                    .map_err(|e| PluginError::Failed(format!("{file}: {e}")))?,
                Err(_) => self.config.enumerate,
            },
            None => self.config.enumerate,
        };
        self.check("enumerate", mode, resource)?;
        Ok(self
            .ids
            .iter()
            .enumerate()
            .map(|(i, id)| {
                let device = match mode {
                    Mode::Unhealthy => Device::unhealthy(id),
                    _ => Device::healthy(id),
                };
                match numa_node(i, self.config.numa) {
                    Some(node) => device.numa_node(node),
                    None => device,
                }
            })
            .collect())
    }

    fn allocate(&mut self, resource: &str, ids: &[String]) -> Result<ContainerEdits, PluginError> {
        self.check("allocate", self.config.allocate, resource)?;
        Ok(ContainerEdits::default().env("MISBEHAVING_DEVICES", ids.join(",")))
    }

    fn prestart(&mut self, resource: &str, _ids: &[String]) -> Result<(), PluginError> {
        self.check(
            "prestart",
            self.config.prestart.unwrap_or_default(),
            resource,
        )
    }

    fn preferred(
        &mut self,
        resource: &str,
        available: &[String],
        _must_include: &[String],
        size: usize,
    ) -> Result<Vec<String>, PluginError> {
        self.check(
            "preferred",
            self.config.preferred.unwrap_or_default(),
            resource,
        )?;
        Ok(last(available, size))
    }
}

/// The last `size` entries of `available` (all of them when there are fewer).
fn last(available: &[String], size: usize) -> Vec<String> {
    available[available.len().saturating_sub(size)..].to_vec()
}

export_plugin!(Misbehaving);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults() {
        let config = parse_config("{}").unwrap();
        assert_eq!(config.resource, "bad");
        assert_eq!(config.devices, 2);
        assert_eq!(config.numa, 0);
        assert_eq!(config.allocate, Mode::Ok);
        assert!(config.prestart.is_none() && config.preferred.is_none());
    }

    #[test]
    fn modes_and_unknown_keys() {
        let config = parse_config(r#"{"allocate": "memory", "prestart": "ok"}"#).unwrap();
        assert_eq!(config.allocate, Mode::Memory);
        assert_eq!(config.prestart, Some(Mode::Ok));
        let Err(PluginError::InvalidConfig(msg)) = parse_config(r#"{"alocate": "trap"}"#) else {
            panic!("unknown key accepted");
        };
        assert!(msg.contains("alocate"), "{msg}");
        assert!(parse_config(r#"{"init": "explode"}"#).is_err());
    }

    #[test]
    fn numa_spreads_devices_round_robin() {
        let config = parse_config(r#"{"devices": 64, "numa": 2}"#).unwrap();
        assert_eq!(config.numa, 2);
        assert_eq!(numa_node(0, 0), None);
        assert_eq!(numa_node(5, 0), None);
        assert_eq!(numa_node(0, 2), Some(0));
        assert_eq!(numa_node(63, 2), Some(1));
        assert_eq!(numa_node(7, 3), Some(1));
    }

    #[test]
    fn preferred_takes_the_tail() {
        let ids: Vec<String> = ["a", "b", "c"].iter().map(|s| s.to_string()).collect();
        assert_eq!(last(&ids, 2), vec!["b".to_string(), "c".to_string()]);
        assert_eq!(last(&ids, 5), ids);
    }
}
