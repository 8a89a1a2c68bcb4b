//! The production store: Postgres, shared by any number of combee processes.
//! Version numbers are assigned under the prompt's row lock; label moves are
//! compare-and-set; every change is announced with `NOTIFY combee_changes` in
//! the same transaction so other processes drop their caches at commit.
//!
//! Postgres may sit behind a pooler in transaction mode (PgBouncer's
//! `pool_mode = transaction`), which hands a server connection to a client
//! only until its transaction ends: see [`Route`]. What needs a session of its
//! own (the LISTEN of the change listener, the migrations' advisory locks)
//! then goes to Postgres directly.

use std::{
    str::FromStr,
    sync::atomic::{AtomicBool, Ordering},
    time::Duration,
};

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use futures_util::future::BoxFuture;
use serde_json::Value;
use sqlx::{
    PgConnection, PgPool, Postgres, Row,
    postgres::{PgConnectOptions, PgListener, PgPoolOptions, PgRow},
};
use tokio::{
    sync::{broadcast, oneshot},
    task::JoinHandle,
};
use uuid::Uuid;

use crate::evaluate::outcomes::MAX_ABS_VALUE;

use super::backend::{Backend, SqlStore};
use super::group_commit::{self, GroupCommit, PhaseClock, Weighed, shared_failure};
use super::rollups::{Sign, outcome_delta_sql, task_delta_sql};
use super::sql::{Dialect, Param, Query, corrupt, direct_getters};
use super::traces::{merge_feedback, reference_problem};
use super::{Change, StoreError, StoreKind, StoreResult, migrate};
use crate::domain::trace::FeedbackSource;
use crate::domain::{
    Feedback, PromptName,
    trace::{IdempotencyKey, IdempotentIngest, ValidTrace},
};

const CHANNEL: &str = "combee_changes";

pub type PgStore = SqlStore<Postgres>;

/// How this process reaches Postgres.
///
/// Through a transaction pooler a statement may not outlive its transaction
/// on the server connection: the pooler gives the connection to another
/// client at the next idle `ReadyForQuery`. sqlx 0.8 runs a statement with
/// parameters in two round trips (Parse and Describe, Sync; then Bind and
/// Execute, Sync), and names it (`sqlx_s_N`, per client connection) even with
/// its statement cache off. So, through a pooler, every statement is unnamed
/// (`persistent(false)`, nothing cached) and one that is not already in a
/// transaction runs inside its own `BEGIN`/`COMMIT`, which keeps both round
/// trips on one server connection. Session-scoped statements never go
/// through the pooler: the LISTEN of the change listener and the advisory
/// locks of the migrations use [`Route::direct_url`].
#[derive(Debug, Clone, Default)]
pub struct Route {
    /// Postgres itself, for what needs a session of its own; `None`: the main URL.
    pub direct_url: Option<String>,
    /// The main URL is a pooler in transaction mode.
    pub transaction_pooler: bool,
}

/// Set once a store of this process talks to Postgres through a transaction
/// pooler: from then on every statement of the process's Postgres stores runs
/// pooler-safe (see [`Route`]). A process serves one store; a test that opens
/// a direct store beside a pooled one only pays the pooled way's round trips.
static THROUGH_POOLER: AtomicBool = AtomicBool::new(false);

/// Runs `$run`, an async block over the query `$q` and the connection `$c`,
/// as [`Route`] needs: as written, or (through a transaction pooler) unnamed
/// and inside a transaction of its own unless one is open already.
macro_rules! pooler_safe {
    ($query:expr, $conn:expr, |$q:ident, $c:ident| $run:expr) => {{
        let (query, conn) = ($query, $conn);
        if !THROUGH_POOLER.load(Ordering::Relaxed) {
            let ($q, $c) = (query, conn);
            $run.await
        } else if sqlx::Connection::is_in_transaction(&*conn) {
            let ($q, $c) = (query.persistent(false), conn);
            $run.await
        } else {
            let mut tx = sqlx::Connection::begin(conn).await?;
            let ($q, $c) = (query.persistent(false), &mut *tx);
            match $run.await {
                Ok(v) => {
                    tx.commit().await?;
                    Ok(v)
                }
                Err(e) => {
                    let _ = tx.rollback().await;
                    Err(e)
                }
            }
        }
    }};
}

