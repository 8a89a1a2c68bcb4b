//! Trace inserts run on the writer connection's own SQLite handle. sqlx runs
//! every statement on the connection's worker thread and answers over a
//! channel; under load each such hand-off waits for a core, and a group of
//! trace writes took six of them (begin, the prompt lookup, the insert, two
//! rollup statements, commit), most of its time. Locked out from the worker
//! once, the handle takes a whole group's statements in one go, on the
//! lane's own thread.

use std::collections::HashMap;

use rusqlite::{Connection, ErrorCode, params};
use sqlx::{Sqlite, SqliteConnection, sqlite::LockedSqliteHandle};
use uuid::Uuid;

use super::super::rollups::{self, Counted, Sign};
use super::super::traces::prompt_reference_problem;
use super::super::{StoreError, StoreResult};
use super::{Insert, TraceRow, now_us};
use crate::domain::PromptName;

/// The prompts a group's traces name, looked up once each: the prompt's id
/// and version count, `None` for an unknown prompt. Inside the writer's
/// transaction nothing else writes, so what is read here holds until commit.
type PromptIds = HashMap<PromptName, Option<(String, i64)>>;

/// A connection's SQLite handle, locked out from sqlx's worker for as long
/// as this lives, with a connection over it whose prepared statements are
/// kept until then.
pub(super) struct Locked<'c> {
    // Declared first, so dropped first: its statements are finalised before
    // the lock is let go (sqlx would fail to close a handle left with any).
    db: Connection,
    _locked: LockedSqliteHandle<'c>,
}

impl<'c> Locked<'c> {
    /// Locks `c`'s handle. Work on it may run a transaction of its own but
    /// must end it before the lock is let go, or run inside one the caller
    /// opened through sqlx and leave it open.
    pub async fn lock(c: &'c mut SqliteConnection) -> StoreResult<Self> {
        let mut locked = c.lock_handle().await?;
        // SAFETY: `locked` holds the connection's lock, so sqlx's worker does
        // not touch the handle until it is dropped, after `db` (field order).
        // A connection made from a handle does not close it.
        let db = unsafe { Connection::from_handle(locked.as_raw_handle().as_ptr()) }.map_err(store_error)?;
        Ok(Self { db, _locked: locked })
    }

    /// Runs `work` on the handle, as blocking work.
    pub fn run<T>(&self, work: impl FnOnce(&Connection) -> T) -> T {
        blocking(|| work(&self.db))
    }
}

/// Runs `work` on `c`'s SQLite handle (see [`Locked::lock`]).
pub(super) async fn with_handle<T>(c: &mut SqliteConnection, work: impl FnOnce(&Connection) -> T) -> StoreResult<T> {
    Ok(Locked::lock(c).await?.run(work))
}

/// Runs blocking work without stalling the runtime's other tasks: on a
/// multi-threaded runtime the worker hands its queue to another thread first.
fn blocking<T>(work: impl FnOnce() -> T) -> T {
    use tokio::runtime::{Handle, RuntimeFlavor};
    match Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(RuntimeFlavor::MultiThread) => tokio::task::block_in_place(work),
        _ => work(),
    }
}

/// A SQLite error as the store reports it (the same kinds as through sqlx:
/// a unique violation is `AlreadyExists`, anything else a database error).
pub(super) fn store_error(e: rusqlite::Error) -> StoreError {
    let unique = matches!(
        &e,
        rusqlite::Error::SqliteFailure(f, _) if f.code == ErrorCode::ConstraintViolation
            && matches!(f.extended_code, rusqlite::ffi::SQLITE_CONSTRAINT_UNIQUE | rusqlite::ffi::SQLITE_CONSTRAINT_PRIMARYKEY)
    );
    if unique { StoreError::AlreadyExists } else { StoreError::Database(sqlx::Error::Protocol(format!("sqlite: {e}"))) }
}

