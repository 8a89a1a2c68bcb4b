//! The configurations compared (sequential, naive, Combee at fixed sizes,
//! combee-auto) and how one learns from the whole backlog, round after round,
//! measured against the simulator or modelled from its latency formula.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context as _;
use async_trait::async_trait;
use combee::{
    domain::{Feedback, PromptName, ReduceMode, Strategy, Trace, VersionContent},
    learn::{
        capacity::batch_size::{self, Quality, RoundSample},
        capacity::meter::{BucketCounts, MeterBucket},
        capacity::sizing::{GroupSize, choose_group_size},
        merge::budget::Budget,
        round::journal::MemoryJournal,
        round::{RoundSpec, run_round},
        shuffle::grouping::{self, Execution},
    },
    llm::{
        ChatRequest, ChatResponse, LlmBackend, LlmCall, LlmError, LlmRole, Usage, client::estimate_tokens,
        config::LlmConfig,
    },
    simulation::llm::{self as sim, SimConfig},
};
use serde_json::json;
use uuid::Uuid;

use crate::results::{Bill, RoundLog, RunResult, RunRow, Setup, Sizing};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Against the simulator over HTTP, timed with a wall clock.
    Measured,
    /// Against the in-process replay; times from the latency formula.
    Modelled,
}

pub(crate) struct Env {
    pub(crate) llm: LlmConfig,
    pub(crate) sim: SimConfig,
    pub(crate) http: Arc<dyn LlmBackend>,
    pub(crate) replay: Arc<dyn LlmBackend>,
    pub(crate) base: VersionContent,
    pub(crate) traces: Vec<Trace>,
}

/// The simulator's answers in process, at once; the latency it would have slept is only reported.
pub(crate) struct Replay {
    pub(crate) sim: SimConfig,
}

#[async_trait]
impl LlmBackend for Replay {
    async fn chat(&self, req: ChatRequest) -> Result<ChatResponse, LlmError> {
        let (_, content) = sim::simulated_answer(&self.sim, &req.messages);
        let usage = Usage {
            prompt_tokens: estimate_tokens(req.chars()),
            completion_tokens: estimate_tokens(content.chars().count()),
        };
        let latency = sim::latency_ms(&self.sim, usage.prompt_tokens, usage.completion_tokens);
        Ok(ChatResponse {
            content,
            model: "combee-sim-replay".into(),
            usage,
            cost_usd: 0.0,
            latency_ms: latency.round() as u64,
            retries: 0,
            output_format: None,
            concurrency_limit: None,
        })
    }
}

/// A round's critical path under the latency model: the reflector calls (the
/// map), then the level-1 aggregator calls (parallel) or every batch in turn
/// (sequential), each phase scheduled on `concurrency` slots (a call starts when
/// a slot frees; with at least as many slots as calls a phase is one wave, its
/// slowest call). Level 2 is a union here: no call.
fn modelled_round_secs(sim: &SimConfig, calls: &[LlmCall], execution: Execution, concurrency: usize) -> f64 {
    let latency = |c: &LlmCall| sim::latency_ms(sim, c.prompt_tokens, c.completion_tokens);
    let of = |role| calls.iter().filter(move |c| c.role == role).map(latency).collect::<Vec<f64>>();
    let map = makespan(&of(LlmRole::Reflector), concurrency);
    let reduce = match execution {
        Execution::Parallel => makespan(&of(LlmRole::Aggregator), concurrency),
        Execution::Sequential => of(LlmRole::Aggregator).iter().sum(),
    };
    (map + reduce) / 1000.0
}

/// When the last of `latencies` (in order) finishes on `slots` parallel slots.
fn makespan(latencies: &[f64], slots: usize) -> f64 {
    let mut free = vec![0.0f64; slots.clamp(1, latencies.len().max(1))];
    for &l in latencies {
        let (i, start) = free.iter().copied().enumerate().min_by(|a, b| a.1.total_cmp(&b.1)).unwrap_or((0, 0.0));
        free[i] = start + l;
    }
    free.into_iter().fold(0.0, f64::max)
}

