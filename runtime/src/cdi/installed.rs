//! The CDI devices other tools installed on this node (the NVIDIA Container Toolkit's
//! `nvidia-ctk cdi generate`, a vendor's own spec): what a module's own CDI names must resolve
//! to, or the runtime refuses the container. `validate` reads them to check those names before a
//! pod finds out.

use std::collections::BTreeSet;
use std::io::Read;
use std::path::{Path, PathBuf};

use serde::Deserialize;

/// Where container runtimes look for CDI specs by default: static specs, then transient ones.
pub const SPEC_DIRS: [&str; 2] = ["/etc/cdi", "/var/run/cdi"];

/// A spec file bigger than this is not read (nvidia-ctk's for 8 GPUs is tens of KiB).
const MAX_SPEC: u64 = 16 << 20;

#[derive(Deserialize)]
struct SpecFile {
    kind: String,
    #[serde(default)]
    devices: Vec<Named>,
}

#[derive(Deserialize)]
struct Named {
    name: String,
}

/// The fully qualified device names (`vendor.com/class=name`) the specs in some directories
/// define, and the files that could not be read.
#[derive(Debug, Default)]
pub struct Installed {
    pub dirs: Vec<PathBuf>,
    names: BTreeSet<String>,
    /// One line per spec file that could not be read or parsed.
    pub problems: Vec<String>,
}

impl Installed {
    /// Reads every `.json` and `.yaml` spec in `dirs` (a directory that does not exist has none).
    pub fn read(dirs: &[PathBuf]) -> Installed {
        let mut installed = Installed {
            dirs: dirs.to_vec(),
            ..Installed::default()
        };
        for dir in dirs {
            let Ok(entries) = std::fs::read_dir(dir) else {
                continue;
            };
            let mut files: Vec<PathBuf> = entries
                .flatten()
                .map(|e| e.path())
                .filter(|p| {
                    p.extension()
                        .is_some_and(|e| e == "json" || e == "yaml" || e == "yml")
                })
                .collect();
            files.sort();
            for file in files {
                if let Err(e) = installed.add(&file) {
                    installed.problems.push(format!("{}: {e}", file.display()));
                }
            }
        }
        installed
    }

    fn add(&mut self, file: &Path) -> Result<(), String> {
        let mut text = String::new();
        std::fs::File::open(file)
            .and_then(|f| f.take(MAX_SPEC + 1).read_to_string(&mut text))
            .map_err(|e| e.to_string())?;
        if text.len() as u64 > MAX_SPEC {
            return Err(format!("larger than {} MiB, not read", MAX_SPEC >> 20));
        }
        // YAML 1.2 reads JSON as well.
        let spec: SpecFile = serde_yaml_ng::from_str(&text).map_err(|e| e.to_string())?;
        for device in spec.devices {
            self.names.insert(format!("{}={}", spec.kind, device.name));
        }
        Ok(())
    }

    pub fn contains(&self, qualified: &str) -> bool {
        self.names.contains(qualified)
    }

    pub fn len(&self) -> usize {
        self.names.len()
    }

    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn yaml_and_json_specs_are_read_and_broken_ones_reported() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("nvidia.yaml"),
            "cdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices:\n- name: GPU-1\n  containerEdits:\n    deviceNodes:\n    - path: /dev/nvidia0\n- name: all\n  containerEdits: {}\ncontainerEdits: {}\n",
        )
        .unwrap();
        std::fs::write(
            dir.path().join("vendor.json"),
            r#"{"cdiVersion": "0.6.0", "kind": "vendor.com/fpga", "devices": [{"name": "0", "containerEdits": {}}]}"#,
        )
        .unwrap();
        std::fs::write(dir.path().join("broken.yaml"), "kind: [").unwrap();
        std::fs::write(dir.path().join("notes.txt"), "not a spec").unwrap();
        let missing = dir.path().join("missing");
        let installed = Installed::read(&[dir.path().to_owned(), missing]);
        assert!(installed.contains("nvidia.com/gpu=GPU-1"));
        assert!(installed.contains("nvidia.com/gpu=all"));
        assert!(installed.contains("vendor.com/fpga=0"));
        assert!(!installed.contains("nvidia.com/gpu=GPU-2"));
        assert_eq!(installed.len(), 3);
        assert_eq!(installed.problems.len(), 1, "{:?}", installed.problems);
        assert!(installed.problems[0].contains("broken.yaml"));
    }
}