/// Checks each request's references (each prompt looked up once for the
/// group) and answers the requests that name an unknown prompt or version
/// (there is nothing of theirs to undo); writes the traces of the others,
/// inside the caller's transaction, and returns them with the ids to credit.
pub(super) fn insert_group(conn: &Connection, inserts: Vec<Insert>) -> rusqlite::Result<(Vec<Insert>, Vec<Uuid>)> {
    let mut known = PromptIds::new();
    let mut kept = Vec::with_capacity(inserts.len());
    let mut prompt_ids = Vec::with_capacity(inserts.len());
    for insert in inserts {
        match resolve_prompts(conn, &mut known, &insert.traces)? {
            Ok(ids) => {
                prompt_ids.push(ids);
                kept.push(insert);
            }
            Err(problem) => {
                let _ = insert.reply.send(Err(problem));
            }
        }
    }
    let now = now_us();
    let mut statement = insert_statement(conn)?;
    let mut credit = Vec::new();
    for (insert, prompts) in kept.iter().zip(&prompt_ids) {
        for ((t, id), prompt_id) in insert.traces.iter().zip(&insert.ids).zip(prompts) {
            insert_row(&mut statement, t, *id, prompt_id, now)?;
            credit.push(*id);
        }
    }
    Ok((kept, credit))
}

/// Inserts a request's traces inside the caller's transaction, all or none:
/// their ids, or `Invalid` naming the first trace whose prompt or version is
/// unknown. Their rollup credit is the caller's to write.
pub(super) fn insert_rows(conn: &Connection, traces: &[TraceRow]) -> rusqlite::Result<StoreResult<Vec<Uuid>>> {
    let prompt_ids = match resolve_prompts(conn, &mut PromptIds::new(), traces)? {
        Ok(ids) => ids,
        Err(problem) => return Ok(Err(problem)),
    };
    let (now, mut statement) = (now_us(), insert_statement(conn)?);
    let ids: Vec<Uuid> = traces.iter().map(|_| Uuid::now_v7()).collect();
    for ((t, id), prompt_id) in traces.iter().zip(&ids).zip(&prompt_ids) {
        insert_row(&mut statement, t, *id, prompt_id, now)?;
    }
    Ok(Ok(ids))
}

/// Appends the rollup credit of the stored traces `ids` (inside the caller's
/// transaction), with the statements [`rollups::account`] runs through sqlx.
pub(super) fn credit(conn: &Connection, ids: &[Uuid]) -> rusqlite::Result<()> {
    if ids.is_empty() {
        return Ok(());
    }
    let ids = serde_json::Value::from(ids.iter().map(Uuid::to_string).collect::<Vec<_>>()).to_string();
    for text in rollups::account_statements::<Sqlite>(Sign::Credit, Counted::All) {
        conn.prepare_cached(&text)?.execute([&ids])?;
    }
    Ok(())
}

/// The prompt ids of `traces`, or why the request cannot be stored (the
/// first trace whose prompt or version is unknown, as `Invalid`).
fn resolve_prompts(
    conn: &Connection,
    known: &mut PromptIds,
    traces: &[TraceRow],
) -> rusqlite::Result<StoreResult<Vec<String>>> {
    let mut ids = Vec::with_capacity(traces.len());
    for (i, t) in traces.iter().enumerate() {
        if !known.contains_key(&t.prompt) {
            let mut lookup = conn.prepare_cached("SELECT id, version_count FROM prompts WHERE name = ?")?;
            let mut rows = lookup.query([t.prompt.as_str()])?;
            let found = match rows.next()? {
                Some(row) => Some((row.get::<_, String>(0)?, row.get::<_, i64>(1)?)),
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

/// The one-row trace insert, prepared once per group and run for each row:
/// in-process, a statement per row costs microseconds.
fn insert_statement(conn: &Connection) -> rusqlite::Result<rusqlite::CachedStatement<'_>> {
    conn.prepare_cached(
        "INSERT INTO traces (id, prompt_id, prompt_version, input, trajectory, output, feedback, \
         reflection, external_id, metadata, created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
    )
}

fn insert_row(
    statement: &mut rusqlite::CachedStatement<'_>,
    t: &TraceRow,
    id: Uuid,
    prompt_id: &str,
    now: i64,
) -> rusqlite::Result<()> {
    statement.execute(params![
        id.to_string(),
        prompt_id,
        t.version,
        t.input,
        t.trajectory,
        t.output,
        t.feedback,
        t.reflection,
        t.external_id,
        t.metadata,
        now,
        now,
    ])?;
    Ok(())
}
