//! Traces: one agent run each, sent by deployed agents and consumed by rounds.
//! Everything in a trace is untrusted; [`NewTrace::validate`] is the gate.

use std::{fmt, marker::PhantomData};

use chrono::{DateTime, Utc};
use serde::{
    Deserialize, Deserializer, Serialize,
    de::{MapAccess, Visitor, value::MapAccessDeserializer},
};
use serde_json::Value;
use utoipa::ToSchema;
use uuid::Uuid;

use super::names::PromptName;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum TraceStatus {
    /// Waiting for a round.
    Pending,
    /// Learned from by a round that published a version.
    Consumed,
    /// Given up on after the configured attempts; `failure_reason` says why.
    Failed,
    /// Held back by an operator (a suspected poisoned trace): kept and visible,
    /// never reserved by a round.
    Quarantined,
}

impl TraceStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Consumed => "consumed",
            Self::Failed => "failed",
            Self::Quarantined => "quarantined",
        }
    }
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "pending" => Self::Pending,
            "consumed" => Self::Consumed,
            "failed" => Self::Failed,
            "quarantined" => Self::Quarantined,
            _ => return None,
        })
    }
}

/// How the run went, from whoever could judge it. Every field is optional and
/// may arrive later than the trace (`POST /v1/traces/{id}/feedback`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Feedback {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub score: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub success: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub ground_truth: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub comment: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl Feedback {
    /// Whether the feedback carries a reward (a success flag or a score).
    pub fn rewarded(&self) -> bool {
        self.success.is_some() || self.score.is_some()
    }

    /// Late feedback: fields present in `later` replace the earlier ones.
    pub fn merged(self, later: Feedback) -> Feedback {
        Feedback {
            score: later.score.or(self.score),
            success: later.success.or(self.success),
            ground_truth: later.ground_truth.or(self.ground_truth),
            comment: later.comment.or(self.comment),
            error: later.error.or(self.error),
        }
    }
}

/// A trace as an agent sends it.
#[derive(Debug, Clone, PartialEq, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewTrace {
    /// The prompt the agent ran with: its name, or `project/name` (a
    /// server-wide key names a prompt of another project than `default` so).
    pub prompt: String,
    /// The version of that prompt the agent ran with, when it knows it.
    #[serde(default)]
    pub prompt_version: Option<i64>,
    /// The task input (any JSON).
    #[schema(value_type = Object)]
    pub input: Value,
    /// Messages, steps, tool calls (any JSON).
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub trajectory: Option<Value>,
    /// The final output (any JSON).
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub output: Option<Value>,
    #[serde(default, deserialize_with = "object_or_null")]
    pub feedback: Option<Feedback>,
    /// The agent's own reflection; a round uses it instead of calling the reflector.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub reflection: Option<Value>,
    #[serde(default)]
    pub external_id: Option<String>,
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub metadata: Option<Value>,
}

/// A `T` read only from a JSON object: serde's derived structs also take a
/// JSON array of their fields in order, which no client of this API means.
#[derive(Debug, Clone, PartialEq)]
pub struct ObjectOnly<T>(pub T);

impl<'de, T: Deserialize<'de>> Deserialize<'de> for ObjectOnly<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Object<T>(PhantomData<T>);
        impl<'de, T: Deserialize<'de>> Visitor<'de> for Object<T> {
            type Value = ObjectOnly<T>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
                T::deserialize(MapAccessDeserializer::new(map)).map(ObjectOnly)
            }
        }
        d.deserialize_map(Object(PhantomData))
    }
}

/// A trace's `feedback`: an object, or null for none.
fn object_or_null<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Feedback>, D::Error> {
    Ok(Option::<ObjectOnly<Feedback>>::deserialize(d)?.map(|f| f.0))
}

