//! The regression guard, run periodically by worker processes: for every
//! prompt with `settings.regression_guard` on, it compares production's reward
//! in the current window with (i) its own previous window and (ii) the previous
//! production version's last window before the change, and when
//! `evaluate::guard::compare` finds a significant drop it moves `production`
//! back to the previous production version through its one door (see
//! [`crate::service::production`]) — a `guard-rollback` in the label history
//! with the test's numbers, a `prompt.rolled_back` webhook event, a log line. Rules that keep it from fighting people or itself:
//! - it only acts when the label history says which version production came
//!   from (moves before label history existed are unknown: no rollback);
//! - it never makes the same rollback (from V to P) twice;
//! - once it has acted on a prompt, a later manual move of `production` by an
//!   operator (`promote`, `rollback`) is respected: the guard does not roll
//!   back a version an operator put there after the guard's last action;
//! - it does not judge a version it rolled back to itself (no flip-flop), nor
//!   undo an operator's rollback;
//! - it goes back one step only (to the version production came from), with a
//!   compare-and-set, so two guards or an operator racing it cannot stack moves.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::{
    config::GuardSettings,
    domain::{LabelHistoryEntry, LabelMoveKind, LabelName, MoveCause, PromptName, label::LabelMove},
    evaluate::{
        guard::{Comparison, GuardThresholds, WindowRewards, compare},
        outcomes::RewardSources,
        population::PopulationPolicy,
    },
    service::production::Mover,
    store::{DynStore, LabelMoveQuery, StoreError, StoreResult},
};

/// Who the guard's moves are recorded as.
pub const GUARD_ACTOR: &str = "guard";

/// Most prompts one list call returns.
const PAGE: u32 = 200;

#[derive(Clone)]
pub struct RegressionGuard {
    store: DynStore,
    settings: GuardSettings,
    /// The server's population policy, which a population follows a rollback under.
    population: PopulationPolicy,
}

/// What the guard did for one prompt (for logs and tests).
#[derive(Debug, Clone, PartialEq)]
pub enum GuardOutcome {
    /// Nothing to judge or to roll back to (see the module's rules).
    NotApplicable(&'static str),
    /// Judged; no significant drop (or not enough evidence).
    Healthy,
    /// Production moved from `from` back to `to`.
    RolledBack { from: i64, to: i64 },
    /// Production moved meanwhile; judged again next tick.
    Raced,
}

/// What the rules need of the production history: the move that made the
/// current production, and two facts about the guard's own earlier moves
/// (each read through an index, so a judgement costs the same however long
/// the history grows).
#[derive(Debug, Clone, PartialEq)]
pub struct ProductionFacts {
    /// The newest move of `production`.
    pub current: LabelHistoryEntry,
    /// The guard once rolled production back from the current version to the one it came from.
    pub rolled_back_this_before: bool,
    /// The guard rolled production back at any time before the current move.
    pub guard_acted_before: bool,
}

/// Whether the guard may act on the current production, and if so the move
/// that made it with the versions it came from and went to.
fn applicable(facts: Option<&ProductionFacts>) -> Result<(&LabelHistoryEntry, i64, i64), &'static str> {
    let Some(facts) = facts else { return Err("no recorded production move") };
    let current = &facts.current;
    let (Some(from), Some(to)) = (current.from_version, current.to_version) else {
        return Err("production has no previous version");
    };
    if current.kind == LabelMoveKind::GuardRollback {
        return Err("production is where the guard put it");
    }
    if current.kind == LabelMoveKind::Rollback {
        return Err("an operator rolled back: going back to what they rolled back from would undo their judgement");
    }
    if facts.rolled_back_this_before {
        return Err("already rolled back once from this version to that one");
    }
    if current.kind.by_operator() && facts.guard_acted_before {
        return Err("an operator moved production after the guard's last action");
    }
    Ok((current, from, to))
}

impl RegressionGuard {
    pub fn new(store: DynStore, settings: GuardSettings) -> Self {
        Self { store, settings, population: PopulationPolicy::default() }
    }

    /// Uses these population knobs (from `[population]`) when a population follows a rollback.
    pub fn with_population(mut self, policy: PopulationPolicy) -> Self {
        self.population = policy;
        self
    }

