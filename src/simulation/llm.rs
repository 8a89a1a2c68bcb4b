//! A SIMULATED OpenAI-compatible LLM server, so tests and benchmarks can run
//! combee's learning rounds without a paid model. It is not a language model: it
//! recognises combee's own prompts by their `combee-task:` line and answers them
//! by rule, deterministically by seed. What it models:
//!
//! - **Insights.** Every `INSIGHT-<token>: <text>` marker (token `[A-Za-z0-9_-]+`;
//!   text runs to the end of the line, or to a `"` or `\` so markers inside JSON
//!   strings work) is one distinct insight, identified by its token. Answers carry
//!   markers verbatim, so a test can count exactly which insights survive.
//! - **Capacity** (context overload), one of two models (`capacity_model`):
//!   - `soft` (the default): let m be the number of *new insights the call must
//!     write in its answer* — the distinct insights of its input fence that are not
//!     already in the current prompt it was given (for a consolidation that answers
//!     with decisions, only the insights inside the texts it must write; operations
//!     it passes through unchanged are not written, see `consolidate-decisions`
//!     below). Each of the m is kept independently with probability E(m)/m, where
//!     E(m) = K·(1 − e^(−m/K)) is the expected number kept (K = `capacity_k`): a
//!     call writing few new lessons keeps nearly all, one writing many keeps about K.
//!     The draw for an insight is `sha256(seed ‖ sha256(first user message) ‖ token)`
//!     against E(m)/m: deterministic per seed and request.
//!   - `hard`: a *distilling* call (aggregate-playbook,
//!     aggregate-rewrite: its n items are raw reflections, n from the fence's
//!     `count`) keeps at most K = `capacity_k` distinct new insights, and only
//!     `max(1, floor(K·D / n))` when n > D = `digest_reflections`.
//!     A *combining* call (merge-rewrite, consolidate-playbook: its n items are
//!     level-1 updates, each already the output of one call) keeps at most K per
//!     item it digests: K·n when n ≤ D, `max(1, floor(K·D·D / n))` beyond (the same
//!     overload factor D/n, continuous at n = D). Why not K per call there too: the
//!     paper's premise is that each level of the tree handles ~√n items "well within
//!     the aggregator's effective capacity" and that the final merge keeps the
//!     specific insights of all groups; a hard K per combining call would cap every
//!     two-level round at K insights, i.e. make Combee no better than one call,
//!     which is the opposite of the overload effect being modelled (specific
//!     content lost when one call must *distil* too much raw material).
//!     Which ones: candidates are ranked by the first 8 bytes of
//!     `sha256(seed ‖ sha256(first user message) ‖ token)`, lowest first — spread
//!     across insights and calls, yet the same request and seed always keep the same.
//! - **Latency**: `fixed_ms + per_input_token_ms·prompt_tokens +
//!   per_output_token_ms·completion_tokens`, slept before answering, where
//!   tokens = ceil(characters / 4) (all messages for the prompt, the answer for the
//!   completion) — the same numbers reported as `usage`.
//! - **Faults**, drawn per request from `sha256(seed ‖ request counter)` against the
//!   configured rates in this order: 429 with `Retry-After`, 500/503, an answer held
//!   back `hang_ms` longer, a malformed (non-JSON) answer.
//!
//! - **Answers.** reflect: a `Reflection` whose `key_insight` holds every marker of
//!   the trace (not of the current prompt), or a generic insight when there is none;
//!   its `bullet_tags` tag each `[b-NNNN]` named in the trace's trajectory that is a
//!   bullet of the current playbook, helpful when the feedback says
//!   `"success": true`, harmful otherwise. aggregate-playbook: one `ADD` to
//!   section `insights` per kept new insight (content = the marker); insights
//!   already in the current prompt are not new. consolidate-playbook (decisions
//!   by op id): `drop` for ops whose insights are all in the current prompt,
//!   `merge` for ADDs sharing an insight (the merged text holds the kept markers),
//!   nothing for every other op, which therefore passes through. The merged
//!   texts are what the call writes: m counts their new insights (soft model);
//!   the hard model keeps at most K of them.
//!   aggregate-rewrite and merge-rewrite: the current prompt text followed by a
//!   bullet list of the kept new insights. crossover (recognised by its own
//!   `combee-task: crossover` line): drops nothing and imports every winner's
//!   bullet (`vN:b-NNNN | section | counters | content` lines of the
//!   `untrusted-arms` fence) that carries an insight the champion's prompt does
//!   not hold, each insight once. Any other request gets a fixed JSON note.
//!
//! `GET /v1/sim/stats` reports calls per task and faults injected.

use std::collections::{BTreeMap, HashSet};
use std::future::Future;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use serde_json::json;
use sha2::{Digest, Sha256};

use crate::domain::{BulletTag, BulletTagKind, DeltaOp, Reflection};
use crate::learn::level2::{Action, Decision, DecisionsAnswer};
use crate::learn::protocol::{InstructionAnswer, Task};
use crate::llm::client::estimate_tokens;

/// Which capacity model the simulated aggregator follows (see the module doc). [simulation]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum CapacityModel {
    /// Each of the m new insights a call must write is kept with probability E(m)/m,
    /// E(m) = K·(1 − e^(−m/K)).
    #[default]
    Soft,
    /// At most K new insights per distilling call, fewer beyond D items.
    Hard,
}

/// E(m) = K·(1 − e^(−m/K)): the expected number of new insights a call that must
/// write m of them keeps under the soft capacity model. [simulation]
pub fn expected_kept(k: usize, m: usize) -> f64 {
    if k == 0 {
        return 0.0;
    }
    let k = k as f64;
    k * (1.0 - (-(m as f64) / k).exp())
}

/// How the simulated model behaves. Every field is also a `combee sim-llm` flag.
#[derive(Debug, Clone, PartialEq, clap::Args, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SimConfig {
    /// Seed of every deterministic choice (insight selection, faults). [simulation]
    #[arg(long = "seed", default_value_t = 0)]
    pub seed: u64,
    /// Capacity model: `soft` (each of the m new insights a call must write is kept with
    /// probability E(m)/m, E(m) = K·(1 − e^(−m/K))) or `hard` (at most K per distilling
    /// call, see `digest_reflections`). [simulation]
    #[arg(long, value_enum, default_value_t = CapacityModel::Soft)]
    pub capacity_model: CapacityModel,
    /// K: soft model — the scale of E(m), about the most new insights one call keeps; hard
    /// model — most distinct new insights one distilling aggregator call keeps (a merge or
    /// consolidation keeps K per level-1 update it combines). [simulation]
    #[arg(long, default_value_t = 12)]
    pub capacity_k: usize,
    /// D (hard model only): input items (reflections, proposals, op lists) a call digests
    /// fully; above it a call's capacity shrinks by D/n. [simulation]
    #[arg(long, default_value_t = 12)]
    pub digest_reflections: usize,
    /// Fixed latency of every answer, in ms. [simulation]
    #[arg(long, default_value_t = 0.0)]
    pub fixed_ms: f64,
    /// Latency per prompt token, in ms. [simulation]
    #[arg(long, default_value_t = 0.0)]
    pub per_input_token_ms: f64,
    /// Latency per completion token, in ms. [simulation]
    #[arg(long, default_value_t = 0.0)]
    pub per_output_token_ms: f64,
    /// Share of requests answered 429 with `Retry-After` (0..=1). [simulation]
    #[arg(long, default_value_t = 0.0)]
    pub rate_429: f64,
    /// The delay a 429 asks for, in ms (sent as `retry-after-ms` and rounded up to whole
    /// seconds in `Retry-After`). [simulation]
    #[arg(long, default_value_t = 1000)]
    pub retry_after_ms: u64,
    /// Share of requests answered 500 or 503. [simulation]
    #[arg(long, default_value_t = 0.0)]
    pub rate_5xx: f64,
    /// Share of requests whose answer is held back `hang_ms` longer (a timeout for most clients). [simulation]
    #[arg(long, default_value_t = 0.0)]
    pub rate_hang: f64,
    /// How long a hanging answer is held back, in ms. [simulation]
    #[arg(long, default_value_t = 30_000)]
    pub hang_ms: u64,
    /// Share of requests answered with malformed JSON content. [simulation]
    #[arg(long, default_value_t = 0.0)]
    pub rate_malformed: f64,
    /// Answer shapes real models produce, each drawn independently per request
    /// (0..=1; several can apply to one answer). Share of answers wrapped in a
    /// ```` ```json ```` code fence. [simulation]
    #[arg(long, default_value_t = 0.0)]
    pub rate_fence: f64,
    /// Share of answers with prose before and after the JSON. [simulation]
    #[arg(long, default_value_t = 0.0)]
    pub rate_preamble: f64,
    /// Share of answers carrying keys the format does not have (top level and per item). [simulation]
    #[arg(long, default_value_t = 0.0)]
    pub rate_extra_keys: f64,
    /// Share of answers preceded by a `<think>…</think>` block (which itself holds a JSON draft). [simulation]
    #[arg(long, default_value_t = 0.0)]
    pub rate_think: f64,
    /// Share of answers citing ids that do not exist: a bullet tag or an UPDATE of
    /// bullet `b-9999`, and a source number past the group. [simulation]
    #[arg(long, default_value_t = 0.0)]
    pub rate_unknown_ids: f64,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            seed: 0,
            capacity_model: CapacityModel::Soft,
            capacity_k: 12,
            digest_reflections: 12,
            fixed_ms: 0.0,
            per_input_token_ms: 0.0,
            per_output_token_ms: 0.0,
            rate_429: 0.0,
            retry_after_ms: 1000,
            rate_5xx: 0.0,
            rate_hang: 0.0,
            hang_ms: 30_000,
            rate_malformed: 0.0,
            rate_fence: 0.0,
            rate_preamble: 0.0,
            rate_extra_keys: 0.0,
            rate_think: 0.0,
            rate_unknown_ids: 0.0,
        }
    }
}

