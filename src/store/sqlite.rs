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
    Row, Sqlite, SqliteConnection, SqlitePool,
    sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteRow, SqliteSynchronous},
};
use tokio::sync::{broadcast, oneshot};
use uuid::Uuid;

use crate::evaluate::outcomes::MAX_ABS_VALUE;

use super::backend::{Backend, SqlStore};
use super::group_commit::{self, GroupCommit, PhaseClock, Weighed, shared_failure};
use super::rollups::{self, Counted, Sign};
use super::sql::{Dialect, Param, Query, corrupt, direct_getters, executors};
use super::traces::{merge_feedback, prompt_reference_problem};
use super::{StoreError, StoreKind, StoreResult, migrate};
use crate::domain::trace::FeedbackSource;
use crate::domain::{
    Feedback, PromptName,
    trace::{IdempotencyKey, IdempotentIngest, ValidTrace},
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
    const ROLLUP_ROW_PER_KEY: bool = true;
    const BEGIN_WRITE: &'static str = "BEGIN IMMEDIATE";
    direct_getters!(SqliteRow: get_i64 -> i64, get_i32 -> i32, get_f64 -> f64, get_bool -> bool, get_text -> String, get_bytes -> Vec<u8>);
    fn bind<'q>(q: Query<'q, Self>, p: Param<'q>) -> Query<'q, Self> {
        match p {
            Param::Int(v) => q.bind(v),
            Param::Int32(v) => q.bind(v),
            Param::Real(v) => q.bind(v),
            Param::Bool(v) => q.bind(v),
            Param::Text(v) => q.bind(v),
            Param::Id(v) => q.bind(v.map(|u| u.to_string())),
            Param::At(v) => q.bind(v.map(|t| t.timestamp_micros())),
            Param::Bytes(v) => q.bind(v),
            Param::Ids(v) => {
                q.bind(v.map(|ids| Value::from(ids.iter().map(Uuid::to_string).collect::<Vec<_>>()).to_string()))
            }
            Param::Ints(v) => q.bind(v.map(|ns| Value::from(ns.to_vec()).to_string())),
            Param::Json(v) => q.bind(v.map(|j| j.to_string())),
        }
    }
    executors!(SqliteConnection, SqliteRow);
    fn get_id(row: &SqliteRow, col: &str) -> StoreResult<Option<Uuid>> {
        row.try_get::<Option<&str>, _>(col)?.map(uuid).transpose()
    }
    fn get_at(row: &SqliteRow, col: &str) -> StoreResult<Option<DateTime<Utc>>> {
        row.try_get::<Option<i64>, _>(col)?.map(time).transpose()
    }
    fn get_json(row: &SqliteRow, col: &str) -> StoreResult<Option<Value>> {
        row.try_get::<Option<&str>, _>(col)?.map(json).transpose()
    }
    fn serialize_budget<'c>(_: &'c mut SqliteConnection) -> BoxFuture<'c, StoreResult<()>> {
        Box::pin(async { Ok(()) })
    }
    fn serialize_otlp<'c>(_: &'c mut SqliteConnection, _: &'c str) -> BoxFuture<'c, StoreResult<()>> {
        Box::pin(async { Ok(()) })
    }
    fn any_of(column: &str, param: &str) -> String {
        format!("{column} IN (SELECT value FROM json_each({param}))")
    }
    fn reserve_traces<'c>(
        c: &'c mut SqliteConnection,
        round: Uuid,
        traces: &'c [Uuid],
        at: DateTime<Utc>,
    ) -> BoxFuture<'c, StoreResult<()>> {
        Box::pin(async move {
            for (position, trace) in traces.iter().enumerate() {
                sqlx::query("INSERT INTO round_traces (round_id, trace_id, position) VALUES (?, ?, ?)")
                    .bind(round.to_string())
                    .bind(trace.to_string())
                    .bind(position as i64 + 1)
                    .execute(&mut *c)
                    .await?;
                sqlx::query("UPDATE traces SET round_id = ?, updated_at = ? WHERE id = ?")
                    .bind(round.to_string())
                    .bind(at.timestamp_micros())
                    .bind(trace.to_string())
                    .execute(&mut *c)
                    .await?;
            }
            Ok(())
        })
    }
    fn json_number(col: &str, key: &str) -> String {
        format!(
            "CASE WHEN json_type({col}, '$.{key}') IN ('integer', 'real') AND abs(json_extract({col}, '$.{key}')) \
             <= {MAX_ABS_VALUE} THEN CAST(json_extract({col}, '$.{key}') AS REAL) END"
        )
    }
    fn json_flag(col: &str, key: &str) -> String {
        format!("CASE json_type({col}, '$.{key}') WHEN 'true' THEN 1.0 WHEN 'false' THEN 0.0 END")
    }
    fn json_is(col: &str, key: &str, kind: &str) -> String {
        let types = match kind {
            "number" => "'integer', 'real'",
            "boolean" => "'true', 'false'",
            _ => "'text'",
        };
        format!("json_type({col}, '$.{key}') IN ({types})")
    }
    fn json_text(col: &str, key: &str) -> String {
        format!("json_extract({col}, '$.{key}')")
    }
    fn bucket_start(param: &str) -> String {
        format!("(t.created_at / ({param} * 1000000)) * {param}")
    }
    fn real(expr: &str) -> String {
        format!("CAST({expr} AS REAL)")
    }
    fn string_agg(expr: &str) -> String {
        format!("group_concat({expr}, ',')")
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

/// A trace as its row stores it, serialised by the request's own task before
/// it joins a group (the writer's lane only runs SQL).
struct TraceRow {
    prompt: PromptName,
    version: Option<i64>,
    input: String,
    trajectory: String,
    output: String,
    feedback: String,
    reflection: Option<String>,
    external_id: Option<String>,
    metadata: String,
}

impl TraceRow {
    fn of(t: &ValidTrace) -> StoreResult<Self> {
        Ok(Self {
            prompt: t.prompt.clone(),
            version: t.prompt_version,
            input: to_json(&t.input)?,
            trajectory: to_json(&t.trajectory)?,
            output: to_json(&t.output)?,
            feedback: to_json(&t.feedback)?,
            reflection: t.reflection.as_ref().map(to_json).transpose()?,
            external_id: t.external_id.clone(),
            metadata: to_json(&t.metadata)?,
        })
    }

    fn all(traces: &[ValidTrace]) -> StoreResult<Vec<Self>> {
        traces.iter().map(Self::of).collect()
    }
}

/// Inserts a batch of traces inside the caller's transaction, all or none;
/// `Invalid` names the first trace whose prompt or version is unknown. Their
/// rollup credit is the caller's to write (a group writes its jobs' at once).
async fn insert_trace_rows(c: &mut SqliteConnection, traces: &[TraceRow]) -> StoreResult<Vec<Uuid>> {
    if traces.is_empty() {
        return Ok(Vec::new());
    }
    let prompt_ids = resolve_prompts(&mut *c, &mut PromptIds::new(), traces).await??;
    let ids: Vec<Uuid> = traces.iter().map(|_| Uuid::now_v7()).collect();
    let rows: Vec<RowToInsert<'_>> =
        traces.iter().zip(&ids).zip(&prompt_ids).map(|((t, id), prompt_id)| (t, *id, prompt_id.as_str())).collect();
    insert_resolved(&mut *c, &rows).await?;
    Ok(ids)
}

/// Stores traces under an idempotency key inside the caller's transaction
/// (the single writer serialises requests with the same key, and a key
/// stored earlier in the same group is seen by the next job).
async fn insert_idempotent(
    c: &mut SqliteConnection,
    owner: &str,
    key: &str,
    request_hash: &str,
    traces: &[TraceRow],
) -> StoreResult<(IdempotentIngest, Vec<Uuid>)> {
    let row = sqlx::query("SELECT request_hash, trace_ids FROM idempotency_keys WHERE owner = ? AND key = ?")
        .bind(owner)
        .bind(key)
        .fetch_optional(&mut *c)
        .await?;
    if let Some(row) = row {
        let stored: Option<String> = row.try_get("trace_ids")?;
        // A row without ids can only be left by an older combee that
        // remembered keys before storing: it is taken over below.
        if let Some(stored) = stored {
            if row.try_get::<String, _>("request_hash")? != request_hash {
                return Ok((IdempotentIngest::Mismatch, Vec::new()));
            }
            let ids = serde_json::from_str(&stored).map_err(|_| corrupt("idempotency ids"))?;
            return Ok((IdempotentIngest::Replay { ids }, Vec::new()));
        }
    }
    let ids = insert_trace_rows(&mut *c, traces).await?;
    sqlx::query(
        "INSERT INTO idempotency_keys (owner, key, request_hash, trace_ids, created_at) VALUES (?, ?, ?, ?, ?)
         ON CONFLICT (owner, key) DO UPDATE SET request_hash = excluded.request_hash,
             trace_ids = excluded.trace_ids, created_at = excluded.created_at",
    )
    .bind(owner)
    .bind(key)
    .bind(request_hash)
    .bind(to_json(&ids)?)
    .bind(now_us())
    .execute(&mut *c)
    .await?;
    Ok((IdempotentIngest::Stored { ids: ids.clone() }, ids))
}

/// How many rows one group of the writer may write (a larger batch is a
/// group of its own): bounds how long the group's transaction holds the
/// writer, and so how long another write waits behind it.
const GROUP_ROWS: usize = 2048;

/// One trace write in the writer's group: its work, run inside the group's
/// transaction under a savepoint of its own, so a job that fails (an unknown
/// prompt) is undone alone and its neighbours commit.
pub struct Write {
    rows: usize,
    job: Job,
}

/// What a job does in its group.
enum Job {
    /// Plain inserts (no idempotency key): all of a group's are written by
    /// one statement that keeps each request all or nothing.
    Insert(PlainInsert),
    /// Anything else, run under a savepoint of its own.
    Work {
        /// It reads or retracts rollup credit, so the group's pending credit
        /// is written before it runs (late feedback on a trace of the group).
        settles: bool,
        run: Work,
    },
}

/// One request's plain insert: its rows, their ids (made by the request's
/// task), and where its answer goes.
struct PlainInsert {
    traces: Vec<TraceRow>,
    ids: Vec<Uuid>,
    reply: oneshot::Sender<StoreResult<Vec<Uuid>>>,
}

/// A job's work on the group's connection.
type Work = Box<dyn for<'c> FnOnce(&'c mut SqliteConnection) -> BoxFuture<'c, Finish> + Send>;

