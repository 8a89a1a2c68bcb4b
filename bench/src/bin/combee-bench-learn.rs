//! Learning-speed benchmark: how long it takes to learn from a backlog of N
//! traces, and how much of what the traces teach survives, for the sequential
//! baseline, naive batching, Combee at fixed batch sizes and Combee with the
//! dynamic batch-size controller — the paper's quality-vs-delay comparison,
//! against the OpenAI-compatible simulator (a SIMULATED LLM, not a model).
//!
//! Learning from a backlog means rounds one after another, each starting from
//! the version the previous round published, until all N traces are consumed.
//! Every trace carries one distinct `INSIGHT-<token>` marker; retention is the
//! share of the N markers present in the final rendered prompt.
//!
//! Every configuration is run twice: once against the simulator over HTTP and
//! timed with a wall clock (measured), and once against an in-process replay of
//! the simulator's answers that returns at once, where a round's time is the
//! simulator's latency formula applied to the token counts of the calls on its
//! critical path (modelled: no timing, no overhead). The controller sees
//! measured round times in the first and modelled ones in the second.
//!
//!     scripts/bench-learn            # builds --release, writes bench/results/learn.*

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context as _;
use async_trait::async_trait;
use clap::Parser;
use combee::{
    domain::{Feedback, Method, PromptName, ReduceMode, Strategy, Trace, VersionContent},
    learn::{
        capacity::batch_size::{self, ControllerConfig, Quality, Sample},
        capacity::meter::{self, BucketCounts, MeterBucket},
        capacity::sizing::{GroupSize, choose_group_size},
        merge::budget::Budget,
        round::journal::MemoryJournal,
        round::{RoundSpec, run_round},
        shuffle::grouping::{self, Execution},
    },
    llm::{
        ChatRequest, ChatResponse, LlmBackend, LlmCall, LlmError, LlmRole, Usage,
        client::{OpenAiClient, estimate_tokens},
        config::LlmConfig,
    },
    simulation::llm::{self as sim, CapacityModel, SimConfig},
};
use serde_json::json;
use uuid::Uuid;

#[derive(Parser)]
struct Args {
    /// Traces in the backlog, N.
    #[arg(long, default_value_t = 300)]
    n: usize,
    /// Fixed batch sizes for naive and Combee.
    #[arg(long, value_delimiter = ',', default_value = "10,25,50,100,150,300")]
    sizes: Vec<usize>,
    /// Simulator latency: fixed part of every call, in ms.
    #[arg(long, default_value_t = 250.0)]
    fixed_ms: f64,
    /// Simulator latency per prompt token, in ms.
    #[arg(long, default_value_t = 0.015)]
    per_input_token_ms: f64,
    /// Simulator latency per completion token, in ms.
    #[arg(long, default_value_t = 0.15)]
    per_output_token_ms: f64,
    /// Simulator capacity K: distinct new insights one aggregating call keeps.
    #[arg(long, default_value_t = 12)]
    capacity_k: usize,
    /// Simulator digest D: reflections a call digests fully (hard capacity model only).
    #[arg(long, default_value_t = 12)]
    digest: usize,
    /// Simulator capacity models, each a full sweep: `hard` (at most K per call, fewer beyond D)
    /// and/or `soft` (each of the m new insights a call writes kept with probability E(m)/m).
    /// The level-2 section always uses `soft`.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "hard,soft")]
    capacity_models: Vec<CapacityModel>,
    /// Level-2 section: traces in its one round (n) — union, `reduce = "llm"` and rewrite at p = 2.
    #[arg(long, default_value_t = 100)]
    level2_n: usize,
    /// Level-2 section: round seeds to average over.
    #[arg(long, default_value_t = 5)]
    level2_seeds: u64,
    /// Only run the level-2 section (a few seconds).
    #[arg(long)]
    level2_only: bool,
    /// The client's LLM concurrency limit (at least 2·N, so a map and a level 1 are one wave each).
    #[arg(long, default_value_t = 1024)]
    concurrency: usize,
    /// Tuned rows, labelled as such: Combee at p = 1 (the paper's ⌊√n⌋ groups) at these sizes (empty: none).
    #[arg(long, value_delimiter = ',', default_value = "100")]
    tuned_sizes: Vec<usize>,
    /// Also run Method::Sequential over all N in one round (map in parallel, then N/3 batches in order).
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set)]
    with_one_round_sequential: bool,
    /// Overload-meter section: traces per round.
    #[arg(long, default_value_t = 100)]
    meter_n: usize,
    /// Overload-meter section: round seeds per group size.
    #[arg(long, default_value_t = 3)]
    meter_seeds: u64,
    /// Also run a model that never cites its sources right (the soft capacity model;
    /// each aggregator answer cites nothing or cites the wrong reflections, see the
    /// two rates below): sequential, combee-auto and the meter's text reading.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    non_citing: bool,
    /// The non-citing model: share of aggregator answers without `sources`.
    #[arg(long, default_value_t = 0.5)]
    non_citing_absent: f64,
    /// The non-citing model: share of aggregator answers whose `sources` are wrong (the rest).
    #[arg(long, default_value_t = 0.5)]
    non_citing_wrong: f64,
    /// The max_batch section: backlog N for it (modelled only, soft capacity model).
    #[arg(long, default_value_t = 2048)]
    max_batch_n: usize,
    /// The max_batch section: the ceilings compared.
    #[arg(long, value_delimiter = ',', default_value = "64,128,256,512,1024,2048")]
    max_batches: Vec<u32>,
    /// The max_batch section: client concurrency limits compared (64 is `llm.max_concurrency`'s default).
    #[arg(long, value_delimiter = ',', default_value = "64,1024")]
    max_batch_concurrency: Vec<usize>,
    /// Only compute the modelled figures (no waiting, no files).
    #[arg(long)]
    model_only: bool,
    /// Where learn.md, learn.csv and the SVGs go.
    #[arg(long, default_value = "bench/results")]
    out_dir: PathBuf,
}

// ---------------------------------------------------------------------------
// Configurations and runs

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Family {
    Sequential,
    SequentialOneRound,
    Naive,
    Combee,
    CombeeTuned,
    CombeeAuto,
}

impl Family {
    fn name(self) -> &'static str {
        match self {
            Self::Sequential => "sequential",
            Self::SequentialOneRound => "sequential, one round",
            Self::Naive => "naive",
            Self::Combee => "combee",
            Self::CombeeTuned => "combee p=1 (tuned)",
            Self::CombeeAuto => "combee-auto",
        }
    }
}

#[derive(Debug, Clone)]
enum Sizing {
    Fixed(usize),
    Auto(ControllerConfig),
}

#[derive(Debug, Clone)]
struct Setup {
    family: Family,
    method: Method,
    p: u32,
    sizing: Sizing,
}

impl Setup {
    fn label(&self) -> String {
        match (&self.sizing, self.family) {
            (Sizing::Fixed(bs), Family::Sequential) => format!("sequential (rounds of {bs})"),
            (Sizing::Fixed(bs), Family::Naive | Family::Combee | Family::CombeeTuned) => {
                format!("{} bs={bs}", self.family.name())
            }
            _ => self.family.name().to_owned(),
        }
    }
}

