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
