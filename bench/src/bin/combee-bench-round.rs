//! Round latency benchmark: the wall time of one Combee round over the ideal
//! 3·L (map, level-1 groups, level-2 combine — one LLM latency each), against
//! the OpenAI-compatible simulator (a simulated LLM) at a fixed latency L.
//! Runs the real round executor with its real journal on a real store.
//!
//!     cargo run --release --bin combee-bench-round -- [--latency-ms 500] [--concurrency 64]

use std::{sync::Arc, time::Instant};

use clap::Parser;
use combee::{
    domain::{Feedback, Method, PromptName, ReduceMode, Strategy, Trace, VersionContent},
    learn::{
        merge::budget::Budget,
        round::journal::{MemoryJournal, RoundJournal},
        round::{RoundSpec, run_round},
    },
    llm::{LlmBackend, client::OpenAiClient, config::LlmConfig},
    simulation::llm::SimConfig,
};
use serde_json::json;
use uuid::Uuid;

#[derive(Parser)]
struct RoundArgs {
    /// The simulator's fixed latency per call, L.
    #[arg(long, default_value_t = 500.0)]
    latency_ms: f64,
    /// The client's global LLM concurrency limit.
    #[arg(long, default_value_t = 64)]
    concurrency: usize,
    /// Batch sizes to run.
    #[arg(long, value_delimiter = ',', default_value = "16,64,256")]
    sizes: Vec<usize>,
    /// Write the Markdown table here too.
    #[arg(long)]
    out: Option<std::path::PathBuf>,
}

fn traces(n: usize) -> Vec<Trace> {
    (0..n)
        .map(|i| {
            let feedback = Feedback {
                success: Some(true),
                comment: Some(format!("INSIGHT-b{i:04}: lesson {i}")),
                ..Default::default()
            };
            Trace::pending(
                PromptName::new("default", "bench").unwrap_or_else(|_| unreachable!()),
                json!({"task": i}),
                json!([{"role": "assistant", "content": format!("step for task {i}")}]),
                json!(format!("answer {i}")),
                feedback,
            )
        })
        .collect()
}

struct StoreRow {
    store: &'static str,
    strategy: &'static str,
    n: usize,
    k: usize,
    wall_ms: f64,
    ratio: f64,
    calls: usize,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = RoundArgs::parse();
    let sim =
        combee::simulation::llm::LocalSim::start(SimConfig { fixed_ms: args.latency_ms, ..Default::default() }).await?;
    let llm = LlmConfig { base_url: sim.base_url.clone(), max_concurrency: args.concurrency, ..LlmConfig::default() };
    let backend: Arc<dyn LlmBackend> = Arc::new(OpenAiClient::new(llm.clone())?);
    let base = VersionContent { base: "You are a benchmark agent.".into(), playbook: None };
    let ideal_ms = 3.0 * args.latency_ms;

    // A real store for the journal: Postgres when DATABASE_URL is set, else SQLite in a temp dir.
    let dir = tempfile::tempdir()?;
    let (store_name, store_url) = match std::env::var("DATABASE_URL") {
        Ok(url) if !url.is_empty() => ("postgres", url),
        _ => ("sqlite", format!("sqlite://{}", dir.path().join("bench.db").display())),
    };
    let store = combee::store::connect(&store_url, 32, std::time::Duration::from_secs(10)).await?;
    let key = format!("bench-{}", Uuid::now_v7().simple());
    let name = PromptName::new("default", &key)?;
    let prompt = combee::domain::prompt::NewPrompt {
        name: name.clone(),
        strategy: Strategy::Playbook,
        promotion: Default::default(),
        settings: Default::default(),
        created_by: "bench".into(),
    };
    let first = combee::domain::prompt::NewVersion {
        parent: None,
        source: combee::domain::VersionSource::Manual,
        round_id: None,
        content: base.clone(),
        message: "bench".into(),
        created_by: "bench".into(),
    };
    store.create_prompt(prompt, first).await?;

