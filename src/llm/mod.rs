//! The LLM transport: the one narrow trait the learning engine calls for chat
//! completions, the plain request/response types it speaks, and the per-call
//! record (usage, cost, latency, retries) a round stores. It knows nothing of
//! combee's prompts or answers (those are `learn::prompts`), so it imports no
//! higher layer.
//!
//! Implementation: [`client::OpenAiClient`] for any OpenAI-compatible server,
//! which is also how tests and benchmarks reach the simulated LLM
//! (`simulation::llm`).

pub mod client;
pub mod config;
pub mod format;
pub mod limit;
pub mod meter;
#[cfg(test)]
mod one_slot;
pub mod remember;
pub mod slots;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Who wrote a chat message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ChatRole {
    System,
    User,
    Assistant,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: ChatRole,
    pub content: String,
}

impl ChatMessage {
    pub fn system(content: impl Into<String>) -> Self {
        Self { role: ChatRole::System, content: content.into() }
    }
    pub fn user(content: impl Into<String>) -> Self {
        Self { role: ChatRole::User, content: content.into() }
    }
    pub fn assistant(content: impl Into<String>) -> Self {
        Self { role: ChatRole::Assistant, content: content.into() }
    }
}

/// One chat completion request, backend-neutral.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatRequest {
    /// Which part of a round asks (the backend learns each role's speed apart).
    pub role: LlmRole,
    pub model: String,
    pub messages: Vec<ChatMessage>,
    pub temperature: Option<f32>,
    pub max_tokens: Option<u32>,
    /// Ask for a JSON object answer (`response_format: {"type": "json_object"}`).
    pub json: bool,
    /// The JSON schema the answer must follow, asked for in whichever
    /// `response_format` shape the backend takes (see [`format`]).
    pub schema: Option<Arc<AnswerSchema>>,
    /// What the call is for (prompt, kind, round), as the spending meter counts it.
    pub tag: meter::CallTag,
}

/// The JSON schema of an answer, with the name OpenAI's shape wants.
#[derive(Debug, Clone, PartialEq)]
pub struct AnswerSchema {
    pub name: &'static str,
    pub schema: Value,
}

impl AnswerSchema {
    pub fn new(name: &'static str, schema: Value) -> Self {
        Self { name, schema }
    }

    /// The schema with every object closed and every property required, as
    /// OpenAI's strict mode takes it, its length keywords kept or left out
    /// (strict mode refuses them; the answer's reader enforces lengths anyway).
    pub fn closed_schema(&self, lengths: SchemaLengths) -> Value {
        fn close(v: &Value, keep: bool) -> Value {
            match v {
                Value::Object(m) => {
                    let mut out = serde_json::Map::new();
                    for (k, v) in m {
                        if keep || !matches!(k.as_str(), "maxLength" | "minLength" | "maxItems" | "minItems") {
                            out.insert(k.clone(), close(v, keep));
                        }
                    }
                    if let Some(Value::Object(props)) = out.get("properties") {
                        let all: Vec<Value> = props.keys().map(|k| Value::String(k.clone())).collect();
                        out.insert("required".into(), Value::Array(all));
                        out.insert("additionalProperties".into(), Value::Bool(false));
                    }
                    Value::Object(out)
                }
                Value::Array(items) => Value::Array(items.iter().map(|v| close(v, keep)).collect()),
                other => other.clone(),
            }
        }
        close(&self.schema, lengths == SchemaLengths::Kept)
    }
}

/// Whether a schema sent as `response_format` keeps its length keywords
/// (`maxLength`, `maxItems` and their minimums). OpenAI's strict mode refuses
/// them, so they are left out unless the server is known to hold an answer to
/// them: llama.cpp's server turns the schema into a grammar that does, and
/// without them a small model may write a list or a string until its
/// completion limit (see [`slots::ServerProps`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SchemaLengths {
    Left,
    Kept,
}

impl ChatRequest {
    /// The same request, asking for an answer in `schema`.
    pub fn with_schema(mut self, schema: Arc<AnswerSchema>) -> Self {
        self.json = true;
        self.schema = Some(schema);
        self
    }

    /// Total characters of all messages; the basis of client-side token estimates.
    pub fn chars(&self) -> usize {
        self.messages.iter().map(|m| m.content.chars().count()).sum()
    }
}

/// Token counts as reported by the server.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
}

impl Usage {
    pub fn total(&self) -> u64 {
        self.prompt_tokens + self.completion_tokens
    }
}

