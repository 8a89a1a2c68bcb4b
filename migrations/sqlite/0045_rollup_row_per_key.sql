-- On the embedded store each rollup key keeps one row, and every write adds
-- its deltas to it (an upsert) instead of appending delta rows for the
-- worker's compaction to fold. There is one writer, so the row is never
-- contended; and a compaction pass held that writer for up to 150 ms while
-- trace writes waited behind it, at every few thousand rows appended. The
-- rows there are are folded into one per key here (a key whose traces all
-- went is dropped, as compaction did), and the key becomes unique. A key
-- whose traces all go later keeps a row of zeros until the worker drops it.
CREATE TEMP TABLE outcome_rollups_folded AS
SELECT prompt_id, version, width, start_secs, sum(traces) AS traces, sum(with_feedback) AS with_feedback,
       sum(success_trials) AS success_trials, sum(successes) AS successes, sum(score_n) AS score_n,
       sum(score_sum) AS score_sum, sum(score_sq) AS score_sq, sum(tokens_n) AS tokens_n,
       sum(tokens_sum) AS tokens_sum, sum(tokens_sq) AS tokens_sq, sum(cost_n) AS cost_n, sum(cost_sum) AS cost_sum,
       sum(cost_sq) AS cost_sq, sum(latency_n) AS latency_n, sum(latency_sum) AS latency_sum,
       sum(latency_sq) AS latency_sq, sum(judged) AS judged
FROM outcome_rollups GROUP BY prompt_id, version, width, start_secs HAVING sum(traces) <> 0;
DELETE FROM outcome_rollups;
INSERT INTO outcome_rollups (prompt_id, version, width, start_secs, traces, with_feedback, success_trials, successes,
                             score_n, score_sum, score_sq, tokens_n, tokens_sum, tokens_sq, cost_n, cost_sum, cost_sq,
                             latency_n, latency_sum, latency_sq, judged)
SELECT * FROM temp.outcome_rollups_folded;
DROP TABLE temp.outcome_rollups_folded;
DROP INDEX outcome_rollups_to_compact;
DROP INDEX outcome_rollups_by_window_and_version;
ALTER TABLE outcome_rollups DROP COLUMN compacted;
CREATE UNIQUE INDEX outcome_rollups_by_key ON outcome_rollups (prompt_id, width, start_secs, version);
CREATE INDEX outcome_rollups_emptied ON outcome_rollups (id) WHERE traces = 0;

CREATE TEMP TABLE task_rollups_folded AS
SELECT prompt_id, version, task_key, width, start_secs, sum(traces) AS traces, sum(reward_sum) AS reward_sum
FROM task_rollups GROUP BY prompt_id, version, task_key, width, start_secs HAVING sum(traces) <> 0;
DELETE FROM task_rollups;
INSERT INTO task_rollups (prompt_id, version, task_key, width, start_secs, traces, reward_sum)
SELECT * FROM temp.task_rollups_folded;
DROP TABLE temp.task_rollups_folded;
DROP INDEX task_rollups_to_compact;
DROP INDEX task_rollups_by_window_and_width;
ALTER TABLE task_rollups DROP COLUMN compacted;
CREATE UNIQUE INDEX task_rollups_by_key ON task_rollups (prompt_id, width, start_secs, version, task_key);
CREATE INDEX task_rollups_emptied ON task_rollups (id) WHERE traces = 0;
