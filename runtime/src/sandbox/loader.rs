//! Turning a registry entry into something that can be instantiated: read, compile, check the
//! imports against the grants, link only what is granted.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use wasmtime::Engine;
use wasmtime::component::{Component, Linker};

use super::bindings::PluginPre;
use super::bindings::imports;
use super::cache::CompileCache;
use super::error::LoadError;
use super::host::HostState;
use crate::config::{Grants, ModuleSpec};
use crate::digest::sha256_hex;
use crate::nvml::{Libraries, NvmlNode};

/// A compiled, linked module, ready to be instantiated any number of times (once at start, again
/// after each crash).
#[derive(Clone)]
pub struct LoadedModule {
    pub(crate) name: Arc<str>,
    pub(crate) spec: Arc<ModuleSpec>,
    pub(crate) host_root: Arc<PathBuf>,
    pub(crate) grants: Arc<Grants>,
    pub(crate) pre: PluginPre,
    /// The log allowance all its instances share.
    pub(crate) output: Arc<crate::sandbox::host::OutputAllowance>,
    /// NVML as this node has it, for a module granted `nvml`.
    pub(crate) nvml: Option<Arc<NvmlNode>>,
    /// sha256 of the `.wasm` file, lowercase hex: tells a hot reload whether the file changed.
    pub digest: String,
    pub interface: ModuleInterface,
}

/// Compiling is CPU-bound (hundreds of milliseconds): call this from a blocking thread. With a
/// `cache`, a module compiled before (by this host, with the same engine settings) is loaded
/// precompiled instead; the registry's digest is checked before either. A module granted NVML
/// opens it from `libraries` here (once per process), which may take seconds on a sick node.
pub fn load(
    engine: &Engine,
    cache: Option<&CompileCache>,
    spec: &ModuleSpec,
    host_root: &std::path::Path,
    libraries: &Libraries,
) -> Result<LoadedModule, LoadError> {
    let file = read(spec)?;
    load_file(engine, cache, spec, host_root, libraries, file)
}

/// A module's file as [`load`] reads it, and its sha256.
pub struct ModuleFile {
    path: PathBuf,
    bytes: Vec<u8>,
    /// Lowercase hex.
    digest: String,
    /// Which file, in which state, was read: device, inode, size, modification and change
    /// times.
    identity: (u64, u64, u64, (i64, i64), (i64, i64)),
}

fn identity(meta: &std::fs::Metadata) -> (u64, u64, u64, (i64, i64), (i64, i64)) {
    use std::os::unix::fs::MetadataExt;
    let (mtime, ctime) = (
        (meta.mtime(), meta.mtime_nsec()),
        (meta.ctime(), meta.ctime_nsec()),
    );
    (meta.dev(), meta.ino(), meta.size(), mtime, ctime)
}

impl ModuleFile {
    /// Whether this is what reading `spec`'s file now would give: the same path, still naming
    /// the same file, unchanged since (a file replaced, e.g. a ConfigMap's link swapped, is a
    /// new inode; one written in place has new times). Blocking (a `stat`).
    pub fn is_current_for(&self, spec: &ModuleSpec) -> bool {
        self.path == spec.path
            && std::fs::metadata(&self.path).is_ok_and(|meta| identity(&meta) == self.identity)
    }
}

/// What [`load`] does first: reads `spec`'s file (a regular file, at most
/// [`crate::files::MAX_MODULE`]) and hashes it. The agent does it on a thread of its own while
/// the rest of its start-up runs, so that a module's start does not wait for it (about 0.4 ms of
/// sha256 for a 650 KB module, at every start: the digest keys the compile cache). Blocking.
pub fn read(spec: &ModuleSpec) -> Result<ModuleFile, LoadError> {
    let (bytes, meta) =
        crate::files::read_regular_with_metadata(&spec.path, crate::files::MAX_MODULE).map_err(
            |error| LoadError::Read {
                module: spec.name.clone(),
                path: spec.path.clone(),
                error,
            },
        )?;
    Ok(ModuleFile {
        path: spec.path.clone(),
        digest: sha256_hex(&bytes),
        bytes,
        identity: identity(&meta),
    })
}

