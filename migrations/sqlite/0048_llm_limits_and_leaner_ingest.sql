-- The concurrency limit each LLM backend earned (by base URL and model), so
-- that a new process starts from it instead of from 2 (see docs/local-models.md,
-- Concurrency). Additive: a new table the previous release ignores.
CREATE TABLE llm_limits (
    base_url     TEXT NOT NULL,
    model        TEXT NOT NULL,
    concurrency  INTEGER NOT NULL CHECK (concurrency > 0),
    updated_at   INTEGER NOT NULL,
    PRIMARY KEY (base_url, model)
);

-- Leaner trace ingest (see docs/operations.md, What each index on traces is for):
-- `traces_by_status` served only the operator's trace list filtered by status
-- across every prompt; every trace starts pending, so each insert paid an
-- entry for a list the primary key serves as well. It now holds consumed and
-- failed traces only. (The rollups' references to prompts stay: SQLite checks
-- them with an index probe in the writer's own process, and cannot drop a
-- constraint without rebuilding the table.)
DROP INDEX traces_by_status;
CREATE INDEX traces_by_status ON traces (status, id) WHERE status <> 'pending';
