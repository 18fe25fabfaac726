//! The scenario tests, one file per concern, linked into one test binary: each file alone was a
//! binary linking the whole agent (25 links per change), and run one after another their waits
//! never overlapped. Run one file's scenarios with `cargo test --test scenarios <file>::`.
//! libtest starts them in name order: a scenario that waits long (`hostile_registry`'s 30 s
//! request deadline) belongs in a file named early in it, or the run ends waiting on it alone.
//! `fake_nvml.rs` stays a binary of its own: it points the process's environment at its fixture.

mod agent_restart;
mod amd_gpu;
mod cdi;
mod compile_cache;
mod container_image;
mod deploy_manifests;
mod documentation;
mod dra;
mod dra_advanced;
mod dra_modules;
mod guest_bindings;
mod hostile_modules;
mod hostile_registry;
mod lifecycle;
mod local_trust;
mod metrics;
mod misbehaving_modules;
mod module_cells;
mod nvidia_dra;
mod nvidia_gpu;
mod oci_modules;
mod plugin_watcher;
mod registry_errors;
mod simulate_dra;
mod try_module;
mod vfio_pci;
mod walking_skeleton;
mod wit_0_2;
mod wit_versions;