/// [`load`] from a file already [`read`]: `spec`'s own, as it is now
/// ([`ModuleFile::is_current_for`]; a file read before an edit must not stand in for the edited
/// one).
pub fn load_file(
    engine: &Engine,
    cache: Option<&CompileCache>,
    spec: &ModuleSpec,
    host_root: &std::path::Path,
    libraries: &Libraries,
    file: ModuleFile,
) -> Result<LoadedModule, LoadError> {
    let module = spec.name.clone();
    let ModuleFile { bytes, digest, .. } = file;
    if let Some(expected) = &spec.sha256
        && &digest != expected
    {
        return Err(LoadError::Digest {
            module: module.clone(),
            path: spec.path.clone(),
            expected: expected.clone(),
            actual: digest,
        });
    }
    let started = Instant::now();
    let component = match cache {
        Some(cache) => cache
            .load(engine, &bytes, &digest)
            .map(|(component, outcome)| {
                tracing::debug!(module, ?outcome, elapsed_ms = ms(started), "compile cache");
                component
            }),
        None => super::compiler::compile(engine, &bytes).inspect(|_| {
            tracing::debug!(module, elapsed_ms = ms(started), "compiled");
        }),
    }
    .map_err(|e| LoadError::Compile {
        module: module.clone(),
        path: spec.path.clone(),
        message: format!("{e:#}"),
    })?;
    let interface = check_imports(engine, &component, spec)?;
    let linker = linker(engine, &spec.grants).map_err(|e| LoadError::Invalid {
        module: module.clone(),
        message: format!("linking host interfaces: {e:#}"),
    })?;
    let pre = linker
        .instantiate_pre(&component)
        .map_err(|e| LoadError::Invalid {
            module: module.clone(),
            message: format!("{e:#}"),
        })?;
    let nvml = spec
        .grants
        .has_library(crate::config::NVML)
        .then(|| crate::nvml::open(&libraries.nvml));
    let version =
        semver::Version::parse(&interface.version).map_err(|e| LoadError::NotAPlugin {
            module: module.clone(),
            message: format!("its export version {:?}: {e}", interface.version),
        })?;
    let pre = PluginPre::new(pre, &version).map_err(|e| LoadError::NotAPlugin {
        module: module.clone(),
        message: format!("{e:#}"),
    })?;
    Ok(LoadedModule {
        name: module.into(),
        spec: Arc::new(spec.clone()),
        host_root: Arc::new(host_root.to_owned()),
        grants: Arc::new(spec.grants.clone()),
        pre,
        output: Arc::default(),
        nvml,
        digest,
        interface,
    })
}

/// What a module is, as its component says: the WIT version it was built against and what it
/// imports. Shown by `devicelet validate`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ModuleInterface {
    /// The `devicelet:plugin` version of its `plugin` export, e.g. `0.1.0`.
    pub version: String,
    pub imports: Vec<String>,
}

/// A component's imports and exports by name, for the config `devicelet module push` writes.
/// Read from the component's own sections after validating it (milliseconds), not by compiling
/// it (Cranelift, hundreds of milliseconds and tens of MiB): what is pushed is a valid component
/// with those names, and the node that loads it still compiles and links it.
pub fn interface(bytes: &[u8]) -> Result<(Vec<String>, Vec<String>), String> {
    use wasmparser::{Encoding, Parser, Payload, Validator, WasmFeatures};
    let invalid = |e: wasmparser::BinaryReaderError| format!("not a valid component: {e}");
    Validator::new_with_features(WasmFeatures::default())
        .validate_all(bytes)
        .map_err(invalid)?;
    let (mut imports, mut exports) = (Vec::new(), Vec::new());
    // Nested modules and components have imports and exports of their own: only the outer
    // component's (depth 0) are the module's.
    let mut depth = 0usize;
    for payload in Parser::new(0).parse_all(bytes) {
        let payload = payload.map_err(invalid)?;
        match payload {
            Payload::Version { encoding, .. } if depth == 0 && encoding != Encoding::Component => {
                return Err("a core module, not a component (build it for wasm32-wasip2)".into());
            }
            Payload::ModuleSection { .. } | Payload::ComponentSection { .. } => depth += 1,
            Payload::End(_) => depth = depth.saturating_sub(1),
            Payload::ComponentImportSection(section) if depth == 0 => {
                for import in section {
                    let import = import.map_err(invalid)?;
                    imports.push(import.name.name.to_owned());
                }
            }
            Payload::ComponentExportSection(section) if depth == 0 => {
                for export in section {
                    let export = export.map_err(invalid)?;
                    exports.push(export.name.name.to_owned());
                }
            }
            _ => {}
        }
    }
    Ok((imports, exports))
}

/// Checks the module's WIT version (from its export names) and names the first import it is not
/// allowed, before wasmtime's less specific link error.
fn check_imports(
    engine: &Engine,
    component: &Component,
    spec: &ModuleSpec,
) -> Result<ModuleInterface, LoadError> {
    let ty = component.component_type();
    let exports: Vec<&str> = ty.exports(engine).map(|(name, _)| name).collect();
    let imports: Vec<&str> = ty.imports(engine).map(|(name, _)| name).collect();
    check_names(spec, &exports, &imports)
}

