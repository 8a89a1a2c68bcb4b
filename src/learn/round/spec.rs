//! What a round is asked to do and how it can fail, for every step — shared by
//! the round executor ([`super`]) and its phases ([`super::map`],
//! [`super::reduce`]), which sit below it: the round's spec, its error, the
//! journal key of a level-1 call and the clock that journals each phase.

use std::time::Instant;

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::journal::{JournalError, Phase, PhaseEvent, RoundJournal};
use crate::domain::Method;
use crate::domain::{AgentReflections, Strategy, VersionContent};
use crate::learn::capacity::sizing::GroupSize;
use crate::learn::merge::budget::Budget;
use crate::llm::LlmError;

use crate::domain::ReduceMode;

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
    pub denylist: std::sync::Arc<crate::learn::denylist::ContentDenylist>,
    /// Most reflections one level-1 call may be given (Combee), and why — from
    /// the overload meter ([`crate::learn::capacity::sizing`]); it also bounds level 2's fan-in.
    #[serde(default)]
    pub group_size: GroupSize,
}

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
    /// Every level-1 group degraded (its aggregator answer stayed invalid after
    /// the corrective retry): the round learned nothing, so it publishes nothing.
    #[error(
        "nothing learned: all {groups} level-1 groups degraded (their aggregator answers stayed invalid after the corrective retry); last: {last}"
    )]
    NothingLearned { groups: usize, last: String },
}

impl RoundError {
    /// Transient LLM failures and journal (store) failures are retryable; an
    /// invalid result, an invalid answer or a misconfiguration is not.
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::Llm(e) => e.is_retryable(),
            Self::Journal(_) => true,
            Self::Invalid(_) | Self::NothingToLearn(_) | Self::NothingLearned { .. } => false,
        }
    }
}

fn ms_since(t: Instant) -> u64 {
    u64::try_from(t.elapsed().as_millis()).unwrap_or(u64::MAX)
}

/// Times a phase and journals its start and end.
pub(crate) struct PhaseTimer<'a> {
    journal: &'a dyn RoundJournal,
    phase: Phase,
    started: Instant,
}

impl<'a> PhaseTimer<'a> {
    pub(crate) async fn start(journal: &'a dyn RoundJournal, phase: Phase) -> Result<Self, JournalError> {
        journal.phase(phase, PhaseEvent::Started).await?;
        Ok(Self { journal, phase, started: Instant::now() })
    }

    pub(crate) async fn finish(self) -> Result<u64, JournalError> {
        let elapsed_ms = ms_since(self.started);
        self.journal.phase(self.phase, PhaseEvent::Finished { elapsed_ms }).await?;
        Ok(elapsed_ms)
    }
}