/// What a job left to do once its work ran.
enum Finish {
    /// Its work stands: answer with the group's commit; the traces it
    /// stored, whose rollup credit the group writes for all its jobs at once.
    Kept(Box<dyn FnOnce(StoreResult<()>) + Send>, Vec<Uuid>),
    /// Its work failed and was rolled back: answer with its own error.
    Undone(Box<dyn FnOnce() + Send>),
}

impl Weighed for Write {
    fn weight(&self) -> usize {
        self.rows
    }
}

impl Write {
    /// A job running `work`, which answers with its value and the traces it
    /// stored (to credit), and the receiver of its answer.
    fn new<T, F>(rows: usize, settles: bool, work: F) -> (Self, oneshot::Receiver<StoreResult<T>>)
    where
        T: Send + 'static,
        F: for<'c> FnOnce(&'c mut SqliteConnection) -> BoxFuture<'c, StoreResult<(T, Vec<Uuid>)>> + Send + 'static,
    {
        let (reply, answer) = oneshot::channel();
        let run = work_of(move |c| {
            Box::pin(async move {
                match work(c).await {
                    Ok((value, credit)) => Finish::Kept(
                        Box::new(move |committed: StoreResult<()>| {
                            let _ = reply.send(committed.map(|()| value));
                        }),
                        credit,
                    ),
                    Err(e) => Finish::Undone(Box::new(move || {
                        let _ = reply.send(Err(e));
                    })),
                }
            })
        });
        (Self { rows, job: Job::Work { settles, run } }, answer)
    }
}