/// Size limits applied to every trace at the edge.
#[derive(Debug, Clone, Copy)]
pub struct TraceLimits {
    /// Largest single string anywhere in a trace, in bytes.
    pub max_field_bytes: usize,
    /// Largest trace, as re-encoded JSON, in bytes.
    pub max_trace_bytes: usize,
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum TraceError {
    #[error("{0}")]
    BadName(#[from] super::NameError),
    #[error("`input` must not be null")]
    NullInput,
    #[error("`prompt_version` must be at least 1")]
    BadVersion,
    #[error("`external_id` must be 1..=200 characters")]
    BadExternalId,
    #[error("`metadata` must be a JSON object")]
    BadMetadata,
    #[error("`feedback.score` must be a finite number")]
    BadScore,
    #[error("a string field at {path} is {len} bytes; the limit is {limit}")]
    FieldTooLarge { path: String, len: usize, limit: usize },
    #[error("a string at {path} holds U+0000 (NUL), which a trace may not hold")]
    Nul { path: String },
    #[error("the trace is {len} bytes; the limit is {limit}")]
    TraceTooLarge { len: usize, limit: usize },
}

impl TraceError {
    /// Size violations are answered with 413; the rest with 422.
    pub fn is_size(&self) -> bool {
        matches!(self, Self::FieldTooLarge { .. } | Self::TraceTooLarge { .. })
    }
}

fn check_strings(v: &Value, path: &mut String, limit: usize) -> Result<(), TraceError> {
    let problem = first_in_strings(v, path, &mut |s, at| {
        if s.len() > limit {
            Some(TraceError::FieldTooLarge { path: at.to_owned(), len: s.len(), limit })
        } else if s.contains('\0') {
            Some(TraceError::Nul { path: at.to_owned() })
        } else {
            None
        }
    });
    problem.map_or(Ok(()), Err)
}

/// The first answer of `found(s, at)` over every string and object key in
/// `v`, in order: `at` is where the string is (a key: its object), written
/// `a.b[2]` after `path`, and keys longer than 40 characters cut there.
pub fn first_in_strings<T>(v: &Value, path: &mut String, found: &mut impl FnMut(&str, &str) -> Option<T>) -> Option<T> {
    match v {
        Value::String(s) => found(s, path),
        Value::Array(items) => items.iter().enumerate().find_map(|(i, item)| {
            let len = path.len();
            path.push_str(&format!("[{i}]"));
            let answer = first_in_strings(item, path, found);
            path.truncate(len);
            answer
        }),
        Value::Object(map) => map.iter().find_map(|(k, item)| {
            if let Some(answer) = found(k, path) {
                return Some(answer);
            }
            let len = path.len();
            if !path.is_empty() {
                path.push('.');
            }
            path.extend(k.chars().take(40));
            let answer = first_in_strings(item, path, found);
            path.truncate(len);
            answer
        }),
        _ => None,
    }
}

/// A trace that passed validation, ready to store.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidTrace {
    pub prompt: PromptName,
    pub prompt_version: Option<i64>,
    pub input: Value,
    pub trajectory: Value,
    pub output: Value,
    pub feedback: Feedback,
    pub reflection: Option<Value>,
    pub external_id: Option<String>,
    pub metadata: Value,
}

impl NewTrace {
    /// The trace checked, its prompt read as written: `project/name`, or a
    /// bare name of `home` (the caller's project; `default` for a
    /// server-wide caller).
    pub fn validate(self, limits: TraceLimits, home: &str) -> Result<ValidTrace, TraceError> {
        let prompt = PromptName::written(&self.prompt, home)?;
        if self.input.is_null() {
            return Err(TraceError::NullInput);
        }
        if self.prompt_version.is_some_and(|v| v < 1) {
            return Err(TraceError::BadVersion);
        }
        if let Some(id) = &self.external_id
            && (id.is_empty() || id.chars().count() > 200)
        {
            return Err(TraceError::BadExternalId);
        }
        if self.external_id.as_ref().is_some_and(|id| id.contains('\0')) {
            return Err(TraceError::Nul { path: "external_id".into() });
        }
        let metadata = self.metadata.unwrap_or_else(|| Value::Object(Default::default()));
        if !metadata.is_object() {
            return Err(TraceError::BadMetadata);
        }
        let feedback = self.feedback.unwrap_or_default();
        if feedback.score.is_some_and(|s| !s.is_finite()) {
            return Err(TraceError::BadScore);
        }
        let trace = ValidTrace {
            prompt,
            prompt_version: self.prompt_version,
            input: self.input,
            trajectory: self.trajectory.unwrap_or(Value::Null),
            output: self.output.unwrap_or(Value::Null),
            feedback,
            reflection: self.reflection.filter(|r| !r.is_null()),
            external_id: self.external_id,
            metadata,
        };
        trace.check_size(limits)?;
        Ok(trace)
    }
}

impl ValidTrace {
    fn check_size(&self, limits: TraceLimits) -> Result<(), TraceError> {
        let feedback = serde_json::to_value(&self.feedback).unwrap_or(Value::Null);
        let mut total = self.external_id.as_ref().map_or(0, |s| s.len());
        for (name, v) in [
            ("input", &self.input),
            ("trajectory", &self.trajectory),
            ("output", &self.output),
            ("feedback", &feedback),
            ("metadata", &self.metadata),
        ]
        .into_iter()
        .chain(self.reflection.as_ref().map(|r| ("reflection", r)))
        {
            let mut path = name.to_owned();
            check_strings(v, &mut path, limits.max_field_bytes)?;
            let mut counted = ByteCounter(0);
            total += serde_json::to_writer(&mut counted, v).map_or(0, |()| counted.0);
        }
        if total > limits.max_trace_bytes {
            return Err(TraceError::TraceTooLarge { len: total, limit: limits.max_trace_bytes });
        }
        Ok(())
    }
}

/// Counts the bytes written to it: a trace's encoded size without the encoding.
struct ByteCounter(usize);

impl std::io::Write for ByteCounter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0 += buf.len();
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A stored trace.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct Trace {
    pub id: Uuid,
    #[schema(value_type = String)]
    pub prompt: PromptName,
    pub prompt_version: Option<i64>,
    pub status: TraceStatus,
    #[schema(value_type = Object)]
    pub input: Value,
    #[schema(value_type = Object)]
    pub trajectory: Value,
    #[schema(value_type = Object)]
    pub output: Value,
    pub feedback: Feedback,
    #[schema(value_type = Option<Object>)]
    pub reflection: Option<Value>,
    pub external_id: Option<String>,
    #[schema(value_type = Object)]
    pub metadata: Value,
    /// How many rounds have tried to learn from this trace and failed.
    pub attempts: i32,
    pub failure_reason: Option<String>,
    pub round_id: Option<Uuid>,
    /// When an operator quarantined the trace (status `quarantined`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quarantined_at: Option<DateTime<Utc>>,
    /// The operator's reason for the quarantine.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quarantine_reason: Option<String>,
    /// Who wrote `feedback`: absent for the agent (reported), `judge` (the
    /// prompt's evaluators, named in `judged.by`) or `human` (an operator).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub feedback_source: Option<FeedbackSource>,
    /// What the prompt's evaluators made of the trace, once they looked at it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub judged: Option<Judged>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

/// Who wrote a trace's feedback, when not the agent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum FeedbackSource {
    /// The agent (reported); stored as no source at all.
    Agent,
    /// The prompt's evaluators, on a trace the agent did not score.
    Judge,
    /// An operator's label: wins over a judge, counts as calibration data.
    Human,
}

impl FeedbackSource {
    /// The stored column: NULL for the agent.
    pub fn column(self) -> Option<&'static str> {
        match self {
            Self::Agent => None,
            Self::Judge => Some("judge"),
            Self::Human => Some("human"),
        }
    }
    pub fn from_column(s: Option<&str>) -> Self {
        match s {
            Some("judge") => Self::Judge,
            Some("human") => Self::Human,
            _ => Self::Agent,
        }
    }
}