/// A successful answer, with what it cost to get it.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatResponse {
    pub content: String,
    /// The model the server says answered.
    pub model: String,
    pub usage: Usage,
    pub cost_usd: f64,
    /// Wall time including retries and waits for the rate limiter.
    pub latency_ms: u64,
    /// Attempts beyond the first.
    pub retries: u32,
    /// The structured-output form the answering request carried.
    pub output_format: Option<OutputFormat>,
    /// The adaptive concurrency limit when the answering attempt was sent.
    pub concurrency_limit: Option<u32>,
}

/// Which part of a round made a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LlmRole {
    Reflector,
    Aggregator,
    /// A regression gate running a version on a case: the version is the system prompt.
    Gate,
    /// A prompt's LLM judge scoring a trace no one scored (the aggregator's model).
    Judge,
}

/// The record a round keeps of every LLM call, failed ones included.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LlmCall {
    pub role: LlmRole,
    pub model: String,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub cost_usd: f64,
    pub latency_ms: u64,
    pub retries: u32,
    pub error: Option<String>,
    /// How the answer was read (`schema`, `text`, `repaired`, `refused`); absent
    /// for a call that got no answer and for calls recorded before it was kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub read: Option<AnswerRead>,
    /// The text of a refused answer, cut to [`REFUSED_ANSWER_CHARS`]: untrusted
    /// model output, kept so an operator can see what the model wrote.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refused_answer: Option<String>,
    /// The structured-output form the request asked for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_format: Option<OutputFormat>,
    /// The adaptive concurrency limit of the backend when the call was sent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub concurrency_limit: Option<u32>,
}

/// Most characters of a refused answer a round record keeps.
pub const REFUSED_ANSWER_CHARS: usize = 2_000;

/// How an answer was read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AnswerRead {
    /// The backend was held to the answer's JSON schema and the answer was exactly that object.
    Schema,
    /// No schema was enforced (the backend refuses one); the answer was exactly the object.
    Text,
    /// The object had to be dug out of prose, fences or think blocks, or took the corrective retry.
    Repaired,
    /// The answer could not be used.
    Refused,
}

impl AnswerRead {
    pub const ALL: [AnswerRead; 4] = [Self::Schema, Self::Text, Self::Repaired, Self::Refused];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Schema => "schema",
            Self::Text => "text",
            Self::Repaired => "repaired",
            Self::Refused => "refused",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|r| r.as_str() == s)
    }
}

/// The `response_format` a request carries. Backends differ: OpenAI, vLLM and
/// Ollama take OpenAI's `json_schema` shape; llama-cpp-python's server refuses
/// it and takes `json_object` with a `schema`; some take only `json_object`,
/// some nothing at all. The client walks down this list once per backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OutputFormat {
    /// `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`.
    JsonSchema,
    /// `{"type": "json_object", "schema": {...}}`.
    JsonObjectSchema,
    /// `{"type": "json_object"}`: valid JSON, shape unenforced.
    JsonObject,
    /// No `response_format`: the answer is read from its text.
    Plain,
}

impl OutputFormat {
    pub const ALL: [OutputFormat; 4] = [Self::JsonSchema, Self::JsonObjectSchema, Self::JsonObject, Self::Plain];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::JsonSchema => "json_schema",
            Self::JsonObjectSchema => "json_object_schema",
            Self::JsonObject => "json_object",
            Self::Plain => "plain",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|f| f.as_str() == s)
    }

    /// Whether the backend holds the answer to the schema in this form.
    pub fn enforces_schema(self) -> bool {
        matches!(self, Self::JsonSchema | Self::JsonObjectSchema)
    }
}

impl LlmCall {
    pub fn succeeded(role: LlmRole, resp: &ChatResponse) -> Self {
        Self {
            role,
            model: resp.model.clone(),
            prompt_tokens: resp.usage.prompt_tokens,
            completion_tokens: resp.usage.completion_tokens,
            cost_usd: resp.cost_usd,
            latency_ms: resp.latency_ms,
            retries: resp.retries,
            error: None,
            read: None,
            refused_answer: None,
            output_format: resp.output_format,
            concurrency_limit: resp.concurrency_limit,
        }
    }

    pub fn failed(role: LlmRole, model: &str, latency: Duration, err: &LlmError) -> Self {
        Self {
            role,
            model: model.to_owned(),
            prompt_tokens: 0,
            completion_tokens: 0,
            cost_usd: 0.0,
            latency_ms: u64::try_from(latency.as_millis()).unwrap_or(u64::MAX),
            retries: err.retries(),
            error: Some(err.to_string()),
            read: None,
            refused_answer: None,
            output_format: None,
            concurrency_limit: None,
        }
    }
}

