//! Rounds: opened over a prompt's oldest pending traces, claimed under a lease with a fenced
//! heartbeat, their reflections and LLM calls, and their end (published or failed).

use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;
use utoipa::ToSchema;
use uuid::Uuid;

use super::{
    Change, PromptStore, StoreError, StoreKind, StoreResult,
    backend::{Backend, SqlStore},
    labels::{apply_move, record_move},
    prompts::prompt_from_row,
    sql::{Cols, Dialect, corrupt, enum_str, json, later, now, sql},
    traces::{TRACE_COLUMNS, trace_from_row},
    versions::{insert_version, prompt_name, prompt_name_of},
    webhooks::record_event,
};
use crate::{
    domain::{
        LabelMoveKind, LabelName, MoveCause, Prompt, PromptName, PromptSettings, Reflection, Trace, Version,
        backoff::FailureStreak,
        event::OutboxEvent,
        label::{LabelMove, Selector},
        prompt::NewVersion,
        round::{self, Method, Round, RoundStatus, RoundTrigger},
    },
    llm::{AnswerRead, LlmCall, OutputFormat, REFUSED_ANSWER_CHARS},
};

/// Most characters of a failed round's error kept as a prompt's `last_failure`.
pub const LAST_FAILURE_CHARS: usize = 2_000;

/// A request to open a round over a prompt's oldest pending traces.
#[derive(Debug, Clone)]
pub struct OpenRound {
    pub prompt: PromptName,
    pub trigger: RoundTrigger,
    pub method: Method,
    /// Take at most this many traces.
    pub batch: u32,
    /// Open nothing when fewer traces are pending.
    pub min_traces: u32,
    pub seed: i64,
    /// The `webhook-id` of the inbound trigger asking for this round: it is
    /// remembered in the round's transaction, so only with a round opened.
    pub inbound_webhook_id: Option<String>,
    /// When the prompt has evaluators, leave out pending traces they have not
    /// judged yet unless they arrived longer ago than this (a broken judge
    /// delays learning by this much, never stops it); `None` takes them all.
    pub judge_wait: Option<std::time::Duration>,
    /// The version the round learns on; `None` (or a version the prompt does
    /// not have): the one `production` points at.
    pub base_version: Option<i64>,
}

/// A prompt's learning backlog, for the scheduler.
#[derive(Debug, Clone, PartialEq)]
pub struct Backlog {
    pub prompt: Prompt,
    /// Pending traces not reserved by a round.
    pub pending: i64,
    pub oldest: Option<DateTime<Utc>>,
    /// A round is queued or running.
    pub active_round: bool,
    /// The prompt's failing rounds (the scheduler waits out their backoff);
    /// `last_failure` is not read here.
    pub failures: FailureStreak,
}

/// A round a worker now holds the lease of, with everything needed to run it.
#[derive(Debug, Clone)]
pub struct ClaimedRound {
    pub round: Round,
    pub prompt: Prompt,
    pub base: Version,
    pub traces: Vec<Trace>,
}

/// One stored LLM call of a round.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct RoundCall {
    pub attempt: i32,
    #[serde(flatten)]
    #[schema(value_type = Object)]
    pub call: LlmCall,
    pub created_at: DateTime<Utc>,
}

/// A trace that failed on its own account in a round: its reflection could not be obtained.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceFault {
    pub trace_id: Uuid,
    pub reason: String,
}

/// What the end of a round charges to its traces. Only a trace's own failure
/// costs it an attempt: each faulted trace returns to pending with one more
/// attempt and the reason in `failure_reason`, or is marked `failed` once its
/// attempts reach `max_trace_attempts`. Every other trace of the round pays nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TraceCharges {
    pub faults: Vec<TraceFault>,
    pub max_trace_attempts: i32,
}

/// The end of a round that succeeded, as one value: everything the store
/// writes in the round's last, fenced transaction ([`RoundStore::finish_round`]).
#[derive(Debug, Clone)]
pub struct RoundEnd {
    pub round: Uuid,
    /// The attempt that holds the lease (the fence).
    pub attempt: i32,
    /// The version the round made and the label it gets; `None` when the
    /// round succeeded without one (what it learned changed nothing, or
    /// repeated a version the prompt has).
    pub version: Option<(NewVersion, LabelName)>,
    /// The round's record (`detail`).
    pub detail: Value,
    /// The round's level-1 groups.
    pub k: Option<i32>,
    /// The round's wall time, when it is a sample of the delay the batch-size controller models.
    pub sample_secs: Option<f64>,
    pub charges: TraceCharges,
}

/// How a round ends when it cannot publish.
#[derive(Debug, Clone)]
pub enum RoundFailure {
    /// Try again later (same traces, same seed) — after `after`.
    Retry { after: std::time::Duration },
    /// Give up: the traces return to pending; only those in `charges` (their own
    /// reflection failed) pay an attempt — a failure elsewhere in the round is not theirs.
    GiveUp { charges: TraceCharges },
}