/// The prompts a group's traces name, looked up once each: the prompt's id
/// and version count, `None` for an unknown prompt. Inside the writer's
/// transaction nothing else writes, so what is read here holds until commit.
type PromptIds = std::collections::HashMap<PromptName, Option<(String, i64)>>;

/// One trace row to write: the row, its id and its prompt's id.
type RowToInsert<'a> = (&'a TraceRow, Uuid, &'a str);

/// Columns bound per row of a group insert.
const INSERT_PARAMS: usize = 12;

/// Rows per insert statement, largest first. A group's rows go in chunks of
/// these sizes (the binary decomposition of its count), so the writer prepares
/// each of these few statements once and keeps it: a statement of exactly the
/// group's size would be a new one, parsed and planned, for nearly every group.
const CHUNK_ROWS: [usize; 9] = [256, 128, 64, 32, 16, 8, 4, 2, 1];

/// The prompt ids of `traces`, or why the request cannot be stored (the
/// first trace whose prompt or version is unknown, as `Invalid`).
async fn resolve_prompts(
    c: &mut SqliteConnection,
    known: &mut PromptIds,
    traces: &[TraceRow],
) -> StoreResult<Result<Vec<String>, StoreError>> {
    let mut ids = Vec::with_capacity(traces.len());
    for (i, t) in traces.iter().enumerate() {
        if !known.contains_key(&t.prompt) {
            let row = sqlx::query("SELECT id, version_count FROM prompts WHERE project = ? AND name = ?")
                .bind(t.prompt.project())
                .bind(t.prompt.as_str())
                .fetch_optional(&mut *c)
                .await?;
            let found = match row {
                Some(r) => Some((r.try_get::<String, _>("id")?, r.try_get::<i64, _>("version_count")?)),
                None => None,
            };
            known.insert(t.prompt.clone(), found);
        }
        let found = &known[&t.prompt];
        if let Some(what) = prompt_reference_problem(&t.prompt, t.version, found.as_ref().map(|(_, n)| *n)) {
            return Ok(Err(StoreError::Invalid(format!("traces[{i}]: {what}"))));
        }
        ids.push(found.as_ref().map(|(id, _)| id.clone()).unwrap_or_default());
    }
    Ok(Ok(ids))
}

