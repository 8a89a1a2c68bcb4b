-- The concurrency limit each LLM backend earned (by base URL and model), so
-- that a new process starts from it instead of from 2 (see docs/local-models.md,
-- Concurrency). Additive: a new table the previous release ignores.
CREATE TABLE llm_limits (
    base_url     text NOT NULL,
    model        text NOT NULL,
    concurrency  integer NOT NULL CHECK (concurrency > 0),
    updated_at   timestamptz NOT NULL,
    PRIMARY KEY (base_url, model)
);

-- Leaner trace ingest (see docs/operations.md, What each index on traces is for).
--
-- `traces_by_status` served one read only: the operator's trace list filtered
-- by status across every prompt. Every trace starts pending, so each insert
-- paid an entry (7 % of the WAL a single-trace write made) for a list of
-- pending traces that the primary key serves as well (the newest traces are
-- the pending ones). It now holds consumed and failed traces only, the rows
-- that list needs it for; a trace gets its entry when a round settles it.
DROP INDEX traces_by_status;
CREATE INDEX traces_by_status ON traces (status, id) WHERE status <> 'pending';

-- Each rollup row names its prompt by the id the same statement read from
-- `prompts`, and no prompt is ever deleted (as for `traces` in 0046). The
-- foreign keys' checks took a key-share lock on the prompt's row for every
-- group of trace writes: a WAL record each, and, with several groups of one
-- prompt committing at once, a multixact each.
ALTER TABLE outcome_rollups DROP CONSTRAINT IF EXISTS outcome_rollups_prompt_id_fkey;
ALTER TABLE task_rollups DROP CONSTRAINT IF EXISTS task_rollups_prompt_id_fkey;