/// Learning rounds, from opening through the lease to their end.
#[async_trait]
pub trait RoundStore: Send + Sync {
    /// Reserves up to `batch` of the prompt's oldest pending traces for a new
    /// queued round. `None` when fewer than `min_traces` are pending;
    /// `AlreadyExists` when the prompt has a round in flight; `Duplicate` when
    /// `inbound_webhook_id` opened a round before. The id is remembered only
    /// when this call opens the round: a refused trigger can be retried.
    async fn open_round(&self, req: &OpenRound) -> StoreResult<Option<Round>>;
    /// Per prompt: unreserved pending traces, the oldest one's age, whether a round is in flight.
    async fn backlogs(&self) -> StoreResult<Vec<Backlog>>;
    /// Takes the lease of the oldest claimable round (queued and due, or
    /// running with an expired lease) and bumps its attempt number.
    async fn claim_round(&self, owner: &str, lease: std::time::Duration) -> StoreResult<Option<ClaimedRound>>;
    /// Extends the lease; false when this attempt no longer holds it.
    async fn heartbeat_round(&self, round: Uuid, attempt: i32, lease: std::time::Duration) -> StoreResult<bool>;
    /// Copies into `round` the reflections that earlier rounds of the same prompt
    /// stored for the round's traces against the same base version and strategy,
    /// so a re-run over the same base pays no reflector call twice. Returns how many
    /// were copied; reflections the round already has are kept.
    async fn adopt_reflections(&self, round: Uuid) -> StoreResult<u64>;
    /// Stores a reflection once (a repeat for the same trace is ignored).
    async fn save_reflection(
        &self,
        round: Uuid,
        trace: Uuid,
        reflection: &Reflection,
        from_trace: bool,
    ) -> StoreResult<()>;
    async fn round_reflections(&self, round: Uuid) -> StoreResult<Vec<(Uuid, Reflection, bool)>>;
    async fn record_llm_call(&self, round: Uuid, attempt: i32, call: &LlmCall) -> StoreResult<()>;
    async fn round_calls(&self, round: Uuid) -> StoreResult<Vec<RoundCall>>;
    /// Saves progress (k, phase timings, group outputs); false when the lease was lost.
    async fn update_round(
        &self,
        round: Uuid,
        attempt: i32,
        k: Option<i32>,
        detail: &serde_json::Value,
    ) -> StoreResult<bool>;
    /// Ends a round that succeeded, in one transaction fenced by the attempt:
    /// given a version, writes it and moves its label to it (an `auto-publish`
    /// entry in the label history); charges the traces in `charges` (see
    /// [`TraceCharges`]); marks consumed the round's traces that have a stored
    /// reflection (the others return to pending uncharged: nothing was learned
    /// from them); marks the round succeeded with its record (written here,
    /// once) and, given `sample_secs`, the batch-size controller's delay sample
    /// — atomically, so the scheduler never sees the round done but unsampled;
    /// ends the prompt's failure streak; queues `version.created` and
    /// `round.completed`. Without a version the round's `result_version`
    /// stays empty and no label moves. `Conflict` when the lease was lost.
    /// Moving `production` this way is for `service::production`, the one door
    /// through which production moves.
    async fn finish_round(&self, end: &RoundEnd) -> StoreResult<Option<Version>>;
    /// Ends an attempt that could not publish (fenced by the attempt).
    async fn fail_round(&self, round: Uuid, attempt: i32, error: &str, how: RoundFailure) -> StoreResult<()>;
    async fn get_round(&self, id: Uuid) -> StoreResult<Option<Round>>;
    /// Newest first, optionally for one prompt, before a round id (cursor).
    async fn list_rounds(
        &self,
        prompt: Option<&PromptName>,
        before: Option<Uuid>,
        limit: u32,
    ) -> StoreResult<Vec<Round>>;
    /// The trace ids a round reserved, in batch order.
    async fn round_trace_ids(&self, round: Uuid) -> StoreResult<Vec<Uuid>>;
    /// The prompt's failing rounds; `None` when there is no such prompt.
    async fn failure_streak(&self, prompt: &PromptName) -> StoreResult<Option<FailureStreak>>;
    /// Ends the prompt's failure streak (an operator's reset); false when there is no such prompt.
    async fn clear_failure_streak(&self, prompt: &PromptName) -> StoreResult<bool>;
    /// Up to `limit` prompts in a failure streak, by name.
    async fn failing_prompts(&self, limit: u32) -> StoreResult<Vec<(PromptName, FailureStreak)>>;
}

