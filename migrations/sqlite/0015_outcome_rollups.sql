-- Per-version outcome rollups, so that metrics, Prometheus gauges, the
-- population rater and the regression guard read O(buckets) rows instead of
-- every trace, and outcomes survive the deletion of old traces by retention.
--
-- Every write that changes what a trace counts for (insert, late feedback,
-- quarantine and release, an operator's delete, an OTLP re-map) appends
-- signed delta rows in the same transaction: the trace's old contribution
-- negated, its new one added. Rows are only ever inserted on the write path
-- (no row is updated, so concurrent writers never wait on each other); a
-- worker job folds the rows of each key into one `compacted` row. A reader
-- sums whatever rows a key has, compacted or not.
--
-- Three tiers (width 60, 3600 and 86400 seconds): a window is read from the
-- coarsest rows that fit inside it. `version` 0 stands for traces that named
-- no version. Minute rows older than 8 days are pruned by retention; hour and
-- day rows are kept.
CREATE TABLE outcome_rollups (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    prompt_id       TEXT NOT NULL REFERENCES prompts (id),
    version         INTEGER NOT NULL,
    width           INTEGER NOT NULL CHECK (width IN (60, 3600, 86400)),
    start_secs      INTEGER NOT NULL,   -- Unix seconds, a multiple of width
    traces          INTEGER NOT NULL,
    with_feedback   INTEGER NOT NULL,
    success_trials  INTEGER NOT NULL,
    successes       INTEGER NOT NULL,
    score_n         INTEGER NOT NULL,
    score_sum       REAL NOT NULL,
    score_sq        REAL NOT NULL,
    tokens_n        INTEGER NOT NULL,
    tokens_sum      REAL NOT NULL,
    tokens_sq       REAL NOT NULL,
    cost_n          INTEGER NOT NULL,
    cost_sum        REAL NOT NULL,
    cost_sq         REAL NOT NULL,
    latency_n       INTEGER NOT NULL,
    latency_sum     REAL NOT NULL,
    latency_sq      REAL NOT NULL,
    compacted       INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX outcome_rollups_by_window ON outcome_rollups (prompt_id, width, start_secs);
CREATE INDEX outcome_rollups_to_compact ON outcome_rollups (id) WHERE compacted = 0;

-- Rewards per (version, metadata.task_key, minute), for comparing arms on
-- matched work over the rater's window; pruned with the minute rows.
CREATE TABLE task_rollups (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    prompt_id   TEXT NOT NULL REFERENCES prompts (id),
    version     INTEGER NOT NULL,
    task_key    TEXT NOT NULL,
    start_secs  INTEGER NOT NULL,   -- Unix seconds, a multiple of 60
    traces      INTEGER NOT NULL,   -- rewarded traces
    reward_sum  REAL NOT NULL,
    compacted   INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX task_rollups_by_window ON task_rollups (prompt_id, start_secs);
CREATE INDEX task_rollups_to_compact ON task_rollups (id) WHERE compacted = 0;

-- The traces already stored, rolled up once (minute rows only for the last 8 days).
INSERT INTO outcome_rollups (prompt_id, version, width, start_secs, traces, with_feedback, success_trials, successes,
                             score_n, score_sum, score_sq, tokens_n, tokens_sum, tokens_sq, cost_n, cost_sum, cost_sq,
                             latency_n, latency_sum, latency_sq, compacted)
SELECT prompt_id, version, width, start_secs, count(*), count(CASE WHEN rewarded THEN 1 END), count(success),
       count(CASE WHEN success = 1 THEN 1 END),
       count(score), coalesce(sum(score), 0), coalesce(sum(score * score), 0),
       count(tokens), coalesce(sum(tokens), 0), coalesce(sum(tokens * tokens), 0),
       count(cost), coalesce(sum(cost), 0), coalesce(sum(cost * cost), 0),
       count(latency), coalesce(sum(latency), 0), coalesce(sum(latency * latency), 0), 1
FROM (
    SELECT t.prompt_id, coalesce(t.prompt_version, 0) AS version, w.width,
           (t.created_at / (w.width * 1000000)) * w.width AS start_secs,
           CASE json_type(t.feedback, '$.success') WHEN 'true' THEN 1.0 WHEN 'false' THEN 0.0 END AS success,
           (json_type(t.feedback, '$.success') IN ('true', 'false') OR json_type(t.feedback, '$.score') IN ('integer', 'real')) AS rewarded,
           CASE WHEN json_type(t.feedback, '$.score') IN ('integer', 'real') AND abs(json_extract(t.feedback, '$.score')) <= 1000000000000 THEN CAST(json_extract(t.feedback, '$.score') AS REAL) END AS score,
           CASE WHEN json_type(t.metadata, '$.tokens') IN ('integer', 'real') AND abs(json_extract(t.metadata, '$.tokens')) <= 1000000000000 THEN CAST(json_extract(t.metadata, '$.tokens') AS REAL) END AS tokens,
           CASE WHEN json_type(t.metadata, '$.cost_usd') IN ('integer', 'real') AND abs(json_extract(t.metadata, '$.cost_usd')) <= 1000000000000 THEN CAST(json_extract(t.metadata, '$.cost_usd') AS REAL) END AS cost,
           CASE WHEN json_type(t.metadata, '$.latency_ms') IN ('integer', 'real') AND abs(json_extract(t.metadata, '$.latency_ms')) <= 1000000000000 THEN CAST(json_extract(t.metadata, '$.latency_ms') AS REAL) END AS latency
    FROM traces t CROSS JOIN (SELECT 60 AS width UNION ALL SELECT 3600 UNION ALL SELECT 86400) w
    WHERE t.quarantined_at IS NULL AND NOT (w.width = 60 AND t.created_at < (CAST(strftime('%s', 'now') AS INTEGER) - 8 * 86400) * 1000000)) v
GROUP BY prompt_id, version, width, start_secs;

INSERT INTO task_rollups (prompt_id, version, task_key, start_secs, traces, reward_sum, compacted)
SELECT prompt_id, version, task_key, start_secs, count(*), sum(reward), 1
FROM (
    SELECT t.prompt_id, t.prompt_version AS version, json_extract(t.metadata, '$.task_key') AS task_key,
           (t.created_at / 60000000) * 60 AS start_secs,
           CASE WHEN json_type(t.feedback, '$.success') IN ('true', 'false') THEN CASE json_type(t.feedback, '$.success') WHEN 'true' THEN 1.0 WHEN 'false' THEN 0.0 END
                ELSE CASE WHEN json_type(t.feedback, '$.score') IN ('integer', 'real') AND abs(json_extract(t.feedback, '$.score')) <= 1000000000000 THEN CAST(json_extract(t.feedback, '$.score') AS REAL) END END AS reward
    FROM traces t
    WHERE t.quarantined_at IS NULL AND t.prompt_version IS NOT NULL AND json_type(t.metadata, '$.task_key') = 'text'
      AND t.created_at >= (CAST(strftime('%s', 'now') AS INTEGER) - 8 * 86400) * 1000000) r
WHERE reward IS NOT NULL
GROUP BY prompt_id, version, task_key, start_secs;
