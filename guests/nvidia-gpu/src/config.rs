//! The module's `[module.config]` table.

use std::time::Duration;

use devicelet_sdk::PluginError;
use devicelet_sdk::nvml::{Gpu, MigDevice};
use serde::Deserialize;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum IdStrategy {
    Uuid,
    Index,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Visible {
    /// `NVIDIA_VISIBLE_DEVICES`, read by NVIDIA's container runtime hook.
    Envvar,
    /// CDI names, resolved by the container runtime from the specs NVIDIA's toolkit generates.
    Cdi,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum MigStrategy {
    None,
    Single,
    Mixed,
    /// Every placement of every profile published as a partition for DRA; instances made at
    /// prepare.
    Dynamic,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct Config {
    #[serde(default = "default_resource")]
    pub resource: String,
    #[serde(default = "default_ids")]
    pub device_id_strategy: IdStrategy,
    #[serde(default = "default_visible")]
    pub visible: Visible,
    #[serde(default = "default_cdi_kind")]
    pub cdi_kind: String,
    #[serde(default = "default_mig")]
    pub mig_strategy: MigStrategy,
    /// Application errors (13: graphics engine exception, 31: memory page fault, 43: GPU stopped
    /// processing, 45: preemptive cleanup, 68: video processor exception, 109: context switch
    /// timeout), as NVIDIA's plugin skips them: they say the workload failed, not the GPU.
    #[serde(default = "default_ignored")]
    pub ignored_xids: Vec<u64>,
    #[serde(default = "default_quiet")]
    quiet_period: String,
    pub mps_pipe_directory: Option<String>,
    pub mps_shm_directory: Option<String>,
    /// How many containers share each GPU through MPS (the registry's `[module.sharing]
    /// replicas`): each gets 1/N of the GPU's threads and memory, as NVIDIA's MPS daemon sets
    /// per client.
    pub mps_replicas: Option<u32>,
    /// Through DRA, whole GPUs shared by their memory (`sharing.rs`).
    #[serde(default)]
    pub dra_memory_sharing: bool,
}

/// MPS clients per GPU on Volta and later.
pub const MAX_MPS_REPLICAS: u32 = 48;

fn default_resource() -> String {
    "gpu".into()
}
fn default_ids() -> IdStrategy {
    IdStrategy::Uuid
}
fn default_visible() -> Visible {
    Visible::Envvar
}
fn default_cdi_kind() -> String {
    "nvidia.com/gpu".into()
}
fn default_mig() -> MigStrategy {
    MigStrategy::None
}
fn default_ignored() -> Vec<u64> {
    vec![13, 31, 43, 45, 68, 109]
}
fn default_quiet() -> String {
    "5m".into()
}

impl Config {
    pub fn parse(json: &str) -> Result<Config, PluginError> {
        let text = if json.trim().is_empty() { "{}" } else { json };
        // `visible-devices` in the registry; `visible` above reads it.
        let mut value: serde_json::Value =
            serde_json::from_str(text).map_err(|e| PluginError::InvalidConfig(e.to_string()))?;
        if let Some(table) = value.as_object_mut()
            && let Some(v) = table.remove("visible-devices")
        {
            table.insert("visible".into(), v);
        }
        let config: Config =
            serde_json::from_value(value).map_err(|e| PluginError::InvalidConfig(e.to_string()))?;
        if config.mig_strategy == MigStrategy::Dynamic && config.visible == Visible::Cdi {
            return Err(PluginError::InvalidConfig(
                "mig-strategy \"dynamic\" needs visible-devices = \"envvar\": the NVIDIA \
                 toolkit's CDI specs name the MIG devices that existed when they were generated, \
                 never one made for a claim"
                    .into(),
            ));
        }
        if !config.cdi_kind.contains('/') {
            return Err(PluginError::InvalidConfig(format!(
                "cdi-kind {:?} is not of the form vendor.com/class",
                config.cdi_kind
            )));
        }
        for (key, dir) in [
            ("mps-pipe-directory", &config.mps_pipe_directory),
            ("mps-shm-directory", &config.mps_shm_directory),
        ] {
            if let Some(dir) = dir
                && !dir.starts_with('/')
            {
                return Err(PluginError::InvalidConfig(format!(
                    "{key} {dir:?} is not an absolute path"
                )));
            }
        }
        if let Some(replicas) = config.mps_replicas {
            if config.mps_pipe_directory.is_none() {
                return Err(PluginError::InvalidConfig(
                    "mps-replicas needs mps-pipe-directory (the MPS daemon's clients reach it there)"
                        .into(),
                ));
            }
            if !(1..=MAX_MPS_REPLICAS).contains(&replicas) {
                return Err(PluginError::InvalidConfig(format!(
                    "mps-replicas {replicas} is not between 1 and {MAX_MPS_REPLICAS} (MPS serves \
                     at most {MAX_MPS_REPLICAS} clients per GPU)"
                )));
            }
        }
        Ok(config)
    }

    pub fn quiet_period(&self) -> Result<Duration, PluginError> {
        parse_duration(&self.quiet_period).ok_or_else(|| {
            PluginError::InvalidConfig(format!(
                "quiet-period {:?} is not a duration such as 500ms, 30s, 5m or 1h",
                self.quiet_period
            ))
        })
    }

    /// A unit's device ID: its UUID, or `<gpu index>` / `<gpu index>:<MIG index>` as NVIDIA's
    /// plugin and toolkit write indexes.
    /// The ID of a GPU lost before NVML ever gave its UUID: its index, under either strategy
    /// (`lost-3` with UUIDs, so it cannot be taken for a real one).
    pub fn lost_id(&self, index: u32) -> String {
        match self.device_id_strategy {
            IdStrategy::Uuid => format!("lost-{index}"),
            IdStrategy::Index => index.to_string(),
        }
    }

    pub fn id(&self, gpu: &Gpu, mig: Option<&MigDevice>) -> String {
        match (self.device_id_strategy, mig) {
            (IdStrategy::Uuid, None) => gpu.uuid.clone(),
            (IdStrategy::Uuid, Some(mig)) => mig.uuid.clone(),
            (IdStrategy::Index, None) => gpu.index.to_string(),
            (IdStrategy::Index, Some(mig)) => format!("{}:{}", gpu.index, mig.index),
        }
    }
}

fn parse_duration(text: &str) -> Option<Duration> {
    let split = text.find(|c: char| !c.is_ascii_digit())?;
    let (number, unit) = text.split_at(split);
    let n: u64 = number.parse().ok()?;
    match unit {
        "ms" => Some(Duration::from_millis(n)),
        "s" => Some(Duration::from_secs(n)),
        "m" => Some(Duration::from_secs(n.checked_mul(60)?)),
        "h" => Some(Duration::from_secs(n.checked_mul(3600)?)),
        _ => None,
    }
}
