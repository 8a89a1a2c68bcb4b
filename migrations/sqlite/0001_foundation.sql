-- Foundation: API keys, prompts, immutable versions, labels, traces, idempotency.
-- Ids are UUID text, times are integer microseconds since the Unix epoch, JSON is text.

CREATE TABLE api_keys (
    id          TEXT PRIMARY KEY,
    name        TEXT NOT NULL,
    prefix      TEXT NOT NULL,
    hash        TEXT NOT NULL UNIQUE,
    scopes      TEXT NOT NULL,
    created_at  INTEGER NOT NULL,
    revoked_at  INTEGER
);

CREATE TABLE prompts (
    id             TEXT PRIMARY KEY,
    name           TEXT NOT NULL UNIQUE,
    strategy       TEXT NOT NULL CHECK (strategy IN ('playbook', 'rewrite')),
    promotion      TEXT NOT NULL CHECK (promotion IN ('auto', 'manual')),
    settings       TEXT NOT NULL,
    version_count  INTEGER NOT NULL DEFAULT 0,
    created_at     INTEGER NOT NULL,
    created_by     TEXT NOT NULL
);

CREATE TABLE versions (
    prompt_id     TEXT NOT NULL REFERENCES prompts (id),
    number        INTEGER NOT NULL CHECK (number >= 1),
    parent        INTEGER,
    source        TEXT NOT NULL CHECK (source IN ('manual', 'learned', 'rollback')),
    round_id      TEXT,
    base          TEXT NOT NULL,
    playbook      TEXT,
    content_hash  TEXT NOT NULL,
    message       TEXT NOT NULL,
    created_by    TEXT NOT NULL,
    created_at    INTEGER NOT NULL,
    PRIMARY KEY (prompt_id, number)
);

CREATE TABLE labels (
    prompt_id   TEXT NOT NULL,
    name        TEXT NOT NULL,
    version     INTEGER NOT NULL,
    updated_at  INTEGER NOT NULL,
    updated_by  TEXT NOT NULL,
    PRIMARY KEY (prompt_id, name),
    FOREIGN KEY (prompt_id, version) REFERENCES versions (prompt_id, number)
);

CREATE TABLE traces (
    id              TEXT PRIMARY KEY,
    prompt_id       TEXT NOT NULL REFERENCES prompts (id),
    prompt_version  INTEGER,
    status          TEXT NOT NULL DEFAULT 'pending' CHECK (status IN ('pending', 'consumed', 'failed')),
    input           TEXT NOT NULL,
    trajectory      TEXT NOT NULL,
    output          TEXT NOT NULL,
    feedback        TEXT NOT NULL,
    reflection      TEXT,
    external_id     TEXT,
    metadata        TEXT NOT NULL,
    attempts        INTEGER NOT NULL DEFAULT 0,
    failure_reason  TEXT,
    round_id        TEXT,
    created_at      INTEGER NOT NULL,
    updated_at      INTEGER NOT NULL
);
CREATE INDEX traces_by_prompt_status ON traces (prompt_id, status, id);
CREATE INDEX traces_by_status ON traces (status, id);

CREATE TABLE idempotency_keys (
    owner         TEXT NOT NULL,
    key           TEXT NOT NULL,
    request_hash  TEXT NOT NULL,
    status_code   INTEGER,
    body          BLOB,
    created_at    INTEGER NOT NULL,
    PRIMARY KEY (owner, key)
);
CREATE INDEX idempotency_keys_by_age ON idempotency_keys (created_at);