/// Resets a prompt's failure streak inside the caller's transaction.
async fn reset_failures<D: Backend>(c: &mut D::Connection, prompt_id: Uuid) -> StoreResult<()> {
    sql::<D>(
        "UPDATE prompts SET failure_streak = 0, last_failed_at = NULL, last_failure = NULL
         WHERE id = $1 AND failure_streak <> 0",
    )
    .bind(prompt_id)
    .execute(c)
    .await?;
    Ok(())
}

fn failures_from_row<D: Backend>(row: &D::Row, with_reason: bool) -> StoreResult<FailureStreak> {
    let r = Cols::<D>(row);
    Ok(FailureStreak {
        failures: r.get::<i32>("failure_streak")?.max(0) as u32,
        last_failed_at: r.get("last_failed_at")?,
        last_failure: if with_reason { r.get("last_failure")? } else { None },
    })
}

/// `text` cut to at most `max` characters.
fn bounded(text: &str, max: usize) -> &str {
    text.char_indices().nth(max).map_or(text, |(i, _)| &text[..i])
}

#[async_trait]
impl<D: Backend> RoundStore for SqlStore<D> {
    async fn open_round(&self, req: &OpenRound) -> StoreResult<Option<Round>> {
        let now = now();
        let mut tx = self.begin_write().await?;
        // First, so a duplicate delivery is told so (not "a round is in flight":
        // its own round). A concurrent duplicate waits here on the primary key;
        // every refusal below rolls back, forgetting the id.
        if let Some(hook) = &req.inbound_webhook_id {
            let n = sql::<D>("INSERT INTO inbound_webhooks (id, received_at) VALUES ($1, $2) ON CONFLICT DO NOTHING")
                .bind(hook)
                .bind(now)
                .execute(&mut tx)
                .await?;
            if n == 0 {
                return Err(StoreError::Duplicate);
            }
        }
        // The prompt row lock (Postgres; the single writer on SQLite) serialises round creation per prompt.
        let text = format!(
            "SELECT id, strategy, settings, version_count FROM prompts WHERE name = $1 AND project = $2{}",
            D::lock(" FOR UPDATE")
        );
        let row = sql::<D>(&text).bind(req.prompt.as_str()).bind(req.prompt.project()).fetch_one(&mut tx).await?;
        let r = Cols::<D>(&row);
        let prompt_id: Uuid = r.get("id")?;
        let strategy: String = r.get("strategy")?;
        let settings: PromptSettings = serde_json::from_value(r.get("settings")?).map_err(|_| corrupt("settings"))?;
        let latest: i64 = r.get("version_count")?;
        let active = sql::<D>("SELECT id FROM rounds WHERE prompt_id = $1 AND status IN ('queued', 'running')")
            .bind(prompt_id)
            .fetch_optional(&mut tx)
            .await?;
        if active.is_some() {
            return Err(StoreError::AlreadyExists);
        }
        // An operator's round ends a failing prompt's backoff (rolled back with
        // the round when nothing is pending).
        if req.trigger.is_operator() {
            reset_failures::<D>(&mut tx, prompt_id).await?;
        }
        // Unjudged traces wait for the evaluators, up to `judge_wait`.
        let judged_since = match req.judge_wait {
            Some(wait) => {
                let has = sql::<D>("SELECT prompt_id FROM prompt_evaluators WHERE prompt_id = $1")
                    .bind(prompt_id)
                    .fetch_optional(&mut tx)
                    .await?;
                has.map(|_| now - chrono::Duration::from_std(wait).unwrap_or(chrono::Duration::MAX))
            }
            None => None,
        };
        let text = format!(
            "SELECT id FROM traces WHERE prompt_id = $1 AND status = 'pending' AND round_id IS NULL
               AND quarantined_at IS NULL AND ($3 IS NULL OR judged_at IS NOT NULL OR created_at < $3)
             ORDER BY id LIMIT $2{}",
            D::lock(" FOR UPDATE SKIP LOCKED")
        );
        let ids: Vec<Uuid> = sql::<D>(&text)
            .bind(prompt_id)
            .bind(i64::from(req.batch))
            .bind(judged_since)
            .map(&mut tx, |row| Cols::<D>(row).get("id"))
            .await?;
        if ids.is_empty() || (ids.len() as u32) < req.min_traces {
            return Ok(None);
        }
        let production: Option<i64> =
            sql::<D>("SELECT version FROM labels WHERE prompt_id = $1 AND name = 'production'")
                .bind(prompt_id)
                .value(&mut tx, "version")
                .await?;
        let id = Uuid::now_v7();
        sql::<D>(
            "INSERT INTO rounds (id, prompt_id, status, trigger, method, strategy, seed, duplication, n, base_version,
                                 not_before, created_at, updated_at)
             VALUES ($1, $2, 'queued', $3, $4, $5, $6, $7, $8, $9, $10, $10, $10)",
        )
        .bind(id)
        .bind(prompt_id)
        .bind(req.trigger.as_str())
        .bind(round::method_str(req.method))
        .bind(strategy)
        .bind(req.seed)
        .bind(settings.duplication as i32)
        .bind(ids.len() as i32)
        .bind(req.base_version.filter(|v| (1..=latest).contains(v)).or(production).unwrap_or(latest))
        .bind(now)
        .execute(&mut tx)
        .await?;
        D::reserve_traces(&mut tx, id, &ids, now).await?;
        self.commit(tx, Change::RoundQueued).await?;
        self.get_round(id).await
    }

    async fn backlogs(&self) -> StoreResult<Vec<Backlog>> {
        // Count and oldest in one pass over the backlog (the partial index
        // `traces_backlog`, which holds only what waits): a correlated
        // `min(created_at)` of its own walked each prompt's traces in time
        // order, history first. SQLite is told the index: without statistics
        // it would walk every pending trace, quarantined ones included.
        let hint = if D::KIND == StoreKind::Sqlite { " INDEXED BY traces_backlog" } else { "" };
        let text = format!(
            "SELECT p.id, p.name, p.project, p.strategy, p.promotion, p.settings, p.created_at, p.created_by,
                    p.failure_streak, p.last_failed_at, coalesce(b.pending, 0) AS pending, b.oldest,
                    EXISTS (SELECT 1 FROM rounds r WHERE r.prompt_id = p.id AND r.status IN ('queued', 'running')) AS active
             FROM prompts p
             LEFT JOIN (SELECT t.prompt_id, count(*) AS pending, min(t.created_at) AS oldest FROM traces t{hint}
                        WHERE t.status = 'pending' AND t.round_id IS NULL AND t.quarantined_at IS NULL
                        GROUP BY t.prompt_id) b ON b.prompt_id = p.id
             ORDER BY p.name, p.project"
        );
        sql::<D>(&text)
            .map(&mut *self.reader.acquire().await?, |row| {
                let r = Cols::<D>(row);
                Ok(Backlog {
                    prompt: prompt_from_row::<D>(row)?,
                    pending: r.get("pending")?,
                    oldest: r.get("oldest")?,
                    active_round: r.get("active")?,
                    failures: failures_from_row::<D>(row, false)?,
                })
            })
            .await
    }

    async fn claim_round(&self, owner: &str, lease: Duration) -> StoreResult<Option<ClaimedRound>> {
        let Some(id) = D::claim_round_id(self, owner, lease).await? else { return Ok(None) };
        let round = self.get_round(id).await?.ok_or(StoreError::NotFound)?;
        let prompt = self.get_prompt(&round.prompt).await?.ok_or(StoreError::NotFound)?;
        let base = self
            .resolve(&round.prompt, &Selector::Version(round.base_version))
            .await?
            .ok_or_else(|| corrupt("round base version"))?
            .version;
        let traces = sql::<D>(&format!(
            "SELECT {TRACE_COLUMNS} FROM round_traces rt JOIN traces t ON t.id = rt.trace_id
             JOIN prompts p ON p.id = t.prompt_id WHERE rt.round_id = $1 ORDER BY rt.position"
        ))
        .bind(id)
        .map(&mut *self.reader.acquire().await?, trace_from_row::<D>)
        .await?;
        Ok(Some(ClaimedRound { round, prompt, base, traces }))
    }

    async fn heartbeat_round(&self, round: Uuid, attempt: i32, lease: Duration) -> StoreResult<bool> {
        D::heartbeat_round(self, round, attempt, lease).await
    }

    async fn adopt_reflections(&self, round: Uuid) -> StoreResult<u64> {
        // Newest first: of several earlier reflections on a trace, the newest wins.
        sql::<D>(
            "INSERT INTO reflections (round_id, trace_id, reflection, from_trace, created_at)
             SELECT cur.id, r.trace_id, r.reflection, r.from_trace, $2
             FROM rounds cur
             JOIN round_traces rt ON rt.round_id = cur.id
             JOIN reflections r ON r.trace_id = rt.trace_id AND r.round_id <> cur.id
             JOIN rounds prev ON prev.id = r.round_id AND prev.prompt_id = cur.prompt_id
                             AND prev.base_version = cur.base_version AND prev.strategy = cur.strategy
             WHERE cur.id = $1
             ORDER BY r.trace_id, r.created_at DESC
             ON CONFLICT DO NOTHING",
        )
        .bind(round)
        .bind(now())
        .execute(&mut *self.writer.acquire().await?)
        .await
    }

    async fn save_reflection(&self, round: Uuid, trace: Uuid, r: &Reflection, from_trace: bool) -> StoreResult<()> {
        let reflection = serde_json::to_value(r).map_err(|_| corrupt("reflection"))?;
        sql::<D>(
            "INSERT INTO reflections (round_id, trace_id, reflection, from_trace, created_at) VALUES ($1, $2, $3, $4, $5)
             ON CONFLICT DO NOTHING",
        )
        .bind(round)
        .bind(trace)
        .bind(json(&reflection))
        .bind(from_trace)
        .bind(now())
        .execute(&mut *self.writer.acquire().await?)
        .await?;
        Ok(())
    }

    async fn round_reflections(&self, round: Uuid) -> StoreResult<Vec<(Uuid, Reflection, bool)>> {
        sql::<D>("SELECT trace_id, reflection, from_trace FROM reflections WHERE round_id = $1 ORDER BY created_at, trace_id")
            .bind(round)
            .map(&mut *self.reader.acquire().await?, |row| {
                let r = Cols::<D>(row);
                let reflection = serde_json::from_value(r.get("reflection")?).map_err(|_| corrupt("reflection"))?;
                Ok((r.get("trace_id")?, reflection, r.get("from_trace")?))
            })
            .await
    }

    async fn record_llm_call(&self, round: Uuid, attempt: i32, call: &LlmCall) -> StoreResult<()> {
        sql::<D>(
            "INSERT INTO llm_calls (round_id, attempt, role, model, prompt_tokens, completion_tokens, cost_usd, latency_ms,
                                    retries, error, created_at, read_as, refused_answer, output_format, concurrency_limit)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15)",
        )
        .bind(round)
        .bind(attempt)
        .bind(enum_str(call.role))
        .bind(&call.model)
        .bind(call.prompt_tokens as i64)
        .bind(call.completion_tokens as i64)
        .bind(call.cost_usd)
        .bind(call.latency_ms as i64)
        .bind(call.retries as i32)
        .bind(call.error.as_deref())
        .bind(now())
        .bind(call.read.map(AnswerRead::as_str))
        // Untrusted model output: bounded here too, whatever the caller cut.
        .bind(call.refused_answer.as_deref().map(|a| bounded(a, REFUSED_ANSWER_CHARS)))
        .bind(call.output_format.map(OutputFormat::as_str))
        .bind(call.concurrency_limit.map(|n| i64::from(n.min(i32::MAX as u32)) as i32))
        .execute(&mut *self.writer.acquire().await?)
        .await?;
        Ok(())
    }

    async fn round_calls(&self, round: Uuid) -> StoreResult<Vec<RoundCall>> {
        sql::<D>(
            "SELECT attempt, role, model, prompt_tokens, completion_tokens, cost_usd, latency_ms, retries, error, created_at,
                    read_as, refused_answer, output_format, concurrency_limit
             FROM llm_calls WHERE round_id = $1 ORDER BY id",
        )
        .bind(round)
        .map(&mut *self.reader.acquire().await?, |row| {
            let r = Cols::<D>(row);
            Ok(RoundCall {
                attempt: r.get("attempt")?,
                call: LlmCall {
                    role: serde_json::from_value(Value::String(r.get("role")?)).map_err(|_| corrupt("llm role"))?,
                    model: r.get("model")?,
                    prompt_tokens: r.get::<i64>("prompt_tokens")? as u64,
                    completion_tokens: r.get::<i64>("completion_tokens")? as u64,
                    cost_usd: r.get("cost_usd")?,
                    latency_ms: r.get::<i64>("latency_ms")? as u64,
                    retries: r.get::<i32>("retries")? as u32,
                    error: r.get("error")?,
                    // A value a newer binary wrote and this one does not know reads as absent.
                    read: r.get::<Option<String>>("read_as")?.as_deref().and_then(AnswerRead::parse),
                    refused_answer: r.get("refused_answer")?,
                    output_format: r.get::<Option<String>>("output_format")?.as_deref().and_then(OutputFormat::parse),
                    concurrency_limit: r.get::<Option<i32>>("concurrency_limit")?.map(|n| n.max(0) as u32),
                },
                created_at: r.get("created_at")?,
            })
        })
        .await
    }

    async fn update_round(&self, round: Uuid, attempt: i32, k: Option<i32>, detail: &Value) -> StoreResult<bool> {
        let n = sql::<D>(
            "UPDATE rounds SET k = COALESCE($1, k), detail = $2, updated_at = $3
             WHERE id = $4 AND attempt = $5 AND status = 'running'",
        )
        .bind(k)
        .bind(json(detail))
        .bind(now())
        .bind(round)
        .bind(attempt)
        .execute(&mut *self.writer.acquire().await?)
        .await?;
        Ok(n == 1)
    }

    async fn finish_round(&self, end: &RoundEnd) -> StoreResult<Option<Version>> {
        let now = now();
        let mut tx = self.begin_write().await?;
        let (prompt_id, prompt) = fence::<D>(&mut tx, end.round, end.attempt).await?;
        record_sample::<D>(&mut tx, end.round, end.sample_secs, now).await?;
        // A round that succeeds ends the prompt's failure streak, version or not.
        reset_failures::<D>(&mut tx, prompt_id).await?;
        let mut queued = false;
        let mut published = None;
        if let Some((v, label)) = &end.version {
            let number: i64 =
                sql::<D>("UPDATE prompts SET version_count = version_count + 1 WHERE id = $1 RETURNING version_count")
                    .bind(prompt_id)
                    .value(&mut tx, "version_count")
                    .await?
                    .ok_or(StoreError::NotFound)?;
            insert_version::<D>(&mut tx, prompt_id, number, v, now).await?;
            let by = v.created_by.clone();
            let mv = LabelMove {
                label: label.clone(),
                to_version: number,
                expected_current: None,
                check_current: false,
                by,
            };
            let (moved, previous) = apply_move::<D>(&mut tx, prompt_id, &mv).await?;
            let version = v.clone().into_version(prompt.clone(), number, now);
            queued |= record_event::<D>(&mut tx, &OutboxEvent::version_created(&version, &[label.as_str()])).await?;
            let cause = MoveCause::new(LabelMoveKind::AutoPublish, format!("round {} published v{number}", end.round))
                .with_evidence(serde_json::json!({ "round_id": end.round }));
            queued |= record_move::<D>(&mut tx, prompt_id, &prompt, &moved, previous, &cause).await?;
            published = Some((version, label));
        }
        let number = published.as_ref().map(|(v, _)| v.number);
        settle_succeeded::<D>(&mut tx, end.round, number, end.k, &end.detail, &end.charges, now).await?;
        let result = published.as_ref().map(|(v, label)| (v.number, *label));
        queued |= record_event::<D>(&mut tx, &OutboxEvent::round_completed(&prompt, end.round, result)).await?;
        self.commit(tx, Change::prompt(&prompt)).await?;
        self.announce_outbox(queued);
        Ok(published.map(|(v, _)| v))
    }

    async fn fail_round(&self, round: Uuid, attempt: i32, error: &str, how: RoundFailure) -> StoreResult<()> {
        let now = now();
        let mut tx = self.begin_write().await?;
        let (prompt_id, name) = fence::<D>(&mut tx, round, attempt).await?;
        let mut queued = false;
        let requeued = match how {
            RoundFailure::Retry { after } => {
                sql::<D>(
                    "UPDATE rounds SET status = 'queued', lease_owner = NULL, lease_expires_at = NULL, error = $1,
                            not_before = $2, updated_at = $3 WHERE id = $4",
                )
                .bind(error)
                .bind(later(now, after))
                .bind(now)
                .bind(round)
                .execute(&mut tx)
                .await?;
                true
            }
            RoundFailure::GiveUp { charges } => {
                charge_traces::<D>(&mut tx, round, &charges).await?;
                release_traces::<D>(&mut tx, round).await?;
                sql::<D>(
                    "UPDATE rounds SET status = 'failed', error = $1, finished_at = $2, lease_owner = NULL,
                            lease_expires_at = NULL, updated_at = $2 WHERE id = $3",
                )
                .bind(error)
                .bind(now)
                .bind(round)
                .execute(&mut tx)
                .await?;
                // The round's end starts or extends the prompt's failure streak;
                // subscribers hear of the streak's first failure only (the
                // prompt's state says how it goes on).
                let prior: Option<i32> = sql::<D>(
                    "UPDATE prompts SET failure_streak = failure_streak + 1, last_failed_at = $1, last_failure = $2
                     WHERE id = $3 RETURNING failure_streak - 1 AS prior",
                )
                .bind(now)
                .bind(bounded(error, LAST_FAILURE_CHARS))
                .bind(prompt_id)
                .value(&mut tx, "prior")
                .await?;
                if prior.unwrap_or(0) == 0 {
                    queued =
                        record_event::<D>(&mut tx, &OutboxEvent::round_failed(&name, round, attempt, error)).await?;
                }
                false
            }
        };
        if requeued {
            self.commit(tx, Change::RoundQueued).await?;
        } else {
            tx.commit().await?;
        }
        self.announce_outbox(queued);
        Ok(())
    }

    async fn get_round(&self, id: Uuid) -> StoreResult<Option<Round>> {
        sql::<D>(&format!("SELECT {ROUND_COLUMNS} FROM rounds r JOIN prompts p ON p.id = r.prompt_id WHERE r.id = $1"))
            .bind(id)
            .fetch_optional(&mut *self.reader.acquire().await?)
            .await?
            .as_ref()
            .map(round_from_row::<D>)
            .transpose()
    }

    async fn list_rounds(
        &self,
        prompt: Option<&PromptName>,
        before: Option<Uuid>,
        limit: u32,
    ) -> StoreResult<Vec<Round>> {
        // Only the conditions given are in the text (no `$n IS NULL OR …`): one
        // prompt's rounds come newest first from `rounds_by_prompt_id`, a page
        // costs its rows however many rounds there are.
        let mut conditions = Vec::new();
        if prompt.is_some() {
            let n = conditions.len() + 1;
            conditions
                .push(format!("r.prompt_id = (SELECT id FROM prompts WHERE project = ${n} AND name = ${})", n + 1));
        }
        let params = if prompt.is_some() { 2 } else { 0 };
        if before.is_some() {
            conditions.push(format!("r.id < ${}", params + 1));
        }
        let filter = if conditions.is_empty() { String::new() } else { format!("WHERE {}", conditions.join(" AND ")) };
        let text = format!(
            "SELECT {ROUND_COLUMNS} FROM rounds r JOIN prompts p ON p.id = r.prompt_id {filter}
             ORDER BY r.id DESC LIMIT ${}",
            params + usize::from(before.is_some()) + 1
        );
        let mut query = sql::<D>(&text);
        if let Some(p) = prompt {
            query = query.bind(p.project()).bind(p.as_str());
        }
        if let Some(id) = before {
            query = query.bind(id);
        }
        query.bind(i64::from(limit)).map(&mut *self.reader.acquire().await?, round_from_row::<D>).await
    }

    async fn round_trace_ids(&self, round: Uuid) -> StoreResult<Vec<Uuid>> {
        sql::<D>("SELECT trace_id FROM round_traces WHERE round_id = $1 ORDER BY position")
            .bind(round)
            .map(&mut *self.reader.acquire().await?, |row| Cols::<D>(row).get("trace_id"))
            .await
    }

    async fn failure_streak(&self, prompt: &PromptName) -> StoreResult<Option<FailureStreak>> {
        sql::<D>("SELECT failure_streak, last_failed_at, last_failure FROM prompts WHERE project = $1 AND name = $2")
            .bind(prompt.project())
            .bind(prompt.as_str())
            .fetch_optional(&mut *self.reader.acquire().await?)
            .await?
            .as_ref()
            .map(|row| failures_from_row::<D>(row, true))
            .transpose()
    }

    async fn clear_failure_streak(&self, prompt: &PromptName) -> StoreResult<bool> {
        let mut tx = self.begin_write().await?;
        let id: Option<Uuid> = sql::<D>("SELECT id FROM prompts WHERE project = $1 AND name = $2")
            .bind(prompt.project())
            .bind(prompt.as_str())
            .value(&mut tx, "id")
            .await?;
        let Some(id) = id else { return Ok(false) };
        reset_failures::<D>(&mut tx, id).await?;
        tx.commit().await?;
        Ok(true)
    }

    async fn failing_prompts(&self, limit: u32) -> StoreResult<Vec<(PromptName, FailureStreak)>> {
        sql::<D>(
            "SELECT project, name, failure_streak, last_failed_at, last_failure FROM prompts WHERE failure_streak > 0
             ORDER BY name, project LIMIT $1",
        )
        .bind(i64::from(limit))
        .map(&mut *self.reader.acquire().await?, |row| {
            let r = Cols::<D>(row);
            let name = prompt_name(&r.get::<String>("project")?, &r.get::<String>("name")?)?;
            Ok((name, failures_from_row::<D>(row, true)?))
        })
        .await
    }
}

