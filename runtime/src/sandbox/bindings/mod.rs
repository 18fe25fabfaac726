//! The host/guest seam: the WIT world's generated bindings, one module per line of the WIT
//! package (`v0_1`, `v0_2`, `v0_3`), each converting into the host's own types, and [`Plugin`], the one
//! type the rest of the host calls a module through. A new line gets a sibling module here and a
//! variant in `plugin.rs`; nothing else in the host matches on versions.

/// `From` the line's container edits and plugin errors (the same records in every line) into
/// the host's, for the line's `wit` types module.
macro_rules! edits_and_errors_from {
    ($wit:ident) => {
        impl From<$wit::ContainerEdits> for crate::device::ContainerEdits {
            fn from(e: $wit::ContainerEdits) -> Self {
                crate::device::ContainerEdits {
                    envs: e.envs,
                    mounts: e
                        .mounts
                        .into_iter()
                        .map(|m| crate::device::Mount {
                            container_path: m.container_path,
                            host_path: m.host_path,
                            read_only: m.read_only,
                        })
                        .collect(),
                    devices: e
                        .devices
                        .into_iter()
                        .map(|d| crate::device::DeviceNode {
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

        impl From<$wit::PluginError> for crate::device::PluginError {
            fn from(e: $wit::PluginError) -> Self {
                use crate::device::PluginError;
                match e {
                    $wit::PluginError::InvalidConfig(m) => PluginError::InvalidConfig(m),
                    $wit::PluginError::UnknownResource(m) => PluginError::UnknownResource(m),
                    $wit::PluginError::UnknownDevice(m) => PluginError::UnknownDevice(m),
                    $wit::PluginError::Failed(m) => PluginError::Failed(m),
                }
            }
        }
    };
}

mod plugin;
pub mod v0_1;
pub mod v0_2;
pub mod v0_3;

/// A module's own version as operators are shown it: printable ASCII, bounded.
fn printable_version(version: String) -> String {
    if version.len() <= 64 && version.bytes().all(|b| b.is_ascii_graphic()) {
        version
    } else {
        "(not printable)".to_owned()
    }
}

pub use plugin::{Answer, Plugin, PluginPre};

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
        /// Added in 0.3.1: making and destroying MIG instances.
        Mig,
        /// The export every module must have.
        Plugin,
        /// Optional exports, since 0.2.0.
        Release,
        Config,
        /// Optional export, since 0.3.0.
        Claims,
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

    /// The published versions, parsed.
    fn published() -> impl Iterator<Item = Version> {
        PUBLISHED.iter().filter_map(|v| Version::parse(v).ok())
    }

    /// Each line's oldest and newest published version, oldest line first.
    fn lines() -> Vec<(Version, Version)> {
        let mut lines: Vec<(Version, Version)> = Vec::new();
        for v in published() {
            match lines
                .iter_mut()
                .find(|(oldest, _)| line(oldest) == line(&v))
            {
                Some((oldest, newest)) => {
                    if v < *oldest {
                        *oldest = v;
                    } else if v > *newest {
                        *newest = v;
                    }
                }
                None => lines.push((v.clone(), v)),
            }
        }
        lines.sort();
        lines
    }

    /// The versions a module may be built against, as the operator reads it:
    /// `0.1.0 to 0.1.2, 0.2.0`. Per line, its oldest published version through its newest: a
    /// minor version only adds, and wasmtime's linker resolves an older `@0.1.x` import to the
    /// host's newer definition.
    pub fn speaks() -> String {
        let spans: Vec<String> = lines()
            .into_iter()
            .map(|(oldest, newest)| {
                if oldest == newest {
                    newest.to_string()
                } else {
                    format!("{oldest} to {newest}")
                }
            })
            .collect();
        spans.join(", ")
    }

    /// Whether a module built against `version` links with this host: on a published line, no
    /// newer than that line's newest version, no older than its first. Build metadata (`+...`)
    /// says nothing about the interface and is ignored; a pre-release is refused.
    pub fn supported(version: &Version) -> bool {
        let mut version = version.clone();
        version.build = semver::BuildMetadata::EMPTY;
        version.pre.is_empty()
            && lines().iter().any(|(oldest, newest)| {
                line(&version) == line(oldest) && version >= *oldest && version <= *newest
            })
    }

    /// The name each line's newest version gives host interface `interface`
    /// (`devicelet:plugin/log@0.1.2`, `devicelet:plugin/log@0.2.0`): the host defines it under
    /// every one, since every line has the same host interfaces.
    pub fn host_names(interface: &str) -> Vec<String> {
        lines()
            .into_iter()
            .map(|(_, newest)| format!("devicelet:plugin/{interface}@{newest}"))
            .collect()
    }

    /// The version that added `mig`: the host defines it on that line only.
    const MIG_SINCE: Version = Version::new(0, 3, 1);

    /// Like [`host_names`], for `mig`: only the lines that have it.
    pub fn mig_host_names() -> Vec<String> {
        lines()
            .into_iter()
            .filter(|(_, newest)| line(newest) == line(&MIG_SINCE) && *newest >= MIG_SINCE)
            .map(|(_, newest)| format!("devicelet:plugin/mig@{newest}"))
            .collect()
    }

    /// Which of our interfaces `name` (an import or export name) is: None when it is not a
    /// `devicelet:plugin` name at all.
    pub fn ours(name: &str) -> Option<Result<Interface, Unsupported>> {
        let rest = name.strip_prefix("devicelet:plugin/")?;
        let (interface, version) = rest.split_once('@').unwrap_or((rest, ""));
        let parsed = match Version::parse(version) {
            Ok(v) if supported(&v) => v,
            _ => return Some(Err(Unsupported::Version(version.to_owned()))),
        };
        Some(match interface {
            "log" => Ok(Interface::Log),
            "types" => Ok(Interface::Types),
            "sysfs" => Ok(Interface::Sysfs),
            "devnodes" => Ok(Interface::Devnodes),
            "nvml" => Ok(Interface::Nvml),
            "schedule" => Ok(Interface::Schedule),
            "mig" if line(&parsed) == line(&MIG_SINCE) && parsed >= MIG_SINCE => Ok(Interface::Mig),
            "plugin" => Ok(Interface::Plugin),
            "release" => Ok(Interface::Release),
            "config" => Ok(Interface::Config),
            "claims" => Ok(Interface::Claims),
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
            for version in [
                "0.1.7",
                "0.2.1",
                "0.3.2",
                "0.4.0",
                "1.0.0",
                "0.1.1-rc.1",
                "",
                "0.1",
            ] {
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
            assert_eq!(
                ours("devicelet:plugin/plugin@0.2.0"),
                Some(Ok(Interface::Plugin))
            );
            assert_eq!(
                ours("devicelet:plugin/release@0.2.0"),
                Some(Ok(Interface::Release))
            );
            assert_eq!(
                ours("devicelet:plugin/claims@0.3.0"),
                Some(Ok(Interface::Claims))
            );
            assert_eq!(speaks(), "0.1.0 to 0.1.2, 0.2.0, 0.3.0 to 0.3.1");
            assert_eq!(
                host_names("nvml"),
                [
                    "devicelet:plugin/nvml@0.1.2",
                    "devicelet:plugin/nvml@0.2.0",
                    "devicelet:plugin/nvml@0.3.1"
                ]
            );
            // `mig` exists from 0.3.1 on, on its line only.
            assert_eq!(mig_host_names(), ["devicelet:plugin/mig@0.3.1"]);
            assert_eq!(ours("devicelet:plugin/mig@0.3.1"), Some(Ok(Interface::Mig)));
            for older in ["0.3.0", "0.2.0", "0.1.2"] {
                assert_eq!(
                    ours(&format!("devicelet:plugin/mig@{older}")),
                    Some(Err(Unsupported::Interface)),
                    "{older}"
                );
            }
        }

        /// Each line's bindings come from its newest frozen folder.
        #[test]
        fn bindings_are_generated_from_each_lines_newest_frozen_folder() {
            let sources = [
                include_str!("v0_1.rs"),
                include_str!("v0_2.rs"),
                include_str!("v0_3.rs"),
            ];
            for (_, newest) in lines() {
                let path = format!("path: \"../wit/v{newest}\"");
                assert!(sources.iter().any(|s| s.contains(&path)), "{path}");
            }
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
                (
                    "0.2.0",
                    "6b46bf739c470938674c58617cc89d6ac747e612cf36de5552966aae460ae267",
                ),
                (
                    "0.3.0",
                    "602a7ed76abf0fbf159af2c3d52466b3f430b6d02cb3609b101f9e1e47592e48",
                ),
                (
                    "0.3.1",
                    "6d7325f29c4071389226e6953483b36a6de444f2558cb71ffd1014c0f489c672",
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
