//! Sharing for any resource: each physical device advertised as several replicas
//! (`<id>::<n>`), with the health and topology of the device, while the module only ever sees
//! physical IDs.
//!
//! A [`Replicated`] backend wraps the module's: `enumerate` is expanded, the IDs of `allocate` and
//! `prestart` are mapped back to physical ones (each once), and `preferred` is the host's. The
//! backend's upkeep (budget, version, runtime) is not a call and does not pass through here. The
//! core and the front ends then need nothing special: snapshots, ID checks, prepared answers and the ledger
//! work on replica IDs like on any others. Preferred allocation for a shared resource is always
//! the host's, which knows from the ledger how many replicas of each device are in use.

use std::sync::Arc;

use crate::config::{ShareRule, Sharing};
use crate::device::{ContainerEdits, Device, Inventory, MAX_DEVICES, MAX_ID, Request};
use crate::resource::backend::{BackendError, DeviceBackend};

/// Separates a physical device ID from its replica number.
pub const REPLICA_SEPARATOR: &str = "::";

/// The physical device a replica ID belongs to (`gpu-0::3` → `gpu-0`).
pub fn physical_id(id: &str) -> &str {
    match id.rsplit_once(REPLICA_SEPARATOR) {
        Some((physical, n)) if !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()) => physical,
        _ => id,
    }
}

/// What a shared resource's name gets when its rule renames it.
pub const RENAMED_SUFFIX: &str = ".shared";

/// The served name of a resource the module declared as `name`: `<name>.shared` when its rule
/// shares and renames.
pub fn served_name(name: String, rule: &ShareRule) -> String {
    if rule.rename && rule.shares() {
        format!("{name}{RENAMED_SUFFIX}")
    } else {
        name
    }
}

/// A module's backend with its resources shared as the registry says.
#[derive(Clone)]
pub struct Replicated<B> {
    inner: B,
    sharing: Arc<Sharing>,
}

impl<B: DeviceBackend> Replicated<B> {
    pub fn new(inner: B, sharing: Sharing) -> Self {
        Replicated {
            inner,
            sharing: Arc::new(sharing),
        }
    }

    fn rule(&self, resource: &str) -> Option<&ShareRule> {
        Some(self.sharing.rule(resource)).filter(|r| r.shares())
    }

    /// The physical devices the module is asked for when a container asks for `ids`.
    fn physical_for(&self, resource: &str, ids: Vec<String>) -> Result<Vec<String>, BackendError> {
        let Some(rule) = self.rule(resource) else {
            return Ok(ids);
        };
        if rule.fail_requests_greater_than_one && ids.len() > 1 {
            return Err(BackendError::Invalid(format!(
                "{resource} is shared: a container may ask for one device only, not {} \
                 (fail-requests-greater-than-one)",
                ids.len()
            )));
        }
        Ok(physical(&ids))
    }
}