pub(super) const ROUND_COLUMNS: &str = "r.id, p.project AS prompt_project, p.name AS prompt_name, r.status, \
     r.trigger, r.method, r.strategy, r.seed, r.duplication, r.n, r.k, r.base_version, r.result_version, r.attempt, \
     r.error, r.detail, r.created_at, r.started_at, r.finished_at, r.updated_at";

pub(super) fn round_from_row<D: Dialect>(row: &D::Row) -> StoreResult<Round> {
    let r = Cols::<D>(row);
    let (status, trigger): (String, String) = (r.get("status")?, r.get("trigger")?);
    let (method, strategy): (String, String) = (r.get("method")?, r.get("strategy")?);
    Ok(Round {
        id: r.get("id")?,
        prompt: prompt_name_of(&r)?,
        status: RoundStatus::parse(&status).ok_or_else(|| corrupt("round status"))?,
        trigger: RoundTrigger::parse(&trigger).ok_or_else(|| corrupt("round trigger"))?,
        method: round::parse_method(&method).ok_or_else(|| corrupt("round method"))?,
        strategy: round::parse_strategy(&strategy).ok_or_else(|| corrupt("round strategy"))?,
        seed: r.get("seed")?,
        duplication: r.get("duplication")?,
        n: r.get("n")?,
        k: r.get("k")?,
        base_version: r.get("base_version")?,
        result_version: r.get("result_version")?,
        attempt: r.get("attempt")?,
        error: r.get("error")?,
        detail: r.get("detail")?,
        created_at: r.get("created_at")?,
        started_at: r.get("started_at")?,
        finished_at: r.get("finished_at")?,
        updated_at: r.get("updated_at")?,
    })
}

