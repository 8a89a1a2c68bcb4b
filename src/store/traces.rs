//! Traces (their INSERT and group commit are each backend's: `sqlite/trace_writes.rs`, `postgres/trace_writes.rs`):
//! durable ingest (with `Idempotency-Key`), reads, late feedback, requeue of failed ones, the operator's quarantine
//! and delete, and the outcome aggregates versions are judged by.

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use serde_json::Value;
use uuid::Uuid;

use super::{
    Change, StoreResult,
    backend::{Backend, SqlStore},
    rollups::{self, Counted, Sign},
    sql::{Cols, Dialect, Param, corrupt, json, now, sql},
    versions::{prompt_id, prompt_name_of},
};
use crate::{
    domain::{
        Feedback, PromptName, Trace,
        trace::{
            FeedbackSource, IdempotencyKey, IdempotentIngest, Judged, RequeueFailed, TraceFilter, TraceStatus,
            ValidTrace,
        },
    },
    evaluate::outcomes::OutcomeBucket,
};

/// The result of an operator action on one trace.
#[derive(Debug, Clone, PartialEq)]
pub enum TraceAction {
    /// Done; the trace as it is now (for a delete: as it was).
    Done(Box<Trace>),
    NotFound,
    /// Not allowed in the trace's state; the text says why, for the operator.
    Refused(String),
}

impl TraceAction {
    /// `Done` with the trace as it is now, or `NotFound`.
    pub(crate) fn found(trace: Option<Trace>) -> Self {
        trace.map_or(Self::NotFound, |t| Self::Done(Box::new(t)))
    }
}

/// Why an operator action on a trace in this state is refused, if it is.
/// `status` is the stored status column (never `quarantined`).
pub(crate) fn trace_action_refusal(delete: bool, status: &str, round_id: Option<Uuid>) -> Option<String> {
    let verb = if delete { "deleted" } else { "quarantined" };
    if status == "consumed" {
        return Some(format!(
            "the trace was consumed by a round and a version was learned from it; it cannot be {verb} \
             (roll back the version instead)"
        ));
    }
    round_id.map(|r| {
        format!("the trace is reserved by round {r}, which is in flight; it can be {verb} once the round ends")
    })
}

/// Why a trace (posted, or re-mapped from OTLP spans) cannot be stored, or `None`: `version_count` is
/// the prompt's, `None` when it does not exist. Shared by both backends.
pub(crate) fn prompt_reference_problem(
    prompt: &PromptName,
    version: Option<i64>,
    version_count: Option<i64>,
) -> Option<String> {
    let prompt = prompt.as_str();
    match (version_count, version) {
        (None, _) => Some(crate::domain::project::unknown_prompt(prompt)),
        (Some(last), Some(v)) if v > last => {
            Some(format!("prompt {prompt:?} has no version {v} (the latest is {last})"))
        }
        _ => None,
    }
}

