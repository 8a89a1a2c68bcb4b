//! The JSON schema of each answer combee asks a model for (the map's
//! reflections, the reduce's operations, instructions and decisions), sent as
//! `response_format` so a backend that can hold a model to a schema does:
//! a small model then writes every field it must, within the lengths its
//! token limit leaves room for. The readers in [`super::decode`] still check
//! every answer: a schema is a request, not a guarantee.

use std::sync::{Arc, LazyLock};

use serde_json::{Value, json};

use crate::domain::VersionContent;
use crate::domain::playbook::MAX_SECTION_CHARS;
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

fn bullet_ids(current: &VersionContent) -> Vec<&str> {
    current.playbook.iter().flat_map(|p| p.bullets().map(|(_, b)| b.id.as_str())).collect()
}

/// A reflection on a trace run with `current`: its tags name `current`'s bullets.
pub fn reflection(current: &VersionContent) -> Arc<AnswerSchema> {
    Arc::new(reflection_over(&bullet_ids(current)))
}

/// A playbook aggregator's operations on `current`: UPDATE and REMOVE name its bullets.
pub fn operations(current: &VersionContent) -> Arc<AnswerSchema> {
    Arc::new(operations_over(&bullet_ids(current)))
}

/// A rewritten instruction.
pub fn instruction() -> Arc<AnswerSchema> {
    INSTRUCTION.clone()
}

/// A level-2 consolidation's decisions.
pub fn decisions() -> Arc<AnswerSchema> {
    DECISIONS.clone()
}

fn reflection_over(ids: &[&str]) -> AnswerSchema {
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

fn operations_over(ids: &[&str]) -> AnswerSchema {
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