/// Checks each request's references (each prompt looked up once for the
/// group) and answers the requests that name an unknown prompt or version
/// (there is nothing of theirs to undo) and takes them out of `inserts`;
/// writes the traces of the others and returns the ids to credit. On an
/// error `inserts` holds every request not yet answered, for the caller to
/// answer with the group's failure.
async fn insert_group(c: &mut SqliteConnection, inserts: &mut Vec<PlainInsert>) -> StoreResult<Vec<Uuid>> {
    let mut known = PromptIds::new();
    let mut prompt_ids = Vec::with_capacity(inserts.len());
    let mut pending = std::mem::take(inserts).into_iter();
    while let Some(insert) = pending.next() {
        match resolve_prompts(&mut *c, &mut known, &insert.traces).await {
            Ok(Ok(ids)) => {
                prompt_ids.push(ids);
                inserts.push(insert);
            }
            Ok(Err(problem)) => {
                let _ = insert.reply.send(Err(problem));
            }
            Err(e) => {
                inserts.push(insert);
                inserts.extend(pending);
                return Err(e);
            }
        }
    }
    let rows: Vec<RowToInsert<'_>> = inserts
        .iter()
        .zip(&prompt_ids)
        .flat_map(|(insert, prompts)| {
            insert.traces.iter().zip(&insert.ids).zip(prompts).map(|((t, id), p)| (t, *id, p.as_str()))
        })
        .collect();
    insert_resolved(&mut *c, &rows).await?;
    Ok(rows.iter().map(|(_, id, _)| *id).collect())
}

/// Writes rows whose references were checked, in chunks of [`CHUNK_ROWS`].
async fn insert_resolved(c: &mut SqliteConnection, rows: &[RowToInsert<'_>]) -> StoreResult<()> {
    let now = now_us();
    let statements = insert_statements();
    let mut rest = rows;
    while !rest.is_empty() {
        // The last statement is of one row, so a chunk always fits.
        let (size, text) =
            statements.iter().find(|(n, _)| *n <= rest.len()).unwrap_or(&statements[statements.len() - 1]);
        let (chunk, after) = rest.split_at(*size);
        let mut q = sqlx::query(text.as_str());
        for (t, id, prompt_id) in chunk {
            q = q
                .bind(id.to_string())
                .bind(*prompt_id)
                .bind(t.version)
                .bind(&t.input)
                .bind(&t.trajectory)
                .bind(&t.output)
                .bind(&t.feedback)
                .bind(&t.reflection)
                .bind(&t.external_id)
                .bind(&t.metadata)
                .bind(now)
                .bind(now);
        }
        q.execute(&mut *c).await?;
        rest = after;
    }
    Ok(())
}

/// The insert statement of each of [`CHUNK_ROWS`], largest first, built once.
fn insert_statements() -> &'static [(usize, String)] {
    static TEXTS: std::sync::OnceLock<Vec<(usize, String)>> = std::sync::OnceLock::new();
    TEXTS.get_or_init(|| {
        let row = format!("({})", ["?"; INSERT_PARAMS].join(", "));
        CHUNK_ROWS
            .into_iter()
            .map(|n| {
                let values = vec![row.as_str(); n].join(", ");
                let text = format!(
                    "INSERT INTO traces (id, prompt_id, prompt_version, input, trajectory, output, feedback, \
                     reflection, external_id, metadata, created_at, updated_at) VALUES {values}"
                );
                (n, text)
            })
            .collect()
    })
}

