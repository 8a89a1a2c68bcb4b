//! The OpenAI-compatible chat-completions client (OpenAI, DeepSeek, vLLM, Ollama,
//! llama.cpp, OpenRouter, LiteLLM, combee's simulated LLM). It owns everything that
//! makes calls robust and polite: per-attempt timeouts fitted to the backend's
//! observed speed, retries with jittered exponential backoff honouring
//! `Retry-After`, a client-side requests/tokens per minute limiter, a concurrency
//! limit that adapts to the backend ([`super::limit`]), the structured-output shape
//! and context window the backend takes ([`super::format`]), what a local
//! server says it holds (its slots and the context they share,
//! [`super::slots`]), and usage/cost accounting. [`chat_decoded`] adds strict reading with one corrective retry and
//! records how each answer was read.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::config::LlmConfig;
use super::format::{self, ContextWindow, FormatLadder};
use super::limit::{AdaptiveLimit, AttemptSignal};
use super::meter::{Spend, SpendMeter};
use super::remember::{LimitMemory, Remembered};
use super::slots::{self, PromptTokens, SharedContext};
use super::{
    AnswerRead, ChatMessage, ChatRequest, ChatResponse, LlmBackend, LlmCall, LlmError, LlmRole, OutputFormat,
    REFUSED_ANSWER_CHARS, SchemaLengths, TimeoutKind, Usage,
};
use crate::retry_after::parse_retry_after;
use async_trait::async_trait;
use rand::Rng;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// The client-side token estimate: one token per four characters, rounded up.
pub fn estimate_tokens(chars: usize) -> u64 {
    (chars as u64).div_ceil(4)
}

/// A cheap handle; clones share the concurrency limit and the rate limiter.
#[derive(Clone)]
pub struct OpenAiClient {
    inner: Arc<Inner>,
    /// Reserves each attempt's estimated cost and settles what it used; none, nothing is capped.
    meter: Option<Arc<dyn SpendMeter>>,
    /// Where the concurrency limit is recalled from and kept; none, it starts new each time.
    remembered: Option<Arc<Remembered>>,
}

struct Inner {
    http: reqwest::Client,
    cfg: LlmConfig,
    url: String,
    limit: AdaptiveLimit,
    limiter: RateLimiter,
    formats: FormatLadder,
    window: ContextWindow,
    /// Where the server describes itself (`GET /props`), read once (set once read).
    props_url: Option<String>,
    props: tokio::sync::OnceCell<()>,
    shared: SharedContext,
    /// How many tokens the server makes of a prompt's characters.
    prompt_tokens: PromptTokens,
    /// Asked of a server that said it penalises no repetition (see [`slots::REPEAT_PENALTY`]).
    repeat_penalty: std::sync::OnceLock<f32>,
    /// Set once the server said it holds answers to a schema's lengths (see [`SchemaLengths`]).
    schema_lengths: std::sync::OnceLock<SchemaLengths>,
}

impl std::fmt::Debug for OpenAiClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenAiClient").field("url", &self.inner.url).finish_non_exhaustive()
    }
}

impl OpenAiClient {
    /// Builds a client from settings whose env fallbacks were already applied.
    pub fn new(cfg: LlmConfig) -> Result<Self, LlmError> {
        cfg.validate().map_err(|e| LlmError::Config(e.to_string()))?;
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::try_from_secs_f64(cfg.connect_timeout_secs).unwrap_or(Duration::from_secs(10)))
            .build()
            .map_err(|e| LlmError::Config(format!("cannot build HTTP client: {e}")))?;
        let url = format!("{}/chat/completions", cfg.base_url.trim_end_matches('/'));
        let limiter = RateLimiter::new(cfg.requests_per_minute, cfg.tokens_per_minute);
        let limit = AdaptiveLimit::new(cfg.max_concurrency);
        let window = ContextWindow::new(cfg.context_tokens);
        let props_url = slots::props_url(&cfg.base_url);
        let inner = Inner {
            http,
            cfg,
            url,
            limit,
            limiter,
            formats: FormatLadder::default(),
            window,
            props_url,
            props: tokio::sync::OnceCell::new(),
            shared: SharedContext::default(),
            prompt_tokens: PromptTokens::default(),
            repeat_penalty: std::sync::OnceLock::new(),
            schema_lengths: std::sync::OnceLock::new(),
        };
        Ok(Self { inner: Arc::new(inner), meter: None, remembered: None })
    }

    /// The same client, every attempt of every call counted by `meter` (and refused where it says so).
    pub fn with_meter(mut self, meter: Arc<dyn SpendMeter>) -> Self {
        self.meter = Some(meter);
        self
    }

    /// The same client, its concurrency limit resumed from what `memory` kept
    /// for this backend before its first call, and kept there as it learns
    /// (see [`super::remember`]). Call inside a tokio runtime.
    pub fn with_limit_memory(mut self, memory: Arc<dyn LimitMemory>) -> Self {
        self.remembered = Some(Remembered::new(memory, &self.inner.cfg));
        self
    }

    /// Keeps what the concurrency limit learned now (it is otherwise kept
    /// within a second of changing).
    pub async fn keep_limit_now(&self) {
        if let Some(r) = &self.remembered {
            r.keep_now(&self.inner.limit).await;
        }
    }

    pub fn config(&self) -> &LlmConfig {
        &self.inner.cfg
    }

    /// A request for `role` with the configured model, temperature and token limit.
    pub fn request(&self, role: LlmRole, messages: Vec<ChatMessage>, json: bool) -> ChatRequest {
        self.inner.cfg.request(role, messages, json)
    }

    /// The least time an attempt gets (`llm.request_timeout_secs`).
    fn timeout_floor(&self) -> Duration {
        Duration::try_from_secs_f64(self.inner.cfg.request_timeout_secs).unwrap_or(Duration::from_secs(120))
    }

    /// The adaptive concurrency limit this backend has now.
    pub fn concurrency_limit(&self) -> u32 {
        self.inner.limit.limit()
    }

    /// The `response_format` shape this backend has not refused.
    pub fn output_format(&self) -> OutputFormat {
        self.inner.formats.current()
    }

    /// Reads what the server says it holds (`GET /props`), once: its slots cap
    /// the concurrency limit, its context is the window and the budget of the
    /// calls in flight. A server without the page (or with another page there)
    /// teaches nothing; one that cannot be reached is asked again next call.
    async fn read_props(&self) {
        let inner = &self.inner;
        let Some(url) = &inner.props_url else { return };
        let _ = inner
            .props
            .get_or_try_init(|| async {
                let mut rb = inner.http.get(url).timeout(self.timeout_floor().min(Duration::from_secs(10)));
                let key = inner.cfg.api_key.expose();
                if !key.is_empty() {
                    rb = rb.bearer_auth(key);
                }
                let resp = rb.send().await.map_err(|_| ())?;
                let said = match resp.status().is_success() {
                    true => resp.bytes().await.ok().and_then(|b| slots::parse_props(&b)),
                    false => None,
                };
                if let Some(p) = said {
                    if let Some(n) = p.slots {
                        inner.limit.cap_at(n as usize);
                        metrics::gauge!("combee_llm_server_slots").set(f64::from(n));
                    }
                    if let Some(tokens) = p.context_tokens {
                        inner.window.learn(tokens);
                        inner.shared.set_tokens(tokens);
                    }
                    if p.no_repetition_penalty {
                        let _ = inner.repeat_penalty.set(slots::REPEAT_PENALTY);
                    }
                    if p.holds_schema_lengths {
                        let _ = inner.schema_lengths.set(SchemaLengths::Kept);
                    }
                    tracing::info!(slots = ?p.slots, context_tokens = ?p.context_tokens,
                        no_repetition_penalty = p.no_repetition_penalty, holds_schema_lengths = p.holds_schema_lengths,
                        "the LLM server says what it holds (GET /props): calls in flight fit its slots and context");
                }
                Ok::<(), ()>(())
            })
            .await;
    }

    /// Removes the API key from any text that may end up in a log or an error.
    fn scrub(&self, text: &str) -> String {
        let key = self.inner.cfg.api_key.expose();
        let text = truncate_chars(text, 500);
        if key.len() >= 4 { text.replace(key, "[redacted]") } else { text }
    }

    async fn attempt(
        &self,
        wire: &WireRequest<'_>,
        timeout: Duration,
    ) -> Result<(String, Option<String>, Option<Usage>), FailedAttempt> {
        let mut rb = self.inner.http.post(&self.inner.url).timeout(timeout).json(wire);
        let key = self.inner.cfg.api_key.expose();
        if !key.is_empty() {
            rb = rb.bearer_auth(key);
        }
        let resp = rb.send().await.map_err(|e| self.transport_failure(&e, timeout))?;
        let status = resp.status();
        let retry_after = parse_retry_after(resp.headers(), chrono::Utc::now());
        let body = resp.bytes().await.map_err(|e| self.transport_failure(&e, timeout))?;
        if !status.is_success() {
            let message = self.scrub(&String::from_utf8_lossy(&body));
            let code = status.as_u16();
            let err = match code {
                429 => LlmError::RateLimited { retry_after },
                // The server's own timeout, not ours: reported as what it is, and retried.
                408 => LlmError::Server { status: code, message },
                500..=599 => LlmError::Server { status: code, message },
                _ => LlmError::Rejected { status: code, message },
            };
            // A failed answer that still reports usage was billed: it counts.
            let usage = serde_json::from_slice::<WireResponse>(&body).ok().and_then(|w| w.usage).map(Usage::from);
            return Err(FailedAttempt { err, retry_after, usage });
        }
        let parsed: WireResponse = serde_json::from_slice(&body).map_err(|e| FailedAttempt {
            err: LlmError::BadResponse(self.scrub(&format!("not a chat completion: {e}"))),
            retry_after: None,
            usage: None,
        })?;
        let usage = parsed.usage.map(Usage::from);
        let content = parsed.choices.into_iter().next().and_then(|c| c.message.content).ok_or_else(|| {
            FailedAttempt { err: LlmError::BadResponse("no message content".into()), retry_after: None, usage }
        })?;
        Ok((content, parsed.model, usage))
    }

    fn transport_failure(&self, e: &reqwest::Error, timeout: Duration) -> FailedAttempt {
        let err = if e.is_timeout() {
            // reqwest flags a connect timeout as both a connect error and a timeout.
            if e.is_connect() {
                let after = Duration::try_from_secs_f64(self.inner.cfg.connect_timeout_secs).unwrap_or_default();
                LlmError::Timeout { which: TimeoutKind::Connect, after }
            } else {
                LlmError::Timeout { which: TimeoutKind::Request, after: timeout }
            }
        } else {
            // The cause without reqwest's URL prefix; the key is only ever in a header, and scrubbed anyway.
            let mut msg = std::error::Error::source(e).map(|s| s.to_string()).unwrap_or_default();
            if msg.is_empty() {
                msg = e.to_string();
            }
            LlmError::Connection(self.scrub(&msg))
        };
        FailedAttempt { err, retry_after: None, usage: None }
    }

    /// Delay before retry number `retry` (0-based): the server's `Retry-After` when it
    /// sent one, else full jitter over the exponential bound; both capped by `backoff_max_ms`.
    fn backoff(&self, retry: u32, retry_after: Option<Duration>) -> Duration {
        let cfg = &self.inner.cfg;
        let cap = Duration::from_millis(cfg.backoff_max_ms);
        if let Some(wait) = retry_after {
            return wait.min(cap);
        }
        let bound = cfg.backoff_base_ms.saturating_mul(1u64 << retry.min(30)).min(cfg.backoff_max_ms);
        Duration::from_millis(rand::thread_rng().gen_range(0..=bound))
    }
}

