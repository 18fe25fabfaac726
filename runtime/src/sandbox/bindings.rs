//! The host/guest seam: the WIT world's generated bindings, and the conversions between them and
//! the host's own types. A new WIT major version gets a sibling module here and nothing else in
//! the host changes.

/// Bindings for `devicelet:plugin@0.1`, generated from the newest frozen copy, `wit/v0.1.2/`; modules
/// built against an older 0.1.x link against them by semver.
pub mod v0_1 {
    wasmtime::component::bindgen!({
        path: "../wit/v0.1.2",
        world: "device-plugin",
        exports: { default: async },
    });

    pub use self::devicelet::plugin::types as wit;
    pub use self::exports::devicelet::plugin::plugin as guest;
}

use v0_1::wit;

use crate::device::{ContainerEdits, Device, DeviceNode, Health, Mount, PluginError, ResourceInfo};

/// The versions of the WIT package, read from the frozen folders under `wit/` by `build.rs`, and
/// what the host makes of the version a module's imports and export name.
pub mod imports {
    use semver::Version;

    include!(concat!(env!("OUT_DIR"), "/wit_versions.rs"));

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Interface {
        Log,
        Types,
        Sysfs,
        Devnodes,
        /// Added in 0.1.1.
        Nvml,
        /// Added in 0.1.2; every module may import it.
        Schedule,
        /// The export every module must have.
        Plugin,
    }

    /// Why a `devicelet:plugin` name is not one this host provides.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub enum Unsupported {
        /// An interface no published version has.
        Interface,
        /// A version outside [`speaks`] (or no version at all).
        Version(String),
    }

    /// The semver line a version belongs to: the major, or the minor for 0.x. Versions on one
    /// line only add to each other.
    fn line(v: &Version) -> (u64, u64) {
        if v.major == 0 {
            (0, v.minor)
        } else {
            (v.major, 0)
        }
    }

    /// The oldest published version on [`LATEST`]'s line.
    fn oldest() -> Option<Version> {
        let latest = Version::parse(LATEST).ok()?;
        PUBLISHED
            .iter()
            .filter_map(|v| Version::parse(v).ok())
            .filter(|v| line(v) == line(&latest))
            .min()
    }

    /// The versions a module may be built against, as the operator reads it: `0.1.0 to 0.1.1`.
    /// The oldest published version on the latest's line through [`LATEST`]: a minor version
    /// only adds, and wasmtime's linker resolves an older `@0.1.x` import to the host's newer
    /// definition.
    pub fn speaks() -> String {
        match oldest() {
            Some(oldest) if oldest.to_string() != LATEST => format!("{oldest} to {LATEST}"),
            _ => LATEST.to_owned(),
        }
    }

    /// Whether a module built against `version` links with this host: on [`LATEST`]'s line, no
    /// newer than it, no older than the first published version on that line. Build metadata
    /// (`+...`) says nothing about the interface and is ignored; a pre-release is refused.
    pub fn supported(version: &Version) -> bool {
        let (Some(oldest), Ok(latest)) = (oldest(), Version::parse(LATEST)) else {
            return false;
        };
        let mut version = version.clone();
        version.build = semver::BuildMetadata::EMPTY;
        version.pre.is_empty()
            && line(&version) == line(&latest)
            && version >= oldest
            && version <= latest
    }

    /// Which of our interfaces `name` (an import or export name) is: None when it is not a
    /// `devicelet:plugin` name at all.
    pub fn ours(name: &str) -> Option<Result<Interface, Unsupported>> {
        let rest = name.strip_prefix("devicelet:plugin/")?;
        let (interface, version) = rest.split_once('@').unwrap_or((rest, ""));
        match Version::parse(version) {
            Ok(v) if supported(&v) => {}
            _ => return Some(Err(Unsupported::Version(version.to_owned()))),
        }
        Some(match interface {
            "log" => Ok(Interface::Log),
            "types" => Ok(Interface::Types),
            "sysfs" => Ok(Interface::Sysfs),
            "devnodes" => Ok(Interface::Devnodes),
            "nvml" => Ok(Interface::Nvml),
            "schedule" => Ok(Interface::Schedule),
            "plugin" => Ok(Interface::Plugin),
            _ => Err(Unsupported::Interface),
        })
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn published_versions_match_and_later_or_other_lines_do_not() {
            assert_eq!(ours("devicelet:plugin/log@0.1.0"), Some(Ok(Interface::Log)));
            assert_eq!(
                ours("devicelet:plugin/nvml@0.1.1"),
                Some(Ok(Interface::Nvml))
            );
            assert_eq!(
                ours("devicelet:plugin/plugin@0.1.0"),
                Some(Ok(Interface::Plugin))
            );
            // 0.1.7 is semver-compatible with 0.1.1 but newer than anything this host speaks:
            // refused here, by name, rather than by wasmtime's link error later.
            for version in ["0.1.7", "0.2.0", "1.0.0", "0.1.1-rc.1", "", "0.1"] {
                assert_eq!(
                    ours(&format!("devicelet:plugin/sysfs@{version}")),
                    Some(Err(Unsupported::Version(version.into()))),
                    "{version}"
                );
            }
            assert_eq!(
                ours("devicelet:plugin/gpio@0.1.1"),
                Some(Err(Unsupported::Interface))
            );
            assert_eq!(ours("wasi:io/streams@0.2.0"), None);
            assert_eq!(
                ours("devicelet:plugin/schedule@0.1.2"),
                Some(Ok(Interface::Schedule))
            );
            assert_eq!(speaks(), "0.1.0 to 0.1.2");
        }

        #[test]
        fn bindings_are_generated_from_the_latest_frozen_folder() {
            let source = include_str!("bindings.rs");
            assert!(source.contains(&format!("path: \"../wit/v{LATEST}\"")));
            assert_eq!(PLUGIN, format!("devicelet:plugin/plugin@{LATEST}"));
        }

        /// A published version is never edited (a module built against it must keep loading):
        /// change the WIT by adding `wit/v<next>/`, then add its digest here.
        #[test]
        fn published_wit_is_never_edited() {
            use sha2::{Digest, Sha256};
            let frozen = [
                (
                    "0.1.0",
                    "d9e8e5a4d8302c6682c13f5769effc7f79b430d7f60d43281d2702e203e33e1a",
                ),
                (
                    "0.1.1",
                    "2a163c1e5958df90e77e92ba568cd065db9a0b5f52e74fc63bea9d779faeda2b",
                ),
                (
                    "0.1.2",
                    "08cee9dd5f8de457277f9d7b3e7dd809ea396bc57874ab06a0c68d79aa963a6d",
                ),
            ];
            let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../wit");
            assert_eq!(
                PUBLISHED.len(),
                frozen.len(),
                "a version folder without a digest here"
            );
            for (version, expected) in frozen {
                let path = root.join(format!("v{version}/plugin.wit"));
                let text =
                    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
                let actual = format!("{:x}", Sha256::digest(&text));
                assert_eq!(
                    actual,
                    expected,
                    "{} was edited after it was published",
                    path.display()
                );
            }
        }
    }
}

