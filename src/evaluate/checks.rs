//! Code checks: what an agent's reply must satisfy, tested without a model.
//! Evaluators turn a trace into a score and a critique with them, and a
//! regression set's cases say with them what must hold. A check comes from an
//! operator (untrusted until [`Check::compile`] accepted it) and is run on a
//! reply that came from an agent (untrusted data, never interpreted).

use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::ToSchema;

/// Longest literal text, pattern or metadata key a check may carry, in bytes.
pub const MAX_CHECK_TEXT: usize = 4_096;
/// Largest JSON Schema a check may carry, as encoded JSON, in bytes.
pub const MAX_SCHEMA_BYTES: usize = 65_536;
/// Longest quote of a reply or expected value inside a critique, in characters.
const QUOTE_CHARS: usize = 120;

/// One rule a reply must follow.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum Check {
    /// The reply contains `text` (case-insensitive unless `case_sensitive`).
    Contains {
        text: String,
        #[serde(default)]
        case_sensitive: bool,
    },
    /// The reply does not contain `text`.
    NotContains {
        text: String,
        #[serde(default)]
        case_sensitive: bool,
    },
    /// The reply matches a regular expression (Rust `regex` syntax, no
    /// look-around; anchored only where the pattern says so).
    Regex { pattern: String },
    /// The reply is JSON (the whole reply, or one fenced ```json block) that
    /// matches a JSON Schema.
    JsonSchema {
        #[schema(value_type = serde_json::Value)]
        schema: Value,
    },
    /// The reply equals `value` (strings compared after trimming whitespace;
    /// other JSON values compared with the reply parsed as JSON).
    Equals {
        #[schema(value_type = serde_json::Value)]
        value: Value,
    },
    /// The reply equals the value at `key` in the trace's metadata; a trace
    /// without that key is not judged by this check.
    EqualsMetadata { key: String },
    /// The reply's length in characters lies within the bounds.
    Length {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        min: Option<usize>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        max: Option<usize>,
    },
}

/// A check whose pattern or schema was accepted, ready to run many times.
#[derive(Debug)]
pub struct CompiledCheck {
    check: Check,
    matcher: Matcher,
}

enum Matcher {
    None,
    Regex(regex::Regex),
    Schema(Box<jsonschema::Validator>),
}

impl std::fmt::Debug for Matcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::None => "None",
            Self::Regex(_) => "Regex",
            Self::Schema(_) => "Schema",
        })
    }
}

/// A check's result on one reply.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum Verdict {
    Passed,
    /// The reply broke the rule; `critique` says what it must do, in words a
    /// reflector (and a person) can act on.
    Failed {
        critique: String,
    },
    /// The check does not apply (an `equals_metadata` key the trace lacks).
    NotApplicable,
}

/// What a set of checks made of one reply: a score in [0, 1] (the share of
/// applicable checks passed) and the critiques of the failed ones.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct CheckScore {
    pub score: f64,
    pub passed: usize,
    pub applicable: usize,
    pub critiques: Vec<String>,
}

