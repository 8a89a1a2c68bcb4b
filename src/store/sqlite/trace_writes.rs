//! Where a trace is stored on SQLite: the INSERT of traces (plain, or under
//! an idempotency key) and the group-commit writer that commits them, with
//! late feedback, on the one writer connection: a group's plain inserts go
//! in one statement, every other job under a savepoint of its own, and the
//! group commits once (one WAL flush) before any of its requests is answered.

use futures_util::future::BoxFuture;
use sqlx::{Row, Sqlite, SqliteConnection, SqlitePool};
use tokio::sync::oneshot;
use uuid::Uuid;

use super::dialect::now_us;
use crate::domain::{
    Feedback, PromptName,
    trace::{FeedbackSource, IdempotencyKey, IdempotentIngest, ValidTrace},
};
use crate::store::backend::SqlStore;
use crate::store::group_commit::{self, GroupCommit, PhaseClock, Weighed, shared_failure};
use crate::store::rollups::{self, Counted, Sign};
use crate::store::sql::{Dialect, corrupt};
use crate::store::traces::{merge_feedback, prompt_reference_problem};
use crate::store::{StoreError, StoreResult};

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

/// Starts the writer: one lane, since SQLite has one writer, and the lane's
/// groups are its commits.
pub(super) fn start_writer(writer: &SqlitePool) -> GroupCommit<Write> {
    GroupCommit::start(1, GROUP_ROWS, GROUP_ROWS, {
        let writer = writer.clone();
        move |group| commit_group(writer.clone(), group)
    })
}

/// Stores plain traces as one job of a group, answered once the group commits.
pub(super) async fn insert_traces(s: &SqlStore<Sqlite>, traces: &[ValidTrace]) -> StoreResult<Vec<Uuid>> {
    if traces.is_empty() {
        return Ok(Vec::new());
    }
    let traces = TraceRow::all(traces)?;
    let ids = traces.iter().map(|_| Uuid::now_v7()).collect();
    let (reply, answer) = oneshot::channel();
    s.writes.submit(Write { rows: traces.len(), job: Job::Insert(PlainInsert { traces, ids, reply }) }).await?;
    group_commit::answer(answer).await
}

/// Stores traces under an idempotency key, as a job of a group with a savepoint of its own.
pub(super) async fn insert_traces_idempotent(
    s: &SqlStore<Sqlite>,
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

/// Merges late feedback into a trace, as a job of a group (see `merge_feedback`).
pub(super) async fn add_feedback(
    s: &SqlStore<Sqlite>,
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