#[derive(Debug, Clone)]
struct RoundLog {
    bs: usize,
    secs: f64,
    reason: Option<String>,
}

#[derive(Debug, Clone)]
struct RunResult {
    rounds: Vec<RoundLog>,
    total_secs: f64,
    kept: usize,
    calls: usize,
    /// Combee-auto: the largest batch it took.
    largest: Option<u32>,
    /// Bytes of the largest round's record (outcome and group outputs, as JSON).
    largest_record: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Against the simulator over HTTP, timed with a wall clock.
    Measured,
    /// Against the in-process replay; times from the latency formula.
    Modelled,
}

struct Env {
    llm: LlmConfig,
    sim: SimConfig,
    http: Arc<dyn LlmBackend>,
    replay: Arc<dyn LlmBackend>,
    base: VersionContent,
    traces: Vec<Trace>,
}

/// The simulator's answers in process, at once; the latency it would have slept is only reported.
struct Replay {
    sim: SimConfig,
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

fn insight_tokens(text: &str) -> BTreeSet<String> {
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
async fn learn(env: &Env, mode: Mode, setup: &Setup) -> anyhow::Result<RunResult> {
    learn_from(env, mode, setup, &env.traces, env.llm.max_concurrency).await
}

/// [`learn`] over `traces`, modelled round times scheduled on `concurrency` slots.
async fn learn_from(
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
    let mut samples: Vec<Sample> = Vec::new();
    let mut meter: BTreeMap<u32, (BucketCounts, u64)> = BTreeMap::new();
    let mut rounds = Vec::new();
    let (mut calls, mut largest, mut largest_record) = (0, None, 0);
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
        samples.push(Sample { batch_size: bs as u32, round_secs: secs });
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
    Ok(RunResult { rounds, total_secs, kept, calls, largest, largest_record })
}

/// The overload meter against the truth, per group size: Combee rounds of
/// `n` traces at p = 2 with groups bounded at each size, the meter's estimate
/// from the answers' cited sources (as the product makes it) next to the true
/// per-group retention from the markers (which the product never reads).
/// Against the in-process replay of the simulator (same answers, no waiting).
async fn meter_section(env: &Env, n: usize, seeds: u64) -> anyhow::Result<(String, bool)> {
    let mut est: BTreeMap<u32, BucketCounts> = BTreeMap::new();
    // Answers read by their citations, by text for want of citations, by text for implausible ones.
    let mut read = (0usize, 0usize, 0usize);
    let mut truth: BTreeMap<u32, (usize, usize)> = BTreeMap::new();
    let markers: std::collections::HashMap<Uuid, String> =
        env.traces.iter().map(|t| (t.id, t.feedback.comment.clone().unwrap_or_default())).collect();
    for max_group in [1usize, 2, 3, 4, 6, 8, 12, 16, 24, 32] {
        for seed in 1..=seeds {
            let spec = RoundSpec {
                round_id: Uuid::now_v7(),
                seed: seed * 1000 + max_group as u64,
                method: Method::Combee,
                strategy: Strategy::Playbook,
                duplication: 2,
                reduce: ReduceMode::Union,
                budget: Budget::default(),
                agent_reflections: combee::domain::AgentReflections::Use,
                denylist: Default::default(),
                group_size: GroupSize { max_group: Some(max_group), ..GroupSize::default() },
            };
            let outcome =
                run_round(env.replay.as_ref(), &env.llm, &spec, &env.base, &env.traces[..n], &MemoryJournal::new())
                    .await?;
            if let Some(m) = &outcome.record.meter {
                read.0 += m.by_sources;
                read.1 += m.missing_sources;
                read.2 += m.implausible_sources;
            }
            for &(b, c) in outcome.record.meter.iter().flat_map(|m| &m.buckets) {
                let e = est.entry(b).or_default();
                e.marked += c.marked;
                e.recaptured += c.recaptured;
            }
            for g in &outcome.group_outputs {
                let given: BTreeSet<String> = g.traces.iter().flat_map(|t| insight_tokens(&markers[t])).collect();
                let kept = insight_tokens(&g.output.to_string());
                let e = truth.entry(meter::bucket_of(g.traces.len())).or_default();
                e.0 += given.intersection(&kept).count();
                e.1 += given.len();
            }
        }
    }
    let mut out = format!(
        "Answers read: {} by their citations, {} by text (no sources), {} by text (implausible citations).\n\n\
         | group size | meter estimate | samples (marked copies) | true retention (markers) | difference |\n|---|---|---|---|---|\n",
        read.0, read.1, read.2
    );
    let mut ok = true;
    for (b, c) in &est {
        let Some(e) = c.estimate() else { continue };
        let (kept, given) = truth.get(b).copied().unwrap_or_default();
        let t = if given == 0 { f64::NAN } else { kept as f64 / given as f64 };
        let diff = 100.0 * (e - t);
        let counted = c.marked >= 100;
        if counted {
            ok &= diff.abs() <= 10.0;
        }
        let _ = writeln!(
            out,
            "| {}–{} | {:.1}% | {} | {:.1}% ({kept}/{given}) | {:+.1} points{} |",
            b,
            meter::bucket_max(*b),
            100.0 * e,
            c.marked,
            100.0 * t,
            diff,
            if counted { "" } else { " (under 100 samples: not judged)" }
        );
    }
    Ok((out, ok))
}

fn traces(n: usize) -> anyhow::Result<(Vec<Trace>, BTreeSet<String>)> {
    let prompt = PromptName::parse("bench-learn")?;
    let traces: Vec<Trace> = (0..n)
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
    let tokens = (0..n).map(|i| format!("t{i:03}")).collect();
    Ok((traces, tokens))
}

// ---------------------------------------------------------------------------
// The benchmark

struct Row {
    setup: Setup,
    measured: Option<RunResult>,
    modelled: RunResult,
}

impl Row {
    fn result(&self) -> &RunResult {
        self.measured.as_ref().unwrap_or(&self.modelled)
    }
}

// ---------------------------------------------------------------------------
// Level 2 under the soft capacity model

/// One level-2 configuration of the section.
struct Level2Row {
    label: &'static str,
    strategy: Strategy,
    reduce: ReduceMode,
    /// Per seed: insights kept, LLM calls, level-2 calls, wall seconds.
    runs: Vec<(usize, usize, usize, f64)>,
}

/// One Combee round of `n` traces at p = 2 per configuration and seed, against a
/// simulator with the soft capacity model: how much level 2 keeps of what the
/// groups learned. Union is the reference (no level-2 call); `reduce = "llm"`
/// consolidates by decisions; rewrite merges the groups' instructions against
/// the base. Returns the Markdown section and whether the target holds.
async fn level2_section(args: &Args) -> anyhow::Result<(String, bool)> {
    let sim_cfg = SimConfig {
        capacity_model: CapacityModel::Soft,
        capacity_k: args.capacity_k,
        digest_reflections: args.digest,
        fixed_ms: args.fixed_ms,
        per_input_token_ms: args.per_input_token_ms,
        per_output_token_ms: args.per_output_token_ms,
        ..SimConfig::default()
    };
    let local = sim::LocalSim::start(sim_cfg.clone()).await?;
    let llm = LlmConfig {
        base_url: local.base_url.clone(),
        max_concurrency: args.concurrency.max(args.level2_n),
        ..LlmConfig::default()
    };
    let backend: Arc<dyn LlmBackend> = if args.model_only {
        Arc::new(Replay { sim: sim_cfg.clone() })
    } else {
        Arc::new(OpenAiClient::new(llm.clone())?)
    };
    let (traces, tokens) = traces(args.level2_n)?;
    let base = VersionContent { base: "You are a benchmark agent. Answer the task.".into(), playbook: None };
    let mut rows = vec![
        Level2Row {
            label: "playbook, reduce = union",
            strategy: Strategy::Playbook,
            reduce: ReduceMode::Union,
            runs: vec![],
        },
        Level2Row {
            label: "playbook, reduce = llm (decisions)",
            strategy: Strategy::Playbook,
            reduce: ReduceMode::Llm,
            runs: vec![],
        },
        Level2Row {
            label: "rewrite (structural merge)",
            strategy: Strategy::Rewrite,
            reduce: ReduceMode::Union,
            runs: vec![],
        },
    ];
    for row in &mut rows {
        for seed in 1..=args.level2_seeds.max(1) {
            let spec = RoundSpec {
                round_id: Uuid::now_v7(),
                seed,
                method: Method::Combee,
                strategy: row.strategy,
                duplication: 2,
                reduce: row.reduce,
                budget: Budget::default(),
                agent_reflections: combee::domain::AgentReflections::Use,
                denylist: Default::default(),
                group_size: Default::default(),
            };
            let t = Instant::now();
            let outcome = run_round(backend.as_ref(), &llm, &spec, &base, &traces, &MemoryJournal::new())
                .await
                .with_context(|| format!("level-2 section: {} seed {seed}", row.label))?;
            let kept = insight_tokens(&outcome.content.render()).intersection(&tokens).count();
            row.runs.push((kept, outcome.calls.len(), outcome.level2.consolidation_calls, t.elapsed().as_secs_f64()));
        }
    }
    let mean = |r: &Level2Row| r.runs.iter().map(|x| x.0 as f64).sum::<f64>() / r.runs.len() as f64;
    let union = mean(&rows[0]);
    let n = args.level2_n;
    let mut out = format!(
        "### Level 2 under the soft capacity model (simulated LLM)\n\nOne Combee round of n = {n} traces, p = 2, \
         k = {} groups, simulator capacity model `soft` (each of the m new insights a call must write kept with \
         probability E(m)/m, E(m) = {}·(1 − e^(−m/{}))), round seeds 1–{}; {}. Retention = insights of the {n} \
         traces in the published prompt.\n\n\
         | configuration | LLM calls per round | level-2 calls per round | wall per round (s) | retention, mean (min–max) | of union's |\n\
         |---|---|---|---|---|---|\n",
        grouping::combee_group_count(n),
        args.capacity_k,
        args.capacity_k,
        args.level2_seeds.max(1),
        if args.model_only { "in-process replay of the simulator" } else { "simulator over HTTP" },
    );
    let mut ok = true;
    for (i, r) in rows.iter().enumerate() {
        let runs = r.runs.len() as f64;
        let m = mean(r);
        let (lo, hi) = r.runs.iter().fold((usize::MAX, 0), |(lo, hi), x| (lo.min(x.0), hi.max(x.0)));
        let share = if union > 0.0 { m / union } else { 0.0 };
        if i > 0 {
            ok &= share >= 0.9;
        }
        let _ = writeln!(
            out,
            "| {} | {:.1} | {:.1} | {:.2} | {:.1}% ({lo}–{hi} of {n}) | {:.1}% |",
            r.label,
            r.runs.iter().map(|x| x.1 as f64).sum::<f64>() / runs,
            r.runs.iter().map(|x| x.2 as f64).sum::<f64>() / runs,
            r.runs.iter().map(|x| x.3).sum::<f64>() / runs,
            100.0 * m / n as f64,
            100.0 * share,
        );
    }
    let _ = writeln!(
        out,
        "\n- `reduce = \"llm\"` and rewrite keep ≥ 90% of what union keeps (n = {n}, p = 2, soft): {}\n",
        pass(ok)
    );
    Ok((out, ok))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    anyhow::ensure!(args.n >= 3, "--n must be at least 3");
    anyhow::ensure!(args.level2_n >= 4, "--level2-n must be at least 4");
    eprintln!("  level 2 under the soft capacity model …");
    let (level2, _) = level2_section(&args).await?;
    if args.level2_only {
        print!("{level2}");
        return Ok(());
    }
    let total = Instant::now();
    let mut md = String::new();
    let mut csv = String::new();
    let mut svgs = Vec::new();
    let mut runs: Vec<(CapacityModel, bool)> = args.capacity_models.iter().map(|&m| (m, true)).collect();
    if args.non_citing {
        runs.push((CapacityModel::Soft, false));
    }
    for (model, citing) in runs {
        let (report_md, report_csv, svg) = one_model(&args, model, citing).await?;
        md.push_str(&report_md);
        md.push('\n');
        if csv.is_empty() {
            csv.push_str(&report_csv);
        } else {
            csv.extend(report_csv.lines().skip(1).map(|l| format!("{l}\n")));
        }
        if citing {
            svgs.push((model, svg));
        }
    }
    eprintln!("  max_batch, modelled …");
    md.push_str(&max_batch_section(&args).await?);
    md.push('\n');
    md.push_str(&level2);
    let _ = writeln!(md, "\nWhole benchmark: {:.0} s on {} cores.", total.elapsed().as_secs_f64(), cores());
    print!("{md}");
    if !args.model_only {
        std::fs::create_dir_all(&args.out_dir)?;
        std::fs::write(args.out_dir.join("learn.md"), &md)?;
        std::fs::write(args.out_dir.join("learn.csv"), csv)?;
        for (model, svg) in svgs {
            std::fs::write(args.out_dir.join(format!("learn-quality-delay-{}.svg", model_name(model))), svg)?;
        }
        eprintln!("wrote {}/learn.{{md,csv}}, learn-quality-delay-{{hard,soft}}.svg", args.out_dir.display());
    }
    Ok(())
}

fn cores() -> usize {
    std::thread::available_parallelism().map_or(0, |n| n.get())
}

fn model_name(m: CapacityModel) -> &'static str {
    match m {
        CapacityModel::Hard => "hard",
        CapacityModel::Soft => "soft",
    }
}

/// The model's name in headings: its capacity model, and whether it cites its sources.
fn model_label(sim: &SimConfig) -> String {
    if non_citing(sim) {
        format!(
            "{}, non-citing ({:.0}% of answers without sources, {:.0}% citing the wrong reflections)",
            model_name(sim.capacity_model),
            100.0 * sim.rate_no_sources,
            100.0 * sim.rate_wrong_sources
        )
    } else {
        model_name(sim.capacity_model).to_owned()
    }
}

/// Whether this simulated model never cites its sources right.
fn non_citing(sim: &SimConfig) -> bool {
    sim.rate_no_sources + sim.rate_wrong_sources >= 1.0 - 1e-9
}

/// Every configuration under one capacity model: the Markdown section, CSV rows,
/// SVG. A model that does not cite (`citing` false: its aggregator answers carry
/// no `sources`) runs only sequential, combee-auto and the meter's reading.
async fn one_model(args: &Args, model: CapacityModel, citing: bool) -> anyhow::Result<(String, String, String)> {
    let sim_cfg = SimConfig {
        rate_no_sources: if citing { 0.0 } else { args.non_citing_absent },
        rate_wrong_sources: if citing { 0.0 } else { args.non_citing_wrong },
        capacity_model: model,
        capacity_k: args.capacity_k,
        digest_reflections: args.digest,
        fixed_ms: args.fixed_ms,
        per_input_token_ms: args.per_input_token_ms,
        per_output_token_ms: args.per_output_token_ms,
        ..SimConfig::default()
    };
    let local_sim = sim::LocalSim::start(sim_cfg.clone()).await?;
    let llm = LlmConfig {
        base_url: local_sim.base_url.clone(),
        max_concurrency: args.concurrency.max(2 * args.n),
        ..LlmConfig::default()
    };
    let (traces, _) = traces(args.n)?;
    let env = Env {
        http: Arc::new(OpenAiClient::new(llm.clone())?),
        replay: Arc::new(Replay { sim: sim_cfg.clone() }),
        llm,
        sim: sim_cfg.clone(),
        base: VersionContent { base: "You are a benchmark agent. Answer the task.".into(), playbook: None },
        traces,
    };
    // The product defaults: p = 2 (the prompt default) and `ControllerConfig::default()`.
    let p = 2;
    let auto_cfg = ControllerConfig::default();
    let fixed = |family, method, p, bs| Setup { family, method, p, sizing: Sizing::Fixed(bs) };
    let mut setups = vec![
        fixed(Family::Sequential, Method::Sequential, 1, grouping::SEQUENTIAL_BATCH),
        Setup { family: Family::CombeeAuto, method: Method::Combee, p, sizing: Sizing::Auto(auto_cfg.clone()) },
    ];
    if args.with_one_round_sequential {
        setups.push(fixed(Family::SequentialOneRound, Method::Sequential, 1, args.n));
    }
    let mut rows: Vec<Row> = Vec::new();
    let started = Instant::now();
    let name = model_label(&sim_cfg);
    let run = |setup: Setup| {
        let name = name.clone();
        let env = &env;
        let model_only = args.model_only;
        async move {
            let modelled = learn(env, Mode::Modelled, &setup).await?;
            let measured = if model_only {
                None
            } else {
                eprintln!("  [{name}] running {} …", setup.label());
                Some(learn(env, Mode::Measured, &setup).await?)
            };
            anyhow::Ok(Row { setup, measured, modelled })
        }
    };
    for setup in setups {
        rows.push(run(setup).await?);
    }
    // Naive at the largest batch combee-auto took, too (a citing model's full sweep).
    let auto_largest = citing.then_some(()).and_then(|()| {
        rows.iter().find(|r| r.setup.family == Family::CombeeAuto).and_then(|r| r.result().largest).map(|t| t as usize)
    });
    let mut sizes = if citing { args.sizes.clone() } else { Vec::new() };
    sizes.extend(auto_largest);
    sizes.sort_unstable();
    sizes.dedup();
    sizes.retain(|&bs| bs >= 1 && bs <= args.n);
    for &bs in &sizes {
        rows.push(run(fixed(Family::Naive, Method::Naive, 1, bs)).await?);
    }
    for &bs in &sizes {
        rows.push(run(fixed(Family::Combee, Method::Combee, p, bs)).await?);
    }
    for &bs in args.tuned_sizes.iter().filter(|_| citing) {
        rows.push(run(fixed(Family::CombeeTuned, Method::Combee, 1, bs)).await?);
    }
    eprintln!("  [{name}] overload meter vs markers …");
    let meter = meter_section(&env, args.meter_n.min(args.n), args.meter_seeds).await?;
    let bench_secs = started.elapsed().as_secs_f64();
    let report = Report { args, sim: &sim_cfg, auto_cfg: &auto_cfg, rows: &rows, bench_secs, meter };
    Ok((report.markdown(), report.csv(), report.quality_delay_svg()))
}

/// Why `controller.max_batch` is what it is, measured (modelled: the replay of
/// the soft simulator, no waiting): the time to learn a backlog of
/// `--max-batch-n` traces with combee-auto on the product defaults but for the
/// ceiling, at the product's client concurrency (`llm.max_concurrency` = 64)
/// and at a large one, with the largest round's record size (what the store
/// keeps and `GET /v1/rounds/{id}` returns).
async fn max_batch_section(args: &Args) -> anyhow::Result<String> {
    let sim_cfg = SimConfig {
        capacity_model: CapacityModel::Soft,
        capacity_k: args.capacity_k,
        fixed_ms: args.fixed_ms,
        per_input_token_ms: args.per_input_token_ms,
        per_output_token_ms: args.per_output_token_ms,
        ..SimConfig::default()
    };
    let (traces, _) = traces(args.max_batch_n)?;
    let replay: Arc<dyn LlmBackend> = Arc::new(Replay { sim: sim_cfg.clone() });
    let llm = LlmConfig { max_concurrency: 4096, ..LlmConfig::default() };
    let env = Env {
        http: replay.clone(),
        replay,
        llm,
        sim: sim_cfg,
        base: VersionContent { base: "You are a benchmark agent. Answer the task.".into(), playbook: None },
        traces,
    };
    let mut out = format!(
        "## max_batch: time to learn N = {} traces by the ceiling (modelled, soft capacity model, simulated LLM)\n\n\
         combee-auto on the product defaults except `max_batch`; round times from the latency formula with each \
         phase's calls scheduled on the client's concurrency limit (64 is `llm.max_concurrency`'s default). \
         Record = the largest round's `detail` (outcome and group outputs) as JSON.\n\n\
         | max_batch | concurrency | rounds | time to learn (s) | retention | largest round record (KiB) |\n|---|---|---|---|---|---|\n",
        args.max_batch_n
    );
    for &concurrency in &args.max_batch_concurrency {
        for &max_batch in &args.max_batches {
            let cfg = ControllerConfig { max_batch, ..ControllerConfig::default() };
            let setup = Setup { family: Family::CombeeAuto, method: Method::Combee, p: 2, sizing: Sizing::Auto(cfg) };
            let r = learn_from(&env, Mode::Modelled, &setup, &env.traces, concurrency).await?;
            let _ = writeln!(
                out,
                "| {max_batch} | {concurrency} | {} | {:.1} | {:.1}% | {:.0} |",
                r.rounds.len(),
                r.total_secs,
                100.0 * r.kept as f64 / args.max_batch_n as f64,
                r.largest_record as f64 / 1024.0
            );
        }
    }
    Ok(out)
}

// ---------------------------------------------------------------------------
// Report: Markdown, CSV

struct Report<'a> {
    args: &'a Args,
    sim: &'a SimConfig,
    auto_cfg: &'a ControllerConfig,
    rows: &'a [Row],
    bench_secs: f64,
    /// The overload meter against the markers: the table and whether every judged size is within ±10 points.
    meter: (String, bool),
}