/// `combee sim-llm`: run the simulated LLM server.
#[derive(Debug, Clone, clap::Args)]
pub struct SimArgs {
    /// Address the simulator listens on.
    #[arg(long, default_value = "127.0.0.1:8090")]
    pub bind: String,
    #[command(flatten)]
    pub sim: SimConfig,
}

/// Counters served at `GET /v1/sim/stats`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SimStats {
    pub requests: u64,
    /// Requests per recognised task (`reflect`, `aggregate-playbook`, …, `other`).
    pub calls: BTreeMap<String, u64>,
    /// Faults injected per kind: `rate_limited`, `server_error`, `hang`, `malformed`.
    pub faults: BTreeMap<String, u64>,
    /// Answer shapes applied per kind: `fence`, `preamble`, `extra_keys`, `think`, `unknown_ids`.
    #[serde(default)]
    pub shapes: BTreeMap<String, u64>,
    /// Answers that got at least one shape.
    #[serde(default)]
    pub shaped_answers: u64,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
}

struct Sim {
    cfg: SimConfig,
    counter: AtomicU64,
    stats: Mutex<SimStats>,
}

impl Sim {
    fn record(&self, f: impl FnOnce(&mut SimStats)) {
        if let Ok(mut s) = self.stats.lock() {
            f(&mut s);
        }
    }
}

/// The simulator's routes, for embedding in a test server.
pub fn router(cfg: SimConfig) -> Router {
    let sim = Arc::new(Sim { cfg, counter: AtomicU64::new(0), stats: Mutex::new(SimStats::default()) });
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/models", get(models))
        .route("/v1/sim/stats", get(stats))
        .with_state(sim)
}

/// A simulator serving on a free loopback port in this process (tests and
/// benchmarks); it stops when this handle is dropped.
pub struct LocalSim {
    /// The OpenAI-compatible base URL, e.g. `http://127.0.0.1:PORT/v1`.
    pub base_url: String,
    shutdown: tokio_util::sync::CancellationToken,
}

impl LocalSim {
    /// Binds 127.0.0.1:0 and starts serving `cfg` in the background.
    pub async fn start(cfg: SimConfig) -> std::io::Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let base_url = format!("http://{}/v1", listener.local_addr()?);
        let shutdown = tokio_util::sync::CancellationToken::new();
        let stop = shutdown.clone();
        tokio::spawn(serve_simulator(listener, cfg, async move { stop.cancelled().await }));
        Ok(Self { base_url, shutdown })
    }
}

impl Drop for LocalSim {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// Serves the simulator on `listener` until `shutdown` completes.
pub async fn serve_simulator(
    listener: tokio::net::TcpListener,
    cfg: SimConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, "LLM SIMULATOR listening (simulated answers, not a language model)");
    }
    axum::serve(listener, router(cfg)).with_graceful_shutdown(shutdown).await
}

async fn models() -> Response {
    Json(json!({"object": "list", "data": [{"id": "combee-sim", "object": "model", "owned_by": "combee-simulation"}]}))
        .into_response()
}

async fn stats(State(sim): State<Arc<Sim>>) -> Response {
    let s = sim.stats.lock().map(|s| s.clone()).unwrap_or_default();
    Json(s).into_response()
}

fn api_error(status: StatusCode, kind: &str, message: &str) -> Response {
    (status, Json(json!({"error": {"message": message, "type": kind, "code": status.as_u16()}}))).into_response()
}

#[derive(Deserialize)]
struct SimRequest {
    #[serde(default)]
    model: String,
    messages: Vec<SimMessage>,
    #[serde(default)]
    seed: Option<u64>,
}

#[derive(Deserialize)]
struct SimMessage {
    role: String,
    content: String,
}

fn hash(parts: &[&[u8]]) -> [u8; 32] {
    let mut h = Sha256::new();
    for p in parts {
        h.update((p.len() as u64).to_le_bytes());
        h.update(p);
    }
    h.finalize().into()
}

fn hash_u64(parts: &[&[u8]]) -> u64 {
    let h = hash(parts);
    u64::from_be_bytes([h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7]])
}

/// A uniform draw in [0, 1).
fn unit(parts: &[&[u8]]) -> f64 {
    (hash_u64(parts) >> 11) as f64 / (1u64 << 53) as f64
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    RateLimited,
    ServerError(u16),
    Hang,
    Malformed,
}

fn draw_fault(cfg: &SimConfig, n: u64) -> Option<Fault> {
    let u = unit(&[b"fault", &cfg.seed.to_le_bytes(), &n.to_le_bytes()]);
    let mut edge = 0.0;
    for (rate, fault) in [
        (cfg.rate_429, Fault::RateLimited),
        (
            cfg.rate_5xx,
            Fault::ServerError(if hash_u64(&[b"5xx", &cfg.seed.to_le_bytes(), &n.to_le_bytes()]).is_multiple_of(2) {
                500
            } else {
                503
            }),
        ),
        (cfg.rate_hang, Fault::Hang),
        (cfg.rate_malformed, Fault::Malformed),
    ] {
        edge += rate.clamp(0.0, 1.0);
        if u < edge {
            return Some(fault);
        }
    }
    None
}

