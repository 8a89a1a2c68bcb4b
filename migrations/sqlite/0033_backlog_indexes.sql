-- The scheduler's and the rounds' reads of traces cost what is waiting or
-- reserved, never the history (the soak benchmark found both walking it).
--
-- The backlog a round may take: pending, unreserved and not quarantined.
-- Quarantined traces stay pending until retention deletes them, so the index
-- leaves them out; `created_at` is in the index, so a prompt's count and
-- oldest come from the index alone.
CREATE INDEX traces_backlog ON traces (prompt_id, id, created_at)
    WHERE status = 'pending' AND round_id IS NULL AND quarantined_at IS NULL;
DROP INDEX traces_pending_unreserved;

-- A round's reserved traces (released, charged or consumed when it ends),
-- without walking every pending trace, quarantined ones included.
CREATE INDEX traces_reserved ON traces (round_id) WHERE status = 'pending' AND round_id IS NOT NULL;