pub(crate) fn insight_tokens(text: &str) -> BTreeSet<String> {
    text.split("INSIGHT-")
        .skip(1)
        .filter_map(|rest| rest.split(':').next())
        .filter(|t| !t.is_empty() && t.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-'))
        .map(str::to_owned)
        .collect()
}

/// Learns from the whole backlog with `setup`, round after round. Combee-auto
/// does what the worker does: the overload meter accumulates the rounds' own
/// readings (`outcome.meter`), the group size comes from it
/// (`sizing::choose_group_size`), and the controller (`batch_size::choose`)
/// picks each batch from the round times so far — all on the product defaults.
pub(crate) async fn learn(env: &Env, mode: Mode, setup: &Setup) -> anyhow::Result<RunResult> {
    learn_from(env, mode, setup, &env.traces, env.llm.max_concurrency).await
}

/// [`learn`] over `traces`, modelled round times scheduled on `concurrency` slots.
pub(crate) async fn learn_from(
    env: &Env,
    mode: Mode,
    setup: &Setup,
    traces: &[Trace],
    concurrency: usize,
) -> anyhow::Result<RunResult> {
    let backend = match mode {
        Mode::Measured => env.http.as_ref(),
        Mode::Modelled => env.replay.as_ref(),
    };
    let execution = grouping::plan(setup.method, 4, setup.p, 0).execution;
    let mut content = env.base.clone();
    let mut samples: Vec<RoundSample> = Vec::new();
    let mut meter: BTreeMap<u32, (BucketCounts, u64)> = BTreeMap::new();
    let mut rounds = Vec::new();
    let (mut calls, mut largest, mut largest_record) = (0, None, 0);
    let mut bill = Bill::default();
    let mut pos = 0;
    let started = Instant::now();
    while pos < traces.len() {
        let backlog = traces.len() - pos;
        let buckets: Vec<MeterBucket> = meter.iter().map(|(&s, &(c, r))| MeterBucket::new(s, c, r)).collect();
        let (bs, reason, group_size) = match &setup.sizing {
            Sizing::Fixed(bs) => ((*bs).clamp(1, backlog), None, GroupSize::default()),
            Sizing::Auto(cfg) => {
                let group_size = choose_group_size(&buckets, cfg.target_retention, setup.p >= 2);
                let quality = Quality::of(group_size.clone(), setup.p, true);
                let choice = batch_size::choose(&samples, backlog as u64, &quality, cfg);
                largest = largest.max(Some(choice.batch_size));
                let why = format!("{}; groups: {}", choice.reason.message(), group_size.message());
                (choice.batch_size.max(1) as usize, Some(why), group_size)
            }
        };
        let spec = RoundSpec {
            round_id: Uuid::now_v7(),
            seed: rounds.len() as u64 + 1,
            method: setup.method,
            strategy: Strategy::Playbook,
            duplication: setup.p,
            reduce: ReduceMode::Union,
            budget: Budget::default(),
            agent_reflections: combee::domain::AgentReflections::Use,
            denylist: Default::default(),
            group_size,
        };
        let journal = MemoryJournal::new();
        let t = Instant::now();
        let outcome = run_round(backend, &env.llm, &spec, &content, &traces[pos..pos + bs], &journal)
            .await
            .with_context(|| format!("{} round {} (bs {bs})", setup.label(), rounds.len() + 1))?;
        let secs = match mode {
            Mode::Measured => t.elapsed().as_secs_f64(),
            Mode::Modelled => modelled_round_secs(&env.sim, &outcome.calls, execution, concurrency),
        };
        calls += outcome.calls.len();
        // The token bill from what combee recorded of the calls (the journal), not from the outcome.
        bill.add(&journal.snapshot().calls);
        if let Some(reading) = &outcome.record.meter {
            for &(bucket, c) in &reading.buckets {
                let e = meter.entry(bucket).or_default();
                e.0.marked += c.marked;
                e.0.recaptured += c.recaptured;
                e.1 += 1;
            }
        }
        // What the round's record (`detail`) holds: the outcome and the group outputs.
        let record = serde_json::to_vec(&outcome.record).map_or(0, |v| v.len())
            + serde_json::to_vec(&outcome.group_outputs).map_or(0, |v| v.len());
        largest_record = largest_record.max(record);
        samples.push(RoundSample { batch_size: bs as u32, round_secs: secs });
        let groups = format!("k = {}, groups ≤ {}", outcome.k, outcome.grouping.largest_group);
        rounds.push(RoundLog { bs, secs, reason: reason.map(|r| format!("{groups} — {r}")) });
        content = outcome.content;
        pos += bs;
    }
    let total_secs = match mode {
        Mode::Measured => started.elapsed().as_secs_f64(),
        Mode::Modelled => rounds.iter().map(|r| r.secs).sum(),
    };
    let tokens: BTreeSet<String> =
        traces.iter().flat_map(|t| insight_tokens(&t.feedback.comment.clone().unwrap_or_default())).collect();
    let kept = insight_tokens(&content.render()).intersection(&tokens).count();
    Ok(RunResult { rounds, total_secs, kept, calls, largest, largest_record, bill, content })
}

pub(crate) fn traces(n: usize) -> anyhow::Result<(Vec<Trace>, BTreeSet<String>)> {
    traces_from(0, n)
}

/// `n` traces numbered from `start`, each with its own marker (`INSIGHT-t<number>`).
pub(crate) fn traces_from(start: usize, n: usize) -> anyhow::Result<(Vec<Trace>, BTreeSet<String>)> {
    let prompt = PromptName::new("default", "bench-learn")?;
    let traces: Vec<Trace> = (start..start + n)
        .map(|i| {
            let feedback = Feedback {
                success: Some(!i.is_multiple_of(3)),
                comment: Some(format!("INSIGHT-t{i:03}: check field {i} before answering")),
                ..Default::default()
            };
            Trace::pending(
                prompt.clone(),
                json!({"task": format!("task {i}")}),
                json!([{"role": "assistant", "content": format!("worked on task {i}")}]),
                json!(format!("answer {i}")),
                feedback,
            )
        })
        .collect();
    let tokens = (start..start + n).map(|i| format!("t{i:03}")).collect();
    Ok((traces, tokens))
}

/// Prompt and completion tokens the simulator at `base_url` (…/v1) has served so far, by its own count.
pub(crate) async fn served(base_url: &str) -> anyhow::Result<(u64, u64)> {
    let stats: combee::simulation::llm::SimStats =
        reqwest::get(format!("{base_url}/sim/stats")).await?.error_for_status()?.json().await?;
    Ok((stats.prompt_tokens, stats.completion_tokens))
}

/// One configuration's row: modelled, then (unless `model_only`) measured
/// against the simulator at `base_url`, with the tokens the simulator counted
/// as served meanwhile.
pub(crate) async fn run_setup(
    env: &Env,
    base_url: &str,
    model_only: bool,
    name: &str,
    setup: Setup,
) -> anyhow::Result<RunRow> {
    let modelled = learn(env, Mode::Modelled, &setup).await?;
    let (measured, served) = if model_only {
        (None, None)
    } else {
        eprintln!("  [{name}] running {} …", setup.label());
        let before = served(base_url).await?;
        let measured = learn(env, Mode::Measured, &setup).await?;
        let after = served(base_url).await?;
        (Some(measured), Some((after.0 - before.0, after.1 - before.1)))
    };
    Ok(RunRow { setup, measured, modelled, served })
}

#[cfg(test)]
mod tests {
    use combee::{domain::Method, llm::client::OpenAiClient, simulation::llm::LocalSim};

    use super::*;
    use crate::results::Family;

    /// The bill is what combee recorded of its calls, and that is what the
    /// simulator (a real HTTP server on a port) counted as served.
    #[tokio::test]
    async fn the_bill_is_what_the_simulator_served() {
        let sim =
            SimConfig { fixed_ms: 0.0, per_input_token_ms: 0.0, per_output_token_ms: 0.0, ..SimConfig::default() };
        let local = LocalSim::start(sim.clone()).await.unwrap();
        let llm = LlmConfig { base_url: local.base_url.clone(), ..LlmConfig::default() };
        let (traces, _) = traces(12).unwrap();
        let env = Env {
            http: Arc::new(OpenAiClient::new(llm.clone()).unwrap()),
            replay: Arc::new(Replay { sim: sim.clone() }),
            llm,
            sim,
            base: VersionContent { base: "You are a test agent.".into(), playbook: None },
            traces,
        };
        let setups = [
            Setup { family: Family::Sequential, method: Method::Sequential, p: 1, sizing: Sizing::Fixed(3) },
            Setup { family: Family::Combee, method: Method::Combee, p: 2, sizing: Sizing::Fixed(12) },
        ];
        for setup in setups {
            let before = served(&local.base_url).await.unwrap();
            let r = learn(&env, Mode::Measured, &setup).await.unwrap();
            let after = served(&local.base_url).await.unwrap();
            let t = r.bill.total();
            assert_eq!((t.prompt, t.completion), (after.0 - before.0, after.1 - before.1), "{}", setup.label());
            assert_eq!(t.calls as usize, r.calls, "{}", setup.label());
            assert_eq!(r.bill.reflector.calls, 12, "{}: one reflection per trace", setup.label());
            assert!(r.bill.aggregator.calls > 0 && t.prompt > 0 && t.completion > 0, "{}", setup.label());
        }
    }
}
