//! The round executor, which runs every step of the method in order for one
//! prompt over a batch of traces — map (one reflector call per trace, [`map`]),
//! augmented shuffle ([`crate::learn::shuffle`]), level-1 reduce (one
//! aggregator call per group against the same frozen version) and level-2
//! reduce ([`reduce`]), validation — as `docs/design.md` (The round, step by
//! step) describes. It knows no store: everything it
//! must not lose goes through a [`RoundJournal`], so a crashed round resumes from
//! its saved reflections and only the missing ones are paid for again.
//!
//! Level 2 departs from a single merge call on purpose: no call is ever asked to
//! restate the union of what the groups learned (playbook `reduce = "llm"`
//! consolidates by decisions on numbered ops; rewrite merges the group
//! instructions structurally against the base) — see [`crate::learn::merge::level2`].
//!
//! Two choices the design leaves open:
//! - A reflection that lands twice in the *same* group is sent to that group's
//!   aggregator once. The augmented shuffle's point is a second chance in another
//!   group; a repeat inside one call buys nothing but tokens.
//! - A trace whose reflector call fails for good (an invalid answer after the
//!   corrective retry) is left out of the round and listed in
//!   [`RoundOutcome::unreflected`] (and in the journal); one bad trace must not
//!   block a prompt forever. It is not consumed: the worker returns it to pending
//!   with one attempt charged — its own failure — so its lesson is not lost.
//!   A transient failure (backend down, timeouts, 429) fails the whole round as
//!   retryable, after the reflections already obtained have been saved.
//! - A level-1 group whose aggregator answer is still invalid after the
//!   corrective retry *degrades* ([`AnswerReport::groups_degraded`]) rather
//!   than failing the round, as level 2 degrades to the union: it contributes
//!   nothing, and with p ≥ 2 its reflections usually still reach the reduce
//!   through their other group. When every group degrades the round learned
//!   nothing and ends with [`RoundError::NothingLearned`] instead of
//!   publishing the base again.
//! - Answers are read tolerantly ([`crate::learn::prompts::answer`]); everything ignored or
//!   dropped is counted per call in [`RoundOutcome::answers`].
//! - Every learned change passes the lesson check ([`screen`]) before it
//!   may enter the version; what it refuses is listed in
//!   [`OutcomeRecord::refused`], and a round whose every change was refused
//!   keeps its base's content (and so publishes nothing).
//! - Provenance: aggregator operations cite the reflections of their group they
//!   came from; [`RoundOutcome::coverage`] says, per reflection, whether an
//!   applied operation cites it — the retention figure a real model gives.

pub mod journal;
mod map;
mod record;
mod reduce;
mod screen;
mod spec;

use std::collections::HashSet;

use uuid::Uuid;

use crate::domain::Method;
use crate::domain::prompt::placeholders;
use crate::domain::{Playbook, Reflection, Strategy, Trace, VersionContent};
use crate::learn::capacity::meter;
use crate::learn::merge::apply;
use crate::learn::merge::budget::Protection;
use crate::learn::shuffle::grouping::{self, Execution};
use crate::llm::{LlmBackend, config::LlmConfig};
use journal::{Phase, RoundJournal};
use map::map_phase;
use reduce::RoundReducer;
use spec::PhaseTimer;
pub use spec::{RoundError, RoundSpec, group_key};

pub use record::{
    AnswerReport, CallNotes, Coverage, DegradedGroup, GroupingRecord, LearnedRoundDetail, Level2Summary,
    MAX_CALL_NOTES, MapCounts, OutcomeRecord, PhaseTimings, ReflectionCoverage, RefusedChange, RoundOutcome,
    Unreflected,
};

