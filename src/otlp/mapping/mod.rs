//! From OpenTelemetry spans and log records to combee traces. All records of
//! one trace id become one combee trace whose trajectory is the spans in start
//! order — also when they arrive in several exports: [`split_request`] (spans)
//! and [`crate::otlp::logs::split_request`] (log records) cut an export into
//! per-record bodies the store keeps, and [`remap`] maps the union of a trace
//! id's records again; records that cannot map yet (no prompt or no input so
//! far) are held, records that never can are rejected with a reason (the
//! OTLP answer counts them).
//!
//! Each span is read through the conventions instrumentations speak, one
//! file each: the OpenTelemetry GenAI conventions with their older forms
//! ([`genai`]), OpenInference ([`openinference`]), the Vercel AI SDK
//! ([`vercel`]) and Langfuse ([`langfuse`]); the first convention that has a
//! value wins, in that order, and combee's own `combee.*` attributes win over
//! all. Pure: no store access, no network. Which prompt names exist is checked
//! by the store, inside the merge transaction.

mod genai;
mod langfuse;
mod openinference;
pub(crate) mod records;
mod values;
mod vercel;

use std::collections::{BTreeSet, HashMap};

use opentelemetry_proto::tonic::{
    collector::trace::v1::ExportTraceServiceRequest,
    common::v1::{KeyValue, any_value::Value as Any},
    trace::v1::{ResourceSpans, ScopeSpans, Span, status::StatusCode},
};
use prost::Message;
use serde_json::{Map, Value, json};

use crate::domain::{
    Feedback, NewTrace,
    span::{OtlpRemap, OtlpSpan},
    trace::{TraceLimits, ValidTrace},
};
use records::Record;
use values::{any_to_json, clip, get, parse_version, string_attr, structured};

/// The attribute names combee itself defines, and the GenAI ones every
/// convention module shares (documented in docs/opentelemetry.md and docs/integrations.md).
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
    /// OpenInference and Langfuse name a conversation and a user this way.
    pub const SESSION_ID: &str = "session.id";
    pub const USER_ID: &str = "user.id";
    pub const EVALUATION_EVENT: &str = "gen_ai.evaluation.result";
}

/// Where a trace names its prompt, first match wins (each on the span, then
/// its resource): the GenAI attribute, combee's own, Langfuse's prompt link,
/// and combee's attribute carried in Vercel AI SDK telemetry metadata or
/// runtime context.
const PROMPT_NAME_KEYS: [&str; 5] =
    [attr::PROMPT_NAME, attr::COMBEE_PROMPT, langfuse::PROMPT_NAME, vercel::METADATA_PROMPT, vercel::CONTEXT_PROMPT];
const PROMPT_VERSION_KEYS: [&str; 5] = [
    attr::PROMPT_VERSION,
    attr::COMBEE_PROMPT_VERSION,
    langfuse::PROMPT_VERSION,
    vercel::METADATA_PROMPT_VERSION,
    vercel::CONTEXT_PROMPT_VERSION,
];

/// A trace that mapped and passed validation.
#[derive(Debug, Clone, PartialEq)]
pub struct MappedTrace {
    /// The OpenTelemetry trace id, 32 lowercase hex digits (also the `external_id`).
    pub trace_id: String,
    pub spans: usize,
    pub trace: ValidTrace,
}

/// Records (spans or log records) that could not be mapped, and why.
#[derive(Debug, Clone, PartialEq)]
pub struct Rejection {
    /// `None` for records without a valid trace id.
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
        self.summary("rejected", "span(s)")
    }

    /// `"{what} {n} {unit}: trace …: reason; …"`, or empty when nothing is listed.
    pub fn summary(&self, what: &str, unit: &str) -> String {
        let total = self.rejected_spans();
        if total == 0 {
            return String::new();
        }
        const SHOWN: usize = 5;
        let mut msg = format!("{what} {total} {unit}: ");
        let parts: Vec<String> = self
            .rejected
            .iter()
            .take(SHOWN)
            .map(|r| match &r.trace_id {
                Some(id) => format!("trace {id} ({} {unit}): {}", r.spans, r.reason),
                None => format!("{} {unit}: {}", r.spans, r.reason),
            })
            .collect();
        msg.push_str(&parts.join("; "));
        if self.rejected.len() > SHOWN {
            msg.push_str(&format!("; and {} more trace(s)", self.rejected.len() - SHOWN));
        }
        clip(msg, 2000)
    }
}

