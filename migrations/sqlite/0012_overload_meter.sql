-- The overload meter: per published playbook round and group-size bucket, the
-- capture–recapture counts (copies marked by another covered copy of their
-- reflection, and of them those their own group covered too). The estimate is
-- summed over a prompt's rounds when read; one row per round and bucket makes
-- recording idempotent.

CREATE TABLE meter_counts (
    round_id    TEXT NOT NULL REFERENCES rounds (id),
    prompt_id   TEXT NOT NULL REFERENCES prompts (id),
    size_min    INTEGER NOT NULL CHECK (size_min >= 0),
    marked      INTEGER NOT NULL CHECK (marked >= 0),
    recaptured  INTEGER NOT NULL CHECK (recaptured >= 0 AND recaptured <= marked),
    created_at  INTEGER NOT NULL,
    PRIMARY KEY (round_id, size_min)
);
CREATE INDEX meter_counts_by_prompt ON meter_counts (prompt_id, size_min);