fn pass(ok: bool) -> &'static str {
    if ok { "PASS" } else { "FAIL" }
}

fn sizes_text(r: &RunResult) -> String {
    let sizes: Vec<usize> = r.rounds.iter().map(|x| x.bs).collect();
    match sizes.as_slice() {
        [] => String::new(),
        [first, ..] if sizes.len() > 6 && sizes[..sizes.len() - 1].iter().all(|s| s == first) => {
            let last = sizes[sizes.len() - 1];
            if last == *first {
                format!("{first} ×{}", sizes.len())
            } else {
                format!("{first} ×{}, {last}", sizes.len() - 1)
            }
        }
        _ if sizes.len() > 12 => {
            let head: Vec<String> = sizes[..5].iter().map(ToString::to_string).collect();
            let tail: Vec<String> = sizes[sizes.len() - 2..].iter().map(ToString::to_string).collect();
            format!("{}, …, {} ({} rounds)", head.join(", "), tail.join(", "), sizes.len())
        }
        _ => sizes.iter().map(ToString::to_string).collect::<Vec<_>>().join(", "),
    }
}

impl Report<'_> {
    fn n(&self) -> usize {
        self.args.n
    }

    fn row(&self, family: Family) -> Option<&Row> {
        self.rows.iter().find(|r| r.setup.family == family)
    }

    fn fixed(&self, family: Family, bs: usize) -> Option<&Row> {
        self.rows.iter().find(|r| r.setup.family == family && matches!(r.setup.sizing, Sizing::Fixed(b) if b == bs))
    }

    fn retention(&self, r: &RunResult) -> f64 {
        r.kept as f64 / self.n() as f64
    }

    fn seq_secs(&self, measured: bool) -> f64 {
        self.row(Family::Sequential)
            .map(|r| if measured { r.result().total_secs } else { r.modelled.total_secs })
            .unwrap_or(f64::NAN)
    }

    fn settings(&self) -> String {
        let s = self.sim;
        let c = self.auto_cfg;
        format!(
            "**Simulated LLM** (combee's OpenAI-compatible simulator, not a language model), over HTTP in the same process:\n\
             latency per call = {} ms + {} ms × prompt tokens + {} ms × completion tokens (tokens = characters / 4); \
             {}; no faults. Client concurrency limit {}. Strategy playbook, level-2 reduce = union (no LLM call). \
             N = {} traces, each with one distinct `INSIGHT-<token>` marker; retention = share of the N markers in \
             the final rendered prompt. **Product defaults** for Combee and combee-auto: p = 2, \
             `ControllerConfig::default()` (min_batch {}, max_batch {}, max_round_secs {}, target_retention {}), \
             group size from the overload meter (groups of 4 until it has measured a round). \
             Machine: {} cores. This model's runs (measured and modelled): {:.0} s.\n",
            s.fixed_ms,
            s.per_input_token_ms,
            s.per_output_token_ms,
            match s.capacity_model {
                CapacityModel::Hard => format!(
                    "capacity model **hard**: K = {} distinct new insights per aggregating call, max(1, ⌊K·D/n⌋) \
                     when a call gets n > D = {} reflections",
                    s.capacity_k, s.digest_reflections
                ),
                CapacityModel::Soft => format!(
                    "capacity model **soft**: each of the m new insights a call must write kept with probability \
                     E(m)/m, E(m) = {k}·(1 − e^(−m/{k}))",
                    k = s.capacity_k
                ),
            },
            self.args.concurrency.max(2 * self.n()),
            self.n(),
            c.min_batch,
            c.max_batch,
            c.max_round_secs,
            c.target_retention,
            cores(),
            self.bench_secs,
        )
    }

    fn markdown(&self) -> String {
        let mut out = String::new();
        let n = self.n();
        let _ = writeln!(
            out,
            "## {} capacity model: learning from a backlog of N = {n} traces, time to learn and retention (simulated LLM)\n",
            model_label(self.sim)
        );
        out.push_str(&self.settings());
        out.push('\n');
        out.push_str(
            "Sequential = the GEPA-default baseline, batches of 3 one after another: N/3 rounds of 3 traces, each \
             reflecting on its 3 traces and applying one aggregator update before the next round starts (the \
             controller's T(3)). Modelled = the simulator's latency formula over the token counts of each round's \
             critical path (slowest reflector call + slowest level-1 group, or every batch in turn for sequential), \
             from an in-process replay of the simulator's answers — no timing, no overhead.\n\n",
        );
        out.push_str(
            "| configuration | batch sizes | rounds | LLM calls | time to learn (s) | modelled (s) | measured / modelled | speed-up vs sequential | retention |\n\
             |---|---|---|---|---|---|---|---|---|\n",
        );
        let seq = self.seq_secs(true);
        for row in self.rows {
            let r = row.result();
            let measured = row.measured.as_ref().map_or("—".to_owned(), |m| format!("{:.2}", m.total_secs));
            let ratio = row
                .measured
                .as_ref()
                .map_or("—".to_owned(), |m| format!("{:.3}", m.total_secs / row.modelled.total_secs));
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} | {:.2} | {} | {:.1}× | {:.1}% ({}/{}) |",
                row.setup.label(),
                sizes_text(r),
                r.rounds.len(),
                r.calls,
                measured,
                row.modelled.total_secs,
                ratio,
                seq / r.total_secs,
                100.0 * self.retention(r),
                r.kept,
                n
            );
        }
        out.push('\n');

        // The controller's choices.
        for family in [Family::CombeeAuto] {
            let Some(row) = self.row(family) else { continue };
            let r = row.result();
            let _ = writeln!(out, "**{}** took {}; per round:\n", family.name(), sizes_text(r));
            for (i, round) in r.rounds.iter().enumerate() {
                let _ = writeln!(
                    out,
                    "{}. bs {} — {:.3} s — {}",
                    i + 1,
                    round.bs,
                    round.secs,
                    round.reason.clone().unwrap_or_default()
                );
            }
            if row.measured.is_some() {
                let m = &row.modelled;
                let _ = writeln!(out, "\nOn modelled round times the same controller took {}.", sizes_text(m));
            }
            out.push('\n');
        }

        // The overload meter.
        let _ = writeln!(
            out,
            "### Overload meter vs true retention, by group size\n\nCombee rounds of {} traces at p = 2 with groups \
             bounded at 1, 2, 3, 4, 6, 8, 12, 16, 24, 32 reflections, round seeds 1–{} each, against the in-process \
             replay of this simulator (the same answers, no waiting). Estimate: the product's capture–recapture over \
             the round's own reading of its answers ({}); truth: per group, the markers its answer kept over those \
             its reflections held. Sizes with at least 100 samples are judged (±10 points).\n",
            self.args.meter_n.min(self.n()),
            self.args.meter_seeds,
            if non_citing(self.sim) {
                "no answer cites its sources right: by text, whether each reflection's key insight reappears in its \
                 group's operations, for answers without sources and for answers whose citations are implausible"
            } else {
                "by the operations' cited sources"
            }
        );
        out.push_str(&self.meter.0);
        out.push('\n');

        // Targets.
        out.push_str(&self.targets());
        out
    }

    fn targets(&self) -> String {
        let mut out = format!("### Targets ({} capacity model)\n\n", model_label(self.sim));
        if self.args.model_only {
            out.push_str("(--model-only: every figure below is modelled, nothing was measured)\n\n");
        }
        let (Some(seq), Some(auto)) = (self.row(Family::Sequential), self.row(Family::CombeeAuto)) else {
            return out;
        };
        let measured = seq.result().total_secs / auto.result().total_secs;
        let modelled = seq.modelled.total_secs / auto.modelled.total_secs;
        let auto_ret = self.retention(auto.result());
        let seq_ret = self.retention(seq.result());
        // The targets: hard ≥ 50× at ≥ 98 %; soft ≥ 40× at ≥ sequential's retention;
        // a model that does not cite ≥ 17× at ≥ sequential's retention.
        let (speed, retention, retention_text) = match (self.sim.capacity_model, non_citing(self.sim)) {
            (_, true) => (17.0, seq_ret, format!("≥ sequential's {:.1}%", 100.0 * seq_ret)),
            (CapacityModel::Hard, false) => (50.0, 0.98, "≥ 98%".to_owned()),
            (CapacityModel::Soft, false) => (40.0, seq_ret, format!("≥ sequential's {:.1}%", 100.0 * seq_ret)),
        };
        let _ = writeln!(
            out,
            "- Combee-auto speed-up over sequential: {measured:.1}× (≥ {speed}×): {} (modelled from the latency formula alone: {modelled:.1}×)",
            pass(measured >= speed)
        );
        let _ = writeln!(
            out,
            "- Combee-auto retention {:.1}% ({retention_text}): {}",
            100.0 * auto_ret,
            pass(auto_ret >= retention - 1e-9)
        );
        if let Some(bs) = auto.result().largest.map(|t| t as usize)
            && let Some(naive) = self.fixed(Family::Naive, bs)
        {
            let ret = self.retention(naive.result());
            let _ = writeln!(
                out,
                "- Naive at combee-auto's largest batch (bs = {bs}): retention {:.1}% (far below combee-auto's): {}",
                100.0 * ret,
                pass(ret <= auto_ret / 2.0)
            );
        }
        let _ = writeln!(out, "- Sequential retention (the reference): {:.1}%", 100.0 * seq_ret);
        let _ = writeln!(
            out,
            "- Overload meter within ±10 points of the truth at every judged size: {}",
            pass(self.meter.1)
        );
        out
    }

    fn csv(&self) -> String {
        let mut out = String::from(
            "configuration,family,method,p,batch_sizes,rounds,llm_calls,time_to_learn_s,modelled_s,speedup_vs_sequential,kept,n,retention\n",
        );
        let seq = self.seq_secs(true);
        for row in self.rows {
            let r = row.result();
            let sizes: Vec<String> = r.rounds.iter().map(|x| x.bs.to_string()).collect();
            let _ = writeln!(
                out,
                "\"{}\",{},{},{},\"{}\",{},{},{:.4},{:.4},{:.3},{},{},{:.4}",
                row.setup.label(),
                row.setup.family.name(),
                serde_json::to_value(row.setup.method)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_owned))
                    .unwrap_or_default(),
                row.setup.p,
                sizes.join(" "),
                r.rounds.len(),
                r.calls,
                r.total_secs,
                row.modelled.total_secs,
                seq / r.total_secs,
                r.kept,
                self.n(),
                self.retention(r)
            );
        }
        out
    }
}

