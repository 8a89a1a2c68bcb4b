//! A growing playbook: ten consecutive rounds of 300 distinct lessons on one
//! prompt, on the product defaults, against the simulator (a SIMULATED LLM)
//! over HTTP — what each round costs as the playbook its calls are shown
//! grows: prompt and completion tokens per learned trace, aggregator calls,
//! group sizes, the playbook's size, the round's time and combee's own CPU
//! time per LLM answer. Written to `growth.md`, apart from `learn.md`.
//!
//! Combee's own CPU time is that of the one thread that runs the rounds (a
//! current-thread runtime: the map, the shuffle, the reduce and the HTTP
//! client), read from `/proc/thread-self/schedstat`; the simulator answers on
//! other threads and is not counted.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Instant;

use anyhow::Context as _;
use combee::{
    domain::{AgentReflections, Method, PromptSettings, ReduceMode, Strategy, VersionContent},
    learn::{
        capacity::meter::{BucketCounts, MeterBucket},
        capacity::sizing::{DEFAULT_TARGET_RETENTION, choose_group_size},
        merge::{apply::rendered_chars, budget::Budget},
        round::journal::MemoryJournal,
        round::{RoundSpec, run_round},
    },
    llm::{LlmRole, client::OpenAiClient, config::LlmConfig},
    simulation::llm::{self as sim, CapacityModel},
};
use uuid::Uuid;

use crate::LearnArgs;
use crate::runs::traces;

/// One round's figures.
struct GrowthRound {
    prompt_per_trace: f64,
    completion_per_trace: f64,
    aggregator_calls: usize,
    k: usize,
    largest_group: usize,
    max_group: Option<usize>,
    bullets: usize,
    chars: usize,
    secs: f64,
    cpu_ms_per_answer: f64,
}

/// The section: one table per configuration, and the ratio the target is about.
pub(crate) async fn growth_section(args: &LearnArgs) -> anyhow::Result<String> {
    let sim_cfg = args.sim_config(CapacityModel::Soft);
    let local = sim::LocalSim::start(sim_cfg).await?;
    let mut md = String::new();
    let _ = writeln!(
        md,
        "## A growing playbook: {} rounds of {} traces on one prompt (simulated LLM)\n",
        args.growth_rounds, args.growth_n
    );
    let _ = writeln!(
        md,
        "Simulator (a simulation, not a model): soft capacity model, K = {}, latency {} ms + {} ms per prompt \
         token + {} ms per completion token. Product defaults: p = 2, group sizes from the overload meter \
         (target retention {DEFAULT_TARGET_RETENTION}), the client's default concurrency ({}), the default \
         playbook budget unless the row says otherwise. Every trace carries one distinct lesson, so the \
         playbook meets {} new lessons a round. Tokens are the client's estimate (characters / 4). CPU: combee's \
         own, one thread, per LLM answer. Machine: {} cores.\n",
        args.capacity_k,
        args.fixed_ms,
        args.per_input_token_ms,
        args.per_output_token_ms,
        LlmConfig::default().max_concurrency,
        args.growth_n,
        crate::cores()
    );
    let configs = [
        ("reduce = \"union\" (default), default budget", ReduceMode::Union, true),
        ("reduce = \"llm\", default budget", ReduceMode::Llm, true),
        ("reduce = \"union\", no playbook budget", ReduceMode::Union, false),
    ];
    for (label, reduce, budgeted) in configs {
        eprintln!("  growth: {label} …");
        let url = local.base_url.clone();
        let (rounds, n) = (args.growth_rounds, args.growth_n);
        // A thread of its own, so its CPU time is combee's alone.
        let rows = tokio::task::spawn_blocking(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            rt.block_on(run(url, reduce, budgeted, rounds, n))
        })
        .await??;
        let _ = writeln!(md, "### {label}\n");
        md.push_str(
            "| round | prompt tokens / trace | completion tokens / trace | aggregator calls | groups (k) | \
             largest group | group bound | playbook bullets | playbook chars | round (s) | CPU ms / answer |\n\
             |---|---|---|---|---|---|---|---|---|---|---|\n",
        );
        for (i, r) in rows.iter().enumerate() {
            let _ = writeln!(
                md,
                "| {} | {:.0} | {:.0} | {} | {} | {} | {} | {} | {} | {:.1} | {:.2} |",
                i + 1,
                r.prompt_per_trace,
                r.completion_per_trace,
                r.aggregator_calls,
                r.k,
                r.largest_group,
                r.max_group.map_or("√n".to_owned(), |g| g.to_string()),
                r.bullets,
                r.chars,
                r.secs,
                r.cpu_ms_per_answer
            );
        }
        if let (Some(first), Some(last)) = (rows.first(), rows.last()) {
            let ratio = last.prompt_per_trace / first.prompt_per_trace.max(1.0);
            let verdict = if ratio <= 2.0 { "within" } else { "NOT within" };
            let _ = writeln!(
                md,
                "\nPrompt tokens per learned trace, round {} over round 1: {ratio:.2}× ({verdict} the 2× target).\n",
                rows.len()
            );
        }
    }
    Ok(md)
}

