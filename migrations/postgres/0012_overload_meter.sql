-- The overload meter: per published playbook round and group-size bucket, the
-- capture–recapture counts (copies marked by another covered copy of their
-- reflection, and of them those their own group covered too). The estimate is
-- summed over a prompt's rounds when read; one row per round and bucket makes
-- recording idempotent.

CREATE TABLE meter_counts (
    round_id    uuid NOT NULL REFERENCES rounds (id),
    prompt_id   uuid NOT NULL REFERENCES prompts (id),
    size_min    integer NOT NULL CHECK (size_min >= 0),
    marked      bigint NOT NULL CHECK (marked >= 0),
    recaptured  bigint NOT NULL CHECK (recaptured >= 0 AND recaptured <= marked),
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (round_id, size_min)
);
CREATE INDEX meter_counts_by_prompt ON meter_counts (prompt_id, size_min);
