//! [`Plugin`]: one instance of a module, called in the host's own types whichever line of the WIT
//! package it speaks. The loader picks the line by the version of the module's `plugin` export;
//! this is the only place that matches on it.
//!
//! A 0.1 module is called as 0.2 describes a module that uses none of 0.2's additions: its
//! `init` gets the config alone and its answer has no version; its `allocate` gets the
//! resource and the IDs, and a request with config is refused for it; it has no `release` or
//! `config` export. A 0.1 or 0.2 module is called as 0.3 describes one that uses none of 0.3's
//! additions: no counter sets, taints or shared devices, no `claims` export; a request's shares
//! are not passed (it has no device that could have any).

use wasmtime::Store;
use wasmtime::component::{ComponentExportIndex, InstancePre, TypedFunc};

use super::{v0_1, v0_2, v0_3};
use crate::device::{
    ContainerEdits, InitContext, Inventory, ModuleInfo, PluginError, Prepared, Request,
    ResourceInfo,
};
use crate::sandbox::host::HostState;

/// What a module call returns: a trap, or the module's own answer.
pub type Answer<T> = wasmtime::Result<Result<T, PluginError>>;

type ReleaseFn = TypedFunc<(v0_2::wit::Request,), (Result<(), v0_2::wit::PluginError>,)>;
type ConfigFn = TypedFunc<(String, String), (Result<(), v0_2::wit::PluginError>,)>;
type ReleaseFn3 = TypedFunc<(v0_3::wit::Request,), (Result<(), v0_3::wit::PluginError>,)>;
type ConfigFn3 = TypedFunc<(String, String), (Result<(), v0_3::wit::PluginError>,)>;
type PrepareFn =
    TypedFunc<(v0_3::wit::Request,), (Result<v0_3::wit::Prepared, v0_3::wit::PluginError>,)>;

/// A 0.3 module's optional exports, by index until instantiated.
#[derive(Clone, Copy)]
pub struct Exports3 {
    release: Option<ComponentExportIndex>,
    config: Option<ComponentExportIndex>,
    prepare: Option<ComponentExportIndex>,
    unprepare: Option<ComponentExportIndex>,
}

/// A compiled, linked module of any line, ready to be instantiated.
#[derive(Clone)]
pub enum PluginPre {
    V0_1(v0_1::DevicePluginPre<HostState>),
    V0_2 {
        pre: v0_2::DevicePluginPre<HostState>,
        /// The optional exports' functions, when the module has them.
        release: Option<ComponentExportIndex>,
        config: Option<ComponentExportIndex>,
    },
    V0_3 {
        pre: v0_3::DevicePluginPre<HostState>,
        exports: Exports3,
    },
}

impl PluginPre {
    /// The bindings for a module whose `plugin` export is at `version` (a supported one).
    pub fn new(pre: InstancePre<HostState>, version: &semver::Version) -> wasmtime::Result<Self> {
        if (version.major, version.minor) == (0, 1) {
            return Ok(PluginPre::V0_1(v0_1::DevicePluginPre::new(pre)?));
        }
        let component = pre.component();
        let export = |interface: &str, function: &str| {
            let interface = component.get_export_index(None, interface)?;
            component.get_export_index(Some(&interface), function)
        };
        if (version.major, version.minor) == (0, 2) {
            return Ok(PluginPre::V0_2 {
                release: export(v0_2::RELEASE, "release"),
                config: export(v0_2::CONFIG, "validate-config"),
                pre: v0_2::DevicePluginPre::new(pre)?,
            });
        }
        let exports = Exports3 {
            release: export(v0_3::RELEASE, "release"),
            config: export(v0_3::CONFIG, "validate-config"),
            prepare: export(v0_3::CLAIMS, "prepare"),
            unprepare: export(v0_3::CLAIMS, "unprepare"),
        };
        if exports.prepare.is_some() != exports.unprepare.is_some() {
            return Err(wasmtime::format_err!(
                "its `claims` export lacks `prepare` or `unprepare`"
            ));
        }
        Ok(PluginPre::V0_3 {
            exports,
            pre: v0_3::DevicePluginPre::new(pre)?,
        })
    }

    pub fn engine(&self) -> &wasmtime::Engine {
        match self {
            PluginPre::V0_1(pre) => pre.engine(),
            PluginPre::V0_2 { pre, .. } => pre.engine(),
            PluginPre::V0_3 { pre, .. } => pre.engine(),
        }
    }

    /// Whether `init` is told the names the resources are served under (0.2 on).
    pub fn tells_served_names(&self) -> bool {
        !matches!(self, PluginPre::V0_1(_))
    }

    /// Whether the module exports `release` (0.2 on).
    pub fn has_release(&self) -> bool {
        match self {
            PluginPre::V0_1(_) => false,
            PluginPre::V0_2 { release, .. } => release.is_some(),
            PluginPre::V0_3 { exports, .. } => exports.release.is_some(),
        }
    }