/// Traces, from ingest to the operator's containment.
#[async_trait]
pub trait TraceStore: Send + Sync {
    /// Stores traces durably, all or none; `Invalid` names the first unknown prompt or version.
    async fn insert_traces(&self, traces: &[ValidTrace]) -> StoreResult<Vec<Uuid>>;
    async fn get_trace(&self, id: Uuid) -> StoreResult<Option<Trace>>;
    /// Newest first.
    async fn list_traces(&self, filter: &TraceFilter, limit: u32) -> StoreResult<Vec<Trace>>;
    /// Late feedback from the agent (see [`TraceStore::add_feedback_from`]).
    async fn add_feedback(&self, id: Uuid, feedback: Feedback) -> StoreResult<Option<Trace>> {
        self.add_feedback_from(id, feedback, FeedbackSource::Agent).await
    }
    /// Merges late feedback from the agent or an operator into a trace's: the
    /// fields sent replace the earlier ones. A reward (score or success) sent
    /// replaces a judged one whole (its score and critique go), and the trace's
    /// feedback is then the sender's.
    async fn add_feedback_from(
        &self,
        id: Uuid,
        feedback: Feedback,
        source: FeedbackSource,
    ) -> StoreResult<Option<Trace>>;
    /// Puts the prompt's matching `failed` traces back to `pending` with their
    /// attempts reset and failure reason cleared; returns their ids, oldest
    /// first. `NotFound` when the prompt does not exist.
    async fn requeue_failed_traces(&self, req: &RequeueFailed) -> StoreResult<Vec<Uuid>>;
    /// Holds a pending or failed trace back from learning (idempotent); refused
    /// while a round has it reserved or once it was consumed.
    async fn quarantine_trace(&self, id: Uuid, reason: &str) -> StoreResult<TraceAction>;
    /// Quarantines every unreserved pending trace of `filter.prompt` created in
    /// `[since, until)`; returns how many. `filter.status` and `before_id` are ignored.
    async fn quarantine_traces(&self, filter: &TraceFilter, reason: &str) -> StoreResult<u64>;
    /// Lifts a trace's quarantine: it is learned from again (a pending trace
    /// rejoins the backlog). Idempotent: a trace not quarantined is unchanged.
    async fn release_trace(&self, id: Uuid) -> StoreResult<TraceAction>;
    /// Deletes a trace that no version was learned from (with its reflections
    /// in failed rounds); refused while a round has it reserved or once consumed.
    async fn delete_trace(&self, id: Uuid) -> StoreResult<TraceAction>;
    /// Per (version, time bucket) outcome aggregates of the prompt's traces
    /// created in `[from, until)`; buckets are `bucket_secs` wide, aligned to
    /// the Unix epoch. Read from the rollups every trace write maintains, and
    /// only from them (never the trace rows), so late feedback counts at once
    /// and a read costs the same however many traces arrived in the window;
    /// windows as [`crate::evaluate::outcomes::rollup_window`] keeps them (ends
    /// to the second when recent).
    /// Quarantined traces are left out: their rewards are not trusted.
    /// `versions`, when given, are the only versions read (0 stands for
    /// traces that named no version); what is left out costs nothing.
    async fn version_outcomes(
        &self,
        prompt: &PromptName,
        from: DateTime<Utc>,
        until: DateTime<Utc>,
        bucket_secs: i64,
        versions: Option<&[i64]>,
    ) -> StoreResult<Vec<crate::evaluate::outcomes::OutcomeBucket>>;
    /// Stores traces and remembers the key with their ids in ONE
    /// transaction: an outage at any point leaves either both or neither, so
    /// a retry either replays or stores — never twice, and never a key stuck
    /// "in flight". A concurrent request with the same key waits for the
    /// first to end. `Invalid` (nothing stored, key not remembered) as for
    /// `insert_traces`.
    async fn insert_traces_idempotent(
        &self,
        key: IdempotencyKey<'_>,
        traces: &[ValidTrace],
    ) -> StoreResult<IdempotentIngest>;
    /// Deletes keys older than the retention; returns how many.
    async fn idempotency_purge(&self, older_than: DateTime<Utc>) -> StoreResult<u64>;
}

#[async_trait]
impl<D: Backend> TraceStore for SqlStore<D> {
    async fn insert_traces(&self, traces: &[ValidTrace]) -> StoreResult<Vec<Uuid>> {
        D::insert_traces(self, traces).await
    }

    async fn get_trace(&self, id: Uuid) -> StoreResult<Option<Trace>> {
        sql::<D>(&format!("SELECT {TRACE_COLUMNS} FROM traces t JOIN prompts p ON p.id = t.prompt_id WHERE t.id = $1"))
            .bind(id)
            .fetch_optional(&mut *self.reader.acquire().await?)
            .await?
            .as_ref()
            .map(trace_from_row::<D>)
            .transpose()
    }

