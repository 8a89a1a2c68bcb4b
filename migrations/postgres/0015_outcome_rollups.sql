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
    id              bigserial PRIMARY KEY,
    prompt_id       uuid NOT NULL REFERENCES prompts (id),
    version         bigint NOT NULL,
    width           integer NOT NULL CHECK (width IN (60, 3600, 86400)),
    start_secs      bigint NOT NULL,   -- Unix seconds, a multiple of width
    traces          bigint NOT NULL,
    with_feedback   bigint NOT NULL,
    success_trials  bigint NOT NULL,
    successes       bigint NOT NULL,
    score_n         bigint NOT NULL,
    score_sum       double precision NOT NULL,
    score_sq        double precision NOT NULL,
    tokens_n        bigint NOT NULL,
    tokens_sum      double precision NOT NULL,
    tokens_sq       double precision NOT NULL,
    cost_n          bigint NOT NULL,
    cost_sum        double precision NOT NULL,
    cost_sq         double precision NOT NULL,
    latency_n       bigint NOT NULL,
    latency_sum     double precision NOT NULL,
    latency_sq      double precision NOT NULL,
    compacted       boolean NOT NULL DEFAULT false
);
CREATE INDEX outcome_rollups_by_window ON outcome_rollups (prompt_id, width, start_secs);
CREATE INDEX outcome_rollups_to_compact ON outcome_rollups (id) WHERE NOT compacted;

-- Rewards per (version, metadata.task_key, minute), for comparing arms on
-- matched work over the rater's window; pruned with the minute rows.
CREATE TABLE task_rollups (
    id          bigserial PRIMARY KEY,
    prompt_id   uuid NOT NULL REFERENCES prompts (id),
    version     bigint NOT NULL,
    task_key    text NOT NULL,
    start_secs  bigint NOT NULL,   -- Unix seconds, a multiple of 60
    traces      bigint NOT NULL,   -- rewarded traces
    reward_sum  double precision NOT NULL,
    compacted   boolean NOT NULL DEFAULT false
);
CREATE INDEX task_rollups_by_window ON task_rollups (prompt_id, start_secs);
CREATE INDEX task_rollups_to_compact ON task_rollups (id) WHERE NOT compacted;

-- The traces already stored, rolled up once (minute rows only for the last 8 days).
INSERT INTO outcome_rollups (prompt_id, version, width, start_secs, traces, with_feedback, success_trials, successes,
                             score_n, score_sum, score_sq, tokens_n, tokens_sum, tokens_sq, cost_n, cost_sum, cost_sq,
                             latency_n, latency_sum, latency_sq, compacted)
SELECT prompt_id, version, width, start_secs, count(*), count(CASE WHEN rewarded THEN 1 END), count(success),
       count(CASE WHEN success = 1 THEN 1 END),
       count(score), coalesce(sum(score), 0), coalesce(sum(score * score), 0),
       count(tokens), coalesce(sum(tokens), 0), coalesce(sum(tokens * tokens), 0),
       count(cost), coalesce(sum(cost), 0), coalesce(sum(cost * cost), 0),
       count(latency), coalesce(sum(latency), 0), coalesce(sum(latency * latency), 0), TRUE
FROM (
    SELECT t.prompt_id, coalesce(t.prompt_version, 0) AS version, w.width,
           floor(extract(epoch FROM t.created_at) / w.width)::bigint * w.width AS start_secs,
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
    FROM traces t CROSS JOIN (SELECT 60 AS width UNION ALL SELECT 3600 UNION ALL SELECT 86400) w
    WHERE t.quarantined_at IS NULL AND NOT (w.width = 60 AND t.created_at < now() - interval '8 days')) v
GROUP BY prompt_id, version, width, start_secs;

INSERT INTO task_rollups (prompt_id, version, task_key, start_secs, traces, reward_sum, compacted)
SELECT prompt_id, version, task_key, start_secs, count(*), sum(reward), TRUE
FROM (
    SELECT t.prompt_id, t.prompt_version AS version, t.metadata->>'task_key' AS task_key,
           floor(extract(epoch FROM t.created_at) / 60)::bigint * 60 AS start_secs,
           CASE WHEN jsonb_typeof(t.feedback->'success') = 'boolean'
                THEN CASE WHEN (t.feedback->>'success')::boolean THEN 1.0::float8 ELSE 0.0::float8 END
                ELSE CASE WHEN jsonb_typeof(t.feedback->'score') = 'number' THEN CASE WHEN abs((t.feedback->'score')::numeric)
                     <= 1000000000000 THEN (t.feedback->'score')::numeric::float8 END END END AS reward
    FROM traces t
    WHERE t.quarantined_at IS NULL AND t.prompt_version IS NOT NULL AND jsonb_typeof(t.metadata->'task_key') = 'string'
      AND t.created_at >= now() - interval '8 days') r
WHERE reward IS NOT NULL
GROUP BY prompt_id, version, task_key, start_secs;