/// Boxes a job's work (a function, so the closure is typed for every lifetime).
fn work_of<F>(f: F) -> Work
where
    F: for<'c> FnOnce(&'c mut SqliteConnection) -> BoxFuture<'c, Finish> + Send + 'static,
{
    Box::new(f)
}

/// Commits one group: its plain inserts with one statement, every other job
/// under its own savepoint, the rollup credit of the traces stored written
/// once for all of them, then one commit (one WAL flush); each job is
/// answered after it.
async fn commit_group(writer: SqlitePool, group: Vec<Write>) {
    let mut answers: Vec<Box<dyn FnOnce(StoreResult<()>) + Send>> = Vec::with_capacity(group.len());
    let (mut inserts, mut others) = (Vec::new(), Vec::new());
    for write in group {
        match write.job {
            Job::Insert(insert) => inserts.push(insert),
            Job::Work { settles, run } => others.push((settles, run)),
        }
    }
    let mut clock = PhaseClock::start();
    let outcome: StoreResult<()> = async {
        let mut tx = writer.begin_with(<Sqlite as Dialect>::BEGIN_WRITE).await?;
        clock.lap("begin");
        let mut credit: Vec<Uuid> = Vec::new();
        if !inserts.is_empty() {
            credit = insert_group(&mut tx, &mut inserts).await?;
        }
        clock.lap("insert");
        for (settles, run) in others.drain(..) {
            if settles && !credit.is_empty() {
                rollups::account::<Sqlite>(&mut tx, &std::mem::take(&mut credit), Sign::Credit, Counted::All).await?;
            }
            sqlx::query("SAVEPOINT job").execute(&mut *tx).await?;
            match run(&mut tx).await {
                Finish::Kept(answer, stored) => {
                    answers.push(answer);
                    credit.extend(stored);
                }
                Finish::Undone(answer) => {
                    // Answered even if the rollback fails: the group then fails below.
                    let undone = sqlx::query("ROLLBACK TO job").execute(&mut *tx).await;
                    answer();
                    undone?;
                }
            }
            sqlx::query("RELEASE job").execute(&mut *tx).await?;
        }
        clock.lap("other");
        rollups::account::<Sqlite>(&mut tx, &credit, Sign::Credit, Counted::All).await?;
        clock.lap("rollups");
        tx.commit().await?;
        clock.lap("commit");
        Ok(())
    }
    .await;
    match outcome {
        Ok(()) => {
            for insert in inserts {
                let _ = insert.reply.send(Ok(insert.ids));
            }
            answers.into_iter().for_each(|answer| answer(Ok(())));
        }
        Err(e) => {
            // Jobs not yet run are dropped unanswered, which their callers
            // read as the store being unavailable, as the group's failure is.
            drop(others);
            for insert in inserts {
                let _ = insert.reply.send(Err(shared_failure(&e)));
            }
            for answer in answers {
                answer(Err(shared_failure(&e)));
            }
        }
    }
}

/// Each reading connection's own page cache, in KiB (SQLite's default is
/// 2,000): the readers' pages are also in the operating system's cache, and
/// sixteen full default caches were a quarter of the server's memory once
/// many prompts had been read.
const READER_PAGE_CACHE_KIB: u32 = 256;

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
            // A file the process itself holds open does not go away between uses: checking the
            // one connection before each use cost every group of trace writes a round trip.
            .test_before_acquire(false)
            .acquire_timeout(acquire_timeout.max(Duration::from_secs(30)))
            .connect_with(options.clone())
            .await
            .map_err(StoreError::Unavailable)?;
        migrate::sqlite(&writer).await?;
        let reader = SqlitePoolOptions::new()
            .max_connections(readers.max(1))
            .acquire_timeout(acquire_timeout)
            .connect_with(options.read_only(true).pragma("cache_size", format!("-{READER_PAGE_CACHE_KIB}")))
            .await
            .map_err(StoreError::Unavailable)?;
        let (changes, _) = broadcast::channel(1024);
        // One lane: SQLite has one writer, and the lane's groups are its commits.
        let writes = GroupCommit::start(1, GROUP_ROWS, GROUP_ROWS, {
            let writer = writer.clone();
            move |group| commit_group(writer.clone(), group)
        });
        Ok(Self { writer, reader, changes, watch: KeyGenerationCache::open(path), writes })
    }
}

