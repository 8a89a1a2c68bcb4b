//! The round executor: one learning step for one prompt over a batch of traces —
//! map (one reflector call per trace), augmented shuffle, level-1 reduce (one
//! aggregator call per group against the same frozen version), level-2 reduce,
//! validation — as `docs/design.md` (The round, step by step) describes. It knows no store: everything it
//! must not lose goes through a [`RoundJournal`], so a crashed round resumes from
//! its saved reflections and only the missing ones are paid for again.
//!
//! Level 2 departs from a single merge call on purpose: no call is ever asked to
//! restate the union of what the groups learned (playbook `reduce = "llm"`
//! consolidates by decisions on numbered ops; rewrite merges the group
//! instructions structurally against the base) — see [`super::level2`].
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
//!   corrective retry is *left out* ([`AnswerReport::groups_left_out`]) rather
//!   than failing the round, unless more than [`MAX_LEFT_OUT_SHARE`] of the
//!   groups (or all of them) are: then the round fails as before. With p ≥ 2
//!   its reflections usually still reach the reduce through their other group.
//! - Answers are read tolerantly ([`super::answer`]); everything ignored or
//!   dropped is counted per call in [`RoundOutcome::answers`].
//! - Provenance: aggregator operations cite the reflections of their group they
//!   came from; [`RoundOutcome::coverage`] says, per reflection, whether an
//!   applied operation cites it — the retention figure a real model gives.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use futures_util::StreamExt;
use futures_util::stream;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use uuid::Uuid;

use super::delta::{self, Applied, Budget, Evicted, Guard, MergedOp, Skipped};
use super::grouping::{self, Execution, Method};
use super::journal::{JournalError, Phase, PhaseEvent, ReflectionSource, RoundJournal};
use super::level2;
use super::sizing::GroupSize;
use crate::domain::{AgentReflections, DeltaOp, Playbook, Reflection, Strategy, Trace, VersionContent};
use crate::learn::answer::AnswerNotes;
use crate::learn::protocol::{self, SourcedOp, Task, placeholders, validate_reflection};
use crate::llm::{LlmBackend, LlmCall, LlmConfig, LlmError};

/// Most level-1 groups a round may leave out (invalid answers after the
/// corrective retry), as a share of its groups; above it, or when every group
/// fails, the round fails.
pub const MAX_LEFT_OUT_SHARE: f64 = 1.0 / 3.0;

/// Most answers whose notes a round record lists one by one (it stays small on a
/// round of thousands of traces).
pub const MAX_CALL_NOTES: usize = 1_000;

/// A prompt setting; defined in `domain` so the domain need not import the learning engine.
pub use crate::domain::prompt::ReduceMode;

/// What a round is asked to do; fixed when the round is created, so a resumed
/// round regroups identically.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RoundSpec {
    pub round_id: Uuid,
    pub seed: u64,
    pub method: Method,
    pub strategy: Strategy,
    /// p: how many times each reflection enters the augmented shuffle (Combee only).
    pub duplication: u32,
    pub reduce: ReduceMode,
    pub budget: Budget,
    /// Whether a valid reflection an agent sent with its trace replaces the reflector call.
    #[serde(default)]
    pub agent_reflections: AgentReflections,
    /// Lines learned content must not add (from the configuration, not stored with the round).
    #[serde(skip)]
    pub denylist: std::sync::Arc<super::denylist::ContentDenylist>,
    /// Most reflections one level-1 call may be given (Combee), and why — from
    /// the overload meter ([`super::sizing`]); it also bounds level 2's fan-in.
    #[serde(default)]
    pub group_size: GroupSize,
}

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

/// One level-1 aggregator call, as the round's record keeps it.
pub use crate::domain::GroupOutput;

