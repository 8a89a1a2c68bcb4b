-- Reads that run on a timer or on every request must cost what the live state
-- and the window cost, never what the whole history costs. The indexes and
-- the one rollup below make each of them O(what it returns).

-- The latest move of one label (the population rater's cooldown, the UI's
-- production markers) without walking every other label's moves: under the
-- `evaluated` policy each round moves `candidate`, so `production`'s last move
-- sinks ever deeper in the prompt's history.
CREATE INDEX label_moves_by_label ON label_moves (prompt_id, label, id);
-- The regression guard's own moves (has it rolled this back before?) without
-- walking every production move (under `auto`, one per round).
CREATE INDEX label_moves_by_kind ON label_moves (prompt_id, kind, id);

-- The live arms of a population (champion and challengers) without the
-- retired ones, which stay as history: one more per learned version.
CREATE INDEX population_arms_live ON population_arms (prompt_id, version) WHERE state <> 'retired';

-- A prompt's rounds newest first (the rounds list, the prompts page's last round).
CREATE INDEX rounds_by_prompt_id ON rounds (prompt_id, id);

-- Retention compacts finished rounds' detail: it looks only at rounds not yet
-- compacted, instead of skipping every round it compacted before.
ALTER TABLE rounds ADD COLUMN detail_compacted_at timestamptz;
UPDATE rounds r SET detail_compacted_at = s.compacted_at FROM round_summaries s WHERE s.round_id = r.id;
DROP INDEX rounds_by_finish;
CREATE INDEX rounds_detail_to_compact ON rounds (finished_at)
    WHERE finished_at IS NOT NULL AND detail_compacted_at IS NULL;

-- The overload meter's counts summed per prompt and bucket, kept in step with
-- `meter_counts` (one row per round and bucket, the record) when a round's
-- counts are recorded, so the scheduler reads O(buckets), not O(rounds).
CREATE TABLE meter_totals (
    prompt_id   uuid NOT NULL REFERENCES prompts (id),
    size_min    integer NOT NULL CHECK (size_min >= 0),
    marked      bigint NOT NULL CHECK (marked >= 0),
    recaptured  bigint NOT NULL CHECK (recaptured >= 0),
    rounds      bigint NOT NULL CHECK (rounds >= 0),
    PRIMARY KEY (prompt_id, size_min)
);
INSERT INTO meter_totals (prompt_id, size_min, marked, recaptured, rounds)
SELECT prompt_id, size_min, sum(marked), sum(recaptured), count(*) FROM meter_counts GROUP BY prompt_id, size_min;
