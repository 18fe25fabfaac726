//! What the API server refuses in a `resource.k8s.io/v1` ResourceSlice (`pkg/apis/resource/
//! validation`, limits from `k8s.io/api/resource/v1` 1.34 to 1.36; see `docs/design/dra.md` §4),
//! each cause as the server words it: `<field path>: <what>`.

use serde_json::Value;

use devicelet_api::names::{is_dns1123_label, is_dns1123_subdomain, is_qualified_name};

/// `ResourceSliceMaxDevices`.
pub const MAX_DEVICES: usize = 128;
/// `ResourceSliceMaxDevicesWithAdvancedFeatures`: when any device has taints or consumes
/// counters.
pub const MAX_DEVICES_ADVANCED: usize = 64;
/// `ResourceSliceMaxAttributesAndCapacitiesPerDevice`.
pub const MAX_ATTRIBUTES_AND_CAPACITIES: usize = 32;
/// `DriverNameMaxLength`.
pub const MAX_DRIVER: usize = 63;
/// `DeviceAttributeMaxValueLength`.
pub const MAX_ATTRIBUTE_VALUE: usize = 64;
/// `DeviceMaxIDLength`: the identifier part of an attribute or capacity name.
pub const MAX_ID: usize = 32;
/// `PoolNameMaxLength`.
pub const MAX_POOL: usize = 253;
/// `DeviceTaintsMaxLength` (1.35 on; 4 in 1.34).
pub const MAX_TAINTS: usize = 16;
/// A taint's effects (`None` since 1.35).
const EFFECTS: [&str; 3] = ["NoExecute", "NoSchedule", "None"];

const SUBDOMAIN: &str = "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric \
                         characters, '-' or '.', and must start and end with an alphanumeric \
                         character";
const LABEL: &str = "a lowercase RFC 1123 label must consist of lower case alphanumeric \
                     characters or '-', and must start and end with an alphanumeric character";

/// `metadata.name` of any object: a DNS subdomain.
pub fn object_name(name: &str) -> Vec<String> {
    if is_dns1123_subdomain(name) {
        Vec::new()
    } else {
        vec![format!(
            "metadata.name: Invalid value: {name:?}: {SUBDOMAIN}"
        )]
    }
}

/// Every cause the server gives for refusing this ResourceSlice; empty when it is valid.
pub fn resource_slice(name: &str, slice: &Value) -> Vec<String> {
    let mut causes = object_name(name);
    let spec = &slice["spec"];
    match spec["driver"].as_str() {
        None | Some("") => causes.push("spec.driver: Required value".into()),
        Some(driver) if driver.len() > MAX_DRIVER => causes.push(format!(
            "spec.driver: Too long: may not be more than {MAX_DRIVER} bytes"
        )),
        Some(driver) if !is_dns1123_subdomain(driver) => causes.push(format!(
            "spec.driver: Invalid value: {driver:?}: {SUBDOMAIN}"
        )),
        Some(_) => {}
    }
    pool(&spec["pool"], &mut causes);
    let placements = [
        "nodeName",
        "nodeSelector",
        "allNodes",
        "perDeviceNodeSelection",
    ];
    let set: Vec<&str> = placements
        .into_iter()
        .filter(|k| match &spec[*k] {
            Value::Null => false,
            Value::Bool(b) => *b,
            Value::String(s) => !s.is_empty(),
            _ => true,
        })
        .collect();
    if set.len() != 1 {
        causes.push(format!(
            "spec: Invalid value: {set:?}: exactly one of `nodeName`, `nodeSelector`, `allNodes`, \
             `perDeviceNodeSelection` is required"
        ));
    }
    if let Some(node) = spec["nodeName"].as_str()
        && !node.is_empty()
        && !is_dns1123_subdomain(node)
    {
        causes.push(format!(
            "spec.nodeName: Invalid value: {node:?}: {SUBDOMAIN}"
        ));
    }
    let devices = spec["devices"].as_array().map(Vec::as_slice).unwrap_or(&[]);
    counter_sets(spec, !devices.is_empty(), &mut causes);
    let advanced = devices
        .iter()
        .any(|d| !d["taints"].is_null() || !d["consumesCounters"].is_null());
    let limit = if advanced {
        MAX_DEVICES_ADVANCED
    } else {
        MAX_DEVICES
    };
    if devices.len() > limit {
        causes.push(format!(
            "spec.devices: Too many: {}: must have at most {limit} items",
            devices.len()
        ));
    }
    let mut seen = std::collections::BTreeSet::new();
    for (i, device) in devices.iter().enumerate() {
        let at = format!("spec.devices[{i}]");
        match device["name"].as_str() {
            None | Some("") => causes.push(format!("{at}.name: Required value")),
            Some(name) if !is_dns1123_label(name) => {
                causes.push(format!("{at}.name: Invalid value: {name:?}: {LABEL}"))
            }
            Some(name) if !seen.insert(name.to_string()) => {
                causes.push(format!("{at}.name: Duplicate value: {name:?}"))
            }
            Some(_) => {}
        }
        device_fields(&at, device, &mut causes);
        taints(&at, device, &mut causes);
        let consumes = device["consumesCounters"].as_array().map_or(0, Vec::len);
        if consumes > MAX_CONSUMPTIONS {
            causes.push(format!(
                "{at}.consumesCounters: Too many: {consumes}: must have at most \
                 {MAX_CONSUMPTIONS} items"
            ));
        }
    }
    causes
}