async fn chat(State(sim): State<Arc<Sim>>, body: Bytes) -> Response {
    let req: SimRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return api_error(StatusCode::BAD_REQUEST, "invalid_request_error", &format!("bad request: {e}")),
    };
    let n = sim.counter.fetch_add(1, Ordering::SeqCst);
    let cfg = &sim.cfg;
    let (task, answer) = answer(cfg, &req);
    let (answer, shapes) = match task {
        Some(task) => shape_answer(cfg, n, task, answer),
        None => (answer, Vec::new()),
    };
    let fault = draw_fault(cfg, n);
    sim.record(|s| {
        s.requests += 1;
        let name = task.map_or(if is_crossover(&req) { CROSSOVER_TASK } else { "other" }, Task::as_str);
        *s.calls.entry(name.to_owned()).or_default() += 1;
        for shape in &shapes {
            *s.shapes.entry((*shape).to_owned()).or_default() += 1;
        }
        s.shaped_answers += u64::from(!shapes.is_empty());
        if let Some(f) = fault {
            let kind = match f {
                Fault::RateLimited => "rate_limited",
                Fault::ServerError(_) => "server_error",
                Fault::Hang => "hang",
                Fault::Malformed => "malformed",
            };
            *s.faults.entry(kind.to_owned()).or_default() += 1;
        }
    });
    match fault {
        Some(Fault::RateLimited) => {
            let mut resp = api_error(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", "simulated rate limit");
            let secs = cfg.retry_after_ms.div_ceil(1000).max(1);
            if let (Ok(s), Ok(ms)) = (secs.to_string().parse(), cfg.retry_after_ms.to_string().parse()) {
                resp.headers_mut().insert("retry-after", s);
                resp.headers_mut().insert("retry-after-ms", ms);
            }
            return resp;
        }
        Some(Fault::ServerError(code)) => {
            let status = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            return api_error(status, "server_error", "simulated server error");
        }
        _ => {}
    }
    let content = if fault == Some(Fault::Malformed) {
        // Cut the answer off mid-way: what a model that ran out of tokens sends.
        let cut: String = answer.chars().take(answer.chars().count() / 2).collect();
        format!("{cut} …(simulated malformed answer")
    } else {
        answer
    };
    let prompt_tokens = estimate_tokens(req.messages.iter().map(|m| m.content.chars().count()).sum());
    let completion_tokens = estimate_tokens(content.chars().count());
    sim.record(|s| {
        s.prompt_tokens += prompt_tokens;
        s.completion_tokens += completion_tokens;
    });
    let mut ms = latency_ms(cfg, prompt_tokens, completion_tokens);
    if fault == Some(Fault::Hang) {
        ms += cfg.hang_ms as f64;
    }
    if ms.is_finite() && ms > 0.0 {
        tokio::time::sleep(Duration::from_secs_f64(ms / 1000.0)).await;
    }
    let model = if req.model.is_empty() { "combee-sim".to_owned() } else { req.model };
    Json(json!({
        "id": format!("chatcmpl-sim-{n}"),
        "object": "chat.completion",
        "created": chrono::Utc::now().timestamp(),
        "model": model,
        "system_fingerprint": "combee-simulation",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens}
    }))
    .into_response()
}

/// One insight marker.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Insight {
    token: String,
    text: String,
}

impl Insight {
    fn marker(&self) -> String {
        format!("INSIGHT-{}: {}", self.token, self.text)
    }
}

fn is_token_byte(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_' || c == b'-'
}

/// Distinct insight markers in order of first appearance.
fn insights(text: &str) -> Vec<Insight> {
    let mut out: Vec<Insight> = Vec::new();
    let b = text.as_bytes();
    for (i, _) in text.match_indices("INSIGHT-") {
        // A marker starts a word; `\n`-style escapes count as a break (markers inside JSON strings).
        let escaped = i >= 2 && b[i - 2] == b'\\' && matches!(b[i - 1], b'n' | b'r' | b't');
        if i > 0 && is_token_byte(b[i - 1]) && !escaped {
            continue;
        }
        let start = i + "INSIGHT-".len();
        let len = b[start..].iter().take_while(|c| is_token_byte(**c)).count();
        if len == 0 || b.get(start + len) != Some(&b':') {
            continue;
        }
        let token = &text[start..start + len];
        let rest = &text[start + len + 1..];
        let end = rest.find(['\n', '\r', '"', '\\']).unwrap_or(rest.len());
        let body = rest[..end].trim();
        if body.is_empty() || out.iter().any(|x| x.token == token) {
            continue;
        }
        out.push(Insight { token: token.to_owned(), text: body.to_owned() });
    }
    out
}

/// The attributes and body of the first `<tag …>…</tag>` fence.
fn fenced<'a>(text: &'a str, tag: &str) -> Option<(&'a str, &'a str)> {
    let open = format!("<{tag}");
    let mut from = 0;
    loop {
        let start = from + text[from..].find(&open)?;
        let after = &text[start + open.len()..];
        if after.starts_with(['>', ' ']) {
            let gt = after.find('>')?;
            let body = &after[gt + 1..];
            let end = body.find(&format!("</{tag}>")).unwrap_or(body.len());
            return Some((&after[..gt], &body[..end]));
        }
        from = start + open.len();
    }
}

fn count_attr(attrs: &str) -> Option<usize> {
    let rest = attrs.split_once("count=\"")?.1;
    rest.split_once('"')?.0.parse().ok()
}

/// The labelled part of a rendered trace between `--- name ---` and the next label.
fn trace_part<'a>(trace: &'a str, name: &str) -> &'a str {
    let label = format!("--- {name} ---\n");
    let Some((_, rest)) = trace.split_once(&label) else { return "" };
    match rest.find("\n--- ") {
        Some(end) => &rest[..end],
        None => rest,
    }
}

/// How many new insights a call with `items` inputs keeps: K, or max(1, floor(K·D/n)) when n > D.
pub fn capacity(cfg: &SimConfig, items: usize) -> usize {
    if items <= cfg.digest_reflections {
        cfg.capacity_k
    } else {
        (cfg.capacity_k.saturating_mul(cfg.digest_reflections) / items).max(1).min(cfg.capacity_k.max(1))
    }
}

/// How many new insights a combining call (merge, consolidate) over `items` level-1
/// updates keeps: K per item up to D items, max(1, floor(K·D·D/n)) when n > D.
pub fn combine_capacity(cfg: &SimConfig, items: usize) -> usize {
    let (k, d) = (cfg.capacity_k, cfg.digest_reflections);
    if items <= d { k.saturating_mul(items.max(1)) } else { (k.saturating_mul(d).saturating_mul(d) / items).max(1) }
}

/// Keeps the `capacity` best-ranked candidates (seeded hash rank), in their original order.
fn keep(seed: u64, digest: &[u8; 32], candidates: Vec<Insight>, capacity: usize) -> Vec<Insight> {
    let mut ranked: Vec<(u64, usize)> = candidates
        .iter()
        .enumerate()
        .map(|(i, c)| (hash_u64(&[b"keep", &seed.to_le_bytes(), digest, c.token.as_bytes()]), i))
        .collect();
    ranked.sort();
    let chosen: HashSet<usize> = ranked.into_iter().take(capacity).map(|(_, i)| i).collect();
    candidates.into_iter().enumerate().filter(|(i, _)| chosen.contains(i)).map(|(_, c)| c).collect()
}

/// The soft model: each of the m candidates (the new insights the call must write)
/// is kept independently with probability E(m)/m, drawn from a seeded hash.
fn keep_soft(seed: u64, digest: &[u8; 32], candidates: Vec<Insight>, k: usize) -> Vec<Insight> {
    let m = candidates.len();
    if m == 0 {
        return candidates;
    }
    let p = expected_kept(k, m) / m as f64;
    candidates
        .into_iter()
        .filter(|c| unit(&[b"keep-soft", &seed.to_le_bytes(), digest, c.token.as_bytes()]) < p)
        .collect()
}

/// The `combee-task:` name of the crossover template (not one of the round's [`Task`]s).
const CROSSOVER_TASK: &str = "crossover";

fn is_crossover(req: &SimRequest) -> bool {
    req.messages
        .iter()
        .filter(|m| m.role == "system")
        .flat_map(|m| m.content.lines())
        .any(|l| l.strip_prefix("combee-task:").is_some_and(|t| t.trim() == CROSSOVER_TASK))
}