/// The NOTIFY listener task, stopped with the store.
pub struct Listener(JoinHandle<()>);

impl Drop for Listener {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl SqlStore<Postgres> {
    pub async fn connect(
        url: &str,
        route: &Route,
        max_connections: u32,
        acquire_timeout: Duration,
    ) -> StoreResult<Self> {
        let mut options = PgConnectOptions::from_str(url).map_err(StoreError::Unavailable)?;
        if route.transaction_pooler {
            if route.direct_url.is_none() {
                return Err(StoreError::Invalid(
                    "a transaction pooler needs a direct URL to Postgres (database.direct_url) for LISTEN and \
                     the migrations' advisory locks"
                        .into(),
                ));
            }
            THROUGH_POOLER.store(true, Ordering::Relaxed);
            // Nothing cached, and no startup parameter PgBouncer does not know by default.
            options = options.statement_cache_capacity(0).extra_float_digits(None);
        }
        let pool = PgPoolOptions::new()
            .max_connections(max_connections)
            .acquire_timeout(acquire_timeout)
            // No ping before every checkout (it was 12% of server CPU on trace ingest);
            // a dead connection fails its statement instead, and the pool replaces it.
            .test_before_acquire(false)
            .connect_with(options)
            .await
            .map_err(StoreError::Unavailable)?;
        let direct = match &route.direct_url {
            // The listener's connection and one for the migrations.
            Some(direct) => PgPoolOptions::new()
                .max_connections(2)
                .acquire_timeout(acquire_timeout)
                .test_before_acquire(false)
                .connect(direct)
                .await
                .map_err(StoreError::Unavailable)?,
            None => pool.clone(),
        };
        migrate::postgres(&direct).await?;
        let (changes, _) = broadcast::channel(1024);
        let listener = Listener(tokio::spawn(listen(direct, changes.clone())));

        let writes = GroupCommit::start(lanes(max_connections), GROUP_ROWS, ALONE_ROWS, {
            let pool = pool.clone();
            move |group| commit_group(pool.clone(), group)
        });
        Ok(Self { writer: pool.clone(), reader: pool, changes, watch: listener, writes })
    }

