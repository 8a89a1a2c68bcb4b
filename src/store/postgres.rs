//! The production store: Postgres, shared by any number of combee processes.
//! Version numbers are assigned under the prompt's row lock; label moves are
//! compare-and-set; every change is announced with `NOTIFY combee_changes` in
//! the same transaction so other processes drop their caches at commit.

use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use futures_util::future::BoxFuture;
use serde_json::Value;
use sqlx::{
    PgConnection, PgPool, Postgres, Row, Transaction,
    postgres::{PgListener, PgPoolOptions, PgRow},
};
use tokio::{sync::broadcast, task::JoinHandle};
use uuid::Uuid;

use crate::evaluate::{
    outcomes::{COST_KEY, LATENCY_KEY, MAX_ABS_VALUE, OutcomeBucket, TOKENS_KEY},
    stats::Moments,
};

use super::backend::{Backend, SqlStore};
use super::sql::{
    Dialect, Param, Query, ROUND_COLUMNS, TRACE_COLUMNS, VERSION_COLUMNS, apply_move, charge_traces, corrupt, fence,
    insert_version, now, prompt_from_row, prompt_id, record_event, record_history, record_move, release_traces,
    round_from_row, trace_from_row, version_from_row,
};
use super::{
    AttemptRecord, Backlog, Change, ClaimedDelivery, ClaimedRound, DeliveryAttempt, DeliveryOutcome, IdempotencyKey,
    IdempotentIngest, LabelMove, NewPrompt, OpenRound, OtlpMerge, OtlpRemap, OtlpRemapFn, OtlpSpan, PopulationArm,
    PromptSummary, RequeueFailed, Resolved, RoundCall, RoundFailure, Selector, Store, StoreError, StoreKind,
    StoreResult, TaskRewards, TraceAction, TraceCharges, TraceFilter, migrate, otlp_prompt_problem,
    trace_action_refusal, version_move_kind,
};
use crate::{
    domain::{
        Feedback, LabelMoveKind, LabelName, MoveCause, Prompt, PromptName, PromptSettings, Reflection, Trace, Version,
        event::OutboxEvent,
        prompt::NewVersion,
        round::{self, Round},
        trace::ValidTrace,
    },
    llm::LlmCall,
    secret::Secret,
};

const CHANNEL: &str = "combee_changes";

pub type PgStore = SqlStore<Postgres>;

/// The NOTIFY listener task, stopped with the store.
pub struct Listener(JoinHandle<()>);

impl Drop for Listener {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl SqlStore<Postgres> {
    pub async fn connect(url: &str, max_connections: u32, acquire_timeout: Duration) -> StoreResult<Self> {
        let pool = PgPoolOptions::new()
            .max_connections(max_connections)
            .acquire_timeout(acquire_timeout)
            // No ping before every checkout (it was 12% of server CPU on trace ingest);
            // a dead connection fails its statement instead, and the pool replaces it.
            .test_before_acquire(false)
            .connect(url)
            .await
            .map_err(StoreError::Unavailable)?;
        migrate::postgres(&pool).await?;
        let (changes, _) = broadcast::channel(1024);
        let listener = Listener(tokio::spawn(listen(pool.clone(), changes.clone())));
        Ok(Self { writer: pool.clone(), reader: pool, changes, extra: listener })
    }

    pub fn pool(&self) -> &PgPool {
        &self.writer
    }
}

/// Inserts a batch of traces with the given ids in one statement: rows whose
/// prompt or version is unknown fall out of the join, and then nothing is
/// inserted at all. Returns how many rows were inserted (all or zero).
async fn insert_trace_rows<'e>(
    exec: impl sqlx::PgExecutor<'e>,
    traces: &[ValidTrace],
    ids: &[Uuid],
) -> StoreResult<u64> {
    let rows: Vec<Value> = traces
        .iter()
        .zip(ids)
        .map(|(t, id)| {
            serde_json::json!({
                "id": id, "prompt": t.prompt.as_str(), "prompt_version": t.prompt_version,
                "input": t.input, "trajectory": t.trajectory, "output": t.output,
                "feedback": t.feedback, "reflection": t.reflection, "external_id": t.external_id,
                "metadata": t.metadata,
            })
        })
        .collect();
    Ok(sqlx::query(
        "WITH matched AS (
             SELECT t.id, p.id AS prompt_id, t.prompt_version, t.input, COALESCE(t.trajectory, 'null'::jsonb) AS trajectory,
                    COALESCE(t.output, 'null'::jsonb) AS output, t.feedback, t.reflection, t.external_id, t.metadata
             FROM jsonb_to_recordset($1) AS t(id uuid, prompt text, prompt_version bigint, input jsonb, trajectory jsonb,
                  output jsonb, feedback jsonb, reflection jsonb, external_id text, metadata jsonb)
             JOIN prompts p ON p.name = t.prompt AND (t.prompt_version IS NULL OR t.prompt_version <= p.version_count))
         INSERT INTO traces (id, prompt_id, prompt_version, input, trajectory, output, feedback, reflection, external_id, metadata)
         SELECT id, prompt_id, prompt_version, input, trajectory, output, feedback, reflection, external_id, metadata
         FROM matched WHERE (SELECT count(*) FROM matched) = $2",
    )
    .bind(Value::Array(rows))
    .bind(traces.len() as i64)
    .execute(exec)
    .await?
    .rows_affected())
}

/// Postgres encodes ids, times and JSON natively (uuid, timestamptz, jsonb).
impl Dialect for Postgres {
    fn bind<'q>(q: Query<'q, Self>, p: Param<'q>) -> Query<'q, Self> {
        match p {
            Param::Int(v) => q.bind(v),
            Param::Int32(v) => q.bind(v),
            Param::Real(v) => q.bind(v),
            Param::Bool(v) => q.bind(v),
            Param::Text(v) => q.bind(v),
            Param::Id(v) => q.bind(v),
            Param::At(v) => q.bind(v),
            Param::Json(v) => q.bind(v),
        }
    }
    fn execute<'c, 'q: 'c>(q: Query<'q, Self>, c: &'c mut PgConnection) -> BoxFuture<'c, sqlx::Result<u64>> {
        Box::pin(async move { Ok(q.execute(c).await?.rows_affected()) })
    }
    fn fetch_all<'c, 'q: 'c>(q: Query<'q, Self>, c: &'c mut PgConnection) -> BoxFuture<'c, sqlx::Result<Vec<PgRow>>> {
        Box::pin(q.fetch_all(c))
    }
    fn fetch_optional<'c, 'q: 'c>(
        q: Query<'q, Self>,
        c: &'c mut PgConnection,
    ) -> BoxFuture<'c, sqlx::Result<Option<PgRow>>> {
        Box::pin(q.fetch_optional(c))
    }
    fn get_i64(row: &PgRow, col: &str) -> StoreResult<Option<i64>> {
        Ok(row.try_get(col)?)
    }
    fn get_i32(row: &PgRow, col: &str) -> StoreResult<Option<i32>> {
        Ok(row.try_get(col)?)
    }
    fn get_f64(row: &PgRow, col: &str) -> StoreResult<Option<f64>> {
        Ok(row.try_get(col)?)
    }
    fn get_bool(row: &PgRow, col: &str) -> StoreResult<Option<bool>> {
        Ok(row.try_get(col)?)
    }
    fn get_text(row: &PgRow, col: &str) -> StoreResult<Option<String>> {
        Ok(row.try_get(col)?)
    }
    fn get_id(row: &PgRow, col: &str) -> StoreResult<Option<Uuid>> {
        Ok(row.try_get(col)?)
    }
    fn get_at(row: &PgRow, col: &str) -> StoreResult<Option<DateTime<Utc>>> {
        Ok(row.try_get(col)?)
    }
    fn get_json(row: &PgRow, col: &str) -> StoreResult<Option<Value>> {
        Ok(row.try_get(col)?)
    }
    fn lock(clause: &'static str) -> &'static str {
        clause
    }
    fn notify<'c>(c: &'c mut PgConnection, payload: &'c str) -> BoxFuture<'c, StoreResult<()>> {
        Box::pin(async move {
            sqlx::query("SELECT pg_notify($1, $2)").bind(CHANNEL).bind(payload).execute(c).await?;
            Ok(())
        })
    }
}