/// Each device `replicas_of` times, as `<id>::<n>` when more than once.
fn expand(inventory: Inventory, rule: &ShareRule, module: &str) -> Result<Inventory, BackendError> {
    let Inventory {
        devices,
        counter_sets,
    } = inventory;
    let mut out = Vec::with_capacity(devices.len());
    for d in devices {
        if d.id.contains(REPLICA_SEPARATOR) {
            return Err(BackendError::Failed(format!(
                "module `{module}` listed device {:?}, but `{REPLICA_SEPARATOR}` in an ID is \
                 reserved for replicas when a resource is shared",
                d.id
            )));
        }
        let replicas = rule.replicas_of(&d.id);
        let whole_only = d.exclusive || d.group.is_some() || d.shared.is_some();
        if (whole_only || !d.consumes.is_empty()) && replicas > 1 {
            let why = if d.exclusive {
                "exclusive (never shared)".to_owned()
            } else if d.shared.is_some() {
                "shared by capacity (replicas would multiply its capacity)".to_owned()
            } else if !d.consumes.is_empty() {
                "a partition drawing on counters (replicas would multiply them)".to_owned()
            } else {
                "in a device group (allocated whole, never shared)".to_owned()
            };
            return Err(BackendError::Invalid(format!(
                "module `{module}` marks device {:?} {why}, but the registry's \
                 [module.sharing] gives it {replicas} replicas: no device of the resource is \
                 served until the rule goes (or sets `devices = {{ {:?} = 1 }}`)",
                d.id, d.id
            )));
        }
        if replicas <= 1 {
            out.push(d);
            continue;
        }
        let longest = d.id.len() + REPLICA_SEPARATOR.len() + (replicas - 1).to_string().len();
        if longest > MAX_ID {
            return Err(BackendError::Failed(format!(
                "module `{module}`: device {:?} shared {replicas} ways would have IDs of \
                 {longest} bytes; at most {MAX_ID} allowed",
                d.id
            )));
        }
        if out.len() + replicas as usize > MAX_DEVICES {
            return Err(BackendError::Failed(format!(
                "module `{module}`: sharing would advertise more than {MAX_DEVICES} devices; \
                 lower `replicas`"
            )));
        }
        for n in 0..replicas {
            out.push(Device {
                id: format!("{}{REPLICA_SEPARATOR}{n}", d.id),
                ..d.clone()
            });
        }
    }
    Ok(Inventory {
        devices: out,
        counter_sets,
    })
}

/// Physical IDs of `ids`, each once, in order.
fn physical(ids: &[String]) -> Vec<String> {
    let mut out: Vec<String> = Vec::with_capacity(ids.len());
    for id in ids {
        let p = physical_id(id);
        if !out.iter().any(|o| o == p) {
            out.push(p.to_owned());
        }
    }
    out
}

impl<B: DeviceBackend> DeviceBackend for Replicated<B> {
    fn name(&self) -> &str {
        self.inner.name()
    }

    async fn enumerate(&self, resource: &str) -> Result<Inventory, BackendError> {
        let devices = self.inner.enumerate(resource).await?;
        match self.rule(resource) {
            Some(rule) => expand(devices, rule, self.inner.name()),
            None => Ok(devices),
        }
    }

    async fn allocate(
        &self,
        resource: &str,
        ids: Vec<String>,
    ) -> Result<ContainerEdits, BackendError> {
        let ids = self.physical_for(resource, ids)?;
        self.inner.allocate(resource, ids).await
    }

    async fn allocate_request(&self, request: Request) -> Result<ContainerEdits, BackendError> {
        let ids = self.physical_for(&request.resource, request.ids)?;
        self.inner
            .allocate_request(Request { ids, ..request })
            .await
    }

    async fn release(&self, request: Request) -> Result<(), BackendError> {
        let ids = match self.rule(&request.resource) {
            Some(_) => physical(&request.ids),
            None => request.ids,
        };
        self.inner.release(Request { ids, ..request }).await
    }

    async fn validate_config(&self, resource: &str, config: &str) -> Result<(), BackendError> {
        self.inner.validate_config(resource, config).await
    }

    fn prepares_claims(&self, resource: &str) -> bool {
        self.inner.prepares_claims(resource)
    }

    async fn prepare(&self, request: Request) -> Result<crate::device::Prepared, BackendError> {
        let ids = self.physical_for(&request.resource, request.ids)?;
        self.inner.prepare(Request { ids, ..request }).await
    }

    async fn unprepare(&self, request: Request) -> Result<(), BackendError> {
        let ids = match self.rule(&request.resource) {
            Some(_) => physical(&request.ids),
            None => request.ids,
        };
        self.inner.unprepare(Request { ids, ..request }).await
    }

    async fn preferred(
        &self,
        resource: &str,
        available: Vec<String>,
        must_include: Vec<String>,
        size: u32,
    ) -> Result<Vec<String>, BackendError> {
        if self.rule(resource).is_some() {
            return Err(BackendError::Failed(format!(
                "{resource} is shared: the host answers its preferred allocation"
            )));
        }
        self.inner
            .preferred(resource, available, must_include, size)
            .await
    }