/// The crossover answer: import each winner bullet whose insight the champion
/// lacks (the first bullet per insight), drop nothing.
fn crossover_selection(user: &str, present: &HashSet<String>) -> serde_json::Value {
    let body = fenced(user, "untrusted-arms").map_or("", |(_, body)| body);
    let mut seen: HashSet<String> = HashSet::new();
    let mut import = Vec::new();
    for line in body.lines() {
        let mut parts = line.splitn(4, " | ");
        let (Some(id), Some(_section), Some(_counters), Some(content)) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        if !id.starts_with('v') || !id.contains(":b-") {
            continue;
        }
        let fresh: Vec<String> = insights(content)
            .into_iter()
            .map(|i| i.token)
            .filter(|t| !present.contains(t) && !seen.contains(t))
            .collect();
        if !fresh.is_empty() {
            seen.extend(fresh);
            import.push(id.to_owned());
        }
    }
    json!({"drop": [], "import": import, "reason": "simulated: import every winner lesson the champion lacks"})
}

fn task_of(req: &SimRequest) -> Option<Task> {
    req.messages
        .iter()
        .filter(|m| m.role == "system")
        .flat_map(|m| m.content.lines())
        .find_map(|l| l.strip_prefix("combee-task:"))
        .and_then(|t| Task::parse(t.trim()))
}

/// The latency model: `fixed_ms + per_input_token_ms·prompt_tokens + per_output_token_ms·completion_tokens`
/// (faults aside). Public so a benchmark can predict a round's time from token counts alone.
pub fn latency_ms(cfg: &SimConfig, prompt_tokens: u64, completion_tokens: u64) -> f64 {
    cfg.fixed_ms + cfg.per_input_token_ms * prompt_tokens as f64 + cfg.per_output_token_ms * completion_tokens as f64
}

/// What the simulator answers to `messages` (no latency, no faults, no request seed):
/// the recognised task and the answer text. Public so a benchmark can replay the
/// simulator in process and model its latency without waiting for it.
pub fn simulated_answer(cfg: &SimConfig, messages: &[crate::llm::ChatMessage]) -> (Option<Task>, String) {
    let messages = messages
        .iter()
        .map(|m| SimMessage {
            role: match m.role {
                crate::llm::ChatRole::System => "system",
                crate::llm::ChatRole::User => "user",
                crate::llm::ChatRole::Assistant => "assistant",
            }
            .to_owned(),
            content: m.content.clone(),
        })
        .collect();
    answer(cfg, &SimRequest { model: String::new(), messages, seed: None })
}

/// Reshapes a well-formed answer the way real models do, each shape drawn
/// independently per request against its rate; returns the text and the shapes applied.
fn shape_answer(cfg: &SimConfig, n: u64, task: Task, answer: String) -> (String, Vec<&'static str>) {
    let drawn = |name: &'static str, rate: f64| {
        (rate > 0.0 && unit(&[b"shape", name.as_bytes(), &cfg.seed.to_le_bytes(), &n.to_le_bytes()]) < rate)
            .then_some(name)
    };
    let shapes: Vec<&'static str> = [
        drawn("unknown_ids", cfg.rate_unknown_ids),
        drawn("extra_keys", cfg.rate_extra_keys),
        drawn("think", cfg.rate_think),
        drawn("fence", cfg.rate_fence),
        drawn("preamble", cfg.rate_preamble),
    ]
    .into_iter()
    .flatten()
    .collect();
    if shapes.is_empty() {
        return (answer, shapes);
    }
    let Ok(serde_json::Value::Object(mut obj)) = serde_json::from_str::<serde_json::Value>(&answer) else {
        return (answer, Vec::new());
    };
    if shapes.contains(&"unknown_ids") {
        match task {
            Task::Reflect => {
                if let Some(serde_json::Value::Array(tags)) = obj.get_mut("bullet_tags") {
                    tags.push(json!({"id": "b-9999", "tag": "helpful"}));
                }
            }
            Task::AggregatePlaybook => {
                if let Some(serde_json::Value::Array(ops)) = obj.get_mut("operations") {
                    if let Some(serde_json::Value::Object(first)) = ops.first_mut()
                        && let Some(serde_json::Value::Array(sources)) = first.get_mut("sources")
                    {
                        sources.push(json!(999));
                    }
                    ops.push(json!({"op": "UPDATE", "id": "b-9999", "content": "Simulated edit of a bullet that does not exist",
                                    "reason": "simulated unknown id", "sources": [1]}));
                }
            }
            _ => {}
        }
    }
    if shapes.contains(&"extra_keys") {
        obj.insert("confidence".into(), json!(0.87));
        obj.insert("notes".into(), json!("simulated extra key"));
        for list in ["operations", "decisions", "bullet_tags"] {
            if let Some(serde_json::Value::Array(items)) = obj.get_mut(list) {
                for item in items.iter_mut().filter_map(serde_json::Value::as_object_mut) {
                    item.insert("priority".into(), json!("high"));
                }
            }
        }
    }
    let mut text = serde_json::to_string(&obj).unwrap_or_default();
    if shapes.contains(&"fence") {
        text = format!("```json\n{}\n```", serde_json::to_string_pretty(&obj).unwrap_or_default());
    }
    if shapes.contains(&"preamble") {
        text = format!("Here is my answer, based on the data above:\n\n{text}\n\nLet me know if anything is unclear.");
    }
    if shapes.contains(&"think") {
        text = format!(
            "<think>\nThe user wants JSON. A first draft: {{\"draft\": true}}. Let me check it again.\n</think>\n{text}"
        );
    }
    (text, shapes)
}

/// `[reflection N]` sections of a reflections fence: (N, section text).
fn reflection_sections(body: &str) -> Vec<(usize, &str)> {
    let starts: Vec<(usize, usize)> = body
        .match_indices("[reflection ")
        .filter(|(i, _)| *i == 0 || body.as_bytes()[i - 1] == b'\n')
        .filter_map(|(i, m)| {
            let rest = &body[i + m.len()..];
            let close = rest.find(']')?;
            Some((i, rest[..close].parse().ok()?))
        })
        .collect();
    starts
        .iter()
        .enumerate()
        .map(|(j, &(at, n))| (n, &body[at..starts.get(j + 1).map_or(body.len(), |next| next.0)]))
        .collect()
}

