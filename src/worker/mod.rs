//! The background worker: decides when a prompt's backlog deserves a round,
//! claims rounds under a lease (`FOR UPDATE SKIP LOCKED` on Postgres), keeps
//! the lease alive with a heartbeat fenced by the attempt number, runs the
//! round without holding any transaction across LLM calls, and publishes or
//! fails it. A crashed process's rounds are resumed by whoever claims them
//! after the lease expires, from the reflections already stored.

pub mod breeder;
pub mod choices;
pub mod gate;
pub mod guard;
mod journal;
pub mod judge;
pub mod publish;
pub mod rater;
pub mod retention;
pub mod rollups;

use std::{sync::Arc, time::Duration};

use rand::Rng;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

pub use journal::{StoreJournal, unreflected_faults};

use crate::{
    config::WorkerSettings,
    domain::{BatchSize, Method, Promotion, RoundDetail, round::RoundTrigger},
    learn::{
        capacity::batch_size::ControllerConfig,
        denylist::ContentDenylist,
        merge::budget::Budget,
        round::{RoundError, RoundSpec, run_round},
    },
    llm::{
        LlmBackend,
        config::LlmConfig,
        meter::{CallTag, Tagged},
    },
    service::{self, AppState, ServiceResult, population::RoundBase},
    store::{Backlog, ClaimedRound, DynStore, OpenRound, RoundFailure, StoreError, TraceCharges, TraceFault},
};

#[derive(Clone)]
pub struct Worker {
    /// The process's state: the service calls (the controller's reads) take it.
    state: AppState,
    store: DynStore,
    backend: Arc<dyn LlmBackend>,
    llm: Arc<LlmConfig>,
    settings: Arc<WorkerSettings>,
    denylist: Arc<ContentDenylist>,
    controller: Arc<ControllerConfig>,
    choices: Arc<choices::ChoiceLog>,
    /// Population knobs for prompts under the `evaluated` policy.
    population: crate::evaluate::population::PopulationPolicy,
    /// Names this process in leases (`host:pid:random`).
    owner: String,
}

/// A round the scheduler would start for one backlog, as plain data (unit-tested).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoundStart {
    pub trigger: RoundTrigger,
    pub batch: u32,
    pub min_traces: u32,
}

/// A round starts when the backlog reaches `target` (the fixed batch size, or
/// the controller's start threshold), or when the oldest pending trace has
/// waited `max_wait` and at least `min_batch` are pending; it takes up to
/// `batch` traces (the fixed size, or the controller's bound). None starts
/// while the prompt backs off after failed rounds (`failure_backoff_secs`).
pub fn decide(
    b: &Backlog,
    target: u32,
    batch: u32,
    s: &WorkerSettings,
    now: chrono::DateTime<chrono::Utc>,
) -> Option<RoundStart> {
    if b.active_round || b.pending == 0 || b.failures.backing_off(&s.failure_backoff(), now) {
        return None;
    }
    let target = target.max(1);
    let batch = batch.max(target);
    if b.pending >= i64::from(target) {
        return Some(RoundStart { trigger: RoundTrigger::Backlog, batch, min_traces: target });
    }
    let max_wait = b.prompt.settings.max_wait_secs.unwrap_or(s.max_wait_secs);
    let waited = b.oldest.map(|t| (now - t).num_seconds().max(0) as u64).unwrap_or(0);
    (waited >= max_wait && b.pending >= i64::from(s.min_batch)).then_some(RoundStart {
        trigger: RoundTrigger::MaxWait,
        batch,
        min_traces: s.min_batch,
    })
}

use crate::domain::round::random_seed;

