//! What a round writes down while it runs, in every step (map, level 1, level
//! 2), so a crashed round resumes without paying for its reflections twice and
//! an operator can see every phase, call and group output (a resumed round
//! reuses the level-1 outputs it already paid for, too). The store implements
//! [`RoundJournal`] for one round row; the round executor never sees a
//! database. [`MemoryJournal`] serves tests and benches.

use std::collections::HashMap;
use std::sync::Mutex;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::domain::{GroupOutput, Reflection};
use crate::llm::LlmCall;

/// The phases of a round, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    Map,
    Shuffle,
    Reduce1,
    Reduce2,
    Validate,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum PhaseEvent {
    Started,
    Finished { elapsed_ms: u64 },
}

/// Where a stored reflection came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReflectionSource {
    /// The agent sent it with the trace; no reflector call was made.
    Trace,
    /// A reflector call produced it.
    Reflector,
}

/// The journal could not be read or written. Always worth retrying the round:
/// nothing the round decided depends on it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("round journal: {0}")]
pub struct JournalError(pub String);

/// The narrow record-keeping interface of one round.
#[async_trait]
pub trait RoundJournal: Send + Sync {
    /// Reflections saved by earlier attempts of this round, by trace id.
    async fn stored_reflections(&self) -> Result<HashMap<Uuid, Reflection>, JournalError>;
    /// Saves one reflection as soon as it exists; saving the same trace again replaces it.
    async fn save_reflection(
        &self,
        trace_id: Uuid,
        reflection: &Reflection,
        source: ReflectionSource,
    ) -> Result<(), JournalError>;
    /// Records that the trace's reflection could not be obtained (its own failure:
    /// the trace pays an attempt for it when the round ends). A later
    /// [`RoundJournal::save_reflection`] for the same trace clears it.
    async fn record_unreflected(&self, trace_id: Uuid, error: &str) -> Result<(), JournalError>;
    /// Records LLM calls (usage, latency, failures) in the order they finished.
    async fn record_calls(&self, calls: &[LlmCall]) -> Result<(), JournalError>;
    /// Records the level-1 output of one group (its traces and its ops or instruction).
    async fn save_group_output(&self, output: &GroupOutput) -> Result<(), JournalError>;
    /// Level-1 group outputs saved by earlier attempts of this round (as saved by
    /// [`RoundJournal::save_group_output`]); a resumed round reuses those whose key
    /// still matches instead of calling the aggregator again.
    async fn stored_group_outputs(&self) -> Result<Vec<GroupOutput>, JournalError>;
    async fn phase(&self, phase: Phase, event: PhaseEvent) -> Result<(), JournalError>;
}

/// Everything a [`MemoryJournal`] holds.
#[derive(Debug, Clone, Default)]
pub struct JournalRecord {
    pub reflections: HashMap<Uuid, (Reflection, ReflectionSource)>,
    /// Traces whose reflection failed, with the reason.
    pub unreflected: HashMap<Uuid, String>,
    pub calls: Vec<LlmCall>,
    pub group_outputs: Vec<GroupOutput>,
    pub phases: Vec<(Phase, PhaseEvent)>,
}

/// A journal in process memory, for tests, benchmarks and one-shot CLI rounds.
#[derive(Debug, Default)]
pub struct MemoryJournal {
    record: Mutex<JournalRecord>,
}

impl MemoryJournal {
    pub fn new() -> Self {
        Self::default()
    }

    /// A journal that already holds reflector reflections, as after a crash.
    pub fn with_reflections(reflections: impl IntoIterator<Item = (Uuid, Reflection)>) -> Self {
        let record = JournalRecord {
            reflections: reflections.into_iter().map(|(id, r)| (id, (r, ReflectionSource::Reflector))).collect(),
            ..Default::default()
        };
        Self { record: Mutex::new(record) }
    }

    /// A copy of what has been recorded so far.
    pub fn snapshot(&self) -> JournalRecord {
        self.record.lock().map(|r| r.clone()).unwrap_or_default()
    }

    fn with<T>(&self, f: impl FnOnce(&mut JournalRecord) -> T) -> Result<T, JournalError> {
        self.record.lock().map(|mut r| f(&mut r)).map_err(|_| JournalError("memory journal poisoned".into()))
    }
}

#[async_trait]
impl RoundJournal for MemoryJournal {
    async fn stored_reflections(&self) -> Result<HashMap<Uuid, Reflection>, JournalError> {
        self.with(|r| r.reflections.iter().map(|(id, (refl, _))| (*id, refl.clone())).collect())
    }

    async fn save_reflection(
        &self,
        trace_id: Uuid,
        reflection: &Reflection,
        source: ReflectionSource,
    ) -> Result<(), JournalError> {
        self.with(|r| {
            r.unreflected.remove(&trace_id);
            r.reflections.insert(trace_id, (reflection.clone(), source));
        })
    }

    async fn record_unreflected(&self, trace_id: Uuid, error: &str) -> Result<(), JournalError> {
        self.with(|r| {
            r.unreflected.insert(trace_id, error.to_owned());
        })
    }

    async fn record_calls(&self, calls: &[LlmCall]) -> Result<(), JournalError> {
        self.with(|r| r.calls.extend_from_slice(calls))
    }

    async fn save_group_output(&self, output: &GroupOutput) -> Result<(), JournalError> {
        self.with(|r| r.group_outputs.push(output.clone()))
    }

    async fn stored_group_outputs(&self) -> Result<Vec<GroupOutput>, JournalError> {
        self.with(|r| r.group_outputs.clone())
    }

    async fn phase(&self, phase: Phase, event: PhaseEvent) -> Result<(), JournalError> {
        self.with(|r| r.phases.push((phase, event)))
    }
}
