//! The LLM transport: the one narrow trait the learning engine calls for chat
//! completions, the plain request/response types it speaks, and the per-call
//! record (usage, cost, latency, retries) a round stores. It knows nothing of
//! combee's prompts or answers (those are `learn::protocol`), so it imports no
//! higher layer.
//!
//! Implementation: [`client::OpenAiClient`] for any OpenAI-compatible server,
//! which is also how tests and benchmarks reach the simulated LLM
//! (`simulation::llm`).

pub mod client;
pub mod config;

use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

pub use client::{OpenAiClient, chat_decoded, chat_json, chat_json_checked};
pub use config::LlmConfig;

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
    pub model: String,
    pub messages: Vec<ChatMessage>,
    pub temperature: Option<f32>,
    pub max_tokens: Option<u32>,
    /// Ask for a JSON object answer (`response_format: {"type": "json_object"}`).
    pub json: bool,
}

impl ChatRequest {
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
}

/// Which part of a round made a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LlmRole {
    Reflector,
    Aggregator,
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
    #[error("{last} (gave up after {retries} retries)")]
    RetriesExhausted { retries: u32, last: Box<LlmError> },
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
            | Self::BadResponse(_) => true,
            Self::Rejected { .. } | Self::InvalidAnswer { .. } | Self::Config(_) => false,
            Self::RetriesExhausted { last, .. } => last.is_retryable(),
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
    /// The whole HTTP attempt (`llm.request_timeout_secs`).
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
}
