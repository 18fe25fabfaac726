//! A module's `[module.config]` table, converted to the JSON the module's `init` receives. The
//! table is the vendor's, not ours: any keys and shapes pass, and only values JSON cannot carry
//! are refused here, at load time, rather than surprising the module later.

use serde_json::{Map, Number, Value};
use toml::de::DeValue;

use super::error::RegistryError;
use super::value::Node;

/// Converts `config` (which must be a table) to a JSON object.
pub(super) fn config(node: &Node<'_>) -> Result<Value, RegistryError> {
    node.table("a table, e.g. [module.config]")?;
    to_json(node)
}

/// TOML to JSON, value for value. Datetimes have no JSON type and become their RFC 3339 text;
/// integers stay integers; floats must be finite, since JSON has no NaN or infinity.
fn to_json(node: &Node<'_>) -> Result<Value, RegistryError> {
    Ok(match node.get() {
        DeValue::String(text) => Value::String(text.to_string()),
        DeValue::Boolean(flag) => Value::Bool(*flag),
        DeValue::Datetime(datetime) => Value::String(datetime.to_string()),
        DeValue::Integer(integer) => i64::from_str_radix(integer.as_str(), integer.radix())
            .map(Value::from)
            .map_err(|_| node.error(format!("integer {integer} does not fit in 64 bits")))?,
        DeValue::Float(float) => float
            .as_str()
            .parse::<f64>()
            .ok()
            .and_then(Number::from_f64)
            .map(Value::Number)
            .ok_or_else(|| {
                node.error(format!(
                    "float {float} cannot be handed to the module: JSON has no NaN or infinity"
                ))
            })?,
        DeValue::Array(_) => Value::Array(
            node.array("an array")?
                .iter()
                .map(to_json)
                .collect::<Result<_, _>>()?,
        ),
        DeValue::Table(_) => {
            let mut object = Map::new();
            for entry in node.table("a table")?.entries() {
                object.insert(entry.name.to_string(), to_json(&entry.node)?);
            }
            Value::Object(object)
        }
    })
}
