//! Outcome rollups: per (prompt, version, time bucket) sums of what traces
//! count for (rewards, scores, usage), and per (version, task key, minute or
//! second) reward sums, so every read of outcomes costs O(buckets), not
//! O(traces), and outcomes outlive the traces retention deletes. Reads never
//! touch the trace rows: a window's edges fall on rollup buckets (second rows
//! for recent edges, see [`rollup_window`]), so a read costs the same however
//! many traces arrived in it, the current second included.
//!
//! Writes only ever append signed delta rows, inside the transaction of the
//! trace write they account for: a trace's contribution *as it is now* is
//! taken back (`Sign::Retract`) before a change and added (`Sign::Credit`)
//! after it, so late feedback replaces its earlier contribution exactly once.
//! No rollup row is updated on the write path (concurrent writers never wait
//! on a hot row); [`Rollups::compact_rollups`] folds each key's rows into one.
//! Readers sum whatever rows a key has.

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use uuid::Uuid;

use super::{
    StoreResult,
    backend::{Backend, SqlStore},
    sql::{Cols, Dialect, Param, sql},
};
use crate::{
    domain::PromptName,
    evaluate::outcomes::{
        COST_KEY, LATENCY_KEY, MAX_ABS_VALUE, MINUTE_ROLLUP_DAYS, OutcomeBucket, SECOND_ROLLUP_HOURS, TOKENS_KEY,
        rollup_reads, rollup_window,
    },
    evaluate::stats::Moments,
};

/// Whether a delta adds a trace's contribution or takes it back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Sign {
    Credit,
    Retract,
}

/// Which of the traces named count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Counted {
    /// Those not quarantined (what they contribute now).
    Unquarantined,
    /// All of them, quarantined or not (what they contributed before a
    /// quarantine just set, or contribute after one just lifted).
    All,
}

/// The rewards of one version on one task, as the rater compares arms on them.
use crate::evaluate::rater::TaskRewards;

const OUTCOME_COLUMNS: &str = "prompt_id, version, width, start_secs, traces, with_feedback, success_trials, successes, \
     score_n, score_sum, score_sq, tokens_n, tokens_sum, tokens_sq, cost_n, cost_sum, cost_sq, latency_n, latency_sum, \
     latency_sq, judged";

pub(crate) const TIER_WIDTHS: &str =
    "(SELECT 1 AS width UNION ALL SELECT 60 UNION ALL SELECT 3600 UNION ALL SELECT 86400) w";

/// The task rollups' tiers: seconds for the edges, minutes for the rest.
pub(crate) const TASK_WIDTHS: &str = "(SELECT 1 AS width UNION ALL SELECT 60) w";

/// Widths the task rollups keep, coarsest first.
const TASK_TIERS: [i64; 2] = [60, 1];

/// SQL: the outcome columns of one trace row `t`, read from its feedback and
/// metadata: `success` (1.0 / 0.0, or NULL), `rewarded` (it carries a
/// success flag or a numeric score), `score`, and the usage `tokens`, `cost`
/// and `latency`: what the outcome rollups sum.
fn outcome_columns<D: Dialect>() -> String {
    format!(
        "{success} AS success, ({is_flag} OR {is_number}) AS rewarded, {score} AS score, {tokens} AS tokens, \
         {cost} AS cost, {latency} AS latency, CASE WHEN t.feedback_source = 'judge' THEN 1 END AS judged",
        success = D::json_flag("t.feedback", "success"),
        is_flag = D::json_is("t.feedback", "success", "boolean"),
        is_number = D::json_is("t.feedback", "score", "number"),
        score = D::json_number("t.feedback", "score"),
        tokens = D::json_number("t.metadata", TOKENS_KEY),
        cost = D::json_number("t.metadata", COST_KEY),
        latency = D::json_number("t.metadata", LATENCY_KEY),
    )
}

/// One new trace's outcome columns, read by [`outcome_columns`]'s and
/// [`task_reward_columns`]'s rules from the fields its request already parsed
/// (a new trace has no judge's feedback yet): what a trace write adds to the
/// rollups without Postgres reading each trace's JSON again. The rules are the
/// SQL's (and `tests/it/lifecycle.rs` holds the rollups of traces written this
/// way and taken back by the SQL to a scan of the rows).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct NewTraceOutcome {
    /// 1.0 or 0.0 for `feedback.success`.
    pub success: Option<f64>,
    /// It carries a success flag or a numeric score.
    pub rewarded: bool,
    /// `score`, `tokens`, `cost` and `latency`, as [`MOMENTS`] names them.
    pub moments: [Option<f64>; 4],
    /// What the task rollups sum: the success flag, else the score.
    pub reward: Option<f64>,
}