struct FailedAttempt {
    err: LlmError,
    retry_after: Option<Duration>,
    /// What the failed attempt reported it used, if it did.
    usage: Option<Usage>,
}

#[derive(Serialize)]
struct WireRequest<'a> {
    model: &'a str,
    messages: &'a [ChatMessage],
    #[serde(skip_serializing_if = "Option::is_none")]
    temperature: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    max_tokens: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    response_format: Option<serde_json::Value>,
    /// llama.cpp's extension, sent only to a llama.cpp server that applies none by itself.
    #[serde(skip_serializing_if = "Option::is_none")]
    repeat_penalty: Option<f32>,
}

// The envelope is read leniently: providers add fields freely. The *answer*
// inside it is what `chat_json` parses strictly.
#[derive(Deserialize)]
struct WireResponse {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    choices: Vec<WireChoice>,
    #[serde(default)]
    usage: Option<WireUsage>,
}

#[derive(Deserialize)]
struct WireChoice {
    message: WireMessage,
}

#[derive(Deserialize)]
struct WireMessage {
    #[serde(default)]
    content: Option<String>,
}

#[derive(Deserialize)]
struct WireUsage {
    #[serde(default)]
    prompt_tokens: u64,
    #[serde(default)]
    completion_tokens: u64,
}

impl From<WireUsage> for Usage {
    fn from(u: WireUsage) -> Self {
        Usage { prompt_tokens: u.prompt_tokens, completion_tokens: u.completion_tokens }
    }
}

#[async_trait]
impl LlmBackend for OpenAiClient {
    async fn chat(&self, req: ChatRequest) -> Result<ChatResponse, LlmError> {
        let inner = &self.inner;
        if let Some(r) = &self.remembered {
            r.recall_into(&inner.limit).await;
        }
        let started = Instant::now();
        self.read_props().await;
        // Counted once: the estimate, the context share and the server's cut all read it.
        let chars = req.chars();
        let estimate = estimate_tokens(chars);
        let max_tokens = self.fit_max_tokens(&req)?;
        // The call's share of a context the server's slots share: its prompt
        // (counted as finely as the server cut one) and its completion limit.
        let held = inner.prompt_tokens.of(chars) + u64::from(max_tokens.unwrap_or(inner.cfg.max_tokens));
        let mut retries = 0u32;
        // A timed-out attempt's retry gets twice as long: the backend is slower than it looked.
        let mut timeout_scale = 1u32;
        // What every attempt so far reported it used: the bill counts retried attempts too.
        let mut billed = Usage::default();
        let kind = req.tag.kind_for(req.role);
        let most = u64::from(max_tokens.unwrap_or(inner.cfg.max_tokens));
        let reserve = Usage { prompt_tokens: estimate, completion_tokens: most };
        loop {
            // Reserved before the slot is awaited: calls waiting for a slot hold their share of a cap.
            let hold = match &self.meter {
                Some(meter) => match meter.reserve(&req.tag, kind, self.spend(&req.model, reserve)).await {
                    Ok(hold) => Some(hold),
                    Err(refusal) => {
                        return Err(LlmError::BudgetReached { scope: refusal.scope, until: refusal.until });
                    }
                },
                None => None,
            };
            let (outcome, limit_at_send, format, shape_refused) = {
                let slot = inner.limit.acquire().await;
                let _admitted = inner.shared.admit(held).await;
                inner.limiter.acquire(estimate).await;
                // Chosen once the slot is held: a refusal seen while this call waited counts.
                let format = inner.formats.format_for(req.schema.as_deref(), req.json);
                let wire = WireRequest {
                    model: &req.model,
                    messages: &req.messages,
                    temperature: req.temperature,
                    max_tokens,
                    response_format: format::response_format(
                        format,
                        req.schema.as_deref(),
                        inner.schema_lengths.get().copied().unwrap_or(SchemaLengths::Left),
                    ),
                    repeat_penalty: inner.repeat_penalty.get().copied(),
                };
                let timeout = inner.limit.attempt_timeout(
                    req.role,
                    estimate,
                    u64::from(max_tokens.unwrap_or(inner.cfg.max_tokens)),
                    slot.in_flight_at_send,
                    self.timeout_floor(),
                ) * timeout_scale;
                let sent = Instant::now();
                let outcome = self.attempt(&wire, timeout).await;
                inner.limit.record(&slot, sample_of(req.role, &outcome, sent.elapsed(), estimate));
                if let Some(r) = &self.remembered {
                    r.note(&inner.limit);
                }
                if let Ok((_, _, Some(usage))) = &outcome {
                    inner.prompt_tokens.observe(chars, usage.prompt_tokens);
                }
                // Settle the estimate with what the call really used; failed attempts refund it.
                let used = match &outcome {
                    Ok((_, _, usage)) => usage.map_or(estimate, |u| u.total()),
                    Err(_) => 0,
                };
                inner.limiter.settle(estimate, used);
                // Stepped down while the slot is still held: a call that takes the
                // slot next must not ask in the shape just refused.
                let shape_refused = match &outcome {
                    Err(FailedAttempt {
                        err: LlmError::Rejected { status, message } | LlmError::Server { status, message },
                        ..
                    }) => {
                        format != OutputFormat::Plain
                            && format::refuses_response_format(*status, message)
                            && inner.formats.refused(format)
                    }
                    _ => false,
                };
                (outcome, slot.limit_at_send, format, shape_refused)
            };
            let spent = attempt_usage(&outcome, estimate, reserve);
            if let Some(reported) = reported_usage(&outcome, estimate) {
                billed.prompt_tokens += reported.prompt_tokens;
                billed.completion_tokens += reported.completion_tokens;
            }
            if let (Some(meter), Some(hold)) = (&self.meter, hold) {
                meter.settle(hold, self.spend(&req.model, spent)).await;
            }
            let FailedAttempt { err, retry_after, .. } = match outcome {
                Ok((content, model, _)) => {
                    inner.formats.publish();
                    inner.window.publish();
                    return Ok(ChatResponse {
                        cost_usd: inner.cfg.cost_usd(&req.model, billed),
                        model: model.unwrap_or_else(|| req.model.clone()),
                        content,
                        usage: billed,
                        latency_ms: u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
                        retries,
                        output_format: Some(format),
                        concurrency_limit: Some(limit_at_send),
                    });
                }
                Err(failure) => failure,
            };
            if shape_refused {
                // Not a retry: the same request in the next shape the backend may take.
                continue;
            }
            // The server's shared context filled: the limit was capped below the
            // calls in flight (`sample_of`); the call itself fits and is tried again.
            let full = matches!(&err, LlmError::Rejected { status, message } | LlmError::Server { status, message }
                if format::cache_full(*status, message));
            if full {
                metrics::counter!("combee_llm_context_full_total").increment(1);
                tracing::warn!(
                    limit = inner.limit.limit(),
                    "the LLM server's shared context is full; fewer calls at once"
                );
            }
            if let LlmError::Rejected { status, message } | LlmError::Server { status, message } = &err
                && let Some(window) = format::context_exceeded(*status, message)
            {
                match window {
                    Some(tokens) => inner.window.learn(tokens),
                    None => inner.window.learn_below(estimate),
                }
                return Err(LlmError::ContextExceeded { window: inner.window.get(), message: message.clone() });
            }
            if !(err.is_retryable() || full) || retries >= inner.cfg.max_retries {
                return Err(if retries == 0 {
                    err
                } else {
                    LlmError::RetriesExhausted { retries, last: Box::new(err) }
                });
            }
            if matches!(err, LlmError::Timeout { which: TimeoutKind::Request, .. }) {
                timeout_scale = timeout_scale.saturating_mul(2).min(16);
            }
            let wait = self.backoff(retries, retry_after);
            tracing::warn!(error = %err, retry = retries + 1, wait_ms = wait.as_millis() as u64, "LLM call failed; retrying");
            tokio::time::sleep(wait).await;
            retries += 1;
        }
    }

