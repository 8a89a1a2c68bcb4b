//! The population rater's loop, run by worker processes, and how arms join:
//! a learned version joins as a challenger (mutation: the parent's μ,
//! σ = √(σ_parent² + 1)) instead of moving `production`; periodically the
//! rater reads each due prompt's last rating window, hands it to the pure
//! rater ([`crate::evaluate::rater`]: ranking, TrueSkill, the promotion gate),
//! saves the ratings and weights, and moves `production` where the gate says
//! so through its one door ([`crate::service::production::Mover`]) — a
//! `gate-promote` in the label history with the numbers. The champion is
//! always the version `production` points at; any move of it is reconciled
//! here again on the next tick.
//! After a rated window, with probability `crossover_prob` and when at least
//! two arms each won some task keys, one LLM call crosses the winners into a
//! child (source `crossover`, see [`crate::learn::crossover`]) that joins as a
//! challenger with μ = the precision-weighted mean of its parents' μ,
//! σ = √(1/Σσᵢ⁻² + 1); a failure is logged and counted, never fatal.

use std::{collections::BTreeMap, sync::Arc, time::Duration};

use chrono::{DateTime, Utc};
use serde_json::json;
use sha2::{Digest, Sha256};
use tokio_util::sync::CancellationToken;

use crate::{
    config::PopulationSettings,
    domain::{LabelMoveKind, LabelName, MoveCause, Prompt, PromptName, Strategy, VersionSource, prompt::NewVersion},
    evaluate::{
        population::{Arm, GateDecision, PopulationPolicy, arm_to_retire},
        rater::{self, Basis, TIE, first_window_due, task_winners},
        trueskill::{Rating, TrueSkill},
    },
    learn::{
        crossover::{self, Winner},
        delta::Budget,
        denylist::ContentDenylist,
    },
    llm::{LlmBackend, LlmError, config::LlmConfig},
    service::{
        population::{effective_policy, reconcile},
        production::{Mover, production_version},
    },
    store::{ArmState, DynStore, LabelMove, PopulationArm, Selector, StoreError, StoreResult, TaskRewards},
};

/// Who the gate's moves are recorded as.
pub const GATE_ACTOR: &str = "gate";

/// Who crossover children are made and labelled by.
pub const CROSSOVER_ACTOR: &str = "crossover";

/// Most prompts one list call returns.
const PAGE: u32 = 200;

/// Mutation: `version`, learned from `parent`, joins the population of
/// `prompt` as a challenger with the parent's μ and σ = √(σ_parent² + 1);
/// the weakest challenger is retired when there are more than `max_arms`.
/// Weights are recomputed and saved.
pub async fn add_challenger(
    store: &DynStore,
    prompt: &PromptName,
    version: i64,
    parent: Option<i64>,
    policy: &PopulationPolicy,
) -> StoreResult<Vec<PopulationArm>> {
    let parents: Vec<i64> = parent.into_iter().collect();
    join(store, prompt, version, &parents, policy, |rated| rated.first().copied().unwrap_or_default().mutated_child())
        .await
}

/// Crossover: `version`, bred from `parents` (the first is the champion whose
/// bullets it kept), joins as a challenger with μ = the precision-weighted
/// mean of the parents' μ and σ = √(1/Σσᵢ⁻² + 1); retirement as for mutation.
pub async fn add_crossover_child(
    store: &DynStore,
    prompt: &PromptName,
    version: i64,
    parents: &[i64],
    policy: &PopulationPolicy,
) -> StoreResult<Vec<PopulationArm>> {
    join(store, prompt, version, parents, policy, |rated| {
        Rating::crossover_child(rated).unwrap_or_else(|| Rating::default().mutated_child())
    })
    .await
}