impl Check {
    /// Validates an operator's check at the edge; the error explains what is
    /// wrong in words fit for a 422.
    pub fn compile(self) -> Result<CompiledCheck, String> {
        let text_ok = |what: &str, s: &str| -> Result<(), String> {
            if s.is_empty() {
                return Err(format!("{what} must not be empty"));
            }
            if s.len() > MAX_CHECK_TEXT {
                return Err(format!("{what} is {} bytes; the limit is {MAX_CHECK_TEXT}", s.len()));
            }
            Ok(())
        };
        let matcher = match &self {
            Self::Contains { text, .. } | Self::NotContains { text, .. } => {
                text_ok("`text`", text)?;
                Matcher::None
            }
            Self::Regex { pattern } => {
                text_ok("`pattern`", pattern)?;
                let re = regex::RegexBuilder::new(pattern)
                    .size_limit(1 << 20)
                    .build()
                    .map_err(|e| format!("`pattern` is not a valid regular expression: {e}"))?;
                Matcher::Regex(re)
            }
            Self::JsonSchema { schema } => {
                let len = serde_json::to_vec(schema).map(|v| v.len()).unwrap_or(usize::MAX);
                if len > MAX_SCHEMA_BYTES {
                    return Err(format!("`schema` is {len} bytes; the limit is {MAX_SCHEMA_BYTES}"));
                }
                if !schema.is_object() && !schema.is_boolean() {
                    return Err("`schema` must be a JSON Schema (an object or a boolean)".into());
                }
                let validator = jsonschema::validator_for(schema)
                    .map_err(|e| format!("`schema` is not a valid JSON Schema: {e}"))?;
                Matcher::Schema(Box::new(validator))
            }
            Self::Equals { value } => {
                let len = serde_json::to_vec(value).map(|v| v.len()).unwrap_or(usize::MAX);
                if len > MAX_SCHEMA_BYTES {
                    return Err(format!("`value` is {len} bytes; the limit is {MAX_SCHEMA_BYTES}"));
                }
                Matcher::None
            }
            Self::EqualsMetadata { key } => {
                text_ok("`key`", key)?;
                Matcher::None
            }
            Self::Length { min, max } => {
                match (min, max) {
                    (None, None) => return Err("a `length` check needs `min`, `max` or both".into()),
                    (Some(lo), Some(hi)) if lo > hi => {
                        return Err(format!("`min` ({lo}) must not exceed `max` ({hi})"));
                    }
                    _ => {}
                }
                Matcher::None
            }
        };
        Ok(CompiledCheck { check: self, matcher })
    }
}

impl CompiledCheck {
    pub fn check(&self) -> &Check {
        &self.check
    }

    /// Runs the check on `reply`; `metadata` is the trace's metadata object.
    pub fn run(&self, reply: &str, metadata: &Value) -> Verdict {
        let fail = |critique: String| Verdict::Failed { critique };
        match (&self.check, &self.matcher) {
            (Check::Contains { text, case_sensitive }, _) => {
                if contains(reply, text, *case_sensitive) {
                    Verdict::Passed
                } else {
                    fail(format!("the reply must contain {}", quote(text)))
                }
            }
            (Check::NotContains { text, case_sensitive }, _) => {
                if contains(reply, text, *case_sensitive) {
                    fail(format!("the reply must not contain {}", quote(text)))
                } else {
                    Verdict::Passed
                }
            }
            (Check::Regex { pattern }, Matcher::Regex(re)) => {
                if re.is_match(reply) {
                    Verdict::Passed
                } else {
                    fail(format!("the reply must match the pattern {}", quote(pattern)))
                }
            }
            (Check::JsonSchema { .. }, Matcher::Schema(validator)) => match reply_json(reply) {
                None => fail("the reply must be valid JSON".into()),
                Some(json) => match validator.iter_errors(&json).next() {
                    None => Verdict::Passed,
                    Some(e) => {
                        let at = e.instance_path().to_string();
                        let at = if at.is_empty() { "/".to_string() } else { at };
                        fail(format!(
                            "the reply must be JSON matching the required schema (at {at}: {})",
                            truncate(&e.to_string(), QUOTE_CHARS)
                        ))
                    }
                },
            },
            (Check::Equals { value }, _) => equals(reply, value, "the expected answer"),
            (Check::EqualsMetadata { key }, _) => match metadata.get(key) {
                None | Some(Value::Null) => Verdict::NotApplicable,
                Some(expected) => equals(reply, expected, &format!("metadata `{key}`")),
            },
            (Check::Length { min, max }, _) => {
                let n = reply.chars().count();
                match (min, max) {
                    (Some(lo), _) if n < *lo => {
                        fail(format!("the reply must be at least {lo} characters long (it has {n})"))
                    }
                    (_, Some(hi)) if n > *hi => {
                        fail(format!("the reply must be at most {hi} characters long (it has {n})"))
                    }
                    _ => Verdict::Passed,
                }
            }
            // `compile` pairs every pattern and schema check with its matcher.
            (Check::Regex { .. } | Check::JsonSchema { .. }, _) => fail("the check could not be prepared".into()),
        }
    }
}