impl Worker {
    pub fn new(
        state: AppState,
        backend: Arc<dyn LlmBackend>,
        llm: LlmConfig,
        settings: WorkerSettings,
        controller: ControllerConfig,
    ) -> Self {
        let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "combee".into());
        let tag: u32 = rand::thread_rng().r#gen();
        let owner = format!("{host}:{}:{tag:08x}", std::process::id());
        let denylist =
            ContentDenylist::new(&settings.denylist_substrings, &settings.denylist_patterns).unwrap_or_else(|e| {
                // Settings::load refuses this at start-up; fail closed if it slips through anyway.
                tracing::error!(error = %e, "invalid denylist: no learned version will be published");
                ContentDenylist::new(&[], &["(?s).".to_owned()]).unwrap_or_default()
            });
        Self {
            store: state.store.clone(),
            state,
            backend,
            denylist: Arc::new(denylist),
            llm: Arc::new(llm),
            settings: Arc::new(settings),
            controller: Arc::new(controller),
            choices: Arc::default(),
            population: Default::default(),
            owner,
        }
    }

    /// The LLM and content denylist this worker learns with (crossover uses them too).
    pub fn llm_parts(&self) -> (Arc<dyn LlmBackend>, LlmConfig, Arc<ContentDenylist>) {
        (self.backend.clone(), (*self.llm).clone(), self.denylist.clone())
    }

    /// Uses these population knobs (from `[population]`) for `evaluated` prompts.
    pub fn with_population(mut self, policy: crate::evaluate::population::PopulationPolicy) -> Self {
        self.population = policy;
        self
    }

    /// Runs until `shutdown`; rounds in progress are abandoned to their lease
    /// (another process, or this one after a restart, resumes them).
    ///
    /// A wake (a round queued anywhere, a round of this worker done, any other
    /// change) claims what is claimable at once, but the scheduler, which
    /// reads every prompt's backlog and batch-size controller, runs at most
    /// once per poll interval: under steady learning a wake comes several
    /// times per finished round, and scheduling on each one kept Postgres busy
    /// with thousands of controller reads a second.
    pub async fn run(self, shutdown: CancellationToken) {
        let mut changes = self.store.changes();
        let mut running: JoinSet<()> = JoinSet::new();
        let mut gates: JoinSet<()> = JoinSet::new();
        let poll = Duration::from_millis(self.settings.poll_interval_ms);
        let mut next_schedule = tokio::time::Instant::now();
        tracing::info!(owner = %self.owner, "learning worker started");
        // The server's caps may have been raised with this start: rounds waiting for them look again now.
        if let Err(e) = self.store.lift_server_budget(self.state.clock.now().date_naive()).await {
            tracing::warn!(error = %e, "rounds waiting for the budget could not be woken");
        }
        loop {
            if tokio::time::Instant::now() >= next_schedule {
                if let Err(e) = self.schedule().await {
                    tracing::warn!(error = %e, "scheduling rounds failed");
                }
                metrics::counter!("combee_worker_schedule_passes_total").increment(1);
                self.gates(&mut gates).await;
                next_schedule = tokio::time::Instant::now() + poll;
            }
            while running.len() < self.settings.max_parallel_rounds {
                match self.store.claim_round(&self.owner, Duration::from_secs(self.settings.lease_secs)).await {
                    Ok(Some(claimed)) => {
                        let worker = self.clone();
                        let stop = shutdown.child_token();
                        running.spawn(async move { worker.execute(claimed, stop).await });
                    }
                    Ok(None) => break,
                    Err(e) => {
                        tracing::warn!(error = %e, "claiming a round failed");
                        break;
                    }
                }
            }
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = tokio::time::sleep_until(next_schedule) => {}
                Some(_) = running.join_next(), if !running.is_empty() => {}
                c = changes.recv() => {
                    if matches!(c, Err(tokio::sync::broadcast::error::RecvError::Closed)) {
                        changes = self.store.changes();
                    }
                }
            }
        }
        running.abort_all();
        gates.abort_all();
        tracing::info!("learning worker stopped");
    }

    /// Regression gates: rejects those whose harness did not answer in time,
    /// and runs pending ones (at most `max_parallel_rounds` at once) under a
    /// lease, so a gate whose worker died runs again elsewhere.
    async fn gates(&self, running: &mut JoinSet<()>) {
        while running.try_join_next().is_some() {}
        let exposer = service::gate::Exposer::of(&self.state);
        if let Err(e) = service::gate::expire_overdue(&exposer).await {
            tracing::warn!(error = %e, "expiring overdue regression gates failed");
        }
        let room = self.settings.max_parallel_rounds.saturating_sub(running.len());
        if room == 0 {
            return;
        }
        let lease = Duration::from_secs(self.settings.lease_secs.saturating_mul(10));
        let claimed = match self.store.claim_gates(lease, room as u32).await {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "claiming regression gates failed");
                return;
            }
        };
        for open in claimed {
            let worker = self.clone();
            running.spawn(async move {
                let Ok(Some(prompt)) = worker.store.get_prompt(&open.prompt).await else { return };
                let exposer = service::gate::Exposer::of(&worker.state);
                let settings = &worker.state.settings.regression;
                let version = open.gate.version;
                // The gate's calls count in the prompt's learning budget.
                let tagged = Tagged::new(worker.backend.clone(), CallTag::prompt(&prompt.name.qualified(), "gate"));
                if let Err(e) = gate::run(&worker.store, &tagged, &worker.llm, settings, &exposer, &prompt, open.gate).await
                {
                    tracing::warn!(prompt = %prompt.name, version, error = %e, "a regression gate failed; it runs again");
                }
            });
        }
    }

    /// Opens rounds for prompts whose backlog is due.
    pub async fn schedule(&self) -> ServiceResult<()> {
        let now = self.state.clock.now();
        let backoff = self.settings.failure_backoff();
        // A prompt a daily cap holds back opens no round: its traces stay pending until the cap lifts.
        let held: std::collections::HashSet<String> =
            service::budget::reached_all(&self.state).await?.into_iter().map(|(name, _)| name).collect();
        if held.contains("") {
            return Ok(());
        }
        for backlog in self.store.backlogs().await? {
            // The budget names a prompt by its key (`project/name` outside `default`).
            if held.contains(&*backlog.prompt.name.qualified()) {
                continue;
            }
            // Before the controller's reads: a prompt backing off costs nothing more.
            if backlog.failures.backing_off(&backoff, now) {
                continue;
            }
            if backlog.active_round || backlog.pending == 0 {
                continue;
            }
            let name = &backlog.prompt.name;
            let (target, batch) = match backlog.prompt.settings.batch_size {
                BatchSize::Fixed(n) => (n, n),
                BatchSize::Auto => {
                    let choice = service::controller::current(
                        &self.state,
                        &backlog.prompt,
                        backlog.pending as u64,
                        &self.controller,
                    )
                    .await?;
                    self.choices.record(&self.store, name, &backlog.prompt.project, &choice).await?;
                    (choice.target, choice.cap)
                }
            };
            let Some(d) = decide(&backlog, target, batch, &self.settings, now) else { continue };
            // An `evaluated` prompt learns on from the challenger under measurement, once it had its chance.
            let base_version = if backlog.prompt.promotion == Promotion::Evaluated {
                match service::population::next_round_base(&self.store, name, &self.population, now).await? {
                    RoundBase::From(v) => Some(v),
                    RoundBase::Wait(v) => {
                        tracing::debug!(prompt = %name, waiting_for = v, "learning waits for the challenger's evidence");
                        metrics::counter!("combee_rounds_waiting_for_evidence_total").increment(1);
                        continue;
                    }
                }
            } else {
                None
            };
            let req = OpenRound {
                prompt: backlog.prompt.name.clone(),
                trigger: d.trigger,
                method: Method::Combee,
                batch: d.batch,
                min_traces: d.min_traces,
                seed: random_seed(),
                inbound_webhook_id: None,
                judge_wait: Some(Duration::from_secs(self.settings.judge_wait_secs)),
                base_version,
            };
            match self.store.open_round(&req).await {
                Ok(Some(r)) => {
                    tracing::info!(round = %r.id, prompt = %r.prompt, n = r.n, trigger = ?d.trigger, "round queued")
                }
                Ok(None) | Err(StoreError::AlreadyExists) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    /// Runs one claimed round to publication or failure.
    pub async fn execute(&self, claimed: ClaimedRound, stop: CancellationToken) {
        let ClaimedRound { round, prompt, base, traces } = &claimed;
        let (id, attempt) = (round.id, round.attempt);
        let span = tracing::info_span!("round", round = %id, prompt = %prompt.name, attempt);
        let _enter = span.enter();
        let recorded = RoundDetail::read(&round.detail).unwrap_or_else(|e| {
            tracing::warn!(error = %e, "the round's earlier record is unreadable; this attempt starts a new one");
            RoundDetail::default()
        });
        if attempt > self.settings.max_round_attempts {
            let reason = round.error.clone().unwrap_or_else(|| "the round's worker stopped (lease expired)".into());
            let msg = format!("gave up after {} attempts: {reason}", attempt - 1);
            self.give_up(id, attempt, &msg, unreflected_faults(&recorded)).await;
            return;
        }
        // Keep the lease alive; losing it cancels the round.
        let lost = stop.child_token();
        let heartbeat = self.keep_lease(id, attempt, lost.clone());
        let journal = StoreJournal::new(self.store.clone(), id, attempt, recorded);
        let spec = self.spec_for(round, prompt).await;
        let started = std::time::Instant::now();
        // Every call of this pass counts against the prompt's budget and the round's.
        let pass: i32 = rand::thread_rng().r#gen();
        let backend = Tagged::new(self.backend.clone(), CallTag::round(&prompt.name.qualified(), id, pass));
        let result = tokio::select! {
            r = run_round(&backend, &self.llm, &spec, &base.content, traces, &journal) => Some(r),
            _ = lost.cancelled() => None,
        };
        lost.cancel();
        heartbeat.abort();
        let Some(result) = result else { return };
        let elapsed = started.elapsed().as_secs_f64();
        metrics::histogram!("combee_round_duration_seconds").record(elapsed);
        let degraded_groups = match &result {
            Ok(outcome) => outcome.answers.groups_degraded.len(),
            Err(RoundError::NothingLearned { groups, .. }) => *groups,
            Err(_) => 0,
        };
        if degraded_groups > 0 {
            metrics::counter!("combee_level1_groups_degraded_total").increment(degraded_groups as u64);
        }
        if let Ok(outcome) = &result {
            for r in &outcome.refused {
                metrics::counter!("combee_learned_changes_refused_total", "rule" => r.rule.as_str(), "source" => "round")
                    .increment(1);
            }
        }
        let outcome = match result {
            Ok(outcome) => outcome,
            Err(RoundError::Llm(e)) if e.budget_reached().is_some() => {
                self.wait_for_budget(id, attempt, &prompt.name, &e).await;
                return;
            }
            Err(e) => {
                tracing::warn!(error = %e, retryable = e.is_retryable(), "round attempt failed");
                let faults = unreflected_faults(&journal.detail());
                self.retry_or_give_up(id, attempt, &e.to_string(), e.is_retryable(), faults).await;
                return;
            }
        };
        let mut detail = journal.detail().with_outcome(outcome.record.clone());
        detail.group_outputs = outcome.group_outputs.clone();
        let by = format!("worker:{}", self.owner);
        // A prompt with a regression set (or a harness) holds its learned version back until the gate decides.
        let gated = match service::gate::mode_for(&self.store, &prompt.name).await {
            Ok(mode) => mode,
            Err(e) => {
                tracing::warn!(error = %e, "the regression set could not be read; the version is gated");
                Some(crate::domain::regression::GateMode::Cases)
            }
        };
        let publisher = publish::Publisher { by: &by, max_trace_attempts: self.settings.max_trace_attempts };
        let publication = publish::Publication::of(&claimed, &outcome, detail.to_value(), elapsed, gated, publisher);
        match publish::publish(&self.state, &claimed, publication).await {
            publish::Published::Version(_) | publish::Published::Unchanged | publish::Published::Repeats(_) => {}
            publish::Published::LeaseLost => {
                tracing::warn!("lease lost before publishing; another worker owns the round")
            }
            publish::Published::Failed(e) => {
                tracing::error!(error = %e, "publishing failed");
                let faults = unreflected_faults(&journal.detail());
                self.retry_or_give_up(id, attempt, &format!("publishing failed: {e}"), true, faults).await;
            }
        }
    }

    /// Renews the round's lease every `heartbeat_secs` until `lost` is cancelled;
    /// cancels `lost` itself when the lease is gone (another process owns the round).
    fn keep_lease(&self, id: uuid::Uuid, attempt: i32, lost: CancellationToken) -> tokio::task::JoinHandle<()> {
        let store = self.store.clone();
        let every = Duration::from_secs(self.settings.heartbeat_secs);
        let lease = Duration::from_secs(self.settings.lease_secs);
        tokio::spawn(async move {
            loop {
                tokio::select! { _ = lost.cancelled() => return, _ = tokio::time::sleep(every) => {} }
                match store.heartbeat_round(id, attempt, lease).await {
                    Ok(true) => {}
                    Ok(false) => {
                        tracing::warn!(round = %id, "lease lost; abandoning this attempt");
                        lost.cancel();
                        return;
                    }
                    Err(e) => tracing::warn!(round = %id, error = %e, "heartbeat failed"),
                }
            }
        })
    }

    /// What the claimed round is asked to do: its method, seed and duplication,
    /// the prompt's settings and budget, and the group size the overload meter
    /// gives it now (the meter changes only when a round of this prompt
    /// publishes, so a retried attempt regroups as the first did).
    async fn spec_for(&self, round: &crate::domain::round::Round, prompt: &crate::domain::Prompt) -> RoundSpec {
        let group_size = match service::controller::group_size(&self.state, prompt, &self.controller).await {
            Ok(g) => g,
            Err(e) => {
                tracing::warn!(error = %e, "the overload meter could not be read; using the paper's default groups");
                crate::learn::capacity::sizing::GroupSize::default_because("the overload meter could not be read")
            }
        };
        RoundSpec {
            round_id: round.id,
            seed: round.seed as u64,
            method: round.method,
            strategy: round.strategy,
            duplication: round.duplication.max(1) as u32,
            reduce: prompt.settings.reduce,
            budget: Budget::for_prompt(&prompt.settings, round.strategy),
            agent_reflections: prompt.settings.agent_reflections,
            denylist: self.denylist.clone(),
            group_size,
        }
    }

    /// Puts the round back in the queue without charging the attempt: its
    /// journal keeps what it paid for, and it looks again after
    /// `budget.recheck_secs` (or at once when the prompt's cap is raised).
    async fn wait_for_budget(
        &self,
        id: uuid::Uuid,
        attempt: i32,
        prompt: &crate::domain::PromptName,
        e: &crate::llm::LlmError,
    ) {
        let mut after = Duration::from_secs(self.state.settings.budget.recheck_secs);
        // A daily cap raised while this pass's last calls finished: look again at once.
        let daily = e.budget_reached().is_some_and(|(_, until)| until.is_some());
        if daily && matches!(service::budget::reached(&self.state, prompt).await, Ok(None)) {
            after = Duration::ZERO;
        }
        tracing::info!(error = %e, recheck_secs = after.as_secs(), "the budget holds the round back; it waits");
        metrics::counter!("combee_rounds_budget_waits_total").increment(1);
        match self.store.wait_round(id, attempt, &e.to_string(), after).await {
            Ok(true) => {}
            Ok(false) => tracing::warn!("lease lost before the round could wait; another worker owns it"),
            Err(e) => tracing::warn!(error = %e, "could not put the round back to wait; its lease will expire"),
        }
    }

    /// Only a trace's own failure costs it an attempt (see [`TraceCharges`]).
    fn charges(&self, faults: Vec<TraceFault>) -> TraceCharges {
        TraceCharges { faults, max_trace_attempts: self.settings.max_trace_attempts }
    }

    async fn retry_or_give_up(
        &self,
        id: uuid::Uuid,
        attempt: i32,
        error: &str,
        retryable: bool,
        faults: Vec<TraceFault>,
    ) {
        if retryable && attempt < self.settings.max_round_attempts {
            let after = Duration::from_secs(self.settings.retry_delay_secs * attempt as u64);
            if let Err(e) = self.store.fail_round(id, attempt, error, RoundFailure::Retry { after }).await {
                tracing::warn!(error = %e, "could not re-queue the round");
            }
        } else {
            self.give_up(id, attempt, error, faults).await;
        }
    }

    async fn give_up(&self, id: uuid::Uuid, attempt: i32, error: &str, faults: Vec<TraceFault>) {
        let how = RoundFailure::GiveUp { charges: self.charges(faults) };
        match self.store.fail_round(id, attempt, error, how).await {
            Ok(()) => {
                metrics::counter!("combee_rounds_total", "outcome" => "failed").increment(1);
                tracing::warn!(
                    error,
                    "round failed; its traces are pending again (only failed reflections were charged)"
                )
            }
            Err(e) => tracing::warn!(error = %e, "could not fail the round"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::{Promotion, Prompt, PromptName, PromptSettings, Strategy};
    use chrono::Utc;

    fn backlog(pending: i64, waited_secs: i64) -> Backlog {
        Backlog {
            prompt: Prompt {
                id: uuid::Uuid::nil(),
                name: PromptName::new("default", "p").unwrap(),
                project: "default".into(),
                strategy: Strategy::Playbook,
                promotion: Promotion::Auto,
                settings: PromptSettings::default(),
                created_at: Utc::now(),
                created_by: "t".into(),
            },
            pending,
            oldest: Some(Utc::now() - chrono::Duration::seconds(waited_secs)),
            active_round: false,
            failures: Default::default(),
        }
    }

    fn settings() -> WorkerSettings {
        crate::config::Settings::default().worker
    }

    #[test]
    fn a_full_batch_starts_a_round() {
        let d = decide(&backlog(40, 0), 32, 32, &settings(), Utc::now()).unwrap();
        assert_eq!(d, RoundStart { trigger: RoundTrigger::Backlog, batch: 32, min_traces: 32 });
        let d = decide(&backlog(8, 0), 8, 8, &settings(), Utc::now()).unwrap();
        assert_eq!(d.batch, 8);
        // The controller: start at 4 pending, take up to its bound.
        let d = decide(&backlog(40, 0), 4, 256, &settings(), Utc::now()).unwrap();
        assert_eq!(d, RoundStart { trigger: RoundTrigger::Backlog, batch: 256, min_traces: 4 });
    }

    #[test]
    fn a_long_wait_starts_a_smaller_round() {
        assert_eq!(decide(&backlog(3, 10), 32, 32, &settings(), Utc::now()), None);
        let d = decide(&backlog(3, 601), 32, 32, &settings(), Utc::now()).unwrap();
        assert_eq!(d, RoundStart { trigger: RoundTrigger::MaxWait, batch: 32, min_traces: 1 });
    }

    #[test]
    fn nothing_starts_while_a_round_is_in_flight_or_nothing_is_pending() {
        let mut b = backlog(100, 1000);
        b.active_round = true;
        assert_eq!(decide(&b, 32, 32, &settings(), Utc::now()), None);
        assert_eq!(decide(&backlog(0, 1000), 32, 32, &settings(), Utc::now()), None);
    }

    #[test]
    fn nothing_starts_while_the_prompt_backs_off_after_failed_rounds() {
        let now = Utc::now();
        let mut b = backlog(100, 1000);
        // Two failures in a row: 60 s, then 120 s after the last one.
        b.failures = crate::domain::backoff::FailureStreak {
            failures: 2,
            last_failed_at: Some(now - chrono::Duration::seconds(100)),
            last_failure: None,
        };
        assert_eq!(decide(&b, 32, 32, &settings(), now), None);
        let d = decide(&b, 32, 32, &settings(), now + chrono::Duration::seconds(20)).unwrap();
        assert_eq!(d.trigger, RoundTrigger::Backlog);
    }
}
