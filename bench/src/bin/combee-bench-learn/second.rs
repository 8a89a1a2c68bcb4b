//! The second backlog: N new traces learned on top of the playbook the first
//! backlog taught. A backlog learned from an empty prompt hides what every call
//! costs once there is a playbook (each reflector and aggregator call carries
//! it); here every call does, as in a service that has been learning for a while.

use std::fmt::Write as _;

use combee::{domain::Method, learn::capacity::batch_size::ControllerConfig, llm::client::estimate_tokens};

use crate::bill::bill_section;
use crate::report::sizes_text;
use crate::results::{Family, RunRow, Setup, Sizing};
use crate::runs::{Env, insight_tokens, run_setup, traces_from};
use crate::text::per_trace;

/// Sequential, combee-auto on the defaults and combee-auto at p = 1 (tuned)
/// learning traces N..2N, each starting from `start` (what combee-auto learned
/// from the first backlog). The Markdown section, with its token bill.
pub(crate) async fn second_backlog_section(
    env: &Env,
    base_url: &str,
    model_only: bool,
    name: &str,
    start: &RunRow,
) -> anyhow::Result<String> {
    let n = env.traces.len();
    let first = start.result();
    let (traces, _) = traces_from(n, n)?;
    let env2 = Env {
        llm: env.llm.clone(),
        sim: env.sim.clone(),
        http: env.http.clone(),
        replay: env.replay.clone(),
        base: first.content.clone(),
        traces,
    };
    let auto =
        |family, p| Setup { family, method: Method::Combee, p, sizing: Sizing::Auto(ControllerConfig::default()) };
    let setups = [
        Setup { family: Family::Sequential, method: Method::Sequential, p: 1, sizing: Sizing::Fixed(3) },
        auto(Family::CombeeAuto, 2),
        auto(Family::CombeeAutoTuned, 1),
    ];
    let mut rows = Vec::new();
    for setup in setups {
        rows.push(run_setup(&env2, base_url, model_only, &format!("{name}, second backlog"), setup).await?);
    }
    let old_markers = insight_tokens(&first.content.render());
    let bullets = first.content.playbook.as_ref().map_or(0, |p| p.bullets().count());
    let mut out = format!(
        "### Second backlog: N = {n} new traces on top of the learned playbook (SIMULATED LLM)\n\n\
         Every configuration starts from the prompt {} learned from the first backlog ({bullets} bullets, {} \
         prompt tokens as the simulator counts them) and learns {n} new traces (markers t{n:03}–t{:03}); \
         retention = share of the new markers in the final prompt. Every call now carries a full playbook, as in \
         a service that has been learning for a while. combee-auto p=1 is a tuned setting (`duplication = 1`), \
         not a default.\n\n\
         | configuration | batch sizes | rounds | LLM calls | time to learn (s) | speed-up vs sequential | retention \
         (new markers) | first backlog's markers kept | prompt tokens per trace (total), simulated | completion \
         tokens per trace (total), simulated |\n|---|---|---|---|---|---|---|---|---|---|\n",
        start.setup.label(),
        estimate_tokens(first.content.render().chars().count()),
        2 * n - 1,
    );
    let seq_secs = rows[0].result().total_secs;
    for row in &rows {
        let r = row.result();
        let old_kept = insight_tokens(&r.content.render()).intersection(&old_markers).count();
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {:.2} | {:.1}× | {:.1}% ({}/{n}) | {old_kept}/{} | {} | {} |",
            row.setup.label(),
            sizes_text(r),
            r.rounds.len(),
            r.calls,
            r.total_secs,
            seq_secs / r.total_secs,
            100.0 * r.kept as f64 / n as f64,
            r.kept,
            old_markers.len(),
            per_trace(r.bill.total().prompt, n),
            per_trace(r.bill.total().completion, n),
        );
    }
    if let Some((bill, _)) = bill_section(&rows, n, &format!("#### Token bill of the second backlog ({name})")) {
        out.push('\n');
        out.push_str(&bill);
    }
    Ok(out)
}
