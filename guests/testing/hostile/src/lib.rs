//! A deliberately hostile devicelet module, for showing in tests that the host refuses each
//! attack, keeps serving other modules and reports what happened. Never deploy it.
//!
//! It imports `devicelet:plugin/log`, `devicelet:plugin/sysfs` and `devicelet:plugin/devnodes`
//! (every attack is compiled in, so its registry entry needs both a sysfs and a /dev grant) and
//! serves one resource.
//!
//! # Config
//!
//! The registry's `[module.config]` table; unknown keys and unknown attacks are refused with
//! [`PluginError::InvalidConfig`]:
//!
//! ```toml
//! [module.config]
//! resource = "evil"       # the resource name init returns (default "evil")
//! attack = "read-sysfs"   # one of the attacks below (default "none")
//! path = "/etc/passwd"    # the path or pattern; required by read-sysfs, list-sysfs,
//!                         # glob-dev, device-node and mount-path, refused with any other attack
//! ```
//!
//! # Normal behaviour
//!
//! What every call does unless the attack says otherwise (and all of them with `"none"`):
//!
//! - `enumerate`: two healthy devices, `evil-0` and `evil-1`;
//! - `health`: every requested ID healthy;
//! - `allocate`: empty container edits;
//! - `prestart` and `preferred`: the SDK defaults.
//!
//! Every call answers a resource name other than `resource` with
//! `PluginError::UnknownResource`.
//!
//! # Attacks
//!
//! Probing attacks, in `enumerate`. Each returns the normal devices plus what it got out of the
//! host. When the host call fails, `evil-0` carries an attribute `error` holding the `FsError`
//! in `Debug` form (`FsError::Denied("...")`, `FsError::NotFound`, `FsError::Io("...")`), and
//! the error is logged at warn level:
//!
//! - `"read-sysfs"`: `sysfs::read(path)`; on success adds a device `leaked` with an attribute
//!   `bytes` (how many bytes were read);
//! - `"list-sysfs"`: `sysfs::list(path)`; on success with entries adds a device `leaked` with an
//!   attribute `entries` (the names joined by `,`); an empty listing adds nothing;
//! - `"glob-dev"`: `devnodes::glob(path)`; adds one device per returned path, `found-0`,
//!   `found-1`... in the host's order, each with an attribute `path` (the returned path).
//!
//! Forbidden container edits, in `allocate` (the whole answer, nothing else in it):
//!
//! - `"dev-mem"`: device node `/dev/mem` at `/dev/mem`, permissions `rw`;
//! - `"mount-root"`: read-write bind mount of host `/` at `/host`;
//! - `"huge-string"`: env `HOSTILE_HUGE` set to 10 MiB of `x` (10 * 1024 * 1024 bytes);
//! - `"bad-env"`: env `1BAD=NAME` = `x`, annotation `not a key!` = `x` and CDI device
//!   `not-qualified`;
//! - `"device-node"`: device node `path` at `/dev/hostile`, permissions `rw` (for paths that
//!   are granted as text but resolve to something else);
//! - `"mount-path"`: read-write bind mount of host `path` at `/mnt/hostile`;
//! - `"bad-cdi"`: CDI devices that only look qualified: `-vendor.com/class=x`,
//!   `vendor.com/class=..` and `vendor.com/class-=x`.
//!
//! Bad device lists, in `enumerate` (exactly these devices, all healthy):
//!
//! - `"many-devices"`: 100,000 devices `d-0` .. `d-99999`;
//! - `"invalid-ids"`: `ok-0`, `bad id with spaces`, `../../etc`, the empty string and 300 `a`s;
//! - `"duplicate-ids"`: `dup`, `dup`, `other`;
//! - `"attribute-flood"`: 2,000 devices `a-0` .. `a-1999`, each with 12 attributes of 1,000
//!   bytes: every per-device rule holds, but together they would hold ~24 MB of the agent's
//!   memory.
//!
//! Noise, in `enumerate`:
//!
//! - `"stdout-flood"`: prints 10,000 lines to stdout and 10,000 to stderr, then returns the
//!   normal devices.

