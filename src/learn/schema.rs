//! The JSON schema of each answer combee asks a model for (the map's
//! reflections, the reduce's operations, instructions and decisions), sent as
//! `response_format` so a backend that can hold a model to a schema does:
//! a small model then writes every field it must, within the lengths its
//! token limit leaves room for. The reader in [`super::protocol`] still checks
//! every answer: a schema is a request, not a guarantee.

use std::sync::{Arc, LazyLock};

use serde_json::{Value, json};

use super::protocol::{MAX_SECTION_CHARS, Task};
use crate::domain::VersionContent;
use crate::llm::AnswerSchema;

/// Most bullet ids a schema lists by name; a larger playbook's ids are left to the reader.
const MAX_LISTED_IDS: usize = 1_000;

/// Longest reflection field a schema asks for: four of them and the tags fit
/// `llm.reflector_max_tokens` (1024 by default) with room to spare.
pub const REFLECTION_FIELD_CHARS: usize = 400;
/// Most bullet tags a reflection schema asks for.
pub const SCHEMA_BULLET_TAGS: usize = 30;
/// Longest bullet content and reason an operations schema asks for.
pub const OP_CONTENT_CHARS: usize = 300;
const OP_REASON_CHARS: usize = 200;
/// Most operations an aggregator schema asks for: a group's lessons fit
/// `llm.aggregator_max_tokens` (2048 by default).
pub const SCHEMA_OPERATIONS: usize = 12;

fn text(max: usize) -> Value {
    json!({"type": "string", "maxLength": max})
}

fn object(properties: Value, required: &[&str]) -> Value {
    json!({"type": "object", "properties": properties, "required": required, "additionalProperties": false})
}

fn sources() -> Value {
    json!({"type": "array", "items": {"type": "integer", "minimum": 1}, "maxItems": 20})
}

/// A bullet id the schema accepts: one of `ids` where they are few enough to list.
fn bullet_id(ids: &[&str]) -> Value {
    if (1..=MAX_LISTED_IDS).contains(&ids.len()) { json!({"type": "string", "enum": ids}) } else { text(16) }
}

fn reflection(ids: &[&str]) -> AnswerSchema {
    let field = text(REFLECTION_FIELD_CHARS);
    let insight = json!({"type": "string", "minLength": 1, "maxLength": REFLECTION_FIELD_CHARS});
    let tag = object(
        json!({"id": bullet_id(ids), "tag": {"type": "string", "enum": ["helpful", "harmful", "neutral"]}}),
        &["id", "tag"],
    );
    // No bullets: nothing to tag, so the list must stay empty.
    let most = if ids.is_empty() { 0 } else { SCHEMA_BULLET_TAGS.min(ids.len()) };
    AnswerSchema::new(
        "reflection",
        object(
            json!({
                "error": field,
                "root_cause": field,
                "correct_approach": field,
                "key_insight": insight,
                "bullet_tags": {"type": "array", "items": tag, "maxItems": most},
            }),
            &["error", "root_cause", "correct_approach", "key_insight", "bullet_tags"],
        ),
    )
}

fn operations(ids: &[&str]) -> AnswerSchema {
    let kind = |k: &str| json!({"type": "string", "enum": [k]});
    let add = object(
        json!({"op": kind("ADD"), "section": text(MAX_SECTION_CHARS), "content": text(OP_CONTENT_CHARS),
               "reason": text(OP_REASON_CHARS), "sources": sources()}),
        &["op", "section", "content", "reason", "sources"],
    );
    // UPDATE and REMOVE name a bullet of the current playbook; with none, only ADD is possible.
    let item = if ids.is_empty() {
        add
    } else {
        let update = object(
            json!({"op": kind("UPDATE"), "id": bullet_id(ids), "content": text(OP_CONTENT_CHARS),
                   "reason": text(OP_REASON_CHARS), "sources": sources()}),
            &["op", "id", "content", "reason", "sources"],
        );
        let remove = object(
            json!({"op": kind("REMOVE"), "id": bullet_id(ids), "reason": text(OP_REASON_CHARS), "sources": sources()}),
            &["op", "id", "reason", "sources"],
        );
        json!({"anyOf": [add, update, remove]})
    };
    AnswerSchema::new(
        "playbook_operations",
        object(json!({"operations": {"type": "array", "items": item, "maxItems": SCHEMA_OPERATIONS}}), &["operations"]),
    )
}

static INSTRUCTION: LazyLock<Arc<AnswerSchema>> = LazyLock::new(|| {
    Arc::new(AnswerSchema::new(
        "instruction",
        object(json!({"instruction": {"type": "string", "minLength": 1}}), &["instruction"]),
    ))
});

static DECISIONS: LazyLock<Arc<AnswerSchema>> = LazyLock::new(|| {
    let decision = object(
        json!({
            "action": {"type": "string", "enum": ["merge", "edit", "drop"]},
            "ops": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 50},
            "content": text(OP_CONTENT_CHARS),
            "reason": text(OP_REASON_CHARS),
        }),
        &["action", "ops", "content", "reason"],
    );
    Arc::new(AnswerSchema::new(
        "consolidation_decisions",
        object(json!({"decisions": {"type": "array", "items": decision, "maxItems": 50}}), &["decisions"]),
    ))
});

/// The schema of `task`'s answer about `current`: bullet ids are those of its
/// playbook, so a model held to the schema cannot name one that does not exist.
pub fn answer_schema(task: Task, current: &VersionContent) -> Arc<AnswerSchema> {
    let ids: Vec<&str> = current.playbook.iter().flat_map(|p| p.bullets().map(|(_, b)| b.id.as_str())).collect();
    match task {
        Task::Reflect => Arc::new(reflection(&ids)),
        Task::AggregatePlaybook => Arc::new(operations(&ids)),
        Task::AggregateRewrite | Task::MergeRewrite => INSTRUCTION.clone(),
        Task::ConsolidatePlaybook => DECISIONS.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::learn::protocol::{self, tests::content_with_playbook};

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
        assert!(protocol::decode_reflection(&reflection.to_string(), &current).is_ok());

        let ops = json!({"operations": [
            {"op": "ADD", "section": "strategies", "content": "Quote the order id.", "reason": "r", "sources": [1]},
            {"op": "UPDATE", "id": "b-0001", "content": "Check units twice.", "reason": "r", "sources": [1]},
            {"op": "REMOVE", "id": "b-0001", "reason": "harmful", "sources": [1]}]});
        assert!(fits(&ops, &answer_schema(Task::AggregatePlaybook, &current).schema));
        let read = protocol::decode_operations(&ops.to_string(), &current, 1).unwrap();
        assert_eq!(read.value.len(), 3);
        assert!(read.notes.is_empty(), "{:?}", read.notes);

        let instruction = json!({"instruction": "You answer {question} for {user}. Quote ids."});
        assert!(fits(&instruction, &answer_schema(Task::AggregateRewrite, &current).schema));
        assert!(protocol::decode_instruction(&instruction.to_string(), &current).is_ok());
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
        assert!(!fits(
            &json!({"operations": [{"op": "ADD", "content": "no section", "reason": "", "sources": []}]}),
            &ops
        ));
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
                assert!(closed(&answer_schema(task, &current).strict_schema()), "{task:?}");
            }
        }
    }
}