    async fn list_traces(&self, f: &TraceFilter, limit: u32) -> StoreResult<Vec<Trace>> {
        // Only the filters given are in the text, each in the form an index
        // serves (a prompt's traces newest first from `traces_by_prompt`, the
        // partial index's own condition for quarantined ones), so a page costs
        // about its rows, not a walk through every trace kept. A settled
        // status is written out with the condition of the partial indexes that
        // hold consumed and failed traces only (`traces_settled_by_prompt`,
        // `traces_by_status` across prompts) on both stores; pending traces,
        // the newest, come first in `traces_by_prompt` and the primary key.
        let mut conditions: Vec<String> = Vec::new();
        let mut n = 0;
        let mut next = || {
            n += 1;
            format!("${n}")
        };
        if f.prompt.is_some() {
            let (project, name) = (next(), next());
            conditions
                .push(format!("t.prompt_id = (SELECT id FROM prompts WHERE project = {project} AND name = {name})"));
        }
        if f.project.is_some() {
            conditions.push(format!("p.project = {}", next()));
        }
        match f.status {
            Some(TraceStatus::Quarantined) => conditions.push("t.quarantined_at IS NOT NULL".into()),
            Some(TraceStatus::Pending) => {
                conditions.push(format!("t.status = {} AND t.quarantined_at IS NULL", next()))
            }
            Some(settled) => conditions.push(format!(
                "t.status = '{}' AND t.status <> 'pending' AND t.quarantined_at IS NULL",
                settled.as_str()
            )),
            None => {}
        }
        // A time range is also an id range (ids are UUIDv7), which the
        // indexes that end in `id` serve; `created_at` then narrows it exactly.
        if f.since.is_some() {
            conditions.push(format!("t.created_at >= {} AND t.id >= {}", next(), next()));
        }
        if f.until.is_some() {
            conditions.push(format!("t.created_at < {} AND t.id < {}", next(), next()));
        }
        if f.before_id.is_some() {
            conditions.push(format!("t.id < {}", next()));
        }
        let filter = if conditions.is_empty() { String::new() } else { format!("WHERE {}", conditions.join(" AND ")) };
        let text = format!(
            "SELECT {TRACE_COLUMNS} FROM traces t JOIN prompts p ON p.id = t.prompt_id {filter}
             ORDER BY t.id DESC LIMIT {}",
            next()
        );
        let mut q = sql::<D>(&text);
        if let Some(p) = &f.prompt {
            q = q.bind(p.project()).bind(p.as_str());
        }
        if let Some(project) = &f.project {
            q = q.bind(project.as_str());
        }
        if let Some(status) = f.status.filter(|s| *s == TraceStatus::Pending) {
            q = q.bind(status.as_str());
        }
        if let Some(since) = f.since {
            q = q.bind(since).bind(ids_made_from(since));
        }
        if let Some(until) = f.until {
            q = q.bind(until).bind(ids_made_before(until));
        }
        if let Some(id) = f.before_id {
            q = q.bind(id);
        }
        q.bind(i64::from(limit)).map(&mut *self.reader.acquire().await?, trace_from_row::<D>).await
    }

    async fn add_feedback_from(
        &self,
        id: Uuid,
        feedback: Feedback,
        source: FeedbackSource,
    ) -> StoreResult<Option<Trace>> {
        if !D::add_feedback(self, id, feedback, source).await? {
            return Ok(None);
        }
        self.get_trace(id).await
    }

    async fn requeue_failed_traces(&self, req: &RequeueFailed) -> StoreResult<Vec<Uuid>> {
        let mut tx = self.begin_write().await?;
        let prompt = prompt_id::<D>(&mut tx, &req.prompt).await?;
        let text = format!(
            "UPDATE traces SET status = 'pending', attempts = 0, failure_reason = NULL, round_id = NULL, updated_at = $4
             WHERE prompt_id = $1 AND status = 'failed' AND status <> 'pending' AND ($2 IS NULL OR {})
               AND ($3 IS NULL OR created_at >= $3)
             RETURNING id",
            D::any_of("id", "$2")
        );
        let mut ids: Vec<Uuid> = sql::<D>(&text)
            .bind(prompt)
            .bind(Param::Ids(req.ids.as_deref()))
            .bind(req.since)
            .bind(now())
            .map(&mut tx, |row| Cols::<D>(row).get("id"))
            .await?;
        if ids.is_empty() {
            tx.commit().await?;
        } else {
            self.commit(tx, Change::RoundQueued).await?;
        }
        ids.sort();
        Ok(ids)
    }

    async fn quarantine_trace(&self, id: Uuid, reason: &str) -> StoreResult<TraceAction> {
        let mut tx = self.begin_write().await?;
        if let Some(refused) = lock_for_action::<D>(&mut tx, id, false).await? {
            return Ok(refused);
        }
        let held: Vec<Uuid> = sql::<D>(
            "UPDATE traces SET quarantined_at = $1, quarantine_reason = $2, updated_at = $1
             WHERE id = $3 AND quarantined_at IS NULL RETURNING id",
        )
        .bind(now())
        .bind(reason)
        .bind(id)
        .map(&mut tx, |row| Cols::<D>(row).get("id"))
        .await?;
        rollups::account::<D>(&mut tx, &held, Sign::Retract, Counted::All).await?;
        tx.commit().await?;
        Ok(TraceAction::found(self.get_trace(id).await?))
    }

