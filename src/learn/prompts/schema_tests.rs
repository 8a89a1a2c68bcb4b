//! The answer schemas against the readers: what one accepts the other does.

use super::decode::*;
use super::task::*;
use super::tests::content_with_playbook;
use crate::domain::VersionContent;
use serde_json::Value;
use serde_json::json;

/// Whether `v` fits `schema` for the keywords these schemas use.
fn fits(v: &Value, schema: &Value) -> bool {
    if let Some(options) = schema.get("anyOf").and_then(Value::as_array) {
        return options.iter().any(|o| fits(v, o));
    }
    if let Some(allowed) = schema.get("enum").and_then(Value::as_array)
        && !allowed.contains(v)
    {
        return false;
    }
    match schema.get("type").and_then(Value::as_str) {
        Some("object") => {
            let Some(m) = v.as_object() else { return false };
            let props = schema["properties"].as_object().cloned().unwrap_or_default();
            let required = schema["required"].as_array().cloned().unwrap_or_default();
            required.iter().all(|k| k.as_str().is_some_and(|k| m.contains_key(k)))
                && m.iter().all(|(k, v)| props.get(k).is_some_and(|s| fits(v, s)))
        }
        Some("array") => v.as_array().is_some_and(|a| {
            schema.get("maxItems").and_then(Value::as_u64).is_none_or(|n| a.len() as u64 <= n)
                && a.iter().all(|x| fits(x, &schema["items"]))
        }),
        Some("string") => v.as_str().is_some_and(|s| {
            let n = s.chars().count() as u64;
            schema.get("maxLength").and_then(Value::as_u64).is_none_or(|m| n <= m)
                && schema.get("minLength").and_then(Value::as_u64).is_none_or(|m| n >= m)
        }),
        Some("integer") => v.as_i64().is_some(),
        _ => true,
    }
}

#[test]
fn answers_that_fit_the_schemas_are_accepted_by_the_readers() {
    let current = content_with_playbook();
    let reflection = json!({"error": "gave no order id", "root_cause": "skipped the lookup",
            "correct_approach": "look the order up", "key_insight": "always quote the order id",
            "bullet_tags": [{"id": "b-0001", "tag": "helpful"}]});
    assert!(fits(&reflection, &answer_schema(Task::Reflect, &current).schema));
    assert!(decode_reflection(&reflection.to_string(), &current).is_ok());

    let ops = json!({"operations": [
            {"op": "ADD", "section": "strategies", "content": "Quote the order id.", "reason": "r", "sources": [1]},
            {"op": "UPDATE", "id": "b-0001", "content": "Check units twice.", "reason": "r", "sources": [1]},
            {"op": "REMOVE", "id": "b-0001", "reason": "harmful", "sources": [1]}]});
    assert!(fits(&ops, &answer_schema(Task::AggregatePlaybook, &current).schema));
    let read = decode_operations(&ops.to_string(), &current, 1).unwrap();
    assert_eq!(read.value.len(), 3);
    assert!(read.notes.is_empty(), "{:?}", read.notes);

    let instruction = json!({"instruction": "You answer {question} for {user}. Quote ids."});
    assert!(fits(&instruction, &answer_schema(Task::AggregateRewrite, &current).schema));
    assert!(decode_instruction(&instruction.to_string(), &current).is_ok());
}

#[test]
fn what_the_readers_refuse_the_schemas_refuse_too() {
    let current = content_with_playbook();
    let schema = answer_schema(Task::Reflect, &current).schema.clone();
    // The very answer a small model gave without a schema: no key insight.
    assert!(!fits(&json!({"error": "x", "root_cause": "y", "correct_approach": "z"}), &schema));
    assert!(!fits(
        &json!({"error": "", "root_cause": "", "correct_approach": "", "key_insight": "",
                               "bullet_tags": []}),
        &schema
    ));
    let ops = answer_schema(Task::AggregatePlaybook, &current).schema.clone();
    assert!(!fits(&json!({"operations": [{"op": "ADD", "content": "no section", "reason": "", "sources": []}]}), &ops));
    assert!(!fits(&json!({"operations": [{"op": "MOVE", "id": "b-0001", "reason": "", "sources": []}]}), &ops));
    // Ids the playbook does not have, as a small model wrote them.
    let update =
        |id: &str| json!({"operations": [{"op": "UPDATE", "id": id, "content": "c", "reason": "", "sources": []}]});
    assert!(fits(&update("b-0001"), &ops));
    assert!(!fits(&update("}{"), &ops));
    let tags = |id: &str| {
        json!({"error": "", "root_cause": "", "correct_approach": "", "key_insight": "k",
                   "bullet_tags": [{"id": id, "tag": "helpful"}]})
    };
    assert!(fits(&tags("b-0001"), &schema));
    assert!(!fits(&tags("b-012E"), &schema));
    // An empty playbook: nothing to tag, nothing to update or remove.
    let empty = VersionContent { base: "b".into(), playbook: None };
    assert!(!fits(&tags("b-0001"), &answer_schema(Task::Reflect, &empty).schema));
    assert!(!fits(&update("b-0001"), &answer_schema(Task::AggregatePlaybook, &empty).schema));
    let add = json!({"operations": [{"op": "ADD", "section": "s", "content": "c", "reason": "", "sources": [1]}]});
    assert!(fits(&add, &answer_schema(Task::AggregatePlaybook, &empty).schema));
}

#[test]
fn the_strict_form_of_every_schema_closes_every_object() {
    fn closed(v: &Value) -> bool {
        match v {
            Value::Object(m) => {
                let ok = !m.contains_key("properties")
                    || (m.get("additionalProperties") == Some(&Value::Bool(false))
                        && m["required"].as_array().map(Vec::len)
                            == m["properties"].as_object().map(serde_json::Map::len));
                ok && !m.contains_key("maxLength") && m.values().all(closed)
            }
            Value::Array(a) => a.iter().all(closed),
            _ => true,
        }
    }
    for task in Task::ALL {
        for current in [content_with_playbook(), VersionContent { base: "b".into(), playbook: None }] {
            assert!(closed(&answer_schema(task, &current).closed_schema(crate::llm::SchemaLengths::Left)), "{task:?}");
        }
    }
}
