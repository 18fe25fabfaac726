//! How Allocate hands devices to the container runtime: the registry's `device-list-strategy`,
//! and the answer it shapes.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::sync::{Notify, watch};

use super::build::View;
use crate::device::ContainerEdits;

pub use crate::config::DeviceListStrategy;

/// How often Allocate named devices by CDI, and how often it could not.
#[derive(Debug, Default)]
pub struct Counts {
    pub named: AtomicU64,
    /// Containers that got the module's answer itself, because the written spec would not have
    /// given them the same (a device not in it yet, an answer for several devices that is not
    /// the sum of their own).
    pub unnamed: AtomicU64,
}

/// One resource's CDI naming, shared by its spec writer and its server.
#[derive(Debug, Clone)]
pub struct Naming {
    pub strategy: DeviceListStrategy,
    /// The spec as last written; None while there is none (or it may not be named).
    pub view: watch::Receiver<Option<Arc<View>>>,
    /// The `cdi.k8s.io/` annotation key the resource's answers use.
    pub annotation_key: Arc<str>,
    pub counts: Arc<Counts>,
    /// Wakes the spec writer when the file on disk is not the one it wrote.
    pub recheck: Arc<Notify>,
}

impl Naming {
    /// What a container gets for the module's `answer` for `ids` (physical device IDs, each
    /// once), shaped per the strategy: the devices named by CDI when the spec on disk, applied,
    /// gives the container exactly what `answer` does; else `answer` itself. Front-end neutral:
    /// the caller turns it into its wire answer.
    pub fn shape(&self, ids: &[&str], answer: ContainerEdits) -> ContainerEdits {
        let view = self.view.borrow().clone();
        let view = view.filter(|v| v.covers(ids, &answer));
        // The file is checked last and on every call: it is what the runtime will read.
        let Some(view) = view.filter(|v| {
            v.on_disk() || {
                self.recheck.notify_one();
                false
            }
        }) else {
            self.counts.unnamed.fetch_add(1, Ordering::Relaxed);
            return answer;
        };
        self.counts.named.fetch_add(1, Ordering::Relaxed);
        let mut out = answer;
        if !self.strategy.devices {
            out.envs.clear();
            out.mounts.clear();
            out.devices.clear();
        }
        let names: Vec<String> = ids.iter().map(|id| view.name(id)).collect();
        if self.strategy.cdi_annotations {
            // Ours replaces one of the module's under the same key, as the kubelet's map would.
            out.annotations.retain(|(k, _)| **k != *self.annotation_key);
            out.annotations
                .push((self.annotation_key.to_string(), names.join(",")));
        }
        if self.strategy.cdi_cri {
            out.cdi_devices.extend(names);
        }
        out
    }
}

/// Longest name part of an annotation key (after `cdi.k8s.io/`), by Kubernetes' rules.
const MAX_ANNOTATION_NAME: usize = 63;

/// The annotation key for a resource's devices: `cdi.k8s.io/devicelet_<vendor>_<class>`, unique
/// per resource (the kubelet merges every plugin's annotations into one container's); a digest
/// of the name stands in when that would be too long.
pub fn annotation_key(resource: &str) -> String {
    let name = format!("devicelet_{}", resource.replace('/', "_"));
    if name.len() <= MAX_ANNOTATION_NAME {
        return format!("cdi.k8s.io/{name}");
    }
    let digest = crate::digest::sha256_hex(resource.as_bytes());
    format!("cdi.k8s.io/devicelet_{}", &digest[..32])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strategies_parse_alone_or_together() {
        let s = DeviceListStrategy::parse(["cdi-cri", "devices"]).unwrap();
        assert!(s.devices && s.cdi_cri && !s.cdi_annotations);
        assert_eq!(s.to_string(), "devices, cdi-cri");
        assert!(!DeviceListStrategy::default().uses_cdi());
        let e = DeviceListStrategy::parse(["cdi"]).unwrap_err();
        assert!(e.contains("unknown device-list strategy \"cdi\""), "{e}");
        assert!(DeviceListStrategy::parse([]).is_err());
    }

    #[test]
    fn annotation_keys_fit_kubernetes_limits() {
        assert_eq!(
            annotation_key("devicelet.io/fuse"),
            "cdi.k8s.io/devicelet_devicelet.io_fuse"
        );
        let long = annotation_key(&format!("example.com/{}", "x".repeat(60)));
        let name = long.strip_prefix("cdi.k8s.io/").unwrap();
        assert!(name.len() <= MAX_ANNOTATION_NAME, "{long}");
    }
}