    async fn quarantine_traces(&self, f: &TraceFilter, reason: &str) -> StoreResult<u64> {
        let Some(prompt) = &f.prompt else { return Ok(0) };
        let mut tx = self.begin_write().await?;
        let held: Vec<Uuid> = sql::<D>(
            "UPDATE traces SET quarantined_at = $1, quarantine_reason = $2, updated_at = $1
             WHERE prompt_id = (SELECT id FROM prompts WHERE name = $3 AND project = $6) AND status = 'pending'
               AND round_id IS NULL AND quarantined_at IS NULL
               AND ($4 IS NULL OR created_at >= $4) AND ($5 IS NULL OR created_at < $5)
             RETURNING id",
        )
        .bind(now())
        .bind(reason)
        .bind(prompt.as_str())
        .bind(f.since)
        .bind(f.until)
        .bind(prompt.project())
        .map(&mut tx, |row| Cols::<D>(row).get("id"))
        .await?;
        // The rows this statement changed, whatever ran meanwhile: their rewards leave the rollups.
        rollups::account::<D>(&mut tx, &held, Sign::Retract, Counted::All).await?;
        tx.commit().await?;
        Ok(held.len() as u64)
    }

    async fn release_trace(&self, id: Uuid) -> StoreResult<TraceAction> {
        let mut tx = self.begin_write().await?;
        let released: Vec<Uuid> = sql::<D>(
            "UPDATE traces SET quarantined_at = NULL, quarantine_reason = NULL, updated_at = $1
             WHERE id = $2 AND quarantined_at IS NOT NULL RETURNING id",
        )
        .bind(now())
        .bind(id)
        .map(&mut tx, |row| Cols::<D>(row).get("id"))
        .await?;
        rollups::account::<D>(&mut tx, &released, Sign::Credit, Counted::All).await?;
        tx.commit().await?;
        Ok(TraceAction::found(self.get_trace(id).await?))
    }

    async fn delete_trace(&self, id: Uuid) -> StoreResult<TraceAction> {
        let Some(trace) = self.get_trace(id).await? else { return Ok(TraceAction::NotFound) };
        let mut tx = self.begin_write().await?;
        if let Some(refused) = lock_for_action::<D>(&mut tx, id, true).await? {
            return Ok(refused);
        }
        // An operator's delete takes the trace's outcome with it (retention's does not).
        rollups::account::<D>(&mut tx, &[id], Sign::Retract, Counted::Unquarantined).await?;
        // Only rounds that ended without publishing can still name it; its OTLP
        // spans go too (a re-sent span would then make a new trace).
        for text in [
            "DELETE FROM reflections WHERE trace_id = $1",
            "DELETE FROM round_traces WHERE trace_id = $1",
            "DELETE FROM otlp_spans WHERE trace_id = $1",
            "DELETE FROM traces WHERE id = $1",
        ] {
            sql::<D>(text).bind(id).execute(&mut tx).await?;
        }
        tx.commit().await?;
        Ok(TraceAction::Done(Box::new(trace)))
    }

    async fn version_outcomes(
        &self,
        prompt: &PromptName,
        from: DateTime<Utc>,
        until: DateTime<Utc>,
        bucket_secs: i64,
        versions: Option<&[i64]>,
    ) -> StoreResult<Vec<OutcomeBucket>> {
        rollups::read_version_outcomes(self, prompt, from, until, bucket_secs, versions).await
    }

    async fn insert_traces_idempotent(
        &self,
        key: IdempotencyKey<'_>,
        traces: &[ValidTrace],
    ) -> StoreResult<IdempotentIngest> {
        D::insert_traces_idempotent(self, key, traces).await
    }

    async fn idempotency_purge(&self, older_than: DateTime<Utc>) -> StoreResult<u64> {
        sql::<D>("DELETE FROM idempotency_keys WHERE created_at < $1")
            .bind(older_than)
            .execute(&mut *self.writer.acquire().await?)
            .await
    }
}

