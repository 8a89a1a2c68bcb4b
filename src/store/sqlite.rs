//! The embedded store: SQLite in WAL mode, for a single combee process with no
//! database server. Writes go through one dedicated connection, so concurrent
//! writers queue in-process instead of failing with `SQLITE_BUSY`; reads use a
//! separate pool. Changes are announced on an in-process broadcast after commit.

use std::{path::Path, str::FromStr, time::Duration};

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use futures_util::future::BoxFuture;
use serde_json::Value;
use sqlx::{
    Row, Sqlite, SqliteConnection, Transaction,
    sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteRow, SqliteSynchronous},
};
use tokio::sync::broadcast;
use uuid::Uuid;

use crate::evaluate::{
    outcomes::{COST_KEY, LATENCY_KEY, MAX_ABS_VALUE, OutcomeBucket, TOKENS_KEY},
    stats::Moments,
};

use super::backend::{Backend, SqlStore};
use super::sql::{
    Dialect, Param, Query, ROUND_COLUMNS, TRACE_COLUMNS, VERSION_COLUMNS, apply_move, charge_traces, corrupt, fence,
    insert_version, prompt_from_row, prompt_id, record_event, record_history, record_move, release_traces,
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

pub type SqliteStore = SqlStore<Sqlite>;

/// Makes the per-request "did any process revoke a key?" check cheap. Every
/// commit, by any process, rewrites the WAL index header at the start of the
/// `-shm` file (its change counter, frame count and salts; see
/// <https://sqlite.org/walformat.html>). While those bytes are unchanged no
/// transaction has committed, so the key generation read under them still
/// holds and no query is needed; when they changed, or cannot be read, the
/// generation is read from the table again.
pub struct KeyGenerationCache {
    shm: Option<std::fs::File>,
    seen: std::sync::Mutex<Option<(WalIndexHeader, i64)>>,
}

/// The first copy of the WAL index header.
type WalIndexHeader = [u8; 48];

impl KeyGenerationCache {
    fn open(db: &Path) -> Self {
        let mut shm = db.as_os_str().to_owned();
        shm.push("-shm");
        Self { shm: std::fs::File::open(shm).ok(), seen: std::sync::Mutex::new(None) }
    }

    fn header(&self) -> Option<WalIndexHeader> {
        use std::os::unix::fs::FileExt;
        let mut buf = [0u8; 48];
        self.shm.as_ref()?.read_exact_at(&mut buf, 0).ok()?;
        Some(buf)
    }

    fn lookup(&self, header: &WalIndexHeader) -> Option<i64> {
        match *self.seen.lock().unwrap_or_else(|e| e.into_inner()) {
            Some((seen, generation)) if seen == *header => Some(generation),
            _ => None,
        }
    }

    fn remember(&self, header: WalIndexHeader, generation: i64) {
        *self.seen.lock().unwrap_or_else(|e| e.into_inner()) = Some((header, generation));
    }
}

/// SQLite keeps ids as text, times as integer microseconds and JSON as text.
impl Dialect for Sqlite {
    fn bind<'q>(q: Query<'q, Self>, p: Param<'q>) -> Query<'q, Self> {
        match p {
            Param::Int(v) => q.bind(v),
            Param::Int32(v) => q.bind(v),
            Param::Real(v) => q.bind(v),
            Param::Bool(v) => q.bind(v),
            Param::Text(v) => q.bind(v),
            Param::Id(v) => q.bind(v.map(|u| u.to_string())),
            Param::At(v) => q.bind(v.map(|t| t.timestamp_micros())),
            Param::Json(v) => q.bind(v.map(|j| j.to_string())),
        }
    }
    fn execute<'c, 'q: 'c>(q: Query<'q, Self>, c: &'c mut SqliteConnection) -> BoxFuture<'c, sqlx::Result<u64>> {
        Box::pin(async move { Ok(q.execute(c).await?.rows_affected()) })
    }
    fn fetch_all<'c, 'q: 'c>(
        q: Query<'q, Self>,
        c: &'c mut SqliteConnection,
    ) -> BoxFuture<'c, sqlx::Result<Vec<SqliteRow>>> {
        Box::pin(q.fetch_all(c))
    }
    fn fetch_optional<'c, 'q: 'c>(
        q: Query<'q, Self>,
        c: &'c mut SqliteConnection,
    ) -> BoxFuture<'c, sqlx::Result<Option<SqliteRow>>> {
        Box::pin(q.fetch_optional(c))
    }
    fn get_i64(row: &SqliteRow, col: &str) -> StoreResult<Option<i64>> {
        Ok(row.try_get(col)?)
    }
    fn get_i32(row: &SqliteRow, col: &str) -> StoreResult<Option<i32>> {
        Ok(row.try_get(col)?)
    }
    fn get_f64(row: &SqliteRow, col: &str) -> StoreResult<Option<f64>> {
        Ok(row.try_get(col)?)
    }
    fn get_bool(row: &SqliteRow, col: &str) -> StoreResult<Option<bool>> {
        Ok(row.try_get(col)?)
    }
    fn get_text(row: &SqliteRow, col: &str) -> StoreResult<Option<String>> {
        Ok(row.try_get(col)?)
    }
    fn get_id(row: &SqliteRow, col: &str) -> StoreResult<Option<Uuid>> {
        row.try_get::<Option<&str>, _>(col)?.map(uuid).transpose()
    }
    fn get_at(row: &SqliteRow, col: &str) -> StoreResult<Option<DateTime<Utc>>> {
        row.try_get::<Option<i64>, _>(col)?.map(time).transpose()
    }
    fn get_json(row: &SqliteRow, col: &str) -> StoreResult<Option<Value>> {
        row.try_get::<Option<&str>, _>(col)?.map(json).transpose()
    }
    fn lock(_: &'static str) -> &'static str {
        ""
    }
    fn notify<'c>(_: &'c mut SqliteConnection, _: &'c str) -> BoxFuture<'c, StoreResult<()>> {
        Box::pin(async { Ok(()) })
    }
}

fn now_us() -> i64 {
    Utc::now().timestamp_micros()
}

fn time(us: i64) -> StoreResult<DateTime<Utc>> {
    DateTime::from_timestamp_micros(us).ok_or_else(|| corrupt("timestamp"))
}

fn uuid(s: &str) -> StoreResult<Uuid> {
    Uuid::parse_str(s).map_err(|_| corrupt("uuid"))
}

fn json(s: &str) -> StoreResult<Value> {
    serde_json::from_str(s).map_err(|_| corrupt("json"))
}

fn to_json<T: serde::Serialize>(v: &T) -> StoreResult<String> {
    serde_json::to_string(v).map_err(|_| corrupt("json"))
}

/// Inserts a batch of traces inside the caller's transaction; `Invalid` names
/// the first trace whose prompt or version is unknown (roll back then).
async fn insert_trace_rows(tx: &mut Transaction<'_, Sqlite>, traces: &[ValidTrace]) -> StoreResult<Vec<Uuid>> {
    let now = now_us();
    let mut ids = Vec::with_capacity(traces.len());
    for (i, t) in traces.iter().enumerate() {
        let id = Uuid::now_v7();
        let n = sqlx::query(
            "INSERT INTO traces (id, prompt_id, prompt_version, input, trajectory, output, feedback, reflection,
                                 external_id, metadata, created_at, updated_at)
             SELECT ?1, p.id, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?11 FROM prompts p
             WHERE p.name = ?2 AND (?3 IS NULL OR ?3 <= p.version_count)",
        )
        .bind(id.to_string())
        .bind(t.prompt.as_str())
        .bind(t.prompt_version)
        .bind(to_json(&t.input)?)
        .bind(to_json(&t.trajectory)?)
        .bind(to_json(&t.output)?)
        .bind(to_json(&t.feedback)?)
        .bind(t.reflection.as_ref().map(to_json).transpose()?)
        .bind(&t.external_id)
        .bind(to_json(&t.metadata)?)
        .bind(now)
        .execute(&mut **tx)
        .await?
        .rows_affected();
        if n == 0 {
            let known: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM prompts WHERE name = ?)")
                .bind(t.prompt.as_str())
                .fetch_one(&mut **tx)
                .await?;
            let what = if known {
                format!("prompt {:?} has no version {}", t.prompt.as_str(), t.prompt_version.unwrap_or_default())
            } else {
                format!("unknown prompt {:?}", t.prompt.as_str())
            };
            return Err(StoreError::Invalid(format!("traces[{i}]: {what}")));
        }
        ids.push(id);
    }
    Ok(ids)
}

