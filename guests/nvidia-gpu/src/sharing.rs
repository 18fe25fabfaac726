//! Whole GPUs shared through Dynamic Resource Allocation (`dra-memory-sharing = true`): each GPU
//! is published shared by capacity (KEP-5075), its `memory` held by claims in any amount (a
//! claim that asks nothing holds all of it, which is a GPU of its own). How a claim shares is
//! its own choice, in its opaque config, as with NVIDIA's DRA driver's `GpuConfig`:
//!
//! ```json
//! {"sharing": {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 25}}}
//! ```
//!
//! `TimeSlicing` (or no config) hands the GPU over as it is: the scheduler keeps the memory
//! count, the GPU time-slices. `MPS` makes the container an MPS client (the module's
//! `mps-pipe-directory`) limited to the memory its claim holds
//! (`CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`) and to a share of the GPU's threads (the config's, else
//! its share of the memory).

use devicelet_sdk::{ContainerEdits, PluginError, Request};
use serde::Deserialize;

/// The capacity claims share.
pub const MEMORY: &str = "memory";

/// The MPS client limits NVIDIA's MPS daemon enforces.
const THREADS: &str = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE";
const PINNED: &str = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT";

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ClaimConfig {
    /// NVIDIA's `resource.nvidia.com/v1beta1`, if given: any version of that group.
    #[serde(default)]
    pub api_version: Option<String>,
    /// `GpuConfig`, if given.
    #[serde(default)]
    pub kind: Option<String>,
    #[serde(default)]
    pub sharing: Option<Sharing>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Sharing {
    pub strategy: Strategy,
    #[serde(default)]
    pub mps_config: Option<MpsConfig>,
    /// NVIDIA's time-slice interval; the GPU's own scheduler decides here, so it is accepted
    /// and has no effect.
    #[serde(default, rename = "timeSlicingConfig")]
    _time_slicing_config: Option<serde_json::Value>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub enum Strategy {
    TimeSlicing,
    #[serde(rename = "MPS")]
    Mps,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct MpsConfig {
    #[serde(default)]
    pub default_active_thread_percentage: Option<u32>,
    /// A cap below the claim's share (`10Gi`).
    #[serde(default)]
    pub default_pinned_device_memory_limit: Option<String>,
}

impl ClaimConfig {
    /// A claim's opaque config for this module (empty: none).
    pub fn parse(config: &str) -> Result<ClaimConfig, PluginError> {
        if config.trim().is_empty() {
            return Ok(ClaimConfig::default());
        }
        let parsed: ClaimConfig = serde_json::from_str(config).map_err(|e| {
            PluginError::InvalidConfig(format!(
                "a claim's config for nvidia-gpu is NVIDIA's GpuConfig, e.g. {{\"sharing\": \
                 {{\"strategy\": \"MPS\"}}}}: {e}"
            ))
        })?;
        if let Some(api) = parsed
            .api_version
            .as_deref()
            .filter(|a| !a.starts_with("resource.nvidia.com/"))
        {
            return Err(PluginError::InvalidConfig(format!(
                "apiVersion {api:?}: this module takes resource.nvidia.com's GpuConfig"
            )));
        }
        if let Some(kind) = parsed.kind.as_deref().filter(|k| *k != "GpuConfig") {
            return Err(PluginError::InvalidConfig(format!(
                "kind {kind:?}: this module takes GpuConfig"
            )));
        }
        let threads = parsed
            .sharing
            .as_ref()
            .and_then(|s| s.mps_config.as_ref())
            .and_then(|m| m.default_active_thread_percentage);
        if let Some(t) = threads.filter(|t| !(1..=100).contains(t)) {
            return Err(PluginError::InvalidConfig(format!(
                "defaultActiveThreadPercentage {t} is not between 1 and 100"
            )));
        }
        Ok(parsed)
    }

    pub fn strategy(&self) -> Option<Strategy> {
        self.sharing.as_ref().map(|s| s.strategy)
    }
}

/// A quantity in MiB, as the agent hands shares over (`20Gi`, `10G`, `81920Mi`, `512`).
pub fn mib(quantity: &str) -> Option<u64> {
    let split = quantity
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(quantity.len());
    let (number, unit) = quantity.split_at(split);
    let n: u128 = number.parse().ok()?;
    let bytes = match unit {
        "" => n,
        "Ki" => n << 10,
        "Mi" => n << 20,
        "Gi" => n << 30,
        "Ti" => n << 40,
        "k" => n * 1_000,
        "M" => n * 1_000_000,
        "G" => n * 1_000_000_000,
        "T" => n * 1_000_000_000_000,
        _ => return None,
    };
    u64::try_from(bytes >> 20).ok()
}

/// The module's MPS directories: the control daemon's pipes, and its shared memory.
#[derive(Debug, Clone, Copy)]
pub struct MpsDirs<'a> {
    pub pipe: Option<&'a str>,
    pub shm: Option<&'a str>,
}

/// One whole GPU of a claim: its ID, its memory in MiB and its PCI address (CUDA numbers the
/// container's GPUs by it under `CUDA_DEVICE_ORDER=PCI_BUS_ID`).
pub struct WholeGpu {
    pub id: String,
    pub memory_mib: u64,
    pub bus: String,
}

/// `edits` for a claim holding the whole GPUs `gpus` (and, when `partitions`, MIG devices), as
/// its sharing strategy makes them: MPS limits for an MPS claim, and nothing of MPS for any
/// other (the module's own MPS settings are the device-plugin front end's).
pub fn edits(
    mut edits: ContainerEdits,
    config: &ClaimConfig,
    request: &Request,
    mut gpus: Vec<WholeGpu>,
    partitions: bool,
    mps: MpsDirs<'_>,
) -> Result<ContainerEdits, PluginError> {
    edits
        .envs
        .retain(|(name, _)| !name.starts_with("CUDA_MPS_"));
    edits.mounts.retain(|m| {
        Some(m.host_path.as_str()) != mps.pipe && Some(m.host_path.as_str()) != mps.shm
    });
    if config.strategy() != Some(Strategy::Mps) {
        return Ok(edits);
    }
    if partitions {
        return Err(PluginError::InvalidConfig(
            "MPS sharing is for whole GPUs; this claim holds MIG devices".into(),
        ));
    }
    let Some(dir) = mps.pipe else {
        return Err(PluginError::InvalidConfig(
            "the claim asks for MPS sharing, but the module has no mps-pipe-directory (the MPS \
             control daemon's, which its clients reach)"
                .into(),
        ));
    };
    let cap = config
        .sharing
        .as_ref()
        .and_then(|s| s.mps_config.as_ref())
        .and_then(|m| m.default_pinned_device_memory_limit.as_deref())
        .map(|q| {
            mib(q).ok_or_else(|| {
                PluginError::InvalidConfig(format!(
                    "defaultPinnedDeviceMemoryLimit {q:?} is not a whole quantity such as 10Gi"
                ))
            })
        })
        .transpose()?;
    gpus.sort_by(|a, b| a.bus.cmp(&b.bus));
    let mut limits = Vec::new();
    let mut share = 100;
    for (i, gpu) in gpus.iter().enumerate() {
        // Every share the request holds of the GPU (none: all of it).
        let mut held = None;
        for s in request.shares.iter().filter(|s| s.id == gpu.id) {
            for amount in s.consumed.iter().filter(|a| a.name == MEMORY) {
                let mib = mib(&amount.value).ok_or_else(|| {
                    PluginError::Failed(format!(
                        "the agent gave {} a share of {:?}",
                        gpu.id, amount.value
                    ))
                })?;
                held = Some(held.unwrap_or(0) + mib);
            }
        }
        let held = held.unwrap_or(gpu.memory_mib);
        let limit = cap.map_or(held, |c| c.min(held)).max(1);
        limits.push(format!("{i}={limit}M"));
        if let Some(percent) = (held * 100).checked_div(gpu.memory_mib) {
            share = share.min(percent.clamp(1, 100) as u32);
        }
    }
    let threads = config
        .sharing
        .as_ref()
        .and_then(|s| s.mps_config.as_ref())
        .and_then(|m| m.default_active_thread_percentage)
        .unwrap_or(share);
    edits = edits
        .env("CUDA_MPS_PIPE_DIRECTORY", dir.to_owned())
        .mount(dir, dir, false);
    if let Some(shm) = mps.shm {
        edits = edits.mount(shm, "/dev/shm", false);
    }
    Ok(edits
        .env("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
        .env(THREADS, threads.to_string())
        .env(PINNED, limits.join(",")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities_become_mib() {
        assert_eq!(mib("20Gi"), Some(20480));
        assert_eq!(mib("81920Mi"), Some(81920));
        assert_eq!(mib("10G"), Some(9536));
        assert_eq!(mib("1.5Gi"), None);
        assert_eq!(mib("lots"), None);
    }

    #[test]
    fn nvidias_gpu_config_is_read_and_checked() {
        let c = ClaimConfig::parse(
            r#"{"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
                "sharing": {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 30}}}"#,
        )
        .unwrap();
        assert_eq!(c.strategy(), Some(Strategy::Mps));
        assert_eq!(ClaimConfig::parse("").unwrap().strategy(), None);
        for bad in [
            r#"{"kind": "MigDeviceConfig"}"#,
            r#"{"apiVersion": "gpu.example.com/v1", "kind": "GpuConfig"}"#,
            r#"{"sharing": {"strategy": "MPS"}, "extra": 1}"#,
            r#"{"sharing": {"strategy": "Spatial"}}"#,
            r#"{"sharing": {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 0}}}"#,
        ] {
            assert!(ClaimConfig::parse(bad).is_err(), "{bad}");
        }
    }
}