/// CPU time of the calling thread, in nanoseconds.
fn thread_cpu_ns() -> u64 {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse().ok()))
        .unwrap_or(0)
}

async fn run(
    base_url: String,
    reduce: ReduceMode,
    budgeted: bool,
    rounds: usize,
    n: usize,
) -> anyhow::Result<Vec<GrowthRound>> {
    let llm = LlmConfig { base_url, ..LlmConfig::default() };
    let backend = OpenAiClient::new(llm.clone())?;
    let (all, _) = traces(rounds * n)?;
    let settings = PromptSettings {
        reduce,
        max_bullets: (!budgeted).then_some(combee::domain::prompt::MAX_BULLETS),
        max_chars: (!budgeted).then_some(combee::domain::prompt::MAX_CHARS),
        ..PromptSettings::default()
    };
    let budget = Budget::for_prompt(&settings, Strategy::Playbook);
    let mut content = VersionContent { base: "You are a benchmark agent. Answer the task.".into(), playbook: None };
    let mut meter: BTreeMap<u32, (BucketCounts, u64)> = BTreeMap::new();
    let mut out = Vec::new();
    for (r, batch) in all.chunks(n).enumerate() {
        let buckets: Vec<MeterBucket> = meter.iter().map(|(&s, &(c, k))| MeterBucket::new(s, c, k)).collect();
        let group_size = choose_group_size(&buckets, DEFAULT_TARGET_RETENTION, settings.duplication >= 2);
        let max_group = group_size.max_group;
        let spec = RoundSpec {
            round_id: Uuid::now_v7(),
            seed: r as u64 + 1,
            method: Method::Combee,
            strategy: Strategy::Playbook,
            duplication: settings.duplication,
            reduce,
            budget: budget.clone(),
            agent_reflections: AgentReflections::default(),
            denylist: Default::default(),
            group_size,
        };
        let journal = MemoryJournal::new();
        let (t, cpu) = (Instant::now(), thread_cpu_ns());
        let outcome = run_round(&backend, &llm, &spec, &content, batch, &journal)
            .await
            .with_context(|| format!("growth round {}", r + 1))?;
        let (secs, cpu_ns) = (t.elapsed().as_secs_f64(), thread_cpu_ns().saturating_sub(cpu));
        if let Some(reading) = &outcome.record.meter {
            for &(bucket, c) in &reading.buckets {
                let e = meter.entry(bucket).or_default();
                e.0.marked += c.marked;
                e.0.recaptured += c.recaptured;
                e.1 += 1;
            }
        }
        let learned = outcome.record.n.max(1) as f64;
        let calls = &outcome.calls;
        let pb = outcome.content.playbook.clone().unwrap_or_default();
        out.push(GrowthRound {
            prompt_per_trace: calls.iter().map(|c| c.prompt_tokens).sum::<u64>() as f64 / learned,
            completion_per_trace: calls.iter().map(|c| c.completion_tokens).sum::<u64>() as f64 / learned,
            aggregator_calls: calls.iter().filter(|c| c.role == LlmRole::Aggregator).count(),
            k: outcome.record.k,
            largest_group: outcome.record.grouping.largest_group,
            max_group,
            bullets: pb.bullet_count(),
            chars: rendered_chars(&pb),
            secs,
            cpu_ms_per_answer: cpu_ns as f64 / 1e6 / calls.len().max(1) as f64,
        });
        content = outcome.content;
    }
    Ok(out)
}
