//! The scheduler's choice of devices for one request of a claim, as the structured allocator
//! (`k8s.io/dynamic-resource-allocation/structured`, with every DRA feature of 1.36 on) makes
//! it for one driver on one node: from complete pools only; never a device another claim holds
//! (admin access aside) or whose `NoSchedule`/`NoExecute` taint the request does not tolerate;
//! partitionable devices (KEP-4815) only while the pool's shared counters cover what they and
//! every allocated device consume (a pool whose device names a counter set or counter it does
//! not define is invalid and skipped); consumable capacity (KEP-5075): a device with
//! `allowMultipleAllocations` is shared by claims whose requests fit in what is left of each
//! capacity, each consuming its request rounded up by the capacity's `requestPolicy` (its
//! `default`, or the whole capacity, when the request names none) and getting a `shareID`; a
//! request for capacity a device lacks, or over it, passes that device over. The search tries
//! combinations in slice order and takes the first that fits, as the allocator does.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::{Value, json};

use devicelet_api::quantity;

/// What one claim's request asks for.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DeviceRequest {
    pub count: usize,
    /// `DeviceToleration` objects.
    pub tolerations: Vec<Value>,
    /// `capacity.requests`: name → quantity.
    pub capacity: BTreeMap<String, String>,
    /// Selectors: attribute name → the value it must have, as a CEL selector
    /// `device.attributes["<driver>"].<name> == "<value>"` selects (a string, integer, bool or
    /// version attribute, compared as written).
    pub attributes: BTreeMap<String, String>,
    /// Opaque parameters for the driver (`devices.config[].opaque.parameters`), copied into
    /// the allocation as the scheduler copies a claim's config.
    pub config: Option<Value>,
}

/// (pool, device).
type DeviceKey = (String, String);
/// Counter set → counter → nano-units.
type Counters = BTreeMap<String, BTreeMap<String, i128>>;

/// One device of a complete pool, as the allocator sees it.
struct Candidate {
    key: DeviceKey,
    device: Value,
    /// Counter set → counter → amount it consumes.
    consumes: Counters,
    multiple: bool,
}

/// What claims hold already.
#[derive(Default)]
pub struct Allocated {
    /// Devices held whole (results without a `shareID`, admin access aside).
    pub whole: BTreeSet<DeviceKey>,
    /// Capacity consumed by the shares of each device (results with a `shareID`).
    pub shared: BTreeMap<DeviceKey, BTreeMap<String, i128>>,
}

