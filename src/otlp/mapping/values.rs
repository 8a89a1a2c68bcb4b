//! Reading OTLP attribute values: the lookups every convention shares, and
//! `AnyValue` → JSON. Instrumentations record content either as JSON strings
//! or as structured values (arrays, key-value lists); both read the same.

use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue, any_value::Value as Any};
use serde_json::{Map, Value, json};

/// The value of `key` among `attrs`, if set.
pub(super) fn get<'a>(attrs: &'a [KeyValue], key: &str) -> Option<&'a Any> {
    attrs.iter().find(|kv| kv.key == key).and_then(|kv| kv.value.as_ref()).and_then(|v| v.value.as_ref())
}

/// The first of `keys` that is set, as structured JSON.
pub(super) fn first_structured(attrs: &[KeyValue], keys: &[&str]) -> Option<Value> {
    keys.iter().find_map(|k| get(attrs, k)).map(structured)
}

pub(super) fn any_to_json(v: &Any, depth: usize) -> Value {
    if depth > 32 {
        return Value::String("…".into());
    }
    let inner = |v: &AnyValue| v.value.as_ref().map_or(Value::Null, |v| any_to_json(v, depth + 1));
    match v {
        Any::StringValue(s) => Value::String(s.clone()),
        Any::BoolValue(b) => Value::Bool(*b),
        Any::IntValue(i) => json!(i),
        Any::DoubleValue(d) => {
            serde_json::Number::from_f64(*d).map_or_else(|| Value::String(d.to_string()), Value::Number)
        }
        Any::BytesValue(b) => Value::String(hex::encode(b)),
        Any::ArrayValue(a) => Value::Array(a.values.iter().map(inner).collect()),
        Any::KvlistValue(kv) => Value::Object(
            kv.values.iter().map(|kv| (kv.key.clone(), kv.value.as_ref().map_or(Value::Null, inner))).collect(),
        ),
        Any::StringValueStrindex(i) => json!(i),
    }
}

/// Instrumentations record structured values (messages, arguments) as JSON
/// strings; those become structured again. Other strings stay strings.
pub(super) fn structured(v: &Any) -> Value {
    match v {
        Any::StringValue(s) => parse_json_text(s),
        other => any_to_json(other, 0),
    }
}

/// A string holding a JSON object or array, parsed; any other string as it is.
pub(super) fn parse_json_text(s: &str) -> Value {
    let t = s.trim_start();
    if (t.starts_with('{') || t.starts_with('['))
        && let Ok(parsed) = serde_json::from_str::<Value>(s)
    {
        return parsed;
    }
    Value::String(s.to_owned())
}

pub(super) fn string_attr(attrs: &[KeyValue], key: &str) -> Result<Option<String>, String> {
    match get(attrs, key) {
        None => Ok(None),
        Some(Any::StringValue(s)) => Ok(Some(s.clone())),
        Some(_) => Err(format!("`{key}` must be a string")),
    }
}

pub(super) fn int_attr(attrs: &[KeyValue], key: &str) -> Option<i64> {
    as_int(get(attrs, key)?)
}

pub(super) fn as_int(v: &Any) -> Option<i64> {
    match v {
        Any::IntValue(i) => Some(*i),
        Any::DoubleValue(d) if d.is_finite() && d.fract() == 0.0 && d.abs() < 9.0e15 => Some(*d as i64),
        Any::StringValue(s) => s.trim().parse().ok(),
        _ => None,
    }
}

/// A number given as a number or a numeric string.
pub(super) fn as_f64(v: &Any) -> Option<f64> {
    match v {
        Any::DoubleValue(d) if d.is_finite() => Some(*d),
        Any::IntValue(i) => Some(*i as f64),
        Any::StringValue(s) => s.trim().parse::<f64>().ok().filter(|f| f.is_finite()),
        _ => None,
    }
}

pub(super) fn parse_version(key: &str, v: &Any) -> Result<i64, String> {
    as_int(v).filter(|n| *n >= 1).ok_or_else(|| {
        let shown = clip(any_to_json(v, 0).to_string(), 60);
        format!("`{key}` must be a positive integer version number (got {shown})")
    })
}