impl NewTraceOutcome {
    pub(crate) fn of(feedback: &crate::domain::Feedback, metadata: &serde_json::Value) -> Self {
        let bounded = |v: f64| (v.abs() <= MAX_ABS_VALUE).then_some(v);
        let usage = |key: &str| metadata.get(key).and_then(serde_json::Value::as_f64).and_then(bounded);
        let success = feedback.success.map(|s| if s { 1.0 } else { 0.0 });
        let score = feedback.score.and_then(bounded);
        NewTraceOutcome {
            success,
            rewarded: feedback.success.is_some() || feedback.score.is_some(),
            moments: [score, usage(TOKENS_KEY), usage(COST_KEY), usage(LATENCY_KEY)],
            reward: success.or(score),
        }
    }

    /// The task key the task rollups file it under (`metadata.task_key`, a string).
    pub(crate) fn task_key(metadata: &serde_json::Value) -> Option<&str> {
        metadata.get("task_key").and_then(serde_json::Value::as_str)
    }
}

/// The moments (count, sum, sum of squares) of each of [`MOMENTS`] over the
/// rows of [`outcome_columns`], each term prefixed by `sign` (`-` to
/// retract); named `score_n`, `score_sum`, `score_sq`… when `named`.
fn moment_sums<D: Dialect>(sign: &str, named: bool) -> String {
    MOMENTS
        .map(|c| {
            let (n, sum, sq) = if named {
                (format!(" AS {c}_n"), format!(" AS {c}_sum"), format!(" AS {c}_sq"))
            } else {
                Default::default()
            };
            format!(
                "{sign}count({c}){n}, {sign}{}{sum}, {sign}{}{sq}",
                D::real(&format!("coalesce(sum({c}), 0)")),
                D::real(&format!("coalesce(sum({c} * {c}), 0)"))
            )
        })
        .join(", ")
}

/// The outcomes kept as moments, as [`outcome_columns`] names them.
const MOMENTS: [&str; 4] = ["score", "tokens", "cost", "latency"];

/// SQL: the `task_key` and `reward` columns of one trace row `t` (the reward:
/// 1.0 / 0.0 for `feedback.success`, else `feedback.score`), what the task
/// rollups sum; `keyed` is true when the trace names a task.
fn task_reward_columns<D: Dialect>() -> (String, String) {
    let columns = format!(
        "{task_key} AS task_key, CASE WHEN {is_flag} THEN {flag} ELSE {score} END AS reward",
        task_key = D::json_text("t.metadata", "task_key"),
        is_flag = D::json_is("t.feedback", "success", "boolean"),
        flag = D::json_flag("t.feedback", "success"),
        score = D::json_number("t.feedback", "score"),
    );
    (columns, D::json_is("t.metadata", "task_key", "string"))
}

/// An `INSERT … SELECT` appending the outcome deltas of the rows of `source`
/// (aliased `t`, with `prompt_id`, `prompt_version`, `feedback`, `feedback_source`,
/// `metadata`, `created_at`) that match `cond`: one row per tier and (version,
/// bucket), or on a store that keeps one row per key, added to that row.
pub(crate) fn outcome_delta_sql<D: Dialect>(source: &str, cond: &str, sign: Sign) -> String {
    let s = if sign == Sign::Retract { "-" } else { "" };
    // Each trace's outcome columns are read from its JSON once and summed
    // per second; only those sums (one row per second the traces fall in, a
    // single one for a write's new traces) are joined to the tiers. Joined
    // per trace, every trace was hashed and bucketed once per tier.
    let sums = summed(s, OUTCOME_COLUMNS, OUTCOME_KEY);
    format!(
        "INSERT INTO outcome_rollups ({OUTCOME_COLUMNS})
         WITH outcome_rows AS MATERIALIZED (
             SELECT t.prompt_id, coalesce(t.prompt_version, 0) AS version, {second} AS second, {outcome}
             FROM {source} WHERE {cond}),
         seconds AS (
             SELECT prompt_id, version, second, count(*) AS traces, count(CASE WHEN rewarded THEN 1 END) AS with_feedback,
                    count(success) AS success_trials, count(CASE WHEN success = 1 THEN 1 END) AS successes,
                    {moments}, count(judged) AS judged
             FROM outcome_rows GROUP BY prompt_id, version, second)
         SELECT prompt_id, version, width, start_secs, {sums}
         FROM (SELECT t.*, w.width, (t.second / w.width) * w.width AS start_secs FROM seconds t CROSS JOIN {TIER_WIDTHS}) v
         GROUP BY prompt_id, version, width, start_secs{fold}",
        second = D::bucket_start("1"),
        moments = moment_sums::<D>("", true),
        outcome = outcome_columns::<D>(),
        fold = fold_into_key_row::<D>(OUTCOME_KEY, OUTCOME_COLUMNS),
    )
}

