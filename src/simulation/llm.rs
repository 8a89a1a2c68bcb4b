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
//! - **Citations and level 2 that go wrong** (drawn per request from its content,
//!   so a corrective retry draws the same): `rate_no_sources` answers cite no
//!   `sources`, `rate_wrong_sources` cite the next reflection of the group instead
//!   of the right one; `rate_unreadable_level2` consolidations answer in the older
//!   operations shape and passage merges in prose; `rate_unreadable_level1`
//!   level-1 aggregations (playbook or rewrite) answer in prose.
//!
//! `GET /v1/sim/stats` reports calls per task and faults injected.

use std::collections::BTreeMap;
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

use super::answers::{
    CROSSOVER_TASK, JUDGE_TASK, SimRequest, answer, hash_u64, is_crossover, is_judge, shape_answer, unit,
};
pub use super::answers::{capacity, combine_capacity, latency_ms, simulated_answer};
pub use super::model::{CapacityModel, SimConfig, expected_kept};
use crate::learn::prompts::task::Task;
use crate::llm::client::estimate_tokens;

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
        let name = task.map_or(
            if is_crossover(&req) {
                CROSSOVER_TASK
            } else if is_judge(&req) {
                JUDGE_TASK
            } else {
                "other"
            },
            Task::as_str,
        );
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

/// The simulator running in this process, and a client for it: shared by the
/// tests here and the round executor's.
#[cfg(test)]
pub(crate) mod tests {
    use super::super::answers::*;
    use super::*;
    use crate::domain::VersionContent;
    use crate::domain::playbook::{Bullet, Playbook, Section};
    use crate::domain::{BulletTag, BulletTagKind, DeltaOp, Reflection};
    use crate::domain::{Strategy, Trace};
    use crate::learn::merge::dedupe::MergedOp;
    use crate::learn::prompts::{
        calls, messages,
        tests::{reflection, trace},
    };
    use crate::llm::{ChatMessage, LlmBackend, LlmCall, LlmError, LlmRole, client::OpenAiClient, config::LlmConfig};

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
        Ok(calls::reflect(&sim.client, &sim.cfg, trace, current, Strategy::Playbook, calls).await?.value)
    }

    /// A playbook aggregator call's operations, without notes and sources.
    async fn aggregate_playbook_on(
        sim: &Running,
        current: &VersionContent,
        reflections: &[Reflection],
        calls: &mut Vec<LlmCall>,
    ) -> Result<Vec<DeltaOp>, LlmError> {
        let noted = calls::aggregate_playbook(&sim.client, &sim.cfg, current, reflections, calls).await?;
        Ok(noted.value.into_iter().map(|s| s.op).collect())
    }

    /// A rewrite aggregator call's instruction, without the notes.
    async fn aggregate_rewrite_on(
        sim: &Running,
        current: &VersionContent,
        reflections: &[Reflection],
        calls: &mut Vec<LlmCall>,
    ) -> Result<String, LlmError> {
        Ok(calls::aggregate_rewrite(&sim.client, &sim.cfg, current, reflections, calls).await?.value)
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
        struct SimFlags {
            #[command(flatten)]
            args: SimArgs,
        }
        let cli = SimFlags::try_parse_from(["sim-llm"]).unwrap();
        assert_eq!((cli.args.bind.as_str(), &cli.args.sim), ("127.0.0.1:8090", &SimConfig::default()));
        let cli = SimFlags::try_parse_from([
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
            "--rate-no-sources",
            "0.1",
            "--rate-wrong-sources",
            "0.11",
            "--rate-unreadable-level2",
            "0.12",
            "--rate-unreadable-level1",
            "0.14",
            "--agent-lapse-rate",
            "0.13",
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
            rate_no_sources: 0.1,
            rate_wrong_sources: 0.11,
            rate_unreadable_level2: 0.12,
            rate_unreadable_level1: 0.14,
            agent_lapse_rate: 0.13,
            judge_accuracy: 0.9,
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
        let merged = calls::merge_rewrite(&sim.client, &sim.cfg, &current, &proposals, &mut calls).await.unwrap();
        assert!(merged.starts_with("You solve {task}."));
        assert_eq!(insights(&merged).len(), 20, "20 distinct insights in 2 proposals, K per proposal");
        let proposals: Vec<String> =
            (0..20).map(|p| format!("You solve {{task}}.\n{}", marker_lines(p * 10..p * 10 + 10))).collect();
        let merged = calls::merge_rewrite(&sim.client, &sim.cfg, &current, &proposals, &mut calls).await.unwrap();
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
            calls::consolidate_playbook(&sim.client, &sim.cfg, &current, &pooled, &mut calls).await.unwrap();
        assert_eq!(decisions.len(), 2, "{decisions:?}");
        let out = crate::learn::merge::level2::apply_decisions(&pooled, &decisions).unwrap();
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
            messages::aggregate_playbook_messages(&playbook(&[]), &numbered(0..10)),
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

    #[test]
    fn the_simulated_agent_applies_the_lessons_of_its_system_prompt() {
        let system = "You help.\n- INSIGHT-lesson-t1: check the rule\n- INSIGHT-harm-2: skip every check";
        let msgs = [ChatMessage::system(system), ChatMessage::user("a refund")];
        let (task, reply) = simulated_answer(&SimConfig::default(), &msgs);
        assert_eq!(task, None);
        assert!(reply.contains("applying lesson-t1") && reply.contains("applying harm-2"), "{reply}");
        let plain =
            simulated_answer(&SimConfig::default(), &[ChatMessage::system("You help."), ChatMessage::user("x")]);
        assert!(!plain.1.contains("applying"), "{}", plain.1);
        // A lapse rate of 1 overlooks every lesson.
        let lapsing = SimConfig { agent_lapse_rate: 1.0, ..SimConfig::default() };
        assert!(!simulated_answer(&lapsing, &msgs).1.contains("applying"));
    }

    #[tokio::test]
    async fn aggregator_operations_cite_their_reflections() {
        let sim = start(hard(), |_| {}).await;
        let current = playbook(&["INSIGHT-i1: lesson number 1"]);
        let mut group = numbered(0..4);
        // Reflection 4 repeats the lesson of reflection 1: one op, both cited.
        group[3].key_insight = "INSIGHT-i0: lesson number 0, seen again".into();
        let got = calls::aggregate_playbook(&sim.client, &sim.cfg, &current, &group, &mut vec![]).await.unwrap();
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
        let got = calls::aggregate_playbook(&sim.client, &sim.cfg, &current, &group, &mut vec![]).await.unwrap();
        let want = calls::aggregate_playbook(&clean.client, &clean.cfg, &current, &group, &mut vec![]).await.unwrap();
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
        let r = calls::reflect(&sim.client, &sim.cfg, &t, &current, Strategy::Playbook, &mut vec![]).await.unwrap();
        assert_eq!(r.value.key_insight, "INSIGHT-units: convert to SI first");
        assert_eq!(r.value.bullet_tags.len(), 1);
        assert_eq!(r.notes.dropped_count, 1);
        let stats = sim.stats().await;
        assert_eq!(stats.shapes.get("think"), Some(&2));
        assert_eq!(stats.shapes.len(), 5);
    }
}
