//! The checks every answer of the map and the reduce must pass after it is
//! read: size caps, ids that exist in the current playbook, placeholders kept —
//! an LLM answer is untrusted input.

use std::collections::HashSet;

use serde::{Deserialize, Serialize};

use super::task::{
    MAX_BULLET_CHARS, MAX_BULLET_TAGS, MAX_INSTRUCTION_CHARS, MAX_OPERATIONS, MAX_REFLECTION_FIELD_CHARS,
};
use crate::domain::playbook::{MAX_SECTION_CHARS, parse_bullet_id};
use crate::domain::prompt::placeholders;
use crate::domain::{DeltaOp, Reflection, VersionContent};

/// The playbook aggregators' answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OperationsAnswer {
    pub operations: Vec<DeltaOp>,
}

/// The rewrite aggregators' answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InstructionAnswer {
    pub instruction: String,
}

pub(super) fn bullet_ids(current: &VersionContent) -> HashSet<&str> {
    current.playbook.iter().flat_map(|p| p.bullets().map(|(_, b)| b.id.as_str())).collect()
}

fn check_len(what: &str, text: &str, max: usize) -> Result<(), String> {
    let n = text.chars().count();
    if n > max { Err(format!("{what} is {n} characters; the limit is {max}")) } else { Ok(()) }
}

/// A reflection must carry a key insight, stay within the size caps, and tag only
/// bullets that exist in the current playbook, each at most once.
pub fn validate_reflection(r: &Reflection, current: &VersionContent) -> Result<(), String> {
    if r.key_insight.trim().is_empty() {
        return Err("key_insight must not be empty".into());
    }
    for (what, text) in [
        ("error", &r.error),
        ("root_cause", &r.root_cause),
        ("correct_approach", &r.correct_approach),
        ("key_insight", &r.key_insight),
    ] {
        check_len(what, text, MAX_REFLECTION_FIELD_CHARS)?;
    }
    if r.bullet_tags.len() > MAX_BULLET_TAGS {
        return Err(format!("{} bullet_tags; the limit is {MAX_BULLET_TAGS}", r.bullet_tags.len()));
    }
    let known = bullet_ids(current);
    let mut seen = HashSet::new();
    for t in &r.bullet_tags {
        if !known.contains(t.id.as_str()) {
            return Err(format!("bullet_tags names {:?}, which is not a bullet of the current playbook", short(&t.id)));
        }
        if !seen.insert(t.id.as_str()) {
            return Err(format!("bullet {:?} is tagged twice", short(&t.id)));
        }
    }
    Ok(())
}

/// Operations must name sane sections and one-line contents, and UPDATE/REMOVE
/// may only name bullets of the current playbook.
pub fn validate_operations(a: &OperationsAnswer, current: &VersionContent) -> Result<(), String> {
    if a.operations.len() > MAX_OPERATIONS {
        return Err(format!("{} operations; the limit is {MAX_OPERATIONS}", a.operations.len()));
    }
    let known = bullet_ids(current);
    a.operations.iter().try_for_each(|op| check_op(op, &known))
}

/// One operation against the ids of the current playbook (see [`validate_operations`]).
pub(super) fn check_op(op: &DeltaOp, known: &HashSet<&str>) -> Result<(), String> {
    let content_ok = |c: &str| -> Result<(), String> {
        if c.trim().is_empty() {
            return Err("an operation has empty content".into());
        }
        if c.contains(['\n', '\r']) {
            return Err("bullet content must be a single line".into());
        }
        check_len("bullet content", c, MAX_BULLET_CHARS)
    };
    let id_ok = |id: &str| -> Result<(), String> {
        if parse_bullet_id(id).is_none() || !known.contains(id) {
            return Err(format!("{:?} is not a bullet of the current playbook", short(id)));
        }
        Ok(())
    };
    match op {
        DeltaOp::Add { section, content, .. } => {
            let s = section.trim();
            if s.is_empty() || s.chars().count() > MAX_SECTION_CHARS || s.contains(['\n', '\r']) {
                return Err(format!("section name must be 1..={MAX_SECTION_CHARS} characters on one line"));
            }
            content_ok(content)
        }
        DeltaOp::Update { id, content, .. } => {
            id_ok(id)?;
            content_ok(content)
        }
        DeltaOp::Remove { id, .. } => id_ok(id),
    }
}

/// A rewritten instruction must be non-empty, within the cap, and keep every
/// `{placeholder}` of the current base text.
pub fn validate_instruction(a: &InstructionAnswer, current: &VersionContent) -> Result<(), String> {
    if a.instruction.trim().is_empty() {
        return Err("instruction must not be empty".into());
    }
    check_len("instruction", &a.instruction, MAX_INSTRUCTION_CHARS)?;
    let kept = placeholders(&a.instruction);
    let lost: Vec<String> = placeholders(&current.base).difference(&kept).map(|p| format!("{{{p}}}")).collect();
    if !lost.is_empty() {
        return Err(format!("instruction drops placeholders {}", lost.join(", ")));
    }
    Ok(())
}

pub(super) fn short(s: &str) -> String {
    s.chars().take(40).collect()
}
