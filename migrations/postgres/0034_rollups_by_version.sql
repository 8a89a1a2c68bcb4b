-- The version joins the rollups' window index. A prompt that learns all day
-- has thousands of versions in a week's window; a read that wants a few of
-- them (the newest, the labelled, one arm) now skips the others' rows inside
-- the index instead of reading each from the table, and the compactor finds
-- exactly one key's rows instead of every version's rows of that bucket.
CREATE INDEX outcome_rollups_by_window_and_version ON outcome_rollups (prompt_id, width, start_secs, version);
DROP INDEX outcome_rollups_by_window;
