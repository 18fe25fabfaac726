//! What a container runtime makes of CDI names: specs read and validated by the CDI crate, names
//! resolved, edits applied as a runtime applies them.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use container_device_interface as cdi_crate;
use devicelet::kubelet::api::deviceplugin::ContainerAllocateResponse;

/// What a container gets: env, device nodes (container path, host path, permissions), mounts
/// (container path, host path, read-only).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Container {
    pub envs: BTreeMap<String, String>,
    pub nodes: BTreeSet<(String, String, String)>,
    pub mounts: BTreeSet<(String, String, bool)>,
}

impl Container {
    /// The part of an Allocate answer that lists edits (the `devices` strategy).
    pub fn listed(r: &ContainerAllocateResponse) -> Container {
        Container {
            envs: r.envs.clone().into_iter().collect(),
            nodes: r
                .devices
                .iter()
                .map(|d| {
                    (
                        d.container_path.clone(),
                        d.host_path.clone(),
                        d.permissions.clone(),
                    )
                })
                .collect(),
            mounts: r
                .mounts
                .iter()
                .map(|m| (m.container_path.clone(), m.host_path.clone(), m.read_only))
                .collect(),
        }
    }

    /// Applies CDI container edits, read back as JSON (the crate keeps their fields private).
    pub fn apply(&mut self, edits: &cdi_crate::specs::config::ContainerEdits) {
        let edits = serde_json::to_value(edits).expect("edits serialise");
        for env in edits["env"].as_array().into_iter().flatten() {
            let (k, v) = env.as_str().unwrap().split_once('=').expect("KEY=value");
            self.envs.insert(k.into(), v.into());
        }
        for n in edits["deviceNodes"].as_array().into_iter().flatten() {
            let path = n["path"].as_str().unwrap().to_owned();
            let host = n["hostPath"].as_str().unwrap_or(&path).to_owned();
            let permissions = n["permissions"].as_str().unwrap_or_default().to_owned();
            self.nodes.insert((path, host, permissions));
        }
        for m in edits["mounts"].as_array().into_iter().flatten() {
            let options: Vec<&str> = m["options"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|o| o.as_str())
                .collect();
            self.mounts.insert((
                m["containerPath"].as_str().unwrap().into(),
                m["hostPath"].as_str().unwrap().into(),
                options.contains(&"ro"),
            ));
        }
    }
}

/// Resolves fully qualified CDI names as a runtime does: every spec in `dir` read and validated
/// (a single invalid spec fails the test), each name looked up, each spec's own edits applied
/// once, then each device's.
pub fn resolve(dir: &Path, names: &[String]) -> Container {
    let mut cache = cdi_crate::cache::Cache::default();
    cdi_crate::spec_dirs::with_spec_dirs(&[dir.to_str().unwrap()])(&mut cache);
    cache
        .refresh()
        .unwrap_or_else(|e| panic!("the CDI specs in {} are invalid: {e}", dir.display()));
    let mut container = Container::default();
    let mut specs_applied = BTreeSet::new();
    for name in names {
        let device = cache
            .get_device(name)
            .unwrap_or_else(|| panic!("{name} is in no spec"))
            .clone();
        let mut spec = device.get_spec();
        if specs_applied.insert(spec.get_path())
            && let Some(edits) = spec.edits()
        {
            container.apply(&edits.container_edits);
        }
        container.apply(&device.edits().container_edits);
    }
    container
}
