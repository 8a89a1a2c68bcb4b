//! The reduce step of a round, the part that calls the backend: level 1 (one
//! aggregator call per group against the same frozen version, journaled as
//! each answers, resumed from the journal) and level 2, which runs what
//! [`crate::learn::merge`] plans as pure functions — the deterministic union
//! of playbook operations, or a consolidation / structural merge in a scan tree
//! of bounded fan-in; and the sequential baseline, where each group is applied
//! before the next.

use std::collections::{HashMap, HashSet};

use futures_util::StreamExt;
use futures_util::stream;
use serde_json::{Value, json};
use uuid::Uuid;

use super::journal::{JournalError, Phase, RoundJournal};
use super::record::{AnswerReport, DegradedGroup, Level2Summary, PhaseTimings, RefusedChange};
use super::screen;
use super::spec::{PhaseTimer, RoundError, RoundSpec, group_key};
use crate::domain::GroupOutput;
use crate::domain::{DeltaOp, ReduceMode, Reflection, Strategy, VersionContent};
use crate::learn::merge::apply::{self, Applied, Evicted, Skipped};
use crate::learn::merge::budget::Protection;
use crate::learn::merge::dedupe::{self, MergedOp};
use crate::learn::merge::level2;
use crate::learn::prompts::answer::AnswerNotes;
use crate::learn::prompts::calls;
use crate::learn::prompts::decode::SourcedOp;
use crate::learn::prompts::task::Task;

use crate::llm::{LlmBackend, LlmCall, LlmError, config::LlmConfig};

/// What the reduce step produces: the new content and what went into it.
pub(super) struct ReduceOutcome {
    pub(super) content: VersionContent,
    pub(super) applied: Vec<Applied>,
    pub(super) skipped: Vec<Skipped>,
    /// What the lesson check refused.
    pub(super) refused: Vec<RefusedChange>,
    pub(super) evicted: Vec<Evicted>,
    pub(super) group_outputs: Vec<GroupOutput>,
    pub(super) level2: Level2Summary,
    pub(super) timings: PhaseTimings,
    pub(super) resumed_groups: usize,
    /// Merge nodes per level-2 tree level that made LLM calls (empty: level 2 is mechanical).
    pub(super) levels: Vec<usize>,
}

/// One group's level-1 aggregator answer: playbook operations or a rewritten instruction.
pub(super) enum GroupAnswer {
    /// Operations with their sources as positions in the group.
    Ops(Vec<SourcedOp>),
    Instruction(String),
}

impl GroupAnswer {
    fn to_json(&self) -> Value {
        match self {
            Self::Ops(ops) => json!({ "operations": ops }),
            Self::Instruction(text) => json!({ "instruction": text }),
        }
    }

    /// Reads back what [`GroupAnswer::to_json`] wrote (a journaled group output);
    /// `None` when it is not that shape.
    fn from_json(v: &Value) -> Option<Self> {
        if let Some(text) = v.get("instruction").and_then(Value::as_str) {
            return Some(Self::Instruction(text.to_owned()));
        }
        let ops = v.get("operations")?.as_array()?;
        ops.iter()
            .map(|op| {
                let mut op = op.as_object()?.clone();
                let sources = match op.remove("sources") {
                    None => Vec::new(),
                    Some(s) => serde_json::from_value(s).ok()?,
                };
                let op: DeltaOp = serde_json::from_value(Value::Object(op)).ok()?;
                Some(SourcedOp { op, sources })
            })
            .collect::<Option<Vec<_>>>()
            .map(Self::Ops)
    }

    /// Playbook ops of group `g` with their sources as indices into the round's reflections.
    fn round_ops(self, g: usize, group: &[usize]) -> Vec<(usize, DeltaOp, Vec<usize>)> {
        match self {
            Self::Ops(ops) => ops
                .into_iter()
                .map(|s| (g, s.op, s.sources.iter().filter_map(|&p| group.get(p).copied()).collect()))
                .collect(),
            Self::Instruction(_) => Vec::new(),
        }
    }
}

/// The reduce step of one round: its inputs, the backend it calls and the
/// round's removal protection; its methods run level 1 and level 2.
pub(super) struct RoundReducer<'a> {
    pub(super) backend: &'a dyn LlmBackend,
    pub(super) llm: &'a LlmConfig,
    pub(super) journal: &'a dyn RoundJournal,
    pub(super) spec: &'a RoundSpec,
    pub(super) trace_ids: &'a [Uuid],
    pub(super) reflections: &'a [Reflection],
    pub(super) concurrency: usize,
    pub(super) protection: Protection,
    /// Most inputs one level-2 merge node takes.
    pub(super) fan_in: usize,
}