/// The journal key of one level-1 call: the round's seed and strategy, the
/// version the call was made against, and the group's traces in order (their
/// reflections are journaled, so the same traces mean the same input). The
/// grouping is deterministic per seed, so a resumed round with the same
/// reflections meets the same keys; one whose reflections changed does not.
pub fn group_key(seed: u64, strategy: Strategy, current: &VersionContent, traces: &[Uuid]) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    h.update(seed.to_be_bytes());
    h.update(crate::domain::round::strategy_str(strategy).as_bytes());
    h.update(current.hash().as_bytes());
    for t in traces {
        h.update(t.as_bytes());
    }
    format!("sha256:{}", hex::encode(h.finalize()))
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
    /// Level-1 groups left out because their answer stayed invalid after the corrective retry.
    pub groups_left_out: Vec<GroupLeftOut>,
    /// Reflections that reached no level-1 answer that was used (every group
    /// holding them was left out).
    pub reflections_lost: Vec<Uuid>,
}

impl AnswerReport {
    fn note(&mut self, task: Task, trace_id: Option<Uuid>, group: Option<usize>, notes: AnswerNotes) {
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

/// A level-1 group left out of the round.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupLeftOut {
    pub group: usize,
    pub traces: Vec<Uuid>,
    pub error: String,
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
    fn of(trace_ids: &[Uuid], applied: &[Applied]) -> Self {
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

/// Why a round failed. [`RoundError::is_retryable`] tells the worker whether to try again later.
#[derive(Debug, thiserror::Error)]
pub enum RoundError {
    #[error("LLM call failed: {0}")]
    Llm(#[from] LlmError),
    #[error(transparent)]
    Journal(#[from] JournalError),
    /// The round produced content that must not become a version.
    #[error("round result rejected: {0}")]
    Invalid(String),
    #[error("no trace could be reflected ({0} tried)")]
    NothingToLearn(usize),
}

impl RoundError {
    /// Transient LLM failures and journal (store) failures are retryable; an
    /// invalid result, an invalid answer or a misconfiguration is not.
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::Llm(e) => e.is_retryable(),
            Self::Journal(_) => true,
            Self::Invalid(_) | Self::NothingToLearn(_) => false,
        }
    }
}

fn ms_since(t: Instant) -> u64 {
    u64::try_from(t.elapsed().as_millis()).unwrap_or(u64::MAX)
}

/// Times a phase and journals its start and end.
struct PhaseClock<'a> {
    journal: &'a dyn RoundJournal,
    phase: Phase,
    started: Instant,
}

impl<'a> PhaseClock<'a> {
    async fn start(journal: &'a dyn RoundJournal, phase: Phase) -> Result<Self, JournalError> {
        journal.phase(phase, PhaseEvent::Started).await?;
        Ok(Self { journal, phase, started: Instant::now() })
    }

    async fn finish(self) -> Result<u64, JournalError> {
        let elapsed_ms = ms_since(self.started);
        self.journal.phase(self.phase, PhaseEvent::Finished { elapsed_ms }).await?;
        Ok(elapsed_ms)
    }
}

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
    let clock = PhaseClock::start(journal, Phase::Map).await?;
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
            playbook: Some(delta::apply_bullet_tags(&base.playbook.clone().unwrap_or_default(), &reflections)),
        },
        Strategy::Rewrite => base.clone(),
    };

    // 2. Shuffle and group.
    let clock = PhaseClock::start(journal, Phase::Shuffle).await?;
    let plan = grouping::plan_sized(spec.method, n, spec.duplication, spec.seed, spec.group_size.max_group);
    let groups: Vec<Vec<usize>> = plan.groups.iter().map(|g| distinct_in_order(g)).collect();
    let shuffle_ms = clock.finish().await?;
    let k = groups.len();
    let largest_group = groups.iter().map(Vec::len).max().unwrap_or(0);
    // A level-2 call may take as many inputs as a level-1 group may hold.
    let fan_in = spec.group_size.max_group.unwrap_or(largest_group).max(2);

    // What this round may not take away is judged on the counters before its own tags.
    let guard = Guard::for_round(&base.playbook.clone().unwrap_or_default(), &spec.budget);
    let ctx = Reduce {
        backend,
        llm,
        journal,
        spec,
        trace_ids: &trace_ids,
        reflections: &reflections,
        concurrency,
        guard,
        fan_in,
    };
    let mut result = match plan.execution {
        Execution::Parallel => ctx.parallel(&frozen, &groups, &mut calls, &mut answers).await?,
        Execution::Sequential => ctx.sequential(&frozen, &groups, &mut calls, &mut answers).await?,
    };
    let left_out: HashSet<usize> = answers.groups_left_out.iter().map(|g| g.group).collect();
    let reached: HashSet<usize> =
        groups.iter().enumerate().filter(|(g, _)| !left_out.contains(g)).flat_map(|(_, m)| m.iter().copied()).collect();
    answers.reflections_lost = (0..n).filter(|i| !reached.contains(i)).map(|i| trace_ids[i]).collect();
    let coverage = (spec.strategy == Strategy::Playbook).then(|| Coverage::of(&trace_ids, &result.applied));

    // 5. Validate.
    let clock = PhaseClock::start(journal, Phase::Validate).await?;
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
            p: if spec.method == Method::Combee { spec.duplication.max(1) } else { 1 },
            map: mapped.counts,
            unreflected: mapped.unreflected,
            applied: result.applied,
            skipped: result.skipped,
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
        },
    })
}