/// Runs one round (`docs/design.md`, The round, step by step) over `traces` against the frozen `base` version.
pub async fn run_round(
    backend: &dyn LlmBackend,
    llm: &LlmConfig,
    spec: &RoundSpec,
    base: &VersionContent,
    traces: &[Trace],
    journal: &dyn RoundJournal,
) -> Result<RoundOutcome, RoundError> {
    let mut calls = Vec::new();
    let concurrency = llm.max_concurrency.max(1);

    // 1. Map.
    let clock = PhaseTimer::start(journal, Phase::Map).await?;
    let mapped = map_phase(backend, llm, spec, base, traces, journal, &mut calls).await?;
    let map_ms = clock.finish().await?;
    let (trace_ids, reflections): (Vec<Uuid>, Vec<Reflection>) = mapped.reflections.into_iter().unzip();
    let mut answers = mapped.answers;
    let n = reflections.len();
    if n == 0 {
        return Err(RoundError::NothingToLearn(traces.len()));
    }
    // Tags update the counters once; the result is the frozen version every group sees.
    let frozen = match spec.strategy {
        Strategy::Playbook => VersionContent {
            base: base.base.clone(),
            playbook: Some(apply::apply_bullet_tags(&base.playbook.clone().unwrap_or_default(), &reflections)),
        },
        Strategy::Rewrite => base.clone(),
    };

    // 2. Shuffle and group.
    let clock = PhaseTimer::start(journal, Phase::Shuffle).await?;
    let plan = grouping::plan_sized(
        spec.method,
        n,
        spec.duplication,
        spec.seed,
        spec.group_size.max_group,
        spec.group_size.probe_group,
    );
    let groups: Vec<Vec<usize>> = plan.groups.iter().map(|g| distinct_in_order(g)).collect();
    let shuffle_ms = clock.finish().await?;
    let k = groups.len();
    let largest_group = groups.iter().map(Vec::len).max().unwrap_or(0);
    // A level-2 call may take as many inputs as a level-1 group may hold.
    let fan_in = spec.group_size.max_group.unwrap_or(largest_group).max(2);

    // What this round may not take away is judged on the counters before its own tags.
    let protection = Protection::for_round(&base.playbook.clone().unwrap_or_default(), &spec.budget);
    let ctx = RoundReducer {
        backend,
        llm,
        journal,
        spec,
        trace_ids: &trace_ids,
        reflections: &reflections,
        concurrency,
        protection,
        fan_in,
    };
    let mut result = match plan.execution {
        Execution::Parallel => ctx.parallel(&frozen, &groups, &mut calls, &mut answers).await?,
        Execution::Sequential => ctx.sequential(&frozen, &groups, &mut calls, &mut answers).await?,
    };
    let degraded: HashSet<usize> = answers.groups_degraded.iter().map(|g| g.group).collect();
    let reached: HashSet<usize> =
        groups.iter().enumerate().filter(|(g, _)| !degraded.contains(g)).flat_map(|(_, m)| m.iter().copied()).collect();
    answers.reflections_lost = (0..n).filter(|i| !reached.contains(i)).map(|i| trace_ids[i]).collect();
    let coverage = (spec.strategy == Strategy::Playbook).then(|| Coverage::of(&trace_ids, &result.applied));
    // The round's own copies are the overload meter's samples (p ≥ 2, playbook).
    let p = if spec.method == Method::Combee { spec.duplication.max(1) } else { 1 };
    let meter = (spec.strategy == Strategy::Playbook && p >= 2).then(|| {
        let insights = trace_ids.iter().zip(&reflections).map(|(t, r)| (*t, r.key_insight.clone())).collect();
        meter::observe(&result.group_outputs, &insights)
    });

    // 5. Validate.
    let clock = PhaseTimer::start(journal, Phase::Validate).await?;
    validate_result(base, &result.content, spec).map_err(RoundError::Invalid)?;
    clock.finish().await?;

    result.timings.map_ms = map_ms;
    result.timings.shuffle_ms = shuffle_ms;
    Ok(RoundOutcome {
        content: result.content,
        method: spec.method,
        strategy: spec.strategy,
        group_outputs: result.group_outputs,
        calls,
        record: OutcomeRecord {
            n,
            k,
            resumed_groups: result.resumed_groups,
            p,
            map: mapped.counts,
            unreflected: mapped.unreflected,
            applied: result.applied,
            skipped: result.skipped,
            refused: result.refused,
            evicted: result.evicted,
            level2: result.level2,
            timings: result.timings,
            answers,
            coverage,
            grouping: GroupingRecord {
                group_size: spec.group_size.clone(),
                largest_group,
                fan_in,
                levels: std::iter::once(k).chain(result.levels).collect(),
            },
            meter,
        },
    })
}

/// The indices of a group without repeats, first occurrence first.
fn distinct_in_order(group: &[usize]) -> Vec<usize> {
    let mut seen = HashSet::new();
    group.iter().copied().filter(|i| seen.insert(*i)).collect()
}

/// The publication checks (`docs/design.md`, Publish): not empty, within the budget, every `{placeholder}` of the base kept.
/// A playbook already over its budget before the round (a budget lowered, or
/// the default one met by a playbook learned without it) may only shrink
/// toward it: one round removes at most its removal quota, so holding it to
/// the budget at once would refuse every round.
fn validate_result(base: &VersionContent, new: &VersionContent, spec: &RoundSpec) -> Result<(), String> {
    if new.render().trim().is_empty() {
        return Err("the new prompt is empty".into());
    }
    let budget = &spec.budget;
    match spec.strategy {
        Strategy::Playbook => {
            let pb = new.playbook.as_ref().map_or_else(Playbook::default, Clone::clone);
            let before = base.playbook.as_ref().map_or_else(Playbook::default, Clone::clone);
            if let Some(max) = budget.max_bullets
                && pb.bullet_count() > max.max(before.bullet_count())
            {
                return Err(format!("{} bullets; the budget is {max}", pb.bullet_count()));
            }
            if let Some(max) = budget.max_chars
                && apply::rendered_chars(&pb) > max.max(apply::rendered_chars(&before))
            {
                return Err(format!("playbook is {} characters; the budget is {max}", apply::rendered_chars(&pb)));
            }
        }
        Strategy::Rewrite => {
            let chars = new.base.chars().count();
            if let Some(max) = budget.max_chars
                && chars > max
            {
                return Err(format!("instruction is {chars} characters; the budget is {max}"));
            }
        }
    }
    spec.denylist.check(base, new)?;
    let kept = placeholders(&new.base);
    let lost: Vec<String> = placeholders(&base.base).difference(&kept).map(|p| format!("{{{p}}}")).collect();
    if !lost.is_empty() {
        return Err(format!("the new prompt drops placeholders {}", lost.join(", ")));
    }
    Ok(())
}

#[cfg(test)]
#[path = "round_tests.rs"]
mod tests;