/// Flattened attributes under `prefix` (`prefix.0.message.role`, …) gathered
/// into nested JSON: dotted segments become objects, numeric segments array
/// positions (in index order); JSON text in a value is parsed, except in a
/// message's `content` or `text`. `None` when no attribute has the prefix.
pub(super) fn unflatten(attrs: &[KeyValue], prefix: &str) -> Option<Value> {
    let mut root = Value::Null;
    let mut any = false;
    for kv in attrs {
        let Some(rest) = kv.key.strip_prefix(prefix).and_then(|r| r.strip_prefix('.')) else { continue };
        let Some(v) = kv.value.as_ref().and_then(|v| v.value.as_ref()) else { continue };
        any = true;
        // Message text stays text even when it happens to be JSON.
        let leaf =
            if rest.ends_with(".content") || rest.ends_with(".text") { any_to_json(v, 0) } else { structured(v) };
        insert_path(&mut root, rest.split('.'), leaf);
    }
    any.then(|| sparse_to_arrays(root))
}

/// Numeric keys are gathered in a map first (indices may be sparse or out of order).
fn insert_path<'a>(node: &mut Value, mut path: impl Iterator<Item = &'a str>, leaf: Value) {
    let Some(seg) = path.next() else {
        *node = leaf;
        return;
    };
    if !node.is_object() {
        *node = Value::Object(Map::new());
    }
    if let Value::Object(map) = node {
        // Numeric segments are kept as zero-padded keys so they sort by index.
        let key = match seg.parse::<u32>() {
            Ok(i) => format!("\u{0}{i:010}"),
            Err(_) => seg.to_owned(),
        };
        insert_path(map.entry(key).or_insert(Value::Null), path, leaf);
    }
}

fn sparse_to_arrays(v: Value) -> Value {
    match v {
        Value::Object(map) if !map.is_empty() && map.keys().all(|k| k.starts_with('\u{0}')) => {
            let mut items: Vec<(String, Value)> = map.into_iter().collect();
            items.sort_by(|a, b| a.0.cmp(&b.0));
            Value::Array(items.into_iter().map(|(_, v)| sparse_to_arrays(v)).collect())
        }
        Value::Object(map) => Value::Object(map.into_iter().map(|(k, v)| (k, sparse_to_arrays(v))).collect()),
        other => other,
    }
}

pub(super) fn clip(mut s: String, max: usize) -> String {
    if s.len() > max {
        let mut end = max;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
        s.push('…');
    }
    s
}

/// A string attribute, as the mapping's tests write them.
#[cfg(test)]
pub(super) fn string_kv(key: &str, v: &str) -> KeyValue {
    KeyValue {
        key: key.into(),
        value: Some(AnyValue { value: Some(Any::StringValue(v.into())) }),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry_proto::tonic::common::v1::{ArrayValue, any_value};

    #[test]
    fn attribute_values_convert_to_json() {
        let arr = Any::ArrayValue(ArrayValue {
            values: vec![
                AnyValue { value: Some(any_value::Value::IntValue(1)) },
                AnyValue { value: Some(any_value::Value::DoubleValue(f64::NAN)) },
                AnyValue { value: None },
            ],
        });
        assert_eq!(any_to_json(&arr, 0), json!([1, "NaN", null]));
        assert_eq!(structured(&Any::StringValue("[1, 2".into())), json!("[1, 2"));
        assert_eq!(structured(&Any::StringValue("42".into())), json!("42"));
        assert_eq!(as_f64(&Any::StringValue(" 0.5 ".into())), Some(0.5));
        assert_eq!(as_f64(&Any::StringValue("NaN".into())), None);
    }

    #[test]
    fn flattened_attributes_nest_with_arrays_in_index_order() {
        let attrs = vec![
            string_kv("llm.input_messages.10.message.role", "user"),
            string_kv("llm.input_messages.2.message.role", "system"),
            string_kv("llm.input_messages.2.message.content", "{\"json\": \"text stays text\"}"),
            string_kv("llm.input_messages.10.message.tool_calls.0.tool_call.function.name", "lookup"),
            string_kv("llm.input_messages_other", "not under the prefix"),
        ];
        assert_eq!(
            unflatten(&attrs, "llm.input_messages").unwrap(),
            json!([
                {"message": {"role": "system", "content": "{\"json\": \"text stays text\"}"}},
                {"message": {"role": "user", "tool_calls": [{"tool_call": {"function": {"name": "lookup"}}}]}}
            ])
        );
        assert_eq!(unflatten(&attrs, "llm.output_messages"), None);
    }
}
