//! The one door through which `production` moves, whoever moves it — an
//! operator (API, CLI, web UI), the promotion gate, the regression guard, or a
//! learning round of an `auto` prompt publishing its version: the
//! compare-and-set on the label (or the round's fenced transaction), then what
//! follows every move in the same order — the population follows the new
//! champion (weights recomputed), and the served prompts' cache drops the
//! prompt. A rule about "after production moved" is written here once.

use serde_json::{Map, Value};

use super::{AppState, population};
use crate::{
    cache::PromptCache,
    domain::{
        LabelName, MoveCause, PromptName, Version,
        label::{Label, LabelMove, Selector},
        population::ArmState,
    },
    evaluate::population::PopulationPolicy,
    store::{DynStore, RoundEnd, StoreError, StoreResult},
};

/// What a move of `production` touches beyond the label: the store, the
/// server's population policy (a prompt's own knobs apply over it), and this
/// process's cache of served prompts when it serves agents (a worker has
/// none: other processes' caches follow the store's change feed).
#[derive(Clone, Copy)]
pub struct Mover<'a> {
    store: &'a DynStore,
    policy: PopulationPolicy,
    cache: Option<&'a PromptCache>,
}

impl<'a> Mover<'a> {
    /// The mover of a process that serves requests.
    pub fn of(st: &'a AppState) -> Self {
        Self { store: &st.store, policy: st.settings.population.policy(), cache: Some(&st.cache) }
    }

    /// The mover of a background task (the gate, the guard): no cache of its own.
    pub fn background(store: &'a DynStore, policy: PopulationPolicy) -> Self {
        Self { store, policy, cache: None }
    }

    /// Moves `production` as `mv` says (a compare-and-set when
    /// `mv.check_current`: `Conflict` when it moved meanwhile), recording
    /// `cause` in the label history, then [`Self::followed`].
    pub async fn move_production(&self, prompt: &PromptName, mv: &LabelMove, cause: &MoveCause) -> StoreResult<Label> {
        if mv.label != LabelName::production() {
            return Err(StoreError::Invalid(format!("label {:?} is not production", mv.label)));
        }
        let cause = with_gate_evidence(self.store, prompt, mv.to_version, cause).await?;
        let label = self.store.move_label_because(prompt, mv, &cause).await?;
        self.followed(prompt).await;
        Ok(label)
    }

    /// Ends a round that succeeded (the store's one fenced transaction, see
    /// [`crate::store::RoundRecordStore::finish_round`]): its version, if any, with
    /// its label, the traces, the round's record. A version labelled
    /// `production` (promotion `auto`) moves production like any other move,
    /// so [`Self::followed`] follows it. The version written, if one was.
    pub async fn finish_round(&self, prompt: &PromptName, end: &RoundEnd) -> StoreResult<Option<Version>> {
        let written = self.store.finish_round(end).await?;
        let moved = end.version.as_ref().is_some_and(|(_, label)| *label == LabelName::production());
        if written.is_some() && moved {
            self.followed(prompt).await;
        }
        Ok(written)
    }

    /// After `production` of `prompt` moved (through [`Self::move_production`],
    /// or with a new version made in the same transaction): the population,
    /// if the prompt has one, follows at once, so the new production version
    /// is what agents are served as the champion; then the cache drops the
    /// prompt. A failure to follow is logged: the move stands and the rater
    /// reconciles on its next tick.
    pub async fn followed(&self, prompt: &PromptName) {
        if let Err(e) = follow_production(self.store, prompt, &self.policy).await {
            tracing::warn!(%prompt, error = %e, "the population did not follow production yet");
        }
        if let Some(cache) = self.cache {
            cache.invalidate(prompt.as_str());
        }
    }
}

/// `cause`, with the regression gate's verdict on `version` added to its
/// evidence (as `regression_gate`) when the version was gated: the record of
/// a move says what the version passed, whether the gate, the rater or an
/// operator moved it.
async fn with_gate_evidence(
    store: &DynStore,
    prompt: &PromptName,
    version: i64,
    cause: &MoveCause,
) -> StoreResult<MoveCause> {
    let mut cause = cause.clone();
    let Some(gate) = store.gate(prompt, version).await? else { return Ok(cause) };
    let mut evidence = match cause.evidence.take() {
        Some(Value::Object(map)) => map,
        None => Map::new(),
        // Evidence that is not an object is kept beside the verdict.
        Some(other) => Map::from_iter([("evidence".to_string(), other)]),
    };
    evidence.insert("regression_gate".into(), gate.evidence());
    cause.evidence = Some(Value::Object(evidence));
    Ok(cause)
}

/// Makes a stored population follow `production` at once: the version
/// production points at becomes the champion (joining at the prior if it was
/// no arm), the old champion competes on as a challenger, weights are
/// recomputed under the prompt's policy in effect. Nothing to do for a prompt
/// without a population, or when production is the champion already.
async fn follow_production(store: &DynStore, prompt: &PromptName, server: &PopulationPolicy) -> StoreResult<()> {
    let Some(champion) = production_version(store, prompt).await? else { return Ok(()) };
    let mut arms = store.live_arms(prompt, &[champion]).await?;
    if arms.is_empty() || arms.iter().any(|a| a.version == champion && a.state == ArmState::Champion) {
        return Ok(());
    }
    let (_, policy) = population::effective_policy(store, prompt, server).await?;
    population::reconcile(&mut arms, champion, &policy);
    store.save_population(prompt, &arms).await
}

/// The version `production` of `prompt` points at.
pub async fn production_version(store: &DynStore, prompt: &PromptName) -> StoreResult<Option<i64>> {
    Ok(store.resolve(prompt, &Selector::Label(LabelName::production())).await?.map(|r| r.version.number))
}