/// The same for the per-task reward rows: rewarded traces that name a
/// version and carry a string `metadata.task_key`, per minute and per second.
pub(crate) fn task_delta_sql<D: Dialect>(source: &str, cond: &str, sign: Sign) -> String {
    let s = if sign == Sign::Retract { "-" } else { "" };
    let (reward, keyed) = task_reward_columns::<D>();
    // Read once per trace and summed per second, then joined to the tiers
    // (as the outcome deltas).
    format!(
        "INSERT INTO task_rollups ({TASK_COLUMNS})
         WITH task_rows AS MATERIALIZED (
             SELECT t.prompt_id, t.prompt_version AS version, {second} AS second, {reward}
             FROM {source} WHERE {cond} AND t.prompt_version IS NOT NULL AND {keyed}),
         seconds AS (
             SELECT prompt_id, version, task_key, second, count(*) AS traces, {total} AS reward_sum
             FROM task_rows WHERE reward IS NOT NULL GROUP BY prompt_id, version, task_key, second)
         SELECT prompt_id, version, task_key, width, start_secs, {sums}
         FROM (SELECT t.*, w.width, (t.second / w.width) * w.width AS start_secs FROM seconds t CROSS JOIN {TASK_WIDTHS}) r
         GROUP BY prompt_id, version, task_key, width, start_secs{fold}",
        second = D::bucket_start("1"),
        total = D::real("sum(reward)"),
        sums = summed(s, TASK_COLUMNS, TASK_KEY),
        fold = fold_into_key_row::<D>(TASK_KEY, TASK_COLUMNS),
    )
}

/// Where each key keeps one row ([`Dialect::ROLLUP_ROW_PER_KEY`]), the
/// clause that adds a delta row's sums to the key's row instead of
/// appending it; elsewhere nothing.
fn fold_into_key_row<D: Dialect>(key: &str, columns: &str) -> String {
    if !D::ROLLUP_ROW_PER_KEY {
        return String::new();
    }
    let sums = each_sum(columns, key, |c| format!("{c} = {c} + excluded.{c}"));
    format!(" ON CONFLICT ({key}) DO UPDATE SET {sums}")
}

/// Appends the deltas of the stored traces `ids` (inside the caller's transaction).
pub(crate) async fn account<D: Dialect>(
    c: &mut D::Connection,
    ids: &[Uuid],
    sign: Sign,
    counted: Counted,
) -> StoreResult<()> {
    if ids.is_empty() {
        return Ok(());
    }
    let mut cond = D::any_of("t.id", "$1");
    if counted == Counted::Unquarantined {
        cond.push_str(" AND t.quarantined_at IS NULL");
    }
    for text in [outcome_delta_sql::<D>("traces t", &cond, sign), task_delta_sql::<D>("traces t", &cond, sign)] {
        sql::<D>(&text).bind(Param::Ids(Some(ids))).execute(c).await?;
    }
    Ok(())
}

/// `versions` as runs of consecutive numbers, `(first, last)`, ascending.
fn version_runs(versions: &[i64]) -> Vec<(i64, i64)> {
    let mut sorted = versions.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut runs: Vec<(i64, i64)> = Vec::new();
    for v in sorted {
        match runs.last_mut() {
            Some((_, last)) if *last + 1 == v => *last = v,
            _ => runs.push((v, v)),
        }
    }
    runs
}

