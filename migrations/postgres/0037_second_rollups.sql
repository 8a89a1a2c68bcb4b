-- Second rows: a recent window's edges are read to the second from rollup
-- rows, never from the trace rows, so a read of outcomes costs the same
-- however many traces arrived in the minutes at its edges. The outcome
-- rollups gain a tier of width 1; the task rollups, which had minute rows
-- only, gain a width (60 for the rows there are, 1 for second rows). Readers
-- use second rows for the last 2 hours and retention prunes them after 3;
-- the traces of the last 3 hours are rolled up into them once, here.
ALTER TABLE outcome_rollups DROP CONSTRAINT outcome_rollups_width_check;
ALTER TABLE outcome_rollups ADD CONSTRAINT outcome_rollups_width_check CHECK (width IN (1, 60, 3600, 86400));
ALTER TABLE task_rollups ADD COLUMN width integer NOT NULL DEFAULT 60 CHECK (width IN (1, 60));
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
       count(latency), coalesce(sum(latency), 0), coalesce(sum(latency * latency), 0), TRUE
FROM (
    SELECT t.prompt_id, coalesce(t.prompt_version, 0) AS version,
           floor(extract(epoch FROM t.created_at))::bigint AS start_secs,
           CASE WHEN jsonb_typeof(t.feedback->'success') = 'boolean'
                THEN CASE WHEN (t.feedback->>'success')::boolean THEN 1.0::float8 ELSE 0.0::float8 END END AS success,
           (jsonb_typeof(t.feedback->'success') = 'boolean' OR jsonb_typeof(t.feedback->'score') = 'number') AS rewarded,
           CASE WHEN jsonb_typeof(t.feedback->'score') = 'number' THEN CASE WHEN abs((t.feedback->'score')::numeric)
                <= 1000000000000 THEN (t.feedback->'score')::numeric::float8 END END AS score,
           CASE WHEN jsonb_typeof(t.metadata->'tokens') = 'number' THEN CASE WHEN abs((t.metadata->'tokens')::numeric)
                <= 1000000000000 THEN (t.metadata->'tokens')::numeric::float8 END END AS tokens,
           CASE WHEN jsonb_typeof(t.metadata->'cost_usd') = 'number' THEN CASE WHEN abs((t.metadata->'cost_usd')::numeric)
                <= 1000000000000 THEN (t.metadata->'cost_usd')::numeric::float8 END END AS cost,
           CASE WHEN jsonb_typeof(t.metadata->'latency_ms') = 'number' THEN CASE WHEN abs((t.metadata->'latency_ms')::numeric)
                <= 1000000000000 THEN (t.metadata->'latency_ms')::numeric::float8 END END AS latency
    FROM traces t
    WHERE t.quarantined_at IS NULL AND t.created_at >= now() - interval '3 hours') v
GROUP BY prompt_id, version, start_secs;

INSERT INTO task_rollups (prompt_id, version, task_key, width, start_secs, traces, reward_sum, compacted)
SELECT prompt_id, version, task_key, 1, start_secs, count(*), sum(reward), TRUE
FROM (
    SELECT t.prompt_id, t.prompt_version AS version, t.metadata->>'task_key' AS task_key,
           floor(extract(epoch FROM t.created_at))::bigint AS start_secs,
           CASE WHEN jsonb_typeof(t.feedback->'success') = 'boolean'
                THEN CASE WHEN (t.feedback->>'success')::boolean THEN 1.0::float8 ELSE 0.0::float8 END
                ELSE CASE WHEN jsonb_typeof(t.feedback->'score') = 'number' THEN CASE WHEN abs((t.feedback->'score')::numeric)
                     <= 1000000000000 THEN (t.feedback->'score')::numeric::float8 END END END AS reward
    FROM traces t
    WHERE t.quarantined_at IS NULL AND t.prompt_version IS NOT NULL AND jsonb_typeof(t.metadata->'task_key') = 'string'
      AND t.created_at >= now() - interval '3 hours') r
WHERE reward IS NOT NULL
GROUP BY prompt_id, version, task_key, start_secs;
