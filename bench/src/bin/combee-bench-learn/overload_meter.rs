//! The overload meter's estimate against the truth the markers tell, per
//! group size: whether the retention the product reads from a round's own
//! answers is what the groups really kept.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

use combee::{
    domain::Strategy,
    learn::{
        delta::Budget,
        grouping::Method,
        journal::MemoryJournal,
        meter::{self, BucketCounts},
        round::{ReduceMode, RoundSpec, run_round},
        sizing::GroupSize,
    },
};
use uuid::Uuid;

use crate::runs::{Env, insight_tokens};

/// The overload meter against the truth, per group size: Combee rounds of
/// `n` traces at p = 2 with groups bounded at each size, the meter's estimate
/// from the answers' cited sources (as the product makes it) next to the true
/// per-group retention from the markers (which the product never reads).
/// Against the in-process replay of the simulator (same answers, no waiting).
pub(crate) async fn meter_section(env: &Env, n: usize, seeds: u64) -> anyhow::Result<(String, bool)> {
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
