//! The tolerant readers of the models' answers to the map and reduce calls:
//! the JSON object is found inside fences, prose or think blocks
//! ([`super::answer`]), unknown keys are ignored and single bad items dropped,
//! all of it counted, then the rest is parsed into a strict type and checked
//! ([`super::checks`]).

use serde::Serialize;
use serde_json::Value;

use super::answer::{self, AnswerNotes};
use super::checks::{InstructionAnswer, bullet_ids, check_op, short, validate_instruction, validate_reflection};
use super::task::{MAX_BULLET_TAGS, MAX_OPERATIONS};
use crate::domain::{BulletTag, DeltaOp, Reflection, VersionContent};
use crate::learn::merge::dedupe::MergedOp;
use crate::learn::merge::level2::{self, Decision, DecisionsAnswer};

/// An answer's value with what reading it ignored or dropped.
#[derive(Debug, Clone, PartialEq)]
pub struct DecodedAnswer<T> {
    pub value: T,
    pub notes: AnswerNotes,
}

/// One playbook operation as an aggregator proposed it, with the reflections it
/// cites. Serialised as the operation with a `sources` key (the group's 0-based
/// positions), the form group outputs are recorded in.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SourcedOp {
    #[serde(flatten)]
    pub op: DeltaOp,
    /// The reflections of the group the op came from, as 0-based positions in the
    /// group (the prompt numbers them from 1), ascending, without repeats.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub sources: Vec<usize>,
}

const REFLECTION_KEYS: [&str; 5] = ["error", "root_cause", "correct_approach", "key_insight", "bullet_tags"];

/// Reads a reflector answer: unknown keys are ignored; a bullet tag that is
/// malformed, names a bullet the playbook does not have, repeats one, or is past
/// [`MAX_BULLET_TAGS`] is dropped. The rest must be a valid [`Reflection`].
pub fn decode_reflection(text: &str, current: &VersionContent) -> Result<DecodedAnswer<Reflection>, String> {
    let mut notes = AnswerNotes::default();
    let mut obj = answer::extract_object(text, &mut notes)?;
    answer::keep_known(&mut obj, &REFLECTION_KEYS, "", &mut notes);
    let tags = match obj.remove("bullet_tags") {
        None => Vec::new(),
        Some(Value::Array(tags)) => tags,
        Some(_) => {
            notes.drop_item("bullet_tags", "not a list");
            Vec::new()
        }
    };
    let known = bullet_ids(current);
    let kept = read_items(tags, "bullet_tags", (MAX_BULLET_TAGS, "tags"), &mut notes, |at, mut m, kept, notes| {
        answer::keep_known(&mut m, &["id", "tag"], at, notes);
        // `Helpful` is as clear as `helpful`.
        if let Some(Value::String(tag)) = m.get_mut("tag") {
            *tag = tag.trim().to_ascii_lowercase();
        }
        let tag: BulletTag = serde_json::from_value(Value::Object(m)).map_err(|e| format!("not a bullet tag: {e}"))?;
        if !known.contains(tag.id.as_str()) {
            Err(format!("{:?} is not a bullet of the current playbook", short(&tag.id)))
        } else if kept.iter().any(|t: &BulletTag| t.id == tag.id) {
            Err(format!("bullet {:?} is tagged twice", short(&tag.id)))
        } else {
            Ok(tag)
        }
    });
    let mut r: Reflection =
        serde_json::from_value(Value::Object(obj)).map_err(|e| format!("not a valid reflection: {e}"))?;
    r.bullet_tags = kept;
    validate_reflection(&r, current)?;
    Ok(DecodedAnswer { value: r, notes })
}

/// Reads an answer's list item by item: an item past the limit of kept ones
/// (`limit`: how many, and what they are called), or not an object, is dropped
/// and counted; `read` gets every other with where it stands (`list[i]`) and
/// the items kept so far, and keeps it (`Ok`) or says why not (`Err`: dropped
/// and counted).
fn read_items<T>(
    items: Vec<Value>,
    list: &str,
    (limit, what): (usize, &str),
    notes: &mut AnswerNotes,
    mut read: impl FnMut(&str, serde_json::Map<String, Value>, &[T], &mut AnswerNotes) -> Result<T, String>,
) -> Vec<T> {
    let mut kept = Vec::new();
    for (i, raw) in items.into_iter().enumerate() {
        let at = format!("{list}[{i}]");
        if kept.len() >= limit {
            notes.drop_item(at, format!("beyond the limit of {limit} {what}"));
            continue;
        }
        let Value::Object(m) = raw else {
            notes.drop_item(at, "not an object");
            continue;
        };
        match read(&at, m, &kept, notes) {
            Ok(item) => kept.push(item),
            Err(why) => notes.drop_item(at, why),
        }
    }
    kept
}