/// The evaluators' verdicts on one trace.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Judged {
    pub at: DateTime<Utc>,
    /// The evaluators whose scores make the judged feedback, when it is the
    /// trace's feedback (comma-separated).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub by: Option<String>,
    pub judgements: Vec<crate::evaluate::evaluators::Judgement>,
}

impl Trace {
    /// A trace as it stands just after ingest: pending, untried, in no round,
    /// no metadata, created now (for the simulator, benchmarks and tests that
    /// feed a round without a store).
    pub fn pending(prompt: PromptName, input: Value, trajectory: Value, output: Value, feedback: Feedback) -> Self {
        let now = Utc::now();
        Trace {
            id: Uuid::now_v7(),
            prompt,
            prompt_version: Some(1),
            status: TraceStatus::Pending,
            input,
            trajectory,
            output,
            feedback,
            reflection: None,
            external_id: None,
            metadata: Value::Object(Default::default()),
            attempts: 0,
            failure_reason: None,
            round_id: None,
            quarantined_at: None,
            quarantine_reason: None,
            feedback_source: None,
            judged: None,
            created_at: now,
            updated_at: now,
        }
    }
}

/// Which traces a listing covers, newest first.
#[derive(Debug, Clone, Default)]
pub struct TraceFilter {
    pub prompt: Option<PromptName>,
    /// Only traces of this project's prompts.
    pub project: Option<String>,
    pub status: Option<TraceStatus>,
    pub since: Option<DateTime<Utc>>,
    pub until: Option<DateTime<Utc>>,
    /// Return traces with ids below this (newest first pagination).
    pub before_id: Option<Uuid>,
}

/// Which failed traces of a prompt to put back to pending.
#[derive(Debug, Clone)]
pub struct RequeueFailed {
    pub prompt: PromptName,
    /// Only these traces (ids of traces that are not failed are skipped); `None`: every failed one.
    pub ids: Option<Vec<Uuid>>,
    /// Only traces received at or after this.
    pub since: Option<DateTime<Utc>>,
}

