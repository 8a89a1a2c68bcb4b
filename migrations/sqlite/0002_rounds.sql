-- Learning rounds: a queue of rows claimed with leases, the traces each round
-- reserved, the reflections it stored (so a resumed round does not pay twice),
-- every LLM call, and inbound webhook ids already seen.

CREATE TABLE rounds (
    id               TEXT PRIMARY KEY,
    prompt_id        TEXT NOT NULL REFERENCES prompts (id),
    status           TEXT NOT NULL CHECK (status IN ('queued', 'running', 'succeeded', 'failed')),
    trigger          TEXT NOT NULL,
    method           TEXT NOT NULL,
    strategy         TEXT NOT NULL,
    seed             INTEGER NOT NULL,
    duplication      INTEGER NOT NULL,
    n                INTEGER NOT NULL,
    k                INTEGER,
    base_version     INTEGER NOT NULL,
    result_version   INTEGER,
    attempt          INTEGER NOT NULL DEFAULT 0,
    lease_owner      TEXT,
    lease_expires_at INTEGER,
    not_before       INTEGER NOT NULL,
    error            TEXT,
    detail           TEXT NOT NULL DEFAULT '{}',
    created_at       INTEGER NOT NULL,
    started_at       INTEGER,
    finished_at      INTEGER,
    updated_at       INTEGER NOT NULL
);
CREATE UNIQUE INDEX rounds_one_active_per_prompt ON rounds (prompt_id) WHERE status IN ('queued', 'running');
CREATE INDEX rounds_claimable ON rounds (status, not_before) WHERE status IN ('queued', 'running');
CREATE INDEX rounds_by_prompt ON rounds (prompt_id, created_at DESC);

CREATE TABLE round_traces (
    round_id  TEXT NOT NULL REFERENCES rounds (id),
    trace_id  TEXT NOT NULL REFERENCES traces (id),
    position  INTEGER NOT NULL,
    PRIMARY KEY (round_id, trace_id)
);

CREATE TABLE reflections (
    round_id    TEXT NOT NULL REFERENCES rounds (id),
    trace_id    TEXT NOT NULL REFERENCES traces (id),
    reflection  TEXT NOT NULL,
    from_trace  INTEGER NOT NULL,
    created_at  INTEGER NOT NULL,
    PRIMARY KEY (round_id, trace_id)
);

CREATE TABLE llm_calls (
    id                 INTEGER PRIMARY KEY AUTOINCREMENT,
    round_id           TEXT NOT NULL REFERENCES rounds (id),
    attempt            INTEGER NOT NULL,
    role               TEXT NOT NULL,
    model              TEXT NOT NULL,
    prompt_tokens      INTEGER NOT NULL,
    completion_tokens  INTEGER NOT NULL,
    cost_usd           REAL NOT NULL,
    latency_ms         INTEGER NOT NULL,
    retries            INTEGER NOT NULL,
    error              TEXT,
    created_at         INTEGER NOT NULL
);
CREATE INDEX llm_calls_by_round ON llm_calls (round_id, id);

CREATE TABLE inbound_webhooks (
    id           TEXT PRIMARY KEY,
    received_at  INTEGER NOT NULL
);

CREATE INDEX traces_pending_unreserved ON traces (prompt_id, id) WHERE status = 'pending' AND round_id IS NULL;