/// Runs every check on `reply`. `None` when no check applied (nothing to
/// score: the trace stays unjudged rather than getting a made-up score).
pub fn score(checks: &[CompiledCheck], reply: &str, metadata: &Value) -> Option<CheckScore> {
    let mut passed = 0;
    let mut applicable = 0;
    let mut critiques = Vec::new();
    for check in checks {
        match check.run(reply, metadata) {
            Verdict::Passed => {
                passed += 1;
                applicable += 1;
            }
            Verdict::Failed { critique } => {
                applicable += 1;
                critiques.push(critique);
            }
            Verdict::NotApplicable => {}
        }
    }
    (applicable > 0).then(|| CheckScore { score: passed as f64 / applicable as f64, passed, applicable, critiques })
}

/// The text of an agent's output that checks read: a string as is; an object's
/// `content`, `text`, `answer` or `output` string (the shapes agents and
/// chat APIs use); an OpenAI-style `choices[0].message.content`; otherwise
/// the output as compact JSON.
pub fn reply_text(output: &Value) -> String {
    match output {
        Value::String(s) => s.clone(),
        Value::Null => String::new(),
        Value::Object(map) => {
            for key in ["content", "text", "answer", "output"] {
                if let Some(Value::String(s)) = map.get(key) {
                    return s.clone();
                }
            }
            if let Some(Value::String(s)) = output.pointer("/choices/0/message/content") {
                return s.clone();
            }
            output.to_string()
        }
        other => other.to_string(),
    }
}

fn contains(reply: &str, text: &str, case_sensitive: bool) -> bool {
    if case_sensitive { reply.contains(text) } else { reply.to_lowercase().contains(&text.to_lowercase()) }
}

