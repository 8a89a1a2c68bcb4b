-- The `evaluated` promotion policy: a third value for prompts.promotion, and
-- each prompt's population of arms (versions measured on live traffic).
--
-- SQLite cannot alter a CHECK constraint, so prompts is rebuilt inside the
-- migration's transaction, with foreign keys on (they cannot be switched off
-- in a transaction): with deferred foreign keys, dropping the old table counts
-- the rows that point at it as violations, and inserting the same ids into
-- the new table (named `prompts` by then) counts them off again before commit.
PRAGMA defer_foreign_keys = ON;
CREATE TEMP TABLE prompts_copy AS SELECT * FROM prompts;
CREATE TABLE prompts_new (
    id             TEXT PRIMARY KEY,
    name           TEXT NOT NULL UNIQUE,
    strategy       TEXT NOT NULL CHECK (strategy IN ('playbook', 'rewrite')),
    promotion      TEXT NOT NULL CHECK (promotion IN ('auto', 'manual', 'evaluated')),
    settings       TEXT NOT NULL,
    version_count  INTEGER NOT NULL DEFAULT 0,
    created_at     INTEGER NOT NULL,
    created_by     TEXT NOT NULL
);
DROP TABLE prompts;
ALTER TABLE prompts_new RENAME TO prompts;
INSERT INTO prompts (id, name, strategy, promotion, settings, version_count, created_at, created_by)
    SELECT id, name, strategy, promotion, settings, version_count, created_at, created_by FROM prompts_copy;
DROP TABLE prompts_copy;

-- One row per version that is or was an arm. `state`: champion (the version
-- production points at), challenger (gets a share of traffic), retired
-- (traffic stopped; the version itself stays). μ, σ: TrueSkill rating;
-- weight: share of subjects served this arm (0 when retired).
CREATE TABLE population_arms (
    prompt_id      TEXT NOT NULL REFERENCES prompts (id),
    version        INTEGER NOT NULL,
    state          TEXT NOT NULL CHECK (state IN ('champion', 'challenger', 'retired')),
    mu             REAL NOT NULL,
    sigma          REAL NOT NULL CHECK (sigma > 0),
    weight         REAL NOT NULL CHECK (weight >= 0 AND weight <= 1),
    scored_traces  INTEGER NOT NULL DEFAULT 0,   -- scored traces counted in rated windows
    created_from   INTEGER,                      -- parent version (NULL: the first champion)
    rated_until    INTEGER,                      -- end of the last rating window (µs since the epoch)
    created_at     INTEGER NOT NULL,
    updated_at     INTEGER NOT NULL,
    PRIMARY KEY (prompt_id, version)
);