/// [`super::Store::version_outcomes`]: the window as [`rollup_window`] keeps
/// it, read from the coarsest rollup rows that fit (whole days, hours and
/// minutes; seconds at a recent window's partial minutes); only the
/// `versions` given (0: traces that named none), when given.
///
/// The version is the last column of the rollups' window index, and each
/// run of consecutive versions is its own range condition next to the
/// window's, so the rows of versions left out are skipped inside one index
/// scan per (range, run) and never read from the table. (A list, `= ANY`,
/// would be one index scan per version on Postgres 15, each walking the
/// whole range.)
pub(crate) async fn read_version_outcomes<D: Backend>(
    s: &SqlStore<D>,
    prompt: &PromptName,
    from: DateTime<Utc>,
    until: DateTime<Utc>,
    bucket_secs: i64,
    versions: Option<&[i64]>,
) -> StoreResult<Vec<OutcomeBucket>> {
    if versions.is_some_and(<[i64]>::is_empty) {
        return Ok(Vec::new());
    }
    let (from, until, bucket) = rollup_window(from, until, bucket_secs, Utc::now());
    let reads = rollup_reads(from.timestamp(), until.timestamp(), bucket);
    if reads.is_empty() {
        return Ok(Vec::new());
    }
    // Parameters are numbered in the order they are bound.
    let mut n = 3; // $1 the prompt's name, $2 its project, $3 the bucket width
    let mut param = || {
        n += 1;
        format!("${n}")
    };
    let ranges: Vec<String> = reads
        .iter()
        .map(|_| format!("width = {} AND start_secs >= {} AND start_secs < {}", param(), param(), param()))
        .collect();
    let runs = versions.map(version_runs).unwrap_or_default();
    let ranges = match versions {
        None => ranges.iter().map(|r| format!("({r})")).collect::<Vec<_>>().join(" OR "),
        Some(_) => {
            let runs: Vec<String> =
                runs.iter().map(|_| format!("version >= {} AND version <= {}", param(), param())).collect();
            ranges
                .iter()
                .flat_map(|r| runs.iter().map(move |v| format!("({r} AND {v})")))
                .collect::<Vec<_>>()
                .join(" OR ")
        }
    };
    let counts = ["traces", "with_feedback", "success_trials", "successes", "judged"]
        .map(|c| format!("CAST(sum({c}) AS BIGINT) AS {c}"))
        .join(", ");
    let moments = MOMENTS
        .map(|c| {
            format!(
                "CAST(sum({c}_n) AS BIGINT) AS {c}_n, {} AS {c}_sum, {} AS {c}_sq",
                D::real(&format!("sum({c}_sum)")),
                D::real(&format!("sum({c}_sq)"))
            )
        })
        .join(", ");
    let text = format!(
        "SELECT NULLIF(version, 0) AS version, (start_secs / $3) * $3 AS start, {counts}, {moments}
         FROM outcome_rollups WHERE prompt_id = (SELECT id FROM prompts WHERE name = $1 AND project = $2)
           AND ({ranges})
         GROUP BY 1, 2 HAVING sum(traces) > 0"
    );
    let mut query = sql::<D>(&text).bind(prompt.as_str()).bind(prompt.project()).bind(bucket);
    for (w, a, b) in reads {
        query = query.bind(w).bind(a).bind(b);
    }
    for (first, last) in runs {
        query = query.bind(first).bind(last);
    }
    query.map(&mut *s.reader.acquire().await?, outcome_bucket_from_row::<D>).await
}