/// The import and version rules on a component's import and export names: from the compiled
/// component at load, and from an OCI artifact's config before its module is even fetched.
pub fn check_names(
    spec: &ModuleSpec,
    exports: &[&str],
    imports: &[&str],
) -> Result<ModuleInterface, LoadError> {
    let Some(export) = exports
        .iter()
        .find(|e| e.starts_with("devicelet:plugin/plugin@"))
    else {
        return Err(LoadError::NotAPlugin {
            module: spec.name.clone(),
            message: format!(
                "it exports [{}], not `{}`",
                exports.join(", "),
                imports::PLUGIN
            ),
        });
    };
    let version = export.trim_start_matches("devicelet:plugin/plugin@");
    let unsupported = |version: &str| LoadError::UnsupportedVersion {
        module: spec.name.clone(),
        wants: if version.is_empty() {
            "(no version)".to_owned()
        } else {
            version.to_owned()
        },
        speaks: imports::speaks(),
    };
    if let Some(Err(imports::Unsupported::Version(v))) = imports::ours(export) {
        return Err(unsupported(&v));
    }
    let mut seen = Vec::new();
    for &name in imports {
        let granted = match imports::ours(name) {
            Some(Ok(
                imports::Interface::Log | imports::Interface::Types | imports::Interface::Schedule,
            )) => true,
            Some(Ok(imports::Interface::Sysfs)) => !spec.grants.sysfs.is_empty(),
            Some(Ok(imports::Interface::Devnodes)) => !spec.grants.dev.is_empty(),
            Some(Ok(imports::Interface::Nvml)) => spec.grants.has_library(crate::config::NVML),
            // Linked with `nvml`; its calls check `nvml-mig` themselves.
            Some(Ok(imports::Interface::Mig)) => spec.grants.has_library(crate::config::NVML),
            Some(Err(imports::Unsupported::Version(v))) => return Err(unsupported(&v)),
            None if name.starts_with("wasi:") => true,
            Some(Ok(
                imports::Interface::Plugin
                | imports::Interface::Release
                | imports::Interface::Config
                | imports::Interface::Claims,
            ))
            | Some(Err(imports::Unsupported::Interface))
            | None => {
                return Err(LoadError::UnknownImport {
                    module: spec.name.clone(),
                    import: name.to_owned(),
                });
            }
        };
        if !granted {
            return Err(LoadError::UngrantedImport {
                module: spec.name.clone(),
                import: name.to_owned(),
            });
        }
        seen.push(name.to_owned());
    }
    Ok(ModuleInterface {
        version: version.to_owned(),
        imports: seen,
    })
}

fn linker(engine: &Engine, grants: &Grants) -> wasmtime::Result<Linker<HostState>> {
    use super::host::{Devnodes, Log, Nvml, Sysfs};
    let mut linker = Linker::<HostState>::new(engine);
    wasmtime_wasi::p2::add_to_linker_async(&mut linker)?;
    Log::add_to_linker(&mut linker, |s| &mut s.log)?;
    super::host::Schedule::add_to_linker(&mut linker, |s| &mut s.schedule)?;
    if !grants.sysfs.is_empty() {
        Sysfs::add_to_linker(&mut linker, |s| &mut s.sysfs)?;
    }
    if !grants.dev.is_empty() {
        Devnodes::add_to_linker(&mut linker, |s| &mut s.devnodes)?;
    }
    if grants.has_library(crate::config::NVML) {
        Nvml::add_to_linker(&mut linker, |s| &mut s.nvml)?;
        super::host::add_mig_to_linker(&mut linker, |s| &mut s.nvml)?;
    }
    Ok(linker)
}

fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1000.0
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::interface;

    /// A file read ahead of a module's start stands in for reading it then only while it is
    /// still the same file, unchanged.
    #[test]
    fn a_file_read_ahead_stands_in_only_while_it_is_unchanged() {
        let dir = tempfile::tempdir().unwrap();
        let module = dir.path().join("m.wasm");
        std::fs::write(&module, b"first").unwrap();
        let text = format!(
            "[[module]]\nname = \"m\"\npath = {:?}\n",
            module.display().to_string()
        );
        let registry =
            crate::config::Registry::parse(&text, &dir.path().join("registry.toml")).unwrap();
        let spec = &registry.modules[0];
        let read = || super::read(spec).unwrap();
        assert!(read().is_current_for(spec));
        // Another path.
        let mut other = spec.clone();
        other.path = dir.path().join("other.wasm");
        std::fs::write(&other.path, b"first").unwrap();
        assert!(!read().is_current_for(&other));
        // Replaced (a new file renamed over it, as a ConfigMap's update is).
        let before = read();
        std::fs::write(dir.path().join("new"), b"first").unwrap();
        std::fs::rename(dir.path().join("new"), &module).unwrap();
        assert!(!before.is_current_for(spec));
        // Written to.
        let before = read();
        std::fs::OpenOptions::new()
            .append(true)
            .open(&module)
            .unwrap()
            .write_all(b"!")
            .unwrap();
        assert!(!before.is_current_for(spec));
        assert!(read().is_current_for(spec));
    }

    #[test]
    fn push_refuses_what_is_no_component_by_name() {
        let core = interface(b"\0asm\x01\x00\x00\x00").expect_err("a core module");
        assert!(core.contains("a core module, not a component"), "{core}");
        let garbage = interface(b"\0asm\x0d\x00\x01\x00garbage").expect_err("garbage");
        assert!(garbage.starts_with("not a valid component"), "{garbage}");
        let empty = interface(b"").expect_err("nothing");
        assert!(empty.starts_with("not a valid component"), "{empty}");
    }
}
