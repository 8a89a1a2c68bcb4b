-- Second rows: a recent window's edges are read to the second from rollup
-- rows, never from the trace rows, so a read of outcomes costs the same
-- however many traces arrived in the minutes at its edges. The outcome
-- rollups gain a tier of width 1 (the table is rebuilt: its CHECK names the
-- widths); the task rollups, which had minute rows only, gain a width (60 for
-- the rows there are, 1 for second rows). Readers use second rows for the
-- last 2 hours and retention prunes them after 3; the traces of the last 3
-- hours are rolled up into them once, here.
CREATE TABLE outcome_rollups_new (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    prompt_id       TEXT NOT NULL REFERENCES prompts (id),
    version         INTEGER NOT NULL,
    width           INTEGER NOT NULL CHECK (width IN (1, 60, 3600, 86400)),
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
INSERT INTO outcome_rollups_new SELECT id, prompt_id, version, width, start_secs, traces, with_feedback, success_trials,
       successes, score_n, score_sum, score_sq, tokens_n, tokens_sum, tokens_sq, cost_n, cost_sum, cost_sq, latency_n,
       latency_sum, latency_sq, compacted FROM outcome_rollups;
DROP TABLE outcome_rollups;
ALTER TABLE outcome_rollups_new RENAME TO outcome_rollups;
CREATE INDEX outcome_rollups_by_window_and_version ON outcome_rollups (prompt_id, width, start_secs, version);
CREATE INDEX outcome_rollups_to_compact ON outcome_rollups (id) WHERE compacted = 0;

ALTER TABLE task_rollups ADD COLUMN width INTEGER NOT NULL DEFAULT 60 CHECK (width IN (1, 60));
CREATE INDEX task_rollups_by_window_and_width ON task_rollups (prompt_id, width, start_secs);
DROP INDEX task_rollups_by_window;

INSERT INTO outcome_rollups (prompt_id, version, width, start_secs, traces, with_feedback, success_trials, successes,
                             score_n, score_sum, score_sq, tokens_n, tokens_sum, tokens_sq, cost_n, cost_sum, cost_sq,
                             latency_n, latency_sum, latency_sq, compacted)
SELECT prompt_id, version, 1, start_secs, count(*), count(CASE WHEN rewarded THEN 1 END), count(success),
       count(CASE WHEN success = 1 THEN 1 END),
       count(score), coalesce(sum(score), 0), coalesce(sum(score * score), 0),
       count(tokens), coalesce(sum(tokens), 0), coalesce(sum(tokens * tokens), 0),
       count(cost), coalesce(sum(cost), 0), coalesce(sum(cost * cost), 0),
       count(latency), coalesce(sum(latency), 0), coalesce(sum(latency * latency), 0), 1
FROM (
    SELECT t.prompt_id, coalesce(t.prompt_version, 0) AS version, t.created_at / 1000000 AS start_secs,
           CASE json_type(t.feedback, '$.success') WHEN 'true' THEN 1.0 WHEN 'false' THEN 0.0 END AS success,
           (json_type(t.feedback, '$.success') IN ('true', 'false') OR json_type(t.feedback, '$.score') IN ('integer', 'real')) AS rewarded,
           CASE WHEN json_type(t.feedback, '$.score') IN ('integer', 'real') AND abs(json_extract(t.feedback, '$.score')) <= 1000000000000 THEN CAST(json_extract(t.feedback, '$.score') AS REAL) END AS score,
           CASE WHEN json_type(t.metadata, '$.tokens') IN ('integer', 'real') AND abs(json_extract(t.metadata, '$.tokens')) <= 1000000000000 THEN CAST(json_extract(t.metadata, '$.tokens') AS REAL) END AS tokens,
           CASE WHEN json_type(t.metadata, '$.cost_usd') IN ('integer', 'real') AND abs(json_extract(t.metadata, '$.cost_usd')) <= 1000000000000 THEN CAST(json_extract(t.metadata, '$.cost_usd') AS REAL) END AS cost,
           CASE WHEN json_type(t.metadata, '$.latency_ms') IN ('integer', 'real') AND abs(json_extract(t.metadata, '$.latency_ms')) <= 1000000000000 THEN CAST(json_extract(t.metadata, '$.latency_ms') AS REAL) END AS latency
    FROM traces t
    WHERE t.quarantined_at IS NULL AND t.created_at >= (CAST(strftime('%s', 'now') AS INTEGER) - 3 * 3600) * 1000000) v
GROUP BY prompt_id, version, start_secs;

INSERT INTO task_rollups (prompt_id, version, task_key, width, start_secs, traces, reward_sum, compacted)
SELECT prompt_id, version, task_key, 1, start_secs, count(*), sum(reward), 1
FROM (
    SELECT t.prompt_id, t.prompt_version AS version, json_extract(t.metadata, '$.task_key') AS task_key,
           t.created_at / 1000000 AS start_secs,
           CASE WHEN json_type(t.feedback, '$.success') IN ('true', 'false') THEN CASE json_type(t.feedback, '$.success') WHEN 'true' THEN 1.0 WHEN 'false' THEN 0.0 END
                ELSE CASE WHEN json_type(t.feedback, '$.score') IN ('integer', 'real') AND abs(json_extract(t.feedback, '$.score')) <= 1000000000000 THEN CAST(json_extract(t.feedback, '$.score') AS REAL) END END AS reward
    FROM traces t
    WHERE t.quarantined_at IS NULL AND t.prompt_version IS NOT NULL AND json_type(t.metadata, '$.task_key') = 'text'
      AND t.created_at >= (CAST(strftime('%s', 'now') AS INTEGER) - 3 * 3600) * 1000000) r
WHERE reward IS NOT NULL
GROUP BY prompt_id, version, task_key, start_secs;
