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
    /// The container holding the devices, once the PodResources `List` has shown it.
    pub holder: Option<Holder>,
}

/// A container as the PodResources API names it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Holder {
    pub namespace: String,
    pub pod: String,
    pub container: String,
}

impl std::fmt::Display for Holder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}/{}", self.namespace, self.pod, self.container)
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
            holder: Some(Holder {
                namespace: "ns".into(),
                pod: "p".into(),
                container: "c".into(),
            }),
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
    fn missing_holder_reads_as_none() {
        let e: Entry =
            serde_json::from_str(r#"{"id":1,"resource":"r","device_ids":["a"],"allocated_at":5}"#)
                .unwrap();
        assert_eq!(e.holder, None);
    }
}