pub(super) const TRACE_COLUMNS: &str = "t.id, p.project AS prompt_project, p.name AS prompt_name, \
     t.prompt_version, t.status, t.input, t.trajectory, t.output, t.feedback, t.reflection, t.external_id, \
     t.metadata, t.attempts, t.failure_reason, t.round_id, t.created_at, t.updated_at, t.quarantined_at, t.quarantine_reason, t.feedback_source, \
     t.judged_at, t.judged_by, t.judgements";

pub(super) fn trace_from_row<D: Dialect>(row: &D::Row) -> StoreResult<Trace> {
    let r = Cols::<D>(row);
    let status: String = r.get("status")?;
    let reflection: Option<Value> = r.get("reflection")?;
    let quarantined_at: Option<DateTime<Utc>> = r.get("quarantined_at")?;
    Ok(Trace {
        id: r.get("id")?,
        prompt: prompt_name_of(&r)?,
        prompt_version: r.get("prompt_version")?,
        status: match quarantined_at {
            Some(_) => TraceStatus::Quarantined,
            None => TraceStatus::parse(&status).ok_or_else(|| corrupt("trace status"))?,
        },
        input: r.get("input")?,
        trajectory: r.get("trajectory")?,
        output: r.get("output")?,
        feedback: serde_json::from_value(r.get("feedback")?).map_err(|_| corrupt("feedback"))?,
        reflection: reflection.filter(|r| !r.is_null()),
        external_id: r.get("external_id")?,
        metadata: r.get("metadata")?,
        attempts: r.get("attempts")?,
        failure_reason: r.get("failure_reason")?,
        round_id: r.get("round_id")?,
        quarantined_at,
        quarantine_reason: r.get("quarantine_reason")?,
        feedback_source: r.get::<Option<String>>("feedback_source")?.map(|s| FeedbackSource::from_column(Some(&s))),
        judged: match r.get::<Option<DateTime<Utc>>>("judged_at")? {
            None => None,
            Some(at) => Some(Judged {
                at,
                by: r.get("judged_by")?,
                judgements: match r.get::<Option<Value>>("judgements")? {
                    Some(v) => serde_json::from_value(v).map_err(|_| corrupt("judgements"))?,
                    None => Vec::new(),
                },
            }),
        },
        created_at: r.get("created_at")?,
        updated_at: r.get("updated_at")?,
    })
}

/// Why `trace` cannot be stored, or `None` when its prompt and version exist.
pub(super) async fn reference_problem<D: Dialect>(
    c: &mut D::Connection,
    prompt: &PromptName,
    version: Option<i64>,
) -> StoreResult<Option<String>> {
    let count = sql::<D>("SELECT version_count FROM prompts WHERE project = $1 AND name = $2")
        .bind(prompt.project())
        .bind(prompt.as_str())
        .value(c, "version_count")
        .await?;
    Ok(prompt_reference_problem(prompt, version, count))
}

/// Merges `feedback` from `source` into trace `id`'s, inside the caller's
/// transaction: under the row lock its old contribution to the rollups is
/// taken back and the new one added, once. A reward sent over a judged one
/// replaces it whole (see [`merged_over`]). False when there is no such trace.
pub(super) async fn merge_feedback<D: Dialect>(
    c: &mut D::Connection,
    id: Uuid,
    feedback: Feedback,
    source: FeedbackSource,
) -> StoreResult<bool> {
    let text =
        format!("SELECT feedback, feedback_source, judged_by FROM traces WHERE id = $1{}", D::lock(" FOR UPDATE"));
    let Some(row) = sql::<D>(&text).bind(id).fetch_optional(&mut *c).await? else { return Ok(false) };
    let r = Cols::<D>(&row);
    let current: Feedback = serde_json::from_value(r.get("feedback")?).map_err(|_| corrupt("feedback"))?;
    let was = FeedbackSource::from_column(r.get::<Option<String>>("feedback_source")?.as_deref());
    let judged_by: Option<String> = r.get("judged_by")?;
    let (merged, now_source) = merged_over(current, was, feedback, source);
    let judged_by = judged_by.filter(|_| now_source == FeedbackSource::Judge);
    let merged = serde_json::to_value(merged).map_err(|_| corrupt("feedback"))?;
    rollups::account::<D>(&mut *c, &[id], Sign::Retract, Counted::Unquarantined).await?;
    sql::<D>("UPDATE traces SET feedback = $1, updated_at = $2, feedback_source = $3, judged_by = $4 WHERE id = $5")
        .bind(json(&merged))
        .bind(now())
        .bind(now_source.column())
        .bind(judged_by)
        .bind(id)
        .execute(&mut *c)
        .await?;
    rollups::account::<D>(&mut *c, &[id], Sign::Credit, Counted::Unquarantined).await?;
    Ok(true)
}