/// `ResourceSliceMaxCounterSets`, `ResourceSliceMaxCountersPerCounterSet` and
/// `ResourceSliceMaxDeviceCounterConsumptionsPerDevice` (1.35 on).
const MAX_COUNTER_SETS: usize = 8;
const MAX_COUNTERS: usize = 32;
const MAX_CONSUMPTIONS: usize = 2;

/// `spec.sharedCounters`: in a slice of their own (1.35 on), at most 8 sets of at most 32
/// counters, each set named by a DNS label, each counter a quantity.
fn counter_sets(spec: &Value, has_devices: bool, causes: &mut Vec<String>) {
    let sets = spec["sharedCounters"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or(&[]);
    if sets.is_empty() {
        return;
    }
    if has_devices {
        causes.push(
            "spec: Invalid value: only one of `devices` and `sharedCounters` may be set".into(),
        );
    }
    if sets.len() > MAX_COUNTER_SETS {
        causes.push(format!(
            "spec.sharedCounters: Too many: {}: must have at most {MAX_COUNTER_SETS} items",
            sets.len()
        ));
    }
    for (i, set) in sets.iter().enumerate() {
        let at = format!("spec.sharedCounters[{i}]");
        if !set["name"].as_str().is_some_and(is_dns1123_label) {
            causes.push(format!(
                "{at}.name: Invalid value: {}: {LABEL}",
                set["name"]
            ));
        }
        let counters = set["counters"].as_object().cloned().unwrap_or_default();
        if counters.is_empty() || counters.len() > MAX_COUNTERS {
            causes.push(format!(
                "{at}.counters: Invalid value: {}: must have between 1 and {MAX_COUNTERS} counters",
                counters.len()
            ));
        }
        for (name, counter) in &counters {
            if !counter["value"].as_str().is_some_and(is_quantity) {
                causes.push(format!(
                    "{at}.counters[{name:?}].value: Invalid value: {}: must be a quantity",
                    counter["value"]
                ));
            }
        }
    }
}

/// A device's taints: each a label key, an optional label value and a known effect.
fn taints(at: &str, device: &Value, causes: &mut Vec<String>) {
    let taints = device["taints"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or(&[]);
    if taints.len() > MAX_TAINTS {
        causes.push(format!(
            "{at}.taints: Too many: {}: must have at most {MAX_TAINTS} items",
            taints.len()
        ));
    }
    for (j, taint) in taints.iter().enumerate() {
        let field = format!("{at}.taints[{j}]");
        match taint["key"].as_str() {
            None | Some("") => causes.push(format!("{field}.key: Required value")),
            Some(key) if !is_qualified_name(key) => causes.push(format!(
                "{field}.key: Invalid value: {key:?}: name part must consist of alphanumeric \
                 characters, '-', '_' or '.', and must start and end with an alphanumeric \
                 character"
            )),
            Some(_) => {}
        }
        if let Some(value) = taint["value"].as_str()
            && !is_label_value(value)
        {
            causes.push(format!(
                "{field}.value: Invalid value: {value:?}: a valid label must be an empty string \
                 or consist of alphanumeric characters, '-', '_' or '.', and must start and end \
                 with an alphanumeric character"
            ));
        }
        match taint["effect"].as_str() {
            None | Some("") => causes.push(format!("{field}.effect: Required value")),
            Some(effect) if !EFFECTS.contains(&effect) => causes.push(format!(
                "{field}.effect: Unsupported value: {effect:?}: supported values: \"NoExecute\", \
                 \"NoSchedule\", \"None\""
            )),
            Some(_) => {}
        }
    }
}

use devicelet_api::names::is_label_value;

fn pool(pool: &Value, causes: &mut Vec<String>) {
    match pool["name"].as_str() {
        None | Some("") => causes.push("spec.pool.name: Required value".into()),
        Some(name) if name.len() > MAX_POOL => causes.push(format!(
            "spec.pool.name: Too long: may not be more than {MAX_POOL} bytes"
        )),
        Some(name) if !name.split('/').all(is_dns1123_subdomain) => causes.push(format!(
            "spec.pool.name: Invalid value: {name:?}: must be one or more DNS sub-domains separated by slashes"
        )),
        Some(_) => {}
    }
    if pool["generation"].as_i64().is_some_and(|g| g < 0) {
        causes
            .push("spec.pool.generation: Invalid value: must be greater than or equal to 0".into());
    }
    if pool["resourceSliceCount"].as_i64().is_none_or(|c| c <= 0) {
        causes
            .push("spec.pool.resourceSliceCount: Invalid value: must be greater than zero".into());
    }
}

/// Attributes and capacities of one device.
fn device_fields(at: &str, device: &Value, causes: &mut Vec<String>) {
    let empty = serde_json::Map::new();
    let attributes = device["attributes"].as_object().unwrap_or(&empty);
    let capacity = device["capacity"].as_object().unwrap_or(&empty);
    if attributes.len() + capacity.len() > MAX_ATTRIBUTES_AND_CAPACITIES {
        causes.push(format!(
            "{at}: Too many: {}: the total number of attributes and capacities must not exceed {MAX_ATTRIBUTES_AND_CAPACITIES}",
            attributes.len() + capacity.len()
        ));
    }
    for (name, value) in attributes {
        let field = format!("{at}.attributes[{name:?}]");
        qualified(&field, name, causes);
        let kinds: Vec<&str> = ["int", "bool", "string", "version"]
            .into_iter()
            .filter(|k| !value[*k].is_null())
            .collect();
        if kinds.len() != 1 {
            causes.push(format!(
                "{field}: Invalid value: {kinds:?}: exactly one value must be specified"
            ));
            continue;
        }
        let ok = match kinds[0] {
            "int" => value["int"].is_i64(),
            "bool" => value["bool"].is_boolean(),
            "string" => value["string"]
                .as_str()
                .is_some_and(|s| s.len() <= MAX_ATTRIBUTE_VALUE),
            _ => value["version"]
                .as_str()
                .is_some_and(|v| v.len() <= MAX_ATTRIBUTE_VALUE && is_semver(v)),
        };
        if !ok {
            causes.push(format!(
                "{field}.{}: Invalid value: {}: must be a {} of at most {MAX_ATTRIBUTE_VALUE} bytes",
                kinds[0], value[kinds[0]], kinds[0]
            ));
        }
    }
    for (name, value) in capacity {
        let field = format!("{at}.capacity[{name:?}]");
        qualified(&field, name, causes);
        if !value["value"].as_str().is_some_and(is_quantity) {
            causes.push(format!(
                "{field}.value: Invalid value: {}: must be a quantity such as \"80Gi\"",
                value["value"]
            ));
        }
    }
}

/// An attribute or capacity name: an optional domain (a DNS subdomain of at most 63 bytes) and
/// `/`, then a C identifier of at most 32 bytes.
fn qualified(field: &str, name: &str, causes: &mut Vec<String>) {
    let (domain, id) = match name.split_once('/') {
        Some((domain, id)) => (Some(domain), id),
        None => (None, name),
    };
    if let Some(domain) = domain
        && (domain.len() > 63 || !is_dns1123_subdomain(domain))
    {
        causes.push(format!(
            "{field}: Invalid value: {domain:?}: the domain must be a DNS subdomain of at most 63 bytes"
        ));
    }
    let c_identifier = id
        .bytes()
        .next()
        .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_')
        && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
    if !c_identifier || id.len() > MAX_ID {
        causes.push(format!(
            "{field}: Invalid value: {id:?}: a C identifier of at most {MAX_ID} bytes is required"
        ));
    }
}

/// `MAJOR.MINOR.PATCH[-pre][+build]`, numbers without leading zeros.
fn is_semver(v: &str) -> bool {
    let core = v.split(['-', '+']).next().unwrap_or("");
    let parts: Vec<&str> = core.split('.').collect();
    parts.len() == 3
        && parts.iter().all(|p| {
            !p.is_empty()
                && p.bytes().all(|b| b.is_ascii_digit())
                && (p.len() == 1 || !p.starts_with('0'))
        })
}

/// A Kubernetes quantity: a decimal number with an optional binary or decimal suffix.
fn is_quantity(q: &str) -> bool {
    let number_end = q
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '-' || c == '+'))
        .unwrap_or(q.len());
    let (number, suffix) = q.split_at(number_end);
    !number.is_empty()
        && number.parse::<f64>().is_ok()
        && matches!(
            suffix,
            "" | "Ki"
                | "Mi"
                | "Gi"
                | "Ti"
                | "Pi"
                | "Ei"
                | "n"
                | "u"
                | "m"
                | "k"
                | "M"
                | "G"
                | "T"
                | "P"
                | "E"
        )
}