fn micros(d: Duration) -> i64 {
    d.as_micros().min(i64::MAX as u128) as i64
}

#[async_trait]
impl Backend for Sqlite {
    const KIND: StoreKind = StoreKind::Sqlite;
    const ANNOUNCE_LOCALLY: bool = true;
    type Watch = KeyGenerationCache;
    type Writes = GroupCommit<Write>;

    async fn api_key_generation(s: &SqlStore<Self>) -> StoreResult<i64> {
        // The header is read before the query: a commit landing in between
        // changes it, so the next call queries again.
        let header = s.watch.header();
        if let Some(generation) = header.as_ref().and_then(|h| s.watch.lookup(h)) {
            return Ok(generation);
        }
        let generation: i64 =
            sqlx::query_scalar("SELECT generation FROM api_key_generation").fetch_one(&s.reader).await?;
        if let Some(header) = header {
            s.watch.remember(header, generation);
        }
        Ok(generation)
    }

    async fn insert_traces(s: &SqlStore<Self>, traces: &[ValidTrace]) -> StoreResult<Vec<Uuid>> {
        if traces.is_empty() {
            return Ok(Vec::new());
        }
        let traces = TraceRow::all(traces)?;
        let ids = traces.iter().map(|_| Uuid::now_v7()).collect();
        let (reply, answer) = oneshot::channel();
        s.writes.submit(Write { rows: traces.len(), job: Job::Insert(PlainInsert { traces, ids, reply }) }).await?;
        group_commit::answer(answer).await
    }

    async fn insert_traces_idempotent(
        s: &SqlStore<Self>,
        key: IdempotencyKey<'_>,
        traces: &[ValidTrace],
    ) -> StoreResult<IdempotentIngest> {
        let rows = TraceRow::all(traces)?;
        let (owner, key, hash) = (key.owner.to_string(), key.key.to_owned(), key.request_hash.to_owned());
        let (job, answer) = Write::new(rows.len(), false, move |c| {
            Box::pin(async move { insert_idempotent(c, &owner, &key, &hash, &rows).await })
        });
        s.writes.submit(job).await?;
        group_commit::answer(answer).await
    }

    async fn add_feedback(
        s: &SqlStore<Self>,
        id: Uuid,
        feedback: Feedback,
        source: FeedbackSource,
    ) -> StoreResult<bool> {
        let (job, answer) = Write::new(1, true, move |c| {
            Box::pin(async move { Ok((merge_feedback::<Sqlite>(c, id, feedback, source).await?, Vec::new())) })
        });
        s.writes.submit(job).await?;
        group_commit::answer(answer).await
    }

    async fn claim_round_id(s: &SqlStore<Self>, owner: &str, lease: Duration) -> StoreResult<Option<Uuid>> {
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
        id.as_deref().map(uuid).transpose()
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

    async fn claim_delivery_ids(
        s: &SqlStore<Self>,
        owner: &str,
        lease: Duration,
        limit: u32,
    ) -> StoreResult<Vec<Uuid>> {
        // One writer connection: the claim cannot race another claim in this
        // process, and SQLite serves a single process. The lease is the due
        // time itself, so a crashed attempt becomes due again when it expires.
        let now = now_us();
        let ids: Vec<String> = sqlx::query_scalar(
            "UPDATE webhook_deliveries SET attempts = attempts + 1, lease_owner = ?1, next_attempt_at = ?2 + ?3,
                    updated_at = ?2
             WHERE id IN (SELECT d.id FROM webhook_deliveries d
                          JOIN webhook_subscriptions s ON s.id = d.subscription_id AND s.enabled = 1
                          WHERE d.status = 'pending' AND d.next_attempt_at <= ?2
                          ORDER BY d.next_attempt_at LIMIT ?4)
             RETURNING id",
        )
        .bind(owner)
        .bind(now)
        .bind(micros(lease))
        .bind(i64::from(limit))
        .fetch_all(&s.writer)
        .await?;
        ids.iter().map(|id| uuid(id)).collect()
    }
}
