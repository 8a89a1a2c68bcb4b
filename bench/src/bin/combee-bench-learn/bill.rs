//! The token bill of learning: the prompt and completion tokens of every LLM
//! call a configuration made, summed from what combee recorded of its calls
//! (each round's journal: the `usage` the backend reported), split by role so
//! the report can say where the tokens went — and checked against what the
//! simulator itself counted as served.

use std::fmt::Write as _;

use crate::results::{Family, RunRow};
use crate::text::pass;

/// A token-bill section: where the tokens of sequential, combee-auto, Combee
/// at fixed sizes and the tuned rows went, and the target on prompt tokens per
/// learned trace (with the ratio). `None` when sequential or combee-auto is missing.
pub(crate) fn bill_section(rows: &[RunRow], n: usize, title: &str) -> Option<(String, f64)> {
    let seq = rows.iter().find(|r| r.setup.family == Family::Sequential)?;
    let auto = rows.iter().find(|r| r.setup.family == Family::CombeeAuto)?;
    let seq_prompt = seq.result().bill.total().prompt as f64;
    let mut out = format!(
        "{title}, SIMULATED LLM\n\n\
         Tokens as the simulated LLM counts them (characters / 4, not a real tokenizer) and reports them in each \
         answer's `usage`, summed from the calls combee recorded in each round's journal; per trace = over the N = \
         {n} traces of the backlog; per kept insight = over the markers the final prompt kept. Both roles carry the \
         current prompt (base and playbook) in every call.\n\n\
         | configuration | reflector calls | prompt tokens per reflector call | aggregator calls | prompt tokens per \
         aggregator call | prompt tokens per trace | per kept insight | prompt tokens per trace vs sequential | \
         completion tokens per trace |\n|---|---|---|---|---|---|---|---|---|\n"
    );
    for row in rows.iter().filter(|r| {
        matches!(
            r.setup.family,
            Family::Sequential | Family::CombeeAuto | Family::CombeeAutoTuned | Family::CombeeTuned | Family::Combee
        )
    }) {
        let r = row.result();
        let (b, t) = (r.bill, r.bill.total());
        let _ = writeln!(
            out,
            "| {} | {} | {:.0} | {} | {:.0} | {:.0} | {:.0} | {:.2}× | {:.0} |",
            row.setup.label(),
            b.reflector.calls,
            b.reflector.prompt_per_call(),
            b.aggregator.calls,
            b.aggregator.prompt_per_call(),
            t.prompt as f64 / n as f64,
            t.prompt as f64 / r.kept.max(1) as f64,
            t.prompt as f64 / seq_prompt,
            t.completion as f64 / n as f64,
        );
    }
    let ratio = auto.result().bill.total().prompt as f64 / seq_prompt;
    let _ = writeln!(
        out,
        "\n- Combee-auto prompt tokens per learned trace {:.2}× sequential's (≤ 1.5×), at retention {:.1}% vs {:.1}%: {}",
        ratio,
        100.0 * auto.result().kept as f64 / n as f64,
        100.0 * seq.result().kept as f64 / n as f64,
        pass(ratio <= 1.5)
    );
    let served: Vec<_> = rows.iter().filter_map(|r| r.served.map(|s| (r, s))).collect();
    if !served.is_empty() {
        let agree = served.iter().all(|(r, s)| {
            let t = r.result().bill.total();
            *s == (t.prompt, t.completion)
        });
        let _ = writeln!(
            out,
            "- Combee's record of the calls against the simulator's own count of the tokens it served, over {} \
             measured runs: {}",
            served.len(),
            if agree { "equal in every run" } else { "DIFFERENT in at least one run" }
        );
    }
    Some((out, ratio))
}
