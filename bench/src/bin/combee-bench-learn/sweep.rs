//! The sweeps: every configuration under one simulated model (the main table,
//! the controller's choices, the overload meter), and the time to learn by
//! `controller.max_batch`.

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Instant;

use combee::{
    domain::{Method, VersionContent},
    learn::{capacity::batch_size::ControllerConfig, shuffle::grouping},
    llm::{LlmBackend, client::OpenAiClient, config::LlmConfig},
    service::llm_limits::StoreLimits,
    simulation::llm::{self as sim, CapacityModel, SimConfig},
    store,
};

use crate::LearnArgs;
use crate::overload_meter::meter_section;
use crate::report::{LearnReport, model_label};
use crate::results::{Family, RunRow, Setup, Sizing};
use crate::runs::{Env, Mode, Replay, learn_from, run_setup, traces};
use crate::second::second_backlog_section;

/// Every configuration under one capacity model: the Markdown section, CSV rows,
/// SVG. A model that does not cite (`citing` false: its aggregator answers carry
/// no `sources`) runs only sequential, combee-auto and the meter's reading.
pub(crate) async fn one_model(
    args: &LearnArgs,
    model: CapacityModel,
    citing: bool,
) -> anyhow::Result<(String, String, String)> {
    let sim_cfg = SimConfig {
        rate_no_sources: if citing { 0.0 } else { args.non_citing_absent },
        rate_wrong_sources: if citing { 0.0 } else { args.non_citing_wrong },
        ..args.sim_config(model)
    };
    let local_sim = sim::LocalSim::start(sim_cfg.clone()).await?;
    let (env, process) = bench_env(args, &sim_cfg, &local_sim.base_url).await?;
    // The product defaults: p = 2 (the prompt default) and `ControllerConfig::default()`.
    let p = 2;
    let auto_cfg = ControllerConfig::default();
    let fixed = |family, method, p, bs| Setup { family, method, p, sizing: Sizing::Fixed(bs) };
    let mut setups = vec![
        fixed(Family::Sequential, Method::Sequential, 1, grouping::SEQUENTIAL_BATCH),
        Setup { family: Family::CombeeAuto, method: Method::Combee, p, sizing: Sizing::Auto(auto_cfg.clone()) },
        Setup { family: Family::CombeeAutoWarm, method: Method::Combee, p, sizing: Sizing::Auto(auto_cfg.clone()) },
    ];
    if args.with_one_round_sequential {
        setups.push(fixed(Family::SequentialOneRound, Method::Sequential, 1, args.n));
    }
    let mut rows: Vec<RunRow> = Vec::new();
    let started = Instant::now();
    let name = model_label(&sim_cfg);
    let run = |setup: Setup| run_setup(&env, &local_sim.base_url, args.model_only, &name, setup);
    for setup in setups {
        rows.push(run(setup).await?);
    }
    if !args.model_only {
        rows.push(process.resumed_round(&env, &local_sim.base_url, &name).await?);
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
    let second = match rows.iter().find(|r| r.setup.family == Family::CombeeAuto) {
        Some(auto) if citing && args.second_backlog => {
            Some(second_backlog_section(&env, &local_sim.base_url, args.model_only, &name, auto).await?)
        }
        _ => None,
    };
    eprintln!("  [{name}] overload meter vs markers …");
    let meter = meter_section(&env, args.meter_n.min(args.n), args.meter_seeds).await?;
    let bench_secs = started.elapsed().as_secs_f64();
    let report = LearnReport { args, sim: &sim_cfg, auto_cfg: &auto_cfg, rows: &rows, bench_secs, meter, second };
    Ok((report.markdown(), report.csv(), report.quality_delay_svg()))
}

/// The LLM client of a benchmark process, which keeps the concurrency limit it
/// earns in a store of its own (SQLite, in a temp dir), as a worker process does.
pub(crate) struct Process {
    client: OpenAiClient,
    limits: Arc<StoreLimits>,
    _dir: tempfile::TempDir,
}

/// The simulated backend's benchmark environment for `sim_cfg` at `base_url`, and its process's client.
pub(crate) async fn bench_env(args: &LearnArgs, sim_cfg: &SimConfig, base_url: &str) -> anyhow::Result<(Env, Process)> {
    let llm = LlmConfig {
        base_url: base_url.to_owned(),
        max_concurrency: args.concurrency.max(2 * args.n),
        ..LlmConfig::default()
    };
    let (traces, _) = traces(args.n)?;
    let dir = tempfile::tempdir()?;
    let url = format!("sqlite://{}", dir.path().join("limits.db").display());
    let limits = StoreLimits::new(store::connect(&url, 2, std::time::Duration::from_secs(10)).await?);
    let client = OpenAiClient::new(llm.clone())?.with_limit_memory(limits.clone());
    let env = Env {
        http: Arc::new(client.clone()),
        replay: Arc::new(Replay { sim: sim_cfg.clone() }),
        llm,
        sim: sim_cfg.clone(),
        base: VersionContent { base: "You are a benchmark agent. Answer the task.".into(), playbook: None },
        traces,
    };
    Ok((env, Process { client, limits, _dir: dir }))
}

impl Process {
    /// Combee-auto on the product defaults through a new process's client on
    /// the same backend: its concurrency limit resumed from what this one kept.
    pub(crate) async fn resumed_round(&self, env: &Env, base_url: &str, name: &str) -> anyhow::Result<RunRow> {
        self.client.keep_limit_now().await;
        let resumed = Env {
            http: Arc::new(OpenAiClient::new(env.llm.clone())?.with_limit_memory(self.limits.clone())),
            replay: env.replay.clone(),
            llm: env.llm.clone(),
            sim: env.sim.clone(),
            base: env.base.clone(),
            traces: env.traces.clone(),
        };
        let sizing = Sizing::Auto(ControllerConfig::default());
        let setup = Setup { family: Family::CombeeAutoResumed, method: Method::Combee, p: 2, sizing };
        run_setup(&resumed, base_url, false, name, setup).await
    }
}

/// Why `controller.max_batch` is what it is, measured (modelled: the replay of
/// the soft simulator, no waiting): the time to learn a backlog of
/// `--max-batch-n` traces with combee-auto on the product defaults but for the
/// ceiling, at the product's client concurrency (`llm.max_concurrency` = 64)
/// and at a large one, with the largest round's record size (what the store
/// keeps and `GET /v1/rounds/{id}` returns).
pub(crate) async fn max_batch_section(args: &LearnArgs) -> anyhow::Result<String> {
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
