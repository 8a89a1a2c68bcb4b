-- A failing prompt's backoff: rounds of the prompt that failed in a row since
-- the last success or operator reset, when the last one failed and why. The
-- scheduler waits an exponential delay after the last failure before it opens
-- another round. Expand only: a defaulted counter and nullable columns, so a
-- binary from before this migration reads and writes `prompts` as it did.
ALTER TABLE prompts ADD COLUMN failure_streak INTEGER NOT NULL DEFAULT 0;
ALTER TABLE prompts ADD COLUMN last_failed_at INTEGER;
ALTER TABLE prompts ADD COLUMN last_failure TEXT;
