//! Where a trace is stored on Postgres: the INSERT of traces (one statement
//! for a whole group of requests, with their rollup deltas) and the
//! group-commit writer whose lanes commit those groups; writes under an
//! idempotency key and late feedback, which commit in transactions of their own.

use serde_json::Value;
use sqlx::{PgConnection, PgPool, Postgres, Row};
use tokio::sync::oneshot;
use uuid::Uuid;

use crate::domain::{
    Feedback, PromptName,
    trace::{FeedbackSource, IdempotencyKey, IdempotentIngest, ValidTrace},
};
use crate::store::backend::SqlStore;
use crate::store::group_commit::{self, GroupCommit, PhaseClock, Weighed, shared_failure};
use crate::store::rollups::{NewTraceOutcome, TASK_WIDTHS, TIER_WIDTHS};
use crate::store::sql::{Dialect, corrupt};
use crate::store::traces::{merge_feedback, reference_problem};
use crate::store::{StoreError, StoreResult};

/// Traces as the typed columns of [`insert_trace_rows`], one entry a trace,
/// filled by the request's own task with fresh ids. `req` names the request
/// (its first trace's id), so a group's statement keeps each request all or
/// nothing; the JSON fields travel as text and Postgres parses each once,
/// into `jsonb`. What the request adds to the rollups travels summed
/// (`outcomes`, `tasks`), so Postgres adds a few sums instead of reading
/// each trace's feedback and metadata again (on batched ingest 8 % of
/// Postgres's CPU a trace; see docs/benchmarks.md).
#[derive(Default)]
struct TraceColumns {
    outcomes: Vec<OutcomeSums>,
    tasks: Vec<TaskSums>,
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
        for (i, t) in traces.iter().enumerate() {
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
            let outcome = NewTraceOutcome::of(&t.feedback, &t.metadata);
            OutcomeSums::add(&mut c.outcomes, traces, i, &outcome);
            if let (Some(version), Some(key), Some(reward)) =
                (t.prompt_version, NewTraceOutcome::task_key(&t.metadata), outcome.reward)
            {
                TaskSums::add(&mut c.tasks, traces, i, version, key, reward);
            }
        }
        Ok(c)
    }
}

/// A request's outcome deltas for one (prompt, version), as the columns of
/// `outcome_rollups` sum them (a new trace is never judged yet). `first` is
/// the request's first trace of that prompt and version, which names them.
struct OutcomeSums {
    first: usize,
    version: Option<i64>,
    traces: i64,
    with_feedback: i64,
    success_trials: i64,
    successes: i64,
    /// (count, sum, sum of squares) of score, tokens, cost and latency.
    moments: [(i64, f64, f64); 4],
}

impl OutcomeSums {
    fn add(all: &mut Vec<OutcomeSums>, traces: &[ValidTrace], at: usize, o: &NewTraceOutcome) {
        let (prompt, version) = (&traces[at].prompt, traces[at].prompt_version);
        let i = match all.iter().position(|s| s.version == version && &traces[s.first].prompt == prompt) {
            Some(i) => i,
            None => {
                all.push(OutcomeSums {
                    first: at,
                    version,
                    traces: 0,
                    with_feedback: 0,
                    success_trials: 0,
                    successes: 0,
                    moments: [(0, 0.0, 0.0); 4],
                });
                all.len() - 1
            }
        };
        let s = &mut all[i];
        s.traces += 1;
        s.with_feedback += i64::from(o.rewarded);
        s.success_trials += i64::from(o.success.is_some());
        s.successes += i64::from(o.success == Some(1.0));
        for (m, v) in s.moments.iter_mut().zip(o.moments) {
            if let Some(v) = v {
                *m = (m.0 + 1, m.1 + v, m.2 + v * v);
            }
        }
    }
}

/// A request's task-reward deltas for one (prompt, version, task key), named
/// by the request's first trace of that prompt as [`OutcomeSums`].
struct TaskSums {
    first: usize,
    version: i64,
    task_key: String,
    traces: i64,
    reward_sum: f64,
}

