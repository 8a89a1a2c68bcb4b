//! The embedded store's writer lane: trace writes committed in groups (see
//! `group_commit.rs`), on the one writer connection. While groups keep
//! coming the lane keeps that connection, and a run of plain-insert groups
//! goes straight through its SQLite handle (`handle.rs`): between such groups
//! there is no hand-off to another thread at all, only each group's commit.
//! Every other write of the process waits for the writer connection at most
//! [`HOLD`] behind a run.

use std::time::{Duration, Instant};

use futures_util::future::BoxFuture;
use sqlx::{Connection, Sqlite, SqliteConnection, SqlitePool};
use tokio::sync::oneshot;
use uuid::Uuid;

use super::super::StoreResult;
use super::super::group_commit::{Group, Queue, Weighed, record, shared_failure};
use super::super::rollups::{self, Counted, Sign};
use super::{Insert, TraceRow, handle};

/// How long the lane keeps the writer connection through groups queued back
/// to back before giving it back, so that the process's other writes (round
/// claims, label moves, judged scores, keys) get their turn: each waits at
/// most this (and one group) for it. Kept short because some of them take
/// the connection once per statement. (Keeping it through the pauses
/// between groups too, for a longer hold, starved them: a judge fell so far
/// behind that its scores missed the rater's windows.)
const HOLD: Duration = Duration::from_millis(5);

/// How many rows one group of the writer may write (a larger batch is a
/// group of its own): bounds how long the group's transaction holds the
/// writer, and so how long another write waits behind it.
pub(super) const GROUP_ROWS: usize = 2048;

/// One trace write in the writer's group: its work, run inside the group's
/// transaction under a savepoint of its own, so a job that fails (an unknown
/// prompt) is undone alone and its neighbours commit.
pub struct Write {
    rows: usize,
    job: Job,
}

/// What a job does in its group.
enum Job {
    /// Plain inserts (no idempotency key): a group's are written together,
    /// each request all or nothing.
    Insert(Insert),
    /// Anything else, run under a savepoint of its own.
    Work {
        /// It reads or retracts rollup credit, so the group's pending credit
        /// is written before it runs (late feedback on a trace of the group).
        settles: bool,
        run: Work,
    },
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
    /// A plain insert of `traces`, and the receiver of its answer (their ids).
    pub(super) fn insert(traces: Vec<TraceRow>) -> (Self, oneshot::Receiver<StoreResult<Vec<Uuid>>>) {
        let (reply, answer) = oneshot::channel();
        let ids = traces.iter().map(|_| Uuid::now_v7()).collect();
        (Self { rows: traces.len(), job: Job::Insert(Insert { traces, ids, reply }) }, answer)
    }

    /// Whether this is a plain insert.
    fn is_plain(&self) -> bool {
        matches!(self.job, Job::Insert(_))
    }

    /// A job running `work`, which answers with its value and the traces it
    /// stored (to credit), and the receiver of its answer.
    pub(super) fn new<T, F>(rows: usize, settles: bool, work: F) -> (Self, oneshot::Receiver<StoreResult<T>>)
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

/// Boxes a job's work (a function, so the closure is typed for every lifetime).
fn work_of<F>(f: F) -> Work
where
    F: for<'c> FnOnce(&'c mut SqliteConnection) -> BoxFuture<'c, Finish> + Send + 'static,
{
    Box::new(f)
}

impl Write {
    fn into_insert(self) -> Option<Insert> {
        match self.job {
            Job::Insert(insert) => Some(insert),
            Job::Work { .. } => None,
        }
    }
}

/// Times the phases of a group's commit into `combee_store_write_phase_seconds`.
struct PhaseClock(Instant);

impl PhaseClock {
    fn start() -> Self {
        Self(Instant::now())
    }

    fn lap(&mut self, phase: &'static str) {
        let now = Instant::now();
        metrics::histogram!("combee_store_write_phase_seconds", "phase" => phase)
            .record(now.duration_since(self.0).as_secs_f64());
        self.0 = now;
    }
}

/// Runs the lane until the store closes: takes the connection when a group
/// is waiting, commits that group and those queued behind it for up to
/// [`HOLD`], and gives the connection back when that is up or none is queued.
pub(super) async fn run(writer: SqlitePool, mut queue: Queue<Write>) {
    while let Some(first) = queue.next().await {
        let mut clock = PhaseClock::start();
        let Ok(mut conn) = writer.acquire().await else {
            // Dropped unanswered: its callers read the store as unavailable.
            drop(first);
            continue;
        };
        let held = Instant::now();
        let mut next = Some(first);
        while let Some(group) = next.take() {
            if group.jobs.iter().all(Write::is_plain) {
                next = plain_run(&mut conn, group, &mut queue, held, clock).await;
            } else {
                let (started, weight) = (clock.0, group.weight);
                commit_group(&mut conn, group.jobs, clock).await;
                record(weight, started);
                next = more(&mut queue, held);
            }
            clock = PhaseClock::start();
        }
    }
}

