//! From the module's answer for each device alone to a spec: the edits every device shares
//! lifted to the top, the rest per device; and the [`View`] Allocate checks its answers against.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use super::spec::{self, Spec, SpecDevice};
use super::writer::FileId;
use crate::device::{ContainerEdits, NodeFile, NodeKind};

/// A device node as a container gets it: container path, host path, cgroup permissions, and the
/// node itself (kind, numbers, mode, owner) as the host checked it.
type Node = (String, String, String, Option<NodeFile>);

/// What an answer does to a container, as sets: the same container whatever the order the
/// module listed things in, or however often.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Edits {
    envs: BTreeMap<String, String>,
    /// Container path, host path, read-only.
    mounts: BTreeSet<(String, String, bool)>,
    nodes: BTreeSet<Node>,
}

impl Edits {
    /// The part of an Allocate answer a CDI spec can carry (annotations and the module's own CDI
    /// names stay in the answer).
    pub fn of(answer: &ContainerEdits) -> Edits {
        Edits {
            envs: answer.envs.iter().cloned().collect(),
            mounts: answer
                .mounts
                .iter()
                .map(|m| (m.container_path.clone(), m.host_path.clone(), m.read_only))
                .collect(),
            nodes: answer
                .devices
                .iter()
                .map(|d| {
                    (
                        d.container_path.clone(),
                        d.host_path.clone(),
                        d.permissions.clone(),
                        d.file,
                    )
                })
                .collect(),
        }
    }

    /// Adds `other`'s edits, as a runtime applying both would; false when both set one
    /// variable to different values (the container would depend on the order).
    fn add(&mut self, other: &Edits) -> bool {
        for (k, v) in &other.envs {
            match self.envs.get(k) {
                Some(had) if had != v => return false,
                Some(_) => {}
                None => {
                    self.envs.insert(k.clone(), v.clone());
                }
            }
        }
        self.mounts.extend(other.mounts.iter().cloned());
        self.nodes.extend(other.nodes.iter().cloned());
        true
    }

    fn is_empty(&self) -> bool {
        self.envs.is_empty() && self.mounts.is_empty() && self.nodes.is_empty()
    }

    /// What `self` and `other` both hold.
    fn common(&self, other: &Edits) -> Edits {
        Edits {
            envs: self
                .envs
                .iter()
                .filter(|(k, v)| other.envs.get(*k) == Some(v))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            mounts: self.mounts.intersection(&other.mounts).cloned().collect(),
            nodes: self.nodes.intersection(&other.nodes).cloned().collect(),
        }
    }

    fn without(&self, common: &Edits) -> Edits {
        Edits {
            envs: self
                .envs
                .iter()
                .filter(|(k, v)| common.envs.get(*k) != Some(v))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            mounts: self.mounts.difference(&common.mounts).cloned().collect(),
            nodes: self.nodes.difference(&common.nodes).cloned().collect(),
        }
    }

    fn to_spec(&self) -> spec::Edits {
        spec::Edits {
            env: self.envs.iter().map(|(k, v)| format!("{k}={v}")).collect(),
            device_nodes: self
                .nodes
                .iter()
                .map(|(path, host, permissions, file)| spec::DeviceNode {
                    path: path.clone(),
                    host_path: (host != path).then(|| host.clone()),
                    permissions: (!permissions.is_empty()).then(|| permissions.clone()),
                    kind: file.map(|f| match f.kind {
                        NodeKind::Char => "c",
                        NodeKind::Block => "b",
                    }),
                    major: file.map(|f| f.major),
                    minor: file.map(|f| f.minor),
                    file_mode: file.map(|f| f.mode),
                    uid: file.map(|f| f.uid),
                    gid: file.map(|f| f.gid),
                })
                .collect(),
            mounts: self
                .mounts
                .iter()
                .map(|(container, host, read_only)| spec::Mount {
                    host_path: host.clone(),
                    container_path: container.clone(),
                    options: vec!["rbind".into(), if *read_only { "ro" } else { "rw" }.into()],
                })
                .collect(),
        }
    }
}

/// A written spec, as Allocate consults it: which devices it names and what each gives a
/// container, and which file on disk holds it.
#[derive(Debug)]
pub struct View {
    kind: String,
    /// Where the spec is, and the file written there: a device is named only while it is still
    /// that file.
    path: std::path::PathBuf,
    file: Option<FileId>,
    common: Edits,
    /// By physical device ID: its own edits, and the answer they came from.
    devices: HashMap<String, (Edits, Arc<ContainerEdits>)>,
}

impl View {
    pub fn kind(&self) -> &str {
        &self.kind
    }

