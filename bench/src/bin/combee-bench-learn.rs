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

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context as _;
use async_trait::async_trait;
use clap::Parser;
use combee::{
    domain::{Feedback, PromptName, Strategy, Trace, TraceStatus, VersionContent},
    learn::{
        controller::{self, ControllerConfig, Fit, Sample},
        delta::Budget,
        grouping::{self, Execution, Method},
        journal::MemoryJournal,
        round::{ReduceMode, RoundSpec, run_round},
    },
    llm::{
        ChatRequest, ChatResponse, LlmBackend, LlmCall, LlmError, LlmRole, Usage,
        client::{OpenAiClient, estimate_tokens},
        config::LlmConfig,
        sim::{self, CapacityModel, SimConfig},
    },
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
    /// Simulator capacity model of the main sweep: `hard` (at most K per call, fewer beyond D)
    /// or `soft` (each of the m new insights a call writes kept with probability E(m)/m).
    /// The level-2 section always uses `soft`.
    #[arg(long, value_enum, default_value_t = CapacityModel::Hard)]
    capacity_model: CapacityModel,
    /// Level-2 section: traces in its one round (n) — union, `reduce = "llm"` and rewrite at p = 2.
    #[arg(long, default_value_t = 100)]
    level2_n: usize,
    /// Level-2 section: round seeds to average over.
    #[arg(long, default_value_t = 5)]
    level2_seeds: u64,
    /// Only run the level-2 section (a few seconds).
    #[arg(long)]
    level2_only: bool,
    /// p: duplication of Combee's augmented shuffle.
    #[arg(long, default_value_t = 1)]
    duplication: u32,
    /// Controller min_batch; its ladder doubles from here.
    #[arg(long, default_value_t = 16)]
    min_batch: u32,
    /// Controller max_batch; default: the largest size up to which every Combee round's groups
    /// (⌈p·bs / ⌊√bs⌋⌉ reflections) stay within D — 132 for D = 12, p = 1.
    #[arg(long)]
    max_batch: Option<u32>,
    /// The client's LLM concurrency limit (at least N, so a map is one wave).
    #[arg(long, default_value_t = 512)]
    concurrency: usize,
    /// Also run Combee at p = 2 at these sizes and at the size combee-auto settled on
    /// (empty: skip).
    #[arg(long, value_delimiter = ',', default_value = "50,100")]
    p2_sizes: Vec<usize>,
    /// Also run Method::Sequential over all N in one round (map in parallel, then N/3 batches in order).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    with_one_round_sequential: bool,
    /// Only compute the modelled figures (no waiting, no files).
    #[arg(long)]
    model_only: bool,
    /// Where learn.md, learn.csv and the SVGs go.
    #[arg(long, default_value = "bench/results")]
    out_dir: PathBuf,
}

/// The delay-curve ladder: doubling sizes profiled one round each.
const PROFILE_LADDER: [usize; 7] = [4, 8, 16, 32, 64, 128, 256];

// ---------------------------------------------------------------------------
// Configurations and runs

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Family {
    Sequential,
    SequentialOneRound,
    Naive,
    Combee,
    CombeeP2,
    CombeeAuto,
    CombeeAutoDefault,
}

impl Family {
    fn name(self) -> &'static str {
        match self {
            Self::Sequential => "sequential",
            Self::SequentialOneRound => "sequential, one round",
            Self::Naive => "naive",
            Self::Combee => "combee",
            Self::CombeeP2 => "combee p=2",
            Self::CombeeAuto => "combee-auto",
            Self::CombeeAutoDefault => "combee-auto, default ladder",
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
            (Sizing::Fixed(bs), Family::Naive | Family::Combee | Family::CombeeP2) => {
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
    /// Combee-auto: the unclamped plateau bs* of the first and of the last fitted choice,
    /// and the last target.
    first_plateau: Option<f64>,
    plateau: Option<f64>,
    target: Option<u32>,
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
    tokens: BTreeSet<String>,
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
        })
    }
}

