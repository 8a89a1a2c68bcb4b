//! The report of one simulated model: its Markdown section (settings, the
//! table of configurations, the controller's choices, the meter, the targets)
//! and its CSV rows.

use std::fmt::Write as _;

use combee::{
    learn::capacity::batch_size::ControllerConfig,
    simulation::llm::{CapacityModel, SimConfig},
};

use crate::bill::bill_section;
use crate::results::{Family, RunResult, RunRow, Sizing};
use crate::text::{pass, per_trace};
use crate::{LearnArgs, cores};

pub(crate) struct LearnReport<'a> {
    pub(crate) args: &'a LearnArgs,
    pub(crate) sim: &'a SimConfig,
    pub(crate) auto_cfg: &'a ControllerConfig,
    pub(crate) rows: &'a [RunRow],
    pub(crate) bench_secs: f64,
    /// The overload meter against the markers: the table and whether every judged size is within ±10 points.
    pub(crate) meter: (String, bool),
    /// The second backlog's section (a citing model with `--second-backlog`).
    pub(crate) second: Option<String>,
}

pub(crate) fn sizes_text(r: &RunResult) -> String {
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

pub(crate) fn model_name(m: CapacityModel) -> &'static str {
    match m {
        CapacityModel::Hard => "hard",
        CapacityModel::Soft => "soft",
    }
}

/// The model's name in headings: its capacity model, and whether it cites its sources.
pub(crate) fn model_label(sim: &SimConfig) -> String {
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
pub(crate) fn non_citing(sim: &SimConfig) -> bool {
    sim.rate_no_sources + sim.rate_wrong_sources >= 1.0 - 1e-9
}

impl LearnReport<'_> {
    pub(crate) fn n(&self) -> usize {
        self.args.n
    }

    fn row(&self, family: Family) -> Option<&RunRow> {
        self.rows.iter().find(|r| r.setup.family == family)
    }

    fn fixed(&self, family: Family, bs: usize) -> Option<&RunRow> {
        self.rows.iter().find(|r| r.setup.family == family && matches!(r.setup.sizing, Sizing::Fixed(b) if b == bs))
    }

    pub(crate) fn retention(&self, r: &RunResult) -> f64 {
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

    pub(crate) fn markdown(&self) -> String {
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
             from an in-process replay of the simulator's answers — no timing, no overhead. Tokens: what combee \
             recorded of each call (the `usage` the simulated LLM reported: characters / 4, not a real tokenizer), \
             per trace of the backlog, total in brackets; the token bill below says where they went.\n\n",
        );
        out.push_str(
            "| configuration | batch sizes | rounds | LLM calls | time to learn (s) | modelled (s) | measured / modelled | speed-up vs sequential | retention | prompt tokens per trace (total), simulated | completion tokens per trace (total), simulated |\n\
             |---|---|---|---|---|---|---|---|---|---|---|\n",
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
                "| {} | {} | {} | {} | {} | {:.2} | {} | {:.1}× | {:.1}% ({}/{}) | {} | {} |",
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
                n,
                per_trace(r.bill.total().prompt, n),
                per_trace(r.bill.total().completion, n),
            );
        }
        out.push('\n');

        // The controller's choices.
        for family in [Family::CombeeAuto, Family::CombeeAutoWarm, Family::CombeeAutoResumed] {
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

        // Targets, then the token bill.
        out.push_str(&self.targets());
        let title = format!("### Token bill ({} capacity model)", model_label(self.sim));
        if let Some((bill, _)) = bill_section(self.rows, n, &title) {
            out.push('\n');
            out.push_str(&bill);
        }
        if let Some(second) = &self.second {
            out.push('\n');
            out.push_str(second);
        }
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
        // The speed-up is judged on the warm client, where there is one: the
        // client's concurrency limit starts low and at most doubles per round trip,
        // so a process's first large round pays the ramp once (shown beside it).
        let warm = self.row(Family::CombeeAutoWarm);
        let judged = warm.unwrap_or(auto);
        let measured = seq.result().total_secs / judged.result().total_secs;
        let modelled = seq.modelled.total_secs / judged.modelled.total_secs;
        let auto_ret = self.retention(auto.result()).min(self.retention(judged.result()));
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
            "- Combee-auto speed-up over sequential{}: {measured:.1}× (≥ {speed}×): {} (modelled from the latency formula alone: {modelled:.1}×)",
            if warm.is_some() { ", warm client" } else { "" },
            pass(measured >= speed)
        );
        if warm.is_some() {
            let _ = writeln!(
                out,
                "- Combee-auto speed-up over sequential, the process's first large round (the client's limit still \
                 growing from where sequential's rounds left it): {:.1}× (shown, not judged)",
                seq.result().total_secs / auto.result().total_secs
            );
        }
        if let Some(resumed) = self.row(Family::CombeeAutoResumed) {
            // A backend seen before: the first large round of a new process, its limit resumed from the store.
            let speedup = seq.result().total_secs / resumed.result().total_secs;
            let judged = !non_citing(self.sim);
            let _ = writeln!(
                out,
                "- Combee-auto speed-up over sequential, a new process's first large round on a backend seen before \
                 (its concurrency limit resumed from what the first process kept in the store): {speedup:.1}× {}",
                if judged {
                    format!("(≥ 50×): {}", pass(speedup >= 50.0))
                } else {
                    "(shown, not judged)".to_owned()
                }
            );
        }
        let _ = writeln!(
            out,
            "- Combee-auto retention {:.1}% ({retention_text}; the lower of its runs): {}",
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

    pub(crate) fn csv(&self) -> String {
        let mut out = String::from(
            "configuration,family,method,p,batch_sizes,rounds,llm_calls,time_to_learn_s,modelled_s,speedup_vs_sequential,kept,n,retention,prompt_tokens,completion_tokens\n",
        );
        let seq = self.seq_secs(true);
        for row in self.rows {
            let r = row.result();
            let sizes: Vec<String> = r.rounds.iter().map(|x| x.bs.to_string()).collect();
            let _ = writeln!(
                out,
                "\"{}\",{},{},{},\"{}\",{},{},{:.4},{:.4},{:.3},{},{},{:.4},{},{}",
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
                self.retention(r),
                r.bill.total().prompt,
                r.bill.total().completion,
            );
        }
        out
    }
}
