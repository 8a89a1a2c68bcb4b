-- Label history: one row per change of a label (created, moved, deleted), with
-- who or what made it, of which kind, why, and the numbers behind it. Written in
-- the same transaction as the change; rows are never updated or deleted.
-- Label moves made before this migration are not backfilled.

CREATE TABLE label_moves (
    id            INTEGER PRIMARY KEY AUTOINCREMENT, -- order of the moves
    prompt_id     TEXT NOT NULL REFERENCES prompts (id),
    label         TEXT NOT NULL,
    from_version  INTEGER,                           -- NULL: the label did not exist
    to_version    INTEGER,                           -- NULL: the label was deleted
    kind          TEXT NOT NULL,
    actor         TEXT NOT NULL,
    reason        TEXT NOT NULL,
    evidence      TEXT,                              -- JSON
    at            INTEGER NOT NULL                   -- microseconds since the epoch
);
CREATE INDEX label_moves_by_prompt ON label_moves (prompt_id, id);

CREATE TRIGGER label_moves_no_update BEFORE UPDATE ON label_moves
BEGIN
    SELECT RAISE(ABORT, 'label_moves is append-only');
END;
CREATE TRIGGER label_moves_no_delete BEFORE DELETE ON label_moves
BEGIN
    SELECT RAISE(ABORT, 'label_moves is append-only');
END;