/// Forwards NOTIFY payloads to the in-process broadcast; after any gap in the
/// connection it sends `Resync`, since notifications may have been missed.
async fn listen(pool: PgPool, tx: broadcast::Sender<Change>) {
    let mut backoff = Duration::from_millis(100);
    loop {
        let mut listener = match PgListener::connect_with(&pool).await {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(error = %e, "change listener cannot connect; retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
                continue;
            }
        };
        if let Err(e) = listener.listen(CHANNEL).await {
            tracing::warn!(error = %e, "LISTEN failed; retrying");
            tokio::time::sleep(backoff).await;
            continue;
        }
        backoff = Duration::from_millis(100);
        let _ = tx.send(Change::Resync);
        loop {
            match listener.try_recv().await {
                Ok(Some(n)) => {
                    let change = match n.payload().split_once(':') {
                        Some(("prompt", name)) => Change::Prompt(name.to_owned()),
                        _ if n.payload() == "keys" => Change::Keys,
                        _ if n.payload() == "round" => Change::RoundQueued,
                        _ if n.payload() == "outbox" => Change::OutboxEvent,
                        _ => Change::Resync,
                    };
                    let _ = tx.send(change);
                }
                Ok(None) => {
                    let _ = tx.send(Change::Resync);
                }
                Err(e) => {
                    tracing::warn!(error = %e, "change listener lost its connection");
                    let _ = tx.send(Change::Resync);
                    break;
                }
            }
        }
    }
}

async fn notify(tx: &mut Transaction<'_, Postgres>, payload: &str) -> StoreResult<()> {
    sqlx::query("SELECT pg_notify($1, $2)").bind(CHANNEL).bind(payload).execute(&mut **tx).await?;
    Ok(())
}

#[async_trait]
impl Backend for Postgres {
    const KIND: StoreKind = StoreKind::Postgres;
    const ANNOUNCE_LOCALLY: bool = false;
    type Extra = Listener;

    async fn ping(s: &SqlStore<Self>) -> StoreResult<()> {
        sqlx::query("SELECT 1").execute(&s.writer).await?;
        Ok(())
    }

    async fn api_key_generation(s: &SqlStore<Self>) -> StoreResult<i64> {
        Ok(sqlx::query_scalar("SELECT generation FROM api_key_generation").fetch_one(&s.writer).await?)
    }

    async fn create_prompt(s: &SqlStore<Self>, p: NewPrompt, first: NewVersion) -> StoreResult<(Prompt, Version)> {
        let mut tx = s.writer.begin().await?;
        let row = sqlx::query(
            "INSERT INTO prompts (id, name, strategy, promotion, settings, version_count, created_by)
             VALUES ($1, $2, $3, $4, $5, 1, $6)
             RETURNING id, name, strategy, promotion, settings, created_at, created_by",
        )
        .bind(Uuid::now_v7())
        .bind(p.name.as_str())
        .bind(serde_json::to_value(p.strategy).ok().and_then(|v| v.as_str().map(str::to_owned)))
        .bind(serde_json::to_value(p.promotion).ok().and_then(|v| v.as_str().map(str::to_owned)))
        .bind(serde_json::to_value(&p.settings).map_err(|_| corrupt("settings"))?)
        .bind(&p.created_by)
        .fetch_one(&mut *tx)
        .await?;
        let prompt = prompt_from_row::<Postgres>(&row)?;
        let created_at = now();
        insert_version::<Postgres>(&mut *tx, prompt.id, 1, &first, created_at).await?;
        sqlx::query("INSERT INTO labels (prompt_id, name, version, updated_by) VALUES ($1, $2, 1, $3)")
            .bind(prompt.id)
            .bind(LabelName::PRODUCTION)
            .bind(&first.created_by)
            .execute(&mut *tx)
            .await?;
        let version = first.into_version(prompt.name.clone(), 1, created_at);
        let production = LabelName::parse(LabelName::PRODUCTION).map_err(|_| corrupt("label name"))?;
        record_event::<Postgres>(&mut *tx, &OutboxEvent::version_created(&version, &[LabelName::PRODUCTION])).await?;
        record_event::<Postgres>(
            &mut *tx,
            &OutboxEvent::label_moved(&prompt.name, &production, 1, None, &version.created_by),
        )
        .await?;
        let cause = MoveCause::new(LabelMoveKind::Create, "prompt created");
        record_history::<Postgres>(&mut *tx, prompt.id, &production, None, Some(1), &version.created_by, &cause)
            .await?;
        notify(&mut tx, &format!("prompt:{}", prompt.name)).await?;
        tx.commit().await?;
        Ok((prompt, version))
    }

    async fn update_prompt_settings(
        s: &SqlStore<Self>,
        name: &PromptName,
        expected: &PromptSettings,
        new: &PromptSettings,
    ) -> StoreResult<Option<Prompt>> {
        let mut tx = s.writer.begin().await?;
        let Some(current) = sqlx::query_scalar::<_, Value>("SELECT settings FROM prompts WHERE name = $1 FOR UPDATE")
            .bind(name.as_str())
            .fetch_optional(&mut *tx)
            .await?
        else {
            return Ok(None);
        };
        let current: PromptSettings = serde_json::from_value(current).map_err(|_| corrupt("settings"))?;
        if &current != expected {
            return Err(StoreError::Conflict);
        }
        let row = sqlx::query(
            "UPDATE prompts SET settings = $2 WHERE name = $1
             RETURNING id, name, strategy, promotion, settings, created_at, created_by",
        )
        .bind(name.as_str())
        .bind(serde_json::to_value(new).map_err(|_| corrupt("settings"))?)
        .fetch_one(&mut *tx)
        .await?;
        tx.commit().await?;
        prompt_from_row::<Postgres>(&row).map(Some)
    }

    async fn list_prompts(s: &SqlStore<Self>, after: Option<&str>, limit: u32) -> StoreResult<Vec<PromptSummary>> {
        let rows = sqlx::query(
            "SELECT p.id, p.name, p.strategy, p.promotion, p.settings, p.created_at, p.created_by, p.version_count,
                    (SELECT version FROM labels l WHERE l.prompt_id = p.id AND l.name = 'production') AS production_version,
                    (SELECT count(*) FROM traces t WHERE t.prompt_id = p.id AND t.status = 'pending' AND t.quarantined_at IS NULL) AS pending
             FROM prompts p WHERE ($1::text IS NULL OR p.name > $1) ORDER BY p.name LIMIT $2",
        )
        .bind(after)
        .bind(i64::from(limit))
        .fetch_all(&s.writer)
        .await?;
        rows.iter()
            .map(|r| {
                Ok(PromptSummary {
                    prompt: prompt_from_row::<Postgres>(r)?,
                    production_version: r.try_get("production_version")?,
                    latest_version: r.try_get("version_count")?,
                    pending_traces: r.try_get("pending")?,
                })
            })
            .collect()
    }

    async fn create_version(
        s: &SqlStore<Self>,
        prompt: &PromptName,
        v: NewVersion,
        moves: &[LabelMove],
    ) -> StoreResult<Version> {
        let mut tx = s.writer.begin().await?;
        // The row lock taken here serialises concurrent writers of one prompt.
        let row = sqlx::query(
            "UPDATE prompts SET version_count = version_count + 1 WHERE name = $1 RETURNING id, version_count",
        )
        .bind(prompt.as_str())
        .fetch_optional(&mut *tx)
        .await?
        .ok_or(StoreError::NotFound)?;
        let (id, number): (Uuid, i64) = (row.try_get("id")?, row.try_get("version_count")?);
        if v.parent.is_some_and(|p| p < 1 || p >= number) {
            return Err(StoreError::Invalid("parent version does not exist".into()));
        }
        let created_at = now();
        insert_version::<Postgres>(&mut *tx, id, number, &v, created_at).await?;
        let mut moved = Vec::with_capacity(moves.len());
        for mv in moves {
            let mv = LabelMove { to_version: if mv.to_version == 0 { number } else { mv.to_version }, ..mv.clone() };
            moved.push(apply_move::<Postgres>(&mut *tx, id, &mv).await?);
        }
        let version = v.into_version(prompt.clone(), number, created_at);
        let on_new: Vec<&str> =
            moved.iter().filter(|(l, _)| l.version == number).map(|(l, _)| l.name.as_str()).collect();
        record_event::<Postgres>(&mut *tx, &OutboxEvent::version_created(&version, &on_new)).await?;
        let cause = MoveCause::new(version_move_kind(version.source), version.message.clone());
        for (label, previous) in &moved {
            record_move::<Postgres>(&mut *tx, id, prompt, label, *previous, &cause).await?;
        }
        notify(&mut tx, &format!("prompt:{prompt}")).await?;
        tx.commit().await?;
        Ok(version)
    }