    fn context_window(&self) -> Option<u32> {
        self.inner.window.get()
    }
}

/// The usage an attempt reported, or, for an answer without a usage report,
/// the estimate of its prompt and answer.
fn reported_usage(
    outcome: &Result<(String, Option<String>, Option<Usage>), FailedAttempt>,
    estimate: u64,
) -> Option<Usage> {
    match outcome {
        Ok((content, _, usage)) => {
            Some(usage.unwrap_or(Usage {
                prompt_tokens: estimate,
                completion_tokens: estimate_tokens(content.chars().count()),
            }))
        }
        Err(f) => f.usage,
    }
}

/// What an attempt is charged against the budget: what it reported (or its
/// estimate, answered without a report); a timed-out request, whose bill is
/// unknown but may come, keeps its whole reservation; an attempt the server
/// refused or never got costs nothing.
fn attempt_usage(
    outcome: &Result<(String, Option<String>, Option<Usage>), FailedAttempt>,
    estimate: u64,
    reserved: Usage,
) -> Usage {
    match outcome {
        Err(FailedAttempt { err: LlmError::Timeout { which: TimeoutKind::Request, .. }, usage: None, .. }) => reserved,
        _ => reported_usage(outcome, estimate).unwrap_or_default(),
    }
}

impl OpenAiClient {
    /// `usage` by `model` in tokens and dollars.
    fn spend(&self, model: &str, usage: Usage) -> Spend {
        Spend { tokens: usage.total(), usd: self.inner.cfg.cost_usd(model, usage) }
    }

    /// The request's completion limit, lowered to what a known context window
    /// leaves after the prompt; a prompt that leaves no room is not sent.
    fn fit_max_tokens(&self, req: &ChatRequest) -> Result<Option<u32>, LlmError> {
        let Some(window) = self.inner.window.get() else { return Ok(req.max_tokens) };
        let prompt = u32::try_from(self.inner.prompt_tokens.of(req.chars())).unwrap_or(u32::MAX);
        let room = window.saturating_sub(prompt);
        if room < MIN_ANSWER_TOKENS {
            return Err(LlmError::ContextExceeded {
                window: Some(window),
                message: format!("the request's about {prompt} tokens leave no room for an answer"),
            });
        }
        Ok(Some(req.max_tokens.map_or(room, |m| m.min(room))))
    }
}

/// The fewest completion tokens worth sending a request for.
const MIN_ANSWER_TOKENS: u32 = 128;

/// What an attempt tells the concurrency limit.
fn sample_of(
    role: LlmRole,
    outcome: &Result<(String, Option<String>, Option<Usage>), FailedAttempt>,
    latency: Duration,
    estimate: u64,
) -> AttemptSignal {
    match outcome {
        Ok((content, _, usage)) => {
            let usage = usage.unwrap_or(Usage {
                prompt_tokens: estimate,
                completion_tokens: estimate_tokens(content.chars().count()),
            });
            AttemptSignal::Answered {
                role,
                latency,
                prompt_tokens: usage.prompt_tokens,
                completion_tokens: usage.completion_tokens,
            }
        }
        Err(FailedAttempt { err, .. }) => match err {
            LlmError::Rejected { status, message } | LlmError::Server { status, message }
                if format::cache_full(*status, message) =>
            {
                AttemptSignal::CacheFull
            }
            LlmError::RateLimited { .. }
            | LlmError::Server { status: 503, .. }
            | LlmError::Timeout { which: TimeoutKind::Request, .. } => AttemptSignal::Overloaded,
            _ => AttemptSignal::Neutral,
        },
    }
}

/// How an accepted answer was read: exactly the object asked for (held to its
/// schema by the backend, or not), or dug out of its wrapping or fixed by the
/// corrective retry.
fn read_of(resp: &ChatResponse, attempt: u32) -> AnswerRead {
    let exact =
        matches!(serde_json::from_str::<serde_json::Value>(resp.content.trim()), Ok(serde_json::Value::Object(_)));
    match (attempt, exact) {
        (0, true) if resp.output_format.is_some_and(OutputFormat::enforces_schema) => AnswerRead::Schema,
        (0, true) => AnswerRead::Text,
        _ => AnswerRead::Repaired,
    }
}

fn truncate_chars(s: &str, max: usize) -> String {
    match s.char_indices().nth(max) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_owned(),
    }
}

/// Token buckets for requests and tokens per minute; a zero limit disables its bucket.
/// The token bucket may go negative when a call used more than estimated: that debt
/// delays the next calls, which is what a provider-side limit would do too.
struct RateLimiter {
    rpm: u32,
    tpm: u64,
    state: Mutex<Buckets>,
}

#[derive(Debug)]
struct Buckets {
    requests: f64,
    tokens: f64,
    last: Instant,
}

impl Buckets {
    fn refill(&mut self, now: Instant, rpm: u32, tpm: u64) {
        let dt = now.saturating_duration_since(self.last).as_secs_f64();
        self.last = now;
        self.requests = (self.requests + dt * f64::from(rpm) / 60.0).min(f64::from(rpm));
        self.tokens = (self.tokens + dt * tpm as f64 / 60.0).min(tpm as f64);
    }

