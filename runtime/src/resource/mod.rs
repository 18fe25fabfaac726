//! The resource core: what serving one resource means whatever API serves it. The backend seam
//! ([`backend::DeviceBackend`], implemented by the sandbox), the device watcher that turns
//! enumerations into [`snapshot`]s with health ([`health`]), and the Allocate answers prepared
//! ahead of time ([`prepared`]), held as the host's own `device::ContainerEdits`. Nothing here
//! names a kubelet wire type or wasmtime: the device-plugin front end (`kubelet/`) and a second
//! front end would both be built on these.

pub mod advertised;
pub mod backend;
pub mod core;
pub mod health;
pub mod prepared;
pub mod snapshot;

#[cfg(test)]
mod tests {
    use std::path::Path;

    /// Lines of non-test code, in the top-level folders of `src/` that `folder` accepts (files
    /// directly in `src/` have folder ""), that contain one of `patterns`.
    fn lines_naming(folder: impl Fn(&str) -> bool, patterns: &[&str]) -> Vec<String> {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut found = Vec::new();
        let mut dirs = vec![src.clone()];
        while let Some(dir) = dirs.pop() {
            for entry in std::fs::read_dir(&dir).unwrap() {
                let path = entry.unwrap().path();
                let rel = path
                    .strip_prefix(&src)
                    .unwrap()
                    .to_string_lossy()
                    .into_owned();
                if path.is_dir() {
                    dirs.push(path);
                    continue;
                }
                let top = rel.split_once('/').map_or("", |(top, _)| top);
                if !folder(top) || rel.ends_with("tests.rs") {
                    continue;
                }
                let text = std::fs::read_to_string(&path).unwrap();
                let code = text.split("#[cfg(test)]").next().unwrap_or_default();
                for (n, line) in code.lines().enumerate() {
                    let comment = line.trim_start().starts_with("//");
                    if !comment && patterns.iter().any(|p| line.contains(p)) {
                        found.push(format!("{rel}:{}: {}", n + 1, line.trim()));
                    }
                }
            }
        }
        found
    }

    /// The kubelet's wire types stay in the front ends (`kubelet/` for the device plugin, `dra/`
    /// for DRA) and the command line that drives the kubelet simulator (`cli/`): the core, the
    /// sandbox, the ledger, CDI and the policies are written against the host's own types, so
    /// both front ends reuse them as they are. Test code may build wire values to feed a front
    /// end's conversion.
    #[test]
    fn no_kubelet_wire_type_outside_the_front_ends() {
        let wire = [
            "api::deviceplugin",
            "api::podresources",
            "api::pluginregistration",
            "api::dra",
        ];
        let front_ends = ["kubelet", "dra", "cli", "plugin_socket"];
        let found = lines_naming(|top| !front_ends.contains(&top), &wire);
        assert!(
            found.is_empty(),
            "wire types outside the front ends, the socket layer and cli/:\n{}",
            found.join("\n")
        );
    }

    /// The two front ends stand side by side on the core and the socket layer: neither reaches
    /// into the other, so either can change, or a third join them, without touching the other.
    #[test]
    fn the_front_ends_import_neither_each_other() {
        let dra_into_kubelet = lines_naming(
            |top| top == "dra",
            &["crate::kubelet", "super::super::kubelet"],
        );
        let kubelet_into_dra =
            lines_naming(|top| top == "kubelet", &["crate::dra", "super::super::dra"]);
        assert!(
            dra_into_kubelet.is_empty() && kubelet_into_dra.is_empty(),
            "front ends reaching into each other:\n{}",
            [dra_into_kubelet, kubelet_into_dra].concat().join("\n")
        );
    }

    /// The registry parses into plain values: `config/` knows no subsystem that acts on them, so
    /// a subsystem can change without the registry's parser changing with it.
    #[test]
    fn config_imports_no_subsystem() {
        let subsystems = [
            "crate::oci",
            "crate::cdi",
            "crate::policy",
            "crate::dra",
            "crate::kubelet",
            "crate::sandbox",
            "crate::agent",
            "crate::resource",
            "crate::ledger",
        ];
        let found = lines_naming(|top| top == "config", &subsystems);
        assert!(
            found.is_empty(),
            "config/ importing a subsystem:\n{}",
            found.join("\n")
        );
    }

    /// WebAssembly stays in the sandbox (and the agent that starts it): the core and the front
    /// ends serve whatever implements the backend trait.
    #[test]
    fn no_wasmtime_in_the_core_or_the_front_end() {
        let core = [
            "resource", "kubelet", "dra", "ledger", "cdi", "policy", "nvml", "config", "metrics",
        ];
        let found = lines_naming(|top| core.contains(&top), &["wasmtime"]);
        assert!(
            found.is_empty(),
            "wasmtime outside the sandbox:\n{}",
            found.join("\n")
        );
    }
}