/// An `Idempotency-Key` as the store keeps it: per caller, bound to the hash
/// of the request it first came with.
#[derive(Debug, Clone, Copy)]
pub struct IdempotencyKey<'a> {
    pub owner: Uuid,
    pub key: &'a str,
    pub request_hash: &'a str,
}

/// How an ingest under an `Idempotency-Key` ended.
#[derive(Debug, Clone, PartialEq)]
pub enum IdempotentIngest {
    /// First sighting: the traces and the key were committed together.
    Stored { ids: Vec<Uuid> },
    /// The same request was stored before: these are its traces, in request
    /// order (nothing stored now).
    Replay { ids: Vec<Uuid> },
    /// The same key was used with another payload (nothing stored).
    Mismatch,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const LIMITS: TraceLimits = TraceLimits { max_field_bytes: 16, max_trace_bytes: 200 };

    fn parse(v: Value) -> NewTrace {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn a_minimal_trace_is_valid() {
        let t = parse(json!({"prompt": "p", "input": "hi"})).validate(LIMITS, "default").unwrap();
        assert_eq!((t.prompt.project(), t.prompt.as_str()), ("default", "p"));
        let t = parse(json!({"prompt": "p", "input": "hi"})).validate(LIMITS, "team-a").unwrap();
        assert_eq!(t.prompt.project(), "team-a");
        let t = parse(json!({"prompt": "team-b/p", "input": "hi"})).validate(LIMITS, "team-a").unwrap();
        assert_eq!((t.prompt.project(), t.prompt.as_str()), ("team-b", "p"));
        assert_eq!(t.metadata, json!({}));
    }

    #[test]
    fn field_and_trace_limits_name_the_offender() {
        let e = parse(json!({"prompt": "p", "input": {"q": ["ok", "x".repeat(17)]}}))
            .validate(LIMITS, "default")
            .unwrap_err();
        assert_eq!(e, TraceError::FieldTooLarge { path: "input.q[1]".into(), len: 17, limit: 16 });
        assert!(e.is_size());
        let many: Vec<_> = (0..60).map(|i| format!("s{i}")).collect();
        let e = parse(json!({"prompt": "p", "input": many})).validate(LIMITS, "default").unwrap_err();
        assert!(matches!(e, TraceError::TraceTooLarge { .. }));
    }

    #[test]
    fn semantic_errors_are_reported() {
        assert_eq!(
            parse(json!({"prompt": "p", "input": null})).validate(LIMITS, "default"),
            Err(TraceError::NullInput)
        );
        assert!(matches!(
            parse(json!({"prompt": "P!", "input": 1})).validate(LIMITS, "default"),
            Err(TraceError::BadName(_))
        ));
        assert_eq!(
            parse(json!({"prompt": "p", "input": 1, "prompt_version": 0})).validate(LIMITS, "default"),
            Err(TraceError::BadVersion)
        );
        assert_eq!(
            parse(json!({"prompt": "p", "input": 1, "metadata": [1]})).validate(LIMITS, "default"),
            Err(TraceError::BadMetadata)
        );
        assert!(serde_json::from_value::<NewTrace>(json!({"prompt": "p", "input": 1, "extra": 1})).is_err());
    }

    #[test]
    fn no_string_may_hold_nul() {
        let nul = |v: Value| parse(v).validate(LIMITS, "default").unwrap_err();
        assert_eq!(
            nul(json!({"prompt": "p", "input": {"q": ["ok", "a\0"]}})),
            TraceError::Nul { path: "input.q[1]".into() }
        );
        assert_eq!(nul(json!({"prompt": "p", "input": {"a\0": 1}})), TraceError::Nul { path: "input".into() });
        assert_eq!(
            nul(json!({"prompt": "p", "input": 1, "external_id": "x\0"})),
            TraceError::Nul { path: "external_id".into() }
        );
        let e = nul(json!({"prompt": "p", "input": 1, "feedback": {"comment": "\0"}}));
        assert_eq!(e, TraceError::Nul { path: "feedback.comment".into() });
        assert!(!e.is_size());
    }

    #[test]
    fn late_feedback_overrides_present_fields_only() {
        let early = Feedback { score: Some(0.5), comment: Some("meh".into()), ..Default::default() };
        let later = Feedback { success: Some(true), comment: Some("good".into()), ..Default::default() };
        let m = early.merged(later);
        assert_eq!((m.score, m.success, m.comment.as_deref()), (Some(0.5), Some(true), Some("good")));
    }
}