/// The 0-based group positions an op's `sources` name (1-based numbers, or
/// strings such as `"2"` or `"reflection 2"`); anything else is dropped and counted.
fn read_sources(raw: Option<Value>, group_size: usize, at: &str, notes: &mut AnswerNotes) -> Vec<usize> {
    let items = match raw {
        None => return Vec::new(),
        Some(Value::Array(items)) => items,
        Some(one) => vec![one],
    };
    let mut out = Vec::new();
    for v in items {
        let n = match &v {
            Value::Number(n) => n.as_u64(),
            Value::String(s) => {
                let s = s.trim();
                let s = s.strip_prefix("reflection").unwrap_or(s).trim().trim_start_matches('#');
                s.parse::<u64>().ok()
            }
            _ => None,
        };
        match n.and_then(|n| usize::try_from(n).ok()).filter(|n| (1..=group_size).contains(n)) {
            Some(n) => out.push(n - 1),
            None => {
                let shown: String = v.to_string().chars().take(40).collect();
                notes.drop_item(
                    format!("{at}.sources"),
                    format!("{shown} is not a reflection of this group (1..={group_size})"),
                );
            }
        }
    }
    out.sort_unstable();
    out.dedup();
    out
}

/// Reads a playbook aggregator answer: `operations` must be a list; a single
/// operation that is malformed, of an unknown kind, fails [`validate_operations`]'s
/// rules (e.g. an unknown bullet id) or is past [`MAX_OPERATIONS`] is dropped
/// with the reason, and the others are kept. `group_size` bounds `sources`.
pub fn decode_operations(
    text: &str,
    current: &VersionContent,
    group_size: usize,
) -> Result<DecodedAnswer<Vec<SourcedOp>>, String> {
    let mut notes = AnswerNotes::default();
    let mut obj = answer::extract_object(text, &mut notes)?;
    answer::keep_known(&mut obj, &["operations"], "", &mut notes);
    let raw = match obj.remove("operations") {
        Some(Value::Array(ops)) => ops,
        Some(_) => return Err("`operations` must be a list".into()),
        None => return Err("the answer has no `operations` list".into()),
    };
    let known = bullet_ids(current);
    let out = read_items(raw, "operations", (MAX_OPERATIONS, "operations"), &mut notes, |at, mut m, _, notes| {
        let kind = m.get("op").and_then(Value::as_str).map(|k| k.trim().to_ascii_uppercase());
        let fields: &[&str] = match kind.as_deref() {
            Some("ADD") => &["op", "section", "content", "reason", "sources"],
            Some("UPDATE") => &["op", "id", "content", "reason", "sources"],
            Some("REMOVE") => &["op", "id", "reason", "sources"],
            _ => {
                let shown: String = m.get("op").map(Value::to_string).unwrap_or_default().chars().take(40).collect();
                return Err(format!("unknown op {shown}; expected ADD, UPDATE or REMOVE"));
            }
        };
        answer::keep_known(&mut m, fields, at, notes);
        m.insert("op".into(), Value::String(kind.unwrap_or_default()));
        let sources = m.remove("sources");
        let op: DeltaOp =
            serde_json::from_value(Value::Object(m)).map_err(|e| format!("not a valid operation: {e}"))?;
        check_op(&op, &known)?;
        let sources = read_sources(sources, group_size, at, notes);
        Ok(SourcedOp { op, sources })
    });
    Ok(DecodedAnswer { value: out, notes })
}

/// Reads a rewrite answer: unknown keys are ignored; the instruction must pass [`validate_instruction`].
pub fn decode_instruction(text: &str, current: &VersionContent) -> Result<DecodedAnswer<String>, String> {
    let mut notes = AnswerNotes::default();
    let mut obj = answer::extract_object(text, &mut notes)?;
    answer::keep_known(&mut obj, &["instruction"], "", &mut notes);
    let a: InstructionAnswer =
        serde_json::from_value(Value::Object(obj)).map_err(|e| format!("not a valid instruction answer: {e}"))?;
    validate_instruction(&a, current)?;
    Ok(DecodedAnswer { value: a.instruction, notes })
}

/// Reads a consolidation answer: unknown keys are ignored; the decisions must pass
/// [`level2::check_decisions`].
pub fn decode_decisions(text: &str, ops: &[MergedOp]) -> Result<DecodedAnswer<Vec<Decision>>, String> {
    let mut notes = AnswerNotes::default();
    let mut obj = answer::extract_object(text, &mut notes)?;
    answer::keep_known(&mut obj, &["decisions"], "", &mut notes);
    if let Some(Value::Array(ds)) = obj.get_mut("decisions") {
        for (i, d) in ds.iter_mut().enumerate() {
            if let Value::Object(m) = d {
                answer::keep_known(m, &["action", "ops", "content", "reason"], &format!("decisions[{i}]"), &mut notes);
            }
        }
    }
    let a: DecisionsAnswer =
        serde_json::from_value(Value::Object(obj)).map_err(|e| format!("not a valid decisions answer: {e}"))?;
    level2::check_decisions(ops, &a)?;
    Ok(DecodedAnswer { value: a.decisions, notes })
}