    pub fn pool(&self) -> &PgPool {
        &self.writer
    }
}

/// Traces as the typed columns of [`insert_trace_rows`], one entry a trace,
/// filled by the request's own task with fresh ids. `req` names the request
/// (its first trace's id), so a group's statement keeps each request all or
/// nothing; the JSON fields travel as text and Postgres parses each once,
/// into `jsonb`.
#[derive(Default)]
struct TraceColumns {
    req: Vec<Uuid>,
    id: Vec<Uuid>,
    prompt: Vec<PromptName>,
    prompt_version: Vec<Option<i64>>,
    input: Vec<String>,
    trajectory: Vec<String>,
    output: Vec<String>,
    feedback: Vec<String>,
    reflection: Vec<Option<String>>,
    external_id: Vec<Option<String>>,
    metadata: Vec<String>,
}

impl TraceColumns {
    fn of(traces: &[ValidTrace]) -> StoreResult<Self> {
        fn json(v: &impl serde::Serialize) -> StoreResult<String> {
            serde_json::to_string(v).map_err(|_| corrupt("trace"))
        }
        let mut c = TraceColumns::default();
        for t in traces {
            let id = Uuid::now_v7();
            c.req.push(c.id.first().copied().unwrap_or(id));
            c.id.push(id);
            c.prompt.push(t.prompt.clone());
            c.prompt_version.push(t.prompt_version);
            c.input.push(json(&t.input)?);
            c.trajectory.push(json(&t.trajectory)?);
            c.output.push(json(&t.output)?);
            c.feedback.push(json(&t.feedback)?);
            c.reflection.push(t.reflection.as_ref().map(json).transpose()?);
            c.external_id.push(t.external_id.clone());
            c.metadata.push(json(&t.metadata)?);
        }
        Ok(c)
    }
}

/// Inserts the traces of several requests in one statement, each request's
/// [`TraceColumns`] one part of its arrays: a request whose traces do not all
/// match a prompt and version falls out whole (its rows and its rollup
/// deltas), the others are stored. Returns the ids stored.
async fn insert_trace_rows(c: &mut PgConnection, parts: &[&TraceColumns]) -> StoreResult<Vec<Uuid>> {
    /// One column of every part, as one array.
    fn each<'a, U: 'a, T>(
        parts: &[&'a TraceColumns],
        column: impl Fn(&'a TraceColumns) -> &'a Vec<U>,
        view: impl Fn(&'a U) -> T,
    ) -> Vec<T> {
        parts.iter().flat_map(|p| column(p).iter().map(&view)).collect()
    }
    // The rollups' deltas are written by the same statement: one snapshot,
    // all or nothing. Which requests are whole is decided on the narrow
    // columns; the JSON ones are read from their arrays once, by the insert,
    // and the deltas read what it returns (a common table read by several
    // parts of a statement is copied row by row, so a wide one cost three
    // copies of every trace).
    let text = format!(
        "WITH refs AS (
             SELECT * FROM unnest($1::uuid[], $2::uuid[], $3::text[], $4::int8[], $12::text[])
                 AS t(req, id, prompt, prompt_version, project)),
         matched AS (
             SELECT t.req, t.id, p.id AS prompt_id FROM refs t
             JOIN prompts p ON p.project = t.project AND p.name = t.prompt
                 AND (t.prompt_version IS NULL OR t.prompt_version <= p.version_count)),
         counts AS (SELECT req, count(*) AS n FROM refs GROUP BY req),
         complete AS (
             SELECT m.req FROM matched m JOIN counts k ON k.req = m.req GROUP BY m.req, k.n
             HAVING count(*) = k.n),
         stored AS (
             INSERT INTO traces (id, prompt_id, prompt_version, input, trajectory, output, feedback, reflection,
                                 external_id, metadata, created_at)
             SELECT t.id, m.prompt_id, t.prompt_version, t.input::jsonb, t.trajectory::jsonb, t.output::jsonb,
                    t.feedback::jsonb, t.reflection::jsonb, t.external_id, t.metadata::jsonb, now()
             FROM unnest($2::uuid[], $4::int8[], $5::text[], $6::text[], $7::text[], $8::text[], $9::text[],
                         $10::text[], $11::text[])
                  AS t(id, prompt_version, input, trajectory, output, feedback, reflection, external_id, metadata)
             JOIN matched m ON m.id = t.id
             WHERE m.req IN (SELECT req FROM complete)
             RETURNING id, prompt_id, prompt_version, feedback, feedback_source, metadata, created_at),
         outcomes AS ({outcomes}),
         tasks AS ({tasks})
         SELECT id FROM stored",
        outcomes = outcome_delta_sql::<Postgres>("stored t", "true", Sign::Credit),
        tasks = task_delta_sql::<Postgres>("stored t", "true", Sign::Credit),
    );
    let (text_of, maybe_text) = (String::as_str, Option::<String>::as_deref);
    let q = sqlx::query(&text)
        .bind(each(parts, |p| &p.req, |u| *u))
        .bind(each(parts, |p| &p.id, |u| *u))
        .bind(each(parts, |p| &p.prompt, PromptName::as_str))
        .bind(each(parts, |p| &p.prompt_version, |v| *v))
        .bind(each(parts, |p| &p.input, text_of))
        .bind(each(parts, |p| &p.trajectory, text_of))
        .bind(each(parts, |p| &p.output, text_of))
        .bind(each(parts, |p| &p.feedback, text_of))
        .bind(each(parts, |p| &p.reflection, maybe_text))
        .bind(each(parts, |p| &p.external_id, maybe_text))
        .bind(each(parts, |p| &p.metadata, text_of))
        .bind(each(parts, |p| &p.prompt, PromptName::project));
    let stored = Postgres::fetch_all(q, c).await?;
    Ok(stored.iter().map(|r| r.try_get("id")).collect::<Result<_, _>>()?)
}

/// One request's traces waiting for a group, and where its answer goes.
pub struct Insert {
    rows: TraceColumns,
    reply: oneshot::Sender<StoreResult<Vec<Uuid>>>,
}

impl Weighed for Insert {
    fn weight(&self) -> usize {
        self.rows.id.len()
    }
}

/// How many trace rows one group's statement may carry: one statement runs
/// on one Postgres backend, so a group too large would keep the other cores
/// idle while it runs.
const GROUP_ROWS: usize = 1024;

/// A request with at least this many traces commits with a statement of its
/// own, beside the lanes: one flush is already shared by many rows, and
/// batches then run on as many backends as there are connections.
const ALONE_ROWS: usize = 32;

/// How many groups may commit at once: Postgres flushes concurrent commits
/// together, so a few lanes per core keep its cores and the disk busy (one
/// lane's group runs while another's waits on its flush), and each group
/// still gathers what arrived during the commit before it. A lane joins a
/// committing one only with [`ALONE_ROWS`] rows gathered (see
/// [`GroupCommit::start`]): a statement has a cost of its own in Postgres
/// (executor start-up and finish), about what a dozen rows cost to insert.
fn lanes(max_connections: u32) -> usize {
    let cores = std::thread::available_parallelism().map_or(2, usize::from);
    (2 * cores).clamp(4, 32).min((max_connections as usize / 2).max(1))
}

/// Commits one group with one statement (one commit, one WAL flush). A
/// statement that fails on its data (not an outage) is retried one request
/// at a time, so one bad request fails alone.
async fn commit_group(pool: PgPool, group: Vec<Insert>) {
    let parts: Vec<&TraceColumns> = group.iter().map(|job| &job.rows).collect();
    // The statement commits itself: its phase holds the commit and its flush.
    let mut clock = PhaseClock::start();
    let inserted = match pool.acquire().await {
        Ok(mut c) => {
            clock.lap("begin");
            let inserted = insert_trace_rows(&mut c, &parts).await;
            clock.lap("insert");
            inserted
        }
        Err(e) => Err(e.into()),
    };
    match inserted {
        Ok(stored) => {
            let stored: std::collections::HashSet<Uuid> = stored.into_iter().collect();
            for Insert { rows, reply } in group {
                let answer = if rows.id.first().is_some_and(|id| stored.contains(id)) {
                    Ok(rows.id)
                } else {
                    Err(first_unknown_reference(&pool, &rows).await.unwrap_or_else(|e| e))
                };
                let _ = reply.send(answer);
            }
        }
        Err(e) if group.len() > 1 && !matches!(e, StoreError::Unavailable(_)) => {
            for job in group {
                Box::pin(commit_group(pool.clone(), vec![job])).await;
            }
        }
        Err(e) => {
            let mut jobs = group.into_iter();
            if let Some(first) = jobs.next() {
                jobs.for_each(|job| drop(job.reply.send(Err(shared_failure(&e)))));
                let _ = first.reply.send(Err(e));
            }
        }
    }
}

/// Why a request's traces were not stored: the first unknown prompt or version.
async fn first_unknown_reference(pool: &PgPool, rows: &TraceColumns) -> StoreResult<StoreError> {
    let mut c = pool.acquire().await?;
    for (i, (prompt, version)) in rows.prompt.iter().zip(&rows.prompt_version).enumerate() {
        if let Some(problem) = reference_problem::<Postgres>(&mut c, prompt, *version).await? {
            return Ok(StoreError::Invalid(format!("traces[{i}]: {problem}")));
        }
    }
    Ok(StoreError::Invalid("a referenced prompt changed during the request; retry".into()))
}

/// A request's traces as a group job: fresh ids, the rows serialised here.
fn insert_job(traces: &[ValidTrace]) -> StoreResult<(Insert, oneshot::Receiver<StoreResult<Vec<Uuid>>>)> {
    let (reply, answer) = oneshot::channel();
    Ok((Insert { rows: TraceColumns::of(traces)?, reply }, answer))
}

/// Postgres encodes ids, times and JSON natively (uuid, timestamptz, jsonb).
impl Dialect for Postgres {
    const ROLLUP_ROW_PER_KEY: bool = false;
    const BEGIN_WRITE: &'static str = "BEGIN";
    direct_getters!(PgRow: get_i64 -> i64, get_i32 -> i32, get_f64 -> f64, get_bool -> bool, get_text -> String, get_id -> Uuid, get_at -> DateTime<Utc>, get_json -> Value, get_bytes -> Vec<u8>);
    fn bind<'q>(q: Query<'q, Self>, p: Param<'q>) -> Query<'q, Self> {
        match p {
            Param::Int(v) => q.bind(v),
            Param::Int32(v) => q.bind(v),
            Param::Real(v) => q.bind(v),
            Param::Bool(v) => q.bind(v),
            Param::Text(v) => q.bind(v),
            Param::Id(v) => q.bind(v),
            Param::At(v) => q.bind(v),
            Param::Bytes(v) => q.bind(v),
            Param::Ids(v) => q.bind(v),
            Param::Ints(v) => q.bind(v),
            Param::Json(v) => q.bind(v),
        }
    }
    fn execute<'c, 'q: 'c>(q: Query<'q, Self>, c: &'c mut PgConnection) -> BoxFuture<'c, sqlx::Result<u64>> {
        Box::pin(async move { pooler_safe!(q, c, |q, c| async move { Ok(q.execute(c).await?.rows_affected()) }) })
    }
    fn fetch_all<'c, 'q: 'c>(q: Query<'q, Self>, c: &'c mut PgConnection) -> BoxFuture<'c, sqlx::Result<Vec<PgRow>>> {
        Box::pin(async move { pooler_safe!(q, c, |q, c| q.fetch_all(c)) })
    }
    fn fetch_optional<'c, 'q: 'c>(
        q: Query<'q, Self>,
        c: &'c mut PgConnection,
    ) -> BoxFuture<'c, sqlx::Result<Option<PgRow>>> {
        Box::pin(async move { pooler_safe!(q, c, |q, c| q.fetch_optional(c)) })
    }
    fn serialize_budget<'c>(c: &'c mut PgConnection) -> BoxFuture<'c, StoreResult<()>> {
        Box::pin(async move {
            Self::execute(sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended('combee:budget', 0))"), c).await?;
            Ok(())
        })
    }
    fn serialize_otlp<'c>(c: &'c mut PgConnection, otel_trace_id: &'c str) -> BoxFuture<'c, StoreResult<()>> {
        Box::pin(async move {
            let q = sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended('otlp:' || $1, 0))").bind(otel_trace_id);
            Self::execute(q, c).await?;
            Ok(())
        })
    }
    fn any_of(column: &str, param: &str) -> String {
        format!("{column} = ANY({param})")
    }
    fn reserve_traces<'c>(
        c: &'c mut PgConnection,
        round: Uuid,
        traces: &'c [Uuid],
        at: DateTime<Utc>,
    ) -> BoxFuture<'c, StoreResult<()>> {
        Box::pin(async move {
            let q = sqlx::query(
                "INSERT INTO round_traces (round_id, trace_id, position)
                 SELECT $1, t.id, t.ord FROM unnest($2::uuid[]) WITH ORDINALITY AS t(id, ord)",
            );
            Self::execute(q.bind(round).bind(traces), &mut *c).await?;
            let q = sqlx::query("UPDATE traces SET round_id = $1, updated_at = $3 WHERE id = ANY($2)");
            Self::execute(q.bind(round).bind(traces).bind(at), &mut *c).await?;
            Ok(())
        })
    }
    fn json_number(col: &str, key: &str) -> String {
        // jsonb numbers are `numeric`: range-check before the float8 cast. Nested
        // CASEs because Postgres does not promise to short-circuit AND.
        format!(
            "CASE WHEN jsonb_typeof({col}->'{key}') = 'number' THEN CASE WHEN abs(({col}->'{key}')::numeric) \
             <= {MAX_ABS_VALUE} THEN ({col}->'{key}')::numeric::float8 END END"
        )
    }
    fn json_flag(col: &str, key: &str) -> String {
        format!(
            "CASE WHEN jsonb_typeof({col}->'{key}') = 'boolean' THEN CASE WHEN ({col}->>'{key}')::boolean THEN 1.0::float8 ELSE 0.0::float8 END END"
        )
    }
    fn json_is(col: &str, key: &str, kind: &str) -> String {
        format!("jsonb_typeof({col}->'{key}') = '{kind}'")
    }
    fn json_text(col: &str, key: &str) -> String {
        format!("{col}->>'{key}'")
    }
    fn bucket_start(param: &str) -> String {
        format!("floor(extract(epoch FROM t.created_at) / {param})::bigint * {param}")
    }
    fn real(expr: &str) -> String {
        format!("({expr})::float8")
    }
    fn string_agg(expr: &str) -> String {
        format!("string_agg({expr}, ',')")
    }
    fn lock(clause: &'static str) -> &'static str {
        clause
    }
    fn notify<'c>(c: &'c mut PgConnection, payload: &'c str) -> BoxFuture<'c, StoreResult<()>> {
        Box::pin(async move {
            Self::execute(sqlx::query("SELECT pg_notify($1, $2)").bind(CHANNEL).bind(payload), c).await?;
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

#[async_trait]
impl Backend for Postgres {
    const KIND: StoreKind = StoreKind::Postgres;
    const ANNOUNCE_LOCALLY: bool = false;
    type Watch = Listener;
    type Writes = GroupCommit<Insert>;

    async fn api_key_generation(s: &SqlStore<Self>) -> StoreResult<i64> {
        let mut c = s.writer.acquire().await?;
        let row = Postgres::fetch_optional(sqlx::query("SELECT generation FROM api_key_generation"), &mut c).await?;
        Ok(row.ok_or(StoreError::NotFound)?.try_get("generation")?)
    }

    async fn insert_traces(s: &SqlStore<Self>, traces: &[ValidTrace]) -> StoreResult<Vec<Uuid>> {
        if traces.is_empty() {
            return Ok(Vec::new());
        }
        let (job, answer) = insert_job(traces)?;
        if traces.len() >= ALONE_ROWS {
            let started = std::time::Instant::now();
            commit_group(s.writer.clone(), vec![job]).await;
            group_commit::record_group(traces.len(), started);
        } else {
            s.writes.submit(job).await?;
        }
        group_commit::answer(answer).await
    }

    async fn add_feedback(
        s: &SqlStore<Self>,
        id: Uuid,
        feedback: Feedback,
        source: FeedbackSource,
    ) -> StoreResult<bool> {
        // Its own transaction: Postgres flushes concurrent commits together.
        let mut tx = s.begin_write().await?;
        let found = merge_feedback::<Postgres>(&mut tx, id, feedback, source).await?;
        tx.commit().await?;
        Ok(found)
    }

    async fn insert_traces_idempotent(
        s: &SqlStore<Self>,
        key: IdempotencyKey<'_>,
        traces: &[ValidTrace],
    ) -> StoreResult<IdempotentIngest> {
        // Its own transaction, not a group's: a request with the same key
        // waits on this one's key row until it commits.
        let rows = TraceColumns::of(traces)?;
        let remembered = serde_json::to_value(&rows.id).map_err(|_| corrupt("trace ids"))?;
        for _ in 0..3 {
            let mut tx = s.begin_write().await?;
            // Claims the key with the ids it stores. A concurrent request with
            // the same key blocks here on the primary key until the first
            // commits (then nothing is inserted: replay) or rolls back (then
            // this one runs). A row without ids can only be left by an older
            // combee that remembered keys before storing: it is taken over.
            let claim = sqlx::query(
                "INSERT INTO idempotency_keys (owner, key, request_hash, trace_ids) VALUES ($1, $2, $3, $4)
                 ON CONFLICT (owner, key) DO UPDATE
                   SET request_hash = EXCLUDED.request_hash, trace_ids = EXCLUDED.trace_ids, created_at = now()
                   WHERE idempotency_keys.trace_ids IS NULL",
            );
            let claim = claim.bind(key.owner).bind(key.key).bind(key.request_hash).bind(&remembered);
            let claimed = Postgres::execute(claim, &mut tx).await?;
            if claimed == 1 {
                if insert_trace_rows(&mut tx, &[&rows]).await?.len() != traces.len() {
                    tx.rollback().await?;
                    return Err(first_unknown_reference(&s.writer, &rows).await?);
                }
                tx.commit().await?;
                return Ok(IdempotentIngest::Stored { ids: rows.id });
            }
            let q = sqlx::query("SELECT request_hash, trace_ids FROM idempotency_keys WHERE owner = $1 AND key = $2");
            let row = Postgres::fetch_optional(q.bind(key.owner).bind(key.key), &mut tx).await?;
            tx.rollback().await?;
            let Some(row) = row else {
                continue; // purged meanwhile: claim it again
            };
            if row.try_get::<String, _>("request_hash")? != key.request_hash {
                return Ok(IdempotentIngest::Mismatch);
            }
            let stored: Option<Value> = row.try_get("trace_ids")?;
            let ids = stored.and_then(|v| serde_json::from_value(v).ok()).ok_or_else(|| corrupt("idempotency ids"))?;
            return Ok(IdempotentIngest::Replay { ids });
        }
        Err(StoreError::Conflict)
    }

    async fn claim_round_id(s: &SqlStore<Self>, owner: &str, lease: Duration) -> StoreResult<Option<Uuid>> {
        let q = sqlx::query(
            "WITH c AS (
                 SELECT id FROM rounds
                 WHERE (status = 'queued' AND not_before <= now()) OR (status = 'running' AND lease_expires_at < now())
                 ORDER BY created_at FOR UPDATE SKIP LOCKED LIMIT 1)
             UPDATE rounds r SET status = 'running', attempt = r.attempt + 1, lease_owner = $1,
                    lease_expires_at = now() + make_interval(secs => $2), started_at = COALESCE(r.started_at, now()),
                    updated_at = now()
             FROM c WHERE r.id = c.id RETURNING r.id",
        );
        let row =
            Postgres::fetch_optional(q.bind(owner).bind(lease.as_secs_f64()), &mut *s.writer.acquire().await?).await?;
        Ok(row.map(|r| r.try_get("id")).transpose()?)
    }

    async fn heartbeat_round(s: &SqlStore<Self>, round: Uuid, attempt: i32, lease: Duration) -> StoreResult<bool> {
        let q = sqlx::query(
            "UPDATE rounds SET lease_expires_at = now() + make_interval(secs => $3), updated_at = now()
             WHERE id = $1 AND attempt = $2 AND status = 'running'",
        );
        let q = q.bind(round).bind(attempt).bind(lease.as_secs_f64());
        let n = Postgres::execute(q, &mut *s.writer.acquire().await?).await?;
        Ok(n == 1)
    }

    async fn claim_delivery_ids(
        s: &SqlStore<Self>,
        owner: &str,
        lease: Duration,
        limit: u32,
    ) -> StoreResult<Vec<Uuid>> {
        // The lease is the due time itself: a crashed attempt becomes due again when it expires.
        let q = sqlx::query(
            "WITH c AS (
                 SELECT d.id FROM webhook_deliveries d
                 JOIN webhook_subscriptions s ON s.id = d.subscription_id AND s.enabled
                 WHERE d.status = 'pending' AND d.next_attempt_at <= now()
                 ORDER BY d.next_attempt_at FOR UPDATE OF d SKIP LOCKED LIMIT $3)
             UPDATE webhook_deliveries d SET attempts = d.attempts + 1, lease_owner = $1,
                    next_attempt_at = now() + make_interval(secs => $2), updated_at = now()
             FROM c WHERE d.id = c.id RETURNING d.id",
        );
        let q = q.bind(owner).bind(lease.as_secs_f64()).bind(i64::from(limit));
        let rows = Postgres::fetch_all(q, &mut *s.writer.acquire().await?).await?;
        Ok(rows.iter().map(|r| r.try_get("id")).collect::<Result<_, _>>()?)
    }
}