    let mut rows = Vec::new();
    for &n in &args.sizes {
        for (strategy, reduce, label) in [
            (Strategy::Playbook, ReduceMode::Llm, "playbook (reduce=llm)"),
            (Strategy::Rewrite, ReduceMode::Union, "rewrite"),
        ] {
            for journal_kind in ["memory", store_name] {
                let mut batch = traces(n);
                for t in &mut batch {
                    t.prompt = name.clone();
                }
                let spec = RoundSpec {
                    round_id: Uuid::now_v7(),
                    seed: 42,
                    method: Method::Combee,
                    strategy,
                    duplication: 2,
                    reduce,
                    budget: Budget::default(),
                    agent_reflections: combee::domain::AgentReflections::Use,
                    denylist: Default::default(),
                    group_size: Default::default(),
                };
                let (wall, outcome) = if journal_kind == "memory" {
                    let journal = MemoryJournal::new();
                    let t = Instant::now();
                    let o = run_round(backend.as_ref(), &llm, &spec, &base, &batch, &journal).await?;
                    (t.elapsed(), o)
                } else {
                    let ids = store.insert_traces(&to_valid(&batch)).await?;
                    let round = store
                        .open_round(&combee::store::OpenRound {
                            prompt: name.clone(),
                            trigger: combee::domain::round::RoundTrigger::Api,
                            method: Method::Combee,
                            batch: n as u32,
                            min_traces: 1,
                            seed: 42,
                            inbound_webhook_id: None,
                            judge_wait: None,
                            base_version: None,
                        })
                        .await?
                        .ok_or_else(|| anyhow::anyhow!("no round opened"))?;
                    let claimed = store
                        .claim_round("bench", std::time::Duration::from_secs(600))
                        .await?
                        .ok_or_else(|| anyhow::anyhow!("no round claimed"))?;
                    anyhow::ensure!(claimed.traces.len() == ids.len());
                    let journal = combee::worker::StoreJournal::new(
                        store.clone(),
                        round.id,
                        claimed.round.attempt,
                        Default::default(),
                    );
                    let spec = RoundSpec { round_id: round.id, ..spec };
                    let t = Instant::now();
                    let o =
                        run_round(backend.as_ref(), &llm, &spec, &base, &claimed.traces, &journal as &dyn RoundJournal)
                            .await?;
                    let elapsed = t.elapsed();
                    store
                        .fail_round(
                            round.id,
                            claimed.round.attempt,
                            "benchmark done",
                            // Retire the benchmark's traces so the next round takes fresh ones.
                            combee::store::RoundFailure::GiveUp {
                                charges: combee::store::TraceCharges {
                                    faults: ids
                                        .iter()
                                        .map(|&trace_id| combee::store::TraceFault {
                                            trace_id,
                                            reason: "benchmark done".into(),
                                        })
                                        .collect(),
                                    max_trace_attempts: 1,
                                },
                            },
                        )
                        .await?;
                    (elapsed, o)
                };
                let wall_ms = wall.as_secs_f64() * 1000.0;
                rows.push(StoreRow {
                    store: if journal_kind == "memory" { "in-memory journal" } else { store_name },
                    strategy: label,
                    n,
                    k: outcome.k,
                    wall_ms,
                    ratio: wall_ms / ideal_ms,
                    calls: outcome.calls.len(),
                });
            }
        }
    }

    let mut out = String::new();
    out.push_str(&format!(
        "## Round wall time over the ideal 3·L (simulated LLM)\n\n\
         Simulator: fixed latency L = {} ms per call, no per-token latency, default capacity model (K = 12); \
         client concurrency limit {}; p = 2; machine: {} cores. Ideal = 3·L = {} ms (map, level-1 groups, level-2 combine).\n\n\
         | journal | strategy | n | k | LLM calls | wall (ms) | wall / 3·L | target (n = 64) |\n|---|---|---|---|---|---|---|---|\n",
        args.latency_ms,
        args.concurrency,
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        ideal_ms
    ));
    for r in &rows {
        let target = if r.n == 64 { if r.ratio <= 1.10 { "≤ 1.10 PASS" } else { "≤ 1.10 FAIL" } } else { "" };
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} | {:.0} | {:.3} | {} |\n",
            r.store, r.strategy, r.n, r.k, r.calls, r.wall_ms, r.ratio, target
        ));
    }
    if args.concurrency < 256 && args.sizes.contains(&256) {
        out.push_str(&format!(
            "\nAt n = 256 the map needs ⌈256 / {}⌉ waves of reflector calls under the concurrency limit, so its ideal is higher than 3·L.\n",
            args.concurrency
        ));
    }
    print!("{out}");
    if let Some(path) = args.out {
        std::fs::write(path, &out)?;
    }
    Ok(())
}

fn to_valid(traces: &[Trace]) -> Vec<combee::domain::trace::ValidTrace> {
    traces
        .iter()
        .map(|t| combee::domain::trace::ValidTrace {
            prompt: t.prompt.clone(),
            prompt_version: None,
            input: t.input.clone(),
            trajectory: t.trajectory.clone(),
            output: t.output.clone(),
            feedback: t.feedback.clone(),
            reflection: None,
            external_id: None,
            metadata: t.metadata.clone(),
        })
        .collect()
}
