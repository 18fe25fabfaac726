//! [`Plugin`]: one instance of a module, called in the host's own types whichever line of the WIT
//! package it speaks. The loader picks the line by the version of the module's `plugin` export;
//! this is the only place that matches on it.
//!
//! A 0.1 module is called as 0.2 describes a module that uses none of 0.2's additions: its
//! `init` gets the config alone and its answer has no version; its `allocate` gets the
//! resource and the IDs, and a request with config is refused for it; it has no `release` or
//! `config` export.

use wasmtime::Store;
use wasmtime::component::{ComponentExportIndex, InstancePre, TypedFunc};

use super::{v0_1, v0_2};
use crate::device::{
    ContainerEdits, Device, InitContext, ModuleInfo, PluginError, Request, ResourceInfo,
};
use crate::sandbox::host::HostState;

/// What a module call returns: a trap, or the module's own answer.
pub type Answer<T> = wasmtime::Result<Result<T, PluginError>>;

type ReleaseFn = TypedFunc<(v0_2::wit::Request,), (Result<(), v0_2::wit::PluginError>,)>;
type ConfigFn = TypedFunc<(String, String), (Result<(), v0_2::wit::PluginError>,)>;

/// A compiled, linked module of either line, ready to be instantiated.
#[derive(Clone)]
pub enum PluginPre {
    V0_1(v0_1::DevicePluginPre<HostState>),
    V0_2 {
        pre: v0_2::DevicePluginPre<HostState>,
        /// The optional exports' functions, when the module has them.
        release: Option<ComponentExportIndex>,
        config: Option<ComponentExportIndex>,
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
        Ok(PluginPre::V0_2 {
            release: export(v0_2::RELEASE, "release"),
            config: export(v0_2::CONFIG, "validate-config"),
            pre: v0_2::DevicePluginPre::new(pre)?,
        })
    }

    pub fn engine(&self) -> &wasmtime::Engine {
        match self {
            PluginPre::V0_1(pre) => pre.engine(),
            PluginPre::V0_2 { pre, .. } => pre.engine(),
        }
    }

    /// Whether `init` is told the names the resources are served under (0.2).
    pub fn tells_served_names(&self) -> bool {
        matches!(self, PluginPre::V0_2 { .. })
    }

    /// Whether the module exports `release` (0.2).
    pub fn has_release(&self) -> bool {
        matches!(
            self,
            PluginPre::V0_2 {
                release: Some(_),
                ..
            }
        )
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
        }
    }
}

/// One instance of a module.
pub enum Plugin {
    V0_1(v0_1::DevicePlugin),
    V0_2 {
        plugin: v0_2::DevicePlugin,
        release: Option<ReleaseFn>,
        config: Option<ConfigFn>,
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
        })
    }

    pub async fn enumerate(
        &self,
        store: &mut Store<HostState>,
        resource: &str,
    ) -> Answer<Vec<Device>> {
        Ok(match self {
            Plugin::V0_1(p) => p
                .devicelet_plugin_plugin()
                .call_enumerate(store, resource)
                .await?
                .map(|d| d.into_iter().map(Device::from).collect())
                .map_err(PluginError::from),
            Plugin::V0_2 { plugin, .. } => plugin
                .devicelet_plugin_plugin()
                .call_enumerate(store, resource)
                .await?
                .map(|d| d.into_iter().map(Device::from).collect())
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
            _ => Ok(Ok(())),
        }
    }

    /// The module's `validate-config`, when it exports one. A module without one takes no
    /// request config at all.
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
            _ if config.is_empty() => Ok(Ok(())),
            _ => Ok(Err(PluginError::InvalidConfig(
                "the module takes no request config (it does not export `config`)".into(),
            ))),
        }
    }
}
