//! What a round leaves on record once all its steps have run: its outcome (the
//! new content and every call), and the part of it the round's record keeps
//! (`detail.outcome`) — grouping, timings, what reading the answers tolerated,
//! provenance coverage, what level 2 did. Plain serialisable data, read back by
//! the UI and the worker; every part defaults so an older record still reads.

use std::collections::HashSet;

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::domain::Method;
use crate::domain::{DeltaOp, Strategy, VersionContent};
use crate::learn::capacity::sizing::GroupSize;
use crate::learn::lesson_check::Rule;
use crate::learn::merge::apply::{Applied, Evicted, Skipped};
use crate::learn::merge::level2;
use crate::learn::prompts::answer::AnswerNotes;
use crate::learn::prompts::task::Task;
use crate::llm::LlmCall;

/// One level-1 aggregator call, as the round's record keeps it.
use crate::domain::GroupOutput;

/// Most answers whose notes a round record lists one by one (it stays small on a
/// round of thousands of traces).
pub const MAX_CALL_NOTES: usize = 1_000;

/// How a round was cut: the group size it was given and the reduce tree it ran.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct GroupingRecord {
    /// The bound on a level-1 group and where it came from (meter estimate or the paper's default).
    pub group_size: GroupSize,
    /// Most distinct reflections one level-1 group of this round held.
    pub largest_group: usize,
    /// Most inputs one level-2 merge takes: the group bound (at least 2).
    pub fan_in: usize,
    /// Calls per level of the reduce tree, level 1 first (`[20, 5, 2, 1]`); a
    /// level 2 that makes no LLM call (the deterministic union) is not a level.
    pub levels: Vec<usize>,
}

/// Wall time of each phase, in milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PhaseTimings {
    pub map_ms: u64,
    pub shuffle_ms: u64,
    pub reduce1_ms: u64,
    pub reduce2_ms: u64,
}

/// A trace left out of the round because its reflection could not be obtained.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Unreflected {
    pub trace_id: Uuid,
    pub error: String,
}

/// How the round's reflections were obtained.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MapCounts {
    /// Reflector calls that succeeded in this attempt.
    pub reflected: usize,
    /// Taken from the journal (an earlier attempt of the round).
    pub resumed: usize,
    /// The agent's own reflection, sent with the trace.
    pub from_traces: usize,
    /// Traces that carried a reflection the prompt's settings say to ignore
    /// (`agent_reflections = "ignore"`): the reflector diagnosed them instead.
    #[serde(default)]
    pub ignored_from_traces: usize,
}

/// The result of a successful round: the validated new content and its provenance.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RoundOutcome {
    pub content: VersionContent,
    pub method: Method,
    pub strategy: Strategy,
    pub group_outputs: Vec<GroupOutput>,
    /// Every LLM call of this attempt, failed ones included.
    pub calls: Vec<LlmCall>,
    /// The rest (n, k, p, what was applied, …): what the round's record keeps.
    /// Its fields read as the outcome's own (`outcome.n`).
    #[serde(flatten)]
    pub record: OutcomeRecord,
}

impl std::ops::Deref for RoundOutcome {
    type Target = OutcomeRecord;
    fn deref(&self) -> &OutcomeRecord {
        &self.record
    }
}

/// What a finished reduce leaves in the round's record (`detail.outcome`): the
/// outcome without its content (the version), calls (stored one by one) and
/// group outputs (`detail.group_outputs`). Every part defaults, so a record
/// written before a part existed still reads.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct OutcomeRecord {
    /// Reflections the reduce used (traces minus [`OutcomeRecord::unreflected`]).
    pub n: usize,
    /// Level-1 groups (aggregator calls before level 2).
    pub k: usize,
    /// Level-1 groups whose output was taken from the journal (an earlier
    /// attempt of the round) instead of calling the aggregator again.
    pub resumed_groups: usize,
    pub p: u32,
    pub map: MapCounts,
    pub unreflected: Vec<Unreflected>,
    /// Playbook mode: ops applied, with the groups that proposed them.
    pub applied: Vec<Applied>,
    pub skipped: Vec<Skipped>,
    /// Learned changes the lesson check refused (`learn::lesson_check`): they
    /// entered no version.
    pub refused: Vec<RefusedChange>,
    pub evicted: Vec<Evicted>,
    /// What level 2 did (consolidation decisions, rewrite conflict regions).
    pub level2: Level2Summary,
    pub timings: PhaseTimings,
    /// What tolerant reading of the answers ignored or dropped, and groups left out.
    pub answers: AnswerReport,
    /// Playbook rounds: which reflections an applied operation cites.
    pub coverage: Option<Coverage>,
    /// The group size chosen, why, and the reduce tree's levels.
    pub grouping: GroupingRecord,
    /// What this round tells the overload meter (playbook Combee rounds at p ≥ 2):
    /// capture–recapture counts per group size, and how the answers were read.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub meter: Option<crate::learn::capacity::meter::MeterReading>,
}