/// The indices of a group without repeats, first occurrence first.
fn distinct_in_order(group: &[usize]) -> Vec<usize> {
    let mut seen = HashSet::new();
    group.iter().copied().filter(|i| seen.insert(*i)).collect()
}

/// The agent's own reflection, when it parses strictly and validates against `base`.
fn own_reflection(trace: &Trace, base: &VersionContent) -> Option<Reflection> {
    let r: Reflection = serde_json::from_value(trace.reflection.clone()?).ok()?;
    validate_reflection(&r, base).ok().map(|()| r)
}

struct Mapped {
    /// `(trace id, reflection)` in the order of the round's traces.
    reflections: Vec<(Uuid, Reflection)>,
    counts: MapCounts,
    unreflected: Vec<Unreflected>,
    answers: AnswerReport,
}

async fn map_phase(
    backend: &dyn LlmBackend,
    llm: &LlmConfig,
    spec: &RoundSpec,
    base: &VersionContent,
    traces: &[Trace],
    journal: &dyn RoundJournal,
    calls: &mut Vec<LlmCall>,
) -> Result<Mapped, RoundError> {
    let stored = journal.stored_reflections().await?;
    let mut slots: Vec<Option<Reflection>> = vec![None; traces.len()];
    let mut counts = MapCounts::default();
    let mut todo = Vec::new();
    for (i, trace) in traces.iter().enumerate() {
        if let Some(r) = stored.get(&trace.id) {
            slots[i] = Some(r.clone());
            counts.resumed += 1;
        } else if spec.agent_reflections == AgentReflections::Use
            && let Some(r) = own_reflection(trace, base)
        {
            journal.save_reflection(trace.id, &r, ReflectionSource::Trace).await?;
            slots[i] = Some(r);
            counts.from_traces += 1;
        } else {
            if spec.agent_reflections == AgentReflections::Ignore && trace.reflection.is_some() {
                counts.ignored_from_traces += 1;
            }
            todo.push(i);
        }
    }

    // After a transient failure no new call is started: the round will be retried anyway.
    let abort = AtomicBool::new(false);
    let abort = &abort;
    // Futures collected first: a `map` closure in the stream's type trips the
    // compiler's higher-ranked `Send` check, and the worker must be able to spawn a round.
    let calls_to_make: Vec<_> = todo
        .into_iter()
        .map(|i| async move {
            if abort.load(Ordering::Relaxed) {
                return (i, None, Vec::new());
            }
            let mut calls = Vec::new();
            // An ignored agent reflection is not shown to the reflector either.
            let shown = match spec.agent_reflections {
                AgentReflections::Ignore if traces[i].reflection.is_some() => {
                    std::borrow::Cow::Owned(Trace { reflection: None, ..traces[i].clone() })
                }
                _ => std::borrow::Cow::Borrowed(&traces[i]),
            };
            let r = protocol::reflect_noted(backend, llm, &shown, base, spec.strategy, &mut calls).await;
            if r.as_ref().is_err_and(LlmError::is_retryable) {
                abort.store(true, Ordering::Relaxed);
            }
            (i, Some(r), calls)
        })
        .collect();
    let mut results = stream::iter(calls_to_make).buffer_unordered(llm.max_concurrency.max(1));

    let mut transient: Option<LlmError> = None;
    let mut unreflected = Vec::new();
    let mut answers = AnswerReport::default();
    while let Some((i, r, made)) = results.next().await {
        journal.record_calls(&made).await?;
        calls.extend(made);
        match r {
            None => {}
            Some(Ok(noted)) => {
                let r = noted.value;
                answers.note(Task::Reflect, Some(traces[i].id), None, noted.notes);
                journal.save_reflection(traces[i].id, &r, ReflectionSource::Reflector).await?;
                slots[i] = Some(r);
                counts.reflected += 1;
            }
            Some(Err(e)) if e.is_retryable() => {
                transient.get_or_insert(e);
            }
            Some(Err(e)) => {
                journal.record_unreflected(traces[i].id, &e.to_string()).await?;
                unreflected.push(Unreflected { trace_id: traces[i].id, error: e.to_string() });
            }
        }
    }
    if let Some(e) = transient {
        return Err(RoundError::Llm(e));
    }
    let reflections = traces.iter().zip(slots).filter_map(|(t, r)| r.map(|r| (t.id, r))).collect();
    Ok(Mapped { reflections, counts, unreflected, answers })
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
}

