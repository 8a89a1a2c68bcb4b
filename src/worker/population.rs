//! The population of a prompt under the `evaluated` policy, kept by worker
//! processes: a learned version joins as a challenger (mutation: the parent's
//! μ, σ = √(σ_parent² + 1)) instead of moving `production`; periodically the
//! rater ranks the live arms on their rewards in the last rating window
//! (TrueSkill, one multi-player ranking, rewards within 0.01 tied), recomputes
//! the LUCB traffic weights, and lets the promotion gate move `production` to
//! a challenger whose μ−2σ beats the champion's with enough scored traces on
//! both sides — a `gate-promote` in the label history with the numbers.
//! The champion is always the version `production` points at: an operator's
//! promote or the regression guard's rollback is followed on the next tick.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::{
    config::PopulationSettings,
    domain::{LabelMoveKind, LabelName, MoveCause, Promotion, PromptName},
    evaluate::{
        outcomes::OutcomeBucket,
        population::{Arm, GateDecision, PopulationPolicy, arm_to_retire, gate, traffic_weights},
        trueskill::{Rating, TrueSkill, ranks_from_rewards},
    },
    store::{ArmState, DynStore, LabelMove, PopulationArm, Selector, StoreError, StoreResult, TaskRewards},
};

/// Who the gate's moves are recorded as.
pub const GATE_ACTOR: &str = "gate";

/// E-SPL's tie rule: rewards within this of each other share a rank.
pub const TIE: f64 = 0.01;

/// Task keys every ranked arm must have run before arms are compared on
/// matched work instead of on their window means.
pub const MIN_SHARED_TASKS: usize = 5;

/// Most prompts one list call returns.
const PAGE: u32 = 200;

fn as_arm(a: &PopulationArm) -> Arm {
    Arm { version: a.version, rating: a.rating, scored_traces: a.scored_traces }
}

/// The version `production` points at.
async fn production_version(store: &DynStore, prompt: &PromptName) -> StoreResult<Option<i64>> {
    Ok(store.resolve(prompt, &Selector::Label(LabelName::production())).await?.map(|r| r.version.number))
}

/// Makes the population agree with `production` (the champion) and sets
/// the live arms' weights. An empty population gets the champion at the prior.
fn reconcile(arms: &mut Vec<PopulationArm>, champion: i64, policy: &PopulationPolicy) {
    if !arms.iter().any(|a| a.version == champion) {
        arms.push(PopulationArm {
            version: champion,
            state: ArmState::Champion,
            rating: Rating::default(),
            weight: 1.0,
            scored_traces: 0,
            created_from: None,
            rated_until: None,
        });
    }
    for a in arms.iter_mut() {
        if a.version == champion {
            a.state = ArmState::Champion;
        } else if a.state == ArmState::Champion {
            // Production moved away (gate, operator, guard): the old champion keeps competing.
            a.state = ArmState::Challenger;
        }
    }
    let live: Vec<Arm> = arms.iter().filter(|a| a.state != ArmState::Retired).map(as_arm).collect();
    let weights = traffic_weights(&live, champion, policy);
    for a in arms.iter_mut() {
        a.weight = weights.iter().find(|(v, _)| *v == a.version).map_or(0.0, |(_, w)| *w);
    }
}

/// Mutation: `version`, learned from `parent`, joins the population of
/// `prompt` as a challenger; the weakest challenger is retired when there are
/// more than `max_arms`. Weights are recomputed and saved.
pub async fn add_challenger(
    store: &DynStore,
    prompt: &PromptName,
    version: i64,
    parent: Option<i64>,
    policy: &PopulationPolicy,
) -> StoreResult<Vec<PopulationArm>> {
    let champion = production_version(store, prompt).await?.ok_or(StoreError::NotFound)?;
    let mut arms = store.population(prompt).await?;
    reconcile(&mut arms, champion, policy);
    let parent_rating =
        parent.and_then(|p| arms.iter().find(|a| a.version == p)).map_or(Rating::default(), |a| a.rating);
    arms.retain(|a| a.version != version);
    arms.push(PopulationArm {
        version,
        state: ArmState::Challenger,
        rating: parent_rating.mutated_child(),
        weight: 0.0,
        scored_traces: 0,
        created_from: parent,
        rated_until: None,
    });
    let live: Vec<Arm> = arms.iter().filter(|a| a.state != ArmState::Retired).map(as_arm).collect();
    // `max_arms` counts challengers; retire until there is room (the newest stays).
    let mut live = live;
    while let Some(weakest) =
        arm_to_retire(&live, champion, Some(version), &PopulationPolicy { max_arms: policy.max_arms + 1, ..*policy })
    {
        live.retain(|a| a.version != weakest);
        if let Some(a) = arms.iter_mut().find(|a| a.version == weakest) {
            a.state = ArmState::Retired;
        }
    }
    reconcile(&mut arms, champion, policy);
    store.save_population(prompt, &arms).await?;
    Ok(arms)
}