// ---------------------------------------------------------------------------
// SVG, by hand

const W: f64 = 820.0;
const H: f64 = 520.0;
const LEFT: f64 = 80.0;
const RIGHT: f64 = 30.0;
const TOP: f64 = 56.0;
const BOTTOM: f64 = 70.0;

#[derive(Clone, Copy)]
struct Axis {
    lo: f64,
    hi: f64,
    log: bool,
    from: f64,
    to: f64,
}

impl Axis {
    fn at(&self, v: f64) -> f64 {
        let f = if self.log {
            (v.ln() - self.lo.ln()) / (self.hi.ln() - self.lo.ln())
        } else {
            (v - self.lo) / (self.hi - self.lo)
        };
        self.from + f * (self.to - self.from)
    }

    /// 1-2-5 ticks for a log axis, even steps for a linear one.
    fn ticks(&self, step: f64) -> Vec<f64> {
        if self.log {
            let mut out = Vec::new();
            let mut decade = 10f64.powf(self.lo.log10().floor());
            while decade <= self.hi {
                for m in [1.0, 2.0, 5.0] {
                    let v = decade * m;
                    if v >= self.lo * 0.999 && v <= self.hi * 1.001 {
                        out.push(v);
                    }
                }
                decade *= 10.0;
            }
            out
        } else {
            let mut out = Vec::new();
            let mut v = (self.lo / step).ceil() * step;
            while v <= self.hi + 1e-9 {
                out.push(v);
                v += step;
            }
            out
        }
    }
}