    /// Takes one request and `estimate` tokens if both are available, else says how long to wait.
    fn try_take(&mut self, now: Instant, rpm: u32, tpm: u64, estimate: u64) -> Result<(), Duration> {
        self.refill(now, rpm, tpm);
        // A request larger than the whole bucket is admitted once the bucket is full.
        let need_tokens = estimate.min(tpm) as f64;
        let mut wait: f64 = 0.0;
        if rpm > 0 && self.requests < 1.0 {
            wait = wait.max((1.0 - self.requests) * 60.0 / f64::from(rpm));
        }
        if tpm > 0 && self.tokens < need_tokens {
            wait = wait.max((need_tokens - self.tokens) * 60.0 / tpm as f64);
        }
        if wait > 0.0 {
            return Err(Duration::from_secs_f64(wait.min(60.0)));
        }
        if rpm > 0 {
            self.requests -= 1.0;
        }
        if tpm > 0 {
            self.tokens -= estimate as f64;
        }
        Ok(())
    }
}

impl RateLimiter {
    fn new(rpm: u32, tpm: u64) -> Self {
        Self {
            rpm,
            tpm,
            state: Mutex::new(Buckets { requests: f64::from(rpm), tokens: tpm as f64, last: Instant::now() }),
        }
    }

    async fn acquire(&self, estimate: u64) {
        if self.rpm == 0 && self.tpm == 0 {
            return;
        }
        loop {
            let verdict = match self.state.lock() {
                Ok(mut b) => b.try_take(Instant::now(), self.rpm, self.tpm, estimate),
                Err(_) => return, // a panic elsewhere poisoned it; limiting is best effort
            };
            match verdict {
                Ok(()) => return,
                Err(wait) => tokio::time::sleep(wait.max(Duration::from_millis(1))).await,
            }
        }
    }

    fn settle(&self, estimate: u64, used: u64) {
        if self.tpm == 0 {
            return;
        }
        if let Ok(mut b) = self.state.lock() {
            b.tokens = (b.tokens + estimate as f64 - used as f64).min(self.tpm as f64);
        }
    }
}

/// Sends `req` and parses the answer strictly as `T`. See [`chat_json_checked`].
pub async fn chat_json<T>(
    backend: &dyn LlmBackend,
    role: LlmRole,
    req: ChatRequest,
    calls: &mut Vec<LlmCall>,
) -> Result<T, LlmError>
where
    T: DeserializeOwned + Send,
{
    chat_json_checked(backend, role, req, calls, |_: &T| Ok(())).await
}

/// Sends `req`, parses the answer strictly as `T` (use `deny_unknown_fields` types)
/// and runs `check` on it. When either fails, asks ONCE more with the bad answer and
/// the reason appended to the conversation; a second failure is
/// [`LlmError::InvalidAnswer`]. Every call made, failed or not, is pushed onto `calls`.
pub async fn chat_json_checked<T, F>(
    backend: &dyn LlmBackend,
    role: LlmRole,
    req: ChatRequest,
    calls: &mut Vec<LlmCall>,
    check: F,
) -> Result<T, LlmError>
where
    T: DeserializeOwned + Send,
    F: Fn(&T) -> Result<(), String> + Send + Sync,
{
    let decode = |content: &str| {
        serde_json::from_str::<T>(content.trim())
            .map_err(|e| format!("not valid JSON of the requested shape: {e}"))
            .and_then(|v| check(&v).map(|()| v))
    };
    chat_decoded(backend, role, req, calls, decode).await
}

