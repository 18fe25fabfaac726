//! Device taints (KEP-5055, `resource.k8s.io/v1`, beta and on by default since 1.36): an
//! unhealthy device stays in its slice with the host's health taint, so the scheduler gives it
//! only to a claim that tolerates the taint, and the cluster still sees the device and why it is
//! sick. API servers without the DRADeviceTaints feature drop the field on write; the publisher
//! notices and withdraws unhealthy devices instead (see `slices`).

use k8s_openapi::api::resource::v1::{DeviceTaint, DeviceToleration};

/// The key of the taint the host puts on a device its module reports unhealthy. One key for
/// every driver, so one toleration (`key: devicelet.io/unhealthy, operator: Exists`) lets a
/// claim take sick devices of any of them.
pub const HEALTH_KEY: &str = "devicelet.io/unhealthy";
/// Keeps the device from new claims that do not tolerate it, and leaves running pods alone
/// (`NoExecute` would have the eviction controller delete them on every health blip).
pub const HEALTH_EFFECT: &str = "NoSchedule";
/// `DeviceTaintsMaxLength` in 1.34 (16 since 1.35): the host adds one.
pub const MAX_TAINTS: usize = 4;

/// The health taint for a device unhealthy because of `reason` (the module's words, made a
/// label value: other characters become `-`, cut to 63 bytes).
pub fn health_taint(reason: Option<&str>) -> DeviceTaint {
    let value = label_value(reason.unwrap_or_default());
    DeviceTaint {
        key: HEALTH_KEY.to_owned(),
        value: (!value.is_empty()).then_some(value),
        effect: HEALTH_EFFECT.to_owned(),
        time_added: None,
    }
}

/// `text` as a Kubernetes label value: at most 63 bytes of `[A-Za-z0-9._-]`, beginning and
/// ending with a letter or digit; runs of anything else become one `-`.
pub fn label_value(text: &str) -> String {
    let mut out = String::new();
    for c in text.chars() {
        if c.is_ascii_alphanumeric() || c == '.' || c == '_' {
            out.push(c);
        } else if !out.ends_with('-') {
            out.push('-');
        }
    }
    out.truncate(63);
    out.trim_matches(|c: char| !c.is_ascii_alphanumeric())
        .to_owned()
}

/// Whether two taints are the same taint (the server's `timeAdded` aside).
pub fn same(a: &DeviceTaint, b: &DeviceTaint) -> bool {
    a.key == b.key
        && a.effect == b.effect
        && a.value.as_deref().unwrap_or_default() == b.value.as_deref().unwrap_or_default()
}

/// Whether `toleration` tolerates `taint`, as the scheduler decides it
/// (`k8s.io/dynamic-resource-allocation/resourceclaim.ToleratesTaint`): an empty effect or key
/// matches any; operator `Exists` matches any value, `Equal` (the default) only the same value;
/// any other operator matches nothing.
pub fn tolerates(toleration: &DeviceToleration, taint: &DeviceTaint) -> bool {
    if given(&toleration.effect).is_some_and(|e| e != taint.effect) {
        return false;
    }
    if given(&toleration.key).is_some_and(|k| k != taint.key) {
        return false;
    }
    match toleration.operator.as_deref().unwrap_or_default() {
        "" | "Equal" => {
            toleration.value.as_deref().unwrap_or_default()
                == taint.value.as_deref().unwrap_or_default()
        }
        "Exists" => true,
        _ => false,
    }
}

fn given(field: &Option<String>) -> Option<&str> {
    field.as_deref().filter(|s| !s.is_empty())
}

/// Whether `taint` keeps a device from a claim without a toleration for it: `None` and effects
/// this agent does not know are informational ("consumers must treat unknown effects like
/// None").
pub fn binding(taint: &DeviceTaint) -> bool {
    matches!(taint.effect.as_str(), "NoSchedule" | "NoExecute")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toleration(key: &str, operator: &str, value: &str, effect: &str) -> DeviceToleration {
        let some = |s: &str| (!s.is_empty()).then(|| s.to_owned());
        DeviceToleration {
            key: some(key),
            operator: some(operator),
            value: some(value),
            effect: some(effect),
            toleration_seconds: None,
        }
    }

    #[test]
    fn a_reason_becomes_a_label_value() {
        assert_eq!(
            label_value("XID 79: GPU has fallen off the bus"),
            "XID-79-GPU-has-fallen-off-the-bus"
        );
        assert_eq!(label_value("  --ok--  "), "ok");
        assert_eq!(label_value("ünïcode"), "n-code");
        assert_eq!(label_value(""), "");
        let long = label_value(&"a".repeat(100));
        assert_eq!(long.len(), 63);
        // Cut so that it still ends with an alphanumeric.
        let cut = label_value(&format!("{}-b", "a".repeat(62)));
        assert_eq!(cut, "a".repeat(62));
        let taint = health_taint(None);
        assert_eq!(taint.value, None);
        assert_eq!(
            (taint.key.as_str(), taint.effect.as_str()),
            (HEALTH_KEY, "NoSchedule")
        );
    }

    #[test]
    fn tolerations_match_as_the_scheduler_matches_them() {
        let taint = health_taint(Some("xid 79"));
        assert_eq!(taint.value.as_deref(), Some("xid-79"));
        // Matching: the empty toleration, Exists on the key, Equal with the value, the effect.
        for t in [
            toleration("", "Exists", "", ""),
            toleration(HEALTH_KEY, "Exists", "", ""),
            toleration(HEALTH_KEY, "Exists", "", "NoSchedule"),
            toleration(HEALTH_KEY, "", "xid-79", ""),
            toleration(HEALTH_KEY, "Equal", "xid-79", "NoSchedule"),
        ] {
            assert!(tolerates(&t, &taint), "{t:?}");
        }
        // Not matching: another key, value or effect, an unknown operator; and a toleration
        // with neither key nor operator is `Equal` to an empty value, which this taint's is not.
        for t in [
            toleration("other.io/x", "Exists", "", ""),
            toleration(HEALTH_KEY, "Equal", "xid-48", ""),
            toleration(HEALTH_KEY, "Exists", "", "NoExecute"),
            toleration(HEALTH_KEY, "Gt", "1", ""),
            toleration("", "", "", ""),
        ] {
            assert!(!tolerates(&t, &taint), "{t:?}");
        }
        assert!(binding(&taint));
        let informational = DeviceTaint {
            effect: "None".into(),
            ..taint.clone()
        };
        assert!(!binding(&informational));
        let later: DeviceTaint = serde_json::from_value(serde_json::json!({
            "key": HEALTH_KEY, "value": "xid-79", "effect": "NoSchedule",
            "timeAdded": "2026-11-28T19:00:00Z"
        }))
        .expect("a taint");
        assert!(same(&taint, &later));
        assert!(!same(&taint, &health_taint(Some("other"))));
    }
}