/// What one rating tick did for one prompt (for logs and tests).
#[derive(Debug, Clone, PartialEq)]
pub enum RatingOutcome {
    /// The last window is not over yet.
    WindowOpen,
    /// Arms rated (those with enough traces); the gate held.
    Rated { ranked: Vec<i64>, basis: Basis, gate: GateDecision },
    /// The gate moved production from `from` to `to`.
    Promoted { from: i64, to: i64 },
    /// Production moved meanwhile; judged again next tick.
    Raced,
}

/// One arm's reward in a window: success rate when its traces report
/// success, mean score otherwise; with how many traces carried it.
fn window_reward(buckets: &[OutcomeBucket], version: i64) -> (u64, Option<f64>) {
    let mine = buckets.iter().filter(|b| b.version == Some(version));
    let (mut trials, mut successes, mut scored, mut score_sum, mut with_feedback) = (0u64, 0u64, 0u64, 0.0, 0u64);
    for b in mine {
        trials += b.success_trials;
        successes += b.successes;
        scored += b.score.count;
        score_sum += b.score.sum;
        with_feedback += b.with_feedback;
    }
    let reward = if trials > 0 {
        Some(successes as f64 / trials as f64)
    } else if scored > 0 {
        Some(score_sum / scored as f64)
    } else {
        None
    };
    (with_feedback, reward)
}

/// How the arms of a window were compared.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Basis {
    /// On the task keys all ranked arms ran: each arm's mean reward per shared
    /// key, averaged over the keys (arms in an online split see different work).
    SharedTasks,
    /// On each arm's mean reward over the window (too few shared task keys).
    WindowMeans,
}

/// Each of `versions`' reward on the task keys all of them ran (the mean of
/// its per-key mean rewards), in the order of `versions`; `None` when they
/// share fewer than `min_keys` keys.
pub fn matched_rewards(tasks: &[TaskRewards], versions: &[i64], min_keys: usize) -> Option<Vec<f64>> {
    use std::collections::{BTreeMap, BTreeSet};
    let mut per_key: BTreeMap<&str, BTreeMap<i64, f64>> = BTreeMap::new();
    for t in tasks.iter().filter(|t| t.traces > 0 && versions.contains(&t.version)) {
        per_key.entry(&t.task_key).or_default().insert(t.version, t.reward_sum / t.traces as f64);
    }
    let wanted: BTreeSet<i64> = versions.iter().copied().collect();
    let shared: Vec<&BTreeMap<i64, f64>> =
        per_key.values().filter(|by_version| by_version.keys().copied().collect::<BTreeSet<_>>() == wanted).collect();
    if shared.len() < min_keys.max(1) {
        return None;
    }
    Some(versions.iter().map(|v| shared.iter().map(|m| m[v]).sum::<f64>() / shared.len() as f64).collect())
}

#[derive(Clone)]
pub struct PopulationRater {
    store: DynStore,
    settings: PopulationSettings,
    trueskill: TrueSkill,
}

impl PopulationRater {
    pub fn new(store: DynStore, settings: PopulationSettings) -> Self {
        Self { store, settings, trueskill: TrueSkill::default() }
    }