fn tick_label(v: f64) -> String {
    if v >= 1.0 && (v - v.round()).abs() < 1e-9 { format!("{}", v.round() as i64) } else { format!("{v}") }
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

struct Svg {
    body: String,
}

impl Svg {
    fn new(title: &str, subtitle: &str) -> Self {
        let mut body = format!(
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{W}\" height=\"{H}\" viewBox=\"0 0 {W} {H}\" \
             font-family=\"DejaVu Sans, Helvetica, Arial, sans-serif\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
        );
        let _ = writeln!(
            body,
            "<text x=\"{}\" y=\"24\" font-size=\"17\" font-weight=\"bold\" text-anchor=\"middle\">{}</text>",
            W / 2.0,
            esc(title)
        );
        let _ = writeln!(
            body,
            "<text x=\"{}\" y=\"43\" font-size=\"12\" fill=\"#555\" text-anchor=\"middle\">{}</text>",
            W / 2.0,
            esc(subtitle)
        );
        Self { body }
    }

    fn axes(&mut self, x: &Axis, y: &Axis, x_step: f64, y_step: f64, x_title: &str, y_title: &str) {
        let (x0, x1, y0, y1) = (x.from, x.to, y.from, y.to);
        for t in x.ticks(x_step) {
            let px = x.at(t);
            let _ = writeln!(
                self.body,
                "<line x1=\"{px:.1}\" y1=\"{y0:.1}\" x2=\"{px:.1}\" y2=\"{y1:.1}\" stroke=\"#e5e5e5\"/>"
            );
            let _ = writeln!(
                self.body,
                "<line x1=\"{px:.1}\" y1=\"{y0:.1}\" x2=\"{px:.1}\" y2=\"{:.1}\" stroke=\"#333\"/>",
                y0 + 5.0
            );
            let _ = writeln!(
                self.body,
                "<text x=\"{px:.1}\" y=\"{:.1}\" font-size=\"12\" text-anchor=\"middle\">{}</text>",
                y0 + 19.0,
                tick_label(t)
            );
        }
        for t in y.ticks(y_step) {
            let py = y.at(t);
            let _ = writeln!(
                self.body,
                "<line x1=\"{x0:.1}\" y1=\"{py:.1}\" x2=\"{x1:.1}\" y2=\"{py:.1}\" stroke=\"#e5e5e5\"/>"
            );
            let _ = writeln!(
                self.body,
                "<line x1=\"{:.1}\" y1=\"{py:.1}\" x2=\"{x0:.1}\" y2=\"{py:.1}\" stroke=\"#333\"/>",
                x0 - 5.0
            );
            let _ = writeln!(
                self.body,
                "<text x=\"{:.1}\" y=\"{:.1}\" font-size=\"12\" text-anchor=\"end\">{}</text>",
                x0 - 8.0,
                py + 4.0,
                tick_label(t)
            );
        }
        let _ = writeln!(
            self.body,
            "<rect x=\"{x0:.1}\" y=\"{y1:.1}\" width=\"{:.1}\" height=\"{:.1}\" fill=\"none\" stroke=\"#333\"/>",
            x1 - x0,
            y0 - y1
        );
        let _ = writeln!(
            self.body,
            "<text x=\"{:.1}\" y=\"{:.1}\" font-size=\"13\" text-anchor=\"middle\">{}</text>",
            (x0 + x1) / 2.0,
            y0 + 42.0,
            esc(x_title)
        );
        let _ = writeln!(
            self.body,
            "<text x=\"{:.1}\" y=\"{:.1}\" font-size=\"13\" text-anchor=\"middle\" transform=\"rotate(-90 {:.1} {:.1})\">{}</text>",
            22.0,
            (y0 + y1) / 2.0,
            22.0,
            (y0 + y1) / 2.0,
            esc(y_title)
        );
    }

    fn marker(&mut self, shape: Shape, px: f64, py: f64, color: &str, filled: bool) {
        let fill = if filled { color } else { "white" };
        let style = format!("fill=\"{fill}\" stroke=\"{color}\" stroke-width=\"1.8\"");
        let _ = match shape {
            Shape::Circle => writeln!(self.body, "<circle cx=\"{px:.1}\" cy=\"{py:.1}\" r=\"5.5\" {style}/>"),
            Shape::Square => writeln!(
                self.body,
                "<rect x=\"{:.1}\" y=\"{:.1}\" width=\"11\" height=\"11\" {style}/>",
                px - 5.5,
                py - 5.5
            ),
            Shape::Triangle => writeln!(
                self.body,
                "<polygon points=\"{:.1},{:.1} {:.1},{:.1} {:.1},{:.1}\" {style}/>",
                px,
                py - 7.0,
                px - 6.5,
                py + 5.0,
                px + 6.5,
                py + 5.0
            ),
            Shape::Diamond => writeln!(
                self.body,
                "<polygon points=\"{:.1},{:.1} {:.1},{:.1} {:.1},{:.1} {:.1},{:.1}\" {style}/>",
                px,
                py - 7.0,
                px + 7.0,
                py,
                px,
                py + 7.0,
                px - 7.0,
                py
            ),
            Shape::Star => {
                let pts: Vec<String> = (0..10)
                    .map(|i| {
                        let r = if i % 2 == 0 { 10.0 } else { 4.2 };
                        let a = std::f64::consts::PI * (i as f64) / 5.0 - std::f64::consts::FRAC_PI_2;
                        format!("{:.1},{:.1}", px + r * a.cos(), py + r * a.sin())
                    })
                    .collect();
                writeln!(self.body, "<polygon points=\"{}\" {style}/>", pts.join(" "))
            }
        };
    }

    fn text(&mut self, px: f64, py: f64, size: f64, anchor: &str, color: &str, text: &str) {
        let _ = writeln!(
            self.body,
            "<text x=\"{px:.1}\" y=\"{py:.1}\" font-size=\"{size}\" text-anchor=\"{anchor}\" fill=\"{color}\">{}</text>",
            esc(text)
        );
    }

    fn line(&mut self, points: &[(f64, f64)], color: &str, width: f64, dash: Option<&str>) {
        let d: Vec<String> = points.iter().map(|(x, y)| format!("{x:.1},{y:.1}")).collect();
        let dash = dash.map_or(String::new(), |d| format!(" stroke-dasharray=\"{d}\""));
        let _ = writeln!(
            self.body,
            "<polyline points=\"{}\" fill=\"none\" stroke=\"{color}\" stroke-width=\"{width}\"{dash}/>",
            d.join(" ")
        );
    }

    /// A legend box; entries are (shape or line, color, filled, label).
    fn legend(&mut self, x: f64, y: f64, entries: &[(Option<Shape>, &str, bool, String)]) {
        let (width, height) = legend_size(entries);
        let _ = writeln!(
            self.body,
            "<rect x=\"{x:.1}\" y=\"{y:.1}\" width=\"{width:.1}\" height=\"{height:.1}\" fill=\"white\" fill-opacity=\"0.92\" stroke=\"#999\"/>"
        );
        for (i, (shape, color, filled, label)) in entries.iter().enumerate() {
            let cy = y + 17.0 + 20.0 * i as f64;
            match shape {
                Some(s) => self.marker(*s, x + 20.0, cy, color, *filled),
                None => {
                    self.line(&[(x + 8.0, cy), (x + 32.0, cy)], color, 2.0, if *filled { None } else { Some("6 4") })
                }
            }
            self.text(x + 40.0, cy + 4.0, 12.0, "start", "#222", label);
        }
    }

    fn finish(mut self) -> String {
        self.body.push_str("</svg>\n");
        self.body
    }
}

#[derive(Clone, Copy)]
enum Shape {
    Circle,
    Square,
    Triangle,
    Diamond,
    Star,
}

fn style(family: Family) -> (Shape, &'static str, bool) {
    match family {
        Family::Sequential => (Shape::Square, "#222222", true),
        Family::SequentialOneRound => (Shape::Square, "#777777", false),
        Family::Naive => (Shape::Circle, "#d62728", true),
        Family::Combee => (Shape::Triangle, "#1f77b4", true),
        Family::CombeeTuned => (Shape::Diamond, "#1f77b4", false),
        Family::CombeeAuto => (Shape::Star, "#2ca02c", true),
    }
}

#[derive(Clone, Copy)]
struct Rect {
    x0: f64,
    y0: f64,
    x1: f64,
    y1: f64,
}

impl Rect {
    fn overlap(&self, o: &Rect) -> f64 {
        let w = (self.x1.min(o.x1) - self.x0.max(o.x0)).max(0.0);
        let h = (self.y1.min(o.y1) - self.y0.max(o.y0)).max(0.0);
        w * h
    }

    fn inside(&self, o: &Rect) -> bool {
        self.x0 >= o.x0 && self.x1 <= o.x1 && self.y0 >= o.y0 && self.y1 <= o.y1
    }
}

/// Where to put a marker's label: the first of a few spots around it that is
/// inside the plot and free of markers, the legend and earlier labels, else the
/// spot with the least overlap. Returns the text position, anchor and box.
fn place_label(
    px: f64,
    py: f64,
    text: &str,
    size: f64,
    taken: &[Rect],
    bounds: &Rect,
) -> (f64, f64, &'static str, Rect) {
    let w = text.chars().count() as f64 * size * 0.58;
    let spots = [
        (9.0, 4.0, "start"),
        (-9.0, 4.0, "end"),
        (0.0, -12.0, "middle"),
        (0.0, 20.0, "middle"),
        (7.0, -10.0, "start"),
        (7.0, 18.0, "start"),
        (-7.0, -10.0, "end"),
        (-7.0, 18.0, "end"),
        (0.0, -25.0, "middle"),
        (0.0, 33.0, "middle"),
        (22.0, 4.0, "start"),
        (-22.0, 4.0, "end"),
    ];
    let boxed = |(dx, dy, anchor): (f64, f64, &'static str)| {
        let (tx, ty) = (px + dx, py + dy);
        let x0 = match anchor {
            "start" => tx,
            "end" => tx - w,
            _ => tx - w / 2.0,
        };
        (tx, ty, anchor, Rect { x0, y0: ty - size, x1: x0 + w, y1: ty + 3.0 })
    };
    let cost = |r: &Rect| {
        let outside = if r.inside(bounds) { 0.0 } else { 1e6 };
        outside + taken.iter().map(|t| t.overlap(r)).sum::<f64>()
    };
    let mut best = boxed(spots[0]);
    let mut best_cost = cost(&best.3);
    for spot in spots {
        let candidate = boxed(spot);
        let c = cost(&candidate.3);
        if c < best_cost {
            (best, best_cost) = (candidate, c);
        }
        if c == 0.0 {
            break;
        }
    }
    best
}

fn legend_size(entries: &[(Option<Shape>, &str, bool, String)]) -> (f64, f64) {
    let width = 14.0 + 36.0 + entries.iter().map(|e| e.3.chars().count()).max().unwrap_or(0) as f64 * 6.6;
    (width, 10.0 + 20.0 * entries.len() as f64)
}

/// Bounds of a log axis on 1-2-5 values, with some room on both sides.
fn log_bounds(values: impl Iterator<Item = f64>) -> (f64, f64) {
    let (lo, hi) = values
        .filter(|v| v.is_finite() && *v > 0.0)
        .fold((f64::INFINITY, 0.0f64), |(lo, hi), v| (lo.min(v), hi.max(v)));
    if !lo.is_finite() {
        return (1.0, 10.0);
    }
    let steps = |decade: f64| [1.0, 2.0, 5.0].map(|m| m * 10f64.powf(decade));
    let below = (lo / 1.3).log10().floor();
    let lo = steps(below).into_iter().filter(|v| *v <= lo / 1.3).fold(10f64.powf(below), f64::max);
    let above = (hi * 1.3).log10().floor();
    let hi = steps(above).into_iter().chain([10f64.powf(above + 1.0)]).find(|v| *v >= hi * 1.3).unwrap_or(hi * 2.0);
    (lo, hi)
}

impl Report<'_> {
    fn quality_delay_svg(&self) -> String {
        let mut svg = Svg::new(
            &format!(
                "Retention vs time to learn N = {} traces ({} capacity model)",
                self.n(),
                model_name(self.sim.capacity_model)
            ),
            &format!(
                "simulated LLM: {} ms + {} ms/input token + {} ms/output token; K = {}, D = {}; playbook, p = 2",
                self.sim.fixed_ms,
                self.sim.per_input_token_ms,
                self.sim.per_output_token_ms,
                self.sim.capacity_k,
                self.sim.digest_reflections,
            ),
        );
        let (lo, hi) = log_bounds(self.rows.iter().map(|r| r.result().total_secs));
        let x = Axis { lo, hi, log: true, from: LEFT, to: W - RIGHT };
        let y = Axis { lo: 0.0, hi: 108.0, log: false, from: H - BOTTOM, to: TOP };
        svg.axes(
            &x,
            &y,
            1.0,
            10.0,
            "time to learn all N traces (s, log scale) — left is faster",
            "retention (% of the N insights in the final prompt)",
        );
        let families = [
            Family::Sequential,
            Family::SequentialOneRound,
            Family::Naive,
            Family::Combee,
            Family::CombeeTuned,
            Family::CombeeAuto,
        ];
        let entries: Vec<(Option<Shape>, &str, bool, String)> = families
            .iter()
            .filter(|f| self.rows.iter().any(|r| r.setup.family == **f))
            .map(|&f| {
                let (s, c, filled) = style(f);
                let label = match f {
                    Family::Naive | Family::Combee | Family::CombeeTuned => format!("{} (label: batch size)", f.name()),
                    _ => f.name().to_owned(),
                };
                (Some(s), c, filled, label)
            })
            .collect();
        // The legend sits in the empty lower right: slow and forgetful is where nothing lands.
        let (lw, lh) = legend_size(&entries);
        let (lx, ly) = (x.to - lw - 10.0, y.from - lh - 10.0);
        svg.legend(lx, ly, &entries);
        let mut taken = vec![Rect { x0: lx, y0: ly, x1: lx + lw, y1: ly + lh }];
        let points: Vec<(&Row, f64, f64)> = self
            .rows
            .iter()
            .map(|row| {
                let r = row.result();
                (row, x.at(r.total_secs), y.at(100.0 * self.retention(r)))
            })
            .collect();
        // Named configurations are drawn last, on top of any fixed-size marker they share a spot with.
        let mut order: Vec<&(&Row, f64, f64)> = points.iter().collect();
        order.sort_by_key(|(row, _, _)| {
            !matches!(row.setup.sizing, Sizing::Fixed(_)) || row.setup.family == Family::Sequential
        });
        for &&(row, px, py) in &order {
            let (shape, color, filled) = style(row.setup.family);
            svg.marker(shape, px, py, color, filled);
            taken.push(Rect { x0: px - 8.0, y0: py - 8.0, x1: px + 8.0, y1: py + 8.0 });
        }
        // ... and labelled first, so they get the best spots.
        order.sort_by_key(|(row, _, _)| {
            matches!(row.setup.sizing, Sizing::Fixed(_)) && row.setup.family != Family::Sequential
        });
        let bounds = Rect { x0: x.from, y0: y.to, x1: x.to, y1: y.from };
        for &&(row, px, py) in &order {
            let r = row.result();
            let (_, color, _) = style(row.setup.family);
            let label = match (row.setup.family, &row.setup.sizing) {
                (Family::Naive | Family::Combee | Family::CombeeTuned, Sizing::Fixed(bs)) => format!("{bs}"),
                (Family::CombeeAuto, _) => format!("combee-auto: {}", sizes_text(r)),
                (Family::Sequential, _) => "sequential (bs 3)".to_owned(),
                (family, _) => family.name().to_owned(),
            };
            let (tx, ty, anchor, rect) = place_label(px, py, &label, 11.0, &taken, &bounds);
            taken.push(rect);
            svg.text(tx, ty, 11.0, anchor, color, &label);
        }
        svg.finish()
    }
}
