//! What WIT 0.3 lets a module say about its devices, as a ResourceSlice says it: the module's
//! own taints, devices several claims share by capacity (`allowMultipleAllocations`, each
//! capacity's `requestPolicy`), partitions that draw on the pool's counter sets
//! (`consumesCounters`), and the counter sets themselves (`sharedCounters`, in slices of their
//! own, as the API requires since 1.35).

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::{
    CapacityRequestPolicy, CapacityRequestPolicyRange, Counter, CounterSet as ApiCounterSet,
    DeviceCounterConsumption, DeviceTaint,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use crate::device::{CounterSet, Device, RequestPolicy, ValidAmounts};

/// The module's own taints of `d`, as the API writes them (the server stamps `timeAdded`).
pub fn own_taints(d: &Device) -> Vec<DeviceTaint> {
    d.taints
        .iter()
        .map(|t| DeviceTaint {
            key: t.key.clone(),
            value: (!t.value.is_empty()).then(|| t.value.clone()),
            effect: t.effect.api().to_owned(),
            time_added: None,
        })
        .collect()
}

/// The request policy of capacity `name` of a device shared by capacity.
pub fn request_policy(d: &Device, name: &str) -> Option<CapacityRequestPolicy> {
    let (_, policy) = d
        .shared
        .as_ref()?
        .policies
        .iter()
        .find(|(n, _)| n == name)?;
    Some(api_policy(policy))
}

fn api_policy(p: &RequestPolicy) -> CapacityRequestPolicy {
    let quantity = |q: &String| Quantity(q.clone());
    let (valid_range, valid_values) = match &p.valid {
        ValidAmounts::Any => (None, None),
        ValidAmounts::Range { min, max, step } => (
            Some(CapacityRequestPolicyRange {
                min: quantity(min),
                max: max.as_ref().map(quantity),
                step: step.as_ref().map(quantity),
            }),
            None,
        ),
        ValidAmounts::Values(values) => (None, Some(values.iter().map(quantity).collect())),
    };
    CapacityRequestPolicy {
        default: p.default.as_ref().map(quantity),
        valid_range,
        valid_values,
    }
}

fn counters(list: &[(String, String)]) -> BTreeMap<String, Counter> {
    list.iter()
        .map(|(name, value)| {
            (
                name.clone(),
                Counter {
                    value: Quantity(value.clone()),
                },
            )
        })
        .collect()
}

/// What `d` takes from the pool's counter sets; None when nothing.
pub fn consumes(d: &Device) -> Option<Vec<DeviceCounterConsumption>> {
    (!d.consumes.is_empty()).then(|| {
        d.consumes
            .iter()
            .map(|u| DeviceCounterConsumption {
                counter_set: u.counter_set.clone(),
                counters: counters(&u.counters),
            })
            .collect()
    })
}

/// The module's counter sets, as a slice's `sharedCounters`.
pub fn counter_sets(sets: &[CounterSet]) -> Vec<ApiCounterSet> {
    sets.iter()
        .map(|s| ApiCounterSet {
            name: s.name.clone(),
            counters: counters(&s.counters),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::{CounterUse, Health, Shared, Taint, TaintEffect};

    #[test]
    fn a_shared_partition_with_taints_reads_as_the_api_writes_it() {
        let mut d = Device::new("gpu-0-mig-1g", Health::Healthy);
        d.capacities = vec![("memory".into(), "10Gi".into())];
        d.shared = Some(Shared {
            policies: vec![(
                "memory".into(),
                RequestPolicy {
                    default: Some("1Gi".into()),
                    valid: ValidAmounts::Range {
                        min: "1Gi".into(),
                        max: None,
                        step: Some("1Gi".into()),
                    },
                },
            )],
        });
        d.consumes = vec![CounterUse {
            counter_set: "gpu-0".into(),
            counters: vec![("memory-slices".into(), "1".into())],
        }];
        d.taints = vec![Taint {
            key: "example.com/maintenance".into(),
            value: String::new(),
            effect: TaintEffect::NoExecute,
        }];
        let policy = request_policy(&d, "memory").expect("a policy");
        assert_eq!(policy.default, Some(Quantity("1Gi".into())));
        let range = policy.valid_range.expect("a range");
        assert_eq!(
            (range.min.0.as_str(), range.step.map(|q| q.0)),
            ("1Gi", Some("1Gi".into()))
        );
        assert!(request_policy(&d, "other").is_none());
        let used = consumes(&d).expect("consumes");
        assert_eq!(used[0].counter_set, "gpu-0");
        assert_eq!(used[0].counters["memory-slices"].value.0, "1");
        let taints = own_taints(&d);
        assert_eq!(
            (taints[0].effect.as_str(), taints[0].value.as_deref()),
            ("NoExecute", None)
        );
        let sets = counter_sets(&[CounterSet {
            name: "gpu-0".into(),
            counters: vec![("memory-slices".into(), "8".into())],
        }]);
        assert_eq!(sets[0].counters["memory-slices"].value.0, "8");
    }
}