/// `ResourceClaimStatus.devices` limits: conditions per device, opaque data size.
const MAX_CONDITIONS: usize = 8;
const MAX_STATUS_DATA: usize = 10 << 10;

/// Every cause the server gives for refusing `devices` as a claim's `status.devices`: each
/// entry must be a device the claim was allocated, with at most 8 well-formed conditions and at
/// most 10 KiB of data.
pub fn claim_device_statuses(claim: &Value, devices: &[Value]) -> Vec<String> {
    let mut causes = Vec::new();
    let allocated: Vec<(&Value, &Value, &Value)> =
        claim["status"]["allocation"]["devices"]["results"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|r| (&r["driver"], &r["pool"], &r["device"]))
            .collect();
    for (i, entry) in devices.iter().enumerate() {
        let at = format!("status.devices[{i}]");
        let key = (&entry["driver"], &entry["pool"], &entry["device"]);
        if !allocated.contains(&key) {
            causes.push(format!(
                "{at}: Invalid value: {{driver: {}, pool: {}, device: {}}}: must be an \
                 allocated device in the claim",
                key.0, key.1, key.2
            ));
        }
        let conditions = entry["conditions"]
            .as_array()
            .map(Vec::as_slice)
            .unwrap_or(&[]);
        if conditions.len() > MAX_CONDITIONS {
            causes.push(format!(
                "{at}.conditions: Too many: {}: must have at most {MAX_CONDITIONS} items",
                conditions.len()
            ));
        }
        for (j, c) in conditions.iter().enumerate() {
            let field = format!("{at}.conditions[{j}]");
            if c["type"].as_str().is_none_or(str::is_empty) {
                causes.push(format!("{field}.type: Required value"));
            }
            if !matches!(c["status"].as_str(), Some("True" | "False" | "Unknown")) {
                causes.push(format!(
                    "{field}.status: Unsupported value: {}: supported values: \"False\", \
                     \"True\", \"Unknown\"",
                    c["status"]
                ));
            }
            if !c["reason"].as_str().is_some_and(is_reason) {
                causes.push(format!(
                    "{field}.reason: Invalid value: {}: a condition reason must start with \
                     alphabetic character, optionally followed by a string of alphanumeric \
                     characters or '_,:', and must end with an alphanumeric character or '_'",
                    c["reason"]
                ));
            }
            if c["lastTransitionTime"].as_str().is_none_or(str::is_empty) {
                causes.push(format!("{field}.lastTransitionTime: Required value"));
            }
        }
        if !entry["data"].is_null() {
            let size = entry["data"].to_string().len();
            if size > MAX_STATUS_DATA {
                causes.push(format!(
                    "{at}.data: Too long: may not be more than {MAX_STATUS_DATA} bytes"
                ));
            }
        }
    }
    causes
}

/// `^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$`, a condition's reason.
fn is_reason(r: &str) -> bool {
    let b = r.as_bytes();
    b.first().is_some_and(u8::is_ascii_alphabetic)
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'_' | b',' | b':'))
        && b.last()
            .is_some_and(|c| c.is_ascii_alphanumeric() || *c == b'_')
}