/// Locks trace `id` for an operator action (`delete` or quarantine); the
/// answer to give instead when it is missing or in a state that refuses it.
pub(super) async fn lock_for_action<D: Dialect>(
    c: &mut D::Connection,
    id: Uuid,
    delete: bool,
) -> StoreResult<Option<TraceAction>> {
    let text = format!("SELECT status, round_id FROM traces WHERE id = $1{}", D::lock(" FOR UPDATE"));
    let Some(row) = sql::<D>(&text).bind(id).fetch_optional(c).await? else {
        return Ok(Some(TraceAction::NotFound));
    };
    let r = Cols::<D>(&row);
    Ok(trace_action_refusal(delete, &r.get::<String>("status")?, r.get("round_id")?).map(TraceAction::Refused))
}

/// Late feedback `later` from `source` over `current` (written by `was`):
/// the merged feedback and who wrote it now. A reward sent over a judged
/// one takes its place whole (the judged score and critique go: the agent or
/// the operator knows better); a sender without a reward leaves the source.
pub(crate) fn merged_over(
    current: Feedback,
    was: FeedbackSource,
    later: Feedback,
    source: FeedbackSource,
) -> (Feedback, FeedbackSource) {
    if !later.rewarded() {
        return (current.merged(later), was);
    }
    let current = if was == FeedbackSource::Judge {
        Feedback { score: None, success: None, comment: None, ..current }
    } else {
        current
    };
    (current.merged(later), source)
}

/// The smallest UUIDv7 a trace made at `at` can have, less an hour for
/// clocks of the server and the database that disagree: `created_at >= at`
/// narrows it exactly.
pub(crate) fn ids_made_from(at: DateTime<Utc>) -> Uuid {
    uuid_v7_floor(at.timestamp_millis().saturating_sub(CLOCKS_APART_MS))
}

/// The UUIDv7 below which every trace made before `at` is, plus an hour for
/// clocks that disagree: `created_at < at` narrows it exactly.
pub(crate) fn ids_made_before(at: DateTime<Utc>) -> Uuid {
    uuid_v7_floor(at.timestamp_millis().saturating_add(CLOCKS_APART_MS))
}

/// How far apart the server's and the database's clocks may be.
const CLOCKS_APART_MS: i64 = 3_600_000;

/// The lowest UUIDv7 of millisecond `ms` since the epoch; before the first
/// millisecond the lowest id, past the last (48 bits of them) the highest.
fn uuid_v7_floor(ms: i64) -> Uuid {
    match u128::try_from(ms) {
        Err(_) => Uuid::nil(),
        Ok(ms) if ms >= 1 << 48 => Uuid::max(),
        Ok(ms) => Uuid::from_u128(ms << 80),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_time_range_becomes_an_id_range_even_at_the_ends_of_time() {
        let at = DateTime::from_timestamp_millis(1_765_000_000_123).unwrap();
        // An id made at `at`, as `Uuid::now_v7` makes one then.
        let ts = uuid::Timestamp::from_unix(uuid::NoContext, 1_765_000_000, 123_000_000);
        let made = Uuid::new_v7(ts);
        assert!(ids_made_from(at) <= made && made < ids_made_before(at));
        let hour = chrono::Duration::hours(1);
        let (early, late) = (at - hour - chrono::Duration::seconds(1), at + hour + chrono::Duration::seconds(1));
        assert!(made < ids_made_from(late) && ids_made_before(early) <= made, "an hour's margin each way");
        // A bound a request can name, however far off, is an id, never a panic.
        assert_eq!(ids_made_from(DateTime::<Utc>::MIN_UTC), Uuid::nil());
        assert_eq!(ids_made_before(DateTime::<Utc>::MAX_UTC), Uuid::max());
        assert_eq!(ids_made_before(DateTime::<Utc>::MIN_UTC), Uuid::nil());
    }
}