impl From<wit::ResourceInfo> for ResourceInfo {
    fn from(r: wit::ResourceInfo) -> Self {
        ResourceInfo {
            name: r.name,
            prestart: r.prestart,
            preferred_allocation: r.preferred_allocation,
        }
    }
}

impl From<wit::Health> for Health {
    fn from(h: wit::Health) -> Self {
        match h {
            wit::Health::Healthy => Health::Healthy,
            wit::Health::Unhealthy => Health::Unhealthy,
        }
    }
}

impl From<wit::Device> for Device {
    fn from(d: wit::Device) -> Self {
        Device {
            id: d.id,
            health: d.health.into(),
            numa_nodes: d.numa_nodes,
            attributes: d.attributes,
        }
    }
}

impl From<wit::ContainerEdits> for ContainerEdits {
    fn from(e: wit::ContainerEdits) -> Self {
        ContainerEdits {
            envs: e.envs,
            mounts: e
                .mounts
                .into_iter()
                .map(|m| Mount {
                    container_path: m.container_path,
                    host_path: m.host_path,
                    read_only: m.read_only,
                })
                .collect(),
            devices: e
                .devices
                .into_iter()
                .map(|d| DeviceNode {
                    container_path: d.container_path,
                    host_path: d.host_path,
                    permissions: d.permissions,
                    file: None,
                })
                .collect(),
            annotations: e.annotations,
            cdi_devices: e.cdi_devices,
        }
    }
}

impl From<wit::PluginError> for PluginError {
    fn from(e: wit::PluginError) -> Self {
        match e {
            wit::PluginError::InvalidConfig(m) => PluginError::InvalidConfig(m),
            wit::PluginError::UnknownResource(m) => PluginError::UnknownResource(m),
            wit::PluginError::UnknownDevice(m) => PluginError::UnknownDevice(m),
            wit::PluginError::Failed(m) => PluginError::Failed(m),
        }
    }
}