    /// This view, of the spec written to `path` as `file`.
    pub fn at(mut self, path: &std::path::Path, file: FileId) -> View {
        self.path = path.to_owned();
        self.file = Some(file);
        self
    }

    /// Whether the file at the spec's path is still the one written (one `stat`).
    pub fn on_disk(&self) -> bool {
        self.file.is_some_and(|f| f.is_at(&self.path))
    }

    pub fn len(&self) -> usize {
        self.devices.len()
    }

    pub fn is_empty(&self) -> bool {
        self.devices.is_empty()
    }

    /// Whether a runtime applying the spec's devices `ids` (physical, each once) gives a
    /// container exactly what `answer` (the module's answer for those devices) does.
    pub fn covers(&self, ids: &[&str], answer: &ContainerEdits) -> bool {
        if ids.is_empty() {
            // Nothing to name (the kubelet never asks for nothing; an empty annotation would not
            // parse).
            return false;
        }
        if let [id] = ids {
            // The usual case, answered from the answer the spec was built from.
            if let Some((_, source)) = self.devices.get(*id)
                && source.envs == answer.envs
                && source.mounts == answer.mounts
                && source.devices == answer.devices
            {
                return true;
            }
        }
        let mut applied = self.common.clone();
        for id in ids {
            let Some((edits, _)) = self.devices.get(*id) else {
                return false;
            };
            if !applied.add(edits) {
                return false;
            }
        }
        applied == Edits::of(answer)
    }

    /// The fully qualified CDI name of a device.
    pub fn name(&self, id: &str) -> String {
        format!("{}={id}", self.kind)
    }
}