impl RoundReducer<'_> {
    /// One aggregator call for `group` against `current`.
    async fn aggregate(
        &self,
        current: &VersionContent,
        group: &[usize],
        calls: &mut Vec<LlmCall>,
    ) -> Result<(GroupAnswer, AnswerNotes), LlmError> {
        let rs: Vec<Reflection> = group.iter().map(|&i| self.reflections[i].clone()).collect();
        match self.spec.strategy {
            Strategy::Playbook => calls::aggregate_playbook(self.backend, self.llm, current, &rs, calls)
                .await
                .map(|a| (GroupAnswer::Ops(a.value), a.notes)),
            Strategy::Rewrite => calls::aggregate_rewrite(self.backend, self.llm, current, &rs, calls)
                .await
                .map(|a| (GroupAnswer::Instruction(a.value), a.notes)),
        }
    }

    fn task(&self) -> Task {
        match self.spec.strategy {
            Strategy::Playbook => Task::AggregatePlaybook,
            Strategy::Rewrite => Task::AggregateRewrite,
        }
    }

    /// Records a group whose answer failed: a non-retryable failure (an answer
    /// still invalid after the corrective retry) degrades the group — it
    /// contributes nothing, and its reason and refused text go on record;
    /// anything else fails the round.
    fn degrade(
        &self,
        g: usize,
        group: &[usize],
        e: LlmError,
        made: &[LlmCall],
        answers: &mut AnswerReport,
    ) -> Result<(), LlmError> {
        if e.is_retryable() || !matches!(e, LlmError::InvalidAnswer { .. }) {
            return Err(e);
        }
        tracing::warn!(group = g, reflections = group.len(), error = %e, "level-1 group degraded: its answer stayed invalid");
        answers.groups_degraded.push(DegradedGroup {
            group: g,
            traces: group.iter().map(|&i| self.trace_ids[i]).collect(),
            error: e.to_string(),
            refused_answer: made.iter().rev().find_map(|c| c.refused_answer.clone()),
        });
        Ok(())
    }

    async fn record(
        &self,
        current: &VersionContent,
        g: usize,
        group: &[usize],
        proposal: &GroupAnswer,
        made: Vec<LlmCall>,
        calls: &mut Vec<LlmCall>,
    ) -> Result<GroupOutput, JournalError> {
        self.journal.record_calls(&made).await?;
        calls.extend(made);
        let traces: Vec<Uuid> = group.iter().map(|&i| self.trace_ids[i]).collect();
        let out = GroupOutput {
            group: g,
            key: group_key(self.spec.seed, self.spec.strategy, current, &traces),
            traces,
            output: proposal.to_json(),
        };
        self.journal.save_group_output(&out).await?;
        Ok(out)
    }

    /// Level-1 outputs journaled by earlier attempts of this round, by key
    /// (outputs without a key, from before keys existed, are not reused).
    async fn journaled_outputs(&self) -> Result<HashMap<String, GroupOutput>, JournalError> {
        let stored = self.journal.stored_group_outputs().await?;
        Ok(stored.into_iter().filter(|o| !o.key.is_empty()).map(|o| (o.key.clone(), o)).collect())
    }

    /// The journaled output of group `g` when its call was already paid for
    /// against `current` with the same traces.
    fn resume(
        &self,
        journaled: &HashMap<String, GroupOutput>,
        current: &VersionContent,
        g: usize,
        group: &[usize],
    ) -> Option<(GroupAnswer, GroupOutput)> {
        let traces: Vec<Uuid> = group.iter().map(|&i| self.trace_ids[i]).collect();
        let out = journaled.get(&group_key(self.spec.seed, self.spec.strategy, current, &traces))?;
        let proposal = GroupAnswer::from_json(&out.output)?;
        Some((proposal, GroupOutput { group: g, ..out.clone() }))
    }

    /// Combee and naive: level 1 in parallel against the same frozen version, then level 2 once.
    pub(super) async fn parallel(
        &self,
        frozen: &VersionContent,
        groups: &[Vec<usize>],
        calls: &mut Vec<LlmCall>,
        report: &mut AnswerReport,
    ) -> Result<ReduceOutcome, RoundError> {
        let clock = PhaseTimer::start(self.journal, Phase::Reduce1).await?;
        let journaled = self.journaled_outputs().await?;
        let mut proposals = Vec::with_capacity(groups.len());
        let mut group_outputs = Vec::with_capacity(groups.len());
        for (g, group) in groups.iter().enumerate() {
            if let Some((p, out)) = self.resume(&journaled, frozen, g, group) {
                proposals.push((g, p));
                group_outputs.push(out);
            }
        }
        let resumed_groups = proposals.len();
        let resumed: HashSet<usize> = proposals.iter().map(|(g, _)| *g).collect();
        let group_calls: Vec<_> = groups
            .iter()
            .enumerate()
            .filter(|(g, _)| !resumed.contains(g))
            .map(|(g, group)| async move {
                let mut made = Vec::new();
                let r = self.aggregate(frozen, group, &mut made).await;
                (g, r, made)
            })
            .collect();
        let mut answers = stream::iter(group_calls).buffered(self.concurrency);
        let mut failure: Option<LlmError> = None;
        while let Some((g, r, made)) = answers.next().await {
            match r {
                Ok((p, notes)) => {
                    report.note(self.task(), None, Some(g), notes);
                    group_outputs.push(self.record(frozen, g, &groups[g], &p, made, calls).await?);
                    proposals.push((g, p));
                }
                Err(e) => {
                    self.journal.record_calls(&made).await?;
                    if let Err(e) = self.degrade(g, &groups[g], e, &made, report) {
                        // Prefer reporting a fatal failure: retrying would not help.
                        if failure.as_ref().is_none_or(LlmError::is_retryable) {
                            failure = Some(e);
                        }
                    }
                    calls.extend(made);
                }
            }
        }
        if let Some(e) = failure {
            return Err(e.into());
        }
        if proposals.is_empty() {
            return Err(nothing_learned(report));
        }
        let reduce1_ms = clock.finish().await?;
        // Level 2 sees the groups in their order, resumed or not, as an uninterrupted round would.
        proposals.sort_by_key(|(g, _)| *g);
        group_outputs.sort_by_key(|o| o.group);

        let clock = PhaseTimer::start(self.journal, Phase::Reduce2).await?;
        let mut reduced = match self.spec.strategy {
            Strategy::Playbook => self.level2_playbook(frozen, groups, proposals, calls).await?,
            Strategy::Rewrite => self.level2_rewrite(frozen, proposals, calls).await?,
        };
        reduced.timings.reduce1_ms = reduce1_ms;
        reduced.timings.reduce2_ms = clock.finish().await?;
        reduced.group_outputs = group_outputs;
        reduced.resumed_groups = resumed_groups;
        Ok(reduced)
    }

    async fn level2_playbook(
        &self,
        frozen: &VersionContent,
        groups: &[Vec<usize>],
        proposals: Vec<(usize, GroupAnswer)>,
        calls: &mut Vec<LlmCall>,
    ) -> Result<ReduceOutcome, RoundError> {
        let mut summary = Level2Summary::default();
        let mut levels = Vec::new();
        let mut refused = Vec::new();
        let base = frozen.base.as_str();
        let tree = level2::scan_tree(proposals.len(), self.fan_in);
        let merged = if self.spec.reduce == ReduceMode::Llm && tree.len() > 1 {
            // More group outputs than one call may take: a scan tree of consolidations.
            let mut nodes: Vec<Vec<MergedOp>> = Vec::with_capacity(proposals.len());
            for (g, p) in proposals {
                nodes.push(dedupe::normalize_sourced_ops(screen::raw_ops(
                    p.round_ops(g, &groups[g]),
                    base,
                    &mut refused,
                )));
            }
            for level in &tree {
                let mut inputs: Vec<Option<Vec<MergedOp>>> = std::mem::take(&mut nodes).into_iter().map(Some).collect();
                let node_inputs: Vec<Vec<Vec<MergedOp>>> =
                    level.iter().map(|r| r.clone().map(|i| inputs[i].take().unwrap_or_default()).collect()).collect();
                let node_calls = node_inputs.into_iter().map(|children| async move {
                    let ops = level2::union_of_nodes(children);
                    let mut made = Vec::new();
                    if ops.len() <= 1 {
                        return Ok::<_, RoundError>((level2::Consolidated { ops, ..Default::default() }, 0, made));
                    }
                    let (c, n) = self.consolidate(frozen, &ops, &mut made).await?;
                    Ok((c, n, made))
                });
                for (c, n, made) in futures_util::future::try_join_all(node_calls).await? {
                    calls.extend(made);
                    summary.consolidation_calls += n;
                    summary.merged_inputs += c.merged_inputs;
                    summary.dropped.extend(c.dropped);
                    summary.degraded.extend(c.degraded);
                    nodes.push(c.ops);
                }
                levels.push(level.len());
            }
            nodes.pop().unwrap_or_default()
        } else {
            let union = proposals.into_iter().flat_map(|(g, p)| p.round_ops(g, &groups[g])).collect();
            let mut merged = dedupe::normalize_sourced_ops(screen::raw_ops(union, base, &mut refused));
            if self.spec.reduce == ReduceMode::Llm && merged.len() > 1 {
                let mut made = Vec::new();
                let consolidated = self.consolidate(frozen, &merged, &mut made).await?;
                calls.extend(made);
                summary.consolidation_calls = consolidated.1;
                summary.merged_inputs = consolidated.0.merged_inputs;
                summary.dropped = consolidated.0.dropped;
                summary.degraded = consolidated.0.degraded;
                merged = consolidated.0.ops;
                levels.push(1);
            }
            merged
        };
        // A consolidation may have rewritten what it merged or edited: checked again.
        let merged = screen::merged_ops(merged, base, &mut refused);
        let playbook = frozen.playbook.clone().unwrap_or_default();
        let outcome = apply::apply_ops_protected(&playbook, &merged, &self.spec.budget, &mut self.protection.clone());
        Ok(ReduceOutcome {
            content: VersionContent { base: frozen.base.clone(), playbook: Some(outcome.playbook) },
            applied: outcome.applied,
            skipped: outcome.skipped,
            refused,
            evicted: outcome.evicted,
            group_outputs: Vec::new(),
            level2: summary,
            timings: PhaseTimings::default(),
            resumed_groups: 0,
            levels,
        })
    }

    /// Consolidation by decisions (see [`level2`]): chunks of related ops, one call
    /// each, in parallel; ops no decision names pass through. Returns the result
    /// and the number of calls.
    async fn consolidate(
        &self,
        frozen: &VersionContent,
        ops: &[MergedOp],
        calls: &mut Vec<LlmCall>,
    ) -> Result<(level2::Consolidated, usize), RoundError> {
        let chunks = level2::consolidation_chunks(ops, level2::CONSOLIDATE_MAX_OPS);
        let chunk_calls: Vec<_> = chunks
            .iter()
            .map(|idx| async move {
                let part: Vec<MergedOp> = idx.iter().map(|&i| ops[i].clone()).collect();
                let mut made = Vec::new();
                let r = calls::consolidate_playbook(self.backend, self.llm, frozen, &part, &mut made).await;
                (idx, part, r, made)
            })
            .collect();
        let mut answers = stream::iter(chunk_calls).buffered(self.concurrency);
        let mut out = level2::Consolidated::default();
        let n = chunks.len();
        let mut placed: Vec<(usize, MergedOp)> = Vec::new();
        while let Some((idx, part, r, made)) = answers.next().await {
            self.journal.record_calls(&made).await?;
            calls.extend(made);
            // An answer still unreadable after its corrective retry (or whose
            // decisions cannot be applied) degrades to the union: the chunk's ops
            // pass through as they are. A transient failure still fails the round.
            let decided = match r {
                Ok(decisions) => level2::apply_decisions(&part, &decisions),
                Err(e) if unreadable(&e) => Err(e.to_string()),
                Err(e) => return Err(e.into()),
            };
            match decided {
                Ok(decided) => {
                    placed.extend(decided.positions.iter().map(|&p| idx[p]).zip(decided.ops));
                    out.dropped.extend(decided.dropped);
                    out.merged_inputs += decided.merged_inputs;
                }
                Err(error) => {
                    tracing::warn!(ops = part.len(), %error, "level 2 degraded to the union for one consolidation");
                    out.degraded.push(level2::DegradedCall { inputs: part.len(), error });
                    placed.extend(idx.iter().copied().zip(part));
                }
            }
        }
        // Chunks regroup ops by section; restore the order of first proposal.
        placed.sort_by_key(|(at, _)| *at);
        (out.positions, out.ops) = placed.into_iter().unzip();
        Ok((out, n))
    }

    pub(super) async fn level2_rewrite(
        &self,
        frozen: &VersionContent,
        proposals: Vec<(usize, GroupAnswer)>,
        calls: &mut Vec<LlmCall>,
    ) -> Result<ReduceOutcome, RoundError> {
        let (base, max_chars) = (frozen.base.as_str(), self.spec.budget.max_chars);
        let mut refused = Vec::new();
        let mut nodes: Vec<String> = Vec::with_capacity(proposals.len());
        let mut admitted = Vec::new();
        for (g, p) in proposals {
            if let GroupAnswer::Instruction(t) = p
                && let Some(t) = screen::instruction(t, vec![g], base, max_chars, &mut refused)
            {
                nodes.push(t);
                admitted.push(g);
            }
        }
        let mut summary = Level2Summary::default();
        let mut levels = Vec::new();
        if nodes.len() > 1 {
            // The structural k-way merge against the base (see [`level2`]), in a
            // scan tree when there are more proposals than one merge may take.
            for level in level2::scan_tree(nodes.len(), self.fan_in) {
                let mut inputs: Vec<Option<String>> = std::mem::take(&mut nodes).into_iter().map(Some).collect();
                let node_inputs: Vec<Vec<String>> =
                    level.iter().map(|r| r.clone().filter_map(|i| inputs[i].take()).collect()).collect();
                let node_calls = node_inputs.into_iter().map(|texts| self.merge_instructions(frozen, texts));
                for (text, regions, made, degraded) in futures_util::future::try_join_all(node_calls).await? {
                    summary.conflict_regions += regions;
                    summary.degraded.extend(degraded);
                    summary.consolidation_calls += made.len();
                    calls.extend(made);
                    nodes.push(text);
                }
                levels.push(level.len());
            }
        }
        // The merged text is checked as a whole; refused, the base stays as it was.
        let merged = nodes.pop().and_then(|t| screen::instruction(t, admitted, base, max_chars, &mut refused));
        Ok(ReduceOutcome {
            content: VersionContent {
                base: merged.unwrap_or_else(|| base.to_owned()),
                playbook: frozen.playbook.clone(),
            },
            applied: Vec::new(),
            skipped: Vec::new(),
            refused,
            evicted: Vec::new(),
            group_outputs: Vec::new(),
            level2: summary,
            timings: PhaseTimings::default(),
            resumed_groups: 0,
            levels,
        })
    }

    /// One merge node of the rewrite strategy: `texts` merged structurally
    /// against the base, only the conflict regions going to the model. Returns
    /// the text, the number of conflict regions, the calls made and the merges
    /// that degraded to the union of their versions.
    async fn merge_instructions(
        &self,
        frozen: &VersionContent,
        mut texts: Vec<String>,
    ) -> Result<(String, usize, Vec<LlmCall>, Vec<level2::DegradedCall>), RoundError> {
        if texts.len() <= 1 {
            return Ok((texts.pop().unwrap_or_else(|| frozen.base.clone()), 0, Vec::new(), Vec::new()));
        }
        let plan = level2::plan_rewrite_merge(&frozen.base, &texts);
        let regions = level2::conflicts(&plan);
        let conflict_regions = regions.len();
        let region_calls: Vec<_> = regions
            .into_iter()
            .map(|(base, variants)| async move {
                let mut made = Vec::new();
                let r = self.merge_region(base, variants, &mut made).await;
                (r, made)
            })
            .collect();
        let mut answers = stream::iter(region_calls).buffered(self.concurrency);
        let mut resolved = Vec::new();
        let mut failure = None;
        let mut calls = Vec::new();
        let mut degraded = Vec::new();
        while let Some((r, made)) = answers.next().await {
            self.journal.record_calls(&made).await?;
            calls.extend(made);
            match r {
                Ok((text, fell_back)) => {
                    resolved.push(text);
                    degraded.extend(fell_back);
                }
                Err(e) => {
                    failure.get_or_insert(e);
                }
            }
        }
        if let Some(e) = failure {
            return Err(e.into());
        }
        let text = level2::assemble(&plan, &resolved)
            .ok_or_else(|| RoundError::Invalid("the rewrite merge lost a conflict region".into()))?;
        Ok((text, conflict_regions, calls, degraded))
    }

    /// Merges the groups' versions of one conflicting passage in a tree of
    /// bounded fan-in; each call sees only the passage and at most
    /// [`level2::REGION_FAN_IN`] versions of it. A merge whose answer stays
    /// unreadable degrades to the union of its versions' lines (listed).
    async fn merge_region(
        &self,
        base: String,
        mut variants: Vec<String>,
        calls: &mut Vec<LlmCall>,
    ) -> Result<(String, Vec<level2::DegradedCall>), LlmError> {
        let passage = VersionContent { base, playbook: None };
        let mut degraded = Vec::new();
        while variants.len() > 1 {
            let mut next = Vec::new();
            for r in level2::tree_level(variants.len(), level2::REGION_FAN_IN) {
                let chunk = &variants[r];
                if chunk.len() == 1 {
                    next.push(chunk[0].clone());
                    continue;
                }
                match calls::merge_rewrite(self.backend, self.llm, &passage, chunk, calls).await {
                    Ok(text) => next.push(text),
                    Err(e) if unreadable(&e) => {
                        tracing::warn!(versions = chunk.len(), error = %e, "level 2 degraded to the union for one passage");
                        degraded.push(level2::DegradedCall { inputs: chunk.len(), error: e.to_string() });
                        next.push(level2::union_of_lines(chunk));
                    }
                    Err(e) => return Err(e),
                }
            }
            variants = next;
        }
        Ok((variants.pop().unwrap_or(passage.base), degraded))
    }

    /// The sequential baseline: each batch is aggregated against the result of
    /// the previous one and applied before the next; there is no level 2.
    pub(super) async fn sequential(
        &self,
        frozen: &VersionContent,
        groups: &[Vec<usize>],
        calls: &mut Vec<LlmCall>,
        report: &mut AnswerReport,
    ) -> Result<ReduceOutcome, RoundError> {
        let clock = PhaseTimer::start(self.journal, Phase::Reduce1).await?;
        let mut current = frozen.clone();
        let mut protection = self.protection.clone();
        let mut reduced = ReduceOutcome {
            content: frozen.clone(),
            applied: Vec::new(),
            skipped: Vec::new(),
            refused: Vec::new(),
            evicted: Vec::new(),
            group_outputs: Vec::new(),
            level2: Level2Summary::default(),
            timings: PhaseTimings::default(),
            resumed_groups: 0,
            levels: Vec::new(),
        };
        let journaled = self.journaled_outputs().await?;
        for (g, group) in groups.iter().enumerate() {
            let proposal = if let Some((p, out)) = self.resume(&journaled, &current, g, group) {
                reduced.group_outputs.push(out);
                reduced.resumed_groups += 1;
                p
            } else {
                let mut made = Vec::new();
                let answer = self.aggregate(&current, group, &mut made).await;
                let proposal = match answer {
                    Ok((p, notes)) => {
                        report.note(self.task(), None, Some(g), notes);
                        p
                    }
                    Err(e) => {
                        self.journal.record_calls(&made).await?;
                        self.degrade(g, group, e, &made, report)?;
                        calls.extend(made);
                        continue;
                    }
                };
                reduced.group_outputs.push(self.record(&current, g, group, &proposal, made, calls).await?);
                proposal
            };
            match proposal {
                p @ GroupAnswer::Ops(_) => {
                    let admitted = screen::raw_ops(p.round_ops(g, group), &frozen.base, &mut reduced.refused);
                    let merged = dedupe::normalize_sourced_ops(admitted);
                    let playbook = current.playbook.clone().unwrap_or_default();
                    let outcome = apply::apply_ops_protected(&playbook, &merged, &self.spec.budget, &mut protection);
                    current.playbook = Some(outcome.playbook);
                    reduced.applied.extend(outcome.applied);
                    reduced.skipped.extend(outcome.skipped);
                    reduced.evicted.extend(outcome.evicted);
                }
                GroupAnswer::Instruction(text) => {
                    let max_chars = self.spec.budget.max_chars;
                    if let Some(text) =
                        screen::instruction(text, vec![g], &frozen.base, max_chars, &mut reduced.refused)
                    {
                        current.base = text;
                    }
                }
            }
        }
        if report.groups_degraded.len() == groups.len() {
            return Err(nothing_learned(report));
        }
        reduced.timings.reduce1_ms = clock.finish().await?;
        let clock = PhaseTimer::start(self.journal, Phase::Reduce2).await?;
        reduced.timings.reduce2_ms = clock.finish().await?;
        reduced.content = current;
        Ok(reduced)
    }
}

/// Whether a failed level-2 call is one the round survives by degrading to the
/// union: the model's answer stayed unreadable after the corrective retry.
fn unreadable(e: &LlmError) -> bool {
    matches!(e, LlmError::InvalidAnswer { .. })
}

/// The end of a round whose every level-1 group degraded: nothing to publish.
fn nothing_learned(report: &AnswerReport) -> RoundError {
    let last = report.groups_degraded.last().map_or_else(String::new, |d| d.error.clone());
    RoundError::NothingLearned { groups: report.groups_degraded.len(), last }
}
