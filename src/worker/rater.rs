//! The population rater's loop, run by worker processes: periodically it
//! reads each due prompt's last rating window, hands it to the pure
//! rater ([`crate::evaluate::rater`]: ranking, TrueSkill, the promotion gate),
//! saves the ratings and weights, and moves `production` where the gate says
//! so through its one door ([`crate::service::production::Mover`]) — a
//! `gate-promote` in the label history with the numbers. The champion is
//! always the version `production` points at; any move of it is reconciled
//! here again on the next tick. After a rated window it may breed a
//! crossover child (see [`super::breeder`]).

use std::{sync::Arc, time::Duration};

use chrono::{DateTime, Utc};
use tokio_util::sync::CancellationToken;

use super::breeder::{Breeder, CrossoverError, CrossoverOutcome, RatedWindow};
use crate::{
    config::PopulationSettings,
    domain::{LabelMoveKind, LabelName, MoveCause, PromptName, label::LabelMove, population::ArmState},
    evaluate::outcomes::RewardSources,
    evaluate::{
        population::{Arm, GateDecision},
        rater::{self, Basis, evidence_to_close, first_window_due, window_may_be_due},
        trueskill::TrueSkill,
    },
    learn::denylist::ContentDenylist,
    llm::{LlmBackend, config::LlmConfig},
    service::{
        population::{built_on, effective_policy, line_of, reconcile},
        production::{Mover, production_version},
    },
    store::{DynStore, StoreError, StoreResult},
};

/// Who the gate's moves are recorded as.
pub const GATE_ACTOR: &str = "gate";

/// Most prompts one list call returns.
const PAGE: u32 = 200;

/// What one rating tick did for one prompt (for logs and tests).
#[derive(Debug, Clone, PartialEq)]
pub enum RatingOutcome {
    /// The last window is not over yet.
    WindowOpen,
    /// Arms rated (those with enough traces); the gate held.
    /// `rewards`: which rewards the ranking stood on (reported, judged, both).
    Rated { ranked: Vec<i64>, basis: Basis, rewards: RewardSources, gate: GateDecision },
    /// The gate moved production from `from` to `to`.
    Promoted { from: i64, to: i64 },
    /// Production moved meanwhile; judged again next tick.
    Raced,
}

/// Where one rating tick's time went: per phase, summed over its prompts.
/// `check`: whether a prompt's window is due (its prompt, production, live
/// arms); `read`: a due window's outcomes, task rewards and production's last
/// move; `save`: ratings, weights and a gate's move; `crossover`: the attempt
/// after a rated window, of which `crossover_llm` waited on its LLM call.
/// Each is O(live arms + the window's buckets) per prompt.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct TickPhases {
    pub list: Duration,
    pub check: Duration,
    pub read: Duration,
    pub save: Duration,
    pub crossover: Duration,
    pub crossover_llm: Duration,
    /// Prompts checked, and windows rated.
    pub checked: u64,
    pub rated: u64,
}

impl TickPhases {
    /// Into `/metrics` (`combee_rater_phase_seconds{phase}`, `combee_rater_windows_total`) and a debug line.
    fn record(&self, total: Duration) {
        for (phase, d) in [
            ("list", self.list),
            ("check", self.check),
            ("read", self.read),
            ("save", self.save),
            ("crossover", self.crossover),
            ("crossover_llm", self.crossover_llm),
        ] {
            metrics::histogram!("combee_rater_phase_seconds", "phase" => phase).record(d.as_secs_f64());
        }
        metrics::counter!("combee_rater_windows_total").increment(self.rated);
        tracing::debug!(
            secs = total.as_secs_f64(),
            checked = self.checked,
            rated = self.rated,
            check = self.check.as_secs_f64(),
            read = self.read.as_secs_f64(),
            save = self.save.as_secs_f64(),
            crossover = self.crossover.as_secs_f64(),
            crossover_llm = self.crossover_llm.as_secs_f64(),
            "population rating tick"
        );
    }
}

#[derive(Clone)]
pub struct PopulationRater {
    store: DynStore,
    settings: PopulationSettings,
    trueskill: TrueSkill,
    /// What crossover needs; without it (no LLM configured) windows are only rated.
    breeder: Option<Breeder>,
}

impl PopulationRater {
    pub fn new(store: DynStore, settings: PopulationSettings) -> Self {
        Self { store, settings, trueskill: TrueSkill::default(), breeder: None }
    }