use devicelet_sdk::{
    ContainerEdits, Device, FsError, Plugin, PluginError, ResourceInfo, devnodes, export_plugin,
    sysfs,
};
use serde::Deserialize;

/// What the module does to the host; see the crate docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "kebab-case")]
enum Attack {
    #[default]
    None,
    ReadSysfs,
    ListSysfs,
    GlobDev,
    DevMem,
    MountRoot,
    HugeString,
    ManyDevices,
    InvalidIds,
    DuplicateIds,
    BadEnv,
    StdoutFlood,
    DeviceNode,
    MountPath,
    BadCdi,
    AttributeFlood,
}

impl Attack {
    /// Whether the attack takes the `path` key.
    fn takes_path(self) -> bool {
        matches!(
            self,
            Attack::ReadSysfs
                | Attack::ListSysfs
                | Attack::GlobDev
                | Attack::DeviceNode
                | Attack::MountPath
        )
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Config {
    #[serde(default = "default_resource")]
    resource: String,
    #[serde(default)]
    attack: Attack,
    #[serde(default)]
    path: Option<String>,
}

fn default_resource() -> String {
    "evil".to_string()
}

fn parse_config(config: &str) -> Result<Config, PluginError> {
    let text = if config.trim().is_empty() {
        "{}"
    } else {
        config
    };
    let config: Config =
        serde_json::from_str(text).map_err(|e| PluginError::InvalidConfig(e.to_string()))?;
    if config.attack.takes_path() != config.path.is_some() {
        let want = if config.attack.takes_path() {
            "needs"
        } else {
            "takes no"
        };
        return Err(PluginError::InvalidConfig(format!(
            "attack {:?} {want} path",
            config.attack
        )));
    }
    Ok(config)
}

/// The devices enumerate returns when not attacking.
fn normal_devices() -> Vec<Device> {
    vec![Device::healthy("evil-0"), Device::healthy("evil-1")]
}

/// The normal devices plus what a probe of the host got out of it, or, when the host refused,
/// the normal devices with the refusal on `evil-0`.
fn probe(what: &str, path: &str, result: Result<Vec<Device>, FsError>) -> Vec<Device> {
    match result {
        Ok(extra) => normal_devices().into_iter().chain(extra).collect(),
        Err(e) => {
            devicelet_sdk::warn!("hostile: {what}({path:?}) failed: {e:?}");
            vec![
                Device::healthy("evil-0").attribute("error", format!("{e:?}")),
                Device::healthy("evil-1"),
            ]
        }
    }
}

/// Healthy devices with the given IDs, in order.
fn devices(ids: &[&str]) -> Vec<Device> {
    ids.iter().map(|id| Device::healthy(*id)).collect()
}

struct Hostile {
    config: Config,
}

impl Hostile {
    fn check(&self, resource: &str) -> Result<(), PluginError> {
        if resource == self.config.resource {
            Ok(())
        } else {
            Err(PluginError::UnknownResource(resource.to_string()))
        }
    }

    fn path(&self) -> &str {
        self.config.path.as_deref().unwrap_or_default()
    }
}

impl Plugin for Hostile {
    fn init(config: &str) -> Result<(Self, Vec<ResourceInfo>), PluginError> {
        let config = parse_config(config)?;
        devicelet_sdk::info!(
            "hostile: serving {} as configured: {config:?}",
            config.resource
        );
        let info = ResourceInfo::new(config.resource.clone());
        Ok((Hostile { config }, vec![info]))
    }

    fn enumerate(&mut self, resource: &str) -> Result<Vec<Device>, PluginError> {
        self.check(resource)?;
        let path = self.path();
        Ok(match self.config.attack {
            Attack::ReadSysfs => probe(
                "sysfs::read",
                path,
                sysfs::read(path).map(|bytes| {
                    vec![Device::healthy("leaked").attribute("bytes", bytes.len().to_string())]
                }),
            ),
            Attack::ListSysfs => probe(
                "sysfs::list",
                path,
                sysfs::list(path).map(|entries| {
                    (!entries.is_empty())
                        .then(|| Device::healthy("leaked").attribute("entries", entries.join(",")))
                        .into_iter()
                        .collect()
                }),
            ),
            Attack::GlobDev => probe(
                "devnodes::glob",
                path,
                devnodes::glob(path).map(|paths| {
                    paths
                        .into_iter()
                        .enumerate()
                        .map(|(i, p)| Device::healthy(format!("found-{i}")).attribute("path", p))
                        .collect()
                }),
            ),
            Attack::ManyDevices => (0..100_000)
                .map(|i| Device::healthy(format!("d-{i}")))
                .collect(),
            Attack::InvalidIds => devices(&[
                "ok-0",
                "bad id with spaces",
                "../../etc",
                "",
                &"a".repeat(300),
            ]),
            Attack::DuplicateIds => devices(&["dup", "dup", "other"]),
            Attack::AttributeFlood => (0..2000)
                .map(|i| {
                    (0..12).fold(Device::healthy(format!("a-{i}")), |d, k| {
                        d.attribute(format!("k{k}"), "v".repeat(1000))
                    })
                })
                .collect(),
            Attack::StdoutFlood => {
                for i in 0..10_000 {
                    println!("hostile: stdout flood line {i}");
                    eprintln!("hostile: stderr flood line {i}");
                }
                normal_devices()
            }
            Attack::None
            | Attack::DevMem
            | Attack::MountRoot
            | Attack::HugeString
            | Attack::BadEnv
            | Attack::DeviceNode
            | Attack::MountPath
            | Attack::BadCdi => normal_devices(),
        })
    }

    fn allocate(&mut self, resource: &str, _ids: &[String]) -> Result<ContainerEdits, PluginError> {
        self.check(resource)?;
        let edits = ContainerEdits::default();
        Ok(match self.config.attack {
            Attack::DevMem => edits.device("/dev/mem", "/dev/mem", "rw"),
            Attack::MountRoot => edits.mount("/", "/host", false),
            Attack::HugeString => edits.env("HOSTILE_HUGE", "x".repeat(10 * 1024 * 1024)),
            Attack::BadEnv => edits
                .env("1BAD=NAME", "x")
                .annotation("not a key!", "x")
                .cdi("not-qualified"),
            Attack::DeviceNode => edits.device(self.path(), "/dev/hostile", "rw"),
            Attack::MountPath => edits.mount(self.path(), "/mnt/hostile", false),
            Attack::BadCdi => edits
                .cdi("-vendor.com/class=x")
                .cdi("vendor.com/class=..")
                .cdi("vendor.com/class-=x"),
            Attack::None
            | Attack::ReadSysfs
            | Attack::ListSysfs
            | Attack::GlobDev
            | Attack::ManyDevices
            | Attack::InvalidIds
            | Attack::DuplicateIds
            | Attack::AttributeFlood
            | Attack::StdoutFlood => edits,
        })
    }
}

export_plugin!(Hostile);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults() {
        let config = parse_config("").unwrap();
        assert_eq!(config.resource, "evil");
        assert_eq!(config.attack, Attack::None);
        assert!(config.path.is_none());
    }

    #[test]
    fn attacks_and_paths() {
        let config = parse_config(r#"{"attack": "read-sysfs", "path": "/etc/passwd"}"#).unwrap();
        assert_eq!(config.attack, Attack::ReadSysfs);
        assert_eq!(config.path.as_deref(), Some("/etc/passwd"));
        assert!(parse_config(r#"{"attack": "glob-dev"}"#).is_err());
        assert!(parse_config(r#"{"attack": "dev-mem", "path": "/x"}"#).is_err());
        assert!(parse_config(r#"{"attack": "explode"}"#).is_err());
        let Err(PluginError::InvalidConfig(msg)) = parse_config(r#"{"atack": "dev-mem"}"#) else {
            panic!("unknown key accepted");
        };
        assert!(msg.contains("atack"), "{msg}");
    }
}