/// A new arm joins: its prior from its parents' current ratings (a parent
/// that never was an arm counts at the default prior), the weakest
/// challenger retired while there are more than `max_arms`, weights saved.
async fn join(
    store: &DynStore,
    prompt: &PromptName,
    version: i64,
    parents: &[i64],
    policy: &PopulationPolicy,
    prior: impl FnOnce(&[Rating]) -> Rating,
) -> StoreResult<Vec<PopulationArm>> {
    let champion = production_version(store, prompt).await?.ok_or(StoreError::NotFound)?;
    let (_, policy) = &effective_policy(store, prompt, policy).await?;
    let also: Vec<i64> = std::iter::once(champion).chain(parents.iter().copied()).collect();
    let mut arms = store.live_arms(prompt, &also).await?;
    reconcile(&mut arms, champion, policy);
    let rated: Vec<Rating> =
        parents.iter().map(|p| arms.iter().find(|a| a.version == *p).map_or(Rating::default(), |a| a.rating)).collect();
    arms.retain(|a| a.version != version);
    arms.push(PopulationArm {
        version,
        state: ArmState::Challenger,
        rating: prior(&rated),
        weight: 0.0,
        scored_traces: 0,
        created_from: parents.first().copied(),
        parents: parents.to_vec(),
        rated_until: None,
    });
    // `max_arms` counts challengers; retire until there is room (the newest stays).
    let mut live: Vec<Arm> = arms.iter().filter(|a| a.state != ArmState::Retired).map(Arm::from).collect();
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

/// The LLM and the content rules crossover children are made with.
#[derive(Clone)]
struct Breeder {
    backend: Arc<dyn LlmBackend>,
    llm: Arc<LlmConfig>,
    denylist: Arc<ContentDenylist>,
}

/// What a crossover attempt after a rated window did.
#[derive(Debug, Clone, PartialEq)]
pub enum CrossoverOutcome {
    /// The window's draw against `crossover_prob` said no.
    NotDrawn,
    /// Fewer than two arms won task keys in the window.
    TooFewWinners { winners: Vec<i64> },
    /// Only playbook prompts have bullets to cross.
    NotPlaybook,
    /// The model imported nothing the champion does not already hold.
    NothingImported,
    /// The child would have the same content as this live arm (e.g. the same
    /// winners crossed again in a later window): no new version.
    SameAsArm { version: i64 },
    /// The child `version`, bred from `parents` (the champion first), joined the population.
    Bred { version: i64, parents: Vec<i64>, rating: Rating },
}

/// What rating a window read, handed on to the crossover after it so the
/// crossover reads nothing twice.
struct RatedWindow {
    prompt: Prompt,
    policy: PopulationPolicy,
    /// The version `production` points at after the rating (and the gate).
    champion: i64,
    /// The live arms' versions.
    live: Vec<i64>,
    /// The window's task rewards, when the rating read them (two or more ranked arms).
    tasks: Option<Vec<TaskRewards>>,
    from: DateTime<Utc>,
    until: DateTime<Utc>,
}

/// Why a crossover attempt failed (logged and counted; the rater goes on).
#[derive(Debug, thiserror::Error)]
pub enum CrossoverError {
    #[error("store: {0}")]
    Store(#[from] StoreError),
    #[error("the crossover call failed: {0}")]
    Llm(#[from] LlmError),
    #[error("the child was refused: {0}")]
    Refused(String),
}

impl CrossoverOutcome {
    fn label(&self) -> &'static str {
        match self {
            Self::NotDrawn => "not_drawn",
            Self::TooFewWinners { .. } => "too_few_winners",
            Self::NotPlaybook => "not_playbook",
            Self::NothingImported => "nothing_imported",
            Self::SameAsArm { .. } => "same_as_arm",
            Self::Bred { .. } => "bred",
        }
    }
}

/// The window's crossover draw in [0, 1): the same for the same prompt and
/// window end in every process, so a test can force it with 0 or 1.
fn crossover_draw(prompt: &PromptName, window_end: DateTime<Utc>) -> f64 {
    let digest = Sha256::new()
        .chain_update(b"crossover")
        .chain_update(prompt.as_str().as_bytes())
        .chain_update(window_end.timestamp_micros().to_le_bytes())
        .finalize();
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    (u64::from_le_bytes(first) >> 11) as f64 / (1u64 << 53) as f64
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
        self.breeder = Some(Breeder { backend, llm: Arc::new(llm), denylist });
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
    /// costs O(windows due), not O(prompts × reads). A population never rated
    /// before waits for its slot (see [`first_window_due`]), so prompts created
    /// together are rated in different ticks and every tick rates about
    /// `tick_secs / window_secs` of them.
    pub async fn tick(&self, now: DateTime<Utc>) -> StoreResult<TickPhases> {
        let mut phases = TickPhases::default();
        let from = now - chrono::Duration::seconds(self.settings.window_secs as i64);
        let mut after: Option<String> = None;
        loop {
            let listed = std::time::Instant::now();
            let page = self.store.rating_schedule(after.as_deref(), PAGE).await?;
            phases.list += listed.elapsed();
            for slot in &page {
                phases.checked += 1;
                // A pre-filter: the rating reads the arms and decides again.
                let due = match slot.rated_until {
                    Some(t) => t <= from,
                    None => {
                        first_window_due(slot.prompt.as_str(), now, self.settings.tick_secs, self.settings.window_secs)
                    }
                };
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
            after = page.last().map(|s| s.prompt.to_string());
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
        if self.breeder.is_some() {
            let started = std::time::Instant::now();
            let crossed = self.breed(rated, &mut phases.crossover_llm).await;
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
        if self.breeder.is_none() {
            return Ok(CrossoverOutcome::NotDrawn);
        }
        let (own, policy) = effective_policy(&self.store, prompt, &self.settings.policy()).await?;
        let champion = production_version(&self.store, prompt).await?.ok_or(StoreError::NotFound)?;
        let live = self.store.live_arms(prompt, &[]).await?;
        let live = live.iter().filter(|a| a.state != ArmState::Retired).map(|a| a.version).collect();
        let rated = RatedWindow { prompt: own, policy, champion, live, tasks: None, from, until };
        let mut llm = Duration::ZERO;
        self.breed(rated, &mut llm).await
    }

    /// [`Self::cross`] on what rating the window read already, adding the time
    /// of its LLM call to `llm`.
    async fn breed(&self, rated: RatedWindow, llm: &mut Duration) -> Result<CrossoverOutcome, CrossoverError> {
        let Some(breeder) = &self.breeder else { return Ok(CrossoverOutcome::NotDrawn) };
        let RatedWindow { prompt: p, policy, champion, live: mut versions, tasks, from, until } = rated;
        let prompt = &p.name;
        if crossover_draw(prompt, until) >= policy.crossover_prob {
            return Ok(CrossoverOutcome::NotDrawn);
        }
        if p.strategy != Strategy::Playbook {
            return Ok(CrossoverOutcome::NotPlaybook);
        }
        versions.sort_unstable();
        let tasks = match tasks {
            Some(tasks) => tasks,
            None => self.store.task_rewards(prompt, from, until).await?,
        };
        let won = task_winners(&tasks, &versions, TIE);
        if won.len() < 2 {
            return Ok(CrossoverOutcome::TooFewWinners { winners: won.into_keys().collect() });
        }
        let load = |v: i64| async move {
            self.store
                .resolve(prompt, &Selector::Version(v))
                .await?
                .map(|r| r.version)
                .ok_or(CrossoverError::Refused(format!("version {v} is gone")))
        };
        let champion_version = load(champion).await?;
        let mut winner_versions = Vec::new();
        for v in won.keys() {
            winner_versions.push(load(*v).await?);
        }
        let winners: Vec<Winner<'_>> = winner_versions
            .iter()
            .map(|v| Winner { version: v.number, content: &v.content, won: won[&v.number].clone() })
            .collect();
        let mut calls = Vec::new();
        let asked = std::time::Instant::now();
        let selection = crossover::select(
            breeder.backend.as_ref(),
            &breeder.llm,
            champion,
            &champion_version.content,
            &winners,
            &mut calls,
        )
        .await;
        *llm += asked.elapsed();
        let selection = selection?;
        let budget = Budget {
            max_bullets: p.settings.max_bullets,
            max_chars: p.settings.max_chars,
            pinned: p.settings.pinned_bullets.clone(),
            max_removal_share: Some(p.settings.max_removal_share),
        };
        let Some((child, applied)) = crossover::breed(&champion_version.content, &selection, &budget) else {
            return Ok(CrossoverOutcome::NothingImported);
        };
        breeder.denylist.check(&champion_version.content, &child).map_err(CrossoverError::Refused)?;
        let child_hash = child.hash();
        for v in &versions {
            let Some(existing) = self.store.resolve(prompt, &Selector::Version(*v)).await? else { continue };
            if existing.version.content_hash == child_hash {
                return Ok(CrossoverOutcome::SameAsArm { version: *v });
            }
        }
        // The champion (whose bullets the child kept) first, then the winners.
        let mut parents = vec![champion];
        parents.extend(won.keys().copied().filter(|v| *v != champion));
        let imported: BTreeMap<i64, usize> = selection.import.iter().fold(BTreeMap::new(), |mut m, i| {
            *m.entry(i.from_version).or_default() += 1;
            m
        });
        let from_list = imported.iter().map(|(v, n)| format!("{n} from v{v}")).collect::<Vec<_>>().join(", ");
        let message = format!(
            "crossover of {}: kept v{champion}'s bullets ({} dropped), imported {from_list}",
            parents.iter().map(|v| format!("v{v}")).collect::<Vec<_>>().join(", "),
            selection.drop.len(),
        );
        let version = self
            .store
            .create_version(
                prompt,
                NewVersion {
                    parent: Some(champion),
                    source: VersionSource::Crossover,
                    round_id: None,
                    content: child,
                    message: message.clone(),
                    created_by: CROSSOVER_ACTOR.to_owned(),
                },
                &[],
            )
            .await?;
        let arms = add_crossover_child(&self.store, prompt, version.number, &parents, &self.settings.policy()).await?;
        let rating = arms.iter().find(|a| a.version == version.number).map_or_else(Rating::default, |a| a.rating);
        let parent_ratings: Vec<serde_json::Value> = parents
            .iter()
            .map(|v| json!({"version": v, "rating": arms.iter().find(|a| a.version == *v).map(|a| a.rating)}))
            .collect();
        let evidence = json!({
            "parents": parent_ratings,
            "child": {"version": version.number, "rating": rating},
            "won": won.iter().map(|(v, keys)| json!({"version": v, "tasks": keys})).collect::<Vec<_>>(),
            "window": {"from": from, "until": until},
            "template": crossover::template_id(),
            "selection": {"drop": selection.drop, "import": selection.import, "reason": selection.reason},
            "answer": selection.notes,
            "applied": applied.applied.len(),
            "skipped": applied.skipped.len(),
            "llm_calls": calls,
        });
        let mv = LabelMove {
            label: LabelName::candidate(),
            to_version: version.number,
            expected_current: None,
            check_current: false,
            by: CROSSOVER_ACTOR.to_owned(),
        };
        let cause = MoveCause::new(LabelMoveKind::Crossover, message).with_evidence(evidence);
        // The child exists and competes either way; the label is its pointer for people.
        if let Err(e) = self.store.move_label_because(prompt, &mv, &cause).await {
            tracing::warn!(%prompt, version = version.number, error = %e, "the crossover child was not labelled candidate");
        }
        Ok(CrossoverOutcome::Bred { version: version.number, parents, rating })
    }

    /// Rating windows since `production` last moved from one version to another
    /// (`None`: it never did — only its creation is on record).
    async fn windows_since_move(&self, prompt: &PromptName, now: DateTime<Utc>) -> StoreResult<Option<u64>> {
        let last = self.store.label_history(prompt, Some(&LabelName::production()), None, 1).await?;
        Ok(last
            .first()
            .filter(|m| m.from_version.is_some())
            .map(|m| (now - m.at).num_seconds().max(0) as u64 / self.settings.window_secs.max(1)))
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
        let from = now - chrono::Duration::seconds(self.settings.window_secs as i64);
        let last_rated = arms.iter().filter_map(|a| a.rated_until).max();
        if last_rated.is_some_and(|t| t > from)
            || (stagger
                && last_rated.is_none()
                && !first_window_due(prompt.as_str(), now, self.settings.tick_secs, self.settings.window_secs))
        {
            return Ok((RatingOutcome::WindowOpen, None));
        }
        let started = std::time::Instant::now();
        // Only the live arms' outcomes are read: a busy prompt's window may
        // hold many versions that are no longer in play.
        let live: Vec<Arm> = arms.iter().filter(|a| a.state != ArmState::Retired).map(Arm::from).collect();
        let in_play: Vec<i64> = live.iter().map(|a| a.version).collect();
        let buckets =
            self.store.version_outcomes(prompt, from, now, self.settings.window_secs as i64, Some(&in_play)).await?;
        let tasks = if rater::needs_tasks(&live, &buckets, self.settings.min_window_traces) {
            Some(self.store.task_rewards(prompt, from, now).await?)
        } else {
            None
        };
        let since_move = self.windows_since_move(prompt, now).await?;
        phases.read += started.elapsed();
        let window = rater::Window {
            arms: &live,
            champion,
            buckets: &buckets,
            tasks: tasks.as_deref(),
            min_window_traces: self.settings.min_window_traces,
            windows_since_move: since_move,
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
            let outcome = RatingOutcome::Rated { ranked: plan.ranked, basis: plan.basis, gate: plan.gate };
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_crossover_draw_is_seeded_by_prompt_and_window() {
        let p = PromptName::parse("p").unwrap();
        let t = DateTime::parse_from_rfc3339("2026-11-23T16:00:00Z").unwrap().with_timezone(&Utc);
        assert_eq!(crossover_draw(&p, t), crossover_draw(&p, t));
        // Over many windows about a fifth fall below 0.2, all below 1, none below 0.
        let draws: Vec<f64> = (0..2000).map(|i| crossover_draw(&p, t + chrono::Duration::seconds(i))).collect();
        assert!(draws.iter().all(|d| (0.0..1.0).contains(d)));
        let share = draws.iter().filter(|d| **d < 0.2).count() as f64 / 2000.0;
        assert!((share - 0.2).abs() < 0.03, "{share}");
    }

    #[test]
    fn a_crossover_childs_prior_is_the_precision_weighted_mean_of_its_parents() {
        // σ 2 and 4: precisions 1/4 and 1/16; μ = (30/4 + 18/16) / (5/16) = 27.6; σ = √(16/5 + 1).
        let child =
            Rating::crossover_child(&[Rating { mu: 30.0, sigma: 2.0 }, Rating { mu: 18.0, sigma: 4.0 }]).unwrap();
        assert!((child.mu - 27.6).abs() < 1e-12, "{child:?}");
        assert!((child.sigma - (16.0f64 / 5.0 + 1.0).sqrt()).abs() < 1e-12, "{child:?}");
        // Two fresh arms at the prior: μ stays 25, σ = √(σ0²/2 + 1).
        let fresh = Rating::crossover_child(&[Rating::default(), Rating::default()]).unwrap();
        assert!((fresh.mu - 25.0).abs() < 1e-12);
        assert!((fresh.sigma - ((25.0f64 / 3.0).powi(2) / 2.0 + 1.0).sqrt()).abs() < 1e-12);
    }
}