/// The most records one trace id may gather across exports.
pub const MAX_SPANS_PER_TRACE: usize = 4096;

/// The records of one trace id in an export, each encoded for the store.
#[derive(Debug, Clone, PartialEq)]
pub struct SpanGroup {
    /// 32 lowercase hex digits.
    pub trace_id: String,
    pub spans: Vec<OtlpSpan>,
}

/// Whether an OTLP trace id is usable: 16 bytes, not all zero.
pub(crate) fn valid_trace_id(id: &[u8]) -> bool {
    id.len() == 16 && id.iter().any(|b| *b != 0)
}

/// Whether an OTLP span id is usable: 8 bytes, not all zero.
pub(crate) fn valid_span_id(id: &[u8]) -> bool {
    id.len() == 8 && id.iter().any(|b| *b != 0)
}

/// Groups records by trace id, in the order each trace id first appears.
pub(crate) fn group_by_trace(items: impl IntoIterator<Item = (Vec<u8>, OtlpSpan)>) -> Vec<SpanGroup> {
    let mut groups: Vec<SpanGroup> = Vec::new();
    let mut index: HashMap<Vec<u8>, usize> = HashMap::new();
    for (id, span) in items {
        let at = *index.entry(id).or_insert_with_key(|id| {
            groups.push(SpanGroup { trace_id: hex::encode(id), spans: Vec::new() });
            groups.len() - 1
        });
        groups[at].spans.push(span);
    }
    groups
}