    /// Crosses winners (with probability `crossover_prob` per rated window)
    /// through this LLM; children must pass the worker's content denylist.
    pub fn with_crossover(
        mut self,
        backend: Arc<dyn LlmBackend>,
        llm: LlmConfig,
        denylist: Arc<ContentDenylist>,
    ) -> Self {
        self.breeder = Some(Breeder {
            store: self.store.clone(),
            population: self.settings.policy(),
            backend,
            llm: Arc::new(llm),
            denylist,
        });
        self
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
            let started = std::time::Instant::now();
            match self.tick(Utc::now()).await {
                Ok(phases) => phases.record(started.elapsed()),
                Err(e) => tracing::warn!(error = %e, "population rating tick failed"),
            }
            metrics::histogram!("combee_rater_tick_seconds").record(started.elapsed().as_secs_f64());
        }
    }

    /// Rates every `evaluated` prompt whose window is due, once; where the
    /// time went. Which windows are due comes from one statement per page of
    /// prompts ([`crate::store::PopulationStore::rating_schedule`]), so a tick
    /// costs O(windows due or looked at), not O(prompts × reads): an open
    /// window that may close early is looked at once per `min_window_secs`
    /// ([`window_may_be_due`]). A population never rated before waits for its
    /// slot (see [`first_window_due`]), so prompts created together are rated
    /// in different ticks and every tick rates about `tick_secs / window_secs`
    /// of them.
    pub async fn tick(&self, now: DateTime<Utc>) -> StoreResult<TickPhases> {
        let mut phases = TickPhases::default();
        let mut after: Option<PromptName> = None;
        loop {
            let listed = std::time::Instant::now();
            let page = self.store.rating_schedule(after.as_ref(), PAGE).await?;
            phases.list += listed.elapsed();
            for slot in &page {
                phases.checked += 1;
                // A pre-filter: the rating reads the arms and decides again.
                let windows = (self.settings.window_secs, self.settings.min_window_secs);
                let due = window_may_be_due(
                    &slot.prompt.qualified(),
                    slot.rated_until,
                    slot.live_arms,
                    now,
                    self.settings.tick_secs,
                    windows,
                );
                if !due {
                    continue;
                }
                if let Err(e) = self.rate_timed(&slot.prompt, now, true, &mut phases).await {
                    tracing::warn!(prompt = %slot.prompt, error = %e, "could not rate the population");
                }
            }
            if page.len() < PAGE as usize {
                return Ok(phases);
            }
            after = page.last().map(|s| s.prompt.clone());
        }
    }

    /// Rates the window `[now − window_secs, now)` of one prompt (unless a
    /// window ending after `now − window_secs` was rated already: windows do
    /// not overlap, so no trace counts twice), then runs the gate, then (with
    /// an LLM) maybe a crossover of the window's winners, whose failure is
    /// logged and counted but does not fail the rating.
    pub async fn rate(&self, prompt: &PromptName, now: DateTime<Utc>) -> StoreResult<RatingOutcome> {
        self.rate_timed(prompt, now, false, &mut TickPhases::default()).await
    }

    /// [`Self::rate`], adding where the time went to `phases`; with
    /// `stagger`, a population never rated waits for its slot.
    async fn rate_timed(
        &self,
        prompt: &PromptName,
        now: DateTime<Utc>,
        stagger: bool,
        phases: &mut TickPhases,
    ) -> StoreResult<RatingOutcome> {
        let (outcome, rated) = self.rate_window(prompt, now, stagger, phases).await?;
        let Some(rated) = rated else { return Ok(outcome) };
        phases.rated += 1;
        if let Some(breeder) = &self.breeder {
            let started = std::time::Instant::now();
            let crossed = breeder.breed(rated, &mut phases.crossover_llm).await;
            phases.crossover += started.elapsed();
            match crossed {
                Ok(done) => {
                    metrics::counter!("combee_crossover_total", "outcome" => done.label()).increment(1);
                    if let CrossoverOutcome::Bred { version, parents, rating } = &done {
                        tracing::info!(%prompt, version, ?parents, mu = rating.mu, sigma = rating.sigma, "crossover child joined the population");
                    } else {
                        tracing::debug!(%prompt, outcome = ?done, "no crossover this window");
                    }
                }
                Err(e) => {
                    metrics::counter!("combee_crossover_total", "outcome" => "failed").increment(1);
                    tracing::warn!(%prompt, error = %e, "crossover failed");
                }
            }
        }
        Ok(outcome)
    }

    /// Crossover after the window `[from, until)` was rated: with probability
    /// `crossover_prob`, when at least two live arms each won task keys, one
    /// LLM call chooses which champion bullets to keep and which winners'
    /// bullets to import; the child is a new version (source `crossover`,
    /// label `candidate`, the evidence in the label history) and joins the
    /// population. Does nothing without an LLM (`NotDrawn`).
    pub async fn cross(
        &self,
        prompt: &PromptName,
        from: DateTime<Utc>,
        until: DateTime<Utc>,
    ) -> Result<CrossoverOutcome, CrossoverError> {
        let Some(breeder) = &self.breeder else { return Ok(CrossoverOutcome::NotDrawn) };
        let (own, policy) = effective_policy(&self.store, prompt, &self.settings.policy()).await?;
        let champion = production_version(&self.store, prompt).await?.ok_or(StoreError::NotFound)?;
        let live = self.store.live_arms(prompt, &[]).await?;
        let live = live.iter().filter(|a| a.state != ArmState::Retired).map(|a| a.version).collect();
        let rated = RatedWindow { prompt: own, policy, champion, live, tasks: None, from, until };
        let mut llm = Duration::ZERO;
        breeder.breed(rated, &mut llm).await
    }

    /// Rating windows since `production` last moved from one version to another
    /// (`None`: it never did — only its creation is on record), counted in
    /// windows as long as the one being rated (`window_len_secs`): windows
    /// close early at high traffic, and the cool-down is as many of them.
    async fn windows_since_move(
        &self,
        prompt: &PromptName,
        now: DateTime<Utc>,
        window_len_secs: u64,
    ) -> StoreResult<Option<u64>> {
        let last = self.store.label_history(prompt, Some(&LabelName::production()), None, 1).await?;
        Ok(last
            .first()
            .filter(|m| m.from_version.is_some())
            .map(|m| (now - m.at).num_seconds().max(0) as u64 / window_len_secs.max(1)))
    }

    /// The window to rate at `now`, if one is due, and whether it closes
    /// early (then only with the evidence [`evidence_to_close`] asks for).
    /// After a rated window the next starts where it ended and has its full
    /// length at `window_secs` (if the population was not rated for longer,
    /// its last `window_secs`), or may close early from `min_window_secs` on; a
    /// population never rated has its last `window_secs`, full at its slot
    /// when `stagger` (see [`first_window_due`]), or early at its slot in
    /// every `min_window_secs` when there are two live arms to compare.
    fn window_of(
        &self,
        prompt: &PromptName,
        arms: &[crate::domain::population::PopulationArm],
        now: DateTime<Utc>,
        stagger: bool,
    ) -> Option<(DateTime<Utc>, bool)> {
        let full = self.settings.window_secs.max(1);
        let shortest = self.settings.min_window_secs.clamp(1, full);
        let secs = |n: u64| chrono::Duration::seconds(n.min(i64::MAX as u64) as i64);
        let compared = arms.iter().filter(|a| a.state != ArmState::Retired).count() >= 2;
        match arms.iter().filter_map(|a| a.rated_until).max() {
            Some(t) if t > now - secs(full) => (now - t >= secs(shortest) && compared).then_some((t, true)),
            Some(_) => Some((now - secs(full), false)),
            None if stagger && !first_window_due(&prompt.qualified(), now, self.settings.tick_secs, full) => {
                let early = compared && first_window_due(&prompt.qualified(), now, self.settings.tick_secs, shortest);
                early.then_some((now - secs(full), true))
            }
            None => Some((now - secs(full), false)),
        }
    }

    /// Rates the window ending at `now` if it is due; with the outcome, what
    /// it read (`None` when the window was still open). Reads the window,
    /// lets [`rater::rate`] judge it, saves the ratings, and applies a
    /// promotion through [`Mover::move_production`].
    async fn rate_window(
        &self,
        prompt: &PromptName,
        now: DateTime<Utc>,
        stagger: bool,
        phases: &mut TickPhases,
    ) -> StoreResult<(RatingOutcome, Option<RatedWindow>)> {
        let started = std::time::Instant::now();
        let (own, policy) = effective_policy(&self.store, prompt, &self.settings.policy()).await?;
        let Some(champion) = production_version(&self.store, prompt).await? else {
            return Err(StoreError::NotFound);
        };
        let mut arms = self.store.live_arms(prompt, &[champion]).await?;
        phases.check += started.elapsed();
        reconcile(&mut arms, champion, &policy);
        let Some((from, early)) = self.window_of(prompt, &arms, now, stagger) else {
            return Ok((RatingOutcome::WindowOpen, None));
        };
        let started = std::time::Instant::now();
        // Only the live arms' outcomes are read: a busy prompt's window may
        // hold many versions that are no longer in play.
        let live: Vec<Arm> = arms.iter().filter(|a| a.state != ArmState::Retired).map(Arm::from).collect();
        let in_play: Vec<i64> = live.iter().map(|a| a.version).collect();
        let width = (now - from).num_seconds().max(1);
        let buckets = self.store.version_outcomes(prompt, from, now, width, Some(&in_play)).await?;
        // The challenger exploration favours: the window may close early once it and the champion have evidence.
        let leader = arms
            .iter()
            .filter(|a| a.state == ArmState::Challenger)
            .max_by(|a, b| a.weight.total_cmp(&b.weight).then(a.version.cmp(&b.version)))
            .map(|a| a.version);
        if early && !evidence_to_close(&buckets, champion, leader, self.settings.min_window_traces) {
            phases.read += started.elapsed();
            return Ok((RatingOutcome::WindowOpen, None));
        }
        let tasks = if rater::needs_tasks(&live, &buckets, self.settings.min_window_traces) {
            Some(self.store.task_rewards(prompt, from, now).await?)
        } else {
            None
        };
        let since_move = self.windows_since_move(prompt, now, width as u64).await?;
        // Within the cool-down only a version learned on top of production may move it: read its line.
        let built_on_champion: Vec<i64> = if since_move.is_some_and(|w| w < policy.cooldown_windows) {
            let line = line_of(&self.store, prompt, champion).await?;
            in_play.iter().copied().filter(|v| built_on(&line, *v, champion)).collect()
        } else {
            Vec::new()
        };
        phases.read += started.elapsed();
        let window = rater::Window {
            arms: &live,
            champion,
            buckets: &buckets,
            tasks: tasks.as_deref(),
            min_window_traces: self.settings.min_window_traces,
            windows_since_move: since_move,
            built_on_champion: &built_on_champion,
            policy: &policy,
            from,
            until: now,
        };
        let plan = rater::rate(&window, &self.trueskill).map_err(|e| StoreError::Corrupt(e.to_string()))?;
        for a in arms.iter_mut().filter(|a| a.state != ArmState::Retired) {
            a.rated_until = Some(now);
            if let Some(rated) = plan.arms.iter().find(|r| r.version == a.version) {
                (a.rating, a.scored_traces) = (rated.rating, rated.scored_traces);
            }
        }
        // What the crossover after this window needs, made once on whichever path the gate takes.
        let rated =
            move |champion: i64| RatedWindow { prompt: own, policy, champion, live: in_play, tasks, from, until: now };
        let started = std::time::Instant::now();
        // Save the ratings first: they are the evidence, whatever happens to a move.
        reconcile(&mut arms, champion, &policy);
        self.store.save_ratings(prompt, &arms).await?;
        let Some(promotion) = plan.promotion else {
            phases.save += started.elapsed();
            let outcome =
                RatingOutcome::Rated { ranked: plan.ranked, basis: plan.basis, rewards: plan.rewards, gate: plan.gate };
            return Ok((outcome, Some(rated(champion))));
        };
        let mv = LabelMove {
            label: LabelName::production(),
            to_version: promotion.to,
            expected_current: Some(promotion.from),
            check_current: true,
            by: GATE_ACTOR.to_owned(),
        };
        let cause =
            MoveCause::new(LabelMoveKind::GatePromote, promotion.reason.clone()).with_evidence(promotion.evidence);
        let moved = Mover::background(&self.store, self.settings.policy()).move_production(prompt, &mv, &cause).await;
        phases.save += started.elapsed();
        let (from, to) = (promotion.from, promotion.to);
        match moved {
            Ok(_) => {
                tracing::info!(%prompt, from, to, reason = %promotion.reason, "promotion gate moved production");
                Ok((RatingOutcome::Promoted { from, to }, Some(rated(to))))
            }
            Err(StoreError::Conflict) => {
                // Someone else moved production: the crossover breeds on theirs.
                let now_champion = production_version(&self.store, prompt).await?.ok_or(StoreError::NotFound)?;
                Ok((RatingOutcome::Raced, Some(rated(now_champion))))
            }
            Err(e) => Err(e),
        }
    }
}
