-- Crossover (the `evaluated` policy): a version can be made by crossing the
-- population's winners, source 'crossover'; and an arm records all the
-- versions it came from (a crossover child has several parents).
--
-- SQLite cannot alter a CHECK constraint, so versions is rebuilt inside the
-- migration's transaction, as 0013 rebuilt prompts: with deferred foreign
-- keys, dropping the old table counts the labels pointing at it as
-- violations, and inserting the same rows into the new table (named
-- `versions` by then) counts them off again before commit.
PRAGMA defer_foreign_keys = ON;
CREATE TEMP TABLE versions_copy AS SELECT * FROM versions;
CREATE TABLE versions_new (
    prompt_id     TEXT NOT NULL REFERENCES prompts (id),
    number        INTEGER NOT NULL CHECK (number >= 1),
    parent        INTEGER,
    source        TEXT NOT NULL CHECK (source IN ('manual', 'learned', 'rollback', 'crossover')),
    round_id      TEXT,
    base          TEXT NOT NULL,
    playbook      TEXT,
    content_hash  TEXT NOT NULL,
    message       TEXT NOT NULL,
    created_by    TEXT NOT NULL,
    created_at    INTEGER NOT NULL,
    PRIMARY KEY (prompt_id, number)
);
DROP TABLE versions;
ALTER TABLE versions_new RENAME TO versions;
INSERT INTO versions (prompt_id, number, parent, source, round_id, base, playbook, content_hash, message,
                      created_by, created_at)
    SELECT prompt_id, number, parent, source, round_id, base, playbook, content_hash, message,
           created_by, created_at FROM versions_copy;
DROP TABLE versions_copy;

-- JSON array of version numbers; NULL for arms written before this migration
-- (their one parent is created_from).
ALTER TABLE population_arms ADD COLUMN parents TEXT;