/// The spec for `kind` from each physical device's own answer, with the edits every device
/// shares (when there are several) lifted into the top-level `containerEdits`, unless that would
/// leave a device with no edits of its own (CDI refuses such a device). Devices whose ID is not
/// a CDI device name, or whose answer holds nothing a spec can carry, are left out. None when no
/// device is left.
pub fn build(kind: &str, answers: &BTreeMap<String, Arc<ContainerEdits>>) -> Option<(Spec, View)> {
    let edits: Vec<(&String, Edits, &Arc<ContainerEdits>)> = answers
        .iter()
        .filter(|(id, _)| spec::is_device_name(id))
        .map(|(id, answer)| (id, Edits::of(answer), answer))
        .filter(|(_, e, _)| !e.is_empty())
        .collect();
    let common = match edits.as_slice() {
        [] => return None,
        [_] => Edits::default(),
        [(_, first, _), rest @ ..] => rest
            .iter()
            .fold(first.clone(), |common, (_, e, _)| common.common(e)),
    };
    let common = if edits.iter().any(|(_, e, _)| e.without(&common).is_empty()) {
        Edits::default()
    } else {
        common
    };
    let mut devices = Vec::with_capacity(edits.len());
    let mut view = HashMap::with_capacity(edits.len());
    for (id, e, answer) in edits {
        let own = e.without(&common);
        devices.push(SpecDevice {
            name: id.clone(),
            container_edits: own.to_spec(),
        });
        view.insert(id.clone(), (own, answer.clone()));
    }
    let container_edits = common.to_spec();
    let spec = Spec {
        version: spec::required_version(&devices, &container_edits),
        kind: kind.to_owned(),
        devices,
        container_edits,
    };
    Some((
        spec,
        View {
            kind: kind.to_owned(),
            path: std::path::PathBuf::new(),
            file: None,
            common,
            devices: view,
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(node: &str, envs: &[(&str, &str)]) -> ContainerEdits {
        let device = |path: &str, minor| crate::device::DeviceNode {
            container_path: path.into(),
            host_path: path.into(),
            permissions: "rw".into(),
            file: Some(NodeFile {
                kind: NodeKind::Char,
                major: 195,
                minor,
                mode: 0o660,
                uid: 0,
                gid: 44,
            }),
        };
        ContainerEdits {
            envs: envs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            devices: vec![device(node, 0), device("/dev/ctl", 255)],
            ..Default::default()
        }
    }

    fn answers() -> BTreeMap<String, Arc<ContainerEdits>> {
        [
            (
                "gpu0",
                answer("/dev/gpu0", &[("VISIBLE", "0"), ("DRIVER", "x")]),
            ),
            (
                "gpu1",
                answer("/dev/gpu1", &[("VISIBLE", "1"), ("DRIVER", "x")]),
            ),
        ]
        .map(|(id, a)| (id.to_string(), Arc::new(a)))
        .into()
    }

    #[test]
    fn what_every_device_needs_is_lifted_to_the_top() {
        let (spec, _) = build("a.com/gpu", &answers()).unwrap();
        assert_eq!(spec.container_edits.env, ["DRIVER=x"]);
        assert_eq!(spec.container_edits.device_nodes.len(), 1);
        assert_eq!(spec.container_edits.device_nodes[0].path, "/dev/ctl");
        let gpu0 = &spec.devices[0];
        assert_eq!(gpu0.name, "gpu0");
        assert_eq!(gpu0.container_edits.env, ["VISIBLE=0"]);
        assert_eq!(gpu0.container_edits.device_nodes[0].path, "/dev/gpu0");
        assert_eq!(gpu0.container_edits.device_nodes[0].host_path, None);
        assert_eq!(spec.version, "0.3.0");
    }

    #[test]
    fn device_nodes_carry_the_host_nodes_kind_numbers_mode_and_owner() {
        let (spec, view) = build("a.com/gpu", &answers()).unwrap();
        let node = &spec.devices[0].container_edits.device_nodes[0];
        assert_eq!(
            (
                node.kind,
                node.major,
                node.minor,
                node.file_mode,
                node.uid,
                node.gid
            ),
            (
                Some("c"),
                Some(195),
                Some(0),
                Some(0o660),
                Some(0),
                Some(44)
            )
        );
        // The same paths with another mode are another container: not covered.
        let mut changed = answer("/dev/gpu0", &[("VISIBLE", "0"), ("DRIVER", "x")]);
        if let Some(file) = changed.devices[0].file.as_mut() {
            file.mode = 0o666;
        }
        assert!(!view.covers(&["gpu0"], &changed));
    }

    #[test]
    fn a_lone_device_keeps_its_edits() {
        let one: BTreeMap<_, _> = answers().into_iter().take(1).collect();
        let (spec, _) = build("a.com/gpu", &one).unwrap();
        assert!(spec.container_edits.is_empty());
        assert_eq!(spec.devices[0].container_edits.device_nodes.len(), 2);
    }

    #[test]
    fn an_answer_is_covered_only_when_the_spec_gives_the_same_container() {
        let (_, view) = build("a.com/gpu", &answers()).unwrap();
        assert!(view.covers(
            &["gpu0"],
            &answer("/dev/gpu0", &[("VISIBLE", "0"), ("DRIVER", "x")])
        ));
        // Both devices set VISIBLE: applying both specs would depend on the order.
        let both = answer("/dev/gpu0", &[("VISIBLE", "0,1"), ("DRIVER", "x")]);
        assert!(!view.covers(&["gpu0", "gpu1"], &both));
        assert!(!view.covers(&["gpu0"], &answer("/dev/gpu0", &[("VISIBLE", "0")])));
        assert!(!view.covers(&["gpu2"], &answer("/dev/gpu2", &[])));
    }

    #[test]
    fn several_devices_are_covered_when_the_answer_is_the_sum_of_theirs() {
        let mut plain = answers();
        for a in plain.values_mut() {
            Arc::make_mut(a).envs.retain(|(k, _)| k != "VISIBLE");
        }
        let (_, view) = build("a.com/gpu", &plain).unwrap();
        let mut both = answer("/dev/gpu0", &[("DRIVER", "x")]);
        both.devices.extend(answer("/dev/gpu1", &[]).devices);
        assert!(view.covers(&["gpu0", "gpu1"], &both));
    }

    #[test]
    fn nothing_is_lifted_that_would_leave_a_device_with_no_edits() {
        let same: BTreeMap<_, _> = [
            ("fuse-0".to_string(), Arc::new(answer("/dev/fuse", &[]))),
            ("fuse-1".to_string(), Arc::new(answer("/dev/fuse", &[]))),
        ]
        .into();
        let (spec, view) = build("a.com/fuse", &same).unwrap();
        assert!(spec.container_edits.is_empty());
        assert!(spec.devices.iter().all(|d| !d.container_edits.is_empty()));
        let mut both = answer("/dev/fuse", &[]);
        both.devices.extend(answer("/dev/fuse", &[]).devices);
        assert!(view.covers(&["fuse-0", "fuse-1"], &both));
        let empty: BTreeMap<_, _> = [("x".to_string(), Arc::default())].into();
        assert!(
            build("a.com/x", &empty).is_none(),
            "an empty device is left out"
        );
    }

    #[test]
    fn ids_that_are_not_cdi_names_are_left_out() {
        let odd: BTreeMap<_, _> = [("a/b".to_string(), Arc::new(answer("/dev/x", &[])))].into();
        assert!(build("a.com/gpu", &odd).is_none());
    }
}