/// Sends `req` and reads the answer with `decode` (which parses and validates;
/// combee's own tolerant readers are in `learn::prompts::answer`). When it fails, asks ONCE
/// more with the bad answer and the reason appended to the conversation; a
/// second failure is [`LlmError::InvalidAnswer`]. Every call made, failed or
/// not, is pushed onto `calls`.
pub async fn chat_decoded<T, F>(
    backend: &dyn LlmBackend,
    role: LlmRole,
    mut req: ChatRequest,
    calls: &mut Vec<LlmCall>,
    decode: F,
) -> Result<T, LlmError>
where
    T: Send,
    F: Fn(&str) -> Result<T, String> + Send + Sync,
{
    const ATTEMPTS: u32 = 2;
    let mut detail = String::new();
    for attempt in 0..ATTEMPTS {
        let started = Instant::now();
        let resp = match backend.chat(req.clone()).await {
            Ok(resp) => resp,
            Err(e) => {
                calls.push(LlmCall::failed(role, &req.model, started.elapsed(), &e));
                return Err(e);
            }
        };
        let parsed = decode(&resp.content);
        let mut call = LlmCall::succeeded(role, &resp);
        match parsed {
            Ok(v) => {
                call.read = Some(read_of(&resp, attempt));
                calls.push(call);
                return Ok(v);
            }
            Err(why) => {
                detail = truncate_chars(&why, 500);
                call.error = Some(format!("invalid answer: {detail}"));
                call.read = Some(AnswerRead::Refused);
                call.refused_answer = Some(truncate_chars(&resp.content, REFUSED_ANSWER_CHARS));
                calls.push(call);
                req.messages.push(ChatMessage::assistant(truncate_chars(&resp.content, 8000)));
                req.messages.push(ChatMessage::user(format!(
                    "Your previous answer could not be used: {detail}\n\
                     Answer again with exactly one JSON object in the requested format and nothing else."
                )));
            }
        }
    }
    Err(LlmError::InvalidAnswer { attempts: ATTEMPTS, detail })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use axum::Router;
    use axum::extract::State;
    use axum::http::{HeaderMap as AxHeaders, StatusCode};
    use axum::response::{IntoResponse, Response};
    use axum::routing::post;
    use serde_json::{Value, json};

    /// What the scripted test server does on its n-th request (0-based).
    struct Step {
        status: u16,
        headers: Vec<(&'static str, String)>,
        body: String,
        delay: Duration,
    }

    fn ok(content: &str) -> Step {
        let body = json!({
            "model": "test-model",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 100, "completion_tokens": 20, "total_tokens": 120}
        });
        Step { status: 200, headers: vec![], body: body.to_string(), delay: Duration::ZERO }
    }

    fn fail(status: u16, body: &str) -> Step {
        Step { status, headers: vec![], body: body.to_owned(), delay: Duration::ZERO }
    }

    type Script = Arc<dyn Fn(usize, &Value, &AxHeaders) -> Step + Send + Sync>;

    #[derive(Clone)]
    struct ScriptedServer {
        script: Script,
        hits: Arc<AtomicUsize>,
        in_flight: Arc<AtomicUsize>,
        max_in_flight: Arc<AtomicUsize>,
        bodies: Arc<Mutex<Vec<Value>>>,
    }

    async fn handle(State(s): State<ScriptedServer>, headers: AxHeaders, body: axum::body::Bytes) -> Response {
        let n = s.hits.fetch_add(1, Ordering::SeqCst);
        let now = s.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        s.max_in_flight.fetch_max(now, Ordering::SeqCst);
        let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        if let Ok(mut b) = s.bodies.lock() {
            b.push(body.clone());
        }
        let step = (s.script)(n, &body, &headers);
        tokio::time::sleep(step.delay).await;
        s.in_flight.fetch_sub(1, Ordering::SeqCst);
        let mut resp = (StatusCode::from_u16(step.status).unwrap(), step.body).into_response();
        for (k, v) in step.headers {
            resp.headers_mut().insert(k, v.parse().unwrap());
        }
        resp.headers_mut().insert("content-type", "application/json".parse().unwrap());
        resp
    }

    async fn spawn(
        script: impl Fn(usize, &Value, &AxHeaders) -> Step + Send + Sync + 'static,
    ) -> (String, ScriptedServer) {
        let server = ScriptedServer {
            script: Arc::new(script),
            hits: Arc::default(),
            in_flight: Arc::default(),
            max_in_flight: Arc::default(),
            bodies: Arc::default(),
        };
        let app = Router::new().route("/v1/chat/completions", post(handle)).with_state(server.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        (format!("http://{addr}/v1"), server)
    }

    fn client(base_url: &str, tweak: impl FnOnce(&mut LlmConfig)) -> OpenAiClient {
        let mut cfg = LlmConfig {
            base_url: base_url.to_owned(),
            api_key: crate::secret::Secret::new("sk-test-SECRET-123"),
            backoff_base_ms: 1,
            backoff_max_ms: 20,
            request_timeout_secs: 5.0,
            ..Default::default()
        };
        tweak(&mut cfg);
        OpenAiClient::new(cfg).unwrap()
    }

    fn req(c: &OpenAiClient) -> ChatRequest {
        c.request(LlmRole::Aggregator, vec![ChatMessage::system("sys"), ChatMessage::user("hello")], true)
    }

    #[tokio::test]
    async fn sends_openai_wire_form_and_accounts_usage() {
        let (url, server) = spawn(|_, _, h| {
            assert_eq!(h.get("authorization").unwrap(), "Bearer sk-test-SECRET-123");
            ok("{}")
        })
        .await;
        let c = client(&url, |c| {
            c.price_prompt_per_million = 1.0;
            c.price_completion_per_million = 2.0;
        });
        let resp = c.chat(req(&c)).await.unwrap();
        assert_eq!(resp.usage, Usage { prompt_tokens: 100, completion_tokens: 20 });
        assert!((resp.cost_usd - 140.0 / 1_000_000.0).abs() < 1e-12);
        assert_eq!((resp.retries, resp.model.as_str()), (0, "test-model"));
        let body = server.bodies.lock().unwrap()[0].clone();
        assert_eq!(body["response_format"], json!({"type": "json_object"}));
        assert_eq!(body["messages"][1], json!({"role": "user", "content": "hello"}));
        assert_eq!(body["model"], "gpt-4o-mini");
    }

    #[tokio::test]
    async fn honours_retry_after_on_429() {
        let (url, server) = spawn(|n, _, _| match n {
            0 => Step { headers: vec![("retry-after", "1".into())], ..fail(429, "slow down") },
            _ => ok("{}"),
        })
        .await;
        let c = client(&url, |c| c.backoff_max_ms = 5_000);
        let started = Instant::now();
        let resp = c.chat(req(&c)).await.unwrap();
        assert!(started.elapsed() >= Duration::from_millis(950), "waited {:?}", started.elapsed());
        assert_eq!(resp.retries, 1);
        assert_eq!(server.hits.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn retry_after_is_capped_by_backoff_max() {
        let (url, _) = spawn(|n, _, _| match n {
            0 => Step { headers: vec![("retry-after", "3600".into())], ..fail(429, "") },
            _ => ok("{}"),
        })
        .await;
        let c = client(&url, |c| c.backoff_max_ms = 30);
        let started = Instant::now();
        c.chat(req(&c)).await.unwrap();
        assert!(started.elapsed() < Duration::from_secs(5));
    }

    /// A meter that records every reservation and settlement, and refuses
    /// once `cap` tokens are spent or held.
    #[derive(Default)]
    struct Recording {
        cap: Option<u64>,
        log: Mutex<Vec<(&'static str, u64)>>,
        held: Mutex<u64>,
    }

    #[async_trait]
    impl SpendMeter for Recording {
        async fn reserve(
            &self,
            tag: &crate::llm::meter::CallTag,
            kind: &'static str,
            estimate: Spend,
        ) -> Result<crate::llm::meter::Hold, crate::llm::meter::SpendRefusal> {
            let mut held = self.held.lock().unwrap();
            if self.cap.is_some_and(|c| *held + estimate.tokens > c) {
                return Err(crate::llm::meter::SpendRefusal { scope: "test cap".into(), until: None });
            }
            *held += estimate.tokens;
            self.log.lock().unwrap().push(("reserve", estimate.tokens));
            let day = chrono::NaiveDate::from_ymd_opt(2026, 1, 1).unwrap();
            Ok(crate::llm::meter::Hold { id: uuid::Uuid::nil(), day, tag: tag.clone(), kind, estimate })
        }

        async fn settle(&self, hold: crate::llm::meter::Hold, used: Spend) {
            *self.held.lock().unwrap() -= hold.estimate.tokens;
            *self.held.lock().unwrap() += used.tokens;
            self.log.lock().unwrap().push(("settle", used.tokens));
        }
    }

    #[tokio::test]
    async fn every_retried_attempt_is_billed_and_metered() {
        // An answer without content that reports usage, then a 500 that reports usage, then the answer.
        let (url, server) = spawn(|n, _, _| match n {
            0 => Step {
                status: 200,
                headers: vec![],
                body: json!({"choices": [], "usage": {"prompt_tokens": 100, "completion_tokens": 7}}).to_string(),
                delay: Duration::ZERO,
            },
            1 => fail(
                500,
                &json!({"error": "overloaded", "usage": {"prompt_tokens": 100, "completion_tokens": 0}}).to_string(),
            ),
            _ => ok("{}"),
        })
        .await;
        let meter = Arc::new(Recording::default());
        let c = client(&url, |c| {
            c.price_prompt_per_million = 1.0;
            c.price_completion_per_million = 2.0;
        })
        .with_meter(meter.clone());
        let resp = c.chat(req(&c)).await.unwrap();
        assert_eq!((resp.retries, server.hits.load(Ordering::SeqCst)), (2, 3));
        // All three attempts are on the bill, not only the last one.
        assert_eq!(resp.usage, Usage { prompt_tokens: 300, completion_tokens: 27 });
        assert!((resp.cost_usd - (300.0 + 54.0) / 1_000_000.0).abs() < 1e-12);
        let log = meter.log.lock().unwrap().clone();
        let settled: Vec<u64> = log.iter().filter(|(what, _)| *what == "settle").map(|(_, t)| *t).collect();
        assert_eq!(settled, [107, 100, 120]);
        // Each attempt reserved its prompt estimate plus the request's max_tokens first.
        let reserved: Vec<u64> = log.iter().filter(|(what, _)| *what == "reserve").map(|(_, t)| *t).collect();
        assert_eq!(reserved.len(), 3);
        assert!(reserved.iter().all(|t| *t == estimate_tokens(req(&c).chars()) + 2048), "{reserved:?}");
    }

    #[tokio::test]
    async fn a_refused_reservation_sends_nothing() {
        let (url, server) = spawn(|_, _, _| ok("{}")).await;
        let meter = Arc::new(Recording { cap: Some(100), ..Default::default() });
        let c = client(&url, |_| {}).with_meter(meter);
        let err = c.chat(req(&c)).await.unwrap_err();
        assert!(matches!(&err, LlmError::BudgetReached { scope, until: None } if scope == "test cap"), "{err}");
        assert!(err.is_retryable() && err.budget_reached().is_some());
        assert_eq!(server.hits.load(Ordering::SeqCst), 0);
    }

    #[tokio::test]
    async fn retries_server_errors_then_succeeds() {
        let (url, server) = spawn(|n, _, _| if n < 2 { fail(500, "oops") } else { ok("{}") }).await;
        let c = client(&url, |_| {});
        let resp = c.chat(req(&c)).await.unwrap();
        assert_eq!(resp.retries, 2);
        assert_eq!(server.hits.load(Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn gives_up_after_max_retries_with_a_retryable_error() {
        let (url, server) = spawn(|_, _, _| fail(503, "down")).await;
        let c = client(&url, |c| c.max_retries = 2);
        let err = c.chat(req(&c)).await.unwrap_err();
        assert!(err.is_retryable());
        assert_eq!(err.retries(), 2);
        assert!(
            matches!(&err, LlmError::RetriesExhausted { last, .. } if matches!(**last, LlmError::Server { status: 503, .. }))
        );
        assert_eq!(server.hits.load(Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn times_out_and_retries() {
        let (url, server) =
            spawn(|n, _, _| if n == 0 { Step { delay: Duration::from_secs(3), ..ok("{}") } } else { ok("{}") }).await;
        let c = client(&url, |c| c.request_timeout_secs = 0.2);
        let resp = c.chat(req(&c)).await.unwrap();
        assert_eq!(resp.retries, 1);
        assert_eq!(server.hits.load(Ordering::SeqCst), 2);

        let (url, _) = spawn(|_, _, _| Step { delay: Duration::from_secs(3), ..ok("{}") }).await;
        let c = client(&url, |c| {
            c.request_timeout_secs = 0.1;
            c.max_retries = 0;
        });
        let err = c.chat(req(&c)).await.unwrap_err();
        assert_eq!(err, LlmError::Timeout { which: TimeoutKind::Request, after: Duration::from_millis(100) });
        assert_eq!(err.to_string(), "LLM request (llm.request_timeout_secs) timeout fired after 0.1s");
    }

    #[tokio::test]
    async fn a_connect_timeout_is_named_with_its_own_value() {
        // A listener whose accept queue is full: the kernel drops further SYNs, so a
        // connect hangs until the client's connect timeout fires.
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let listener = socket.listen(0).unwrap();
        let addr = listener.local_addr().unwrap();
        let mut fillers = Vec::new();
        for _ in 0..4 {
            if let Ok(Ok(s)) =
                tokio::time::timeout(Duration::from_millis(200), tokio::net::TcpStream::connect(addr)).await
            {
                fillers.push(s);
            }
        }
        let c = client(&format!("http://{addr}/v1"), |c| {
            c.connect_timeout_secs = 0.3;
            c.request_timeout_secs = 30.0;
            c.max_retries = 0;
        });
        let started = Instant::now();
        let err = c.chat(req(&c)).await.unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(10), "the request timeout did not fire first");
        assert_eq!(err, LlmError::Timeout { which: TimeoutKind::Connect, after: Duration::from_millis(300) });
        let text = err.to_string();
        assert!(text.contains("connect") && text.contains("0.3s") && !text.contains("30s"), "{text}");
        assert!(err.is_retryable());
        drop((listener, fillers));
    }

    #[tokio::test]
    async fn connection_errors_are_retryable() {
        // Bind then drop a listener: nothing listens on that port afterwards.
        let addr = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap().local_addr().unwrap();
        let c = client(&format!("http://{addr}/v1"), |c| c.max_retries = 1);
        let err = c.chat(req(&c)).await.unwrap_err();
        assert!(err.is_retryable(), "{err}");
        assert_eq!(err.retries(), 1);
    }

    #[tokio::test]
    async fn the_key_never_appears_in_errors() {
        let (url, server) = spawn(|_, _, h| {
            let auth = h.get("authorization").and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned();
            fail(401, &format!(r#"{{"error":{{"message":"Incorrect API key provided: {auth}"}}}}"#))
        })
        .await;
        let c = client(&url, |_| {});
        let err = c.chat(req(&c)).await.unwrap_err();
        assert!(!err.is_retryable());
        assert_eq!(server.hits.load(Ordering::SeqCst), 1, "a 401 is not retried");
        let text = format!("{err} {err:?} {c:?}");
        assert!(!text.contains("sk-test-SECRET-123"), "{text}");
        assert!(text.contains("[redacted]"), "{text}");
    }

    #[tokio::test]
    async fn concurrency_is_limited_globally() {
        let (url, server) = spawn(|_, _, _| Step { delay: Duration::from_millis(40), ..ok("{}") }).await;
        let c = client(&url, |c| c.max_concurrency = 2);
        let calls: Vec<_> = (0..6)
            .map(|_| {
                let c = c.clone();
                tokio::spawn(async move { c.chat(req(&c)).await })
            })
            .collect();
        for call in calls {
            call.await.unwrap().unwrap();
        }
        assert_eq!(server.max_in_flight.load(Ordering::SeqCst), 2);
    }

    #[derive(Debug, Deserialize, PartialEq)]
    #[serde(deny_unknown_fields)]
    struct StrictAnswer {
        instruction: String,
    }

    #[tokio::test]
    async fn malformed_json_is_fixed_by_one_corrective_retry() {
        let (url, server) =
            spawn(|n, _, _| if n == 0 { ok(r#"{"instruction": "x""#) } else { ok(r#"{"instruction": "y"}"#) }).await;
        let c = client(&url, |_| {});
        let mut calls = vec![];
        let a: StrictAnswer = chat_json(&c, LlmRole::Aggregator, req(&c), &mut calls).await.unwrap();
        assert_eq!(a, StrictAnswer { instruction: "y".into() });
        assert_eq!(calls.len(), 2);
        assert!(calls[0].error.as_deref().unwrap_or_default().contains("invalid answer"));
        assert!(calls[1].error.is_none());
        // The retry shows the model its bad answer and why it was rejected.
        let second = server.bodies.lock().unwrap()[1].clone();
        let msgs = second["messages"].as_array().unwrap();
        assert_eq!(msgs.len(), 4);
        assert_eq!(msgs[2], json!({"role": "assistant", "content": r#"{"instruction": "x""#}));
        assert!(msgs[3]["content"].as_str().unwrap().contains("could not be used"));
    }

    #[tokio::test]
    async fn malformed_twice_is_a_clear_fatal_error() {
        let (url, server) =
            spawn(|n, _, _| if n == 0 { ok("not json") } else { ok(r#"{"instruction": "y", "extra": 1}"#) }).await;
        let c = client(&url, |_| {});
        let mut calls = vec![];
        let err = chat_json::<StrictAnswer>(&c, LlmRole::Aggregator, req(&c), &mut calls).await.unwrap_err();
        assert!(
            matches!(&err, LlmError::InvalidAnswer { attempts: 2, detail } if detail.contains("unknown field")),
            "{err}"
        );
        assert!(!err.is_retryable());
        assert_eq!((calls.len(), server.hits.load(Ordering::SeqCst)), (2, 2));
    }

    #[tokio::test]
    async fn validation_failures_also_get_one_retry() {
        let (url, _) =
            spawn(|n, _, _| if n == 0 { ok(r#"{"instruction": ""}"#) } else { ok(r#"{"instruction": "z"}"#) }).await;
        let c = client(&url, |_| {});
        let mut calls = vec![];
        let check =
            |a: &StrictAnswer| if a.instruction.is_empty() { Err("empty instruction".to_owned()) } else { Ok(()) };
        let a: StrictAnswer = chat_json_checked(&c, LlmRole::Aggregator, req(&c), &mut calls, check).await.unwrap();
        assert_eq!(a.instruction, "z");
    }

    fn schema_req(c: &OpenAiClient) -> ChatRequest {
        let schema = crate::llm::AnswerSchema::new(
            "answer",
            json!({"type": "object", "properties": {"instruction": {"type": "string"}}, "required": ["instruction"]}),
        );
        req(c).with_schema(Arc::new(schema))
    }

    #[tokio::test]
    async fn a_refused_response_format_is_detected_once_and_remembered() {
        // llama-cpp-python's server: OpenAI's shape is refused, `json_object` with a schema is taken.
        let (url, server) = spawn(|_, body, _| {
            if body["response_format"]["type"] == "json_schema" {
                fail(500, r#"{"error":{"message":"1 validation error: ('body', 'response_format', 'type') Input should be 'text' or 'json_object'","type":"internal_server_error"}}"#)
            } else {
                ok(r#"{"instruction": "y"}"#)
            }
        })
        .await;
        let c = client(&url, |_| {});
        assert_eq!(c.output_format(), OutputFormat::JsonSchema);
        let mut calls = vec![];
        let a: StrictAnswer = chat_json(&c, LlmRole::Aggregator, schema_req(&c), &mut calls).await.unwrap();
        assert_eq!(a.instruction, "y");
        assert_eq!(c.output_format(), OutputFormat::JsonObjectSchema);
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0].retries, 0, "a refused shape is not a retry");
        assert_eq!(calls[0].output_format, Some(OutputFormat::JsonObjectSchema));
        assert_eq!(calls[0].read, Some(AnswerRead::Schema));
        let bodies = server.bodies.lock().unwrap().clone();
        assert_eq!(bodies.len(), 2);
        assert_eq!(bodies[1]["response_format"]["type"], "json_object");
        assert_eq!(bodies[1]["response_format"]["schema"]["required"], json!(["instruction"]));
        // The next call asks in the remembered shape straight away.
        let _: StrictAnswer = chat_json(&c, LlmRole::Aggregator, schema_req(&c), &mut calls).await.unwrap();
        assert_eq!(server.hits.load(Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn a_backend_that_refuses_every_format_is_read_from_its_text() {
        let (url, server) = spawn(|_, body, _| {
            if body.get("response_format").is_some() {
                fail(400, r#"{"error":{"message":"response_format is not supported"}}"#)
            } else {
                ok("Sure! ```json\n{\"instruction\": \"y\"}\n```")
            }
        })
        .await;
        let c = client(&url, |_| {});
        let mut calls = vec![];
        let decode = |t: &str| {
            let mut notes = crate::learn::prompts::answer::AnswerNotes::default();
            crate::learn::prompts::answer::extract_object(t, &mut notes).map(|m| m["instruction"].clone())
        };
        let v = chat_decoded(&c, LlmRole::Aggregator, schema_req(&c), &mut calls, decode).await.unwrap();
        assert_eq!(v, json!("y"));
        assert_eq!(c.output_format(), OutputFormat::Plain);
        assert_eq!(server.hits.load(Ordering::SeqCst), 4, "three shapes refused, then plain");
        assert_eq!((calls[0].output_format, calls[0].read), (Some(OutputFormat::Plain), Some(AnswerRead::Repaired)));
    }

    #[tokio::test]
    async fn a_refused_answer_keeps_its_text_bounded() {
        let long = format!("{{\"error\": \"x\", \"note\": \"{}\"", "z".repeat(5000));
        let (url, _) = spawn(move |_, _, _| ok(&long)).await;
        let c = client(&url, |_| {});
        let mut calls = vec![];
        let err = chat_json::<StrictAnswer>(&c, LlmRole::Aggregator, req(&c), &mut calls).await.unwrap_err();
        assert!(matches!(err, LlmError::InvalidAnswer { .. }));
        assert_eq!(calls.len(), 2);
        for call in &calls {
            assert_eq!(call.read, Some(AnswerRead::Refused));
            let text = call.refused_answer.as_deref().unwrap();
            assert!(text.starts_with("{\"error\": \"x\""), "{text}");
            assert_eq!(text.chars().count(), REFUSED_ANSWER_CHARS + 1, "cut, with an ellipsis");
        }
    }

    #[tokio::test]
    async fn context_exceeded_is_learned_and_never_sent_again_as_it_was() {
        let (url, server) = spawn(|_, body, _| {
            let chars: usize =
                body["messages"].as_array().unwrap().iter().map(|m| m["content"].as_str().unwrap().len()).sum();
            if chars > 3000 {
                fail(400, r#"{"error":{"message":"Requested tokens (3100) exceed context window of 2048"}}"#)
            } else {
                ok(r#"{"instruction": "y"}"#)
            }
        })
        .await;
        let c = client(&url, |_| {});
        assert_eq!(c.context_window(), None);
        let big = c.request(LlmRole::Reflector, vec![ChatMessage::user("w".repeat(4000))], true);
        let err = c.chat(big.clone()).await.unwrap_err();
        assert_eq!(
            err,
            LlmError::ContextExceeded {
                window: Some(2048),
                message: r#"{"error":{"message":"Requested tokens (3100) exceed context window of 2048"}}"#.into()
            }
        );
        assert!(!err.is_retryable());
        assert_eq!(server.hits.load(Ordering::SeqCst), 1, "not retried");
        assert_eq!(c.context_window(), Some(2048));
        // Sent again, it is not what it was: its completion limit is the room its prompt leaves.
        assert!(matches!(c.chat(big).await, Err(LlmError::ContextExceeded { .. })));
        let sent = server.bodies.lock().unwrap().last().cloned().unwrap();
        assert_eq!(sent["max_tokens"], json!(2048 - 4000 / 3 - 1 - 16), "16 tokens for the chat template");
        // A prompt that leaves no room for an answer is not sent at all.
        let huge = c.request(LlmRole::Reflector, vec![ChatMessage::user("w".repeat(6000))], true);
        assert!(matches!(c.chat(huge).await, Err(LlmError::ContextExceeded { window: Some(2048), .. })));
        assert_eq!(server.hits.load(Ordering::SeqCst), 2);
        c.chat(c.request(LlmRole::Reflector, vec![ChatMessage::user("w".repeat(1500))], true)).await.unwrap();
        let sent = server.bodies.lock().unwrap().last().cloned().unwrap();
        assert_eq!(sent["max_tokens"], json!(1024), "1024 fits beside a 500-token prompt");
        c.chat(c.request(LlmRole::Aggregator, vec![ChatMessage::user("w".repeat(2700))], true)).await.unwrap();
        let sent = server.bodies.lock().unwrap().last().cloned().unwrap();
        assert_eq!(sent["max_tokens"], json!(2048 - 900 - 16), "lowered to the room the prompt leaves");
    }

    #[tokio::test]
    async fn a_one_slot_server_is_not_flooded_and_nothing_times_out() {
        // One slot, as llama.cpp's server: a request waits behind the one being served.
        let (base_url, server) = crate::llm::one_slot::OneSlotServer::spawn().await;
        // A floor far below a queue's wait: only the fitted limit keeps attempts alive.
        let c = client(&base_url, |c| c.request_timeout_secs = 0.15);
        let calls: Vec<_> = (0..24)
            .map(|_| {
                let c = c.clone();
                tokio::spawn(async move { c.chat(req(&c)).await })
            })
            .collect();
        let mut limits = vec![];
        for call in calls {
            let resp = call.await.unwrap().unwrap();
            assert_eq!(resp.retries, 0, "no attempt timed out");
            limits.push(resp.concurrency_limit.unwrap());
        }
        // Never a flood of the 24 (the limit starts at 2 and feels its way), and once the
        // queue has shown, one or two in flight: a probe above that (latency noise on a
        // loaded machine reads as room to grow) is taken back within a few calls.
        assert!(server.most_waiting() <= 6, "{limits:?}");
        assert!(limits[16..].iter().filter(|&&l| l > 2).count() <= 2, "{limits:?}");
        assert!(limits[20..].iter().all(|&l| l <= 2), "{limits:?}");
    }

    /// llama.cpp's server as its defaults start it: slots sharing one context.
    /// A call holds its prompt (a token per `cut` characters) and its
    /// completion limit (the model writes all of it); a call that does not fit
    /// beside the others is answered as llama.cpp answers then.
    #[derive(Clone)]
    struct SharedCache {
        props: Option<Value>,
        context: usize,
        cut: usize,
        held: Arc<AtomicUsize>,
        in_flight: Arc<AtomicUsize>,
        most_in_flight: Arc<AtomicUsize>,
        full: Arc<AtomicUsize>,
        answered: Arc<AtomicUsize>,
        /// Each request's `repeat_penalty`, as sent.
        penalties: Arc<std::sync::Mutex<Vec<Option<f64>>>>,
        /// Each request's `response_format`, as sent.
        formats: Arc<std::sync::Mutex<Vec<Value>>>,
    }

    impl SharedCache {
        async fn spawn(props: Option<Value>, context: usize) -> (String, Self) {
            Self::spawn_cutting(props, context, 3).await
        }

        async fn spawn_cutting(props: Option<Value>, context: usize, cut: usize) -> (String, Self) {
            async fn chat(State(s): State<SharedCache>, body: axum::body::Bytes) -> Response {
                let body: Value = serde_json::from_slice(&body).unwrap();
                s.penalties.lock().unwrap().push(body["repeat_penalty"].as_f64());
                s.formats.lock().unwrap().push(body["response_format"].clone());
                let chars: usize =
                    body["messages"].as_array().unwrap().iter().map(|m| m["content"].as_str().unwrap().len()).sum();
                let tokens = chars / s.cut + body["max_tokens"].as_u64().unwrap_or(4096) as usize;
                let held = s.held.fetch_add(tokens, Ordering::SeqCst) + tokens;
                let now = s.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
                s.most_in_flight.fetch_max(now, Ordering::SeqCst);
                let full = held > s.context;
                if !full {
                    tokio::time::sleep(Duration::from_millis(30)).await;
                }
                s.held.fetch_sub(tokens, Ordering::SeqCst);
                s.in_flight.fetch_sub(1, Ordering::SeqCst);
                if full {
                    s.full.fetch_add(1, Ordering::SeqCst);
                    let e = json!({"error": {"code": 500, "message": "Context size has been exceeded.", "type": "server_error"}});
                    return (StatusCode::INTERNAL_SERVER_ERROR, axum::Json(e)).into_response();
                }
                s.answered.fetch_add(1, Ordering::SeqCst);
                axum::Json(json!({"model": "m", "choices": [{"message": {"content": "{}"}}],
                                  "usage": {"prompt_tokens": chars / s.cut, "completion_tokens": 20}}))
                .into_response()
            }
            async fn describe(State(s): State<SharedCache>) -> Response {
                match s.props {
                    Some(p) => axum::Json(p).into_response(),
                    None => StatusCode::NOT_FOUND.into_response(),
                }
            }
            let state = SharedCache {
                props,
                context,
                cut,
                held: Arc::default(),
                in_flight: Arc::default(),
                most_in_flight: Arc::default(),
                full: Arc::default(),
                answered: Arc::default(),
                penalties: Arc::default(),
                formats: Arc::default(),
            };
            let app = Router::new()
                .route("/v1/chat/completions", post(chat))
                .route("/props", axum::routing::get(describe))
                .with_state(state.clone());
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            tokio::spawn(async move { axum::serve(listener, app).await });
            (format!("http://{addr}/v1"), state)
        }
    }

    async fn many_calls(c: &OpenAiClient, n: usize, chars: usize) -> Vec<ChatResponse> {
        let calls: Vec<_> = (0..n)
            .map(|_| {
                let c = c.clone();
                tokio::spawn(async move {
                    c.chat(c.request(LlmRole::Reflector, vec![ChatMessage::user("w".repeat(chars))], true)).await
                })
            })
            .collect();
        let mut out = Vec::new();
        for call in calls {
            out.push(call.await.unwrap().unwrap());
        }
        out
    }

    #[tokio::test]
    async fn a_server_that_says_its_slots_and_context_gets_only_what_fits() {
        let props = json!({"default_generation_settings": {"params": {}, "n_ctx": 4096}, "total_slots": 4});
        let (url, server) = SharedCache::spawn(Some(props), 4096).await;
        let c = client(&url, |_| {});
        // 500 prompt tokens and a 1024-token completion limit each: two fit in 4096 at once, three do not.
        let answers = many_calls(&c, 16, 1500).await;
        assert_eq!(server.full.load(Ordering::SeqCst), 0, "no call was answered that the context is full");
        assert_eq!(server.most_in_flight.load(Ordering::SeqCst), 2);
        assert!(answers.iter().all(|a| a.retries == 0));
        assert_eq!(c.context_window(), Some(4096), "the window is the server's word");
        assert!(c.concurrency_limit() <= 4, "never more than its four slots: {}", c.concurrency_limit());
        // Shorter calls fit three at a time (the limit grew to the slots meanwhile).
        let before = server.most_in_flight.swap(0, Ordering::SeqCst);
        assert_eq!(before, 2);
        many_calls(&c, 16, 300).await;
        assert_eq!(server.full.load(Ordering::SeqCst), 0);
        assert_eq!(server.most_in_flight.load(Ordering::SeqCst), 3, "100 + 1024 tokens each");
    }

    #[tokio::test]
    async fn a_prompt_is_counted_as_finely_as_the_server_reported_it_cut_one() {
        // Two characters a token (JSON, numbers): 1,200 prompt tokens and a 1024-token
        // completion limit each, so two do not fit in 4096 at once; at three characters a
        // token they would seem to (800 + 1024 twice).
        let props = json!({"default_generation_settings": {"params": {}, "n_ctx": 4096}, "total_slots": 4});
        let (url, server) = SharedCache::spawn_cutting(Some(props), 4096, 2).await;
        let c = client(&url, |_| {});
        many_calls(&c, 1, 2400).await;
        many_calls(&c, 8, 2400).await;
        assert_eq!(server.full.load(Ordering::SeqCst), 0, "no call was answered that the context is full");
        assert_eq!(server.most_in_flight.load(Ordering::SeqCst), 1, "one at a time, as the server counts them");
    }

    #[tokio::test]
    async fn a_server_that_penalises_no_repetition_is_asked_for_a_penalty_and_no_other_is() {
        // llama-server on its defaults: no penalty of any kind, so a small model repeats itself to the limit.
        let plain = json!({"default_generation_settings": {"params": {"repeat_penalty": 1.0, "frequency_penalty": 0.0,
            "presence_penalty": 0.0, "dry_multiplier": 0.0}, "n_ctx": 8192}, "total_slots": 4});
        let own = json!({"default_generation_settings": {"params": {"repeat_penalty": 1.1, "frequency_penalty": 0.0,
            "presence_penalty": 0.0, "dry_multiplier": 0.0}, "n_ctx": 8192}, "total_slots": 4});
        for (props, expected) in [(Some(plain), Some(1.1)), (Some(own), None), (None, None)] {
            let (url, server) = SharedCache::spawn(props.clone(), 8192).await;
            many_calls(&client(&url, |_| {}), 3, 300).await;
            let sent = server.penalties.lock().unwrap().clone();
            assert_eq!(sent.len(), 3);
            for p in sent {
                assert_eq!(p.map(|p| (p * 100.0).round() / 100.0), expected, "{props:?}");
            }
        }
    }

    #[tokio::test]
    async fn a_llama_cpp_server_gets_the_schemas_lengths_and_no_other_does() {
        // A schema's lengths bound what a model writes only where the server turns
        // them into its grammar (llama.cpp); OpenAI's strict mode refuses them.
        let llama = json!({"default_generation_settings": {"params": {}, "n_ctx": 8192}, "total_slots": 4});
        let schema = Arc::new(crate::llm::AnswerSchema::new(
            "ops",
            json!({"type": "object", "properties": {"ops": {"type": "array", "maxItems": 12,
                "items": {"type": "string", "maxLength": 300}}}, "required": ["ops"]}),
        ));
        for (props, kept) in [(Some(llama), true), (None, false)] {
            let (url, server) = SharedCache::spawn(props.clone(), 8192).await;
            let c = client(&url, |_| {});
            c.chat(c.request(LlmRole::Aggregator, vec![ChatMessage::user("w")], true).with_schema(schema.clone()))
                .await
                .unwrap();
            let sent = server.formats.lock().unwrap()[0]["json_schema"]["schema"]["properties"]["ops"].clone();
            assert_eq!(sent["maxItems"].as_u64(), kept.then_some(12), "{props:?}: {sent}");
            assert_eq!(sent["items"]["maxLength"].as_u64(), kept.then_some(300), "{props:?}: {sent}");
        }
    }

    #[tokio::test]
    async fn a_full_shared_context_means_fewer_calls_at_once_not_blind_retries() {
        // No /props: the server is learned from its answers only.
        let (url, server) = SharedCache::spawn(None, 4096).await;
        let c = client(&url, |_| {});
        let answers = many_calls(&c, 40, 300).await;
        assert_eq!(answers.len(), 40, "every call answered in the end");
        let full = server.full.load(Ordering::SeqCst);
        // Slow start overshoots to about six calls at once; each filling takes
        // the cap one below the calls in flight, so a few fillings, then none.
        assert!(full >= 1, "the limit grew into the full context");
        assert!(full <= 10, "then stayed below it: {full} calls answered that the context is full");
        assert!(c.concurrency_limit() <= 3, "capped below the calls that filled it: {}", c.concurrency_limit());
        server.most_in_flight.store(0, Ordering::SeqCst);
        many_calls(&c, 20, 300).await;
        assert_eq!(server.full.load(Ordering::SeqCst), full, "no filling again");
        assert!(server.most_in_flight.load(Ordering::SeqCst) <= 3);
    }

    #[test]
    fn buckets_limit_requests_and_tokens_per_minute() {
        let t0 = Instant::now();
        let mut b = Buckets { requests: 2.0, tokens: 1000.0, last: t0 };
        assert!(b.try_take(t0, 2, 1000, 300).is_ok());
        assert!(b.try_take(t0, 2, 1000, 300).is_ok());
        // Out of requests: one request refills in 30 s at 2/min.
        let wait = b.try_take(t0, 2, 1000, 300).unwrap_err();
        assert!((wait.as_secs_f64() - 30.0).abs() < 0.01, "{wait:?}");
        let t1 = t0 + Duration::from_secs(30);
        assert!(b.try_take(t1, 2, 1000, 300).is_ok());
        // 600 + 10 s of refill = 766.7 tokens; a 1100-token request needs the full 1000: 14 s more.
        let wait = b.try_take(t1 + Duration::from_secs(10), 0, 1000, 1100).unwrap_err();
        assert!((wait.as_secs_f64() - 14.0).abs() < 0.01, "{wait:?}");
        // A request larger than the bucket passes once it is full.
        let mut b = Buckets { requests: 0.0, tokens: 1000.0, last: t0 };
        assert!(b.try_take(t0, 0, 1000, 5000).is_ok());
        assert!(b.tokens < 0.0);
    }
}