impl SqlStore<Sqlite> {
    pub async fn open(path: &Path, readers: u32, acquire_timeout: Duration) -> StoreResult<Self> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)
                .map_err(|e| StoreError::Invalid(format!("cannot create data directory {}: {e}", dir.display())))?;
        }
        let options = SqliteConnectOptions::from_str(&format!("sqlite://{}", path.display()))
            .map_err(StoreError::Unavailable)?
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Full)
            .foreign_keys(true)
            .busy_timeout(Duration::from_secs(10));
        let writer = SqlitePoolOptions::new()
            .max_connections(1)
            .acquire_timeout(acquire_timeout.max(Duration::from_secs(30)))
            .connect_with(options.clone())
            .await
            .map_err(StoreError::Unavailable)?;
        migrate::sqlite(&writer).await?;
        let reader = SqlitePoolOptions::new()
            .max_connections(readers.max(1))
            .acquire_timeout(acquire_timeout)
            .connect_with(options.read_only(true))
            .await
            .map_err(StoreError::Unavailable)?;
        let (changes, _) = broadcast::channel(1024);
        Ok(Self { writer, reader, changes, extra: KeyGenerationCache::open(path) })
    }
}

fn micros(d: Duration) -> i64 {
    d.as_micros().min(i64::MAX as u128) as i64
}

impl SqlStore<Sqlite> {
    async fn load_round(&self, id: Uuid) -> StoreResult<Option<Round>> {
        sqlx::query(&format!(
            "SELECT {ROUND_COLUMNS} FROM rounds r JOIN prompts p ON p.id = r.prompt_id WHERE r.id = ?"
        ))
        .bind(id.to_string())
        .fetch_optional(&self.reader)
        .await?
        .as_ref()
        .map(round_from_row::<Sqlite>)
        .transpose()
    }
}

fn enum_str<T: serde::Serialize>(v: T) -> String {
    serde_json::to_value(v).ok().and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_default()
}

#[async_trait]
impl Backend for Sqlite {
    const KIND: StoreKind = StoreKind::Sqlite;
    const ANNOUNCE_LOCALLY: bool = true;
    type Extra = KeyGenerationCache;

    async fn ping(s: &SqlStore<Self>) -> StoreResult<()> {
        sqlx::query("SELECT 1").execute(&s.reader).await?;
        Ok(())
    }

    async fn api_key_generation(s: &SqlStore<Self>) -> StoreResult<i64> {
        // The header is read before the query: a commit landing in between
        // changes it, so the next call queries again.
        let header = s.extra.header();
        if let Some(generation) = header.as_ref().and_then(|h| s.extra.lookup(h)) {
            return Ok(generation);
        }
        let generation: i64 =
            sqlx::query_scalar("SELECT generation FROM api_key_generation").fetch_one(&s.reader).await?;
        if let Some(header) = header {
            s.extra.remember(header, generation);
        }
        Ok(generation)
    }

    async fn create_prompt(s: &SqlStore<Self>, p: NewPrompt, first: NewVersion) -> StoreResult<(Prompt, Version)> {
        let id = Uuid::now_v7();
        let now = now_us();
        let mut tx = s.writer.begin().await?;
        sqlx::query(
            "INSERT INTO prompts (id, name, strategy, promotion, settings, version_count, created_at, created_by)
             VALUES (?, ?, ?, ?, ?, 1, ?, ?)",
        )
        .bind(id.to_string())
        .bind(p.name.as_str())
        .bind(enum_str(p.strategy))
        .bind(enum_str(p.promotion))
        .bind(to_json(&p.settings)?)
        .bind(now)
        .bind(&p.created_by)
        .execute(&mut *tx)
        .await?;
        insert_version::<Sqlite>(&mut *tx, id, 1, &first, time(now)?).await?;
        sqlx::query("INSERT INTO labels (prompt_id, name, version, updated_at, updated_by) VALUES (?, ?, 1, ?, ?)")
            .bind(id.to_string())
            .bind(LabelName::PRODUCTION)
            .bind(now)
            .bind(&first.created_by)
            .execute(&mut *tx)
            .await?;
        let created_at = time(now)?;
        let prompt = Prompt {
            id,
            name: p.name.clone(),
            strategy: p.strategy,
            promotion: p.promotion,
            settings: p.settings,
            created_at,
            created_by: p.created_by,
        };
        let version = first.into_version(p.name, 1, created_at);
        let production = LabelName::parse(LabelName::PRODUCTION).map_err(|_| corrupt("label name"))?;
        let mut queued =
            record_event::<Sqlite>(&mut *tx, &OutboxEvent::version_created(&version, &[LabelName::PRODUCTION])).await?;
        queued |= record_event::<Sqlite>(
            &mut *tx,
            &OutboxEvent::label_moved(&prompt.name, &production, 1, None, &version.created_by),
        )
        .await?;
        let cause = MoveCause::new(LabelMoveKind::Create, "prompt created");
        record_history::<Sqlite>(&mut *tx, id, &production, None, Some(1), &version.created_by, &cause).await?;
        tx.commit().await?;
        s.announce(Change::Prompt(prompt.name.to_string()));
        s.announce_outbox(queued);
        Ok((prompt, version))
    }

    async fn update_prompt_settings(
        s: &SqlStore<Self>,
        name: &PromptName,
        expected: &PromptSettings,
        new: &PromptSettings,
    ) -> StoreResult<Option<Prompt>> {
        let mut tx = s.writer.begin().await?;
        let Some(current) = sqlx::query_scalar::<_, String>("SELECT settings FROM prompts WHERE name = ?")
            .bind(name.as_str())
            .fetch_optional(&mut *tx)
            .await?
        else {
            return Ok(None);
        };
        let current: PromptSettings = serde_json::from_str(&current).map_err(|_| corrupt("settings"))?;
        if &current != expected {
            return Err(StoreError::Conflict);
        }
        let row = sqlx::query(
            "UPDATE prompts SET settings = ? WHERE name = ?
             RETURNING id, name, strategy, promotion, settings, created_at, created_by",
        )
        .bind(to_json(new)?)
        .bind(name.as_str())
        .fetch_one(&mut *tx)
        .await?;
        tx.commit().await?;
        prompt_from_row::<Sqlite>(&row).map(Some)
    }