/// [`super::Store::task_rewards`]: the window as [`rollup_window`] keeps it,
/// from the task rollups' minute rows, and their second rows at a recent
/// window's partial minutes.
pub(crate) async fn read_task_rewards<D: Backend>(
    s: &SqlStore<D>,
    prompt: &PromptName,
    from: DateTime<Utc>,
    until: DateTime<Utc>,
) -> StoreResult<Vec<TaskRewards>> {
    let (from, until, _) = rollup_window(from, until, 60, Utc::now());
    // Minute rows for whole minutes, second rows for the rest (the tiers that divide a minute).
    let reads: Vec<(i64, i64, i64)> = rollup_reads(from.timestamp(), until.timestamp(), 60)
        .into_iter()
        .inspect(|(w, _, _)| debug_assert!(TASK_TIERS.contains(w)))
        .collect();
    if reads.is_empty() {
        return Ok(Vec::new());
    }
    let mut n = 2; // $1 the prompt's name, $2 its project
    let mut param = || {
        n += 1;
        format!("${n}")
    };
    let ranges = reads
        .iter()
        .map(|_| format!("(width = {} AND start_secs >= {} AND start_secs < {})", param(), param(), param()))
        .collect::<Vec<_>>()
        .join(" OR ");
    let text = format!(
        "SELECT version, task_key, CAST(sum(traces) AS BIGINT) AS n, {total} AS total FROM task_rollups
         WHERE prompt_id = (SELECT id FROM prompts WHERE name = $1 AND project = $2) AND ({ranges})
         GROUP BY version, task_key HAVING sum(traces) > 0",
        total = D::real("sum(reward_sum)"),
    );
    let mut query = sql::<D>(&text).bind(prompt.as_str()).bind(prompt.project());
    for (w, a, b) in reads {
        query = query.bind(w).bind(a).bind(b);
    }
    let mut rows = query
        .map(&mut *s.reader.acquire().await?, |row| {
            let r = Cols::<D>(row);
            Ok(TaskRewards {
                version: r.get::<i64>("version")?,
                task_key: r.get::<String>("task_key")?,
                traces: r.get::<i64>("n")?.max(0) as u64,
                reward_sum: r.get::<f64>("total")?,
            })
        })
        .await?;
    // By version, then task key as bytes (not as the database collates text).
    rows.sort_by(|a, b| (a.version, &a.task_key).cmp(&(b.version, &b.task_key)));
    Ok(rows)
}

/// Upkeep of the rollups, run by the worker.
#[async_trait]
pub trait Rollups: Send + Sync {
    /// Folds the rows of up to `limit` keys that have uncompacted rows into one
    /// row per key (a key whose traces all went is dropped); how many rows
    /// were folded. Sums are unchanged, whatever writes run meanwhile. Where
    /// each key keeps one row ([`Dialect::ROLLUP_ROW_PER_KEY`]), drops up to
    /// `limit` rows of keys whose traces all went; how many.
    async fn compact_rollups(&self, limit: u32) -> StoreResult<u64>;
    /// Deletes up to `limit` of the prompt's rows of one pruned tier (`width`
    /// 60: minute rows, 1: second rows; outcome and task rollups) that start
    /// before `before`; how many.
    async fn prune_rollups(
        &self,
        prompt: &PromptName,
        width: i64,
        before: DateTime<Utc>,
        limit: u32,
    ) -> StoreResult<u64>;
}

/// Minute rows start this long before now at the latest when they are pruned
/// (a day more than readers use them, see [`MINUTE_ROLLUP_DAYS`]).
pub fn minute_rollup_cutoff(now: DateTime<Utc>) -> DateTime<Utc> {
    now - chrono::Duration::days(MINUTE_ROLLUP_DAYS + 1)
}

/// Second rows start this long before now at the latest when they are pruned
/// (an hour more than readers use them, see [`SECOND_ROLLUP_HOURS`]).
pub fn second_rollup_cutoff(now: DateTime<Utc>) -> DateTime<Utc> {
    now - chrono::Duration::hours(SECOND_ROLLUP_HOURS + 1)
}

const OUTCOME_KEY: &str = "prompt_id, version, width, start_secs";
const TASK_KEY: &str = "prompt_id, version, task_key, width, start_secs";
const TASK_COLUMNS: &str = "prompt_id, version, task_key, width, start_secs, traces, reward_sum";

/// `sum(c)` of each of `columns` outside `key`, each prefixed by `sign`: how
/// rows of one key add up.
fn summed(sign: &str, columns: &str, key: &str) -> String {
    each_sum(columns, key, |c| format!("{sign}sum({c})"))
}

/// `term(c)` for each of `columns` (a rollup table's, comma-separated) that
/// is not part of `key`: the columns that add up, joined with commas.
fn each_sum(columns: &str, key: &str, term: impl Fn(&str) -> String) -> String {
    let key: Vec<&str> = key.split(", ").collect();
    columns.split(", ").filter(|c| !key.contains(c)).map(term).collect::<Vec<_>>().join(", ")
}