/// Splits an export into its trace ids' spans, in the order each trace id
/// first appears. Each span is kept as a `ResourceSpans` holding just it, its
/// resource and its scope, so a trace can be re-mapped later from spans that
/// came in different exports. Spans without a valid trace or span id are rejected.
pub fn split_request(req: &ExportTraceServiceRequest) -> (Vec<SpanGroup>, Vec<Rejection>) {
    let (mut bad_trace_ids, mut bad_span_ids) = (0, 0);
    let mut items = Vec::new();
    for rs in &req.resource_spans {
        for ss in &rs.scope_spans {
            for span in &ss.spans {
                if !valid_trace_id(&span.trace_id) {
                    bad_trace_ids += 1;
                    continue;
                }
                if !valid_span_id(&span.span_id) {
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
                let stored = OtlpSpan { span_id: hex::encode(&span.span_id), body: one.encode_to_vec() };
                items.push((span.trace_id.clone(), stored));
            }
        }
    }
    let mut rejected = Vec::new();
    for (count, what) in [(bad_trace_ids, "trace id (16 bytes"), (bad_span_ids, "span id (8 bytes")] {
        if count > 0 {
            rejected.push(Rejection {
                trace_id: None,
                spans: count,
                reason: format!("no valid {what}, not all zero)"),
            });
        }
    }
    (group_by_trace(items), rejected)
}

/// Maps every span of an export request at once (the store's merge does it
/// per trace id across exports; this is the same mapping for one export);
/// a bare prompt name is of the project `home`.
pub fn map_request(req: &ExportTraceServiceRequest, limits: TraceLimits, home: &str) -> Mapping {
    let (groups, rejected) = split_request(req);
    let mut mapping = Mapping { traces: Vec::new(), rejected };
    for group in groups {
        let bodies: Vec<&[u8]> = group.spans.iter().map(|s| s.body.as_slice()).collect();
        let spans = group.spans.len();
        match remap(&group.trace_id, &bodies, limits, home) {
            OtlpRemap::Mapped(trace) => {
                mapping.traces.push(MappedTrace { trace_id: group.trace_id, spans, trace: *trace })
            }
            OtlpRemap::Incomplete(reason) | OtlpRemap::Invalid(reason) => {
                mapping.rejected.push(Rejection { trace_id: Some(group.trace_id), spans, reason })
            }
        }
    }
    mapping
}

/// Maps every record a trace id has so far (bodies made by [`split_request`]
/// or the logs' split, the stored ones first): a trace, not yet (hold them),
/// or never. The prompt is named as a trace names it (`name` or
/// `project/name`); a bare name is of the project `home`.
pub fn remap(trace_id: &str, bodies: &[&[u8]], limits: TraceLimits, home: &str) -> OtlpRemap {
    if bodies.len() > MAX_SPANS_PER_TRACE {
        return OtlpRemap::Invalid(format!(
            "the trace would have more than {MAX_SPANS_PER_TRACE} spans and log records"
        ));
    }
    let records = match records::decode_all(bodies) {
        Ok(records) => records,
        Err(reason) => return OtlpRemap::Invalid(reason),
    };
    match map_trace(trace_id, records, limits, home) {
        Ok(trace) => OtlpRemap::Mapped(Box::new(trace)),
        Err(Unmapped::Incomplete(reason)) => OtlpRemap::Incomplete(reason),
        Err(Unmapped::Invalid(reason)) => OtlpRemap::Invalid(reason),
    }
}

/// What the conventions read from one span; the first to set a field wins.
#[derive(Default)]
struct SpanContent {
    system: Option<Value>,
    input: Option<Value>,
    output: Option<Value>,
    model: Option<Value>,
    operation: Option<Value>,
    tool: Option<Value>,
    tool_call: Map<String, Value>,
    prompt_template: Option<Value>,
    input_tokens: Option<i64>,
    output_tokens: Option<i64>,
    /// Feedback from evaluation events (`gen_ai.evaluation.result`).
    evaluated: Feedback,
    evaluations: Vec<Value>,
    conversation: Option<Value>,
    session: Option<Value>,
    user: Option<Value>,
}

/// Sets `slot` unless an earlier convention set it.
fn fill<T>(slot: &mut Option<T>, value: impl FnOnce() -> Option<T>) {
    if slot.is_none() {
        *slot = value();
    }
}

/// What one span contributes to its trace.
#[derive(Default)]
struct SpanFacts {
    input: Option<Value>,
    output: Option<Value>,
    explicit_input: Option<Value>,
    explicit_output: Option<Value>,
    feedback: Feedback,
    evaluations: Vec<Value>,
    error: Option<String>,
    input_tokens: Option<i64>,
    output_tokens: Option<i64>,
    model: Option<String>,
    conversation: Option<Value>,
    session: Option<Value>,
    user: Option<Value>,
    step: Map<String, Value>,
}

fn span_facts(span: &Span, trace_start: u64) -> Result<SpanFacts, String> {
    let a = span.attributes.as_slice();
    let mut c = SpanContent::default();
    genai::read(span, &mut c);
    openinference::read(a, &mut c);
    vercel::read(span, &mut c);
    langfuse::read(a, &mut c);

    let mut f = SpanFacts {
        explicit_input: get(a, attr::COMBEE_INPUT).map(structured),
        explicit_output: get(a, attr::COMBEE_OUTPUT).map(structured),
        // Evaluation events first; combee's own feedback attributes override them.
        feedback: std::mem::take(&mut c.evaluated).merged(span_feedback(a)?),
        evaluations: std::mem::take(&mut c.evaluations),
        input_tokens: c.input_tokens,
        output_tokens: c.output_tokens,
        model: c.model.as_ref().and_then(Value::as_str).map(str::to_owned),
        conversation: c.conversation.take(),
        session: c.session.take(),
        user: c.user.take(),
        ..Default::default()
    };
    let exception = span.events.iter().find(|ev| ev.name == "exception").map(|ev| {
        let ea = ev.attributes.as_slice();
        let kind = string_attr(ea, "exception.type").ok().flatten().unwrap_or_default();
        let message = string_attr(ea, "exception.message").ok().flatten().unwrap_or_default();
        format!("{kind}: {message}")
    });
    let status_error = span
        .status
        .as_ref()
        .filter(|s| s.code == StatusCode::Error as i32)
        .map(|s| if s.message.is_empty() { "error".to_owned() } else { s.message.clone() });
    f.error = status_error.or(exception);

    let step = &mut f.step;
    step.insert("name".into(), Value::String(span.name.clone()));
    if !span.span_id.is_empty() {
        step.insert("span_id".into(), Value::String(hex::encode(&span.span_id)));
    }
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
    put("operation", c.operation);
    put("model", c.model);
    put("tool", c.tool);
    put("tool_call", (!c.tool_call.is_empty()).then_some(Value::Object(c.tool_call)));
    put("system_instructions", c.system);
    put("prompt_template", c.prompt_template);
    put("input", c.input.clone());
    put("output", c.output.clone());
    let usage: Map<String, Value> = [("input_tokens", f.input_tokens), ("output_tokens", f.output_tokens)]
        .into_iter()
        .filter_map(|(k, v)| v.map(|v| (k.to_owned(), json!(v))))
        .collect();
    put("usage", (!usage.is_empty()).then_some(Value::Object(usage)));
    put("error", f.error.clone().map(Value::String));
    f.input = c.input;
    f.output = c.output;
    Ok(f)
}

fn span_feedback(a: &[KeyValue]) -> Result<Feedback, String> {
    let score = match get(a, attr::FEEDBACK_SCORE) {
        None => None,
        Some(v) => Some(values::as_f64(v).ok_or_else(|| format!("`{}` must be a number", attr::FEEDBACK_SCORE))?),
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

/// The first of `keys` set on a record's span, else on its resource.
fn prompt_attr<'a>(r: &'a Record, keys: &[&'static str]) -> Option<(&'static str, &'a Any)> {
    for attrs in [r.span.attributes.as_slice(), r.resource.as_slice()] {
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

/// Why records do not map (yet).
#[derive(Debug, Clone, PartialEq)]
enum Unmapped {
    /// They look like part of a GenAI trace but lack the prompt or the input so
    /// far: more records of the same trace id may still arrive.
    Incomplete(String),
    /// More records cannot help (or they are not GenAI records at all).
    Invalid(String),
}

impl From<String> for Unmapped {
    fn from(reason: String) -> Self {
        Self::Invalid(reason)
    }
}

/// Attribute prefixes of the conventions this mapping reads: only traces that
/// speak one of them are worth holding while they are incomplete.
const CONVENTION_PREFIXES: [&str; 7] =
    ["gen_ai.", "combee.", "llm.", "input.value", "openinference.", "ai.", "langfuse.observation."];

fn looks_generative(records: &[Record]) -> bool {
    let ours = |attrs: &[KeyValue]| attrs.iter().any(|kv| CONVENTION_PREFIXES.iter().any(|p| kv.key.starts_with(p)));
    records.iter().any(|r| {
        ours(&r.span.attributes)
            || ours(&r.resource)
            || r.span.events.iter().any(|e| e.name.starts_with("gen_ai.") || ours(&e.attributes))
    })
}

/// The one prompt name and the version (if any) the records name.
fn prompt_of(records: &[Record]) -> Result<(String, Option<i64>), Unmapped> {
    let mut names = BTreeSet::new();
    let mut versions = BTreeSet::new();
    for r in records {
        if let Some((key, v)) = prompt_attr(r, &PROMPT_NAME_KEYS) {
            match v {
                Any::StringValue(name) => names.insert(name.clone()),
                _ => return Err(format!("`{key}` must be a string").into()),
            };
        }
        if let Some((key, v)) = prompt_attr(r, &PROMPT_VERSION_KEYS) {
            versions.insert(parse_version(key, v)?);
        }
    }
    let prompt = match names.len() {
        0 => {
            let reason = format!(
                "none of its {} span(s) carries `{}` or `{}` (nor their resource), so it belongs to no prompt",
                records.len(),
                attr::PROMPT_NAME,
                attr::COMBEE_PROMPT
            );
            return Err(if looks_generative(records) {
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
    Ok((prompt, versions.pop_first()))
}

fn map_trace(
    trace_id: &str,
    mut records: Vec<Record>,
    limits: TraceLimits,
    home: &str,
) -> Result<ValidTrace, Unmapped> {
    records.sort_by_key(|r| (r.span.start_time_unix_nano, r.order));
    let n = records.len();
    let (prompt, prompt_version) = prompt_of(&records)?;

    let trace_start = records.iter().map(|r| r.span.start_time_unix_nano).min().unwrap_or(0);
    let trace_end = records.iter().map(|r| r.span.end_time_unix_nano).max().unwrap_or(trace_start);
    let mut steps = Vec::with_capacity(n);
    let mut input = None;
    let mut explicit_input = None;
    let mut explicit_output = None;
    let mut last_output: Option<(u64, Value)> = None;
    let mut feedback = Feedback::default();
    let mut evaluations = Vec::new();
    let mut first_error = None;
    let (mut input_tokens, mut output_tokens) = (None::<i64>, None::<i64>);
    let mut models = BTreeSet::new();
    let (mut conversation, mut session, mut user) = (None, None, None);
    let facts: Vec<SpanFacts> = records.iter().map(|r| span_facts(&r.span, trace_start)).collect::<Result<_, _>>()?;
    let repeats_usage = usage_repeaters(&records, &facts);
    for ((r, f), repeats) in records.iter().zip(facts).zip(repeats_usage) {
        let s = &r.span;
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
            && last_output.as_ref().is_none_or(|(end, _)| s.end_time_unix_nano >= *end)
        {
            last_output = Some((s.end_time_unix_nano, out));
        }
        feedback = feedback.merged(f.feedback);
        evaluations.extend(f.evaluations);
        if first_error.is_none() {
            first_error = f.error.map(|e| format!("span {:?}: {e}", clip(s.name.clone(), 80)));
        }
        if let (Some(t), false) = (f.input_tokens, repeats) {
            input_tokens = Some(input_tokens.unwrap_or(0).saturating_add(t));
        }
        if let (Some(t), false) = (f.output_tokens, repeats) {
            output_tokens = Some(output_tokens.unwrap_or(0).saturating_add(t));
        }
        models.extend(f.model);
        fill(&mut conversation, || f.conversation);
        fill(&mut session, || f.session.or_else(|| get(&r.resource, attr::SESSION_ID).map(structured)));
        fill(&mut user, || f.user);
        steps.push(Value::Object(f.step));
    }
    if feedback.error.is_none() {
        feedback.error = first_error;
    }
    let Some(input) = explicit_input.or(input) else {
        return Err(Unmapped::Incomplete(format!(
            "no input: none of its spans carries `{}`, `{}`, `{}`, `input.value`, `ai.prompt`, \
             `langfuse.observation.input` or a `gen_ai.*.message` event",
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
    let service = records.iter().find_map(|r| string_attr(&r.resource, attr::SERVICE_NAME).ok().flatten());
    if let Some(service) = service {
        otel.insert("service_name".into(), Value::String(service));
    }
    let start = chrono::DateTime::from_timestamp_nanos(i64::try_from(trace_start).unwrap_or(i64::MAX));
    otel.insert("start_time".into(), Value::String(start.to_rfc3339_opts(chrono::SecondsFormat::Micros, true)));
    if let Some(v) = records.iter().find_map(|r| get(&r.span.attributes, attr::AGENT_NAME)) {
        otel.insert("agent_name".into(), any_to_json(v, 0));
    }
    // The conversation (or session) is what an agent would name as its
    // subject when it fetches the prompt; kept at the top of the metadata.
    let subject = conversation.clone().or_else(|| session.clone());
    for (name, v) in [("conversation_id", conversation), ("session_id", session), ("user_id", user)] {
        if let Some(v) = v {
            otel.insert(name.into(), v);
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
    if !evaluations.is_empty() {
        otel.insert("evaluations".into(), Value::Array(evaluations));
    }
    let mut metadata = Map::new();
    metadata.insert("otel".into(), Value::Object(otel));
    if let Some(subject) = subject.filter(|s| !s.is_null()) {
        let subject = match subject {
            Value::String(s) => Value::String(s),
            other => Value::String(other.to_string()),
        };
        metadata.insert("subject".into(), subject);
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
        metadata: Some(Value::Object(metadata)),
    };
    trace.validate(limits, home).map_err(|e| Unmapped::Invalid(e.to_string()))
}

/// Which spans repeat usage their descendants report: an agent's span (or
/// the Vercel AI SDK's top span) often carries the sum of its model calls'
/// usage, which must not be counted twice. Only spans without a descendant
/// that reports usage count toward the trace's totals.
fn usage_repeaters(records: &[Record], facts: &[SpanFacts]) -> Vec<bool> {
    let parent: HashMap<&[u8], &[u8]> = records
        .iter()
        .filter(|r| !r.span.span_id.is_empty())
        .map(|r| (r.span.span_id.as_slice(), r.span.parent_span_id.as_slice()))
        .collect();
    let mut repeaters = std::collections::HashSet::new();
    for (r, f) in records.iter().zip(facts) {
        if f.input_tokens.is_none() && f.output_tokens.is_none() {
            continue;
        }
        // Walk up (bounded: a malformed trace may link spans in a circle).
        let mut at = r.span.parent_span_id.as_slice();
        for _ in 0..records.len() {
            if at.is_empty() || !repeaters.insert(at) {
                break;
            }
            at = parent.get(at).copied().unwrap_or_default();
        }
    }
    records.iter().map(|r| repeaters.contains(r.span.span_id.as_slice())).collect()
}

/// The system messages of a message list (a step's `system_instructions`
/// when the convention has no attribute of its own for them).
fn system_messages(messages: Option<&Value>) -> Option<Value> {
    let Some(Value::Array(items)) = messages else { return None };
    let system: Vec<Value> =
        items.iter().filter(|m| m.get("role").and_then(Value::as_str) == Some("system")).cloned().collect();
    (!system.is_empty()).then_some(Value::Array(system))
}

#[cfg(test)]
mod tests;
