//! From OpenTelemetry spans to combee traces, following the GenAI semantic
//! conventions. All spans of one trace id become one combee trace whose
//! trajectory is the spans in start order — also when they arrive in several
//! exports: [`split_request`] cuts an export into per-span records the store
//! keeps, and [`remap`] maps the union of a trace id's records again; spans
//! that cannot map yet (no prompt or no input so far) are held, spans that
//! never can are rejected with a reason (the OTLP answer counts them).
//! Pure: no store access, no network. Which prompt names exist is checked by
//! the store, inside the merge transaction.

use std::collections::{BTreeSet, HashMap};

use opentelemetry_proto::tonic::{
    collector::trace::v1::ExportTraceServiceRequest,
    common::v1::{AnyValue, KeyValue, any_value::Value as Any},
    trace::v1::{ResourceSpans, ScopeSpans, Span, status::StatusCode},
};
use prost::Message;
use serde_json::{Map, Value, json};

use crate::{
    domain::{
        Feedback, NewTrace,
        trace::{TraceLimits, ValidTrace},
    },
    store::{OtlpRemap, OtlpSpan},
};

/// The attribute names this mapping reads (documented in docs/opentelemetry.md).
pub mod attr {
    pub const PROMPT_NAME: &str = "gen_ai.prompt.name";
    pub const PROMPT_VERSION: &str = "gen_ai.prompt.version";
    pub const COMBEE_PROMPT: &str = "combee.prompt";
    pub const COMBEE_PROMPT_VERSION: &str = "combee.prompt.version";
    pub const COMBEE_INPUT: &str = "combee.input";
    pub const COMBEE_OUTPUT: &str = "combee.output";
    pub const FEEDBACK_SCORE: &str = "combee.feedback.score";
    pub const FEEDBACK_SUCCESS: &str = "combee.feedback.success";
    pub const FEEDBACK_COMMENT: &str = "combee.feedback.comment";
    pub const FEEDBACK_ERROR: &str = "combee.feedback.error";
    pub const FEEDBACK_GROUND_TRUTH: &str = "combee.feedback.ground_truth";
    pub const INPUT_MESSAGES: &str = "gen_ai.input.messages";
    pub const OUTPUT_MESSAGES: &str = "gen_ai.output.messages";
    pub const SYSTEM_INSTRUCTIONS: &str = "gen_ai.system_instructions";
    /// Older conventions: the whole prompt / completion, or indexed
    /// `gen_ai.prompt.{i}.{field}` / `gen_ai.completion.{i}.{field}`.
    pub const LEGACY_PROMPT: &str = "gen_ai.prompt";
    pub const LEGACY_COMPLETION: &str = "gen_ai.completion";
    pub const OPERATION: &str = "gen_ai.operation.name";
    pub const REQUEST_MODEL: &str = "gen_ai.request.model";
    pub const RESPONSE_MODEL: &str = "gen_ai.response.model";
    pub const TOOL_NAME: &str = "gen_ai.tool.name";
    pub const TOOL_CALL_ID: &str = "gen_ai.tool.call.id";
    pub const TOOL_CALL_ARGUMENTS: &str = "gen_ai.tool.call.arguments";
    pub const TOOL_CALL_RESULT: &str = "gen_ai.tool.call.result";
    pub const INPUT_TOKENS: &str = "gen_ai.usage.input_tokens";
    pub const OUTPUT_TOKENS: &str = "gen_ai.usage.output_tokens";
    pub const LEGACY_INPUT_TOKENS: &str = "gen_ai.usage.prompt_tokens";
    pub const LEGACY_OUTPUT_TOKENS: &str = "gen_ai.usage.completion_tokens";
    pub const SERVICE_NAME: &str = "service.name";
    pub const CONVERSATION_ID: &str = "gen_ai.conversation.id";
    pub const AGENT_NAME: &str = "gen_ai.agent.name";
}

/// Span events that carry one message each (the event-based GenAI conventions).
const INPUT_MESSAGE_EVENTS: [(&str, &str); 4] = [
    ("gen_ai.system.message", "system"),
    ("gen_ai.user.message", "user"),
    ("gen_ai.assistant.message", "assistant"),
    ("gen_ai.tool.message", "tool"),
];
const CHOICE_EVENT: &str = "gen_ai.choice";
/// Attributes of message events that describe the emitter, not the message.
const EVENT_NOISE: [&str; 2] = ["gen_ai.system", "gen_ai.provider.name"];

/// A trace that mapped and passed validation.
#[derive(Debug, Clone, PartialEq)]
pub struct MappedTrace {
    /// The OpenTelemetry trace id, 32 lowercase hex digits (also the `external_id`).
    pub trace_id: String,
    pub spans: usize,
    pub trace: ValidTrace,
}

/// Spans that could not be mapped, and why.
#[derive(Debug, Clone, PartialEq)]
pub struct Rejection {
    /// `None` for spans without a valid trace id.
    pub trace_id: Option<String>,
    pub spans: usize,
    pub reason: String,
}

#[derive(Debug, Default, PartialEq)]
pub struct Mapping {
    pub traces: Vec<MappedTrace>,
    pub rejected: Vec<Rejection>,
}

impl Mapping {
    pub fn rejected_spans(&self) -> usize {
        self.rejected.iter().map(|r| r.spans).sum()
    }

    /// A short English summary for `partial_success.error_message`.
    pub fn error_message(&self) -> String {
        self.summary("rejected")
    }