/// Checks that `attempt` still holds the round's lease (locking the round row
/// on Postgres; SQLite's single writer makes check-then-write atomic).
/// Returns the round's prompt id and name.
/// Records the batch-size controller's delay sample of a round that ended (none for a zero time).
async fn record_sample<D: Dialect>(
    c: &mut D::Connection,
    round: Uuid,
    sample_secs: Option<f64>,
    now: DateTime<Utc>,
) -> StoreResult<()> {
    if let Some(secs) = sample_secs.filter(|s| *s > 0.0) {
        sql::<D>(
            "INSERT INTO controller_samples (prompt_id, round_id, batch_size, round_secs, created_at)
             SELECT prompt_id, id, n, $1, $2 FROM rounds WHERE id = $3",
        )
        .bind(secs)
        .bind(now)
        .bind(round)
        .execute(c)
        .await?;
    }
    Ok(())
}

/// Ends a round as succeeded: its faulty traces charged, the traces it
/// reflected consumed, the others back in the backlog, its record written.
async fn settle_succeeded<D: Dialect>(
    c: &mut D::Connection,
    round: Uuid,
    version: Option<i64>,
    k: Option<i32>,
    detail: &Value,
    charges: &TraceCharges,
    now: DateTime<Utc>,
) -> StoreResult<()> {
    charge_traces::<D>(c, round, charges).await?;
    sql::<D>(
        "UPDATE traces SET status = 'consumed', updated_at = $1 WHERE round_id = $2 AND status = 'pending'
           AND EXISTS (SELECT 1 FROM reflections r WHERE r.round_id = $2 AND r.trace_id = traces.id)",
    )
    .bind(now)
    .bind(round)
    .execute(&mut *c)
    .await?;
    release_traces::<D>(c, round).await?;
    sql::<D>(
        "UPDATE rounds SET status = 'succeeded', result_version = $1, detail = $2, error = NULL, finished_at = $3,
                lease_owner = NULL, lease_expires_at = NULL, updated_at = $3, k = COALESCE($5, k) WHERE id = $4",
    )
    .bind(version)
    .bind(json(detail))
    .bind(now)
    .bind(round)
    .bind(k)
    .execute(c)
    .await?;
    Ok(())
}