fn equals(reply: &str, expected: &Value, what: &str) -> Verdict {
    let same = match expected {
        Value::String(s) => reply.trim() == s.trim(),
        other => reply_json(reply).is_some_and(|r| &r == other),
    };
    if same {
        Verdict::Passed
    } else {
        let shown = match expected {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        Verdict::Failed { critique: format!("the reply must be exactly {} ({what})", quote(&shown)) }
    }
}

/// The reply as JSON: the whole reply, or the body of its first fenced code block.
fn reply_json(reply: &str) -> Option<Value> {
    let trimmed = reply.trim();
    if let Ok(v) = serde_json::from_str(trimmed) {
        return Some(v);
    }
    let start = trimmed.find("```")?;
    let body = &trimmed[start + 3..];
    let body = body.strip_prefix("json").unwrap_or(body);
    let end = body.find("```")?;
    serde_json::from_str(body[..end].trim()).ok()
}

fn quote(s: &str) -> String {
    format!("\"{}\"", truncate(s, QUOTE_CHARS))
}

fn truncate(s: &str, chars: usize) -> String {
    let mut out: String = s.chars().take(chars).collect();
    if s.chars().count() > chars {
        out.push('…');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn compiled(v: Value) -> CompiledCheck {
        serde_json::from_value::<Check>(v).unwrap().compile().unwrap()
    }

    fn critique(v: Verdict) -> String {
        match v {
            Verdict::Failed { critique } => critique,
            other => panic!("expected a failure, got {other:?}"),
        }
    }

    #[test]
    fn contains_and_not_contains_ignore_case_unless_asked() {
        let c = compiled(json!({"type": "contains", "text": "Refund"}));
        assert_eq!(c.run("your refund is on its way", &json!({})), Verdict::Passed);
        let strict = compiled(json!({"type": "contains", "text": "Refund", "case_sensitive": true}));
        assert_eq!(critique(strict.run("your refund", &json!({}))), "the reply must contain \"Refund\"");
        let not = compiled(json!({"type": "not_contains", "text": "sorry"}));
        assert_eq!(critique(not.run("Sorry!", &json!({}))), "the reply must not contain \"sorry\"");
        assert_eq!(not.run("Done.", &json!({})), Verdict::Passed);
    }

    #[test]
    fn regex_and_length() {
        let re = compiled(json!({"type": "regex", "pattern": "^[A-Z][a-z]+\\.$"}));
        assert_eq!(re.run("Done.", &json!({})), Verdict::Passed);
        assert!(critique(re.run("done", &json!({}))).contains("must match the pattern"));
        let len = compiled(json!({"type": "length", "max": 5}));
        assert_eq!(
            critique(len.run("été ensoleillé", &json!({}))),
            "the reply must be at most 5 characters long (it has 14)"
        );
        assert_eq!(len.run("héhé", &json!({})), Verdict::Passed);
    }

    #[test]
    fn json_schema_reads_the_reply_or_its_fenced_block() {
        let c = compiled(json!({"type": "json_schema", "schema": {
            "type": "object", "required": ["answer"],
            "properties": {"answer": {"type": "integer"}}
        }}));
        assert_eq!(c.run("{\"answer\": 4}", &json!({})), Verdict::Passed);
        assert_eq!(c.run("Here:\n```json\n{\"answer\": 4}\n```", &json!({})), Verdict::Passed);
        assert_eq!(critique(c.run("four", &json!({}))), "the reply must be valid JSON");
        let wrong = critique(c.run("{\"answer\": \"four\"}", &json!({})));
        assert!(wrong.starts_with("the reply must be JSON matching the required schema (at /answer:"), "{wrong}");
    }

    #[test]
    fn equals_compares_strings_trimmed_and_json_structurally() {
        let c = compiled(json!({"type": "equals", "value": "Paris"}));
        assert_eq!(c.run("  Paris\n", &json!({})), Verdict::Passed);
        assert!(critique(c.run("paris", &json!({}))).contains("exactly \"Paris\""));
        let n = compiled(json!({"type": "equals", "value": {"a": [1, 2]}}));
        assert_eq!(n.run("{ \"a\": [1,2] }", &json!({})), Verdict::Passed);
        let m = compiled(json!({"type": "equals_metadata", "key": "expected"}));
        assert_eq!(m.run("42", &json!({"expected": "42"})), Verdict::Passed);
        assert_eq!(m.run("42", &json!({"other": 1})), Verdict::NotApplicable);
    }

    #[test]
    fn bad_checks_are_refused_with_a_reason() {
        let refuse = |v: Value| serde_json::from_value::<Check>(v).unwrap().compile().unwrap_err();
        assert!(refuse(json!({"type": "regex", "pattern": "("})).contains("not a valid regular expression"));
        assert!(refuse(json!({"type": "regex", "pattern": "(?=x)"})).contains("not a valid"));
        assert!(refuse(json!({"type": "contains", "text": ""})).contains("must not be empty"));
        assert!(refuse(json!({"type": "length"})).contains("needs `min`"));
        assert!(refuse(json!({"type": "length", "min": 9, "max": 2})).contains("must not exceed"));
        assert!(
            refuse(json!({"type": "json_schema", "schema": {"type": "no-such-type"}}))
                .contains("not a valid JSON Schema")
        );
        assert!(refuse(json!({"type": "json_schema", "schema": 3})).contains("an object or a boolean"));
        assert!(serde_json::from_value::<Check>(json!({"type": "contains", "text": "x", "typo": 1})).is_err());
    }

    #[test]
    fn a_score_is_the_share_of_applicable_checks_passed() {
        let checks = [
            compiled(json!({"type": "contains", "text": "refund"})),
            compiled(json!({"type": "length", "max": 10})),
            compiled(json!({"type": "equals_metadata", "key": "expected"})),
        ];
        let s = score(&checks, "no refund possible today", &json!({})).unwrap();
        assert_eq!((s.passed, s.applicable), (1, 2));
        assert!((s.score - 0.5).abs() < 1e-12);
        assert_eq!(s.critiques.len(), 1);
        let only_meta = [compiled(json!({"type": "equals_metadata", "key": "expected"}))];
        assert_eq!(score(&only_meta, "x", &json!({})), None);
    }

    #[test]
    fn the_reply_text_is_found_in_the_usual_shapes() {
        assert_eq!(reply_text(&json!("hi")), "hi");
        assert_eq!(reply_text(&json!({"content": "hi"})), "hi");
        assert_eq!(reply_text(&json!({"choices": [{"message": {"content": "hi"}}]})), "hi");
        assert_eq!(reply_text(&json!({"n": 1})), "{\"n\":1}");
        assert_eq!(reply_text(&Value::Null), "");
    }
}
