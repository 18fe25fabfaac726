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
    let module = spec.name.clone();
    let bytes =
        crate::files::read_regular(&spec.path, crate::files::MAX_MODULE).map_err(|error| {
            LoadError::Read {
                module: module.clone(),
                path: spec.path.clone(),
                error,
            }
        })?;
    let digest = sha256_hex(&bytes);
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
/// Compiles it: only what compiles is pushed.
pub fn interface(bytes: &[u8]) -> Result<(Vec<String>, Vec<String>), String> {
    let engine = super::engine::new_engine().map_err(|e| format!("{e:#}"))?;
    let component = super::compiler::compile(&engine, bytes)
        .map_err(|e| format!("not a component this agent can load: {e:#}"))?;
    let ty = component.component_type();
    let imports = ty.imports(&engine).map(|(n, _)| n.to_owned()).collect();
    let exports = ty.exports(&engine).map(|(n, _)| n.to_owned()).collect();
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
            Some(Err(imports::Unsupported::Version(v))) => return Err(unsupported(&v)),
            None if name.starts_with("wasi:") => true,
            Some(Ok(
                imports::Interface::Plugin
                | imports::Interface::Release
                | imports::Interface::Config,
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
    }
    Ok(linker)
}

fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1000.0
}
