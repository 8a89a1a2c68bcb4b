-- The dynamic batch-size controller: one delay sample per finished Combee
-- round, and the latest choice (size, reason, fit) per prompt.

CREATE TABLE controller_samples (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    prompt_id   TEXT NOT NULL REFERENCES prompts (id),
    round_id    TEXT NOT NULL REFERENCES rounds (id),
    batch_size  INTEGER NOT NULL CHECK (batch_size > 0),
    round_secs  REAL NOT NULL CHECK (round_secs > 0),
    created_at  INTEGER NOT NULL
);
CREATE INDEX controller_samples_by_prompt ON controller_samples (prompt_id, id);

CREATE TABLE controller_choices (
    prompt_id   TEXT PRIMARY KEY REFERENCES prompts (id),
    choice      TEXT NOT NULL,
    updated_at  INTEGER NOT NULL
);