/// A round's critical path under the latency model: the slowest reflector call
/// (the map is one wave), then the slowest level-1 group (parallel) or every
/// batch in turn (sequential). Level 2 is a union here: no call.
fn modelled_round_secs(sim: &SimConfig, calls: &[LlmCall], execution: Execution) -> f64 {
    let latency = |c: &&LlmCall| sim::latency_ms(sim, c.prompt_tokens, c.completion_tokens);
    let map = calls.iter().filter(|c| c.role == LlmRole::Reflector).map(|c| latency(&c)).fold(0.0, f64::max);
    let aggregate = calls.iter().filter(|c| c.role == LlmRole::Aggregator).map(|c| latency(&c));
    let reduce = match execution {
        Execution::Parallel => aggregate.fold(0.0, f64::max),
        Execution::Sequential => aggregate.sum(),
    };
    (map + reduce) / 1000.0
}

fn insight_tokens(text: &str) -> BTreeSet<String> {
    text.split("INSIGHT-")
        .skip(1)
        .filter_map(|rest| rest.split(':').next())
        .filter(|t| !t.is_empty() && t.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-'))
        .map(str::to_owned)
        .collect()
}

/// Learns from the whole backlog with `setup`, round after round.
async fn learn(env: &Env, mode: Mode, setup: &Setup) -> anyhow::Result<RunResult> {
    let backend = match mode {
        Mode::Measured => env.http.as_ref(),
        Mode::Modelled => env.replay.as_ref(),
    };
    let execution = grouping::plan(setup.method, 4, setup.p, 0).execution;
    let mut content = env.base.clone();
    let mut samples: Vec<Sample> = Vec::new();
    let mut rounds = Vec::new();
    let (mut calls, mut first_plateau, mut plateau, mut target) = (0, None, None, None);
    let mut pos = 0;
    let started = Instant::now();
    while pos < env.traces.len() {
        let backlog = env.traces.len() - pos;
        let (bs, reason) = match &setup.sizing {
            Sizing::Fixed(bs) => ((*bs).clamp(1, backlog), None),
            Sizing::Auto(cfg) => {
                let choice = controller::choose(&samples, backlog as u64, cfg);
                if choice.plateau.is_some() {
                    first_plateau = first_plateau.or(choice.plateau);
                    plateau = choice.plateau;
                    target = Some(choice.target);
                }
                (choice.batch_size.max(1) as usize, Some(choice.reason.message()))
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
            group_size: Default::default(),
        };
        let journal = MemoryJournal::new();
        let t = Instant::now();
        let outcome = run_round(backend, &env.llm, &spec, &content, &env.traces[pos..pos + bs], &journal)
            .await
            .with_context(|| format!("{} round {} (bs {bs})", setup.label(), rounds.len() + 1))?;
        let secs = match mode {
            Mode::Measured => t.elapsed().as_secs_f64(),
            Mode::Modelled => modelled_round_secs(&env.sim, &outcome.calls, execution),
        };
        calls += outcome.calls.len();
        samples.push(Sample { batch_size: bs as u32, round_secs: secs });
        rounds.push(RoundLog { bs, secs, reason });
        content = outcome.content;
        pos += bs;
    }
    let total_secs = match mode {
        Mode::Measured => started.elapsed().as_secs_f64(),
        Mode::Modelled => rounds.iter().map(|r| r.secs).sum(),
    };
    let kept = insight_tokens(&content.render()).intersection(&env.tokens).count();
    Ok(RunResult { rounds, total_secs, kept, calls, first_plateau, plateau, target })
}

/// One Combee round of each ladder size from the base version: R(bs).
async fn profile(env: &Env, mode: Mode, p: u32) -> anyhow::Result<Vec<(usize, f64)>> {
    let mut out = Vec::new();
    for bs in PROFILE_LADDER.into_iter().filter(|&bs| bs <= env.traces.len()) {
        let one = Env { traces: env.traces[..bs].to_vec(), ..env.clone_shallow() };
        let setup = Setup { family: Family::Combee, method: Method::Combee, p, sizing: Sizing::Fixed(bs) };
        let r = learn(&one, mode, &setup).await?;
        out.push((bs, r.total_secs));
    }
    Ok(out)
}

impl Env {
    fn clone_shallow(&self) -> Env {
        Env {
            llm: self.llm.clone(),
            sim: self.sim.clone(),
            http: self.http.clone(),
            replay: self.replay.clone(),
            base: self.base.clone(),
            traces: Vec::new(),
            tokens: self.tokens.clone(),
        }
    }
}

fn traces(n: usize) -> anyhow::Result<(Vec<Trace>, BTreeSet<String>)> {
    let now = chrono::Utc::now();
    let prompt = PromptName::parse("bench-learn")?;
    let traces: Vec<Trace> = (0..n)
        .map(|i| Trace {
            id: Uuid::now_v7(),
            prompt: prompt.clone(),
            prompt_version: Some(1),
            status: TraceStatus::Pending,
            input: json!({"task": format!("task {i}")}),
            trajectory: json!([{"role": "assistant", "content": format!("worked on task {i}")}]),
            output: json!(format!("answer {i}")),
            feedback: Feedback {
                success: Some(!i.is_multiple_of(3)),
                comment: Some(format!("INSIGHT-t{i:03}: check field {i} before answering")),
                ..Default::default()
            },
            reflection: None,
            external_id: None,
            metadata: json!({}),
            attempts: 0,
            failure_reason: None,
            round_id: None,
            quarantined_at: None,
            quarantine_reason: None,
            created_at: now,
            updated_at: now,
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

struct Curve {
    measured: Vec<(usize, f64)>,
    modelled: Vec<(usize, f64)>,
    /// Fit of T(bs) = (N/bs)·R(bs) over the profiled sizes in [min_batch, ∞), and its plateau.
    fit: Option<Fit>,
    plateau: Option<f64>,
    fit_modelled: Option<Fit>,
    plateau_modelled: Option<f64>,
}

/// The largest batch size up to which every Combee round (k = ⌊√bs⌋ groups of the
/// p·bs augmented reflections) hands each aggregator call at most `digest` reflections:
/// what an operator who knows the aggregator's capacity would set as max_batch.
fn within_digest_cap(digest: usize, p: u32) -> u32 {
    let fits = |bs: usize| (p as usize * bs).div_ceil(grouping::combee_group_count(bs)) <= digest;
    (1..=100_000).take_while(|&bs| fits(bs)).last().unwrap_or(1) as u32
}

fn fit_curve(points: &[(usize, f64)], n: usize, min_batch: u32, tau_rel: f64) -> (Option<Fit>, Option<f64>) {
    let profile: Vec<(u32, f64)> =
        points.iter().filter(|(bs, _)| *bs >= min_batch as usize).map(|&(bs, r)| (bs as u32, r)).collect();
    let fit = controller::fit_delay(&profile, n as u64);
    let plateau = fit.and_then(|f| {
        let bs_min = f64::from(profile.first()?.0);
        Some(controller::plateau(&f, controller::tau(&f, tau_rel, bs_min)))
    });
    (fit, plateau)
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
    let sim_cfg = SimConfig {
        capacity_model: args.capacity_model,
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
        max_concurrency: args.concurrency.max(args.n),
        ..LlmConfig::default()
    };
    let (traces, tokens) = traces(args.n)?;
    let env = Env {
        http: Arc::new(OpenAiClient::new(llm.clone())?),
        replay: Arc::new(Replay { sim: sim_cfg.clone() }),
        llm,
        sim: sim_cfg.clone(),
        base: VersionContent { base: "You are a benchmark agent. Answer the task.".into(), playbook: None },
        traces,
        tokens,
    };
    let p = args.duplication.max(1);
    let max_batch = args.max_batch.unwrap_or_else(|| within_digest_cap(args.digest, p)).max(args.min_batch);
    let auto_cfg = ControllerConfig {
        min_batch: args.min_batch,
        max_batch,
        ladder: ControllerConfig::doubling_ladder(args.min_batch, max_batch),
        ..ControllerConfig::default()
    };

    let fixed = |family, method, p, bs| Setup { family, method, p, sizing: Sizing::Fixed(bs) };
    // The controller-driven runs come first: the fixed sweep adds the size it settled on.
    let mut setups = vec![
        fixed(Family::Sequential, Method::Sequential, 1, grouping::SEQUENTIAL_BATCH),
        Setup { family: Family::CombeeAuto, method: Method::Combee, p, sizing: Sizing::Auto(auto_cfg.clone()) },
        Setup {
            family: Family::CombeeAutoDefault,
            method: Method::Combee,
            p,
            sizing: Sizing::Auto(ControllerConfig::default()),
        },
    ];
    if args.with_one_round_sequential {
        setups.push(fixed(Family::SequentialOneRound, Method::Sequential, 1, args.n));
    }

    let mut rows: Vec<Row> = Vec::new();
    let total = Instant::now();
    let run = |setup: Setup| {
        let env = &env;
        let model_only = args.model_only;
        async move {
            let modelled = learn(env, Mode::Modelled, &setup).await?;
            let measured = if model_only {
                None
            } else {
                eprintln!("  running {} …", setup.label());
                Some(learn(env, Mode::Measured, &setup).await?)
            };
            anyhow::Ok(Row { setup, measured, modelled })
        }
    };
    for setup in setups {
        rows.push(run(setup).await?);
    }
    let auto_target =
        rows.iter().find(|r| r.setup.family == Family::CombeeAuto).and_then(|r| r.result().target).map(|t| t as usize);
    let mut sizes = args.sizes.clone();
    if let Some(t) = auto_target
        && !sizes.contains(&t)
    {
        sizes.push(t);
    }
    sizes.sort_unstable();
    sizes.dedup();
    sizes.retain(|&bs| bs >= 1 && bs <= args.n);
    for &bs in &sizes {
        rows.push(run(fixed(Family::Naive, Method::Naive, 1, bs)).await?);
    }
    for &bs in &sizes {
        rows.push(run(fixed(Family::Combee, Method::Combee, p, bs)).await?);
    }
    let mut p2_sizes = args.p2_sizes.clone();
    if !p2_sizes.is_empty()
        && let Some(t) = auto_target
    {
        p2_sizes.push(t);
    }
    p2_sizes.sort_unstable();
    p2_sizes.dedup();
    p2_sizes.retain(|&bs| bs >= 1 && bs <= args.n);
    if p != 2 {
        for &bs in &p2_sizes {
            rows.push(run(fixed(Family::CombeeP2, Method::Combee, 2, bs)).await?);
        }
    }
    eprintln!("  profiling the delay curve …");
    let modelled_profile = profile(&env, Mode::Modelled, p).await?;
    let measured_profile = if args.model_only { Vec::new() } else { profile(&env, Mode::Measured, p).await? };
    let (fit, plateau) = fit_curve(&measured_profile, args.n, auto_cfg.min_batch, auto_cfg.tau_rel);
    let (fit_modelled, plateau_modelled) = fit_curve(&modelled_profile, args.n, auto_cfg.min_batch, auto_cfg.tau_rel);
    let curve =
        Curve { measured: measured_profile, modelled: modelled_profile, fit, plateau, fit_modelled, plateau_modelled };
    let bench_secs = total.elapsed().as_secs_f64();

    let report = Report { args: &args, sim: &sim_cfg, auto_cfg: &auto_cfg, rows: &rows, curve: &curve, bench_secs };
    let mut md = report.markdown();
    md.push('\n');
    md.push_str(&level2);
    print!("{md}");
    if !args.model_only {
        std::fs::create_dir_all(&args.out_dir)?;
        std::fs::write(args.out_dir.join("learn.md"), &md)?;
        std::fs::write(args.out_dir.join("learn.csv"), report.csv())?;
        std::fs::write(args.out_dir.join("learn-quality-delay.svg"), report.quality_delay_svg())?;
        std::fs::write(args.out_dir.join("learn-delay-curve.svg"), report.delay_curve_svg())?;
        eprintln!("wrote {}/learn.{{md,csv}}, learn-quality-delay.svg, learn-delay-curve.svg", args.out_dir.display());
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Report: Markdown, CSV

struct Report<'a> {
    args: &'a Args,
    sim: &'a SimConfig,
    auto_cfg: &'a ControllerConfig,
    rows: &'a [Row],
    curve: &'a Curve,
    bench_secs: f64,
}

fn pass(ok: bool) -> &'static str {
    if ok { "PASS" } else { "FAIL" }
}

/// "bs* = 139.5 at the first fit, 149.8 at the last refit".
fn plateaus(r: &RunResult) -> String {
    match (r.first_plateau, r.plateau) {
        (Some(a), Some(b)) if (a - b).abs() >= 0.05 => {
            format!("bs* = {a:.1} at the first fit, {b:.1} at the last refit")
        }
        (_, Some(b)) => format!("bs* = {b:.1}"),
        _ => "no fit".to_owned(),
    }
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
        format!(
            "**Simulated LLM** (combee's OpenAI-compatible simulator, not a language model), over HTTP in the same process:\n\
             latency per call = {} ms + {} ms × prompt tokens + {} ms × completion tokens (tokens = characters / 4); \
             {}; no faults. Client concurrency limit {} (every map is one wave). \
             Strategy playbook, level-2 reduce = union (no LLM call), p = {}. \
             N = {} traces, each with one distinct `INSIGHT-<token>` marker; retention = share of the N markers in \
             the final rendered prompt. Controller (combee-auto): ladder {:?}, min_batch {}, max_batch {} (the largest \
             size up to which every Combee group, ⌈p·bs/⌊√bs⌋⌉ reflections, stays within D), τ_rel {}, window {}. Machine: {} cores. Whole \
             benchmark (measured and modelled runs): {:.0} s.\n",
            s.fixed_ms,
            s.per_input_token_ms,
            s.per_output_token_ms,
            match s.capacity_model {
                CapacityModel::Hard => format!(
                    "capacity model hard: K = {} distinct new insights per aggregating call, max(1, ⌊K·D/n⌋) when a \
                     call gets n > D = {} reflections",
                    s.capacity_k, s.digest_reflections
                ),
                CapacityModel::Soft => format!(
                    "capacity model soft: each of the m new insights a call must write kept with probability E(m)/m, \
                     E(m) = {k}·(1 − e^(−m/{k}))",
                    k = s.capacity_k
                ),
            },
            self.args.concurrency.max(self.n()),
            self.args.duplication.max(1),
            self.n(),
            self.auto_cfg.ladder,
            self.auto_cfg.min_batch,
            self.auto_cfg.max_batch,
            self.auto_cfg.tau_rel,
            self.auto_cfg.window,
            std::thread::available_parallelism().map_or(0, |n| n.get()),
            self.bench_secs,
        )
    }

    fn markdown(&self) -> String {
        let mut out = String::new();
        let n = self.n();
        let _ = writeln!(
            out,
            "## Learning from a backlog of N = {n} traces: time to learn and retention (simulated LLM)\n"
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
        for family in [Family::CombeeAuto, Family::CombeeAutoDefault] {
            let Some(row) = self.row(family) else { continue };
            let r = row.result();
            let _ = writeln!(out, "**{}** picked {} ({}); per round:\n", family.name(), sizes_text(r), plateaus(r));
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
                let _ = writeln!(
                    out,
                    "\nOn modelled round times the same controller picked {} ({}).",
                    sizes_text(m),
                    plateaus(m)
                );
            }
            out.push('\n');
        }

        // The delay curve.
        let c = self.curve;
        let _ = writeln!(
            out,
            "### Delay curve T(bs) = (N/bs)·R(bs)\n\nR(bs) = the time of one Combee round of bs traces from the base \
             version. Fit T(bs) = A·bs^(−α) over the sizes ≥ min_batch = {} (the controller's range); bs* = \
             (α·A/τ)^(1/(α+1)) with τ = τ_rel·|T′({})|.\n",
            self.auto_cfg.min_batch, self.auto_cfg.min_batch
        );
        out.push_str("| bs | R(bs) measured (s) | T(bs) measured (s) | R(bs) modelled (s) | T(bs) modelled (s) |\n|---|---|---|---|---|\n");
        for &(bs, rm) in &c.modelled {
            let meas = c.measured.iter().find(|(b, _)| *b == bs).map(|&(_, r)| r);
            let _ = writeln!(
                out,
                "| {bs} | {} | {} | {rm:.3} | {:.2} |",
                meas.map_or("—".to_owned(), |r| format!("{r:.3}")),
                meas.map_or("—".to_owned(), |r| format!("{:.2}", n as f64 / bs as f64 * r)),
                n as f64 / bs as f64 * rm
            );
        }
        let fit_line = |name: &str, fit: Option<Fit>, plateau: Option<f64>| match fit {
            Some(f) => format!(
                "- {name}: A = {:.1} s, α = {:.3}, R² = {:.4}, bs* = {}\n",
                f.a,
                f.alpha,
                f.r2,
                plateau.map_or("—".to_owned(), |p| format!("{p:.1}"))
            ),
            None => format!("- {name}: no fit\n"),
        };
        out.push('\n');
        if !c.measured.is_empty() {
            out.push_str(&fit_line("measured", c.fit, c.plateau));
        }
        out.push_str(&fit_line("modelled", c.fit_modelled, c.plateau_modelled));
        out.push('\n');

        // Targets.
        out.push_str(&self.targets());
        out
    }

    fn targets(&self) -> String {
        let mut out = String::from("### Targets\n\n");
        if self.args.model_only {
            out.push_str("(--model-only: every figure below is modelled, nothing was measured)\n\n");
        }
        let (Some(seq), Some(auto)) = (self.row(Family::Sequential), self.row(Family::CombeeAuto)) else {
            return out;
        };
        let measured = seq.result().total_secs / auto.result().total_secs;
        let modelled = seq.modelled.total_secs / auto.modelled.total_secs;
        let agreement = measured / modelled;
        let _ = writeln!(
            out,
            "- Combee-auto speed-up over sequential: {measured:.1}× measured (≥ 17×): {}",
            pass(measured >= 17.0)
        );
        let _ = writeln!(
            out,
            "- … modelled from the latency formula alone: {modelled:.1}×; measured / modelled = {agreement:.3} (within 10%): {}",
            pass((agreement - 1.0).abs() <= 0.10)
        );
        let auto_ret = self.retention(auto.result());
        let _ = writeln!(out, "- Combee-auto retention {:.1}% (≥ 95%): {}", 100.0 * auto_ret, pass(auto_ret >= 0.95));
        if let Some(bs) = auto.result().target.map(|t| t as usize)
            && let Some(naive) = self.fixed(Family::Naive, bs)
        {
            let ret = self.retention(naive.result());
            let _ = writeln!(
                out,
                "- Naive at the size combee-auto settled on (bs = {bs}) retention {:.1}% (≤ 20%): {}",
                100.0 * ret,
                pass(ret <= 0.20)
            );
        }
        let _ = writeln!(out, "- Sequential retention (the reference): {:.1}%", 100.0 * self.retention(seq.result()));
        let p2: Vec<String> = self
            .rows
            .iter()
            .filter(|r| r.setup.family == Family::CombeeP2)
            .map(|r| {
                let Sizing::Fixed(bs) = r.setup.sizing else { return String::new() };
                format!("bs {bs}: {:.0}%", 100.0 * self.retention(r.result()))
            })
            .collect();
        let _ = writeln!(
            out,
            "\nWhy p = {p} by default: with p = 2 and a hard cap of K = {} insights per call, Combee's groups \
             (⌈2·bs/⌊√bs⌋⌉ reflections) exceed D = {} once bs > {} and overflow — about 60% retention was \
             measured before with p = 2.{}",
            self.sim.capacity_k,
            self.sim.digest_reflections,
            within_digest_cap(self.sim.digest_reflections, 2),
            if p2.is_empty() { String::new() } else { format!(" This run, Combee at p = 2: {}.", p2.join(", ")) },
            p = self.args.duplication.max(1),
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
        Family::CombeeP2 => (Shape::Triangle, "#1f77b4", false),
        Family::CombeeAuto => (Shape::Star, "#2ca02c", true),
        Family::CombeeAutoDefault => (Shape::Diamond, "#2ca02c", false),
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
            &format!("Retention vs time to learn N = {} traces", self.n()),
            &format!(
                "simulated LLM: {} ms + {} ms/input token + {} ms/output token; K = {}, D = {}; playbook, p = {}",
                self.sim.fixed_ms,
                self.sim.per_input_token_ms,
                self.sim.per_output_token_ms,
                self.sim.capacity_k,
                self.sim.digest_reflections,
                self.args.duplication.max(1)
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
            Family::CombeeP2,
            Family::CombeeAuto,
            Family::CombeeAutoDefault,
        ];
        let entries: Vec<(Option<Shape>, &str, bool, String)> = families
            .iter()
            .filter(|f| self.rows.iter().any(|r| r.setup.family == **f))
            .map(|&f| {
                let (s, c, filled) = style(f);
                let label = match f {
                    Family::Naive | Family::Combee | Family::CombeeP2 => format!("{} (label: batch size)", f.name()),
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
                (Family::Naive | Family::Combee | Family::CombeeP2, Sizing::Fixed(bs)) => format!("{bs}"),
                (Family::CombeeAuto, _) => format!("combee-auto: {}", sizes_text(r)),
                (Family::CombeeAutoDefault, _) => "auto, ladder from 4".to_owned(),
                (Family::Sequential, _) => "sequential (bs 3)".to_owned(),
                (family, _) => family.name().to_owned(),
            };
            let (tx, ty, anchor, rect) = place_label(px, py, &label, 11.0, &taken, &bounds);
            taken.push(rect);
            svg.text(tx, ty, 11.0, anchor, color, &label);
        }
        svg.finish()
    }

    fn delay_curve_svg(&self) -> String {
        let c = self.curve;
        let n = self.n() as f64;
        let points = if c.measured.is_empty() { &c.modelled } else { &c.measured };
        let (fit, plateau) =
            if c.measured.is_empty() { (c.fit_modelled, c.plateau_modelled) } else { (c.fit, c.plateau) };
        let t = |&(bs, r): &(usize, f64)| (bs as f64, n / bs as f64 * r);
        let fixed_runs: Vec<(f64, f64)> = self
            .rows
            .iter()
            .filter(|r| r.setup.family == Family::Combee)
            .filter_map(|r| match r.setup.sizing {
                Sizing::Fixed(bs) => Some((bs as f64, r.result().total_secs)),
                Sizing::Auto(_) => None,
            })
            .collect();
        let seq = self.row(Family::Sequential).map(|r| (3.0, r.result().total_secs));
        let all_t = points.iter().map(t).map(|p| p.1).chain(fixed_runs.iter().map(|p| p.1)).chain(seq.map(|p| p.1));
        let (ylo, yhi) = log_bounds(all_t);
        let x = Axis { lo: 2.0, hi: 500.0, log: true, from: LEFT, to: W - RIGHT };
        let y = Axis { lo: ylo, hi: yhi, log: true, from: H - BOTTOM, to: TOP };
        let subtitle = match fit {
            Some(f) => format!(
                "fit over bs ≥ {}: T(bs) = A·bs^(−α), A = {:.1} s, α = {:.3}, R² = {:.4}; simulated LLM",
                self.auto_cfg.min_batch, f.a, f.alpha, f.r2
            ),
            None => "no fit; simulated LLM".to_owned(),
        };
        let mut svg = Svg::new(&format!("Delay of learning N = {} traces vs batch size (Combee)", self.n()), &subtitle);
        svg.axes(&x, &y, 1.0, 1.0, "batch size bs (log scale)", "T(bs) = (N/bs)·R(bs), seconds (log scale)");
        if let Some(f) = fit {
            let curve: Vec<(f64, f64)> = (0..=100)
                .map(|i| 2f64 * (250f64).powf(i as f64 / 100.0))
                .filter(|bs| *bs <= x.hi)
                .map(|bs| (x.at(bs), y.at(f.delay(bs))))
                .filter(|(_, py)| *py >= y.to && *py <= y.from)
                .collect();
            svg.line(&curve, "#1f77b4", 2.0, None);
        }
        let cap = f64::from(self.auto_cfg.max_batch);
        svg.line(&[(x.at(cap), y.from), (x.at(cap), y.to)], "#999999", 1.5, Some("2 4"));
        svg.text(
            x.at(cap) + 5.0,
            y.to + 14.0,
            11.0,
            "start",
            "#666",
            &format!("max_batch = {}", self.auto_cfg.max_batch),
        );
        if let Some(p) = plateau.filter(|p| p.is_finite() && *p > x.lo && *p < x.hi) {
            svg.line(&[(x.at(p), y.from), (x.at(p), y.to)], "#2ca02c", 2.0, Some("7 5"));
            svg.text(x.at(p) - 5.0, y.from - 10.0, 12.0, "end", "#2ca02c", &format!("bs* = {p:.1}"));
        }
        for p in &fixed_runs {
            svg.marker(Shape::Square, x.at(p.0), y.at(p.1), "#ff7f0e", false);
        }
        if let Some(s) = seq {
            svg.marker(Shape::Square, x.at(s.0), y.at(s.1), "#222222", true);
            svg.text(x.at(s.0) + 9.0, y.at(s.1) + 4.0, 11.0, "start", "#222", "sequential (bs 3)");
        }
        let min_b = self.auto_cfg.min_batch as usize;
        for p in points {
            let (bs, tt) = t(p);
            svg.marker(Shape::Circle, x.at(bs), y.at(tt), "#1f77b4", p.0 >= min_b);
        }
        let source = if c.measured.is_empty() { "modelled" } else { "measured" };
        let entries = vec![
            (Some(Shape::Circle), "#1f77b4", true, format!("(N/bs)·R(bs), one round of bs, {source}")),
            (Some(Shape::Circle), "#1f77b4", false, format!("same, bs < min_batch = {min_b} (not fitted)")),
            (None, "#1f77b4", true, "fit A·bs^(−α)".to_owned()),
            (None, "#2ca02c", false, "plateau bs*".to_owned()),
            (Some(Shape::Square), "#ff7f0e", false, "whole backlog at fixed bs, measured".to_owned()),
            (Some(Shape::Square), "#222222", true, "sequential baseline".to_owned()),
        ];
        let (_, lh) = legend_size(&entries);
        svg.legend(LEFT + 10.0, H - BOTTOM - lh - 10.0, &entries);
        svg.finish()
    }
}