    /// Whether the module exports `claims` (0.3): its DRA claims are prepared by `prepare`,
    /// under the host's write-ahead record.
    pub fn has_claims(&self) -> bool {
        matches!(self, PluginPre::V0_3 { exports, .. } if exports.prepare.is_some())
    }

    pub async fn instantiate(&self, store: &mut Store<HostState>) -> wasmtime::Result<Plugin> {
        match self {
            PluginPre::V0_1(pre) => Ok(Plugin::V0_1(pre.instantiate_async(store).await?)),
            PluginPre::V0_2 {
                pre,
                release,
                config,
            } => {
                let instance = pre.instance_pre().instantiate_async(&mut *store).await?;
                let plugin = v0_2::DevicePlugin::new(&mut *store, &instance)?;
                let release = match release {
                    Some(index) => Some(instance.get_typed_func(&mut *store, index)?),
                    None => None,
                };
                let config = match config {
                    Some(index) => Some(instance.get_typed_func(&mut *store, index)?),
                    None => None,
                };
                Ok(Plugin::V0_2 {
                    plugin,
                    release,
                    config,
                })
            }
            PluginPre::V0_3 { pre, exports } => {
                let instance = pre.instance_pre().instantiate_async(&mut *store).await?;
                let plugin = v0_3::DevicePlugin::new(&mut *store, &instance)?;
                Ok(Plugin::V0_3 {
                    plugin,
                    release: typed(&instance, store, exports.release)?,
                    config: typed(&instance, store, exports.config)?,
                    prepare: typed(&instance, store, exports.prepare)?,
                    unprepare: typed(&instance, store, exports.unprepare)?,
                })
            }
        }
    }
}

/// An optional export's function, typed, when the module has it.
fn typed<P, R>(
    instance: &wasmtime::component::Instance,
    store: &mut Store<HostState>,
    index: Option<ComponentExportIndex>,
) -> wasmtime::Result<Option<TypedFunc<P, R>>>
where
    P: wasmtime::component::ComponentNamedList + wasmtime::component::Lower,
    R: wasmtime::component::ComponentNamedList + wasmtime::component::Lift,
{
    index
        .map(|index| instance.get_typed_func(&mut *store, index))
        .transpose()
}

/// One instance of a module.
pub enum Plugin {
    V0_1(v0_1::DevicePlugin),
    V0_2 {
        plugin: v0_2::DevicePlugin,
        release: Option<ReleaseFn>,
        config: Option<ConfigFn>,
    },
    V0_3 {
        plugin: v0_3::DevicePlugin,
        release: Option<ReleaseFn3>,
        config: Option<ConfigFn3>,
        prepare: Option<PrepareFn>,
        unprepare: Option<ReleaseFn3>,
    },
}

impl Plugin {
    pub async fn init(
        &self,
        store: &mut Store<HostState>,
        context: &InitContext,
    ) -> Answer<ModuleInfo> {
        Ok(match self {
            Plugin::V0_1(p) => p
                .devicelet_plugin_plugin()
                .call_init(store, &context.config)
                .await?
                .map(|resources| ModuleInfo {
                    version: String::new(),
                    resources: resources.into_iter().map(ResourceInfo::from).collect(),
                })
                .map_err(PluginError::from),
            Plugin::V0_2 { plugin, .. } => plugin
                .devicelet_plugin_plugin()
                .call_init(store, &context.into())
                .await?
                .map(ModuleInfo::from)
                .map_err(PluginError::from),
            Plugin::V0_3 { plugin, .. } => plugin
                .devicelet_plugin_plugin()
                .call_init(store, &context.into())
                .await?
                .map(ModuleInfo::from)
                .map_err(PluginError::from),
        })
    }

    pub async fn enumerate(
        &self,
        store: &mut Store<HostState>,
        resource: &str,
    ) -> Answer<Inventory> {
        Ok(match self {
            Plugin::V0_1(p) => p
                .devicelet_plugin_plugin()
                .call_enumerate(store, resource)
                .await?
                .map(|d| Inventory::from(d.into_iter().map(Into::into).collect::<Vec<_>>()))
                .map_err(PluginError::from),
            Plugin::V0_2 { plugin, .. } => plugin
                .devicelet_plugin_plugin()
                .call_enumerate(store, resource)
                .await?
                .map(|d| Inventory::from(d.into_iter().map(Into::into).collect::<Vec<_>>()))
                .map_err(PluginError::from),
            Plugin::V0_3 { plugin, .. } => plugin
                .devicelet_plugin_plugin()
                .call_enumerate(store, resource)
                .await?
                .map(Inventory::from)
                .map_err(PluginError::from),
        })
    }

