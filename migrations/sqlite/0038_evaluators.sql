-- Evaluators: a prompt's list of how to score traces no one scored (code
-- checks, an LLM judge), and on each trace what they made of it. Expand only:
-- a new table and nullable columns, so a binary from before this migration
-- reads and writes `traces` as it did (a judged score sits in `feedback.score`,
-- which it reads as a reported one).
CREATE TABLE prompt_evaluators (
    prompt_id   TEXT PRIMARY KEY REFERENCES prompts (id),
    evaluators  TEXT NOT NULL,
    updated_at  INTEGER NOT NULL
);
-- When the evaluators last looked at the trace (NULL: not yet), what each
-- said, and who wrote its feedback: NULL for the agent, 'judge' (then
-- `judged_by` names the evaluators) or 'human'.
ALTER TABLE traces ADD COLUMN judged_at INTEGER;
ALTER TABLE traces ADD COLUMN judgements TEXT;
ALTER TABLE traces ADD COLUMN feedback_source TEXT;
ALTER TABLE traces ADD COLUMN judged_by TEXT;
-- What the judging worker reads: pending traces not yet judged.
CREATE INDEX traces_unjudged ON traces (prompt_id, id) WHERE judged_at IS NULL AND status = 'pending';
-- Of the rewarded traces a rollup row counts, those whose reward the
-- evaluators gave (so ratings can say which rewards they stand on).
ALTER TABLE outcome_rollups ADD COLUMN judged INTEGER NOT NULL DEFAULT 0;