    /// Runs a tick every `tick_secs` until `shutdown`.
    pub async fn run(self, shutdown: CancellationToken) {
        let mut tick = tokio::time::interval(Duration::from_secs(self.settings.tick_secs));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tracing::info!(window_secs = self.settings.window_secs, "population rater started");
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tick.tick() => {}
            }
            if let Err(e) = self.tick(Utc::now()).await {
                tracing::warn!(error = %e, "population rating tick failed");
            }
        }
    }

    /// Rates every `evaluated` prompt once.
    pub async fn tick(&self, now: DateTime<Utc>) -> StoreResult<()> {
        let mut after: Option<String> = None;
        loop {
            let page = self.store.list_prompts(after.as_deref(), PAGE).await?;
            for p in &page {
                if p.prompt.promotion != Promotion::Evaluated {
                    continue;
                }
                if let Err(e) = self.rate(&p.prompt.name, now).await {
                    tracing::warn!(prompt = %p.prompt.name, error = %e, "could not rate the population");
                }
            }
            if page.len() < PAGE as usize {
                return Ok(());
            }
            after = page.last().map(|p| p.prompt.name.to_string());
        }
    }

    /// Rates the window `[now − window_secs, now)` of one prompt (unless a
    /// window ending after `now − window_secs` was rated already: windows do
    /// not overlap, so no trace counts twice), then runs the gate.
    pub async fn rate(&self, prompt: &PromptName, now: DateTime<Utc>) -> StoreResult<RatingOutcome> {
        let policy = self.settings.policy();
        let Some(champion) = production_version(&self.store, prompt).await? else {
            return Err(StoreError::NotFound);
        };
        let mut arms = self.store.population(prompt).await?;
        reconcile(&mut arms, champion, &policy);
        let w = chrono::Duration::seconds(self.settings.window_secs as i64);
        let from = now - w;
        if arms.iter().filter_map(|a| a.rated_until).any(|t| t > from) {
            return Ok(RatingOutcome::WindowOpen);
        }
        let buckets = self.store.version_outcomes(prompt, from, now, self.settings.window_secs as i64).await?;
        // Rank the live arms with enough scored traces in this window.
        let mut ranked: Vec<(usize, f64)> = Vec::new();
        for (i, a) in arms.iter_mut().enumerate() {
            if a.state == ArmState::Retired {
                continue;
            }
            let (scored, reward) = window_reward(&buckets, a.version);
            a.rated_until = Some(now);
            if let Some(r) = reward.filter(|_| scored >= self.settings.min_window_traces) {
                a.scored_traces += scored;
                ranked.push((i, r));
            }
        }
        let mut basis = Basis::WindowMeans;
        if ranked.len() >= 2 {
            let versions: Vec<i64> = ranked.iter().map(|(i, _)| arms[*i].version).collect();
            let tasks = self.store.task_rewards(prompt, from, now).await?;
            if let Some(matched) = matched_rewards(&tasks, &versions, MIN_SHARED_TASKS) {
                basis = Basis::SharedTasks;
                for ((_, r), m) in ranked.iter_mut().zip(matched) {
                    *r = m;
                }
            }
            let rewards: Vec<f64> = ranked.iter().map(|(_, r)| *r).collect();
            let ranks = ranks_from_rewards(&rewards, TIE);
            let ratings: Vec<Rating> = ranked.iter().map(|(i, _)| arms[*i].rating).collect();
            if let Some(new) = self.trueskill.rate_ranking(&ratings, &ranks) {
                for ((i, _), r) in ranked.iter().zip(new) {
                    arms[*i].rating = r;
                }
            }
        }
        let ranked_versions: Vec<i64> = ranked.iter().map(|(i, _)| arms[*i].version).collect();
        let window_rewards: Vec<serde_json::Value> =
            ranked.iter().map(|(i, r)| json!({"version": arms[*i].version, "reward": r})).collect();
        let live: Vec<Arm> = arms.iter().filter(|a| a.state != ArmState::Retired).map(as_arm).collect();
        let Some(champ) = live.iter().find(|a| a.version == champion).copied() else {
            return Err(StoreError::Corrupt("the champion is not a live arm".into()));
        };
        let decision = gate(&champ, &live, &policy);
        let GateDecision::Promote { challenger, challenger_lower, champion_lower, challenger_traces, champion_traces } =
            decision
        else {
            reconcile(&mut arms, champion, &policy);
            self.store.save_population(prompt, &arms).await?;
            return Ok(RatingOutcome::Rated { ranked: ranked_versions, basis, gate: decision });
        };
        // Save the ratings first: they are the evidence, whatever happens to the move.
        reconcile(&mut arms, champion, &policy);
        self.store.save_population(prompt, &arms).await?;
        let rating_of = |v: i64| arms.iter().find(|a| a.version == v).map(|a| a.rating);
        let reason = format!(
            "promotion gate: v{challenger} μ−2σ = {challenger_lower:.2} ({challenger_traces} scored traces) \
             exceeds champion v{champion} μ−2σ = {champion_lower:.2} ({champion_traces} scored traces)"
        );
        let evidence = json!({
            "champion": {"version": champion, "rating": rating_of(champion), "lower": champion_lower, "scored_traces": champion_traces},
            "challenger": {"version": challenger, "rating": rating_of(challenger), "lower": challenger_lower, "scored_traces": challenger_traces},
            "min_traces": policy.min_traces,
            "window": {"from": from, "until": now, "basis": basis, "rewards": window_rewards},
        });
        let mv = LabelMove {
            label: LabelName::production(),
            to_version: challenger,
            expected_current: Some(champion),
            check_current: true,
            by: GATE_ACTOR.to_owned(),
        };
        let cause = MoveCause::new(LabelMoveKind::GatePromote, reason.clone()).with_evidence(evidence);
        match self.store.move_label_because(prompt, &mv, &cause).await {
            Ok(_) => {
                tracing::info!(%prompt, from = champion, to = challenger, %reason, "promotion gate moved production");
                reconcile(&mut arms, challenger, &policy);
                self.store.save_population(prompt, &arms).await?;
                Ok(RatingOutcome::Promoted { from: champion, to: challenger })
            }
            Err(StoreError::Conflict) => Ok(RatingOutcome::Raced),
            Err(e) => Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn task(version: i64, key: &str, traces: u64, reward_sum: f64) -> TaskRewards {
        TaskRewards { version, task_key: key.into(), traces, reward_sum }
    }

    #[test]
    fn arms_are_compared_on_the_tasks_they_share() {
        // v1 ran easy and hard tasks; v2 only hard ones: on window means v1
        // looks better, on the shared (hard) keys v2 is.
        let mut tasks = Vec::new();
        for k in 0..5 {
            tasks.push(task(1, &format!("hard-{k}"), 2, 0.0));
            tasks.push(task(2, &format!("hard-{k}"), 2, 1.0));
            tasks.push(task(1, &format!("easy-{k}"), 4, 4.0));
        }
        assert_eq!(matched_rewards(&tasks, &[1, 2], 5), Some(vec![0.0, 0.5]));
        assert_eq!(matched_rewards(&tasks, &[2, 1], 5), Some(vec![0.5, 0.0]));
        assert_eq!(matched_rewards(&tasks, &[1, 2], 6), None, "five shared keys are not six");
        // A key counts only when every arm ran it.
        assert_eq!(matched_rewards(&tasks, &[1, 2, 3], 1), None);
    }

    fn arm(version: i64, state: ArmState) -> PopulationArm {
        PopulationArm {
            version,
            state,
            rating: Rating::default(),
            weight: 0.0,
            scored_traces: 0,
            created_from: None,
            rated_until: None,
        }
    }

    #[test]
    fn reconcile_follows_production_and_gives_retired_arms_nothing() {
        let policy = PopulationPolicy::default();
        let mut arms = vec![arm(1, ArmState::Champion), arm(2, ArmState::Challenger), arm(3, ArmState::Retired)];
        reconcile(&mut arms, 2, &policy);
        assert_eq!(arms[0].state, ArmState::Challenger);
        assert_eq!(arms[1].state, ArmState::Champion);
        assert!((arms[1].weight - 0.8).abs() < 1e-12 && (arms[0].weight - 0.2).abs() < 1e-12);
        assert_eq!(arms[2].weight, 0.0);
        let mut empty = Vec::new();
        reconcile(&mut empty, 5, &policy);
        assert_eq!(empty.len(), 1);
        assert_eq!((empty[0].version, empty[0].state, empty[0].weight), (5, ArmState::Champion, 1.0));
    }
}