impl Allocated {
    /// From every claim's allocation results for `driver`.
    pub fn of(claims: &[Value], driver: &str) -> Allocated {
        let mut allocated = Allocated::default();
        let results = claims.iter().flat_map(|c| {
            c["status"]["allocation"]["devices"]["results"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        });
        for r in results.filter(|r| r["driver"] == driver && r["adminAccess"] != true) {
            let (Some(pool), Some(device)) = (r["pool"].as_str(), r["device"].as_str()) else {
                continue;
            };
            let key = (pool.to_owned(), device.to_owned());
            if r["shareID"].is_string() {
                let used = allocated.shared.entry(key).or_default();
                for (name, q) in r["consumedCapacity"].as_object().into_iter().flatten() {
                    *used.entry(name.clone()).or_default() +=
                        q.as_str().and_then(quantity::parse).unwrap_or_default();
                }
            } else {
                allocated.whole.insert(key);
            }
        }
        allocated
    }

    fn holds(&self, key: &DeviceKey) -> bool {
        self.whole.contains(key) || self.shared.contains_key(key)
    }
}

/// Why nothing could be allocated, for the error.
#[derive(Debug, Default)]
pub struct Shortfall {
    /// Devices that passed every check but counters.
    pub free: usize,
    pub tainted: usize,
    /// Devices whose capacity cannot take the request (lacking it, over it, or off its policy).
    pub capacity: usize,
    /// Pools skipped as invalid, each with why.
    pub invalid: Vec<String>,
}

/// The results for `request` from the `slices` of one driver on one node (every pool's, any
/// generation), or why there are none.
pub fn allocate(
    slices: &[Value],
    allocated: &Allocated,
    request: &DeviceRequest,
    mut share_id: impl FnMut() -> String,
) -> Result<Vec<(DeviceKey, Option<Value>)>, Shortfall> {
    let mut shortfall = Shortfall::default();
    let driver = slices
        .first()
        .and_then(|s| s["spec"]["driver"].as_str())
        .unwrap_or_default();
    let mut candidates = Vec::new();
    let mut available: BTreeMap<String, Counters> = BTreeMap::new();
    for (pool, current) in complete_pools(slices) {
        match pool_candidates(&pool, &current) {
            Ok((sets, devices)) => {
                let mut left = sets;
                for d in devices.iter().filter(|d| allocated.holds(&d.key)) {
                    subtract(&mut left, &d.consumes);
                }
                available.insert(pool.clone(), left);
                candidates.extend(devices);
            }
            Err(why) => shortfall.invalid.push(format!("{pool}: {why}")),
        }
    }
    let mut usable: Vec<(Candidate, Option<Value>)> = Vec::new();
    for c in candidates {
        if allocated.whole.contains(&c.key) || (!c.multiple && allocated.holds(&c.key)) {
            continue;
        }
        match selected(&c.device, driver, &request.attributes) {
            Some(true) => {}
            Some(false) => continue,
            None => {
                shortfall.invalid.push(format!(
                    "{}: CEL runtime error: the selector's attribute is missing or not a string",
                    c.key.1
                ));
                return Err(shortfall);
            }
        }
        if untolerated(&c.device, &request.tolerations) {
            shortfall.tainted += 1;
            continue;
        }
        let used = allocated.shared.get(&c.key).cloned().unwrap_or_default();
        match fits(&c.device, &request.capacity, &used) {
            Some(consumed) => {
                let consumed = c.multiple.then(|| json!(consumed));
                usable.push((c, consumed));
            }
            None => shortfall.capacity += 1,
        }
    }
    shortfall.free = usable.len();
    let mut chosen = Vec::new();
    if choose(
        &usable,
        0,
        request.count,
        &available,
        allocated,
        &mut chosen,
    ) {
        Ok(chosen
            .into_iter()
            .map(|i| {
                let (c, consumed) = &usable[i];
                let share = consumed
                    .as_ref()
                    .map(|consumed| json!({"shareID": share_id(), "consumedCapacity": consumed}));
                (c.key.clone(), share)
            })
            .collect())
    } else {
        Err(shortfall)
    }
}

/// The first `count` of `usable` from `from` on whose counters fit together, by index.
fn choose(
    usable: &[(Candidate, Option<Value>)],
    from: usize,
    count: usize,
    available: &BTreeMap<String, Counters>,
    allocated: &Allocated,
    chosen: &mut Vec<usize>,
) -> bool {
    if count == 0 {
        return true;
    }
    for i in from..usable.len() {
        let c = &usable[i].0;
        // A shared device already in use had its counters taken by its first share.
        let counted = !(c.multiple && allocated.shared.contains_key(&c.key));
        let mut left = available.get(&c.key.0).cloned().unwrap_or_default();
        for &j in chosen.iter() {
            let other = &usable[j].0;
            if other.key.0 == c.key.0
                && !(other.multiple && allocated.shared.contains_key(&other.key))
            {
                subtract(&mut left, &other.consumes);
            }
        }
        if counted {
            subtract(&mut left, &c.consumes);
            if left.values().flat_map(BTreeMap::values).any(|v| *v < 0) {
                continue;
            }
        }
        chosen.push(i);
        if choose(usable, i + 1, count - 1, available, allocated, chosen) {
            return true;
        }
        chosen.pop();
    }
    false
}

fn subtract(left: &mut Counters, consumes: &Counters) {
    for (set, counters) in consumes {
        let Some(have) = left.get_mut(set) else {
            continue;
        };
        for (name, amount) in counters {
            if let Some(v) = have.get_mut(name) {
                *v -= amount;
            }
        }
    }
}

/// Each pool of `slices` whose newest generation is complete, with that generation's slices.
fn complete_pools(slices: &[Value]) -> Vec<(String, Vec<&Value>)> {
    let mut pools: BTreeMap<String, Vec<&Value>> = BTreeMap::new();
    for slice in slices {
        let pool = slice["spec"]["pool"]["name"].as_str().unwrap_or_default();
        pools.entry(pool.to_owned()).or_default().push(slice);
    }
    pools
        .into_iter()
        .filter_map(|(pool, slices)| {
            let generation = |s: &Value| s["spec"]["pool"]["generation"].as_i64();
            let newest = slices.iter().filter_map(|s| generation(s)).max()?;
            let current: Vec<&Value> = slices
                .into_iter()
                .filter(|s| generation(s) == Some(newest))
                .collect();
            let expected = current
                .first()
                .and_then(|s| s["spec"]["pool"]["resourceSliceCount"].as_u64())
                .unwrap_or(0);
            (current.len() as u64 == expected).then_some((pool, current))
        })
        .collect()
}

/// A complete pool's shared counters and devices, or why the pool is invalid.
fn pool_candidates(pool: &str, slices: &[&Value]) -> Result<(Counters, Vec<Candidate>), String> {
    let mut sets = Counters::new();
    for set in slices.iter().flat_map(|s| {
        s["spec"]["sharedCounters"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    }) {
        let counters = amounts(&set["counters"]);
        sets.insert(
            set["name"].as_str().unwrap_or_default().to_owned(),
            counters,
        );
    }
    let mut devices = Vec::new();
    for device in slices
        .iter()
        .flat_map(|s| s["spec"]["devices"].as_array().cloned().unwrap_or_default())
    {
        let name = device["name"].as_str().unwrap_or_default().to_owned();
        let mut consumes = Counters::new();
        for c in device["consumesCounters"].as_array().into_iter().flatten() {
            let set = c["counterSet"].as_str().unwrap_or_default();
            let Some(defined) = sets.get(set) else {
                return Err(format!(
                    "device {name} consumes counter set {set:?}, which the pool does not define"
                ));
            };
            let counters = amounts(&c["counters"]);
            if let Some(missing) = counters.keys().find(|k| !defined.contains_key(*k)) {
                return Err(format!(
                    "device {name} consumes counter {missing:?}, which counter set {set:?} does not have"
                ));
            }
            consumes.insert(set.to_owned(), counters);
        }
        devices.push(Candidate {
            key: (pool.to_owned(), name),
            multiple: device["allowMultipleAllocations"] == true,
            consumes,
            device,
        });
    }
    Ok((sets, devices))
}

/// `{name: {value: quantity}}` as nano-units.
fn amounts(counters: &Value) -> BTreeMap<String, i128> {
    counters
        .as_object()
        .into_iter()
        .flatten()
        .map(|(name, c)| {
            let value = c["value"]
                .as_str()
                .and_then(quantity::parse)
                .unwrap_or_default();
            (name.clone(), value)
        })
        .collect()
}

/// Whether `device` has every attribute `wanted` names, with that value, as the CEL selectors
/// `device.attributes["<driver>"].<name> == "<value>"` read it: the driver's own attributes
/// only (unqualified, or under the driver's domain), compared as strings. None where CEL would
/// fail at run time, which fails the whole claim upstream: a device without the attribute, or
/// with one that is not a string.
fn selected(device: &Value, driver: &str, wanted: &BTreeMap<String, String>) -> Option<bool> {
    let empty = serde_json::Map::new();
    let attributes = device["attributes"].as_object().unwrap_or(&empty);
    let mut all = true;
    for (name, value) in wanted {
        let typed = attributes
            .get(name)
            .or_else(|| attributes.get(&format!("{driver}/{name}")))?;
        all &= typed["string"].as_str()? == value;
    }
    Some(all)
}

/// Whether `device` has a `NoSchedule`/`NoExecute` taint none of `tolerations` tolerates.
fn untolerated(device: &Value, tolerations: &[Value]) -> bool {
    device["taints"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|t| binding(t) && !tolerations.iter().any(|o| tolerates(o, t)))
}

/// A taint the scheduler honours: `NoSchedule` and `NoExecute`; `None` and unknown effects
/// are informational.
fn binding(taint: &Value) -> bool {
    matches!(taint["effect"].as_str(), Some("NoSchedule" | "NoExecute"))
}

/// `resourceclaim.ToleratesTaint`: an empty effect or key matches any; `Exists` any value,
/// `Equal` (the default) the same value; another operator nothing.
fn tolerates(toleration: &Value, taint: &Value) -> bool {
    let text = |v: &Value| v.as_str().unwrap_or_default().to_owned();
    let (effect, key) = (text(&toleration["effect"]), text(&toleration["key"]));
    if !effect.is_empty() && effect != text(&taint["effect"]) {
        return false;
    }
    if !key.is_empty() && key != text(&taint["key"]) {
        return false;
    }
    match text(&toleration["operator"]).as_str() {
        "" | "Equal" => text(&toleration["value"]) == text(&taint["value"]),
        "Exists" => true,
        _ => false,
    }
}

/// What the request consumes of each of `device`'s capacities (as quantities), if it fits
/// beside what its shares `used` already: `CmpRequestOverCapacity`.
fn fits(
    device: &Value,
    requested: &BTreeMap<String, String>,
    used: &BTreeMap<String, i128>,
) -> Option<BTreeMap<String, String>> {
    let capacity = device["capacity"].as_object().cloned().unwrap_or_default();
    if requested.keys().any(|name| !capacity.contains_key(name)) {
        return None;
    }
    let mut consumed = BTreeMap::new();
    for (name, cap) in &capacity {
        let value = cap["value"].as_str().and_then(quantity::parse)?;
        let policy = &cap["requestPolicy"];
        let asked = match requested.get(name) {
            Some(q) => Some(quantity::parse(q)?),
            None => None,
        };
        let amount = consumed_amount(asked, value, policy);
        if violates(amount, policy) {
            return None;
        }
        if used.get(name).copied().unwrap_or_default() + amount > value {
            return None;
        }
        consumed.insert(name.clone(), quantity::format(amount));
    }
    Some(consumed)
}

/// `calculateConsumedCapacity`: no request → the policy's default, else the whole capacity;
/// a request rounded up to the policy's range (`min` + a multiple of `step`) or to its next
/// valid value.
fn consumed_amount(asked: Option<i128>, value: i128, policy: &Value) -> i128 {
    let q = |v: &Value| v.as_str().and_then(quantity::parse);
    let Some(asked) = asked else {
        return q(&policy["default"]).unwrap_or(value);
    };
    if let Some(min) = q(&policy["validRange"]["min"]) {
        if asked < min {
            return min;
        }
        return match q(&policy["validRange"]["step"]).filter(|s| *s > 0) {
            Some(step) => min + (asked - min + step - 1) / step * step,
            None => asked,
        };
    }
    if let Some(values) = policy["validValues"].as_array() {
        return values
            .iter()
            .filter_map(q)
            .find(|v| asked <= *v)
            .unwrap_or(asked);
    }
    asked
}

/// `violatesPolicy`: over the range's `max`, off its steps, or not one of the valid values
/// (the default always passes).
fn violates(amount: i128, policy: &Value) -> bool {
    let q = |v: &Value| v.as_str().and_then(quantity::parse);
    if policy.is_null() || q(&policy["default"]) == Some(amount) {
        return false;
    }
    if policy["validRange"].is_object() {
        if q(&policy["validRange"]["max"]).is_some_and(|max| amount > max) {
            return true;
        }
        let min = q(&policy["validRange"]["min"]).unwrap_or_default();
        return q(&policy["validRange"]["step"])
            .filter(|s| *s > 0)
            .is_some_and(|step| (amount - min) % step != 0);
    }
    match policy["validValues"].as_array() {
        Some(values) if !values.is_empty() => !values.iter().filter_map(q).any(|v| v == amount),
        _ => false,
    }
}

/// How much is left, for showing a driver's pools (`try --dra`, `simulate --dra`): of each
/// counter set (pool, set) and of each shared device's capacities (pool, device), every
/// amount as (total, left), in nano-units.
#[derive(Debug, Default, PartialEq)]
pub struct Left {
    pub counters: BTreeMap<DeviceKey, BTreeMap<String, (i128, i128)>>,
    pub capacity: BTreeMap<DeviceKey, BTreeMap<String, (i128, i128)>>,
}

/// What claims leave of the counters and shared capacities of `driver`'s complete pools.
pub fn left(slices: &[Value], allocated: &Allocated) -> Left {
    let mut out = Left::default();
    for (pool, current) in complete_pools(slices) {
        let Ok((sets, devices)) = pool_candidates(&pool, &current) else {
            continue;
        };
        let mut remaining = sets.clone();
        for d in devices.iter().filter(|d| allocated.holds(&d.key)) {
            subtract(&mut remaining, &d.consumes);
        }
        for (set, counters) in &sets {
            let amounts = counters
                .iter()
                .map(|(name, total)| {
                    let left = remaining[set].get(name).copied().unwrap_or(*total);
                    (name.clone(), (*total, left))
                })
                .collect();
            out.counters.insert((pool.clone(), set.clone()), amounts);
        }
        for d in devices.iter().filter(|d| d.multiple) {
            let used = allocated.shared.get(&d.key).cloned().unwrap_or_default();
            let amounts = d.device["capacity"]
                .as_object()
                .into_iter()
                .flatten()
                .filter_map(|(name, cap)| {
                    let total = cap["value"].as_str().and_then(quantity::parse)?;
                    let left = total - used.get(name).copied().unwrap_or_default();
                    Some((name.clone(), (total, left)))
                })
                .collect();
            out.capacity.insert(d.key.clone(), amounts);
        }
    }
    out
}