/// Why a call failed. [`LlmError::is_retryable`] tells the worker whether trying
/// the round again later can help. Messages never contain the API key.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum LlmError {
    /// One of the client's own timeouts fired; the message names which one and its value.
    #[error("LLM {which} timeout fired after {}", show_secs(*after))]
    Timeout { which: TimeoutKind, after: Duration },
    #[error("LLM server rate-limited the request (429)")]
    RateLimited { retry_after: Option<Duration> },
    #[error("LLM server error {status}: {message}")]
    Server { status: u16, message: String },
    #[error("could not reach the LLM server: {0}")]
    Connection(String),
    #[error("LLM server sent an unreadable response: {0}")]
    BadResponse(String),
    /// A 4xx other than 408/429: bad key, unknown model, request too large.
    #[error("LLM server rejected the request ({status}): {message}")]
    Rejected { status: u16, message: String },
    /// The model's answer did not parse or validate, even after one corrective retry.
    #[error("LLM answer was invalid after {attempts} attempts: {detail}")]
    InvalidAnswer { attempts: u32, detail: String },
    #[error("LLM client misconfigured: {0}")]
    Config(String),
    /// The request does not fit the backend's context window. Never retried as
    /// it was: the caller fits the next request into the window it now knows.
    #[error("the request does not fit the LLM's context window{}: {message}", window.map(|w| format!(" of {w} tokens")).unwrap_or_default())]
    ContextExceeded { window: Option<u32>, message: String },
    #[error("{last} (gave up after {retries} retries)")]
    RetriesExhausted { retries: u32, last: Box<LlmError> },
    /// The spending meter refused the call: it would pass a cap. Nothing was
    /// sent; the work waits for the cap to lift (`until`, the next UTC day for a
    /// daily cap) or to be raised.
    #[error("{}", budget_message(scope, *until))]
    BudgetReached { scope: String, until: Option<chrono::DateTime<chrono::Utc>> },
}

fn budget_message(scope: &str, until: Option<chrono::DateTime<chrono::Utc>>) -> String {
    match until {
        Some(t) => format!("budget reached until {} ({scope})", t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)),
        None => format!("budget reached ({scope})"),
    }
}

impl LlmError {
    /// Transient failures (timeouts, 429, 5xx, connection) are retryable; a rejected
    /// request, an invalid answer or a configuration error is not.
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::Timeout { .. }
            | Self::RateLimited { .. }
            | Self::Server { .. }
            | Self::Connection(_)
            | Self::BadResponse(_)
            | Self::BudgetReached { .. } => true,
            Self::Rejected { .. } | Self::InvalidAnswer { .. } | Self::Config(_) | Self::ContextExceeded { .. } => {
                false
            }
            Self::RetriesExhausted { last, .. } => last.is_retryable(),
        }
    }

    /// The cap's scope and when it lifts, when the spending meter refused the call.
    pub fn budget_reached(&self) -> Option<(&str, Option<chrono::DateTime<chrono::Utc>>)> {
        match self {
            Self::BudgetReached { scope, until } => Some((scope, *until)),
            Self::RetriesExhausted { last, .. } => last.budget_reached(),
            _ => None,
        }
    }

    /// Attempts beyond the first that the client made before giving up.
    pub fn retries(&self) -> u32 {
        match self {
            Self::RetriesExhausted { retries, .. } => *retries,
            _ => 0,
        }
    }
}

/// Which of the client's timeouts fired.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TimeoutKind {
    /// Establishing the connection (`llm.connect_timeout_secs`).
    Connect,
    /// The whole HTTP attempt: `llm.request_timeout_secs`, or longer where the
    /// backend's observed speed says the call needs it.
    Request,
}

impl std::fmt::Display for TimeoutKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Connect => "connect (llm.connect_timeout_secs)",
            Self::Request => "request (llm.request_timeout_secs)",
        })
    }
}

/// `10s`, `0.25s`: a duration as an operator wrote it in the config.
fn show_secs(d: Duration) -> String {
    format!("{}s", d.as_secs_f64())
}

/// A chat-completions backend. The learning engine only ever sees this trait.
#[async_trait]
pub trait LlmBackend: Send + Sync {
    async fn chat(&self, req: ChatRequest) -> Result<ChatResponse, LlmError>;

    /// The backend's context window in tokens, where it is configured or was
    /// learned; callers fit their requests into it.
    fn context_window(&self) -> Option<u32> {
        None
    }
}