pub(super) async fn fence<D: Dialect>(
    c: &mut D::Connection,
    round: Uuid,
    attempt: i32,
) -> StoreResult<(Uuid, PromptName)> {
    let row = sql::<D>(&format!(
        "SELECT r.prompt_id, p.project, p.name, r.status, r.attempt FROM rounds r JOIN prompts p ON p.id = r.prompt_id
         WHERE r.id = $1{}",
        D::lock(" FOR UPDATE OF r")
    ))
    .bind(round)
    .fetch_optional(c)
    .await?
    .ok_or(StoreError::NotFound)?;
    let r = Cols::<D>(&row);
    if r.get::<String>("status")? != "running" || r.get::<i32>("attempt")? != attempt {
        return Err(StoreError::Conflict);
    }
    Ok((r.get("prompt_id")?, prompt_name(&r.get::<String>("project")?, &r.get::<String>("name")?)?))
}

/// Charges each faulted trace of the round one attempt (see [`TraceCharges`]).
pub(super) async fn charge_traces<D: Dialect>(
    c: &mut D::Connection,
    round: Uuid,
    charges: &TraceCharges,
) -> StoreResult<()> {
    for fault in &charges.faults {
        sql::<D>(
            "UPDATE traces SET round_id = NULL, attempts = attempts + 1, updated_at = $5, failure_reason = $3,
                    status = CASE WHEN attempts + 1 >= $4 THEN 'failed' ELSE 'pending' END
             WHERE id = $1 AND round_id = $2 AND status = 'pending'",
        )
        .bind(fault.trace_id)
        .bind(round)
        .bind(&fault.reason)
        .bind(charges.max_trace_attempts)
        .bind(now())
        .execute(c)
        .await?;
    }
    Ok(())
}

/// Returns the round's still-reserved pending traces to the backlog, uncharged.
pub(super) async fn release_traces<D: Dialect>(c: &mut D::Connection, round: Uuid) -> StoreResult<()> {
    sql::<D>("UPDATE traces SET round_id = NULL, updated_at = $2 WHERE round_id = $1 AND status = 'pending'")
        .bind(round)
        .bind(now())
        .execute(c)
        .await?;
    Ok(())
}