#[async_trait]
impl<D: Backend> Rollups for SqlStore<D> {
    async fn compact_rollups(&self, limit: u32) -> StoreResult<u64> {
        let mut folded = 0;
        for (table, key, columns) in
            [("outcome_rollups", OUTCOME_KEY, OUTCOME_COLUMNS), ("task_rollups", TASK_KEY, TASK_COLUMNS)]
        {
            folded += if D::ROLLUP_ROW_PER_KEY {
                // One row per key, which writes add to: nothing to fold, and a
                // key whose traces all went is dropped.
                let n = sql::<D>(&format!(
                    "DELETE FROM {table} WHERE id IN (SELECT id FROM {table} WHERE traces = 0 LIMIT $1)"
                ))
                .bind(i64::from(limit))
                .execute(&mut *self.writer.acquire().await?)
                .await?;
                Some(n as i64)
            } else {
                // One statement, one snapshot: exactly the rows it deletes are
                // summed; rows committed meanwhile stay for the next pass, and a
                // concurrent compactor's deletes are skipped, not summed twice.
                let sums = summed("", columns, key);
                let matches = key.split(", ").map(|k| format!("r.{k} = k.{k}")).collect::<Vec<_>>().join(" AND ");
                let text = format!(
                    "WITH k AS (SELECT DISTINCT {key} FROM (SELECT {key} FROM {table} WHERE NOT compacted
                                                      ORDER BY id LIMIT $1) u),
                          gone AS (DELETE FROM {table} r USING k WHERE {matches} RETURNING r.*),
                          put AS (INSERT INTO {table} ({columns}, compacted)
                                  SELECT {key}, {sums}, TRUE FROM gone GROUP BY {key} HAVING sum(traces) <> 0)
                     SELECT count(*) AS n FROM gone"
                );
                sql::<D>(&text).bind(i64::from(limit)).value::<i64>(&mut *self.writer.acquire().await?, "n").await?
            }
            .unwrap_or(0)
            .max(0) as u64;
        }
        Ok(folded)
    }

    async fn prune_rollups(
        &self,
        prompt: &PromptName,
        width: i64,
        before: DateTime<Utc>,
        limit: u32,
    ) -> StoreResult<u64> {
        let before = before.timestamp();
        let mut n = 0;
        for table in ["outcome_rollups", "task_rollups"] {
            n += sql::<D>(&format!(
                "DELETE FROM {table} WHERE id IN (
                     SELECT id FROM {table} WHERE prompt_id = (SELECT id FROM prompts WHERE name = $3 AND project = $5)
                       AND width = $4 AND start_secs < $1 LIMIT $2)"
            ))
            .bind(before)
            .bind(i64::from(limit))
            .bind(prompt.as_str())
            .bind(width)
            .bind(prompt.project())
            .execute(&mut *self.writer.acquire().await?)
            .await?;
        }
        Ok(n)
    }
}

/// One row of the outcome aggregate query.
pub(super) fn outcome_bucket_from_row<D: Dialect>(row: &D::Row) -> StoreResult<OutcomeBucket> {
    let r = Cols::<D>(row);
    let count = |c: &str| -> StoreResult<u64> { Ok(u64::try_from(r.get::<i64>(c)?).unwrap_or(0)) };
    let moments = |p: &str| -> StoreResult<Moments> {
        Ok(Moments {
            count: count(&format!("{p}_n"))?,
            sum: r.get(&format!("{p}_sum"))?,
            sum_sq: r.get(&format!("{p}_sq"))?,
        })
    };
    Ok(OutcomeBucket {
        version: r.get("version")?,
        start: r.get("start")?,
        traces: count("traces")?,
        with_feedback: count("with_feedback")?,
        success_trials: count("success_trials")?,
        successes: count("successes")?,
        judged: count("judged")?,
        score: moments("score")?,
        tokens: moments("tokens")?,
        cost_usd: moments("cost")?,
        latency_ms: moments("latency")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_are_read_as_runs_of_consecutive_numbers() {
        assert_eq!(version_runs(&[7, 0, 5, 6, 1, 9, 6]), vec![(0, 1), (5, 7), (9, 9)]);
        assert_eq!(version_runs(&[3]), vec![(3, 3)]);
        assert!(version_runs(&[]).is_empty());
    }
}