    async fn resolve(s: &SqlStore<Self>, prompt: &PromptName, selector: &Selector) -> StoreResult<Option<Resolved>> {
        let labels_col = "(SELECT array_agg(l2.name ORDER BY l2.name) FROM labels l2
                           WHERE l2.prompt_id = v.prompt_id AND l2.version = v.number) AS labels";
        let row = match selector {
            Selector::Label(label) => {
                sqlx::query(&format!(
                    "SELECT {VERSION_COLUMNS}, {labels_col} FROM labels l
                     JOIN prompts p ON p.id = l.prompt_id
                     JOIN versions v ON v.prompt_id = l.prompt_id AND v.number = l.version
                     WHERE p.name = $1 AND l.name = $2"
                ))
                .bind(prompt.as_str())
                .bind(label.as_str())
                .fetch_optional(&s.writer)
                .await?
            }
            Selector::Latest => {
                sqlx::query(&format!(
                    "SELECT {VERSION_COLUMNS}, {labels_col} FROM prompts p
                     JOIN versions v ON v.prompt_id = p.id AND v.number = p.version_count
                     WHERE p.name = $1"
                ))
                .bind(prompt.as_str())
                .fetch_optional(&s.writer)
                .await?
            }
            Selector::Version(n) => {
                sqlx::query(&format!(
                    "SELECT {VERSION_COLUMNS}, {labels_col} FROM prompts p
                     JOIN versions v ON v.prompt_id = p.id AND v.number = $2
                     WHERE p.name = $1"
                ))
                .bind(prompt.as_str())
                .bind(n)
                .fetch_optional(&s.writer)
                .await?
            }
        };
        let Some(row) = row else { return Ok(None) };
        let labels: Option<Vec<String>> = row.try_get("labels")?;
        let labels = labels
            .unwrap_or_default()
            .iter()
            .map(|l| LabelName::parse(l).map_err(|_| corrupt("label name")))
            .collect::<StoreResult<_>>()?;
        Ok(Some(Resolved { version: version_from_row::<Postgres>(&row)?, labels }))
    }

    async fn delete_label(s: &SqlStore<Self>, prompt: &PromptName, label: &LabelName, by: &str) -> StoreResult<bool> {
        let mut tx = s.writer.begin().await?;
        let id = prompt_id::<Postgres>(&mut *tx, prompt).await?;
        let deleted: Option<i64> =
            sqlx::query_scalar("DELETE FROM labels WHERE prompt_id = $1 AND name = $2 RETURNING version")
                .bind(id)
                .bind(label.as_str())
                .fetch_optional(&mut *tx)
                .await?;
        if let Some(version) = deleted {
            let cause = MoveCause::new(LabelMoveKind::Delete, "label deleted");
            record_history::<Postgres>(&mut *tx, id, label, Some(version), None, by, &cause).await?;
        }
        notify(&mut tx, &format!("prompt:{prompt}")).await?;
        tx.commit().await?;
        Ok(deleted.is_some())
    }

    async fn task_rewards(
        s: &SqlStore<Self>,
        prompt: &PromptName,
        from: DateTime<Utc>,
        until: DateTime<Utc>,
    ) -> StoreResult<Vec<TaskRewards>> {
        let sql = format!(
            "WITH r AS (
               SELECT t.prompt_version AS version, t.metadata->>'task_key' AS task_key,
                      CASE WHEN jsonb_typeof(t.feedback->'success') = 'boolean'
                           THEN CASE WHEN (t.feedback->>'success')::boolean THEN 1.0::float8 ELSE 0.0::float8 END
                           WHEN jsonb_typeof(t.feedback->'score') = 'number'
                           THEN CASE WHEN abs((t.feedback->'score')::numeric) <= {MAX_ABS_VALUE}
                                THEN (t.feedback->'score')::numeric::float8 END END AS reward
               FROM traces t JOIN prompts p ON p.id = t.prompt_id
               WHERE p.name = $1 AND t.created_at >= $2 AND t.created_at < $3 AND t.quarantined_at IS NULL
                 AND t.prompt_version IS NOT NULL AND jsonb_typeof(t.metadata->'task_key') = 'string')
             SELECT version, task_key, count(reward) AS n, coalesce(sum(reward), 0)::float8 AS total
             FROM r WHERE reward IS NOT NULL GROUP BY version, task_key ORDER BY version, task_key"
        );
        sqlx::query(&sql)
            .bind(prompt.as_str())
            .bind(from)
            .bind(until)
            .fetch_all(&s.writer)
            .await?
            .iter()
            .map(|row| {
                Ok(TaskRewards {
                    version: row.try_get("version")?,
                    task_key: row.try_get("task_key")?,
                    traces: row.try_get::<i64, _>("n")?.max(0) as u64,
                    reward_sum: row.try_get("total")?,
                })
            })
            .collect()
    }

    async fn save_population(s: &SqlStore<Self>, prompt: &PromptName, arms: &[PopulationArm]) -> StoreResult<()> {
        let mut tx = s.writer.begin().await?;
        let id = prompt_id::<Postgres>(&mut *tx, prompt).await?;
        for arm in arms {
            let exists: Option<i64> =
                sqlx::query_scalar("SELECT number FROM versions WHERE prompt_id = $1 AND number = $2")
                    .bind(id)
                    .bind(arm.version)
                    .fetch_optional(&mut *tx)
                    .await?;
            if exists.is_none() {
                return Err(StoreError::Invalid(format!("version {} does not exist", arm.version)));
            }
            sqlx::query(
                "INSERT INTO population_arms
                    (prompt_id, version, state, mu, sigma, weight, scored_traces, created_from, rated_until)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
                 ON CONFLICT (prompt_id, version) DO UPDATE SET
                    state = excluded.state, mu = excluded.mu, sigma = excluded.sigma, weight = excluded.weight,
                    scored_traces = excluded.scored_traces, created_from = excluded.created_from,
                    rated_until = excluded.rated_until, updated_at = now()",
            )
            .bind(id)
            .bind(arm.version)
            .bind(arm.state.as_str())
            .bind(arm.rating.mu)
            .bind(arm.rating.sigma)
            .bind(arm.weight)
            .bind(arm.scored_traces as i64)
            .bind(arm.created_from)
            .bind(arm.rated_until)
            .execute(&mut *tx)
            .await?;
        }
        notify(&mut tx, &format!("prompt:{prompt}")).await?;
        tx.commit().await?;
        Ok(())
    }

    async fn insert_traces(s: &SqlStore<Self>, traces: &[ValidTrace]) -> StoreResult<Vec<Uuid>> {
        let ids: Vec<Uuid> = traces.iter().map(|_| Uuid::now_v7()).collect();
        // One statement for the whole batch, atomic on its own (no BEGIN/COMMIT round trips).
        if insert_trace_rows(&s.writer, traces, &ids).await? != traces.len() as u64 {
            return Err(s.first_unknown_reference(traces).await?);
        }
        Ok(ids)
    }

    async fn list_traces(s: &SqlStore<Self>, f: &TraceFilter, limit: u32) -> StoreResult<Vec<Trace>> {
        sqlx::query(&format!(
            "SELECT {TRACE_COLUMNS} FROM traces t JOIN prompts p ON p.id = t.prompt_id
             WHERE ($1::text IS NULL OR p.name = $1)
               AND ($2::text IS NULL OR CASE WHEN $2 = 'quarantined' THEN t.quarantined_at IS NOT NULL
                                             ELSE t.status = $2 AND t.quarantined_at IS NULL END)
               AND ($3::timestamptz IS NULL OR t.created_at >= $3) AND ($4::timestamptz IS NULL OR t.created_at < $4)
               AND ($5::uuid IS NULL OR t.id < $5)
             ORDER BY t.id DESC LIMIT $6"
        ))
        .bind(f.prompt.as_ref().map(|p| p.as_str()))
        .bind(f.status.map(|s| s.as_str()))
        .bind(f.since)
        .bind(f.until)
        .bind(f.before_id)
        .bind(i64::from(limit))
        .fetch_all(&s.writer)
        .await?
        .iter()
        .map(trace_from_row::<Postgres>)
        .collect()
    }

    async fn add_feedback(s: &SqlStore<Self>, id: Uuid, feedback: Feedback) -> StoreResult<Option<Trace>> {
        let mut tx = s.writer.begin().await?;
        let Some(current) = sqlx::query_scalar::<_, Value>("SELECT feedback FROM traces WHERE id = $1 FOR UPDATE")
            .bind(id)
            .fetch_optional(&mut *tx)
            .await?
        else {
            return Ok(None);
        };
        let current: Feedback = serde_json::from_value(current).map_err(|_| corrupt("feedback"))?;
        let merged = serde_json::to_value(current.merged(feedback)).map_err(|_| corrupt("feedback"))?;
        sqlx::query("UPDATE traces SET feedback = $2, updated_at = now() WHERE id = $1")
            .bind(id)
            .bind(merged)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        s.get_trace(id).await
    }

    async fn version_outcomes(
        s: &SqlStore<Self>,
        prompt: &PromptName,
        from: DateTime<Utc>,
        until: DateTime<Utc>,
        bucket_secs: i64,
    ) -> StoreResult<Vec<OutcomeBucket>> {
        // jsonb numbers are `numeric`: range-check before the float8 cast so an
        // absurd value is skipped instead of failing the query. Nested CASEs
        // because Postgres does not promise to short-circuit AND.
        let num = |col: &str, key: &str| {
            format!(
                "CASE WHEN jsonb_typeof({col}->'{key}') = 'number' THEN \
                   CASE WHEN abs(({col}->'{key}')::numeric) <= {MAX_ABS_VALUE} \
                     THEN ({col}->'{key}')::numeric::float8 END END"
            )
        };
        let sql = format!(
            "WITH v AS (
               SELECT t.prompt_version AS version,
                      floor(extract(epoch FROM t.created_at) / $4)::bigint * $4 AS start,
                      CASE WHEN jsonb_typeof(t.feedback->'success') = 'boolean'
                           THEN (t.feedback->>'success')::boolean END AS success,
                      (jsonb_typeof(t.feedback->'success') = 'boolean'
                       OR jsonb_typeof(t.feedback->'score') = 'number') AS rewarded,
                      {score} AS score, {tokens} AS tokens, {cost} AS cost, {latency} AS latency
               FROM traces t JOIN prompts p ON p.id = t.prompt_id
               WHERE p.name = $1 AND t.created_at >= $2 AND t.created_at < $3 AND t.quarantined_at IS NULL)
             SELECT version, start, count(*) AS traces,
                    count(*) FILTER (WHERE rewarded) AS with_feedback,
                    count(success) AS success_trials, count(*) FILTER (WHERE success) AS successes,
                    {aggs}
             FROM v GROUP BY version, start",
            score = num("t.feedback", "score"),
            tokens = num("t.metadata", TOKENS_KEY),
            cost = num("t.metadata", COST_KEY),
            latency = num("t.metadata", LATENCY_KEY),
            aggs = ["score", "tokens", "cost", "latency"]
                .map(|c| format!(
                    "count({c}) AS {c}_n, coalesce(sum({c}), 0)::float8 AS {c}_sum, coalesce(sum({c} * {c}), 0)::float8 AS {c}_sq"
                ))
                .join(", "),
        );
        sqlx::query(&sql)
            .bind(prompt.as_str())
            .bind(from)
            .bind(until)
            .bind(bucket_secs)
            .fetch_all(&s.writer)
            .await?
            .iter()
            .map(outcome_bucket_from_row)
            .collect()
    }

    async fn quarantine_trace(s: &SqlStore<Self>, id: Uuid, reason: &str) -> StoreResult<TraceAction> {
        let mut tx = s.writer.begin().await?;
        if let Some(refused) = lock_for_action(&mut tx, id, false).await? {
            return Ok(refused);
        }
        sqlx::query(
            "UPDATE traces SET quarantined_at = now(), quarantine_reason = $2, updated_at = now()
             WHERE id = $1 AND quarantined_at IS NULL",
        )
        .bind(id)
        .bind(reason)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(TraceAction::found(s.get_trace(id).await?))
    }

    async fn quarantine_traces(s: &SqlStore<Self>, f: &TraceFilter, reason: &str) -> StoreResult<u64> {
        let Some(prompt) = &f.prompt else { return Ok(0) };
        Ok(sqlx::query(
            "UPDATE traces t SET quarantined_at = now(), quarantine_reason = $2, updated_at = now()
             FROM prompts p
             WHERE p.id = t.prompt_id AND p.name = $1 AND t.status = 'pending' AND t.round_id IS NULL
               AND t.quarantined_at IS NULL
               AND ($3::timestamptz IS NULL OR t.created_at >= $3) AND ($4::timestamptz IS NULL OR t.created_at < $4)",
        )
        .bind(prompt.as_str())
        .bind(reason)
        .bind(f.since)
        .bind(f.until)
        .execute(&s.writer)
        .await?
        .rows_affected())
    }

    async fn release_trace(s: &SqlStore<Self>, id: Uuid) -> StoreResult<TraceAction> {
        let mut tx = s.writer.begin().await?;
        let released = sqlx::query(
            "UPDATE traces SET quarantined_at = NULL, quarantine_reason = NULL, updated_at = now()
             WHERE id = $1 AND quarantined_at IS NOT NULL",
        )
        .bind(id)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if released > 0 {
            notify(&mut tx, "round").await?;
        }
        tx.commit().await?;
        Ok(TraceAction::found(s.get_trace(id).await?))
    }

    async fn delete_trace(s: &SqlStore<Self>, id: Uuid) -> StoreResult<TraceAction> {
        let Some(trace) = s.get_trace(id).await? else { return Ok(TraceAction::NotFound) };
        let mut tx = s.writer.begin().await?;
        if let Some(refused) = lock_for_action(&mut tx, id, true).await? {
            return Ok(refused);
        }
        // Only rounds that ended without publishing can still name it.
        sqlx::query("DELETE FROM reflections WHERE trace_id = $1").bind(id).execute(&mut *tx).await?;
        sqlx::query("DELETE FROM round_traces WHERE trace_id = $1").bind(id).execute(&mut *tx).await?;
        // Its OTLP spans go too (a re-sent span would then make a new trace).
        sqlx::query("DELETE FROM otlp_spans WHERE trace_id = $1").bind(id).execute(&mut *tx).await?;
        sqlx::query("DELETE FROM traces WHERE id = $1").bind(id).execute(&mut *tx).await?;
        tx.commit().await?;
        Ok(TraceAction::Done(Box::new(trace)))
    }

    async fn merge_otlp_spans(
        s: &SqlStore<Self>,
        otel_trace_id: &str,
        spans: &[OtlpSpan],
        remap: &OtlpRemapFn<'_>,
    ) -> StoreResult<OtlpMerge> {
        let mut tx = s.writer.begin().await?;
        // Serialises exports of the same trace id, including the first one,
        // when there is no row to lock yet; the lock ends with the transaction.
        sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended('otlp:' || $1, 0))")
            .bind(otel_trace_id)
            .execute(&mut *tx)
            .await?;
        let stored = sqlx::query(
            "SELECT span_id, trace_id, body FROM otlp_spans WHERE otel_trace_id = $1 ORDER BY received_at, span_id",
        )
        .bind(otel_trace_id)
        .fetch_all(&mut *tx)
        .await?;
        let mut seen = std::collections::HashSet::new();
        let mut linked = None;
        let mut bodies: Vec<Vec<u8>> = Vec::with_capacity(stored.len() + spans.len());
        for row in &stored {
            seen.insert(row.try_get::<String, _>("span_id")?);
            linked = linked.or(row.try_get::<Option<Uuid>, _>("trace_id")?);
            bodies.push(row.try_get("body")?);
        }
        let new: Vec<&OtlpSpan> = spans.iter().filter(|s| seen.insert(s.span_id.clone())).collect();
        if new.is_empty() {
            // Ended explicitly: a dropped transaction would keep its locks
            // until its pooled connection is used again.
            tx.rollback().await?;
            return Ok(OtlpMerge::Duplicate);
        }
        if let Some(trace) = linked {
            // The row lock keeps a round from taking the trace while it changes
            // (rounds skip locked traces); a round that took it first wins.
            let open: Option<bool> = sqlx::query_scalar(
                "SELECT status = 'pending' AND round_id IS NULL FROM traces WHERE id = $1 FOR UPDATE",
            )
            .bind(trace)
            .fetch_optional(&mut *tx)
            .await?;
            if open != Some(true) {
                tx.rollback().await?;
                return Ok(OtlpMerge::Closed { trace, spans: new.len() });
            }
        }
        bodies.extend(new.iter().map(|s| s.body.clone()));
        let refs: Vec<&[u8]> = bodies.iter().map(Vec::as_slice).collect();
        let mapped = match remap(&refs) {
            OtlpRemap::Invalid(reason) => {
                tx.rollback().await?;
                return Ok(OtlpMerge::Rejected { spans: new.len(), reason });
            }
            OtlpRemap::Incomplete(reason) if linked.is_some() => {
                tx.rollback().await?;
                return Ok(OtlpMerge::Rejected { spans: new.len(), reason });
            }
            OtlpRemap::Incomplete(reason) => {
                insert_otlp_spans(&mut tx, otel_trace_id, None, &new).await?;
                tx.commit().await?;
                return Ok(OtlpMerge::Held { added: new.len(), reason });
            }
            OtlpRemap::Mapped(t) => *t,
        };
        let prompt = sqlx::query("SELECT id, version_count FROM prompts WHERE name = $1")
            .bind(mapped.prompt.as_str())
            .fetch_optional(&mut *tx)
            .await?;
        let count = prompt.as_ref().map(|r| r.try_get::<i64, _>("version_count")).transpose()?;
        if let Some(reason) = otlp_prompt_problem(&mapped, count) {
            tx.rollback().await?;
            return Ok(OtlpMerge::Rejected { spans: new.len(), reason });
        }
        let prompt_id: Uuid = prompt.as_ref().map(|r| r.try_get("id")).transpose()?.ok_or_else(|| corrupt("prompt"))?;
        let (trace, created) = match linked {
            Some(trace) => {
                let current: Value = sqlx::query_scalar("SELECT feedback FROM traces WHERE id = $1")
                    .bind(trace)
                    .fetch_one(&mut *tx)
                    .await?;
                let current: Feedback = serde_json::from_value(current).map_err(|_| corrupt("feedback"))?;
                // Feedback given through the API stays unless a span says otherwise.
                let feedback =
                    serde_json::to_value(current.merged(mapped.feedback.clone())).map_err(|_| corrupt("feedback"))?;
                sqlx::query(
                    "UPDATE traces SET prompt_id = $2, prompt_version = $3, input = $4, trajectory = $5, output = $6,
                            feedback = $7, metadata = $8, updated_at = now() WHERE id = $1",
                )
                .bind(trace)
                .bind(prompt_id)
                .bind(mapped.prompt_version)
                .bind(&mapped.input)
                .bind(&mapped.trajectory)
                .bind(&mapped.output)
                .bind(feedback)
                .bind(&mapped.metadata)
                .execute(&mut *tx)
                .await?;
                (trace, false)
            }
            None => {
                let trace = Uuid::now_v7();
                sqlx::query(
                    "INSERT INTO traces (id, prompt_id, prompt_version, input, trajectory, output, feedback, reflection,
                                         external_id, metadata)
                     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
                )
                .bind(trace)
                .bind(prompt_id)
                .bind(mapped.prompt_version)
                .bind(&mapped.input)
                .bind(&mapped.trajectory)
                .bind(&mapped.output)
                .bind(serde_json::to_value(&mapped.feedback).map_err(|_| corrupt("feedback"))?)
                .bind(mapped.reflection.as_ref().map(serde_json::to_value).transpose().map_err(|_| corrupt("reflection"))?)
                .bind(&mapped.external_id)
                .bind(&mapped.metadata)
                .execute(&mut *tx)
                .await?;
                sqlx::query("UPDATE otlp_spans SET trace_id = $2 WHERE otel_trace_id = $1 AND trace_id IS NULL")
                    .bind(otel_trace_id)
                    .bind(trace)
                    .execute(&mut *tx)
                    .await?;
                (trace, true)
            }
        };
        insert_otlp_spans(&mut tx, otel_trace_id, Some(trace), &new).await?;
        tx.commit().await?;
        let added = new.len();
        Ok(if created { OtlpMerge::Created { trace, added } } else { OtlpMerge::Extended { trace, added } })
    }

    async fn purge_held_otlp_spans(s: &SqlStore<Self>, older_than: DateTime<Utc>) -> StoreResult<u64> {
        Ok(sqlx::query(
            "DELETE FROM otlp_spans WHERE trace_id IS NULL AND otel_trace_id IN (
                 SELECT otel_trace_id FROM otlp_spans WHERE trace_id IS NULL
                 GROUP BY otel_trace_id HAVING max(received_at) < $1)",
        )
        .bind(older_than)
        .execute(&s.writer)
        .await?
        .rows_affected())
    }

    async fn requeue_failed_traces(s: &SqlStore<Self>, req: &RequeueFailed) -> StoreResult<Vec<Uuid>> {
        let mut tx = s.writer.begin().await?;
        let prompt = prompt_id::<Postgres>(&mut *tx, &req.prompt).await?;
        let mut ids: Vec<Uuid> = sqlx::query_scalar(
            "UPDATE traces SET status = 'pending', attempts = 0, failure_reason = NULL, round_id = NULL, updated_at = now()
             WHERE prompt_id = $1 AND status = 'failed'
               AND ($2::uuid[] IS NULL OR id = ANY($2)) AND ($3::timestamptz IS NULL OR created_at >= $3)
             RETURNING id",
        )
        .bind(prompt)
        .bind(req.ids.as_deref())
        .bind(req.since)
        .fetch_all(&mut *tx)
        .await?;
        if !ids.is_empty() {
            notify(&mut tx, "round").await?;
        }
        tx.commit().await?;
        ids.sort();
        Ok(ids)
    }

    async fn insert_traces_idempotent(
        s: &SqlStore<Self>,
        key: IdempotencyKey<'_>,
        traces: &[ValidTrace],
        status: u16,
        answer: &(dyn for<'i> Fn(&'i [Uuid]) -> Vec<u8> + Send + Sync),
    ) -> StoreResult<IdempotentIngest> {
        let ids: Vec<Uuid> = traces.iter().map(|_| Uuid::now_v7()).collect();
        let body = answer(&ids);
        for _ in 0..3 {
            let mut tx = s.writer.begin().await?;
            // Claims the key with its final answer. A concurrent request with the
            // same key blocks here on the primary key until the first commits
            // (then nothing is inserted: replay) or rolls back (then this one runs).
            // A row without an answer can only be left by an older combee that
            // remembered keys before storing: it is taken over.
            let claimed = sqlx::query(
                "INSERT INTO idempotency_keys (owner, key, request_hash, status_code, body) VALUES ($1, $2, $3, $4, $5)
                 ON CONFLICT (owner, key) DO UPDATE
                   SET request_hash = EXCLUDED.request_hash, status_code = EXCLUDED.status_code,
                       body = EXCLUDED.body, created_at = now()
                   WHERE idempotency_keys.status_code IS NULL",
            )
            .bind(key.owner)
            .bind(key.key)
            .bind(key.request_hash)
            .bind(i32::from(status))
            .bind(&body)
            .execute(&mut *tx)
            .await?
            .rows_affected();
            if claimed == 1 {
                if insert_trace_rows(&mut *tx, traces, &ids).await? != traces.len() as u64 {
                    tx.rollback().await?;
                    return Err(s.first_unknown_reference(traces).await?);
                }
                tx.commit().await?;
                return Ok(IdempotentIngest::Stored { ids, status, body });
            }
            let row = sqlx::query(
                "SELECT request_hash, status_code, body FROM idempotency_keys WHERE owner = $1 AND key = $2",
            )
            .bind(key.owner)
            .bind(key.key)
            .fetch_optional(&mut *tx)
            .await?;
            tx.rollback().await?;
            let Some(row) = row else {
                continue; // purged meanwhile: claim it again
            };
            if row.try_get::<String, _>("request_hash")? != key.request_hash {
                return Ok(IdempotentIngest::Mismatch);
            }
            let status: Option<i32> = row.try_get("status_code")?;
            let body: Option<Vec<u8>> = row.try_get("body")?;
            let status = status.and_then(|s| u16::try_from(s).ok()).ok_or_else(|| corrupt("idempotency status"))?;
            return Ok(IdempotentIngest::Replay { status, body: body.unwrap_or_default() });
        }
        Err(StoreError::Conflict)
    }

    async fn idempotency_purge(s: &SqlStore<Self>, older_than: DateTime<Utc>) -> StoreResult<u64> {
        Ok(sqlx::query("DELETE FROM idempotency_keys WHERE created_at < $1")
            .bind(older_than)
            .execute(&s.writer)
            .await?
            .rows_affected())
    }

    async fn open_round(s: &SqlStore<Self>, req: &OpenRound) -> StoreResult<Option<Round>> {
        let mut tx = s.writer.begin().await?;
        // First, so a duplicate delivery is told so (not "a round is in flight":
        // its own round). A concurrent duplicate waits here on the primary key;
        // every refusal below rolls back, forgetting the id.
        if let Some(hook) = &req.inbound_webhook_id {
            let n = sqlx::query("INSERT INTO inbound_webhooks (id) VALUES ($1) ON CONFLICT DO NOTHING")
                .bind(hook)
                .execute(&mut *tx)
                .await?
                .rows_affected();
            if n == 0 {
                return Err(StoreError::Duplicate);
            }
        }
        // The prompt row lock serialises round creation per prompt.
        let row = sqlx::query("SELECT id, strategy, settings FROM prompts WHERE name = $1 FOR UPDATE")
            .bind(req.prompt.as_str())
            .fetch_optional(&mut *tx)
            .await?
            .ok_or(StoreError::NotFound)?;
        let prompt_id: Uuid = row.try_get("id")?;
        let strategy: String = row.try_get("strategy")?;
        let settings: crate::domain::PromptSettings =
            serde_json::from_value(row.try_get("settings")?).map_err(|_| corrupt("settings"))?;
        let active: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM rounds WHERE prompt_id = $1 AND status IN ('queued', 'running'))",
        )
        .bind(prompt_id)
        .fetch_one(&mut *tx)
        .await?;
        if active {
            return Err(StoreError::AlreadyExists);
        }
        let ids: Vec<Uuid> = sqlx::query_scalar(
            "SELECT id FROM traces WHERE prompt_id = $1 AND status = 'pending' AND round_id IS NULL AND quarantined_at IS NULL
             ORDER BY id LIMIT $2 FOR UPDATE SKIP LOCKED",
        )
        .bind(prompt_id)
        .bind(i64::from(req.batch))
        .fetch_all(&mut *tx)
        .await?;
        if ids.is_empty() || (ids.len() as u32) < req.min_traces {
            return Ok(None);
        }
        let base: i64 = sqlx::query_scalar(
            "SELECT COALESCE((SELECT version FROM labels WHERE prompt_id = $1 AND name = 'production'),
                             (SELECT version_count FROM prompts WHERE id = $1))",
        )
        .bind(prompt_id)
        .fetch_one(&mut *tx)
        .await?;
        let id = Uuid::now_v7();
        sqlx::query(
            "INSERT INTO rounds (id, prompt_id, status, trigger, method, strategy, seed, duplication, n, base_version)
             VALUES ($1, $2, 'queued', $3, $4, $5, $6, $7, $8, $9)",
        )
        .bind(id)
        .bind(prompt_id)
        .bind(req.trigger.as_str())
        .bind(round::method_str(req.method))
        .bind(&strategy)
        .bind(req.seed)
        .bind(settings.duplication as i32)
        .bind(ids.len() as i32)
        .bind(base)
        .execute(&mut *tx)
        .await?;
        sqlx::query(
            "INSERT INTO round_traces (round_id, trace_id, position)
             SELECT $1, t.id, t.ord FROM unnest($2::uuid[]) WITH ORDINALITY AS t(id, ord)",
        )
        .bind(id)
        .bind(&ids)
        .execute(&mut *tx)
        .await?;
        sqlx::query("UPDATE traces SET round_id = $1, updated_at = now() WHERE id = ANY($2)")
            .bind(id)
            .bind(&ids)
            .execute(&mut *tx)
            .await?;
        notify(&mut tx, "round").await?;
        tx.commit().await?;
        s.load_round(id).await
    }

    async fn backlogs(s: &SqlStore<Self>) -> StoreResult<Vec<Backlog>> {
        let rows = sqlx::query(
            "SELECT p.id, p.name, p.strategy, p.promotion, p.settings, p.created_at, p.created_by,
                    (SELECT count(*) FROM traces t WHERE t.prompt_id = p.id AND t.status = 'pending' AND t.round_id IS NULL AND t.quarantined_at IS NULL) AS pending,
                    (SELECT min(t.created_at) FROM traces t WHERE t.prompt_id = p.id AND t.status = 'pending' AND t.round_id IS NULL AND t.quarantined_at IS NULL) AS oldest,
                    EXISTS (SELECT 1 FROM rounds r WHERE r.prompt_id = p.id AND r.status IN ('queued', 'running')) AS active
             FROM prompts p ORDER BY p.name",
        )
        .fetch_all(&s.writer)
        .await?;
        rows.iter()
            .map(|r| {
                Ok(Backlog {
                    prompt: prompt_from_row::<Postgres>(r)?,
                    pending: r.try_get("pending")?,
                    oldest: r.try_get("oldest")?,
                    active_round: r.try_get("active")?,
                })
            })
            .collect()
    }

    async fn claim_round(s: &SqlStore<Self>, owner: &str, lease: Duration) -> StoreResult<Option<ClaimedRound>> {
        let id: Option<Uuid> = sqlx::query_scalar(
            "WITH c AS (
                 SELECT id FROM rounds
                 WHERE (status = 'queued' AND not_before <= now()) OR (status = 'running' AND lease_expires_at < now())
                 ORDER BY created_at FOR UPDATE SKIP LOCKED LIMIT 1)
             UPDATE rounds r SET status = 'running', attempt = r.attempt + 1, lease_owner = $1,
                    lease_expires_at = now() + make_interval(secs => $2), started_at = COALESCE(r.started_at, now()),
                    updated_at = now()
             FROM c WHERE r.id = c.id RETURNING r.id",
        )
        .bind(owner)
        .bind(lease.as_secs_f64())
        .fetch_optional(&s.writer)
        .await?;
        let Some(id) = id else { return Ok(None) };
        let round = s.load_round(id).await?.ok_or(StoreError::NotFound)?;
        let prompt = s.get_prompt(&round.prompt).await?.ok_or(StoreError::NotFound)?;
        let base = s
            .resolve(&round.prompt, &Selector::Version(round.base_version))
            .await?
            .ok_or_else(|| corrupt("round base version"))?
            .version;
        let traces = sqlx::query(&format!(
            "SELECT {TRACE_COLUMNS} FROM round_traces rt JOIN traces t ON t.id = rt.trace_id
             JOIN prompts p ON p.id = t.prompt_id WHERE rt.round_id = $1 ORDER BY rt.position"
        ))
        .bind(id)
        .fetch_all(&s.writer)
        .await?
        .iter()
        .map(trace_from_row::<Postgres>)
        .collect::<StoreResult<Vec<_>>>()?;
        Ok(Some(ClaimedRound { round, prompt, base, traces }))
    }

    async fn heartbeat_round(s: &SqlStore<Self>, round: Uuid, attempt: i32, lease: Duration) -> StoreResult<bool> {
        let n = sqlx::query(
            "UPDATE rounds SET lease_expires_at = now() + make_interval(secs => $3), updated_at = now()
             WHERE id = $1 AND attempt = $2 AND status = 'running'",
        )
        .bind(round)
        .bind(attempt)
        .bind(lease.as_secs_f64())
        .execute(&s.writer)
        .await?
        .rows_affected();
        Ok(n == 1)
    }

    async fn adopt_reflections(s: &SqlStore<Self>, round: Uuid) -> StoreResult<u64> {
        Ok(sqlx::query(
            "INSERT INTO reflections (round_id, trace_id, reflection, from_trace)
             SELECT DISTINCT ON (r.trace_id) cur.id, r.trace_id, r.reflection, r.from_trace
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
        .execute(&s.writer)
        .await?
        .rows_affected())
    }

    async fn save_reflection(
        s: &SqlStore<Self>,
        round: Uuid,
        trace: Uuid,
        r: &Reflection,
        from_trace: bool,
    ) -> StoreResult<()> {
        sqlx::query(
            "INSERT INTO reflections (round_id, trace_id, reflection, from_trace) VALUES ($1, $2, $3, $4)
             ON CONFLICT DO NOTHING",
        )
        .bind(round)
        .bind(trace)
        .bind(serde_json::to_value(r).map_err(|_| corrupt("reflection"))?)
        .bind(from_trace)
        .execute(&s.writer)
        .await?;
        Ok(())
    }

    async fn record_llm_call(s: &SqlStore<Self>, round: Uuid, attempt: i32, call: &LlmCall) -> StoreResult<()> {
        sqlx::query(
            "INSERT INTO llm_calls (round_id, attempt, role, model, prompt_tokens, completion_tokens, cost_usd, latency_ms, retries, error)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
        )
        .bind(round)
        .bind(attempt)
        .bind(serde_json::to_value(call.role).ok().and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_default())
        .bind(&call.model)
        .bind(call.prompt_tokens as i64)
        .bind(call.completion_tokens as i64)
        .bind(call.cost_usd)
        .bind(call.latency_ms as i64)
        .bind(call.retries as i32)
        .bind(&call.error)
        .execute(&s.writer)
        .await?;
        Ok(())
    }

    async fn round_calls(s: &SqlStore<Self>, round: Uuid) -> StoreResult<Vec<RoundCall>> {
        sqlx::query(
            "SELECT attempt, role, model, prompt_tokens, completion_tokens, cost_usd, latency_ms, retries, error, created_at
             FROM llm_calls WHERE round_id = $1 ORDER BY id",
        )
        .bind(round)
        .fetch_all(&s.writer)
        .await?
        .iter()
        .map(|row| {
            let role: String = row.try_get("role")?;
            Ok(RoundCall {
                attempt: row.try_get("attempt")?,
                call: LlmCall {
                    role: serde_json::from_value(Value::String(role)).map_err(|_| corrupt("llm role"))?,
                    model: row.try_get("model")?,
                    prompt_tokens: row.try_get::<i64, _>("prompt_tokens")? as u64,
                    completion_tokens: row.try_get::<i64, _>("completion_tokens")? as u64,
                    cost_usd: row.try_get("cost_usd")?,
                    latency_ms: row.try_get::<i64, _>("latency_ms")? as u64,
                    retries: row.try_get::<i32, _>("retries")? as u32,
                    error: row.try_get("error")?,
                },
                created_at: row.try_get("created_at")?,
            })
        })
        .collect()
    }

    async fn update_round(
        s: &SqlStore<Self>,
        round: Uuid,
        attempt: i32,
        k: Option<i32>,
        detail: &Value,
    ) -> StoreResult<bool> {
        let n = sqlx::query(
            "UPDATE rounds SET k = COALESCE($3, k), detail = $4, updated_at = now()
             WHERE id = $1 AND attempt = $2 AND status = 'running'",
        )
        .bind(round)
        .bind(attempt)
        .bind(k)
        .bind(detail)
        .execute(&s.writer)
        .await?
        .rows_affected();
        Ok(n == 1)
    }

    // One fenced transaction needs all of these; a wrapper struct would only rename them.
    #[allow(clippy::too_many_arguments)]
    async fn publish_round(
        s: &SqlStore<Self>,
        round: Uuid,
        attempt: i32,
        v: NewVersion,
        label: LabelName,
        detail: &Value,
        sample_secs: Option<f64>,
        charges: &TraceCharges,
    ) -> StoreResult<Version> {
        let mut tx = s.writer.begin().await?;
        let (prompt_id, name) = fence::<Postgres>(&mut *tx, round, attempt).await?;
        if let Some(secs) = sample_secs.filter(|s| *s > 0.0) {
            sqlx::query(
                "INSERT INTO controller_samples (prompt_id, round_id, batch_size, round_secs)
                 SELECT prompt_id, id, n, $2 FROM rounds WHERE id = $1",
            )
            .bind(round)
            .bind(secs)
            .execute(&mut *tx)
            .await?;
        }
        let number: i64 = sqlx::query_scalar(
            "UPDATE prompts SET version_count = version_count + 1 WHERE id = $1 RETURNING version_count",
        )
        .bind(prompt_id)
        .fetch_one(&mut *tx)
        .await?;
        let created_at = now();
        insert_version::<Postgres>(&mut *tx, prompt_id, number, &v, created_at).await?;
        let mv = LabelMove {
            label: label.clone(),
            to_version: number,
            expected_current: None,
            check_current: false,
            by: v.created_by.clone(),
        };
        let (moved, previous) = apply_move::<Postgres>(&mut *tx, prompt_id, &mv).await?;
        charge_traces::<Postgres>(&mut *tx, round, charges).await?;
        sqlx::query(
            "UPDATE traces SET status = 'consumed', updated_at = now() WHERE round_id = $1 AND status = 'pending'
               AND EXISTS (SELECT 1 FROM reflections r WHERE r.round_id = $1 AND r.trace_id = traces.id)",
        )
        .bind(round)
        .execute(&mut *tx)
        .await?;
        release_traces::<Postgres>(&mut *tx, round).await?;
        sqlx::query(
            "UPDATE rounds SET status = 'succeeded', result_version = $2, detail = $3, error = NULL, finished_at = now(),
                    lease_owner = NULL, lease_expires_at = NULL, updated_at = now() WHERE id = $1",
        )
        .bind(round)
        .bind(number)
        .bind(detail)
        .execute(&mut *tx)
        .await?;
        let version = v.into_version(PromptName::parse(&name).map_err(|_| corrupt("prompt name"))?, number, created_at);
        record_event::<Postgres>(&mut *tx, &OutboxEvent::version_created(&version, &[label.as_str()])).await?;
        let cause = MoveCause::new(LabelMoveKind::AutoPublish, format!("round {round} published v{number}"))
            .with_evidence(serde_json::json!({ "round_id": round }));
        record_move::<Postgres>(&mut *tx, prompt_id, &version.prompt, &moved, previous, &cause).await?;
        record_event::<Postgres>(&mut *tx, &OutboxEvent::round_completed(&version.prompt, round, number, &label))
            .await?;
        notify(&mut tx, &format!("prompt:{name}")).await?;
        tx.commit().await?;
        Ok(version)
    }

    async fn fail_round(
        s: &SqlStore<Self>,
        round: Uuid,
        attempt: i32,
        error: &str,
        how: RoundFailure,
    ) -> StoreResult<()> {
        let mut tx = s.writer.begin().await?;
        let (_, name) = fence::<Postgres>(&mut *tx, round, attempt).await?;
        match how {
            RoundFailure::Retry { after } => {
                sqlx::query(
                    "UPDATE rounds SET status = 'queued', lease_owner = NULL, lease_expires_at = NULL, error = $2,
                            not_before = now() + make_interval(secs => $3), updated_at = now() WHERE id = $1",
                )
                .bind(round)
                .bind(error)
                .bind(after.as_secs_f64())
                .execute(&mut *tx)
                .await?;
                notify(&mut tx, "round").await?;
            }
            RoundFailure::GiveUp { charges } => {
                charge_traces::<Postgres>(&mut *tx, round, &charges).await?;
                release_traces::<Postgres>(&mut *tx, round).await?;
                sqlx::query(
                    "UPDATE rounds SET status = 'failed', error = $2, finished_at = now(), lease_owner = NULL,
                            lease_expires_at = NULL, updated_at = now() WHERE id = $1",
                )
                .bind(round)
                .bind(error)
                .execute(&mut *tx)
                .await?;
                record_event::<Postgres>(&mut *tx, &OutboxEvent::round_failed(&name, round, attempt, error)).await?;
            }
        }
        tx.commit().await?;
        Ok(())
    }

    async fn webhook_attempts(
        s: &SqlStore<Self>,
        id: Uuid,
        before: Option<i64>,
        limit: u32,
    ) -> StoreResult<Vec<DeliveryAttempt>> {
        sqlx::query(
            "SELECT a.id, a.delivery_id, d.event_id, e.type, a.attempt, a.status_code, a.error, a.latency_ms,
                    a.created_at, a.next_attempt_at, d.status
             FROM webhook_attempts a JOIN webhook_deliveries d ON d.id = a.delivery_id
             JOIN webhook_events e ON e.id = d.event_id
             WHERE a.subscription_id = $1 AND ($2::bigint IS NULL OR a.id < $2) ORDER BY a.id DESC LIMIT $3",
        )
        .bind(id)
        .bind(before)
        .bind(i64::from(limit))
        .fetch_all(&s.writer)
        .await?
        .iter()
        .map(|r| {
            Ok(DeliveryAttempt {
                seq: r.try_get("id")?,
                delivery_id: r.try_get("delivery_id")?,
                event_id: r.try_get("event_id")?,
                event_type: r.try_get("type")?,
                attempt: r.try_get("attempt")?,
                status_code: r.try_get::<Option<i32>, _>("status_code")?.map(|c| c as u16),
                error: r.try_get("error")?,
                latency_ms: r.try_get::<i64, _>("latency_ms")?.max(0) as u64,
                attempted_at: r.try_get("created_at")?,
                next_attempt_at: r.try_get("next_attempt_at")?,
                delivery_status: r.try_get("status")?,
            })
        })
        .collect()
    }

    async fn claim_deliveries(
        s: &SqlStore<Self>,
        owner: &str,
        lease: Duration,
        limit: u32,
    ) -> StoreResult<Vec<ClaimedDelivery>> {
        // The lease is the due time itself: a crashed attempt becomes due again when it expires.
        sqlx::query(
            "WITH c AS (
                 SELECT d.id FROM webhook_deliveries d
                 JOIN webhook_subscriptions s ON s.id = d.subscription_id AND s.enabled
                 WHERE d.status = 'pending' AND d.next_attempt_at <= now()
                 ORDER BY d.next_attempt_at FOR UPDATE OF d SKIP LOCKED LIMIT $3)
             UPDATE webhook_deliveries d SET attempts = d.attempts + 1, lease_owner = $1,
                    next_attempt_at = now() + make_interval(secs => $2), updated_at = now()
             FROM c, webhook_events e, webhook_subscriptions s
             WHERE d.id = c.id AND e.id = d.event_id AND s.id = d.subscription_id
             RETURNING d.id, d.subscription_id, d.event_id, e.type, e.body, s.url, s.secret, d.attempts",
        )
        .bind(owner)
        .bind(lease.as_secs_f64())
        .bind(i64::from(limit))
        .fetch_all(&s.writer)
        .await?
        .iter()
        .map(|r| {
            Ok(ClaimedDelivery {
                id: r.try_get("id")?,
                subscription_id: r.try_get("subscription_id")?,
                event_id: r.try_get("event_id")?,
                event_type: r.try_get("type")?,
                body: r.try_get("body")?,
                url: r.try_get("url")?,
                secret: Secret::new(r.try_get::<String, _>("secret")?),
                attempt: r.try_get("attempts")?,
            })
        })
        .collect()
    }

    async fn finish_delivery(s: &SqlStore<Self>, d: &ClaimedDelivery, rec: &AttemptRecord) -> StoreResult<bool> {
        let mut tx = s.writer.begin().await?;
        let (status, next_at) = match &rec.outcome {
            DeliveryOutcome::Succeeded => ("succeeded", None),
            DeliveryOutcome::Retry { at } => ("pending", Some(*at)),
            DeliveryOutcome::GiveUp | DeliveryOutcome::Gone => ("failed", None),
        };
        let n = sqlx::query(
            "UPDATE webhook_deliveries SET status = $3, next_attempt_at = COALESCE($4, next_attempt_at),
                    last_error = $5, lease_owner = NULL, updated_at = now()
             WHERE id = $1 AND attempts = $2 AND status = 'pending'",
        )
        .bind(d.id)
        .bind(d.attempt)
        .bind(status)
        .bind(next_at)
        .bind(&rec.error)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if n == 0 {
            return Ok(false);
        }
        sqlx::query(
            "INSERT INTO webhook_attempts (delivery_id, subscription_id, attempt, status_code, error, latency_ms, next_attempt_at)
             VALUES ($1, $2, $3, $4, $5, $6, $7)",
        )
        .bind(d.id)
        .bind(d.subscription_id)
        .bind(d.attempt)
        .bind(rec.status_code.map(i32::from))
        .bind(&rec.error)
        .bind(rec.latency_ms.min(i64::MAX as u64) as i64)
        .bind(next_at)
        .execute(&mut *tx)
        .await?;
        if rec.outcome == DeliveryOutcome::Gone {
            sqlx::query(
                "UPDATE webhook_subscriptions SET enabled = false, updated_at = now(),
                        disabled_reason = 'the receiver answered 410 Gone' WHERE id = $1",
            )
            .bind(d.subscription_id)
            .execute(&mut *tx)
            .await?;
            sqlx::query(
                "UPDATE webhook_deliveries SET status = 'failed', last_error = 'subscription disabled', updated_at = now()
                 WHERE subscription_id = $1 AND status = 'pending'",
            )
            .bind(d.subscription_id)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(true)
    }

    async fn controller_samples(
        s: &SqlStore<Self>,
        prompt: &PromptName,
        limit: u32,
    ) -> StoreResult<Vec<super::ControllerSample>> {
        let mut rows = sqlx::query(
            "SELECT s.batch_size, s.round_secs, s.round_id, s.created_at FROM controller_samples s
             JOIN prompts p ON p.id = s.prompt_id WHERE p.name = $1 ORDER BY s.id DESC LIMIT $2",
        )
        .bind(prompt.as_str())
        .bind(i64::from(limit))
        .fetch_all(&s.writer)
        .await?
        .iter()
        .map(|r| {
            Ok(super::ControllerSample {
                batch_size: r.try_get::<i32, _>("batch_size")? as u32,
                round_secs: r.try_get("round_secs")?,
                round_id: r.try_get("round_id")?,
                created_at: r.try_get("created_at")?,
            })
        })
        .collect::<StoreResult<Vec<_>>>()?;
        rows.reverse();
        Ok(rows)
    }

    async fn save_controller_choice(s: &SqlStore<Self>, prompt: &PromptName, choice: &Value) -> StoreResult<()> {
        sqlx::query(
            "INSERT INTO controller_choices (prompt_id, choice) SELECT id, $2 FROM prompts WHERE name = $1
             ON CONFLICT (prompt_id) DO UPDATE SET choice = EXCLUDED.choice, updated_at = now()",
        )
        .bind(prompt.as_str())
        .bind(choice)
        .execute(&s.writer)
        .await?;
        Ok(())
    }

    async fn record_meter_counts(
        s: &SqlStore<Self>,
        prompt: &PromptName,
        round: Uuid,
        counts: &[super::MeterCounts],
    ) -> StoreResult<()> {
        let mut tx = s.writer.begin().await?;
        for c in counts {
            sqlx::query(
                "INSERT INTO meter_counts (round_id, prompt_id, size_min, marked, recaptured)
                 SELECT $2, id, $3, $4, $5 FROM prompts WHERE name = $1
                 ON CONFLICT (round_id, size_min) DO NOTHING",
            )
            .bind(prompt.as_str())
            .bind(round)
            .bind(i32::try_from(c.size_min).unwrap_or(i32::MAX))
            .bind(i64::try_from(c.marked).unwrap_or(i64::MAX))
            .bind(i64::try_from(c.recaptured).unwrap_or(i64::MAX))
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    async fn meter_counts(s: &SqlStore<Self>, prompt: &PromptName) -> StoreResult<Vec<super::MeterCounts>> {
        sqlx::query(
            "SELECT m.size_min, SUM(m.marked)::bigint AS marked, SUM(m.recaptured)::bigint AS recaptured,
                    COUNT(*)::bigint AS rounds
             FROM meter_counts m JOIN prompts p ON p.id = m.prompt_id WHERE p.name = $1
             GROUP BY m.size_min ORDER BY m.size_min",
        )
        .bind(prompt.as_str())
        .fetch_all(&s.writer)
        .await?
        .iter()
        .map(|r| {
            Ok(super::MeterCounts {
                size_min: r.try_get::<i32, _>("size_min")? as u32,
                marked: r.try_get::<i64, _>("marked")? as u64,
                recaptured: r.try_get::<i64, _>("recaptured")? as u64,
                rounds: r.try_get::<i64, _>("rounds")? as u64,
            })
        })
        .collect()
    }
}

impl SqlStore<Postgres> {
    async fn load_round(&self, id: Uuid) -> StoreResult<Option<Round>> {
        sqlx::query(&format!(
            "SELECT {ROUND_COLUMNS} FROM rounds r JOIN prompts p ON p.id = r.prompt_id WHERE r.id = $1"
        ))
        .bind(id)
        .fetch_optional(&self.writer)
        .await?
        .as_ref()
        .map(round_from_row::<Postgres>)
        .transpose()
    }

    /// Explains why a batch did not fully insert: the first trace whose prompt
    /// or version does not exist.
    async fn first_unknown_reference(&self, traces: &[ValidTrace]) -> StoreResult<StoreError> {
        for (i, t) in traces.iter().enumerate() {
            let count: Option<i64> = sqlx::query_scalar("SELECT version_count FROM prompts WHERE name = $1")
                .bind(t.prompt.as_str())
                .fetch_optional(&self.writer)
                .await?;
            match (count, t.prompt_version) {
                (None, _) => {
                    return Ok(StoreError::Invalid(format!("traces[{i}]: unknown prompt {:?}", t.prompt.as_str())));
                }
                (Some(c), Some(v)) if v > c => {
                    return Ok(StoreError::Invalid(format!(
                        "traces[{i}]: prompt {:?} has no version {v}",
                        t.prompt.as_str()
                    )));
                }
                _ => {}
            }
        }
        Ok(StoreError::Invalid("a referenced prompt changed during the request; retry".into()))
    }
}

/// Locks trace `id` for an operator action (`delete` or quarantine); the
/// answer to give instead when it is missing or in a state that refuses it.
async fn lock_for_action(
    tx: &mut Transaction<'_, Postgres>,
    id: Uuid,
    delete: bool,
) -> StoreResult<Option<TraceAction>> {
    let Some(row) = sqlx::query("SELECT status, round_id FROM traces WHERE id = $1 FOR UPDATE")
        .bind(id)
        .fetch_optional(&mut **tx)
        .await?
    else {
        return Ok(Some(TraceAction::NotFound));
    };
    Ok(trace_action_refusal(delete, row.try_get("status")?, row.try_get("round_id")?).map(TraceAction::Refused))
}

/// Stores new spans of `otel_trace_id`, attached to `trace` or held (`None`).
async fn insert_otlp_spans(
    tx: &mut Transaction<'_, Postgres>,
    otel_trace_id: &str,
    trace: Option<Uuid>,
    spans: &[&OtlpSpan],
) -> StoreResult<()> {
    let ids: Vec<&str> = spans.iter().map(|s| s.span_id.as_str()).collect();
    let bodies: Vec<&[u8]> = spans.iter().map(|s| s.body.as_slice()).collect();
    sqlx::query(
        "INSERT INTO otlp_spans (otel_trace_id, span_id, trace_id, body)
         SELECT $1, u.span_id, $2, u.body FROM unnest($3::text[], $4::bytea[]) AS u(span_id, body)",
    )
    .bind(otel_trace_id)
    .bind(trace)
    .bind(&ids)
    .bind(&bodies)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// One row of the outcome aggregate query.
fn outcome_bucket_from_row(row: &PgRow) -> StoreResult<OutcomeBucket> {
    let count = |c: &str| -> StoreResult<u64> { Ok(u64::try_from(row.try_get::<i64, _>(c)?).unwrap_or(0)) };
    let moments = |p: &str| -> StoreResult<Moments> {
        Ok(Moments {
            count: count(&format!("{p}_n"))?,
            sum: row.try_get(format!("{p}_sum").as_str())?,
            sum_sq: row.try_get(format!("{p}_sq").as_str())?,
        })
    };
    Ok(OutcomeBucket {
        version: row.try_get("version")?,
        start: row.try_get("start")?,
        traces: count("traces")?,
        with_feedback: count("with_feedback")?,
        success_trials: count("success_trials")?,
        successes: count("successes")?,
        score: moments("score")?,
        tokens: moments("tokens")?,
        cost_usd: moments("cost")?,
        latency_ms: moments("latency")?,
    })
}
