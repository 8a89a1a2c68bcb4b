//! Level 2 under the soft capacity model: how much of what the groups learned
//! survives union, `reduce = "llm"` and the rewrite strategy's merge.

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context as _;
use combee::{
    domain::{Method, ReduceMode, Strategy, VersionContent},
    learn::{
        merge::budget::Budget,
        round::journal::MemoryJournal,
        round::{RoundSpec, run_round},
        shuffle::grouping,
    },
    llm::{LlmBackend, client::OpenAiClient, config::LlmConfig},
    simulation::llm::{self as sim, CapacityModel},
};
use uuid::Uuid;

use crate::LearnArgs;
use crate::runs::{Replay, insight_tokens, traces};
use crate::text::pass;

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
pub(crate) async fn level2_section(args: &LearnArgs) -> anyhow::Result<(String, bool)> {
    let sim_cfg = args.sim_config(CapacityModel::Soft);
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