/// The recognised task and the answer text (before any fault).
fn answer(cfg: &SimConfig, req: &SimRequest) -> (Option<Task>, String) {
    let user = req.messages.iter().find(|m| m.role == "user").map_or("", |m| m.content.as_str());
    let seed = cfg.seed ^ req.seed.unwrap_or(0).rotate_left(17);
    let digest = hash(&[user.as_bytes()]);
    let current = fenced(user, "current-prompt").map_or("", |(_, body)| body.trim());
    let present: HashSet<String> = insights(current).into_iter().map(|i| i.token).collect();
    // New insights of an input fence, capped by the capacity model.
    let kept = |tag: &str| -> Vec<Insight> {
        let Some((attrs, body)) = fenced(user, tag) else { return vec![] };
        let items = count_attr(attrs).unwrap_or(1);
        let candidates: Vec<Insight> = insights(body).into_iter().filter(|i| !present.contains(&i.token)).collect();
        match cfg.capacity_model {
            CapacityModel::Soft => keep_soft(seed, &digest, candidates, cfg.capacity_k),
            CapacityModel::Hard => {
                let cap =
                    if tag == "untrusted-reflections" { capacity(cfg, items) } else { combine_capacity(cfg, items) };
                keep(seed, &digest, candidates, cap)
            }
        }
    };
    let with_bullets = |kept: Vec<Insight>| -> String {
        let mut text = if current.is_empty() { "You are a helpful agent.".to_owned() } else { current.to_owned() };
        if !kept.is_empty() {
            text.push_str("\n\nLessons learned:\n");
            text.push_str(&kept.iter().map(|i| format!("- {}", i.marker())).collect::<Vec<_>>().join("\n"));
        }
        text
    };
    let adds = |kept: Vec<Insight>| -> Vec<DeltaOp> {
        kept.into_iter()
            .map(|i| DeltaOp::Add {
                section: "insights".into(),
                content: i.marker(),
                reason: "simulated: kept by the capacity model".into(),
            })
            .collect()
    };
    let task = task_of(req);
    if task.is_none() && is_crossover(req) {
        return (None, crossover_selection(user, &present).to_string());
    }
    let text = match task {
        Some(Task::Reflect) => serde_json::to_string(&reflect(user, current)),
        Some(Task::AggregatePlaybook) => {
            // Each op cites the reflections its insight came from, numbered as in the prompt.
            let sections = fenced(user, "untrusted-reflections").map_or_else(Vec::new, |(_, b)| reflection_sections(b));
            let ops: Vec<serde_json::Value> = adds(kept("untrusted-reflections"))
                .into_iter()
                .map(|op| {
                    let mut v = serde_json::to_value(&op).unwrap_or_default();
                    let token = match &op {
                        DeltaOp::Add { content, .. } => insights(content).first().map(|i| i.token.clone()),
                        _ => None,
                    };
                    let sources: Vec<usize> = token.map_or_else(Vec::new, |t| {
                        let needle = format!("INSIGHT-{t}:");
                        sections.iter().filter(|(_, text)| text.contains(&needle)).map(|(n, _)| *n).collect()
                    });
                    if let Some(o) = v.as_object_mut() {
                        o.insert("sources".into(), json!(sources));
                    }
                    v
                })
                .collect();
            serde_json::to_string(&json!({ "operations": ops }))
        }
        Some(Task::ConsolidatePlaybook) => {
            let body = fenced(user, "untrusted-operations").map_or("", |(_, body)| body);
            serde_json::to_string(&consolidation_decisions(cfg, seed, &digest, body, &present))
        }
        Some(Task::AggregateRewrite) => {
            serde_json::to_string(&InstructionAnswer { instruction: with_bullets(kept("untrusted-reflections")) })
        }
        Some(Task::MergeRewrite) => {
            serde_json::to_string(&InstructionAnswer { instruction: with_bullets(kept("untrusted-proposals")) })
        }
        None => Ok(r#"{"simulated": true, "note": "not a combee prompt"}"#.to_owned()),
    };
    (task, text.unwrap_or_default())
}

/// The consolidation answer: decisions only, by op id. Ops whose insights are all
/// in the current prompt already are dropped; ops that share an insight are
/// merged, and the merged text — the only new text the call writes — goes
/// through the capacity model (m = the distinct new insights of all merge texts).
/// Every other op is not mentioned, so it passes through unchanged.
fn consolidation_decisions(
    cfg: &SimConfig,
    seed: u64,
    digest: &[u8; 32],
    body: &str,
    present: &HashSet<String>,
) -> DecisionsAnswer {
    // `o3 | ADD | section | content` lines.
    let ops: Vec<(String, String, Vec<Insight>)> = body
        .lines()
        .filter_map(|l| {
            let mut parts = l.splitn(3, " | ");
            let (label, kind) = (parts.next()?.trim(), parts.next()?.trim());
            label.starts_with('o').then(|| (label.to_owned(), kind.to_owned(), insights(l)))
        })
        .collect();
    let mut decisions = Vec::new();
    let mut clusters: Vec<Vec<usize>> = Vec::new();
    let mut cluster_of: BTreeMap<String, usize> = BTreeMap::new();
    for (i, (label, kind, found)) in ops.iter().enumerate() {
        if !found.is_empty() && found.iter().all(|x| present.contains(&x.token)) {
            decisions.push(Decision {
                action: Action::Drop,
                ops: vec![label.clone()],
                content: None,
                reason: "simulated: already in the playbook".into(),
            });
            continue;
        }
        if kind != "ADD" {
            continue;
        }
        let c = found.iter().find_map(|x| cluster_of.get(&x.token).copied()).unwrap_or_else(|| {
            clusters.push(Vec::new());
            clusters.len() - 1
        });
        clusters[c].push(i);
        for x in found {
            cluster_of.entry(x.token.clone()).or_insert(c);
        }
    }
    let merges: Vec<&Vec<usize>> = clusters.iter().filter(|c| c.len() >= 2).collect();
    let mut to_write: Vec<Insight> = Vec::new();
    for &i in merges.iter().flat_map(|c| c.iter()) {
        for x in &ops[i].2 {
            if !present.contains(&x.token) && !to_write.iter().any(|w| w.token == x.token) {
                to_write.push(x.clone());
            }
        }
    }
    let kept: HashSet<String> = match cfg.capacity_model {
        CapacityModel::Soft => keep_soft(seed, digest, to_write, cfg.capacity_k),
        CapacityModel::Hard => keep(seed, digest, to_write, cfg.capacity_k),
    }
    .into_iter()
    .map(|x| x.token)
    .collect();
    for c in merges {
        let mut markers: Vec<String> = Vec::new();
        for &i in c {
            for x in ops[i].2.iter().filter(|x| kept.contains(&x.token)) {
                if !markers.contains(&x.marker()) {
                    markers.push(x.marker());
                }
            }
        }
        let content = if markers.is_empty() {
            "Simulated merged lesson (its specific insights were lost).".to_owned()
        } else {
            markers.join("; ")
        };
        decisions.push(Decision {
            action: Action::Merge,
            ops: c.iter().map(|&i| ops[i].0.clone()).collect(),
            content: Some(content),
            reason: "simulated: the same insight".into(),
        });
    }
    DecisionsAnswer { decisions }
}

fn reflect(user: &str, current: &str) -> Reflection {
    let trace = fenced(user, "untrusted-trace-data").map_or("", |(_, body)| body);
    let success = trace_part(trace, "feedback").contains("\"success\": true");
    let found = insights(trace);
    let key_insight = if found.is_empty() {
        "Simulated generic insight: re-read the task requirements before answering.".to_owned()
    } else {
        found.iter().map(Insight::marker).collect::<Vec<_>>().join("\n")
    };
    // Tag the playbook bullets the trajectory mentions as `[b-NNNN]`.
    let trajectory = trace_part(trace, "trajectory");
    let mut bullet_tags: Vec<BulletTag> = Vec::new();
    for (i, _) in trajectory.match_indices("[b-") {
        let digits: String = trajectory[i + 3..].chars().take_while(char::is_ascii_digit).collect();
        let id = format!("b-{digits}");
        if digits.is_empty() || !current.contains(&format!("[{id}]")) || bullet_tags.iter().any(|t| t.id == id) {
            continue;
        }
        let tag = if success { BulletTagKind::Helpful } else { BulletTagKind::Harmful };
        bullet_tags.push(BulletTag { id, tag });
    }
    let sim = "(simulated reflection)";
    Reflection {
        error: if success { String::new() } else { format!("The run did not succeed {sim}.") },
        root_cause: if success { String::new() } else { format!("The agent missed a lesson from its playbook {sim}.") },
        correct_approach: format!("Apply the key insight {sim}."),
        key_insight,
        bullet_tags,
    }
}

/// The simulator running in this process, and a client for it: shared by the
/// tests here and the round executor's.
#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::domain::VersionContent;
    use crate::domain::playbook::{Bullet, Playbook, Section};
    use crate::domain::{Strategy, Trace};
    use crate::learn::delta::MergedOp;
    use crate::learn::protocol::{
        self,
        tests::{reflection, trace},
    };
    use crate::llm::{ChatMessage, LlmBackend, LlmCall, LlmConfig, LlmError, LlmRole, OpenAiClient};

    /// The hard capacity model, for tests that count exactly what survives.
    pub(crate) fn hard() -> SimConfig {
        SimConfig { capacity_model: CapacityModel::Hard, ..SimConfig::default() }
    }

    pub(crate) struct Running {
        pub(crate) client: OpenAiClient,
        pub(crate) cfg: LlmConfig,
        pub(crate) base: String,
        _sim: LocalSim,
    }

    impl Running {
        pub(crate) async fn stats(&self) -> SimStats {
            reqwest::get(format!("{}/sim/stats", self.base)).await.unwrap().json().await.unwrap()
        }
    }

    /// A playbook reflector call against the running simulator, without the answer notes.
    async fn reflect_on(
        sim: &Running,
        trace: &Trace,
        current: &VersionContent,
        calls: &mut Vec<LlmCall>,
    ) -> Result<Reflection, LlmError> {
        Ok(protocol::reflect_noted(&sim.client, &sim.cfg, trace, current, Strategy::Playbook, calls).await?.value)
    }

    /// A playbook aggregator call's operations, without notes and sources.
    async fn aggregate_playbook_on(
        sim: &Running,
        current: &VersionContent,
        reflections: &[Reflection],
        calls: &mut Vec<LlmCall>,
    ) -> Result<Vec<DeltaOp>, LlmError> {
        let noted = protocol::aggregate_playbook_noted(&sim.client, &sim.cfg, current, reflections, calls).await?;
        Ok(noted.value.into_iter().map(|s| s.op).collect())
    }

    /// A rewrite aggregator call's instruction, without the notes.
    async fn aggregate_rewrite_on(
        sim: &Running,
        current: &VersionContent,
        reflections: &[Reflection],
        calls: &mut Vec<LlmCall>,
    ) -> Result<String, LlmError> {
        Ok(protocol::aggregate_rewrite_noted(&sim.client, &sim.cfg, current, reflections, calls).await?.value)
    }

    pub(crate) async fn start(sim: SimConfig, tweak: impl FnOnce(&mut LlmConfig)) -> Running {
        let local = LocalSim::start(sim).await.unwrap();
        let base = local.base_url.clone();
        let mut cfg = LlmConfig {
            base_url: base.clone(),
            backoff_base_ms: 1,
            backoff_max_ms: 20,
            max_retries: 8,
            ..Default::default()
        };
        tweak(&mut cfg);
        Running { client: OpenAiClient::new(cfg.clone()).unwrap(), cfg, base, _sim: local }
    }

    fn numbered(range: std::ops::Range<usize>) -> Vec<Reflection> {
        range.map(|i| reflection(&format!("INSIGHT-i{i}: lesson number {i}"))).collect()
    }

    fn playbook(contents: &[&str]) -> VersionContent {
        VersionContent {
            base: "You solve {task}.".into(),
            playbook: Some(Playbook {
                sections: vec![Section {
                    name: "strategies".into(),
                    bullets: contents
                        .iter()
                        .enumerate()
                        .map(|(i, c)| Bullet {
                            id: format!("b-{:04}", i + 1),
                            content: (*c).into(),
                            helpful: 0,
                            harmful: 0,
                        })
                        .collect(),
                }],
                next_id: contents.len() as u64 + 1,
            }),
        }
    }

    fn tokens(ops: &[DeltaOp]) -> Vec<String> {
        ops.iter()
            .flat_map(|op| match op {
                DeltaOp::Add { content, .. } | DeltaOp::Update { content, .. } => insights(content),
                DeltaOp::Remove { .. } => vec![],
            })
            .map(|i| i.token)
            .collect()
    }

    fn with_trajectory(text: &str, success: bool) -> Trace {
        trace(Value::String(text.into()), success)
    }

    use serde_json::Value;

    #[test]
    fn markers_are_found_in_text_and_in_json_strings() {
        let text = "x INSIGHT-a1: first one\n\"INSIGHT-b_2: inside json\\nINSIGHT-c: third\" INSIGHT-a1: dup XINSIGHT-d: no INSIGHT-: no INSIGHT-e:   ";
        let found: Vec<String> = insights(text).iter().map(Insight::marker).collect();
        assert_eq!(found, ["INSIGHT-a1: first one", "INSIGHT-b_2: inside json", "INSIGHT-c: third"]);
    }

    #[test]
    fn sim_args_have_a_flag_for_every_setting() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            args: SimArgs,
        }
        let cli = Cli::try_parse_from(["sim-llm"]).unwrap();
        assert_eq!((cli.args.bind.as_str(), &cli.args.sim), ("127.0.0.1:8090", &SimConfig::default()));
        let cli = Cli::try_parse_from([
            "sim-llm",
            "--bind",
            "0.0.0.0:9",
            "--seed",
            "5",
            "--capacity-model",
            "hard",
            "--capacity-k",
            "3",
            "--digest-reflections",
            "4",
            "--fixed-ms",
            "1.5",
            "--per-input-token-ms",
            "0.1",
            "--per-output-token-ms",
            "2",
            "--rate-429",
            "0.1",
            "--retry-after-ms",
            "10",
            "--rate-5xx",
            "0.2",
            "--rate-hang",
            "0.3",
            "--hang-ms",
            "7",
            "--rate-malformed",
            "0.4",
            "--rate-fence",
            "0.05",
            "--rate-preamble",
            "0.06",
            "--rate-extra-keys",
            "0.07",
            "--rate-think",
            "0.08",
            "--rate-unknown-ids",
            "0.09",
        ])
        .unwrap();
        let want = SimConfig {
            seed: 5,
            capacity_model: CapacityModel::Hard,
            capacity_k: 3,
            digest_reflections: 4,
            fixed_ms: 1.5,
            per_input_token_ms: 0.1,
            per_output_token_ms: 2.0,
            rate_429: 0.1,
            retry_after_ms: 10,
            rate_5xx: 0.2,
            rate_hang: 0.3,
            hang_ms: 7,
            rate_malformed: 0.4,
            rate_fence: 0.05,
            rate_preamble: 0.06,
            rate_extra_keys: 0.07,
            rate_think: 0.08,
            rate_unknown_ids: 0.09,
        };
        assert_eq!(cli.args.sim, want);
        assert_eq!(serde_json::from_str::<SimConfig>("{}").unwrap(), SimConfig::default());
        assert!(serde_json::from_str::<SimConfig>(r#"{"capacity": 3}"#).is_err());
    }

    #[test]
    fn capacity_formula() {
        let cfg = SimConfig { capacity_k: 12, digest_reflections: 12, ..Default::default() };
        assert_eq!(capacity(&cfg, 3), 12);
        assert_eq!(capacity(&cfg, 12), 12);
        assert_eq!(capacity(&cfg, 20), 7);
        assert_eq!(capacity(&cfg, 100), 1);
        let cfg = SimConfig { capacity_k: 12, digest_reflections: 40, ..Default::default() };
        assert_eq!(capacity(&cfg, 100), 4);
        let cfg = SimConfig { capacity_k: 12, digest_reflections: 12, ..Default::default() };
        assert_eq!(combine_capacity(&cfg, 1), 12);
        assert_eq!(combine_capacity(&cfg, 10), 120);
        assert_eq!(combine_capacity(&cfg, 12), 144);
        assert_eq!(combine_capacity(&cfg, 13), 132);
        assert_eq!(combine_capacity(&cfg, 100), 17);
        assert_eq!(combine_capacity(&cfg, 5000), 1);
    }

    #[test]
    fn soft_capacity_keeps_about_e_of_m_deterministically() {
        assert!((expected_kept(12, 100) - 12.0 * (1.0 - (-100.0f64 / 12.0).exp())).abs() < 1e-12);
        assert!(expected_kept(12, 1) > 0.95 && expected_kept(12, 1) < 1.0);
        assert_eq!(expected_kept(0, 5), 0.0);
        let cands = |m: usize| -> Vec<Insight> {
            (0..m).map(|i| Insight { token: format!("t{i}"), text: "x".into() }).collect()
        };
        // Over many calls the mean kept approaches E(m); the same call keeps the same.
        for m in [3usize, 20, 100] {
            let trials = 400;
            let total: usize =
                (0..trials).map(|c: u32| keep_soft(1, &hash(&[&c.to_le_bytes()]), cands(m), 12).len()).sum();
            let mean = total as f64 / f64::from(trials);
            let want = expected_kept(12, m);
            assert!((mean - want).abs() < 0.06 * want + 0.2, "m = {m}: mean {mean:.2}, E(m) = {want:.2}");
        }
        let d = hash(&[b"one call"]);
        assert_eq!(keep_soft(9, &d, cands(50), 12), keep_soft(9, &d, cands(50), 12));
        assert_ne!(keep_soft(9, &d, cands(50), 12), keep_soft(10, &d, cands(50), 12));
        assert!(keep_soft(9, &d, Vec::new(), 12).is_empty());
    }

    #[tokio::test]
    async fn soft_model_loses_little_in_small_calls_and_most_in_large_ones() {
        let sim = start(SimConfig::default(), |_| {}).await;
        assert_eq!(SimConfig::default().capacity_model, CapacityModel::Soft);
        let current = playbook(&[]);
        let mut calls = vec![];
        let big = aggregate_playbook_on(&sim, &current, &numbered(0..100), &mut calls).await.unwrap();
        assert!((6..=18).contains(&big.len()), "E(100) ≈ 12, kept {}", big.len());
        let mut small_kept = 0;
        for g in 0..10 {
            let ops = aggregate_playbook_on(&sim, &current, &numbered(g * 3..g * 3 + 3), &mut calls).await.unwrap();
            small_kept += ops.len();
        }
        assert!(small_kept >= 23, "E(3)/3 ≈ 0.885 of 30, kept {small_kept}");
    }

    #[tokio::test]
    async fn reflect_carries_the_traces_insights_and_tags_used_bullets() {
        let sim = start(SimConfig::default(), |_| {}).await;
        let current = playbook(&["Check units", "INSIGHT-old: already known"]);
        let t = with_trajectory("Used [b-0001] and [b-0042].\nINSIGHT-units: convert to SI first", true);
        let mut calls = vec![];
        let r = reflect_on(&sim, &t, &current, &mut calls).await.unwrap();
        assert_eq!(
            r.key_insight, "INSIGHT-units: convert to SI first",
            "only the trace's insights, not the playbook's"
        );
        assert_eq!(r.bullet_tags, vec![BulletTag { id: "b-0001".into(), tag: BulletTagKind::Helpful }]);
        assert_eq!(calls.len(), 1);
        assert!(calls[0].prompt_tokens > 0 && calls[0].completion_tokens > 0);

        let t = with_trajectory("Used [b-0002].", false);
        let r = reflect_on(&sim, &t, &current, &mut calls).await.unwrap();
        assert!(r.key_insight.contains("generic") && !r.error.is_empty());
        assert_eq!(r.bullet_tags, vec![BulletTag { id: "b-0002".into(), tag: BulletTagKind::Harmful }]);
        assert_eq!(sim.stats().await.calls.get("reflect"), Some(&2));
    }

    #[tokio::test]
    async fn one_naive_call_on_100_insights_keeps_at_most_k() {
        let sim = start(SimConfig { capacity_k: 12, digest_reflections: 12, ..hard() }, |_| {}).await;
        let current = playbook(&["Check units"]);
        let mut calls = vec![];
        let ops = aggregate_playbook_on(&sim, &current, &numbered(0..100), &mut calls).await.unwrap();
        assert!(ops.len() <= 12);
        assert_eq!(ops.len(), 1, "max(1, 12*12/100)");
        // A small group is digested fully; a group of 20 keeps floor(144/20) = 7.
        let ops = aggregate_playbook_on(&sim, &current, &numbered(0..5), &mut calls).await.unwrap();
        assert_eq!(tokens(&ops), ["i0", "i1", "i2", "i3", "i4"]);
        assert!(matches!(&ops[0], DeltaOp::Add { content, .. } if content == "INSIGHT-i0: lesson number 0"));
        let ops = aggregate_playbook_on(&sim, &current, &numbered(0..20), &mut calls).await.unwrap();
        assert_eq!(ops.len(), 7);
    }

    #[tokio::test]
    async fn insights_already_in_the_playbook_are_not_added_again() {
        let sim = start(hard(), |_| {}).await;
        let current = playbook(&["INSIGHT-i1: lesson number 1"]);
        let mut calls = vec![];
        let ops = aggregate_playbook_on(&sim, &current, &numbered(0..3), &mut calls).await.unwrap();
        assert_eq!(tokens(&ops), ["i0", "i2"]);
    }

    #[tokio::test]
    async fn answers_are_deterministic_by_seed_and_spread() {
        let current = playbook(&[]);
        let mut kept = vec![];
        for seed in [7, 7, 8] {
            let sim = start(SimConfig { seed, ..hard() }, |_| {}).await;
            let ops = aggregate_playbook_on(&sim, &current, &numbered(0..30), &mut vec![]).await.unwrap();
            assert_eq!(ops.len(), 4, "floor(12*12/30)");
            kept.push(tokens(&ops));
        }
        assert_eq!(kept[0], kept[1], "same request + seed = same answer");
        assert_ne!(kept[0], kept[2], "another seed keeps other insights");
        assert_ne!(kept[0], ["i0", "i1", "i2", "i3"], "not simply the first ones");
    }

    #[tokio::test]
    async fn rewrite_merge_and_consolidate() {
        let sim = start(SimConfig { capacity_k: 12, ..hard() }, |_| {}).await;
        let current = VersionContent { base: "You solve {task}.".into(), playbook: None };
        let mut calls = vec![];
        let proposal = aggregate_rewrite_on(&sim, &current, &numbered(0..3), &mut calls).await.unwrap();
        assert!(proposal.starts_with("You solve {task}."));
        assert_eq!(insights(&proposal).len(), 3);

        let proposals: Vec<String> =
            [0..10, 5..20].into_iter().map(|r| format!("You solve {{task}}.\n{}", marker_lines(r))).collect();
        let merged = protocol::merge_rewrite(&sim.client, &sim.cfg, &current, &proposals, &mut calls).await.unwrap();
        assert!(merged.starts_with("You solve {task}."));
        assert_eq!(insights(&merged).len(), 20, "20 distinct insights in 2 proposals, K per proposal");
        let proposals: Vec<String> =
            (0..20).map(|p| format!("You solve {{task}}.\n{}", marker_lines(p * 10..p * 10 + 10))).collect();
        let merged = protocol::merge_rewrite(&sim.client, &sim.cfg, &current, &proposals, &mut calls).await.unwrap();
        assert_eq!(insights(&merged).len(), 86, "20 proposals > D = 12: floor(12·12·12/20)");

        let add = |i: usize| DeltaOp::Add {
            section: "s".into(),
            content: format!("INSIGHT-i{i}: lesson number {i}"),
            reason: String::new(),
        };
        // Consolidation answers with decisions only: the two ops of i1 are merged, the
        // op whose insight the playbook holds is dropped, the rest is not mentioned.
        let again = DeltaOp::Add {
            section: "s".into(),
            content: "INSIGHT-i1: lesson number 1, seen by another group".into(),
            reason: String::new(),
        };
        let pooled: Vec<MergedOp> = [add(0), add(1), again, add(2), add(7)]
            .into_iter()
            .enumerate()
            .map(|(g, op)| MergedOp::single(g, op))
            .collect();
        let current = playbook(&["INSIGHT-i7: lesson number 7"]);
        let decisions =
            protocol::consolidate_playbook(&sim.client, &sim.cfg, &current, &pooled, &mut calls).await.unwrap();
        assert_eq!(decisions.len(), 2, "{decisions:?}");
        let out = crate::learn::level2::apply_decisions(&pooled, &decisions).unwrap();
        let ops: Vec<DeltaOp> = out.ops.iter().map(|m| m.op.clone()).collect();
        assert_eq!(tokens(&ops), ["i0", "i1", "i2"]);
        assert_eq!(out.ops[1].groups, vec![1, 2]);
        assert_eq!(out.dropped.len(), 1);
        let stats = sim.stats().await;
        for (task, n) in [("aggregate-rewrite", 1), ("merge-rewrite", 2), ("consolidate-playbook", 1)] {
            assert_eq!(stats.calls.get(task), Some(&n), "{task}");
        }
    }

    fn marker_lines(r: std::ops::Range<usize>) -> String {
        r.map(|i| format!("- INSIGHT-i{i}: lesson number {i}\n")).collect()
    }

    #[tokio::test]
    async fn latency_model_is_roughly_honoured() {
        let sim_cfg =
            SimConfig { fixed_ms: 150.0, per_input_token_ms: 0.05, per_output_token_ms: 0.5, ..Default::default() };
        let sim = start(sim_cfg, |_| {}).await;
        let req = sim.client.request(
            LlmRole::Aggregator,
            protocol::aggregate_playbook_messages(&playbook(&[]), &numbered(0..10)),
            true,
        );
        let started = std::time::Instant::now();
        let resp = sim.client.chat(req).await.unwrap();
        let elapsed = started.elapsed().as_secs_f64() * 1000.0;
        let expected = 150.0 + 0.05 * resp.usage.prompt_tokens as f64 + 0.5 * resp.usage.completion_tokens as f64;
        assert!(expected > 200.0, "the per-token terms matter: {expected}");
        assert!(elapsed >= expected - 5.0 && elapsed < expected + 1000.0, "elapsed {elapsed} ms, model {expected} ms");
        // Usage follows the documented ceil(chars/4).
        let chars: usize = resp.content.chars().count();
        assert_eq!(resp.usage.completion_tokens, chars.div_ceil(4) as u64);
    }

    #[tokio::test]
    async fn faults_are_injected_and_recovered_from() {
        let faulty = SimConfig {
            seed: 3,
            rate_429: 0.15,
            rate_5xx: 0.15,
            rate_hang: 0.15,
            hang_ms: 1_000,
            rate_malformed: 0.15,
            retry_after_ms: 10,
            ..Default::default()
        };
        let sim = start(faulty, |c| c.request_timeout_secs = 0.3).await;
        let clean = start(SimConfig { seed: 3, ..Default::default() }, |_| {}).await;
        let current = playbook(&[]);
        for i in 0..16 {
            let group = numbered(i..i + 3);
            let got = aggregate_playbook_on(&sim, &current, &group, &mut vec![]).await;
            let want = aggregate_playbook_on(&clean, &current, &group, &mut vec![]).await;
            assert_eq!(got.unwrap(), want.unwrap(), "call {i} recovered to the same answer");
        }
        let stats = sim.stats().await;
        for kind in ["rate_limited", "server_error", "hang", "malformed"] {
            assert!(stats.faults.get(kind).copied().unwrap_or(0) >= 1, "{kind} never injected: {stats:?}");
        }
    }

    #[tokio::test]
    async fn fault_responses_look_like_a_real_provider() {
        let sim = start(SimConfig { rate_429: 1.0, retry_after_ms: 1500, ..Default::default() }, |_| {}).await;
        let http = reqwest::Client::new();
        let body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
        let resp = http.post(format!("{}/chat/completions", sim.base)).json(&body).send().await.unwrap();
        assert_eq!(resp.status(), 429);
        assert_eq!(resp.headers()["retry-after"], "2");
        assert_eq!(resp.headers()["retry-after-ms"], "1500");

        let sim = start(SimConfig { rate_5xx: 1.0, ..Default::default() }, |c| c.max_retries = 1).await;
        let err = sim.client.chat(sim.client.request(LlmRole::Reflector, vec![ChatMessage::user("hi")], false)).await;
        assert!(matches!(err, Err(ref e) if e.is_retryable() && e.retries() == 1), "{err:?}");
        let resp = http.post(format!("{}/chat/completions", sim.base)).json(&body).send().await.unwrap();
        assert!(resp.status() == 500 || resp.status() == 503);
    }

    #[tokio::test]
    async fn models_and_foreign_prompts() {
        let sim = start(SimConfig::default(), |_| {}).await;
        let models: Value = reqwest::get(format!("{}/models", sim.base)).await.unwrap().json().await.unwrap();
        assert_eq!(models["data"][0]["id"], "combee-sim");
        let resp = sim
            .client
            .chat(sim.client.request(LlmRole::Reflector, vec![ChatMessage::user("hello")], true))
            .await
            .unwrap();
        assert!(resp.content.contains("simulated"));
        assert_eq!(sim.stats().await.calls.get("other"), Some(&1));
        let bad = reqwest::Client::new().post(format!("{}/chat/completions", sim.base)).body("{").send().await.unwrap();
        assert_eq!(bad.status(), 400);
    }

    #[tokio::test]
    async fn aggregator_operations_cite_their_reflections() {
        let sim = start(hard(), |_| {}).await;
        let current = playbook(&["INSIGHT-i1: lesson number 1"]);
        let mut group = numbered(0..4);
        // Reflection 4 repeats the lesson of reflection 1: one op, both cited.
        group[3].key_insight = "INSIGHT-i0: lesson number 0, seen again".into();
        let got =
            protocol::aggregate_playbook_noted(&sim.client, &sim.cfg, &current, &group, &mut vec![]).await.unwrap();
        let cited: Vec<(String, Vec<usize>)> =
            got.value.iter().map(|s| (tokens(std::slice::from_ref(&s.op)).join(""), s.sources.clone())).collect();
        assert_eq!(cited, [("i0".to_owned(), vec![0, 3]), ("i2".to_owned(), vec![2])]);
        assert!(got.notes.is_empty(), "{:?}", got.notes);
    }

    #[tokio::test]
    async fn every_answer_shape_at_once_still_reads_the_same() {
        let shaped = SimConfig {
            rate_fence: 1.0,
            rate_preamble: 1.0,
            rate_extra_keys: 1.0,
            rate_think: 1.0,
            rate_unknown_ids: 1.0,
            ..hard()
        };
        let (sim, clean) = (start(shaped, |_| {}).await, start(hard(), |_| {}).await);
        let current = playbook(&["Check units"]);
        let group = numbered(0..3);
        let got =
            protocol::aggregate_playbook_noted(&sim.client, &sim.cfg, &current, &group, &mut vec![]).await.unwrap();
        let want =
            protocol::aggregate_playbook_noted(&clean.client, &clean.cfg, &current, &group, &mut vec![]).await.unwrap();
        assert_eq!(got.value, want.value, "the same operations and sources once the shapes are read through");
        assert_eq!(got.notes.wrapping, ["think block", "code fence"]);
        assert!(got.notes.unknown_keys.contains(&"confidence".to_owned()), "{:?}", got.notes);
        assert!(got.notes.unknown_keys.contains(&"operations[0].priority".to_owned()), "{:?}", got.notes);
        // The UPDATE of b-9999 and source 999 are dropped with reasons.
        let reasons: Vec<&str> = got.notes.dropped.iter().map(|d| d.reason.as_str()).collect();
        assert_eq!(got.notes.dropped_count, 2, "{reasons:?}");
        assert!(reasons.iter().any(|r| r.contains("\"b-9999\" is not a bullet")), "{reasons:?}");
        assert!(reasons.iter().any(|r| r.contains("999 is not a reflection of this group")), "{reasons:?}");
        let t = with_trajectory("Used [b-0001].\nINSIGHT-units: convert to SI first", true);
        let r = protocol::reflect_noted(&sim.client, &sim.cfg, &t, &current, Strategy::Playbook, &mut vec![])
            .await
            .unwrap();
        assert_eq!(r.value.key_insight, "INSIGHT-units: convert to SI first");
        assert_eq!(r.value.bullet_tags.len(), 1);
        assert_eq!(r.notes.dropped_count, 1);
        let stats = sim.stats().await;
        assert_eq!(stats.shapes.get("think"), Some(&2));
        assert_eq!(stats.shapes.len(), 5);
    }
}