    /// Runs a tick every `tick_secs` until `shutdown`.
    pub async fn run(self, shutdown: CancellationToken) {
        let mut tick = tokio::time::interval(Duration::from_secs(self.settings.tick_secs));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tracing::info!(window_secs = self.settings.window_secs, "regression guard started");
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tick.tick() => {}
            }
            if let Err(e) = self.tick(Utc::now()).await {
                tracing::warn!(error = %e, "regression guard tick failed");
            }
        }
    }

    /// Judges every prompt once.
    pub async fn tick(&self, now: DateTime<Utc>) -> StoreResult<()> {
        let mut after: Option<PromptName> = None;
        loop {
            let page = self.store.prompts_page(after.as_ref(), PAGE).await?;
            for p in &page {
                if !p.settings.regression_guard {
                    continue;
                }
                if let Err(e) = self.judge(&p.name, now).await {
                    tracing::warn!(prompt = %p.name, error = %e, "regression guard could not judge the prompt");
                }
            }
            if page.len() < PAGE as usize {
                return Ok(());
            }
            after = page.last().map(|p| p.name.clone());
        }
    }

    /// The facts the rules need (see [`ProductionFacts`]): three indexed
    /// reads of at most one move each, never the whole history.
    async fn production_facts(&self, prompt: &PromptName) -> StoreResult<Option<ProductionFacts>> {
        let production = LabelName::production();
        let newest = LabelMoveQuery { label: Some(production.clone()), ..Default::default() };
        let Some(current) = self.store.label_moves(prompt, &newest, 1).await?.pop() else { return Ok(None) };
        let guard_moves = LabelMoveQuery {
            label: Some(production),
            kind: Some(LabelMoveKind::GuardRollback),
            before: Some(current.id),
            ..Default::default()
        };
        let guard_acted_before = !self.store.label_moves(prompt, &guard_moves, 1).await?.is_empty();
        let rolled_back_this_before = match (guard_acted_before, current.from_version, current.to_version) {
            (true, Some(from), Some(to)) => {
                let same = LabelMoveQuery { from_version: Some(to), to_version: Some(from), ..guard_moves };
                !self.store.label_moves(prompt, &same, 1).await?.is_empty()
            }
            _ => false,
        };
        Ok(Some(ProductionFacts { current, rolled_back_this_before, guard_acted_before }))
    }

    async fn rewards(
        &self,
        prompt: &PromptName,
        version: i64,
        from: DateTime<Utc>,
        until: DateTime<Utc>,
    ) -> StoreResult<WindowRewards> {
        let bucket = self.settings.window_secs as i64;
        let buckets = self.store.version_outcomes(prompt, from, until, bucket, Some(&[version])).await?;
        Ok(WindowRewards::of_version(&buckets, version))
    }

    /// Judges one prompt at `now`, and rolls it back when the evidence says so.
    pub async fn judge(&self, prompt: &PromptName, now: DateTime<Utc>) -> StoreResult<GuardOutcome> {
        let facts = self.production_facts(prompt).await?;
        let (current, previous, production) = match applicable(facts.as_ref()) {
            Ok(found) => found,
            Err(why) => return Ok(GuardOutcome::NotApplicable(why)),
        };
        let w = chrono::Duration::seconds(self.settings.window_secs as i64);
        let thresholds = GuardThresholds {
            alpha: self.settings.alpha,
            min_drop: self.settings.min_drop,
            min_traces: self.settings.min_traces,
        };
        let now_rewards = self.rewards(prompt, production, now - w, now).await?;
        let own_before = self.rewards(prompt, production, now - w - w, now - w).await?;
        let previous_last = self.rewards(prompt, previous, current.at - w, current.at).await?;
        let vs_previous = compare(&previous_last, &now_rewards, &thresholds);
        let vs_own = compare(&own_before, &now_rewards, &thresholds);
        let fired: Option<(&str, &Comparison)> = [("previous_production", &vs_previous), ("previous_window", &vs_own)]
            .into_iter()
            .filter_map(|(name, c)| c.as_ref().filter(|c| c.significant).map(|c| (name, c)))
            .max_by(|a, b| a.1.z.total_cmp(&b.1.z));
        let Some((baseline, c)) = fired else { return Ok(GuardOutcome::Healthy) };
        let metric = match c.metric {
            crate::evaluate::guard::Metric::Success => "success rate",
            crate::evaluate::guard::Metric::Score => "mean score",
        };
        let against = if baseline == "previous_production" {
            format!("v{previous}'s last window before the change")
        } else {
            "its own previous window".to_owned()
        };
        let reason = format!(
            "regression guard: {metric} of v{production} fell to {:.3} (n={}) from {:.3} (n={}) in {against}; \
             one-sided z={:.2}, p={:.2e} < alpha={}; rolled back to v{previous}",
            c.current, c.current_n, c.reference, c.reference_n, c.z, c.p_value, thresholds.alpha
        );
        let evidence = json!({
            "fired_on": baseline,
            "window_secs": self.settings.window_secs,
            "alpha": thresholds.alpha,
            "min_drop": thresholds.min_drop,
            "min_traces": thresholds.min_traces,
            "judged_at": now,
            "production_version": production,
            "previous_version": previous,
            "previous_production": vs_previous,
            "previous_window": vs_own,
            "rewards_used": RewardSources {
                reported: now_rewards.sources.reported,
                judged: now_rewards.sources.judged,
            }
            .evidence(),
        });
        let mv = LabelMove {
            label: LabelName::production(),
            to_version: previous,
            expected_current: Some(production),
            check_current: true,
            by: GUARD_ACTOR.to_owned(),
        };
        let cause = MoveCause::new(LabelMoveKind::GuardRollback, reason.clone()).with_evidence(evidence);
        match Mover::background(&self.store, self.population).move_production(prompt, &mv, &cause).await {
            Ok(_) => {
                tracing::warn!(%prompt, from = production, to = previous, %reason, "regression guard rolled production back");
                Ok(GuardOutcome::RolledBack { from: production, to: previous })
            }
            Err(StoreError::Conflict) => Ok(GuardOutcome::Raced),
            Err(e) => Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(id: i64, kind: LabelMoveKind, from: Option<i64>, to: Option<i64>) -> LabelHistoryEntry {
        LabelHistoryEntry {
            id,
            label: LabelName::production(),
            from_version: from,
            to_version: to,
            kind,
            actor: "x".into(),
            reason: String::new(),
            evidence: None,
            at: Utc::now(),
        }
    }

    /// The facts as the store's indexed reads give them, from a whole history (newest first).
    fn facts(history: &[LabelHistoryEntry]) -> Option<ProductionFacts> {
        let current = history.first()?.clone();
        let guard = |m: &&LabelHistoryEntry| m.kind == LabelMoveKind::GuardRollback && m.id < current.id;
        let guard_acted_before = history.iter().any(|m| guard(&m));
        let rolled_back_this_before = history
            .iter()
            .filter(guard)
            .any(|m| m.from_version == current.to_version && m.to_version == current.from_version);
        Some(ProductionFacts { current, rolled_back_this_before, guard_acted_before })
    }

    fn verdict(history: &[LabelHistoryEntry]) -> Result<(i64, i64), &'static str> {
        let facts = facts(history);
        applicable(facts.as_ref()).map(|(_, f, t)| (f, t))
    }

    #[test]
    fn the_rules_decide_when_the_guard_may_act() {
        use LabelMoveKind::*;
        assert!(verdict(&[]).is_err());
        assert!(verdict(&[entry(1, Create, None, Some(1))]).is_err());
        // An automatic publish, and an operator's promotion before the guard ever acted, are guarded.
        let auto = [entry(2, AutoPublish, Some(1), Some(2)), entry(1, Create, None, Some(1))];
        assert_eq!(verdict(&auto), Ok((1, 2)));
        let manual = [entry(2, Promote, Some(1), Some(2)), entry(1, Create, None, Some(1))];
        assert!(verdict(&manual).is_ok());
        // Never the same rollback twice: v2 came back by auto-publish after the guard took it out once.
        let again = [
            entry(4, AutoPublish, Some(1), Some(2)),
            entry(3, GuardRollback, Some(2), Some(1)),
            entry(2, AutoPublish, Some(1), Some(2)),
        ];
        assert!(verdict(&again).is_err());
        // Where the guard put production, it stays; an operator's rollback is never undone.
        assert!(verdict(&again[1..]).is_err());
        assert!(verdict(&[entry(2, Rollback, Some(2), Some(3)), entry(1, Create, None, Some(1))]).is_err());
        // An operator's move after the guard's last action is respected...
        let overridden = [entry(4, Promote, Some(1), Some(3)), entry(3, GuardRollback, Some(2), Some(1))];
        assert!(verdict(&overridden).is_err());
        // ...but a later automatic publish is guarded again.
        let republished = [
            entry(5, AutoPublish, Some(3), Some(4)),
            entry(4, Promote, Some(1), Some(3)),
            entry(3, GuardRollback, Some(2), Some(1)),
        ];
        assert_eq!(verdict(&republished), Ok((3, 4)));
    }
}