    /// `"{what} {n} span(s): trace …: reason; …"`, or empty when no spans are listed.
    pub fn summary(&self, what: &str) -> String {
        let total = self.rejected_spans();
        if total == 0 {
            return String::new();
        }
        const SHOWN: usize = 5;
        let mut msg = format!("{what} {total} span(s): ");
        let parts: Vec<String> = self
            .rejected
            .iter()
            .take(SHOWN)
            .map(|r| match &r.trace_id {
                Some(id) => format!("trace {id} ({} span(s)): {}", r.spans, r.reason),
                None => format!("{} span(s): {}", r.spans, r.reason),
            })
            .collect();
        msg.push_str(&parts.join("; "));
        if self.rejected.len() > SHOWN {
            msg.push_str(&format!("; and {} more trace(s)", self.rejected.len() - SHOWN));
        }
        clip(msg, 2000)
    }
}

fn clip(mut s: String, max: usize) -> String {
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

struct SpanRef<'a> {
    span: &'a Span,
    resource: &'a [KeyValue],
    order: usize,
}

/// Maps every span of an export request. Traces come out in the order their
/// first span appeared in the request.
pub fn map_request(req: &ExportTraceServiceRequest, limits: TraceLimits) -> Mapping {
    let mut mapping = Mapping::default();
    let mut groups: Vec<(&[u8], Vec<SpanRef<'_>>)> = Vec::new();
    let mut index: HashMap<&[u8], usize> = HashMap::new();
    let mut bad_ids = 0;
    let mut order = 0;
    for rs in &req.resource_spans {
        let resource = rs.resource.as_ref().map_or(&[][..], |r| r.attributes.as_slice());
        for ss in &rs.scope_spans {
            for span in &ss.spans {
                order += 1;
                let id = span.trace_id.as_slice();
                if id.len() != 16 || id.iter().all(|b| *b == 0) {
                    bad_ids += 1;
                    continue;
                }
                let at = *index.entry(id).or_insert_with(|| {
                    groups.push((id, Vec::new()));
                    groups.len() - 1
                });
                groups[at].1.push(SpanRef { span, resource, order });
            }
        }
    }
    if bad_ids > 0 {
        mapping.rejected.push(Rejection {
            trace_id: None,
            spans: bad_ids,
            reason: "no valid trace id (16 bytes, not all zero)".into(),
        });
    }
    for (id, spans) in groups {
        let trace_id = hex::encode(id);
        let count = spans.len();
        match map_trace(&trace_id, spans, limits) {
            Ok(trace) => mapping.traces.push(MappedTrace { trace_id, spans: count, trace }),
            Err(unmapped) => mapping.rejected.push(Rejection {
                trace_id: Some(trace_id),
                spans: count,
                reason: unmapped.into_reason(),
            }),
        }
    }
    mapping
}

/// The most spans one trace id may gather across exports.
pub const MAX_SPANS_PER_TRACE: usize = 4096;

/// The spans of one trace id in an export, each encoded for the store.
#[derive(Debug, Clone, PartialEq)]
pub struct SpanGroup {
    /// 32 lowercase hex digits.
    pub trace_id: String,
    pub spans: Vec<OtlpSpan>,
}

/// Splits an export into its trace ids' spans, in the order each trace id
/// first appears. Each span is kept as a `ResourceSpans` holding just it, its
/// resource and its scope, so a trace can be re-mapped later from spans that
/// came in different exports. Spans without a valid trace or span id are rejected.
pub fn split_request(req: &ExportTraceServiceRequest) -> (Vec<SpanGroup>, Vec<Rejection>) {
    let mut groups: Vec<SpanGroup> = Vec::new();
    let mut index: HashMap<&[u8], usize> = HashMap::new();
    let (mut bad_trace_ids, mut bad_span_ids) = (0, 0);
    for rs in &req.resource_spans {
        for ss in &rs.scope_spans {
            for span in &ss.spans {
                let id = span.trace_id.as_slice();
                if id.len() != 16 || id.iter().all(|b| *b == 0) {
                    bad_trace_ids += 1;
                    continue;
                }
                if span.span_id.len() != 8 || span.span_id.iter().all(|b| *b == 0) {
                    bad_span_ids += 1;
                    continue;
                }
                let one = ResourceSpans {
                    resource: rs.resource.clone(),
                    schema_url: rs.schema_url.clone(),
                    scope_spans: vec![ScopeSpans {
                        scope: ss.scope.clone(),
                        schema_url: ss.schema_url.clone(),
                        spans: vec![span.clone()],
                    }],
                };
                let at = *index.entry(id).or_insert_with(|| {
                    groups.push(SpanGroup { trace_id: hex::encode(id), spans: Vec::new() });
                    groups.len() - 1
                });
                groups[at].spans.push(OtlpSpan { span_id: hex::encode(&span.span_id), body: one.encode_to_vec() });
            }
        }
    }
    let mut rejected = Vec::new();
    if bad_trace_ids > 0 {
        rejected.push(Rejection {
            trace_id: None,
            spans: bad_trace_ids,
            reason: "no valid trace id (16 bytes, not all zero)".into(),
        });
    }
    if bad_span_ids > 0 {
        rejected.push(Rejection {
            trace_id: None,
            spans: bad_span_ids,
            reason: "no valid span id (8 bytes, not all zero)".into(),
        });
    }
    (groups, rejected)
}

/// Maps every span a trace id has so far (bodies made by [`split_request`],
/// the stored ones first): a trace, not yet (hold them), or never.
pub fn remap(trace_id: &str, bodies: &[&[u8]], limits: TraceLimits) -> OtlpRemap {
    if bodies.len() > MAX_SPANS_PER_TRACE {
        return OtlpRemap::Invalid(format!("the trace would have more than {MAX_SPANS_PER_TRACE} spans"));
    }
    let mut decoded = Vec::with_capacity(bodies.len());
    for body in bodies {
        match ResourceSpans::decode(*body) {
            Ok(rs) => decoded.push(rs),
            Err(_) => return OtlpRemap::Invalid("a stored span of this trace cannot be read".into()),
        }
    }
    let mut spans = Vec::with_capacity(decoded.len());
    for rs in &decoded {
        let resource = rs.resource.as_ref().map_or(&[][..], |r| r.attributes.as_slice());
        for span in rs.scope_spans.iter().flat_map(|ss| &ss.spans) {
            spans.push(SpanRef { span, resource, order: spans.len() });
        }
    }
    match map_trace(trace_id, spans, limits) {
        Ok(trace) => OtlpRemap::Mapped(Box::new(trace)),
        Err(Unmapped::Incomplete(reason)) => OtlpRemap::Incomplete(reason),
        Err(Unmapped::Invalid(reason)) => OtlpRemap::Invalid(reason),
    }
}

fn get<'a>(attrs: &'a [KeyValue], key: &str) -> Option<&'a Any> {
    attrs.iter().find(|kv| kv.key == key).and_then(|kv| kv.value.as_ref()).and_then(|v| v.value.as_ref())
}