    async fn prestart(&self, resource: &str, ids: Vec<String>) -> Result<(), BackendError> {
        let ids = match self.rule(resource) {
            Some(_) => physical(&ids),
            None => ids,
        };
        self.inner.prestart(resource, ids).await
    }

    fn recheck_after(&self, resource: &str) -> Option<std::time::Duration> {
        self.inner.recheck_after(resource)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::Health;
    use std::sync::Mutex;

    /// Two physical devices; remembers the IDs its calls got.
    #[derive(Clone, Default)]
    struct Module {
        seen: Arc<Mutex<Vec<Vec<String>>>>,
    }

    impl DeviceBackend for Module {
        fn name(&self) -> &str {
            "gpus"
        }

        async fn enumerate(&self, _: &str) -> Result<Inventory, BackendError> {
            Ok(["gpu-0", "gpu-1"]
                .map(|id| Device {
                    id: id.into(),
                    health: Health::Healthy,
                    numa_nodes: vec![1],
                    attributes: Vec::new(),
                    ..crate::device::Device::new("", crate::device::Health::Healthy)
                })
                .into_iter()
                .collect())
        }

        async fn allocate(
            &self,
            _: &str,
            ids: Vec<String>,
        ) -> Result<ContainerEdits, BackendError> {
            self.seen.lock().unwrap().push(ids);
            Ok(ContainerEdits::default())
        }

        async fn prestart(&self, _: &str, ids: Vec<String>) -> Result<(), BackendError> {
            self.seen.lock().unwrap().push(ids);
            Ok(())
        }

        async fn preferred(
            &self,
            _: &str,
            _: Vec<String>,
            _: Vec<String>,
            _: u32,
        ) -> Result<Vec<String>, BackendError> {
            crate::resource::backend::no_preferred(self.name())
        }

        async fn allocate_request(&self, r: Request) -> Result<ContainerEdits, BackendError> {
            self.seen
                .lock()
                .unwrap()
                .push([r.ids, vec![r.config, r.key]].concat());
            Ok(ContainerEdits::default())
        }

        async fn release(&self, r: Request) -> Result<(), BackendError> {
            self.seen
                .lock()
                .unwrap()
                .push([vec!["release".into()], r.ids, vec![r.key]].concat());
            Ok(())
        }

        fn prepares_claims(&self, _: &str) -> bool {
            false
        }

        async fn prepare(&self, _: Request) -> Result<crate::device::Prepared, BackendError> {
            crate::resource::backend::prepares_nothing(self.name())
        }

        async fn unprepare(&self, _: Request) -> Result<(), BackendError> {
            Ok(())
        }

        fn recheck_after(&self, _: &str) -> Option<std::time::Duration> {
            Some(std::time::Duration::from_secs(7))
        }
    }

    fn rule(replicas: u32) -> ShareRule {
        ShareRule {
            replicas,
            devices: [("gpu-1".to_string(), 1)].into(),
            ..ShareRule::default()
        }
    }

    fn strings(ids: &[&str]) -> Vec<String> {
        ids.iter().map(|s| s.to_string()).collect()
    }

    #[tokio::test]
    async fn replicas_are_advertised_and_the_module_sees_physical_ids_once() {
        let module = Module::default();
        let shared = Replicated::new(
            module.clone(),
            Sharing {
                default: rule(3),
                ..Sharing::default()
            },
        );
        let devices = shared.enumerate("gpu").await.unwrap();
        let ids: Vec<&str> = devices.iter().map(|d| d.id.as_str()).collect();
        assert_eq!(ids, ["gpu-0::0", "gpu-0::1", "gpu-0::2", "gpu-1"]);
        assert!(devices.iter().all(|d| d.numa_nodes == [1]), "topology kept");

        shared
            .allocate("gpu", strings(&["gpu-0::2", "gpu-0::0", "gpu-1"]))
            .await
            .unwrap();
        shared
            .prestart("gpu", strings(&["gpu-0::1"]))
            .await
            .unwrap();
        assert_eq!(
            *module.seen.lock().unwrap(),
            [strings(&["gpu-0", "gpu-1"]), strings(&["gpu-0"])]
        );
    }

    #[tokio::test]
    async fn requests_with_config_releases_and_rechecks_reach_the_module_with_physical_ids() {
        let module = Module::default();
        let shared = Replicated::new(
            module.clone(),
            Sharing {
                default: rule(3),
                ..Sharing::default()
            },
        );
        let request = |ids: &[&str]| Request {
            resource: "gpu".into(),
            ids: strings(ids),
            config: r#"{"mode":"x"}"#.into(),
            key: "uid/gpu".into(),
            shares: Vec::new(),
        };
        shared
            .allocate_request(request(&["gpu-0::2", "gpu-0::1"]))
            .await
            .unwrap();
        shared.release(request(&["gpu-0::2"])).await.unwrap();
        assert_eq!(
            *module.seen.lock().unwrap(),
            [
                strings(&["gpu-0", r#"{"mode":"x"}"#, "uid/gpu"]),
                strings(&["release", "gpu-0", "uid/gpu"])
            ]
        );
        assert_eq!(
            shared.recheck_after("gpu"),
            Some(std::time::Duration::from_secs(7))
        );
    }

    #[tokio::test]
    async fn requests_for_more_than_one_can_be_refused() {
        let shared = Replicated::new(
            Module::default(),
            Sharing {
                default: ShareRule {
                    fail_requests_greater_than_one: true,
                    ..rule(2)
                },
                ..Sharing::default()
            },
        );
        shared
            .allocate("gpu", strings(&["gpu-0::0"]))
            .await
            .unwrap();
        let e = shared
            .allocate("gpu", strings(&["gpu-0::0", "gpu-0::1"]))
            .await
            .unwrap_err();
        assert!(matches!(e, BackendError::Invalid(_)), "{e}");
    }

    #[test]
    fn sharing_never_lists_more_devices_or_longer_ids_than_the_host_allows() {
        let many: Vec<Device> = (0..100)
            .map(|i| Device {
                id: format!("d{i}"),
                health: Health::Healthy,
                numa_nodes: Vec::new(),
                attributes: Vec::new(),
                ..crate::device::Device::new("", crate::device::Health::Healthy)
            })
            .collect();
        let e = expand(many.into(), &rule(200), "m").unwrap_err();
        assert!(e.to_string().contains("more than 16384"), "{e}");
        let long = vec![Device {
            id: "x".repeat(125),
            health: Health::Healthy,
            numa_nodes: Vec::new(),
            attributes: Vec::new(),
            ..crate::device::Device::new("", crate::device::Health::Healthy)
        }];
        let e = expand(long.into(), &rule(12), "m").unwrap_err();
        assert!(e.to_string().contains("at most 128"), "{e}");
    }

    #[test]
    fn a_device_shared_by_capacity_or_a_partition_is_never_replicated() {
        let mut shared = Device::new("gpu-0", Health::Healthy);
        shared.shared = Some(crate::device::Shared::default());
        let e = expand(vec![shared].into(), &rule(2), "m").unwrap_err();
        assert!(e.to_string().contains("shared by capacity"), "{e}");
        let mut part = Device::new("gpu-0", Health::Healthy);
        part.consumes = vec![crate::device::CounterUse {
            counter_set: "gpu-0".into(),
            counters: vec![("slices".into(), "1".into())],
        }];
        let e = expand(vec![part].into(), &rule(2), "m").unwrap_err();
        assert!(
            e.to_string().contains("a partition drawing on counters"),
            "{e}"
        );
    }

    #[test]
    fn physical_ids_come_from_replica_ids_only() {
        assert_eq!(physical_id("gpu-0::12"), "gpu-0");
        assert_eq!(physical_id("gpu-0"), "gpu-0");
        assert_eq!(physical_id("a::b"), "a::b");
        assert_eq!(physical_id("a::"), "a::");
    }
}
