//! `--first-rounds-only`: how fast a process's first large round learns,
//! beside sequential on the same simulated backend — the backend never seen
//! (the concurrency limit climbs from 2), the same process once warm, and a
//! new process on a backend seen before (its limit resumed from the store),
//! for each capacity model. A few minutes instead of the whole benchmark.

use std::fmt::Write as _;

use combee::{
    domain::Method,
    learn::{capacity::batch_size::ControllerConfig, shuffle::grouping},
    simulation::llm::{self as sim, SimConfig},
};

use crate::LearnArgs;
use crate::report::model_label;
use crate::results::{Family, Setup, Sizing};
use crate::runs::run_setup;
use crate::sweep::bench_env;

pub(crate) async fn first_rounds_section(args: &LearnArgs) -> anyhow::Result<String> {
    let mut out = format!(
        "## A process's first large round (simulated LLM)\n\nN = {} traces learned by sequential (batches of 3), then \
         by combee-auto on the product defaults: first in the same process right after sequential (a backend never \
         seen: the client's concurrency limit climbs from 2), then again in that process (warm), then through a new \
         process's client on the same backend (its limit resumed from what the first process kept in the store). \
         Speed-up = sequential's time over the configuration's.\n\n\
         | capacity model | sequential | first large round, backend never seen | warm | new process, backend seen before | target (new process) |\n\
         | --- | --- | --- | --- | --- | --- |\n",
        args.n
    );
    for &model in &args.capacity_models {
        let sim_cfg: SimConfig = args.sim_config(model);
        let local_sim = sim::LocalSim::start(sim_cfg.clone()).await?;
        let (env, process) = bench_env(args, &sim_cfg, &local_sim.base_url).await?;
        let name = model_label(&sim_cfg);
        let auto = || Setup {
            family: Family::CombeeAuto,
            method: Method::Combee,
            p: 2,
            sizing: Sizing::Auto(ControllerConfig::default()),
        };
        let sequential = Setup {
            family: Family::Sequential,
            method: Method::Sequential,
            p: 1,
            sizing: Sizing::Fixed(grouping::SEQUENTIAL_BATCH),
        };
        let mut secs = Vec::new();
        for setup in [sequential, auto(), Setup { family: Family::CombeeAutoWarm, ..auto() }] {
            secs.push(run_setup(&env, &local_sim.base_url, false, &name, setup).await?.result().total_secs);
        }
        secs.push(process.resumed_round(&env, &local_sim.base_url, &name).await?.result().total_secs);
        let cell = |s: f64| format!("{s:.2} s, {:.1}×", secs[0] / s);
        let resumed = secs[0] / secs[3];
        let _ = writeln!(
            out,
            "| {name} | {:.1} s | {} | {} | {} | ≥ 50×: {} |",
            secs[0],
            cell(secs[1]),
            cell(secs[2]),
            cell(secs[3]),
            if resumed >= 50.0 { "PASS" } else { "FAIL" }
        );
    }
    Ok(out)
}
