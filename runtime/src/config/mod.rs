//! The node's module registry: the TOML file that tells devicelet which WebAssembly device
//! modules to run, what each may touch on the host, and how tightly each is limited.
//!
//! The registry is written by hand by an operator, so everything here aims at one thing: a bad file
//! is refused before any module starts, with an error that says which file, which line and column,
//! and which key (e.g. `module[1].call-deadline`) is wrong and what would be right. Nothing is
//! silently ignored: an unknown key anywhere outside a module's free-form `config` table is an
//! error, because a misspelt `memory-limit` that quietly fell back to the default would be worse
//! than a refusal.
//!
//! The format, with every optional key at its default:
//!
//! ```toml
//! host-root = "/"                        # where sysfs and /dev are read from
//! resource-domain = "devicelet.io"       # prefixed to bare resource names
//!
//! [[module]]
//! name = "generic-dev"                   # unique; a DNS label
//! path = "generic_dev.wasm"              # relative to this file's directory
//! resource-domain = "devicelet.io"       # per-module override
//! health-interval = "5s"                 # 100ms ..= 1h
//! call-deadline = "2s"                   # 1ms ..= 10s
//! memory-limit = "64MiB"                 # 1MiB ..= 4GiB
//! # sha256 = "<64 hex digits>"           # checked against the module file when given
//!
//! [module.grants]                        # nothing is granted by default
//! sysfs = ["/sys/bus/pci/devices/*"]
//! dev = ["/dev/fuse", "/dev/ttyUSB*"]
//!
//! [module.config]                        # any table; handed to the module as JSON
//! groups = [{ name = "fuse", paths = ["/dev/fuse"] }]
//! ```
//!
//! This module only validates the text. Whether `path` exists, whether the file's digest matches
//! `sha256`, and whether the module's imports fit its grants are the loader's business, because
//! only the loader can name the module *and* the failing file in one message.

mod choices;
mod error;
mod grants;
mod json;
mod keypath;
mod limits;
mod module;
mod names;
pub mod oci_source;
mod registry;
mod sharing;
mod source;
mod units;
pub(crate) mod verify_key;

pub use units::parse_duration;
mod value;

#[cfg(test)]
mod tests;

pub use choices::{AllocationPolicy, DeviceListStrategy};
pub use error::RegistryError;
pub use grants::{
    FORBIDDEN_MOUNTS, Grants, NVML, NVML_MIG, forbidden_by_path, forbidden_by_path_in,
};
pub use limits::{
    CALL_DEADLINE_MAX, CALL_DEADLINE_MIN, DEFAULT_CALL_DEADLINE, DEFAULT_HEALTH_INTERVAL,
    DEFAULT_HOST_ROOT, DEFAULT_MEMORY_LIMIT, DEFAULT_RESOURCE_DOMAIN, HEALTH_INTERVAL_MAX,
    HEALTH_INTERVAL_MIN, MAX_MODULES, MAX_RESOURCES, MAX_RESOURCES_PER_MODULE, MEMORY_LIMIT_MAX,
    MEMORY_LIMIT_MIN,
};
pub use module::{FrontEnd, ModuleSpec};
pub use oci_source::OciSource;
pub use registry::Registry;
pub use sharing::{MAX_REPLICAS, ShareRule, Sharing};
pub use verify_key::VerifyKey;

/// Every key the registry takes, by the table it goes in (`""` for the top level): what the
/// docs must cover (a test holds the README and `docs/` to it).
pub fn registry_keys() -> Vec<(&'static str, &'static str)> {
    let tables: [(&'static str, &[&'static str]); 5] = [
        ("", registry::KEYS),
        ("module", module::KEYS),
        ("module.grants", grants::KEYS),
        ("module.sharing", sharing::KEYS),
        ("module.sharing.resources.<name>", sharing::RESOURCE_KEYS),
    ];
    tables
        .into_iter()
        .flat_map(|(table, keys)| keys.iter().map(move |k| (table, *k)))
        .collect()
}