fn any_to_json(v: &Any, depth: usize) -> Value {
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
fn structured(v: &Any) -> Value {
    match v {
        Any::StringValue(s) => {
            let t = s.trim_start();
            if (t.starts_with('{') || t.starts_with('['))
                && let Ok(parsed) = serde_json::from_str::<Value>(s)
            {
                return parsed;
            }
            Value::String(s.clone())
        }
        other => any_to_json(other, 0),
    }
}

fn string_attr(attrs: &[KeyValue], key: &str) -> Result<Option<String>, String> {
    match get(attrs, key) {
        None => Ok(None),
        Some(Any::StringValue(s)) => Ok(Some(s.clone())),
        Some(_) => Err(format!("`{key}` must be a string")),
    }
}

fn int_attr(attrs: &[KeyValue], key: &str) -> Option<i64> {
    match get(attrs, key)? {
        Any::IntValue(i) => Some(*i),
        Any::DoubleValue(d) if d.is_finite() && d.fract() == 0.0 => Some(*d as i64),
        Any::StringValue(s) => s.trim().parse().ok(),
        _ => None,
    }
}

fn parse_version(key: &str, v: &Any) -> Result<i64, String> {
    let n = match v {
        Any::IntValue(i) => Some(*i),
        Any::StringValue(s) => s.trim().parse::<i64>().ok(),
        Any::DoubleValue(d) if d.fract() == 0.0 && d.abs() < 1e15 => Some(*d as i64),
        _ => None,
    };
    n.filter(|n| *n >= 1).ok_or_else(|| {
        let shown = clip(any_to_json(v, 0).to_string(), 60);
        format!("`{key}` must be a positive integer version number (got {shown})")
    })
}

/// `gen_ai.prompt.{i}.{field}` attributes gathered into `[{field: …}, …]` in index order.
fn indexed_messages(attrs: &[KeyValue], prefix: &str) -> Option<Value> {
    let mut by_index: std::collections::BTreeMap<u64, Map<String, Value>> = Default::default();
    for kv in attrs {
        let Some(rest) = kv.key.strip_prefix(prefix).and_then(|r| r.strip_prefix('.')) else { continue };
        let Some((index, field)) = rest.split_once('.') else { continue };
        let (Ok(index), Some(v)) = (index.parse::<u64>(), kv.value.as_ref().and_then(|v| v.value.as_ref())) else {
            continue;
        };
        by_index.entry(index).or_default().insert(field.to_owned(), structured(v));
    }
    (!by_index.is_empty()).then(|| Value::Array(by_index.into_values().map(Value::Object).collect()))
}

fn event_message(attrs: &[KeyValue], role: Option<&str>) -> Value {
    let mut msg: Map<String, Value> = attrs
        .iter()
        .filter(|kv| !EVENT_NOISE.contains(&kv.key.as_str()))
        .filter_map(|kv| kv.value.as_ref().and_then(|v| v.value.as_ref()).map(|v| (kv.key.clone(), structured(v))))
        .collect();
    if let Some(role) = role {
        msg.entry("role").or_insert_with(|| Value::String(role.to_owned()));
    }
    Value::Object(msg)
}

/// What one span contributes.
#[derive(Default)]
struct SpanFacts {
    input: Option<Value>,
    output: Option<Value>,
    explicit_input: Option<Value>,
    explicit_output: Option<Value>,
    feedback: Feedback,
    error: Option<String>,
    input_tokens: Option<i64>,
    output_tokens: Option<i64>,
    model: Option<String>,
    step: Map<String, Value>,
}

fn span_facts(span: &Span, trace_start: u64) -> Result<SpanFacts, String> {
    let a = span.attributes.as_slice();
    let mut f = SpanFacts::default();

    // Messages: span attributes first, then events, then the older conventions.
    let mut system = get(a, attr::SYSTEM_INSTRUCTIONS).map(structured);
    let mut input = get(a, attr::INPUT_MESSAGES).map(structured);
    let mut output = get(a, attr::OUTPUT_MESSAGES).map(structured);
    let mut event_inputs = Vec::new();
    let mut event_outputs = Vec::new();
    let mut exception = None;
    for ev in &span.events {
        let ea = ev.attributes.as_slice();
        if let Some((_, role)) = INPUT_MESSAGE_EVENTS.iter().find(|(name, _)| *name == ev.name) {
            event_inputs.push(event_message(ea, Some(role)));
        } else if ev.name == CHOICE_EVENT {
            event_outputs.push(event_message(ea, None));
        } else if ev.name == "exception" {
            let kind = string_attr(ea, "exception.type").ok().flatten().unwrap_or_default();
            let message = string_attr(ea, "exception.message").ok().flatten().unwrap_or_default();
            exception.get_or_insert_with(|| format!("{kind}: {message}"));
        }
        input = input.or_else(|| get(ea, attr::INPUT_MESSAGES).map(structured));
        output = output.or_else(|| get(ea, attr::OUTPUT_MESSAGES).map(structured));
        system = system.or_else(|| get(ea, attr::SYSTEM_INSTRUCTIONS).map(structured));
    }
    let input = input
        .or_else(|| get(a, attr::LEGACY_PROMPT).map(structured))
        .or_else(|| indexed_messages(a, attr::LEGACY_PROMPT))
        .or_else(|| (!event_inputs.is_empty()).then_some(Value::Array(event_inputs)));
    let output = output
        .or_else(|| get(a, attr::LEGACY_COMPLETION).map(structured))
        .or_else(|| indexed_messages(a, attr::LEGACY_COMPLETION))
        .or_else(|| (!event_outputs.is_empty()).then_some(Value::Array(event_outputs)));

    f.explicit_input = get(a, attr::COMBEE_INPUT).map(structured);
    f.explicit_output = get(a, attr::COMBEE_OUTPUT).map(structured);
    f.feedback = span_feedback(a)?;
    f.input_tokens = int_attr(a, attr::INPUT_TOKENS).or_else(|| int_attr(a, attr::LEGACY_INPUT_TOKENS));
    f.output_tokens = int_attr(a, attr::OUTPUT_TOKENS).or_else(|| int_attr(a, attr::LEGACY_OUTPUT_TOKENS));
    let status_error = span
        .status
        .as_ref()
        .filter(|s| s.code == StatusCode::Error as i32)
        .map(|s| if s.message.is_empty() { "error".to_owned() } else { s.message.clone() });
    f.error = status_error.or(exception);

    let step = &mut f.step;
    step.insert("name".into(), Value::String(span.name.clone()));
    step.insert("span_id".into(), Value::String(hex::encode(&span.span_id)));
    if !span.parent_span_id.is_empty() {
        step.insert("parent_span_id".into(), Value::String(hex::encode(&span.parent_span_id)));
    }
    let ms = |nanos: u64| (nanos as f64 / 1e6 * 1000.0).round() / 1000.0;
    step.insert("offset_ms".into(), json!(ms(span.start_time_unix_nano.saturating_sub(trace_start))));
    step.insert("duration_ms".into(), json!(ms(span.end_time_unix_nano.saturating_sub(span.start_time_unix_nano))));
    let mut put = |key: &str, v: Option<Value>| {
        if let Some(v) = v {
            step.insert(key.to_owned(), v);
        }
    };
    put("operation", get(a, attr::OPERATION).map(structured));
    let model = get(a, attr::RESPONSE_MODEL).or_else(|| get(a, attr::REQUEST_MODEL)).map(structured);
    f.model = model.as_ref().and_then(Value::as_str).map(str::to_owned);
    put("model", model);
    put("tool", get(a, attr::TOOL_NAME).map(structured));
    let tool_call: Map<String, Value> =
        [("id", attr::TOOL_CALL_ID), ("arguments", attr::TOOL_CALL_ARGUMENTS), ("result", attr::TOOL_CALL_RESULT)]
            .into_iter()
            .filter_map(|(name, key)| get(a, key).map(|v| (name.to_owned(), structured(v))))
            .collect();
    put("tool_call", (!tool_call.is_empty()).then_some(Value::Object(tool_call)));
    put("system_instructions", system);
    put("input", input.clone());
    put("output", output.clone());
    let usage: Map<String, Value> = [("input_tokens", f.input_tokens), ("output_tokens", f.output_tokens)]
        .into_iter()
        .filter_map(|(k, v)| v.map(|v| (k.to_owned(), json!(v))))
        .collect();
    put("usage", (!usage.is_empty()).then_some(Value::Object(usage)));
    put("error", f.error.clone().map(Value::String));
    f.input = input;
    f.output = output;
    Ok(f)
}

fn span_feedback(a: &[KeyValue]) -> Result<Feedback, String> {
    let score = match get(a, attr::FEEDBACK_SCORE) {
        None => None,
        Some(Any::DoubleValue(d)) => Some(*d),
        Some(Any::IntValue(i)) => Some(*i as f64),
        Some(Any::StringValue(s)) if s.trim().parse::<f64>().is_ok() => s.trim().parse().ok(),
        Some(_) => return Err(format!("`{}` must be a number", attr::FEEDBACK_SCORE)),
    };
    let success = match get(a, attr::FEEDBACK_SUCCESS) {
        None => None,
        Some(Any::BoolValue(b)) => Some(*b),
        Some(Any::StringValue(s)) if s == "true" || s == "false" => Some(s == "true"),
        Some(_) => return Err(format!("`{}` must be a boolean", attr::FEEDBACK_SUCCESS)),
    };
    Ok(Feedback {
        score,
        success,
        ground_truth: get(a, attr::FEEDBACK_GROUND_TRUTH).map(structured),
        comment: string_attr(a, attr::FEEDBACK_COMMENT)?,
        error: string_attr(a, attr::FEEDBACK_ERROR)?,
    })
}

/// The prompt attribute of a span, else of its resource.
fn prompt_attr<'a>(s: &SpanRef<'a>, keys: [&'static str; 2]) -> Option<(&'static str, &'a Any)> {
    for attrs in [s.span.attributes.as_slice(), s.resource] {
        for key in keys {
            if let Some(v) = get(attrs, key) {
                return Some((key, v));
            }
        }
    }
    None
}

/// Messages other than the system prompt: the system prompt is what combee
/// learns, not part of the task.
fn task_messages(messages: &Value) -> Value {
    if let Value::Array(items) = messages {
        let kept: Vec<Value> =
            items.iter().filter(|m| m.get("role").and_then(Value::as_str) != Some("system")).cloned().collect();
        if !kept.is_empty() {
            return Value::Array(kept);
        }
    }
    messages.clone()
}

/// Why spans do not map (yet).
#[derive(Debug, Clone, PartialEq)]
enum Unmapped {
    /// They look like part of a GenAI trace but lack the prompt or the input so
    /// far: more spans of the same trace id may still arrive.
    Incomplete(String),
    /// More spans cannot help (or the spans are not GenAI spans at all).
    Invalid(String),
}

impl Unmapped {
    fn into_reason(self) -> String {
        match self {
            Self::Incomplete(r) | Self::Invalid(r) => r,
        }
    }
}

impl From<String> for Unmapped {
    fn from(reason: String) -> Self {
        Self::Invalid(reason)
    }
}

/// Whether any span speaks the GenAI (or combee) conventions: only such
/// traces are worth holding while they are incomplete.
fn looks_generative(spans: &[SpanRef<'_>]) -> bool {
    let ours =
        |attrs: &[KeyValue]| attrs.iter().any(|kv| kv.key.starts_with("gen_ai.") || kv.key.starts_with("combee."));
    spans.iter().any(|s| {
        ours(&s.span.attributes)
            || ours(s.resource)
            || s.span.events.iter().any(|e| e.name.starts_with("gen_ai.") || ours(&e.attributes))
    })
}

fn map_trace(trace_id: &str, mut spans: Vec<SpanRef<'_>>, limits: TraceLimits) -> Result<ValidTrace, Unmapped> {
    spans.sort_by_key(|s| (s.span.start_time_unix_nano, s.order));
    let n = spans.len();

    let mut names = BTreeSet::new();
    let mut versions = BTreeSet::new();
    for s in &spans {
        if let Some((key, v)) = prompt_attr(s, [attr::PROMPT_NAME, attr::COMBEE_PROMPT]) {
            match v {
                Any::StringValue(name) => names.insert(name.clone()),
                _ => return Err(format!("`{key}` must be a string").into()),
            };
        }
        if let Some((key, v)) = prompt_attr(s, [attr::PROMPT_VERSION, attr::COMBEE_PROMPT_VERSION]) {
            versions.insert(parse_version(key, v)?);
        }
    }
    let prompt = match names.len() {
        0 => {
            let reason = format!(
                "none of its {n} span(s) carries `{}` or `{}`, so it belongs to no prompt",
                attr::PROMPT_NAME,
                attr::COMBEE_PROMPT
            );
            return Err(if looks_generative(&spans) {
                Unmapped::Incomplete(reason)
            } else {
                Unmapped::Invalid(reason)
            });
        }
        1 => names.pop_first().unwrap_or_default(),
        _ => {
            let shown: Vec<String> = names.iter().take(5).map(|s| format!("{:?}", clip(s.clone(), 60))).collect();
            return Err(
                format!("its spans name several prompts ({}); one trace maps to one prompt", shown.join(", ")).into()
            );
        }
    };
    if versions.len() > 1 {
        let shown: Vec<String> = versions.iter().take(5).map(i64::to_string).collect();
        return Err(format!("its spans name several versions ({}) of prompt {prompt:?}", shown.join(", ")).into());
    }
    let prompt_version = versions.pop_first();

    let trace_start = spans.iter().map(|s| s.span.start_time_unix_nano).min().unwrap_or(0);
    let trace_end = spans.iter().map(|s| s.span.end_time_unix_nano).max().unwrap_or(trace_start);
    let mut steps = Vec::with_capacity(n);
    let mut input = None;
    let mut explicit_input = None;
    let mut explicit_output = None;
    let mut last_output: Option<(u64, Value)> = None;
    let mut feedback = Feedback::default();
    let mut first_error = None;
    let (mut input_tokens, mut output_tokens) = (None::<i64>, None::<i64>);
    let mut models = BTreeSet::new();
    for s in &spans {
        let f = span_facts(s.span, trace_start)?;
        if explicit_input.is_none() {
            explicit_input = f.explicit_input;
        }
        if f.explicit_output.is_some() {
            explicit_output = f.explicit_output;
        }
        if input.is_none() {
            input = f.input.as_ref().map(task_messages);
        }
        if let Some(out) = f.output
            && last_output.as_ref().is_none_or(|(end, _)| s.span.end_time_unix_nano >= *end)
        {
            last_output = Some((s.span.end_time_unix_nano, out));
        }
        feedback = feedback.merged(f.feedback);
        if first_error.is_none() {
            first_error = f.error.map(|e| format!("span {:?}: {e}", clip(s.span.name.clone(), 80)));
        }
        if let Some(t) = f.input_tokens {
            input_tokens = Some(input_tokens.unwrap_or(0).saturating_add(t));
        }
        if let Some(t) = f.output_tokens {
            output_tokens = Some(output_tokens.unwrap_or(0).saturating_add(t));
        }
        models.extend(f.model);
        steps.push(Value::Object(f.step));
    }
    if feedback.error.is_none() {
        feedback.error = first_error;
    }
    let Some(input) = explicit_input.or(input) else {
        return Err(Unmapped::Incomplete(format!(
            "no input: none of its spans carries `{}`, `{}`, `{}` or a `gen_ai.*.message` event",
            attr::COMBEE_INPUT,
            attr::INPUT_MESSAGES,
            attr::LEGACY_PROMPT
        )));
    };
    let output = explicit_output.or(last_output.map(|(_, v)| v));

    let mut otel = Map::new();
    otel.insert("trace_id".into(), Value::String(trace_id.to_owned()));
    otel.insert("spans".into(), json!(n));
    otel.insert("duration_ms".into(), json!(trace_end.saturating_sub(trace_start) as f64 / 1e6));
    let service = spans.iter().find_map(|s| string_attr(s.resource, attr::SERVICE_NAME).ok().flatten());
    if let Some(service) = service {
        otel.insert("service_name".into(), Value::String(service));
    }
    let start = chrono::DateTime::from_timestamp_nanos(i64::try_from(trace_start).unwrap_or(i64::MAX));
    otel.insert("start_time".into(), Value::String(start.to_rfc3339_opts(chrono::SecondsFormat::Micros, true)));
    for (name, key) in [("conversation_id", attr::CONVERSATION_ID), ("agent_name", attr::AGENT_NAME)] {
        if let Some(v) = spans.iter().find_map(|s| get(&s.span.attributes, key)) {
            otel.insert(name.into(), any_to_json(v, 0));
        }
    }
    if let Some(t) = input_tokens {
        otel.insert("input_tokens".into(), json!(t));
    }
    if let Some(t) = output_tokens {
        otel.insert("output_tokens".into(), json!(t));
    }
    if !models.is_empty() {
        otel.insert("models".into(), json!(models));
    }

    let trace = NewTrace {
        prompt,
        prompt_version,
        input,
        trajectory: Some(Value::Array(steps)),
        output,
        feedback: Some(feedback),
        reflection: None,
        external_id: Some(trace_id.to_owned()),
        metadata: Some(json!({ "otel": otel })),
    };
    trace.validate(limits).map_err(|e| Unmapped::Invalid(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry_proto::tonic::{
        common::v1::{ArrayValue, any_value},
        resource::v1::Resource,
        trace::v1::{ResourceSpans, ScopeSpans, Status, span::Event},
    };

    const LIMITS: TraceLimits = TraceLimits { max_field_bytes: 4096, max_trace_bytes: 64 * 1024 };

    fn kv(key: &str, v: Any) -> KeyValue {
        KeyValue { key: key.into(), value: Some(AnyValue { value: Some(v) }), ..Default::default() }
    }
    fn s(key: &str, v: &str) -> KeyValue {
        kv(key, Any::StringValue(v.into()))
    }
    fn i(key: &str, v: i64) -> KeyValue {
        kv(key, Any::IntValue(v))
    }

    fn span(trace: u8, id: u8, parent: Option<u8>, start: u64, attrs: Vec<KeyValue>) -> Span {
        Span {
            trace_id: vec![trace; 16],
            span_id: vec![id; 8],
            parent_span_id: parent.map(|p| vec![p; 8]).unwrap_or_default(),
            name: format!("span-{id}"),
            start_time_unix_nano: start,
            end_time_unix_nano: start + 2_000_000,
            attributes: attrs,
            ..Default::default()
        }
    }

    fn request(resource: Vec<KeyValue>, spans: Vec<Span>) -> ExportTraceServiceRequest {
        ExportTraceServiceRequest {
            resource_spans: vec![ResourceSpans {
                resource: Some(Resource { attributes: resource, ..Default::default() }),
                scope_spans: vec![ScopeSpans { spans, ..Default::default() }],
                ..Default::default()
            }],
        }
    }

    fn one(m: Mapping) -> MappedTrace {
        assert_eq!(m.rejected, vec![], "nothing rejected");
        assert_eq!(m.traces.len(), 1);
        m.traces.into_iter().next().unwrap()
    }

    #[test]
    fn spans_of_one_trace_become_one_trace_in_start_order() {
        let input = r#"[{"role":"system","parts":[{"type":"text","content":"be nice"}]},{"role":"user","parts":[{"type":"text","content":"refund?"}]}]"#;
        let output = r#"[{"role":"assistant","parts":[{"type":"text","content":"sure"}]}]"#;
        // Given out of order: the tool span (started later) first.
        let tool = span(
            1,
            3,
            Some(1),
            3_000_000,
            vec![
                s(attr::TOOL_NAME, "lookup_order"),
                s(attr::TOOL_CALL_ARGUMENTS, r#"{"id": 7}"#),
                s(attr::TOOL_CALL_RESULT, "shipped"),
            ],
        );
        let chat = span(
            1,
            2,
            Some(1),
            1_000_000,
            vec![
                s(attr::OPERATION, "chat"),
                s(attr::REQUEST_MODEL, "gpt-x"),
                s(attr::INPUT_MESSAGES, input),
                s(attr::OUTPUT_MESSAGES, output),
                i(attr::INPUT_TOKENS, 120),
                i(attr::OUTPUT_TOKENS, 30),
            ],
        );
        let root = span(
            1,
            1,
            None,
            0,
            vec![
                s(attr::PROMPT_NAME, "support-agent"),
                i(attr::PROMPT_VERSION, 3),
                kv(attr::FEEDBACK_SCORE, Any::DoubleValue(0.25)),
                kv(attr::FEEDBACK_SUCCESS, Any::BoolValue(false)),
                s(attr::FEEDBACK_COMMENT, "too slow"),
                s(attr::CONVERSATION_ID, "conv-9"),
            ],
        );
        let t = one(map_request(&request(vec![s("service.name", "shop")], vec![tool, chat, root]), LIMITS));
        assert_eq!(t.trace_id, "01".repeat(16));
        assert_eq!(t.spans, 3);
        let v = &t.trace;
        assert_eq!((v.prompt.as_str(), v.prompt_version), ("support-agent", Some(3)));
        assert_eq!(v.external_id.as_deref(), Some("01".repeat(16).as_str()));
        // The task input leaves the system prompt out; the step keeps it.
        assert_eq!(v.input, json!([{"role":"user","parts":[{"type":"text","content":"refund?"}]}]));
        assert_eq!(v.output, serde_json::from_str::<Value>(output).unwrap());
        let steps = v.trajectory.as_array().unwrap();
        let names: Vec<_> = steps.iter().map(|s| s["name"].as_str().unwrap()).collect();
        assert_eq!(names, ["span-1", "span-2", "span-3"]);
        assert_eq!(steps[1]["input"][0]["role"], "system");
        assert_eq!(steps[1]["model"], "gpt-x");
        assert_eq!(steps[1]["usage"], json!({"input_tokens": 120, "output_tokens": 30}));
        assert_eq!(steps[2]["tool_call"], json!({"arguments": {"id": 7}, "result": "shipped"}));
        assert_eq!(steps[2]["parent_span_id"], "01".repeat(8));
        assert_eq!(steps[2]["offset_ms"], 3.0);
        assert_eq!(steps[2]["duration_ms"], 2.0);
        assert_eq!(
            (v.feedback.score, v.feedback.success, v.feedback.comment.as_deref()),
            (Some(0.25), Some(false), Some("too slow"))
        );
        let otel = &v.metadata["otel"];
        assert_eq!(otel["service_name"], "shop");
        assert_eq!((otel["input_tokens"].as_i64(), otel["output_tokens"].as_i64()), (Some(120), Some(30)));
        assert_eq!(otel["duration_ms"], 5.0);
        assert_eq!(otel["spans"], 3);
        assert_eq!(otel["models"], json!(["gpt-x"]));
        assert_eq!(otel["start_time"], "1970-01-01T00:00:00.000000Z");
        assert_eq!(otel["conversation_id"], "conv-9");
    }

    #[test]
    fn older_conventions_and_message_events_map_too() {
        // Indexed gen_ai.prompt.{i}.* attributes, a string version, the prompt on the resource.
        let legacy = span(
            2,
            1,
            None,
            10,
            vec![
                s("gen_ai.prompt.0.role", "system"),
                s("gen_ai.prompt.0.content", "sys"),
                s("gen_ai.prompt.1.role", "user"),
                s("gen_ai.prompt.1.content", "hello"),
                s("gen_ai.completion.0.role", "assistant"),
                s("gen_ai.completion.0.content", "hi"),
                i(attr::LEGACY_INPUT_TOKENS, 5),
            ],
        );
        let req =
            request(vec![s(attr::COMBEE_PROMPT, "legacy-bot"), s(attr::COMBEE_PROMPT_VERSION, "2")], vec![legacy]);
        let t = one(map_request(&req, LIMITS)).trace;
        assert_eq!((t.prompt.as_str(), t.prompt_version), ("legacy-bot", Some(2)));
        assert_eq!(t.input, json!([{"role": "user", "content": "hello"}]));
        assert_eq!(t.output, json!([{"role": "assistant", "content": "hi"}]));
        assert_eq!(t.metadata["otel"]["input_tokens"], 5);

        // Message events and a choice event; a failed span becomes feedback.error.
        let mut ev = span(3, 1, None, 10, vec![s(attr::PROMPT_NAME, "events-bot")]);
        ev.events = vec![
            Event { name: "gen_ai.system.message".into(), attributes: vec![s("content", "sys")], ..Default::default() },
            Event {
                name: "gen_ai.user.message".into(),
                attributes: vec![s("content", "what time is it"), s("gen_ai.system", "openai")],
                ..Default::default()
            },
            Event {
                name: "gen_ai.choice".into(),
                attributes: vec![i("index", 0), s("message", r#"{"role":"assistant","content":"noon"}"#)],
                ..Default::default()
            },
        ];
        ev.status = Some(Status { code: StatusCode::Error as i32, message: "rate limited".into() });
        let t = one(map_request(&request(vec![], vec![ev]), LIMITS)).trace;
        assert_eq!(t.prompt_version, None);
        assert_eq!(t.input, json!([{"role": "user", "content": "what time is it"}]));
        assert_eq!(t.output, json!([{"index": 0, "message": {"role": "assistant", "content": "noon"}}]));
        assert_eq!(t.feedback.error.as_deref(), Some("span \"span-1\": rate limited"));
    }

    #[test]
    fn explicit_combee_attributes_win() {
        let root = span(
            4,
            1,
            None,
            0,
            vec![
                s(attr::PROMPT_NAME, "p"),
                s(attr::COMBEE_INPUT, r#"{"question": "2+2"}"#),
                s(attr::COMBEE_OUTPUT, "4"),
                s(attr::FEEDBACK_GROUND_TRUTH, "4"),
                s(attr::FEEDBACK_SCORE, "1"),
                s(attr::FEEDBACK_ERROR, "none really"),
            ],
        );
        let chat = span(4, 2, Some(1), 5, vec![s(attr::LEGACY_PROMPT, "what is 2+2"), s(attr::LEGACY_COMPLETION, "5")]);
        let t = one(map_request(&request(vec![], vec![root, chat]), LIMITS)).trace;
        assert_eq!(t.input, json!({"question": "2+2"}));
        assert_eq!(t.output, json!("4"));
        assert_eq!(t.feedback.ground_truth, Some(json!("4")));
        assert_eq!(t.feedback.score, Some(1.0));
        assert_eq!(t.feedback.error.as_deref(), Some("none really"));
        assert_eq!(t.trajectory[1]["input"], "what is 2+2");
    }

    fn rejected_reason(spans: Vec<Span>) -> String {
        let m = map_request(&request(vec![], spans), LIMITS);
        assert_eq!(m.traces, vec![]);
        assert_eq!(m.rejected.len(), 1);
        m.rejected[0].reason.clone()
    }

    #[test]
    fn unmappable_traces_are_rejected_with_a_reason_and_counted() {
        let input = || s(attr::LEGACY_PROMPT, "q");
        assert!(rejected_reason(vec![span(5, 1, None, 0, vec![input()])]).contains("belongs to no prompt"));
        assert!(rejected_reason(vec![span(5, 1, None, 0, vec![s(attr::PROMPT_NAME, "p")])]).starts_with("no input"));
        let bad_version = rejected_reason(vec![span(
            5,
            1,
            None,
            0,
            vec![s(attr::PROMPT_NAME, "p"), s(attr::PROMPT_VERSION, "v2"), input()],
        )]);
        assert!(bad_version.contains("positive integer") && bad_version.contains("v2"), "{bad_version}");
        let zero = rejected_reason(vec![span(
            5,
            1,
            None,
            0,
            vec![s(attr::PROMPT_NAME, "p"), i(attr::PROMPT_VERSION, 0), input()],
        )]);
        assert!(zero.contains("positive integer"), "{zero}");
        let two = rejected_reason(vec![
            span(5, 1, None, 0, vec![s(attr::PROMPT_NAME, "a"), input()]),
            span(5, 2, None, 0, vec![s(attr::PROMPT_NAME, "b")]),
        ]);
        assert!(two.contains("several prompts (\"a\", \"b\")"), "{two}");
        let bad_name = rejected_reason(vec![span(5, 1, None, 0, vec![s(attr::PROMPT_NAME, "Not A Name!"), input()])]);
        assert!(!bad_name.is_empty());
        let bad_score = rejected_reason(vec![span(
            5,
            1,
            None,
            0,
            vec![s(attr::PROMPT_NAME, "p"), s(attr::FEEDBACK_SCORE, "great"), input()],
        )]);
        assert!(bad_score.contains("combee.feedback.score"), "{bad_score}");
        let non_string = rejected_reason(vec![span(5, 1, None, 0, vec![i(attr::PROMPT_NAME, 3), input()])]);
        assert!(non_string.contains("must be a string"), "{non_string}");
    }

    #[test]
    fn size_limits_apply_to_mapped_traces() {
        let big = "x".repeat(LIMITS.max_field_bytes + 1);
        let reason =
            rejected_reason(vec![span(6, 1, None, 0, vec![s(attr::PROMPT_NAME, "p"), s(attr::LEGACY_PROMPT, &big)])]);
        assert!(reason.contains("limit"), "{reason}");
    }

    #[test]
    fn a_batch_mixes_accepted_and_rejected_traces() {
        let ok = span(7, 1, None, 0, vec![s(attr::PROMPT_NAME, "p"), s(attr::LEGACY_PROMPT, "q")]);
        let orphan_a = span(8, 1, None, 0, vec![]);
        let orphan_b = span(8, 2, Some(1), 1, vec![]);
        let mut no_id = span(0, 1, None, 0, vec![]);
        no_id.trace_id = vec![1, 2, 3];
        let m = map_request(&request(vec![], vec![orphan_a, ok, no_id, orphan_b]), LIMITS);
        assert_eq!(m.traces.len(), 1);
        assert_eq!(m.rejected_spans(), 3);
        let msg = m.error_message();
        assert!(msg.starts_with("rejected 3 span(s): "), "{msg}");
        assert!(msg.contains(&"08".repeat(16)) && msg.contains("no valid trace id"), "{msg}");
    }

    #[test]
    fn exports_split_by_trace_id_and_parts_remap_from_their_union() {
        let root = span(9, 1, None, 0, vec![s(attr::PROMPT_NAME, "p")]);
        let chat = span(9, 2, Some(1), 5, vec![s(attr::LEGACY_PROMPT, "q"), s(attr::LEGACY_COMPLETION, "a")]);
        let other = span(10, 1, None, 0, vec![s(attr::PROMPT_NAME, "p"), s(attr::LEGACY_PROMPT, "q")]);
        let mut no_span_id = span(9, 3, None, 0, vec![]);
        no_span_id.span_id = vec![0; 8];
        let (groups, rejected) =
            split_request(&request(vec![s("service.name", "shop")], vec![chat, other, no_span_id, root]));
        assert_eq!(groups.iter().map(|g| g.trace_id.as_str()).collect::<Vec<_>>(), ["09".repeat(16), "0a".repeat(16)]);
        assert_eq!(
            groups[0].spans.iter().map(|s| s.span_id.as_str()).collect::<Vec<_>>(),
            ["02".repeat(8), "01".repeat(8)]
        );
        assert_eq!(rejected.len(), 1);
        assert!(rejected[0].reason.contains("no valid span id"), "{rejected:?}");

        let id = "09".repeat(16);
        let bodies: Vec<&[u8]> = groups[0].spans.iter().map(|s| s.body.as_slice()).collect();
        // Each part alone does not map yet; together they do, in start order, with the resource.
        assert!(
            matches!(remap(&id, &bodies[..1], LIMITS), OtlpRemap::Incomplete(r) if r.contains("belongs to no prompt"))
        );
        assert!(matches!(remap(&id, &bodies[1..], LIMITS), OtlpRemap::Incomplete(r) if r.starts_with("no input")));
        let OtlpRemap::Mapped(t) = remap(&id, &[bodies[1], bodies[0]], LIMITS) else { panic!("maps") };
        let names: Vec<_> = t.trajectory.as_array().unwrap().iter().map(|s| s["name"].as_str().unwrap()).collect();
        assert_eq!(names, ["span-1", "span-2"]);
        assert_eq!((t.input.clone(), t.metadata["otel"]["service_name"].clone()), (json!("q"), json!("shop")));

        // Spans that speak no GenAI convention are not worth holding; broken ones never map.
        let (http, _) = split_request(&request(vec![], vec![span(11, 1, None, 0, vec![s("http.route", "/")])]));
        let http_body = [http[0].spans[0].body.as_slice()];
        assert!(
            matches!(remap(&"0b".repeat(16), &http_body, LIMITS), OtlpRemap::Invalid(r) if r.contains("belongs to no prompt"))
        );
        assert!(matches!(remap(&id, &[b"not protobuf"], LIMITS), OtlpRemap::Invalid(_)));
        let too_many = vec![bodies[0]; MAX_SPANS_PER_TRACE + 1];
        assert!(matches!(remap(&id, &too_many, LIMITS), OtlpRemap::Invalid(r) if r.contains("more than")));
    }

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
    }
}