/// What the reduce phases produce.
struct Reduced {
    content: VersionContent,
    applied: Vec<Applied>,
    skipped: Vec<Skipped>,
    evicted: Vec<Evicted>,
    group_outputs: Vec<GroupOutput>,
    level2: Level2Summary,
    timings: PhaseTimings,
    resumed_groups: usize,
    /// Merge nodes per level-2 tree level that made LLM calls (empty: level 2 is mechanical).
    levels: Vec<usize>,
}

/// One level-1 answer.
enum Proposal {
    /// Operations with their sources as positions in the group.
    Ops(Vec<SourcedOp>),
    Instruction(String),
}

impl Proposal {
    fn to_json(&self) -> Value {
        match self {
            Self::Ops(ops) => json!({ "operations": ops }),
            Self::Instruction(text) => json!({ "instruction": text }),
        }
    }

    /// Reads back what [`Proposal::to_json`] wrote (a journaled group output);
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

struct Reduce<'a> {
    backend: &'a dyn LlmBackend,
    llm: &'a LlmConfig,
    journal: &'a dyn RoundJournal,
    spec: &'a RoundSpec,
    trace_ids: &'a [Uuid],
    reflections: &'a [Reflection],
    concurrency: usize,
    guard: Guard,
    /// Most inputs one level-2 merge node takes.
    fan_in: usize,
}