/// A round's record as the learning engine reads and writes it.
pub type LearnedRoundDetail = crate::domain::RoundDetail<OutcomeRecord>;

/// What reading the models' answers ignored or dropped in one round attempt.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct AnswerReport {
    /// Answers that were not exactly the requested JSON but were used.
    pub tolerated_answers: usize,
    /// Unknown keys ignored, over all answers.
    pub unknown_keys: usize,
    /// Items (operations, bullet tags, sources) dropped, over all answers.
    pub dropped_items: usize,
    /// Per used answer with something to report: the call and its notes (at
    /// most [`MAX_CALL_NOTES`]; the counts above stay exact).
    pub calls: Vec<CallNotes>,
    /// Answers with notes past [`MAX_CALL_NOTES`], counted but not listed.
    #[serde(default)]
    pub calls_not_listed: usize,
    /// Level-1 groups that degraded: their aggregator answer stayed invalid
    /// after the corrective retry, so they contributed nothing to the round
    /// (records written before the name changed call them `groups_left_out`).
    #[serde(alias = "groups_left_out")]
    pub groups_degraded: Vec<DegradedGroup>,
    /// Reflections that reached no level-1 answer that was used (every group
    /// holding them degraded).
    pub reflections_lost: Vec<Uuid>,
}

impl AnswerReport {
    pub(super) fn note(&mut self, task: Task, trace_id: Option<Uuid>, group: Option<usize>, notes: AnswerNotes) {
        if notes.is_empty() {
            return;
        }
        self.tolerated_answers += 1;
        self.unknown_keys += notes.unknown_keys.len();
        self.dropped_items += notes.dropped_count;
        if self.calls.len() < MAX_CALL_NOTES {
            self.calls.push(CallNotes { task, trace_id, group, notes });
        } else {
            self.calls_not_listed += 1;
        }
    }
}

/// The notes of one used answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CallNotes {
    pub task: Task,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace_id: Option<Uuid>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<usize>,
    #[serde(flatten)]
    pub notes: AnswerNotes,
}

/// A level-1 group whose aggregator answer stayed invalid after the corrective
/// retry: it contributed no operation (or instruction) to the round.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DegradedGroup {
    pub group: usize,
    pub traces: Vec<Uuid>,
    /// Why the last answer was refused.
    pub error: String,
    /// The text of the last refused answer (bounded like the call's own
    /// `refused_answer`); absent when the group got no answer text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refused_answer: Option<String>,
}

/// A learned change the lesson check refused, with why (see
/// [`crate::learn::lesson_check`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RefusedChange {
    /// The playbook operation refused (absent for a rewritten instruction).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub op: Option<DeltaOp>,
    /// The rewritten instruction refused, cut to 2,000 characters (absent for an operation).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instruction: Option<String>,
    /// The level-1 groups that proposed it (every group, for a merged instruction).
    pub groups: Vec<usize>,
    pub rule: Rule,
    pub reason: String,
}

/// Provenance of a playbook round: per reflection, whether an applied operation
/// cites it as a source.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Coverage {
    /// Reflections cited by at least one applied operation.
    pub covered: usize,
    /// Reflections the reduce used.
    pub n: usize,
    /// covered / n (0 when n = 0).
    pub share: f64,
    pub reflections: Vec<ReflectionCoverage>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReflectionCoverage {
    pub trace_id: Uuid,
    pub covered: bool,
}

impl Coverage {
    pub(super) fn of(trace_ids: &[Uuid], applied: &[Applied]) -> Self {
        let cited: HashSet<usize> = applied.iter().flat_map(|a| a.sources.iter().copied()).collect();
        let reflections: Vec<ReflectionCoverage> = trace_ids
            .iter()
            .enumerate()
            .map(|(i, &trace_id)| ReflectionCoverage { trace_id, covered: cited.contains(&i) })
            .collect();
        let covered = reflections.iter().filter(|r| r.covered).count();
        let n = reflections.len();
        Self { covered, n, share: if n == 0 { 0.0 } else { covered as f64 / n as f64 }, reflections }
    }
}

/// What level 2 did beyond the deterministic union (see [`level2`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Level2Summary {
    /// LLM calls level 2 made (consolidation chunks, or conflict-region merges).
    pub consolidation_calls: usize,
    /// Playbook: ops folded into merges.
    pub merged_inputs: usize,
    /// Playbook: ops a consolidation decision dropped, with the reason.
    pub dropped: Vec<level2::DroppedOp>,
    /// Rewrite: passages the groups changed differently (each merged by the model).
    pub conflict_regions: usize,
    /// Level-2 calls whose answer stayed unreadable after the corrective retry:
    /// their inputs went into the version as the deterministic union has them
    /// (empty: level 2 ran as asked).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub degraded: Vec<level2::DegradedCall>,
}

impl Level2Summary {
    /// Whether level 2 fell back to the union for at least one call.
    pub fn is_degraded(&self) -> bool {
        !self.degraded.is_empty()
    }
}