    pub async fn allocate(
        &self,
        store: &mut Store<HostState>,
        request: &Request,
    ) -> Answer<ContainerEdits> {
        Ok(match self {
            Plugin::V0_1(_) if !request.config.is_empty() => Err(PluginError::InvalidConfig(
                "the module is built against devicelet:plugin 0.1, which takes no request config"
                    .into(),
            )),
            Plugin::V0_1(p) => p
                .devicelet_plugin_plugin()
                .call_allocate(store, &request.resource, &request.ids)
                .await?
                .map(ContainerEdits::from)
                .map_err(PluginError::from),
            Plugin::V0_2 { plugin, .. } => plugin
                .devicelet_plugin_plugin()
                .call_allocate(store, &request.into())
                .await?
                .map(ContainerEdits::from)
                .map_err(PluginError::from),
            Plugin::V0_3 { plugin, .. } => plugin
                .devicelet_plugin_plugin()
                .call_allocate(store, &request.into())
                .await?
                .map(ContainerEdits::from)
                .map_err(PluginError::from),
        })
    }

    pub async fn prestart(
        &self,
        store: &mut Store<HostState>,
        resource: &str,
        ids: &[String],
    ) -> Answer<()> {
        Ok(match self {
            Plugin::V0_1(p) => p
                .devicelet_plugin_plugin()
                .call_prestart(store, resource, ids)
                .await?
                .map_err(PluginError::from),
            Plugin::V0_2 { plugin, .. } => plugin
                .devicelet_plugin_plugin()
                .call_prestart(store, resource, ids)
                .await?
                .map_err(PluginError::from),
            Plugin::V0_3 { plugin, .. } => plugin
                .devicelet_plugin_plugin()
                .call_prestart(store, resource, ids)
                .await?
                .map_err(PluginError::from),
        })
    }

    pub async fn preferred(
        &self,
        store: &mut Store<HostState>,
        resource: &str,
        available: &[String],
        must_include: &[String],
        size: u32,
    ) -> Answer<Vec<String>> {
        Ok(match self {
            Plugin::V0_1(p) => p
                .devicelet_plugin_plugin()
                .call_preferred(store, resource, available, must_include, size)
                .await?
                .map_err(PluginError::from),
            Plugin::V0_2 { plugin, .. } => plugin
                .devicelet_plugin_plugin()
                .call_preferred(store, resource, available, must_include, size)
                .await?
                .map_err(PluginError::from),
            Plugin::V0_3 { plugin, .. } => plugin
                .devicelet_plugin_plugin()
                .call_preferred(store, resource, available, must_include, size)
                .await?
                .map_err(PluginError::from),
        })
    }

    /// The module's `release`, when it exports one; Ok(Ok(())) otherwise.
    pub async fn release(&self, store: &mut Store<HostState>, request: &Request) -> Answer<()> {
        match self {
            Plugin::V0_2 {
                release: Some(f), ..
            } => {
                let (answer,) = f.call_async(store, (request.into(),)).await?;
                Ok(answer.map_err(PluginError::from))
            }
            Plugin::V0_3 {
                release: Some(f), ..
            } => {
                let (answer,) = f.call_async(store, (request.into(),)).await?;
                Ok(answer.map_err(PluginError::from))
            }
            _ => Ok(Ok(())),
        }
    }

    /// The module's `validate-config`, when it exports one. Without it the config is left to
    /// `allocate` (or `prepare`) to judge: the export is optional.
    pub async fn validate_config(
        &self,
        store: &mut Store<HostState>,
        resource: &str,
        config: &str,
    ) -> Answer<()> {
        match self {
            Plugin::V0_2 {
                config: Some(f), ..
            } => {
                let (answer,) = f
                    .call_async(store, (resource.to_owned(), config.to_owned()))
                    .await?;
                Ok(answer.map_err(PluginError::from))
            }
            Plugin::V0_3 {
                config: Some(f), ..
            } => {
                let (answer,) = f
                    .call_async(store, (resource.to_owned(), config.to_owned()))
                    .await?;
                Ok(answer.map_err(PluginError::from))
            }
            _ => Ok(Ok(())),
        }
    }

    /// The module's `claims.prepare` (0.3); without it, `allocate`, with no status.
    pub async fn prepare(
        &self,
        store: &mut Store<HostState>,
        request: &Request,
    ) -> Answer<Prepared> {
        match self {
            Plugin::V0_3 {
                prepare: Some(f), ..
            } => {
                let (answer,) = f.call_async(store, (request.into(),)).await?;
                Ok(answer.map(Prepared::from).map_err(PluginError::from))
            }
            _ => Ok(self.allocate(store, request).await?.map(|edits| Prepared {
                edits,
                status: Vec::new(),
            })),
        }
    }

    /// The module's `claims.unprepare` (0.3); without it, `release`.
    pub async fn unprepare(&self, store: &mut Store<HostState>, request: &Request) -> Answer<()> {
        match self {
            Plugin::V0_3 {
                unprepare: Some(f), ..
            } => {
                let (answer,) = f.call_async(store, (request.into(),)).await?;
                Ok(answer.map_err(PluginError::from))
            }
            _ => self.release(store, request).await,
        }
    }
}