impl Reduce<'_> {
    /// One aggregator call for `group` against `current`.
    async fn aggregate(
        &self,
        current: &VersionContent,
        group: &[usize],
        calls: &mut Vec<LlmCall>,
    ) -> Result<(Proposal, AnswerNotes), LlmError> {
        let rs: Vec<Reflection> = group.iter().map(|&i| self.reflections[i].clone()).collect();
        match self.spec.strategy {
            Strategy::Playbook => protocol::aggregate_playbook_noted(self.backend, self.llm, current, &rs, calls)
                .await
                .map(|a| (Proposal::Ops(a.value), a.notes)),
            Strategy::Rewrite => protocol::aggregate_rewrite_noted(self.backend, self.llm, current, &rs, calls)
                .await
                .map(|a| (Proposal::Instruction(a.value), a.notes)),
        }
    }

    fn task(&self) -> Task {
        match self.spec.strategy {
            Strategy::Playbook => Task::AggregatePlaybook,
            Strategy::Rewrite => Task::AggregateRewrite,
        }
    }

    /// Records a group whose answer failed: a non-retryable failure (an answer
    /// still invalid after the corrective retry) leaves the group out while few
    /// enough groups are; anything else fails the round.
    fn leave_out(&self, g: usize, group: &[usize], e: LlmError, answers: &mut AnswerReport) -> Result<(), LlmError> {
        if e.is_retryable() || !matches!(e, LlmError::InvalidAnswer { .. }) {
            return Err(e);
        }
        answers.groups_left_out.push(GroupLeftOut {
            group: g,
            traces: group.iter().map(|&i| self.trace_ids[i]).collect(),
            error: e.to_string(),
        });
        Ok(())
    }

    async fn record(
        &self,
        current: &VersionContent,
        g: usize,
        group: &[usize],
        proposal: &Proposal,
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
    ) -> Option<(Proposal, GroupOutput)> {
        let traces: Vec<Uuid> = group.iter().map(|&i| self.trace_ids[i]).collect();
        let out = journaled.get(&group_key(self.spec.seed, self.spec.strategy, current, &traces))?;
        let proposal = Proposal::from_json(&out.output)?;
        Some((proposal, GroupOutput { group: g, ..out.clone() }))
    }

    /// Combee and naive: level 1 in parallel against the same frozen version, then level 2 once.
    async fn parallel(
        &self,
        frozen: &VersionContent,
        groups: &[Vec<usize>],
        calls: &mut Vec<LlmCall>,
        report: &mut AnswerReport,
    ) -> Result<Reduced, RoundError> {
        let clock = PhaseClock::start(self.journal, Phase::Reduce1).await?;
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
        let mut first_left_out: Option<LlmError> = None;
        while let Some((g, r, made)) = answers.next().await {
            match r {
                Ok((p, notes)) => {
                    report.note(self.task(), None, Some(g), notes);
                    group_outputs.push(self.record(frozen, g, &groups[g], &p, made, calls).await?);
                    proposals.push((g, p));
                }
                Err(e) => {
                    self.journal.record_calls(&made).await?;
                    calls.extend(made);
                    if let Err(e) = self.leave_out(g, &groups[g], e.clone(), report) {
                        // Prefer reporting a fatal failure: retrying would not help.
                        if failure.as_ref().is_none_or(LlmError::is_retryable) {
                            failure = Some(e);
                        }
                    } else {
                        first_left_out.get_or_insert(e);
                    }
                }
            }
        }
        if let Some(e) = failure {
            return Err(e.into());
        }
        if let Some(e) = first_left_out
            && too_many_left_out(report.groups_left_out.len(), groups.len())
        {
            return Err(e.into());
        }
        let reduce1_ms = clock.finish().await?;
        // Level 2 sees the groups in their order, resumed or not, as an uninterrupted round would.
        proposals.sort_by_key(|(g, _)| *g);
        group_outputs.sort_by_key(|o| o.group);

        let clock = PhaseClock::start(self.journal, Phase::Reduce2).await?;
        let mut reduced = match self.spec.strategy {
            Strategy::Playbook => self.level2_playbook(frozen, groups, proposals, calls).await?,
            Strategy::Rewrite => {
                self.level2_rewrite(frozen, proposals.into_iter().map(|(_, p)| p).collect(), calls).await?
            }
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
        proposals: Vec<(usize, Proposal)>,
        calls: &mut Vec<LlmCall>,
    ) -> Result<Reduced, RoundError> {
        let mut summary = Level2Summary::default();
        let mut levels = Vec::new();
        let tree = level2::scan_tree(proposals.len(), self.fan_in);
        let merged = if self.spec.reduce == ReduceMode::Llm && tree.len() > 1 {
            // More group outputs than one call may take: a scan tree of consolidations.
            let mut nodes: Vec<Vec<MergedOp>> =
                proposals.into_iter().map(|(g, p)| delta::normalize_sourced_ops(p.round_ops(g, &groups[g]))).collect();
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
                    nodes.push(c.ops);
                }
                levels.push(level.len());
            }
            nodes.pop().unwrap_or_default()
        } else {
            let union = proposals.into_iter().flat_map(|(g, p)| p.round_ops(g, &groups[g]));
            let mut merged = delta::normalize_sourced_ops(union.collect());
            if self.spec.reduce == ReduceMode::Llm && merged.len() > 1 {
                let mut made = Vec::new();
                let consolidated = self.consolidate(frozen, &merged, &mut made).await?;
                calls.extend(made);
                summary.consolidation_calls = consolidated.1;
                summary.merged_inputs = consolidated.0.merged_inputs;
                summary.dropped = consolidated.0.dropped;
                merged = consolidated.0.ops;
                levels.push(1);
            }
            merged
        };
        let playbook = frozen.playbook.clone().unwrap_or_default();
        let outcome = delta::apply_ops_guarded(&playbook, &merged, &self.spec.budget, &mut self.guard.clone());
        Ok(Reduced {
            content: VersionContent { base: frozen.base.clone(), playbook: Some(outcome.playbook) },
            applied: outcome.applied,
            skipped: outcome.skipped,
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
                let r = protocol::consolidate_playbook(self.backend, self.llm, frozen, &part, &mut made).await;
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
            let decided = level2::apply_decisions(&part, &r?).map_err(RoundError::Invalid)?;
            placed.extend(decided.positions.iter().map(|&p| idx[p]).zip(decided.ops));
            out.dropped.extend(decided.dropped);
            out.merged_inputs += decided.merged_inputs;
        }
        // Chunks regroup ops by section; restore the order of first proposal.
        placed.sort_by_key(|(at, _)| *at);
        (out.positions, out.ops) = placed.into_iter().unzip();
        Ok((out, n))
    }

    async fn level2_rewrite(
        &self,
        frozen: &VersionContent,
        proposals: Vec<Proposal>,
        calls: &mut Vec<LlmCall>,
    ) -> Result<Reduced, RoundError> {
        let mut nodes: Vec<String> = proposals
            .into_iter()
            .filter_map(|p| match p {
                Proposal::Instruction(t) => Some(t),
                Proposal::Ops(_) => None,
            })
            .collect();
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
                for (text, regions, made) in futures_util::future::try_join_all(node_calls).await? {
                    summary.conflict_regions += regions;
                    summary.consolidation_calls += made.len();
                    calls.extend(made);
                    nodes.push(text);
                }
                levels.push(level.len());
            }
        }
        Ok(Reduced {
            content: VersionContent { base: nodes.pop().unwrap_or_default(), playbook: frozen.playbook.clone() },
            applied: Vec::new(),
            skipped: Vec::new(),
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
    /// the text, the number of conflict regions and the calls made.
    async fn merge_instructions(
        &self,
        frozen: &VersionContent,
        mut texts: Vec<String>,
    ) -> Result<(String, usize, Vec<LlmCall>), RoundError> {
        if texts.len() <= 1 {
            return Ok((texts.pop().unwrap_or_else(|| frozen.base.clone()), 0, Vec::new()));
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
        while let Some((r, made)) = answers.next().await {
            self.journal.record_calls(&made).await?;
            calls.extend(made);
            match r {
                Ok(text) => resolved.push(text),
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
        Ok((text, conflict_regions, calls))
    }

    /// Merges the groups' versions of one conflicting passage in a tree of
    /// bounded fan-in; each call sees only the passage and at most
    /// [`level2::REGION_FAN_IN`] versions of it.
    async fn merge_region(
        &self,
        base: String,
        mut variants: Vec<String>,
        calls: &mut Vec<LlmCall>,
    ) -> Result<String, LlmError> {
        let passage = VersionContent { base, playbook: None };
        while variants.len() > 1 {
            let mut next = Vec::new();
            for r in level2::tree_level(variants.len(), level2::REGION_FAN_IN) {
                let chunk = &variants[r];
                if chunk.len() == 1 {
                    next.push(chunk[0].clone());
                } else {
                    next.push(protocol::merge_rewrite(self.backend, self.llm, &passage, chunk, calls).await?);
                }
            }
            variants = next;
        }
        Ok(variants.pop().unwrap_or(passage.base))
    }

    /// The sequential baseline: each batch is aggregated against the result of
    /// the previous one and applied before the next; there is no level 2.
    async fn sequential(
        &self,
        frozen: &VersionContent,
        groups: &[Vec<usize>],
        calls: &mut Vec<LlmCall>,
        report: &mut AnswerReport,
    ) -> Result<Reduced, RoundError> {
        let clock = PhaseClock::start(self.journal, Phase::Reduce1).await?;
        let mut current = frozen.clone();
        let mut guard = self.guard.clone();
        let mut reduced = Reduced {
            content: frozen.clone(),
            applied: Vec::new(),
            skipped: Vec::new(),
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
                        calls.extend(made);
                        self.leave_out(g, group, e.clone(), report)?;
                        if too_many_left_out(report.groups_left_out.len(), groups.len()) {
                            return Err(e.into());
                        }
                        continue;
                    }
                };
                reduced.group_outputs.push(self.record(&current, g, group, &proposal, made, calls).await?);
                proposal
            };
            match proposal {
                p @ Proposal::Ops(_) => {
                    let merged = delta::normalize_sourced_ops(p.round_ops(g, group));
                    let playbook = current.playbook.clone().unwrap_or_default();
                    let outcome = delta::apply_ops_guarded(&playbook, &merged, &self.spec.budget, &mut guard);
                    current.playbook = Some(outcome.playbook);
                    reduced.applied.extend(outcome.applied);
                    reduced.skipped.extend(outcome.skipped);
                    reduced.evicted.extend(outcome.evicted);
                }
                Proposal::Instruction(text) => current.base = text,
            }
        }
        reduced.timings.reduce1_ms = clock.finish().await?;
        let clock = PhaseClock::start(self.journal, Phase::Reduce2).await?;
        reduced.timings.reduce2_ms = clock.finish().await?;
        reduced.content = current;
        Ok(reduced)
    }
}

/// Whether `left_out` of `k` groups is more than a round may lose (all of them,
/// or more than [`MAX_LEFT_OUT_SHARE`]).
fn too_many_left_out(left_out: usize, k: usize) -> bool {
    left_out > 0 && (left_out >= k || left_out as f64 > MAX_LEFT_OUT_SHARE * k as f64)
}

/// The publication checks (`docs/design.md`, Publish): not empty, within the budget, every `{placeholder}` of the base kept.
fn validate_result(base: &VersionContent, new: &VersionContent, spec: &RoundSpec) -> Result<(), String> {
    if new.render().trim().is_empty() {
        return Err("the new prompt is empty".into());
    }
    let budget = &spec.budget;
    match spec.strategy {
        Strategy::Playbook => {
            let pb = new.playbook.as_ref().map_or_else(Playbook::default, Clone::clone);
            if let Some(max) = budget.max_bullets
                && pb.bullet_count() > max
            {
                return Err(format!("{} bullets; the budget is {max}", pb.bullet_count()));
            }
            if let Some(max) = budget.max_chars
                && delta::rendered_chars(&pb) > max
            {
                return Err(format!("playbook is {} characters; the budget is {max}", delta::rendered_chars(&pb)));
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
