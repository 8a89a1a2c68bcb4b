//! The OpenAI-compatible chat-completions client (OpenAI, DeepSeek, vLLM, Ollama,
//! llama.cpp, OpenRouter, LiteLLM, combee's simulated LLM). It owns everything that
//! makes calls robust and polite: per-attempt timeouts, retries with jittered
//! exponential backoff honouring `Retry-After`, a client-side requests/tokens per
//! minute limiter, a process-wide concurrency limit, and usage/cost accounting.
//! [`chat_json`] adds strict JSON parsing with one corrective retry.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use rand::Rng;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tokio::sync::Semaphore;

use super::config::LlmConfig;
use super::{ChatMessage, ChatRequest, ChatResponse, LlmBackend, LlmCall, LlmError, LlmRole, TimeoutKind, Usage};
use crate::retry_after::parse_retry_after;

/// The client-side token estimate: one token per four characters, rounded up.
pub fn estimate_tokens(chars: usize) -> u64 {
    (chars as u64).div_ceil(4)
}

/// A cheap handle; clones share the concurrency limit and the rate limiter.
#[derive(Clone)]
pub struct OpenAiClient {
    inner: Arc<Inner>,
}

struct Inner {
    http: reqwest::Client,
    cfg: LlmConfig,
    url: String,
    permits: Semaphore,
    limiter: RateLimiter,
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
        let permits = Semaphore::new(cfg.max_concurrency);
        Ok(Self { inner: Arc::new(Inner { http, cfg, url, permits, limiter }) })
    }

    pub fn config(&self) -> &LlmConfig {
        &self.inner.cfg
    }

    /// A request for `role` with the configured model, temperature and token limit.
    pub fn request(&self, role: LlmRole, messages: Vec<ChatMessage>, json: bool) -> ChatRequest {
        self.inner.cfg.request(role, messages, json)
    }

    fn timeout(&self) -> Duration {
        Duration::try_from_secs_f64(self.inner.cfg.request_timeout_secs).unwrap_or(Duration::from_secs(120))
    }

    /// Removes the API key from any text that may end up in a log or an error.
    fn scrub(&self, text: &str) -> String {
        let key = self.inner.cfg.api_key.expose();
        let text = truncate_chars(text, 500);
        if key.len() >= 4 { text.replace(key, "[redacted]") } else { text }
    }

    async fn attempt(&self, wire: &WireRequest<'_>) -> Result<(String, Option<String>, Option<Usage>), Failure> {
        let timeout = self.timeout();
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
            return Err(Failure { err, retry_after });
        }
        let parsed: WireResponse = serde_json::from_slice(&body).map_err(|e| Failure {
            err: LlmError::BadResponse(self.scrub(&format!("not a chat completion: {e}"))),
            retry_after: None,
        })?;
        let content =
            parsed.choices.into_iter().next().and_then(|c| c.message.content).ok_or_else(|| Failure {
                err: LlmError::BadResponse("no message content".into()),
                retry_after: None,
            })?;
        let usage =
            parsed.usage.map(|u| Usage { prompt_tokens: u.prompt_tokens, completion_tokens: u.completion_tokens });
        Ok((content, parsed.model, usage))
    }

    fn transport_failure(&self, e: &reqwest::Error, timeout: Duration) -> Failure {
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
        Failure { err, retry_after: None }
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

struct Failure {
    err: LlmError,
    retry_after: Option<Duration>,
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
    response_format: Option<ResponseFormat>,
}

#[derive(Serialize)]
struct ResponseFormat {
    #[serde(rename = "type")]
    kind: &'static str,
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

#[async_trait]
impl LlmBackend for OpenAiClient {
    async fn chat(&self, req: ChatRequest) -> Result<ChatResponse, LlmError> {
        let started = Instant::now();
        let wire = WireRequest {
            model: &req.model,
            messages: &req.messages,
            temperature: req.temperature,
            max_tokens: req.max_tokens,
            response_format: req.json.then_some(ResponseFormat { kind: "json_object" }),
        };
        let estimate = estimate_tokens(req.chars());
        let mut retries = 0u32;
        loop {
            let outcome = {
                let _permit = self
                    .inner
                    .permits
                    .acquire()
                    .await
                    .map_err(|_| LlmError::Config("concurrency limiter closed".into()))?;
                self.inner.limiter.acquire(estimate).await;
                let outcome = self.attempt(&wire).await;
                // Settle the estimate with what the call really used; failed attempts refund it.
                let used = match &outcome {
                    Ok((_, _, usage)) => usage.map_or(estimate, |u| u.total()),
                    Err(_) => 0,
                };
                self.inner.limiter.settle(estimate, used);
                outcome
            };
            match outcome {
                Ok((content, model, usage)) => {
                    let usage = usage.unwrap_or(Usage {
                        prompt_tokens: estimate,
                        completion_tokens: estimate_tokens(content.chars().count()),
                    });
                    return Ok(ChatResponse {
                        cost_usd: self.inner.cfg.cost_usd(usage),
                        model: model.unwrap_or_else(|| req.model.clone()),
                        content,
                        usage,
                        latency_ms: u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
                        retries,
                        output_format: None,
                        concurrency_limit: None,
                    });
                }
                Err(Failure { err, retry_after }) => {
                    if !err.is_retryable() || retries >= self.inner.cfg.max_retries {
                        return Err(if retries == 0 {
                            err
                        } else {
                            LlmError::RetriesExhausted { retries, last: Box::new(err) }
                        });
                    }
                    let wait = self.backoff(retries, retry_after);
                    tracing::warn!(error = %err, retry = retries + 1, wait_ms = wait.as_millis() as u64, "LLM call failed; retrying");
                    tokio::time::sleep(wait).await;
                    retries += 1;
                }
            }
        }
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
/// combee's own tolerant readers are in `learn::answer`). When it fails, asks ONCE
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
    for _ in 0..ATTEMPTS {
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
                calls.push(call);
                return Ok(v);
            }
            Err(why) => {
                detail = truncate_chars(&why, 500);
                call.error = Some(format!("invalid answer: {detail}"));
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
    struct Server {
        script: Script,
        hits: Arc<AtomicUsize>,
        in_flight: Arc<AtomicUsize>,
        max_in_flight: Arc<AtomicUsize>,
        bodies: Arc<Mutex<Vec<Value>>>,
    }

    async fn handle(State(s): State<Server>, headers: AxHeaders, body: axum::body::Bytes) -> Response {
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

    async fn spawn(script: impl Fn(usize, &Value, &AxHeaders) -> Step + Send + Sync + 'static) -> (String, Server) {
        let server = Server {
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
    struct Answer {
        instruction: String,
    }

    #[tokio::test]
    async fn malformed_json_is_fixed_by_one_corrective_retry() {
        let (url, server) =
            spawn(|n, _, _| if n == 0 { ok(r#"{"instruction": "x""#) } else { ok(r#"{"instruction": "y"}"#) }).await;
        let c = client(&url, |_| {});
        let mut calls = vec![];
        let a: Answer = chat_json(&c, LlmRole::Aggregator, req(&c), &mut calls).await.unwrap();
        assert_eq!(a, Answer { instruction: "y".into() });
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
        let err = chat_json::<Answer>(&c, LlmRole::Aggregator, req(&c), &mut calls).await.unwrap_err();
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
        let check = |a: &Answer| if a.instruction.is_empty() { Err("empty instruction".to_owned()) } else { Ok(()) };
        let a: Answer = chat_json_checked(&c, LlmRole::Aggregator, req(&c), &mut calls, check).await.unwrap();
        assert_eq!(a.instruction, "z");
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
