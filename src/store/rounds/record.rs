//! A round's end (published, retried or failed), fenced by the attempt that
//! holds its lease, with what it charges its traces; and rounds read back.

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use serde_json::Value;
use uuid::Uuid;

use super::{bounded, failures::reset_failures};
use crate::{
    domain::{
        LabelMoveKind, LabelName, MoveCause, PromptName, Version,
        event::OutboxEvent,
        label::LabelMove,
        prompt::NewVersion,
        round::{self, Round, RoundStatus, RoundTrigger},
    },
    store::{
        Change, StoreError, StoreResult,
        backend::{Backend, SqlStore},
        labels::{apply_move, record_move},
        sql::{Cols, Dialect, corrupt, json, later, now, sql},
        versions::{insert_version, prompt_name, prompt_name_of},
        webhooks::record_event,
    },
};

/// Most characters of a failed round's error kept as a prompt's `last_failure`.
pub const LAST_FAILURE_CHARS: usize = 2_000;

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
/// writes in the round's last, fenced transaction ([`RoundRecordStore::finish_round`]).
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

/// Ending rounds and reading them back.
#[async_trait]
pub trait RoundRecordStore: Send + Sync {
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
}

#[async_trait]
impl<D: Backend> RoundRecordStore for SqlStore<D> {
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
}

const ROUND_COLUMNS: &str = "r.id, p.project AS prompt_project, p.name AS prompt_name, r.status, \
     r.trigger, r.method, r.strategy, r.seed, r.duplication, r.n, r.k, r.base_version, r.result_version, r.attempt, \
     r.error, r.detail, r.created_at, r.started_at, r.finished_at, r.updated_at";

fn round_from_row<D: Dialect>(row: &D::Row) -> StoreResult<Round> {
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
/// Checks that `attempt` still holds the round's lease (locking the round row
/// on Postgres; SQLite's single writer makes check-then-write atomic).
/// Returns the round's prompt id and name.
async fn fence<D: Dialect>(c: &mut D::Connection, round: Uuid, attempt: i32) -> StoreResult<(Uuid, PromptName)> {
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
async fn charge_traces<D: Dialect>(c: &mut D::Connection, round: Uuid, charges: &TraceCharges) -> StoreResult<()> {
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
async fn release_traces<D: Dialect>(c: &mut D::Connection, round: Uuid) -> StoreResult<()> {
    sql::<D>("UPDATE traces SET round_id = NULL, updated_at = $2 WHERE round_id = $1 AND status = 'pending'")
        .bind(round)
        .bind(now())
        .execute(c)
        .await?;
    Ok(())
}