impl TaskSums {
    fn add(all: &mut Vec<TaskSums>, traces: &[ValidTrace], at: usize, version: i64, key: &str, reward: f64) {
        let prompt = &traces[at].prompt;
        match all.iter_mut().find(|s| s.version == version && s.task_key == key && &traces[s.first].prompt == prompt) {
            Some(s) => {
                s.traces += 1;
                s.reward_sum += reward;
            }
            None => all.push(TaskSums { first: at, version, task_key: key.to_owned(), traces: 1, reward_sum: reward }),
        }
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
    /// The prompt of each request's sums (its `first` trace's), as `view` reads it.
    fn sums_of<'a, S: 'a, T>(
        parts: &[&'a TraceColumns],
        sums: impl Fn(&'a TraceColumns) -> &'a Vec<S>,
        first: impl Fn(&S) -> usize,
        view: impl Fn(&'a PromptName) -> T,
    ) -> Vec<T> {
        parts.iter().flat_map(|p| sums(p).iter().map(|s| view(&p.prompt[first(s)]))).collect()
    }
    // The rollups' deltas are written by the same statement: one snapshot,
    // all or nothing. Which requests are whole is decided on the narrow
    // columns; the JSON ones are read from their arrays once, by the insert.
    // Each request's deltas come summed: Postgres adds the sums of the whole
    // requests into each tier's bucket of this statement's second (`now()`,
    // every row's `created_at`).
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
             RETURNING id),
         outcome_sums AS (
             SELECT p.id AS prompt_id, coalesce(o.version, 0) AS version, sum(o.traces) AS traces,
                    sum(o.with_feedback) AS with_feedback, sum(o.success_trials) AS success_trials,
                    sum(o.successes) AS successes, sum(o.score_n) AS score_n, sum(o.score_sum) AS score_sum,
                    sum(o.score_sq) AS score_sq, sum(o.tokens_n) AS tokens_n, sum(o.tokens_sum) AS tokens_sum,
                    sum(o.tokens_sq) AS tokens_sq, sum(o.cost_n) AS cost_n, sum(o.cost_sum) AS cost_sum,
                    sum(o.cost_sq) AS cost_sq, sum(o.latency_n) AS latency_n, sum(o.latency_sum) AS latency_sum,
                    sum(o.latency_sq) AS latency_sq
             FROM unnest($13::uuid[], $14::text[], $15::text[], $16::int8[], $17::int8[], $18::int8[], $19::int8[],
                         $20::int8[], $21::int8[], $22::float8[], $23::float8[], $24::int8[], $25::float8[],
                         $26::float8[], $27::int8[], $28::float8[], $29::float8[], $30::int8[], $31::float8[],
                         $32::float8[])
                  AS o(req, project, prompt, version, traces, with_feedback, success_trials, successes,
                       score_n, score_sum, score_sq, tokens_n, tokens_sum, tokens_sq, cost_n, cost_sum, cost_sq,
                       latency_n, latency_sum, latency_sq)
             JOIN prompts p ON p.project = o.project AND p.name = o.prompt
             WHERE o.req IN (SELECT req FROM complete)
             GROUP BY p.id, coalesce(o.version, 0)),
         outcomes AS (
             INSERT INTO outcome_rollups (prompt_id, version, width, start_secs, traces, with_feedback,
                 success_trials, successes, score_n, score_sum, score_sq, tokens_n, tokens_sum, tokens_sq,
                 cost_n, cost_sum, cost_sq, latency_n, latency_sum, latency_sq, judged)
             SELECT o.prompt_id, o.version, w.width, {start}, o.traces, o.with_feedback, o.success_trials,
                    o.successes, o.score_n, o.score_sum, o.score_sq, o.tokens_n, o.tokens_sum, o.tokens_sq,
                    o.cost_n, o.cost_sum, o.cost_sq, o.latency_n, o.latency_sum, o.latency_sq, 0
             FROM outcome_sums o CROSS JOIN {TIER_WIDTHS}),
         task_sums AS (
             SELECT p.id AS prompt_id, k.version, k.task_key, sum(k.traces) AS traces, sum(k.reward_sum) AS reward_sum
             FROM unnest($33::uuid[], $34::text[], $35::text[], $36::int8[], $37::text[], $38::int8[],
                         $39::float8[])
                  AS k(req, project, prompt, version, task_key, traces, reward_sum)
             JOIN prompts p ON p.project = k.project AND p.name = k.prompt
             WHERE k.req IN (SELECT req FROM complete)
             GROUP BY p.id, k.version, k.task_key),
         tasks AS (
             INSERT INTO task_rollups (prompt_id, version, task_key, width, start_secs, traces, reward_sum)
             SELECT k.prompt_id, k.version, k.task_key, w.width, {start}, k.traces, k.reward_sum
             FROM task_sums k CROSS JOIN {TASK_WIDTHS})
         SELECT id FROM stored",
        start = "(floor(extract(epoch FROM now()))::bigint / w.width) * w.width",
    );
    let (text_of, maybe_text) = (String::as_str, Option::<String>::as_deref);
    // Each request's id beside each of its sums.
    let outcome_req: Vec<Uuid> = parts.iter().flat_map(|p| p.outcomes.iter().map(|_| p.id[0])).collect();
    let task_req: Vec<Uuid> = parts.iter().flat_map(|p| p.tasks.iter().map(|_| p.id[0])).collect();
    let moment = |i: usize| -> (Vec<i64>, Vec<f64>, Vec<f64>) {
        let all = || parts.iter().flat_map(|p| p.outcomes.iter().map(move |o| o.moments[i]));
        (all().map(|m| m.0).collect(), all().map(|m| m.1).collect(), all().map(|m| m.2).collect())
    };
    let mut q = sqlx::query(&text)
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
        .bind(each(parts, |p| &p.prompt, PromptName::project))
        .bind(outcome_req)
        .bind(sums_of(parts, |p| &p.outcomes, |o| o.first, PromptName::project))
        .bind(sums_of(parts, |p| &p.outcomes, |o| o.first, PromptName::as_str))
        .bind(each(parts, |p| &p.outcomes, |o| o.version))
        .bind(each(parts, |p| &p.outcomes, |o| o.traces))
        .bind(each(parts, |p| &p.outcomes, |o| o.with_feedback))
        .bind(each(parts, |p| &p.outcomes, |o| o.success_trials))
        .bind(each(parts, |p| &p.outcomes, |o| o.successes));
    for i in 0..4 {
        let (n, sum, sq) = moment(i);
        q = q.bind(n).bind(sum).bind(sq);
    }
    let q = q
        .bind(task_req)
        .bind(sums_of(parts, |p| &p.tasks, |t| t.first, PromptName::project))
        .bind(sums_of(parts, |p| &p.tasks, |t| t.first, PromptName::as_str))
        .bind(each(parts, |p| &p.tasks, |t| t.version))
        .bind(each(parts, |p| &p.tasks, |t| t.task_key.as_str()))
        .bind(each(parts, |p| &p.tasks, |t| t.traces))
        .bind(each(parts, |p| &p.tasks, |t| t.reward_sum));
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

/// Starts the writer's lanes (see [`lanes`]).
pub(super) fn start_writer(pool: &PgPool, max_connections: u32) -> GroupCommit<Insert> {
    GroupCommit::start(lanes(max_connections), GROUP_ROWS, ALONE_ROWS, {
        let pool = pool.clone();
        move |group| commit_group(pool.clone(), group)
    })
}

/// Stores plain traces: in a group of a lane, or, from [`ALONE_ROWS`] traces on, with a statement of their own.
pub(super) async fn insert_traces(s: &SqlStore<Postgres>, traces: &[ValidTrace]) -> StoreResult<Vec<Uuid>> {
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

/// Merges late feedback into a trace (see `merge_feedback`).
pub(super) async fn add_feedback(
    s: &SqlStore<Postgres>,
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

/// Stores traces under an idempotency key, in a transaction of their own.
pub(super) async fn insert_traces_idempotent(
    s: &SqlStore<Postgres>,
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