/// The next group while the lane may keep the connection: one queued now,
/// if [`HOLD`] is not up.
fn more(queue: &mut Queue<Write>, held: Instant) -> Option<Group<Write>> {
    if held.elapsed() >= HOLD { None } else { queue.queued() }
}

/// Commits `first`, a group of plain inserts, and the groups of plain inserts
/// queued behind it while the lane may keep the connection, all on the
/// connection's handle; returns a group taken from the queue that is not all
/// plain inserts, for the caller to commit.
async fn plain_run(
    conn: &mut SqliteConnection,
    first: Group<Write>,
    queue: &mut Queue<Write>,
    held: Instant,
    clock: PhaseClock,
) -> Option<Group<Write>> {
    // When the handle cannot be had, the group's inserts are never written
    // and are dropped unanswered (read as the store unavailable).
    let db = handle::Locked::lock(conn).await.ok()?;
    // The first group's time counts from before the connection was taken.
    let (mut group, mut started, mut clock) = (first, clock.0, clock);
    loop {
        let weight = group.weight;
        let inserts = group.jobs.into_iter().filter_map(Write::into_insert).collect();
        db.run(|db| commit_inserts(db, inserts, &mut clock));
        record(weight, started);
        match more(queue, held) {
            Some(next) if next.jobs.iter().all(Write::is_plain) => group = next,
            other => return other,
        }
        (clock, started) = (PhaseClock::start(), Instant::now());
    }
}

/// Commits a group of plain inserts on the writer's handle: its own
/// transaction, the rows, their rollup credit and the commit (one WAL
/// flush); answers each insert after it.
fn commit_inserts(db: &rusqlite::Connection, inserts: Vec<Insert>, clock: &mut PhaseClock) {
    let mut kept = Vec::new();
    let outcome = (|| {
        db.execute_batch("BEGIN IMMEDIATE")?;
        clock.lap("begin");
        let (stored, credit) = handle::insert_group(db, inserts)?;
        kept = stored;
        clock.lap("insert");
        handle::credit(db, &credit)?;
        clock.lap("rollups");
        db.execute_batch("COMMIT")?;
        clock.lap("commit");
        Ok(())
    })();
    if outcome.is_err() && !db.is_autocommit() {
        // The group's rows go with its transaction. Should the rollback
        // fail too, sqlx rolls back what is open when it next uses the
        // connection.
        let _ = db.execute_batch("ROLLBACK");
    }
    answer_inserts(kept, &outcome.map_err(handle::store_error));
}

/// Commits one group that holds other jobs than plain inserts: the plain
/// inserts written together, every other job under its own savepoint, the
/// rollup credit of the traces stored written once for all of them, then
/// one commit (one WAL flush); each job is answered after it.
async fn commit_group(conn: &mut SqliteConnection, group: Vec<Write>, mut clock: PhaseClock) {
    let (mut inserts, mut others) = (Vec::new(), Vec::new());
    for write in group {
        match write.job {
            Job::Insert(insert) => inserts.push(insert),
            Job::Work { settles, run } => others.push((settles, run)),
        }
    }
    let mut answers: Vec<Box<dyn FnOnce(StoreResult<()>) + Send>> = Vec::with_capacity(others.len());
    let mut kept_inserts: Vec<Insert> = Vec::new();
    let outcome: StoreResult<()> = async {
        let mut tx = conn.begin().await?;
        clock.lap("begin");
        let mut credit: Vec<Uuid> = Vec::new();
        if !inserts.is_empty() {
            let inserts = std::mem::take(&mut inserts);
            let (kept, stored) = handle::with_handle(&mut tx, |conn| handle::insert_group(conn, inserts))
                .await?
                .map_err(handle::store_error)?;
            kept_inserts = kept;
            credit = stored;
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
    // Jobs not yet run (and inserts not yet written) when the group failed
    // are dropped unanswered, which their callers read as the store being
    // unavailable, as the group's failure is.
    drop((inserts, others));
    answer_inserts(kept_inserts, &outcome);
    for answer in answers {
        answer(outcome.as_ref().map(|_| ()).map_err(shared_failure));
    }
}

/// Answers a group's written inserts with its commit's outcome.
fn answer_inserts(inserts: Vec<Insert>, outcome: &StoreResult<()>) {
    for insert in inserts {
        let _ = insert.reply.send(match outcome {
            Ok(()) => Ok(insert.ids),
            Err(e) => Err(shared_failure(e)),
        });
    }
}
