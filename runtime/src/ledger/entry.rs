//! What the ledger records: one entry per `Allocate` answered, and who holds it.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

/// One `Allocate` the agent answered (or one allocation adopted from the kubelet's PodResources).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    /// Unique within a ledger's lifetime, never reused (the counter is checkpointed).
    pub id: u64,
    /// Extended resource name, e.g. `devicelet.io/fuse`.
    pub resource: String,
    /// The device ids the kubelet asked for, in its order.
    pub device_ids: Vec<String>,
    /// When the entry was made, at millisecond precision (the checkpoint stores unix millis).
    #[serde(with = "unix_millis")]
    pub allocated_at: SystemTime,
    /// Who holds the devices, once the front end has learned it (the device-plugin front end:
    /// from the PodResources `List`).
    pub holder: Option<Holder>,
}

/// Who an allocation belongs to: a container (the device-plugin API allocates per container) or
/// a resource claim (Dynamic Resource Allocation prepares per claim). Written untagged, so a
/// container reads and writes exactly as checkpoints before claims existed.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Holder {
    /// A container, as the PodResources API names it.
    Container {
        namespace: String,
        pod: String,
        container: String,
    },
    /// A ResourceClaim, by namespace, name and UID (a claim deleted and made again under the same
    /// name is another claim).
    Claim {
        namespace: String,
        claim: String,
        uid: String,
    },
}

impl Holder {
    pub fn container(namespace: &str, pod: &str, container: &str) -> Holder {
        Holder::Container {
            namespace: namespace.into(),
            pod: pod.into(),
            container: container.into(),
        }
    }
}

impl std::fmt::Display for Holder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Holder::Container {
                namespace,
                pod,
                container,
            } => write!(f, "{namespace}/{pod}/{container}"),
            Holder::Claim {
                namespace, claim, ..
            } => write!(f, "{namespace} claim {claim}"),
        }
    }
}

/// Unix milliseconds of `t`; 0 before the epoch, saturating far in the future.
pub(crate) fn to_millis(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

fn from_millis(ms: u64) -> Option<SystemTime> {
    UNIX_EPOCH.checked_add(Duration::from_millis(ms))
}

/// `t` cut to what the checkpoint keeps, so a restored entry equals the one recorded.
pub(crate) fn truncate_to_millis(t: SystemTime) -> SystemTime {
    from_millis(to_millis(t)).unwrap_or(UNIX_EPOCH)
}

/// `SystemTime` as a JSON number of unix milliseconds.
mod unix_millis {
    use std::time::SystemTime;

    use serde::de::Error as _;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(t: &SystemTime, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(super::to_millis(*t))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<SystemTime, D::Error> {
        let ms = u64::deserialize(d)?;
        super::from_millis(ms).ok_or_else(|| D::Error::custom(format!("time {ms} ms out of range")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocated_at_is_unix_millis_and_round_trips() {
        let entry = Entry {
            id: 7,
            resource: "devicelet.io/fuse".into(),
            device_ids: vec!["fuse-0".into()],
            allocated_at: UNIX_EPOCH + Duration::from_millis(1_700_000_000_123),
            holder: Some(Holder::container("ns", "p", "c")),
        };
        let json = serde_json::to_value(&entry).unwrap();
        assert_eq!(
            json["allocated_at"],
            serde_json::json!(1_700_000_000_123u64)
        );
        assert_eq!(serde_json::from_value::<Entry>(json).unwrap(), entry);
    }

    #[test]
    fn truncation_drops_sub_millisecond_precision() {
        let t = UNIX_EPOCH + Duration::from_nanos(1_700_000_000_123_456_789);
        assert_eq!(
            truncate_to_millis(t),
            UNIX_EPOCH + Duration::from_millis(1_700_000_000_123)
        );
        assert_eq!(to_millis(UNIX_EPOCH - Duration::from_secs(1)), 0);
    }

    #[test]
    fn a_container_holder_is_written_as_before_claims_and_a_claim_round_trips() {
        // The checkpoint format of every agent before claims existed.
        let old = r#"{"id":1,"resource":"r","device_ids":["a"],"allocated_at":5,"holder":{"namespace":"ns","pod":"p","container":"c"}}"#;
        let e: Entry = serde_json::from_str(old).unwrap();
        assert_eq!(e.holder, Some(Holder::container("ns", "p", "c")));
        assert_eq!(serde_json::to_string(&e).unwrap(), old);
        let claim = Holder::Claim {
            namespace: "ns".into(),
            claim: "gpu-claim".into(),
            uid: "0b5e".into(),
        };
        let json = serde_json::to_string(&claim).unwrap();
        assert_eq!(serde_json::from_str::<Holder>(&json).unwrap(), claim);
        assert_eq!(claim.to_string(), "ns claim gpu-claim");
    }

    #[test]
    fn missing_holder_reads_as_none() {
        let e: Entry =
            serde_json::from_str(r#"{"id":1,"resource":"r","device_ids":["a"],"allocated_at":5}"#)
                .unwrap();
        assert_eq!(e.holder, None);
    }
}