    async fn list_prompts(s: &SqlStore<Self>, after: Option<&str>, limit: u32) -> StoreResult<Vec<PromptSummary>> {
        let rows = sqlx::query(
            "SELECT p.id, p.name, p.strategy, p.promotion, p.settings, p.created_at, p.created_by, p.version_count,
                    (SELECT version FROM labels l WHERE l.prompt_id = p.id AND l.name = 'production') AS production_version,
                    (SELECT count(*) FROM traces t WHERE t.prompt_id = p.id AND t.status = 'pending' AND t.quarantined_at IS NULL) AS pending
             FROM prompts p WHERE (?1 IS NULL OR p.name > ?1) ORDER BY p.name LIMIT ?2",
        )
        .bind(after)
        .bind(i64::from(limit))
        .fetch_all(&s.reader)
        .await?;
        rows.iter()
            .map(|r| {
                Ok(PromptSummary {
                    prompt: prompt_from_row::<Sqlite>(r)?,
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
        let now = now_us();
        let mut tx = s.writer.begin().await?;
        let row = sqlx::query(
            "UPDATE prompts SET version_count = version_count + 1 WHERE name = ? RETURNING id, version_count",
        )
        .bind(prompt.as_str())
        .fetch_optional(&mut *tx)
        .await?
        .ok_or(StoreError::NotFound)?;
        let id = uuid(row.try_get("id")?)?;
        let number: i64 = row.try_get("version_count")?;
        if v.parent.is_some_and(|p| p < 1 || p >= number) {
            return Err(StoreError::Invalid("parent version does not exist".into()));
        }
        insert_version::<Sqlite>(&mut *tx, id, number, &v, time(now)?).await?;
        let mut moved = Vec::with_capacity(moves.len());
        for mv in moves {
            let mv = LabelMove { to_version: if mv.to_version == 0 { number } else { mv.to_version }, ..mv.clone() };
            moved.push(apply_move::<Sqlite>(&mut *tx, id, &mv).await?);
        }
        let version = v.into_version(prompt.clone(), number, time(now)?);
        let on_new: Vec<&str> =
            moved.iter().filter(|(l, _)| l.version == number).map(|(l, _)| l.name.as_str()).collect();
        let mut queued = record_event::<Sqlite>(&mut *tx, &OutboxEvent::version_created(&version, &on_new)).await?;
        let cause = MoveCause::new(version_move_kind(version.source), version.message.clone());
        for (label, previous) in &moved {
            queued |= record_move::<Sqlite>(&mut *tx, id, prompt, label, *previous, &cause).await?;
        }
        tx.commit().await?;
        s.announce(Change::Prompt(prompt.to_string()));
        s.announce_outbox(queued);
        Ok(version)
    }

    async fn resolve(s: &SqlStore<Self>, prompt: &PromptName, selector: &Selector) -> StoreResult<Option<Resolved>> {
        let labels_col = "(SELECT group_concat(l2.name, ',') FROM labels l2
                           WHERE l2.prompt_id = v.prompt_id AND l2.version = v.number) AS labels";
        let row = match selector {
            Selector::Label(label) => {
                sqlx::query(&format!(
                    "SELECT {VERSION_COLUMNS}, {labels_col} FROM labels l
                     JOIN prompts p ON p.id = l.prompt_id
                     JOIN versions v ON v.prompt_id = l.prompt_id AND v.number = l.version
                     WHERE p.name = ? AND l.name = ?"
                ))
                .bind(prompt.as_str())
                .bind(label.as_str())
                .fetch_optional(&s.reader)
                .await?
            }
            Selector::Latest => {
                sqlx::query(&format!(
                    "SELECT {VERSION_COLUMNS}, {labels_col} FROM prompts p
                     JOIN versions v ON v.prompt_id = p.id AND v.number = p.version_count
                     WHERE p.name = ?"
                ))
                .bind(prompt.as_str())
                .fetch_optional(&s.reader)
                .await?
            }
            Selector::Version(n) => {
                sqlx::query(&format!(
                    "SELECT {VERSION_COLUMNS}, {labels_col} FROM prompts p
                     JOIN versions v ON v.prompt_id = p.id AND v.number = ?
                     WHERE p.name = ?"
                ))
                .bind(n)
                .bind(prompt.as_str())
                .fetch_optional(&s.reader)
                .await?
            }
        };
        let Some(row) = row else { return Ok(None) };
        let labels: Option<String> = row.try_get("labels")?;
        let mut labels = labels
            .unwrap_or_default()
            .split(',')
            .filter(|l| !l.is_empty())
            .map(|l| LabelName::parse(l).map_err(|_| corrupt("label name")))
            .collect::<StoreResult<Vec<_>>>()?;
        labels.sort();
        Ok(Some(Resolved { version: version_from_row::<Sqlite>(&row)?, labels }))
    }

    async fn delete_label(s: &SqlStore<Self>, prompt: &PromptName, label: &LabelName, by: &str) -> StoreResult<bool> {
        let mut tx = s.writer.begin().await?;
        let id = prompt_id::<Sqlite>(&mut *tx, prompt).await?;
        let deleted: Option<i64> =
            sqlx::query_scalar("DELETE FROM labels WHERE prompt_id = ? AND name = ? RETURNING version")
                .bind(id.to_string())
                .bind(label.as_str())
                .fetch_optional(&mut *tx)
                .await?;
        if let Some(version) = deleted {
            let cause = MoveCause::new(LabelMoveKind::Delete, "label deleted");
            record_history::<Sqlite>(&mut *tx, id, label, Some(version), None, by, &cause).await?;
        }
        tx.commit().await?;
        s.announce(Change::Prompt(prompt.to_string()));
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
               SELECT t.prompt_version AS version, json_extract(t.metadata, '$.task_key') AS task_key,
                      CASE json_type(t.feedback, '$.success') WHEN 'true' THEN 1.0 WHEN 'false' THEN 0.0
                        ELSE CASE WHEN json_type(t.feedback, '$.score') IN ('integer', 'real')
                                   AND abs(json_extract(t.feedback, '$.score')) <= {MAX_ABS_VALUE}
                             THEN CAST(json_extract(t.feedback, '$.score') AS REAL) END END AS reward
               FROM traces t JOIN prompts p ON p.id = t.prompt_id
               WHERE p.name = ?1 AND t.created_at >= ?2 AND t.created_at < ?3 AND t.quarantined_at IS NULL
                 AND t.prompt_version IS NOT NULL AND json_type(t.metadata, '$.task_key') = 'text')
             SELECT version, task_key, count(reward) AS n, CAST(coalesce(sum(reward), 0) AS REAL) AS total
             FROM r WHERE reward IS NOT NULL GROUP BY version, task_key ORDER BY version, task_key"
        );
        sqlx::query(&sql)
            .bind(prompt.as_str())
            .bind(from.timestamp_micros())
            .bind(until.timestamp_micros())
            .fetch_all(&s.reader)
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
        let id = prompt_id::<Sqlite>(&mut *tx, prompt).await?;
        for arm in arms {
            let exists: Option<i64> =
                sqlx::query_scalar("SELECT number FROM versions WHERE prompt_id = ? AND number = ?")
                    .bind(id.to_string())
                    .bind(arm.version)
                    .fetch_optional(&mut *tx)
                    .await?;
            if exists.is_none() {
                return Err(StoreError::Invalid(format!("version {} does not exist", arm.version)));
            }
            let now = now_us();
            sqlx::query(
                "INSERT INTO population_arms
                    (prompt_id, version, state, mu, sigma, weight, scored_traces, created_from, rated_until, created_at, updated_at)
                 VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
                 ON CONFLICT (prompt_id, version) DO UPDATE SET
                    state = excluded.state, mu = excluded.mu, sigma = excluded.sigma, weight = excluded.weight,
                    scored_traces = excluded.scored_traces, created_from = excluded.created_from,
                    rated_until = excluded.rated_until, updated_at = excluded.updated_at",
            )
            .bind(id.to_string())
            .bind(arm.version)
            .bind(arm.state.as_str())
            .bind(arm.rating.mu)
            .bind(arm.rating.sigma)
            .bind(arm.weight)
            .bind(arm.scored_traces as i64)
            .bind(arm.created_from)
            .bind(arm.rated_until.map(|t| t.timestamp_micros()))
            .bind(now)
            .bind(now)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        s.announce(Change::Prompt(prompt.to_string()));
        Ok(())
    }

    async fn insert_traces(s: &SqlStore<Self>, traces: &[ValidTrace]) -> StoreResult<Vec<Uuid>> {
        let mut tx = s.writer.begin().await?;
        let ids = insert_trace_rows(&mut tx, traces).await?;
        tx.commit().await?;
        Ok(ids)
    }

    async fn list_traces(s: &SqlStore<Self>, f: &TraceFilter, limit: u32) -> StoreResult<Vec<Trace>> {
        sqlx::query(&format!(
            "SELECT {TRACE_COLUMNS} FROM traces t JOIN prompts p ON p.id = t.prompt_id
             WHERE (?1 IS NULL OR p.name = ?1)
               AND (?2 IS NULL OR CASE WHEN ?2 = 'quarantined' THEN t.quarantined_at IS NOT NULL
                                       ELSE t.status = ?2 AND t.quarantined_at IS NULL END)
               AND (?3 IS NULL OR t.created_at >= ?3) AND (?4 IS NULL OR t.created_at < ?4)
               AND (?5 IS NULL OR t.id < ?5)
             ORDER BY t.id DESC LIMIT ?6"
        ))
        .bind(f.prompt.as_ref().map(|p| p.as_str()))
        .bind(f.status.map(|s| s.as_str()))
        .bind(f.since.map(|t| t.timestamp_micros()))
        .bind(f.until.map(|t| t.timestamp_micros()))
        .bind(f.before_id.map(|id| id.to_string()))
        .bind(i64::from(limit))
        .fetch_all(&s.reader)
        .await?
        .iter()
        .map(trace_from_row::<Sqlite>)
        .collect()
    }

    async fn add_feedback(s: &SqlStore<Self>, id: Uuid, feedback: Feedback) -> StoreResult<Option<Trace>> {
        let mut tx = s.writer.begin().await?;
        let Some(current) = sqlx::query_scalar::<_, String>("SELECT feedback FROM traces WHERE id = ?")
            .bind(id.to_string())
            .fetch_optional(&mut *tx)
            .await?
        else {
            return Ok(None);
        };
        let current: Feedback = serde_json::from_str(&current).map_err(|_| corrupt("feedback"))?;
        sqlx::query("UPDATE traces SET feedback = ?, updated_at = ? WHERE id = ?")
            .bind(to_json(&current.merged(feedback))?)
            .bind(now_us())
            .bind(id.to_string())
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
        let num = |col: &str, key: &str| {
            format!(
                "CASE WHEN json_type({col}, '$.{key}') IN ('integer', 'real') \
                       AND abs(json_extract({col}, '$.{key}')) <= {MAX_ABS_VALUE} \
                  THEN CAST(json_extract({col}, '$.{key}') AS REAL) END"
            )
        };
        let sql = format!(
            "WITH v AS (
               SELECT t.prompt_version AS version,
                      (t.created_at / (?4 * 1000000)) * ?4 AS start,
                      CASE json_type(t.feedback, '$.success') WHEN 'true' THEN 1 WHEN 'false' THEN 0 END AS success,
                      (json_type(t.feedback, '$.success') IN ('true', 'false')
                       OR json_type(t.feedback, '$.score') IN ('integer', 'real')) AS rewarded,
                      {score} AS score, {tokens} AS tokens, {cost} AS cost, {latency} AS latency
               FROM traces t JOIN prompts p ON p.id = t.prompt_id
               WHERE p.name = ?1 AND t.created_at >= ?2 AND t.created_at < ?3 AND t.quarantined_at IS NULL)
             SELECT version, start, count(*) AS traces,
                    coalesce(sum(rewarded), 0) AS with_feedback,
                    count(success) AS success_trials, coalesce(sum(success), 0) AS successes,
                    {aggs}
             FROM v GROUP BY version, start",
            score = num("t.feedback", "score"),
            tokens = num("t.metadata", TOKENS_KEY),
            cost = num("t.metadata", COST_KEY),
            latency = num("t.metadata", LATENCY_KEY),
            aggs = ["score", "tokens", "cost", "latency"]
                .map(|c| format!(
                    "count({c}) AS {c}_n, CAST(coalesce(sum({c}), 0) AS REAL) AS {c}_sum, \
                     CAST(coalesce(sum({c} * {c}), 0) AS REAL) AS {c}_sq"
                ))
                .join(", "),
        );
        sqlx::query(&sql)
            .bind(prompt.as_str())
            .bind(from.timestamp_micros())
            .bind(until.timestamp_micros())
            .bind(bucket_secs)
            .fetch_all(&s.reader)
            .await?
            .iter()
            .map(outcome_bucket_from_row)
            .collect()
    }

    async fn quarantine_trace(s: &SqlStore<Self>, id: Uuid, reason: &str) -> StoreResult<TraceAction> {
        // The single writer connection makes this read-then-write atomic.
        let mut tx = s.writer.begin().await?;
        if let Some(refused) = check_for_action(&mut tx, id, false).await? {
            return Ok(refused);
        }
        let now = now_us();
        sqlx::query(
            "UPDATE traces SET quarantined_at = ?, quarantine_reason = ?, updated_at = ?
             WHERE id = ? AND quarantined_at IS NULL",
        )
        .bind(now)
        .bind(reason)
        .bind(now)
        .bind(id.to_string())
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(TraceAction::found(s.get_trace(id).await?))
    }

    async fn quarantine_traces(s: &SqlStore<Self>, f: &TraceFilter, reason: &str) -> StoreResult<u64> {
        let Some(prompt) = &f.prompt else { return Ok(0) };
        let now = now_us();
        Ok(sqlx::query(
            "UPDATE traces SET quarantined_at = ?1, quarantine_reason = ?2, updated_at = ?1
             WHERE prompt_id = (SELECT id FROM prompts WHERE name = ?3) AND status = 'pending' AND round_id IS NULL
               AND quarantined_at IS NULL
               AND (?4 IS NULL OR created_at >= ?4) AND (?5 IS NULL OR created_at < ?5)",
        )
        .bind(now)
        .bind(reason)
        .bind(prompt.as_str())
        .bind(f.since.map(|t| t.timestamp_micros()))
        .bind(f.until.map(|t| t.timestamp_micros()))
        .execute(&s.writer)
        .await?
        .rows_affected())
    }

    async fn release_trace(s: &SqlStore<Self>, id: Uuid) -> StoreResult<TraceAction> {
        sqlx::query(
            "UPDATE traces SET quarantined_at = NULL, quarantine_reason = NULL, updated_at = ?
             WHERE id = ? AND quarantined_at IS NOT NULL",
        )
        .bind(now_us())
        .bind(id.to_string())
        .execute(&s.writer)
        .await?;
        Ok(TraceAction::found(s.get_trace(id).await?))
    }

    async fn delete_trace(s: &SqlStore<Self>, id: Uuid) -> StoreResult<TraceAction> {
        let Some(trace) = s.get_trace(id).await? else { return Ok(TraceAction::NotFound) };
        let mut tx = s.writer.begin().await?;
        if let Some(refused) = check_for_action(&mut tx, id, true).await? {
            return Ok(refused);
        }
        // Only rounds that ended without publishing can still name it.
        for sql in [
            "DELETE FROM reflections WHERE trace_id = ?",
            "DELETE FROM round_traces WHERE trace_id = ?",
            "DELETE FROM otlp_spans WHERE trace_id = ?",
            "DELETE FROM traces WHERE id = ?",
        ] {
            sqlx::query(sql).bind(id.to_string()).execute(&mut *tx).await?;
        }
        tx.commit().await?;
        Ok(TraceAction::Done(Box::new(trace)))
    }

    async fn merge_otlp_spans(
        s: &SqlStore<Self>,
        otel_trace_id: &str,
        spans: &[OtlpSpan],
        remap: &OtlpRemapFn<'_>,
    ) -> StoreResult<OtlpMerge> {
        // The single writer connection serialises this read-map-write against
        // every other write, exports of the same trace id and rounds included.
        let mut tx = s.writer.begin().await?;
        let stored = sqlx::query(
            "SELECT span_id, trace_id, body FROM otlp_spans WHERE otel_trace_id = ? ORDER BY received_at, span_id",
        )
        .bind(otel_trace_id)
        .fetch_all(&mut *tx)
        .await?;
        let mut seen = std::collections::HashSet::new();
        let mut linked = None;
        let mut bodies: Vec<Vec<u8>> = Vec::with_capacity(stored.len() + spans.len());
        for row in &stored {
            seen.insert(row.try_get::<String, _>("span_id")?);
            if linked.is_none() {
                linked = row.try_get::<Option<String>, _>("trace_id")?.as_deref().map(uuid).transpose()?;
            }
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
            let open: Option<bool> =
                sqlx::query_scalar("SELECT status = 'pending' AND round_id IS NULL FROM traces WHERE id = ?")
                    .bind(trace.to_string())
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
        let prompt = sqlx::query("SELECT id, version_count FROM prompts WHERE name = ?")
            .bind(mapped.prompt.as_str())
            .fetch_optional(&mut *tx)
            .await?;
        let count = prompt.as_ref().map(|r| r.try_get::<i64, _>("version_count")).transpose()?;
        if let Some(reason) = otlp_prompt_problem(&mapped, count) {
            tx.rollback().await?;
            return Ok(OtlpMerge::Rejected { spans: new.len(), reason });
        }
        let prompt_id: String =
            prompt.as_ref().map(|r| r.try_get("id")).transpose()?.ok_or_else(|| corrupt("prompt"))?;
        let now = now_us();
        let (trace, created) = match linked {
            Some(trace) => {
                let current: String = sqlx::query_scalar("SELECT feedback FROM traces WHERE id = ?")
                    .bind(trace.to_string())
                    .fetch_one(&mut *tx)
                    .await?;
                let current: Feedback = serde_json::from_str(&current).map_err(|_| corrupt("feedback"))?;
                // Feedback given through the API stays unless a span says otherwise.
                let feedback = current.merged(mapped.feedback.clone());
                sqlx::query(
                    "UPDATE traces SET prompt_id = ?2, prompt_version = ?3, input = ?4, trajectory = ?5, output = ?6,
                            feedback = ?7, metadata = ?8, updated_at = ?9 WHERE id = ?1",
                )
                .bind(trace.to_string())
                .bind(&prompt_id)
                .bind(mapped.prompt_version)
                .bind(to_json(&mapped.input)?)
                .bind(to_json(&mapped.trajectory)?)
                .bind(to_json(&mapped.output)?)
                .bind(to_json(&feedback)?)
                .bind(to_json(&mapped.metadata)?)
                .bind(now)
                .execute(&mut *tx)
                .await?;
                (trace, false)
            }
            None => {
                let trace = Uuid::now_v7();
                sqlx::query(
                    "INSERT INTO traces (id, prompt_id, prompt_version, input, trajectory, output, feedback, reflection,
                                         external_id, metadata, created_at, updated_at)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?11)",
                )
                .bind(trace.to_string())
                .bind(&prompt_id)
                .bind(mapped.prompt_version)
                .bind(to_json(&mapped.input)?)
                .bind(to_json(&mapped.trajectory)?)
                .bind(to_json(&mapped.output)?)
                .bind(to_json(&mapped.feedback)?)
                .bind(mapped.reflection.as_ref().map(to_json).transpose()?)
                .bind(&mapped.external_id)
                .bind(to_json(&mapped.metadata)?)
                .bind(now)
                .execute(&mut *tx)
                .await?;
                sqlx::query("UPDATE otlp_spans SET trace_id = ?2 WHERE otel_trace_id = ?1 AND trace_id IS NULL")
                    .bind(otel_trace_id)
                    .bind(trace.to_string())
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
                 GROUP BY otel_trace_id HAVING max(received_at) < ?)",
        )
        .bind(older_than.timestamp_micros())
        .execute(&s.writer)
        .await?
        .rows_affected())
    }

    async fn requeue_failed_traces(s: &SqlStore<Self>, req: &RequeueFailed) -> StoreResult<Vec<Uuid>> {
        let ids =
            req.ids.as_ref().map(|ids| to_json(&ids.iter().map(Uuid::to_string).collect::<Vec<_>>())).transpose()?;
        let mut tx = s.writer.begin().await?;
        let prompt: String = sqlx::query_scalar("SELECT id FROM prompts WHERE name = ?")
            .bind(req.prompt.as_str())
            .fetch_optional(&mut *tx)
            .await?
            .ok_or(StoreError::NotFound)?;
        let requeued: Vec<String> = sqlx::query_scalar(
            "UPDATE traces SET status = 'pending', attempts = 0, failure_reason = NULL, round_id = NULL, updated_at = ?1
             WHERE prompt_id = ?2 AND status = 'failed'
               AND (?3 IS NULL OR id IN (SELECT value FROM json_each(?3))) AND (?4 IS NULL OR created_at >= ?4)
             RETURNING id",
        )
        .bind(now_us())
        .bind(&prompt)
        .bind(ids)
        .bind(req.since.map(|t| t.timestamp_micros()))
        .fetch_all(&mut *tx)
        .await?;
        tx.commit().await?;
        let mut ids = requeued.iter().map(|id| uuid(id)).collect::<StoreResult<Vec<_>>>()?;
        ids.sort();
        if !ids.is_empty() {
            s.announce(Change::RoundQueued);
        }
        Ok(ids)
    }

    async fn insert_traces_idempotent(
        s: &SqlStore<Self>,
        key: IdempotencyKey<'_>,
        traces: &[ValidTrace],
        status: u16,
        answer: &(dyn for<'i> Fn(&'i [Uuid]) -> Vec<u8> + Send + Sync),
    ) -> StoreResult<IdempotentIngest> {
        // The single writer connection serialises requests with the same key.
        let mut tx = s.writer.begin().await?;
        let row =
            sqlx::query("SELECT request_hash, status_code, body FROM idempotency_keys WHERE owner = ? AND key = ?")
                .bind(key.owner.to_string())
                .bind(key.key)
                .fetch_optional(&mut *tx)
                .await?;
        if let Some(row) = row {
            let stored_status: Option<i64> = row.try_get("status_code")?;
            // A row without an answer can only be left by an older combee that
            // remembered keys before storing: it is taken over below.
            if let Some(stored_status) = stored_status {
                if row.try_get::<String, _>("request_hash")? != key.request_hash {
                    return Ok(IdempotentIngest::Mismatch);
                }
                let body: Option<Vec<u8>> = row.try_get("body")?;
                let status = u16::try_from(stored_status).map_err(|_| corrupt("idempotency status"))?;
                return Ok(IdempotentIngest::Replay { status, body: body.unwrap_or_default() });
            }
        }
        let ids = insert_trace_rows(&mut tx, traces).await?;
        let body = answer(&ids);
        sqlx::query(
            "INSERT INTO idempotency_keys (owner, key, request_hash, status_code, body, created_at) VALUES (?, ?, ?, ?, ?, ?)
             ON CONFLICT (owner, key) DO UPDATE SET request_hash = excluded.request_hash,
                 status_code = excluded.status_code, body = excluded.body, created_at = excluded.created_at",
        )
        .bind(key.owner.to_string())
        .bind(key.key)
        .bind(key.request_hash)
        .bind(i64::from(status))
        .bind(&body)
        .bind(now_us())
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(IdempotentIngest::Stored { ids, status, body })
    }

    async fn idempotency_purge(s: &SqlStore<Self>, older_than: DateTime<Utc>) -> StoreResult<u64> {
        Ok(sqlx::query("DELETE FROM idempotency_keys WHERE created_at < ?")
            .bind(older_than.timestamp_micros())
            .execute(&s.writer)
            .await?
            .rows_affected())
    }

    async fn open_round(s: &SqlStore<Self>, req: &OpenRound) -> StoreResult<Option<Round>> {
        let now = now_us();
        let mut tx = s.writer.begin().await?;
        // First, so a duplicate delivery is told so (not "a round is in flight":
        // its own round); every refusal below rolls back, forgetting the id.
        if let Some(hook) = &req.inbound_webhook_id {
            let n = sqlx::query("INSERT INTO inbound_webhooks (id, received_at) VALUES (?, ?) ON CONFLICT DO NOTHING")
                .bind(hook)
                .bind(now)
                .execute(&mut *tx)
                .await?
                .rows_affected();
            if n == 0 {
                return Err(StoreError::Duplicate);
            }
        }
        let row = sqlx::query("SELECT id, strategy, settings, version_count FROM prompts WHERE name = ?")
            .bind(req.prompt.as_str())
            .fetch_optional(&mut *tx)
            .await?
            .ok_or(StoreError::NotFound)?;
        let prompt_id: String = row.try_get("id")?;
        let strategy: String = row.try_get("strategy")?;
        let settings: crate::domain::PromptSettings =
            serde_json::from_str(row.try_get("settings")?).map_err(|_| corrupt("settings"))?;
        let latest: i64 = row.try_get("version_count")?;
        let active: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM rounds WHERE prompt_id = ? AND status IN ('queued', 'running'))",
        )
        .bind(&prompt_id)
        .fetch_one(&mut *tx)
        .await?;
        if active {
            return Err(StoreError::AlreadyExists);
        }
        let ids: Vec<String> = sqlx::query_scalar(
            "SELECT id FROM traces WHERE prompt_id = ? AND status = 'pending' AND round_id IS NULL AND quarantined_at IS NULL ORDER BY id LIMIT ?",
        )
        .bind(&prompt_id)
        .bind(i64::from(req.batch))
        .fetch_all(&mut *tx)
        .await?;
        if ids.is_empty() || (ids.len() as u32) < req.min_traces {
            return Ok(None);
        }
        let production: Option<i64> =
            sqlx::query_scalar("SELECT version FROM labels WHERE prompt_id = ? AND name = 'production'")
                .bind(&prompt_id)
                .fetch_optional(&mut *tx)
                .await?;
        let id = Uuid::now_v7();
        sqlx::query(
            "INSERT INTO rounds (id, prompt_id, status, trigger, method, strategy, seed, duplication, n, base_version,
                                 not_before, created_at, updated_at)
             VALUES (?, ?, 'queued', ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        )
        .bind(id.to_string())
        .bind(&prompt_id)
        .bind(req.trigger.as_str())
        .bind(round::method_str(req.method))
        .bind(&strategy)
        .bind(req.seed)
        .bind(settings.duplication as i32)
        .bind(ids.len() as i32)
        .bind(production.unwrap_or(latest))
        .bind(now)
        .bind(now)
        .bind(now)
        .execute(&mut *tx)
        .await?;
        for (position, trace) in ids.iter().enumerate() {
            sqlx::query("INSERT INTO round_traces (round_id, trace_id, position) VALUES (?, ?, ?)")
                .bind(id.to_string())
                .bind(trace)
                .bind(position as i64 + 1)
                .execute(&mut *tx)
                .await?;
            sqlx::query("UPDATE traces SET round_id = ?, updated_at = ? WHERE id = ?")
                .bind(id.to_string())
                .bind(now)
                .bind(trace)
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        s.announce(Change::RoundQueued);
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
        .fetch_all(&s.reader)
        .await?;
        rows.iter()
            .map(|r| {
                let oldest: Option<i64> = r.try_get("oldest")?;
                Ok(Backlog {
                    prompt: prompt_from_row::<Sqlite>(r)?,
                    pending: r.try_get("pending")?,
                    oldest: oldest.map(time).transpose()?,
                    active_round: r.try_get("active")?,
                })
            })
            .collect()
    }

    async fn claim_round(s: &SqlStore<Self>, owner: &str, lease: Duration) -> StoreResult<Option<ClaimedRound>> {
        let now = now_us();
        let id: Option<String> = sqlx::query_scalar(
            "UPDATE rounds SET status = 'running', attempt = attempt + 1, lease_owner = ?1, lease_expires_at = ?2 + ?3,
                    started_at = COALESCE(started_at, ?2), updated_at = ?2
             WHERE id = (SELECT id FROM rounds
                         WHERE (status = 'queued' AND not_before <= ?2) OR (status = 'running' AND lease_expires_at < ?2)
                         ORDER BY created_at LIMIT 1)
             RETURNING id",
        )
        .bind(owner)
        .bind(now)
        .bind(micros(lease))
        .fetch_optional(&s.writer)
        .await?;
        let Some(id) = id else { return Ok(None) };
        let id = uuid(&id)?;
        let round = s.load_round(id).await?.ok_or(StoreError::NotFound)?;
        let prompt = s.get_prompt(&round.prompt).await?.ok_or(StoreError::NotFound)?;
        let base = s
            .resolve(&round.prompt, &Selector::Version(round.base_version))
            .await?
            .ok_or_else(|| corrupt("round base version"))?
            .version;
        let traces = sqlx::query(&format!(
            "SELECT {TRACE_COLUMNS} FROM round_traces rt JOIN traces t ON t.id = rt.trace_id
             JOIN prompts p ON p.id = t.prompt_id WHERE rt.round_id = ? ORDER BY rt.position"
        ))
        .bind(id.to_string())
        .fetch_all(&s.reader)
        .await?
        .iter()
        .map(trace_from_row::<Sqlite>)
        .collect::<StoreResult<Vec<_>>>()?;
        Ok(Some(ClaimedRound { round, prompt, base, traces }))
    }

    async fn heartbeat_round(s: &SqlStore<Self>, round: Uuid, attempt: i32, lease: Duration) -> StoreResult<bool> {
        let now = now_us();
        let n = sqlx::query(
            "UPDATE rounds SET lease_expires_at = ?, updated_at = ? WHERE id = ? AND attempt = ? AND status = 'running'",
        )
        .bind(now + micros(lease))
        .bind(now)
        .bind(round.to_string())
        .bind(attempt)
        .execute(&s.writer)
        .await?
        .rows_affected();
        Ok(n == 1)
    }

    async fn adopt_reflections(s: &SqlStore<Self>, round: Uuid) -> StoreResult<u64> {
        Ok(sqlx::query(
            "INSERT OR IGNORE INTO reflections (round_id, trace_id, reflection, from_trace, created_at)
             SELECT cur.id, r.trace_id, r.reflection, r.from_trace, ?2
             FROM rounds cur
             JOIN round_traces rt ON rt.round_id = cur.id
             JOIN reflections r ON r.trace_id = rt.trace_id AND r.round_id <> cur.id
             JOIN rounds prev ON prev.id = r.round_id AND prev.prompt_id = cur.prompt_id
                             AND prev.base_version = cur.base_version AND prev.strategy = cur.strategy
             WHERE cur.id = ?1
             ORDER BY r.trace_id, r.created_at DESC",
        )
        .bind(round.to_string())
        .bind(now_us())
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
            "INSERT INTO reflections (round_id, trace_id, reflection, from_trace, created_at) VALUES (?, ?, ?, ?, ?)
             ON CONFLICT DO NOTHING",
        )
        .bind(round.to_string())
        .bind(trace.to_string())
        .bind(to_json(r)?)
        .bind(from_trace)
        .bind(now_us())
        .execute(&s.writer)
        .await?;
        Ok(())
    }

    async fn record_llm_call(s: &SqlStore<Self>, round: Uuid, attempt: i32, call: &LlmCall) -> StoreResult<()> {
        sqlx::query(
            "INSERT INTO llm_calls (round_id, attempt, role, model, prompt_tokens, completion_tokens, cost_usd, latency_ms,
                                    retries, error, created_at)
             VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        )
        .bind(round.to_string())
        .bind(attempt)
        .bind(enum_str(call.role))
        .bind(&call.model)
        .bind(call.prompt_tokens as i64)
        .bind(call.completion_tokens as i64)
        .bind(call.cost_usd)
        .bind(call.latency_ms as i64)
        .bind(call.retries as i64)
        .bind(&call.error)
        .bind(now_us())
        .execute(&s.writer)
        .await?;
        Ok(())
    }

    async fn round_calls(s: &SqlStore<Self>, round: Uuid) -> StoreResult<Vec<RoundCall>> {
        sqlx::query(
            "SELECT attempt, role, model, prompt_tokens, completion_tokens, cost_usd, latency_ms, retries, error, created_at
             FROM llm_calls WHERE round_id = ? ORDER BY id",
        )
        .bind(round.to_string())
        .fetch_all(&s.reader)
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
                    retries: row.try_get::<i64, _>("retries")? as u32,
                    error: row.try_get("error")?,
                },
                created_at: time(row.try_get("created_at")?)?,
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
            "UPDATE rounds SET k = COALESCE(?, k), detail = ?, updated_at = ? WHERE id = ? AND attempt = ? AND status = 'running'",
        )
        .bind(k)
        .bind(to_json(detail)?)
        .bind(now_us())
        .bind(round.to_string())
        .bind(attempt)
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
        let now = now_us();
        let mut tx = s.writer.begin().await?;
        let (prompt_id, name) = fence::<Sqlite>(&mut *tx, round, attempt).await?;
        if let Some(secs) = sample_secs.filter(|s| *s > 0.0) {
            sqlx::query(
                "INSERT INTO controller_samples (prompt_id, round_id, batch_size, round_secs, created_at)
                 SELECT prompt_id, id, n, ?, ? FROM rounds WHERE id = ?",
            )
            .bind(secs)
            .bind(now)
            .bind(round.to_string())
            .execute(&mut *tx)
            .await?;
        }
        let number: i64 = sqlx::query_scalar(
            "UPDATE prompts SET version_count = version_count + 1 WHERE id = ? RETURNING version_count",
        )
        .bind(prompt_id.to_string())
        .fetch_one(&mut *tx)
        .await?;
        insert_version::<Sqlite>(&mut *tx, prompt_id, number, &v, time(now)?).await?;
        let mv = LabelMove {
            label: label.clone(),
            to_version: number,
            expected_current: None,
            check_current: false,
            by: v.created_by.clone(),
        };
        let (moved, previous) = apply_move::<Sqlite>(&mut *tx, prompt_id, &mv).await?;
        charge_traces::<Sqlite>(&mut *tx, round, charges).await?;
        sqlx::query(
            "UPDATE traces SET status = 'consumed', updated_at = ?1 WHERE round_id = ?2 AND status = 'pending'
               AND EXISTS (SELECT 1 FROM reflections r WHERE r.round_id = ?2 AND r.trace_id = traces.id)",
        )
        .bind(now)
        .bind(round.to_string())
        .execute(&mut *tx)
        .await?;
        release_traces::<Sqlite>(&mut *tx, round).await?;
        sqlx::query(
            "UPDATE rounds SET status = 'succeeded', result_version = ?, detail = ?, error = NULL, finished_at = ?,
                    lease_owner = NULL, lease_expires_at = NULL, updated_at = ? WHERE id = ?",
        )
        .bind(number)
        .bind(to_json(detail)?)
        .bind(now)
        .bind(now)
        .bind(round.to_string())
        .execute(&mut *tx)
        .await?;
        let version = v.into_version(PromptName::parse(&name).map_err(|_| corrupt("prompt name"))?, number, time(now)?);
        let mut queued =
            record_event::<Sqlite>(&mut *tx, &OutboxEvent::version_created(&version, &[label.as_str()])).await?;
        let cause = MoveCause::new(LabelMoveKind::AutoPublish, format!("round {round} published v{number}"))
            .with_evidence(serde_json::json!({ "round_id": round }));
        queued |= record_move::<Sqlite>(&mut *tx, prompt_id, &version.prompt, &moved, previous, &cause).await?;
        queued |=
            record_event::<Sqlite>(&mut *tx, &OutboxEvent::round_completed(&version.prompt, round, number, &label))
                .await?;
        tx.commit().await?;
        s.announce(Change::Prompt(name));
        s.announce_outbox(queued);
        Ok(version)
    }

    async fn fail_round(
        s: &SqlStore<Self>,
        round: Uuid,
        attempt: i32,
        error: &str,
        how: RoundFailure,
    ) -> StoreResult<()> {
        let now = now_us();
        let mut tx = s.writer.begin().await?;
        let (_, name) = fence::<Sqlite>(&mut *tx, round, attempt).await?;
        let requeued = matches!(how, RoundFailure::Retry { .. });
        let mut queued = false;
        match how {
            RoundFailure::Retry { after } => {
                sqlx::query(
                    "UPDATE rounds SET status = 'queued', lease_owner = NULL, lease_expires_at = NULL, error = ?,
                            not_before = ?, updated_at = ? WHERE id = ?",
                )
                .bind(error)
                .bind(now + micros(after))
                .bind(now)
                .bind(round.to_string())
                .execute(&mut *tx)
                .await?;
            }
            RoundFailure::GiveUp { charges } => {
                charge_traces::<Sqlite>(&mut *tx, round, &charges).await?;
                release_traces::<Sqlite>(&mut *tx, round).await?;
                sqlx::query(
                    "UPDATE rounds SET status = 'failed', error = ?, finished_at = ?, lease_owner = NULL,
                            lease_expires_at = NULL, updated_at = ? WHERE id = ?",
                )
                .bind(error)
                .bind(now)
                .bind(now)
                .bind(round.to_string())
                .execute(&mut *tx)
                .await?;
                queued =
                    record_event::<Sqlite>(&mut *tx, &OutboxEvent::round_failed(&name, round, attempt, error)).await?;
            }
        }
        tx.commit().await?;
        if requeued {
            s.announce(Change::RoundQueued);
        }
        s.announce_outbox(queued);
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
             WHERE a.subscription_id = ?1 AND (?2 IS NULL OR a.id < ?2) ORDER BY a.id DESC LIMIT ?3",
        )
        .bind(id.to_string())
        .bind(before)
        .bind(i64::from(limit))
        .fetch_all(&s.reader)
        .await?
        .iter()
        .map(|r| {
            let next: Option<i64> = r.try_get("next_attempt_at")?;
            Ok(DeliveryAttempt {
                seq: r.try_get("id")?,
                delivery_id: uuid(r.try_get("delivery_id")?)?,
                event_id: r.try_get("event_id")?,
                event_type: r.try_get("type")?,
                attempt: r.try_get("attempt")?,
                status_code: r.try_get::<Option<i64>, _>("status_code")?.map(|c| c as u16),
                error: r.try_get("error")?,
                latency_ms: r.try_get::<i64, _>("latency_ms")?.max(0) as u64,
                attempted_at: time(r.try_get("created_at")?)?,
                next_attempt_at: next.map(time).transpose()?,
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
        // One writer connection: the claim cannot race another claim in this
        // process, and SQLite serves a single process. The lease is the due
        // time itself, so a crashed attempt becomes due again when it expires.
        let now = now_us();
        let mut tx = s.writer.begin().await?;
        let rows = sqlx::query(
            "UPDATE webhook_deliveries SET attempts = attempts + 1, lease_owner = ?1, next_attempt_at = ?2 + ?3,
                    updated_at = ?2
             WHERE id IN (SELECT d.id FROM webhook_deliveries d
                          JOIN webhook_subscriptions s ON s.id = d.subscription_id AND s.enabled = 1
                          WHERE d.status = 'pending' AND d.next_attempt_at <= ?2
                          ORDER BY d.next_attempt_at LIMIT ?4)
             RETURNING id, subscription_id, event_id, attempts",
        )
        .bind(owner)
        .bind(now)
        .bind(micros(lease))
        .bind(i64::from(limit))
        .fetch_all(&mut *tx)
        .await?;
        let mut claimed = Vec::with_capacity(rows.len());
        for r in &rows {
            let event_id: String = r.try_get("event_id")?;
            let sub: String = r.try_get("subscription_id")?;
            let e = sqlx::query("SELECT type, body FROM webhook_events WHERE id = ?")
                .bind(&event_id)
                .fetch_one(&mut *tx)
                .await?;
            let h = sqlx::query("SELECT url, secret FROM webhook_subscriptions WHERE id = ?")
                .bind(&sub)
                .fetch_one(&mut *tx)
                .await?;
            claimed.push(ClaimedDelivery {
                id: uuid(r.try_get("id")?)?,
                subscription_id: uuid(&sub)?,
                event_id,
                event_type: e.try_get("type")?,
                body: e.try_get("body")?,
                url: h.try_get("url")?,
                secret: Secret::new(h.try_get::<String, _>("secret")?),
                attempt: r.try_get("attempts")?,
            });
        }
        tx.commit().await?;
        Ok(claimed)
    }

    async fn finish_delivery(s: &SqlStore<Self>, d: &ClaimedDelivery, rec: &AttemptRecord) -> StoreResult<bool> {
        let now = now_us();
        let (status, next_at) = match &rec.outcome {
            DeliveryOutcome::Succeeded => ("succeeded", None),
            DeliveryOutcome::Retry { at } => ("pending", Some(at.timestamp_micros())),
            DeliveryOutcome::GiveUp | DeliveryOutcome::Gone => ("failed", None),
        };
        let mut tx = s.writer.begin().await?;
        let n = sqlx::query(
            "UPDATE webhook_deliveries SET status = ?3, next_attempt_at = COALESCE(?4, next_attempt_at),
                    last_error = ?5, lease_owner = NULL, updated_at = ?6
             WHERE id = ?1 AND attempts = ?2 AND status = 'pending'",
        )
        .bind(d.id.to_string())
        .bind(d.attempt)
        .bind(status)
        .bind(next_at)
        .bind(&rec.error)
        .bind(now)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if n == 0 {
            return Ok(false);
        }
        sqlx::query(
            "INSERT INTO webhook_attempts (delivery_id, subscription_id, attempt, status_code, error, latency_ms,
                                           next_attempt_at, created_at)
             VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        )
        .bind(d.id.to_string())
        .bind(d.subscription_id.to_string())
        .bind(d.attempt)
        .bind(rec.status_code.map(i64::from))
        .bind(&rec.error)
        .bind(rec.latency_ms.min(i64::MAX as u64) as i64)
        .bind(next_at)
        .bind(now)
        .execute(&mut *tx)
        .await?;
        if rec.outcome == DeliveryOutcome::Gone {
            sqlx::query(
                "UPDATE webhook_subscriptions SET enabled = 0, updated_at = ?,
                        disabled_reason = 'the receiver answered 410 Gone' WHERE id = ?",
            )
            .bind(now)
            .bind(d.subscription_id.to_string())
            .execute(&mut *tx)
            .await?;
            sqlx::query(
                "UPDATE webhook_deliveries SET status = 'failed', last_error = 'subscription disabled', updated_at = ?
                 WHERE subscription_id = ? AND status = 'pending'",
            )
            .bind(now)
            .bind(d.subscription_id.to_string())
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
             JOIN prompts p ON p.id = s.prompt_id WHERE p.name = ? ORDER BY s.id DESC LIMIT ?",
        )
        .bind(prompt.as_str())
        .bind(i64::from(limit))
        .fetch_all(&s.reader)
        .await?
        .iter()
        .map(|r| {
            Ok(super::ControllerSample {
                batch_size: r.try_get::<i64, _>("batch_size")? as u32,
                round_secs: r.try_get("round_secs")?,
                round_id: uuid(r.try_get("round_id")?)?,
                created_at: time(r.try_get("created_at")?)?,
            })
        })
        .collect::<StoreResult<Vec<_>>>()?;
        rows.reverse();
        Ok(rows)
    }

    async fn save_controller_choice(s: &SqlStore<Self>, prompt: &PromptName, choice: &Value) -> StoreResult<()> {
        let now = now_us();
        sqlx::query(
            "INSERT INTO controller_choices (prompt_id, choice, updated_at) SELECT id, ?, ? FROM prompts WHERE name = ?
             ON CONFLICT (prompt_id) DO UPDATE SET choice = excluded.choice, updated_at = excluded.updated_at",
        )
        .bind(to_json(choice)?)
        .bind(now)
        .bind(prompt.as_str())
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
        let now = now_us();
        let mut tx = s.writer.begin().await?;
        for c in counts {
            sqlx::query(
                "INSERT INTO meter_counts (round_id, prompt_id, size_min, marked, recaptured, created_at)
                 SELECT ?, id, ?, ?, ?, ? FROM prompts WHERE name = ?
                 ON CONFLICT (round_id, size_min) DO NOTHING",
            )
            .bind(round.to_string())
            .bind(i64::from(c.size_min))
            .bind(i64::try_from(c.marked).unwrap_or(i64::MAX))
            .bind(i64::try_from(c.recaptured).unwrap_or(i64::MAX))
            .bind(now)
            .bind(prompt.as_str())
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    async fn meter_counts(s: &SqlStore<Self>, prompt: &PromptName) -> StoreResult<Vec<super::MeterCounts>> {
        sqlx::query(
            "SELECT m.size_min, SUM(m.marked) AS marked, SUM(m.recaptured) AS recaptured, COUNT(*) AS rounds
             FROM meter_counts m JOIN prompts p ON p.id = m.prompt_id WHERE p.name = ?
             GROUP BY m.size_min ORDER BY m.size_min",
        )
        .bind(prompt.as_str())
        .fetch_all(&s.reader)
        .await?
        .iter()
        .map(|r| {
            Ok(super::MeterCounts {
                size_min: r.try_get::<i64, _>("size_min")? as u32,
                marked: r.try_get::<i64, _>("marked")? as u64,
                recaptured: r.try_get::<i64, _>("recaptured")? as u64,
                rounds: r.try_get::<i64, _>("rounds")? as u64,
            })
        })
        .collect()
    }
}

/// Reads trace `id` for an operator action (`delete` or quarantine) inside
/// the writer's transaction; the answer to give instead when it is missing or
/// in a state that refuses it.
async fn check_for_action(
    tx: &mut Transaction<'_, Sqlite>,
    id: Uuid,
    delete: bool,
) -> StoreResult<Option<TraceAction>> {
    let Some(row) = sqlx::query("SELECT status, round_id FROM traces WHERE id = ?")
        .bind(id.to_string())
        .fetch_optional(&mut **tx)
        .await?
    else {
        return Ok(Some(TraceAction::NotFound));
    };
    let round_id: Option<String> = row.try_get("round_id")?;
    let round_id = round_id.as_deref().map(uuid).transpose()?;
    Ok(trace_action_refusal(delete, row.try_get("status")?, round_id).map(TraceAction::Refused))
}

/// Stores new spans of `otel_trace_id`, attached to `trace` or held (`None`).
async fn insert_otlp_spans(
    tx: &mut Transaction<'_, Sqlite>,
    otel_trace_id: &str,
    trace: Option<Uuid>,
    spans: &[&OtlpSpan],
) -> StoreResult<()> {
    let now = now_us();
    for span in spans {
        sqlx::query(
            "INSERT INTO otlp_spans (otel_trace_id, span_id, trace_id, body, received_at) VALUES (?, ?, ?, ?, ?)",
        )
        .bind(otel_trace_id)
        .bind(&span.span_id)
        .bind(trace.map(|t| t.to_string()))
        .bind(&span.body)
        .bind(now)
        .execute(&mut **tx)
        .await?;
    }
    Ok(())
}

/// One row of the outcome aggregate query.
fn outcome_bucket_from_row(row: &SqliteRow) -> StoreResult<OutcomeBucket> {
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
