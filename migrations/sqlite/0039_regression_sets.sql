-- Regression sets: per prompt, the cases an operator knows must keep working,
-- and per learned version the gate that ran it on them before any live
-- traffic. Expand only: new tables, nothing existing changes, so a binary from
-- before this migration runs on the migrated schema as it did.

-- One row per case. `kind`: what the case asks of a reply (`checks` today);
-- `checks`: the code checks (JSON array); `source`: manual, trace or import.
CREATE TABLE regression_cases (
    id          TEXT PRIMARY KEY,
    prompt_id   TEXT NOT NULL REFERENCES prompts (id),
    name        TEXT,
    kind        TEXT NOT NULL DEFAULT 'checks',
    input       TEXT NOT NULL,
    checks      TEXT NOT NULL,
    source      TEXT NOT NULL,
    trace_id    TEXT,
    created_by  TEXT NOT NULL,
    created_at  INTEGER NOT NULL
);
CREATE INDEX regression_cases_by_prompt ON regression_cases (prompt_id, created_at, id);

-- What one version replied to one case and how it scored, kept so that
-- production's runs are reused by every later gate.
CREATE TABLE regression_runs (
    prompt_id   TEXT NOT NULL REFERENCES prompts (id),
    version     INTEGER NOT NULL,
    case_id     TEXT NOT NULL,
    run         TEXT NOT NULL,
    created_at  INTEGER NOT NULL,
    PRIMARY KEY (prompt_id, version, case_id)
);

-- One gate per learned version. `status`: pending, awaiting_harness, passed,
-- rejected; `detail`: the verdict with its evidence (JSON); `lease_until`: a
-- worker running it holds it until then; `deadline`: a harness's answer is
-- awaited until then (µs since the epoch, as every time here).
CREATE TABLE version_gates (
    prompt_id    TEXT NOT NULL REFERENCES prompts (id),
    version      INTEGER NOT NULL,
    status       TEXT NOT NULL,
    mode         TEXT NOT NULL,
    detail       TEXT NOT NULL,
    deadline     INTEGER,
    lease_until  INTEGER,
    created_at   INTEGER NOT NULL,
    decided_at   INTEGER,
    PRIMARY KEY (prompt_id, version)
);
CREATE INDEX version_gates_open ON version_gates (status) WHERE status IN ('pending', 'awaiting_harness');

-- How a prompt's gate judges (`cases`, `harness`) and how long a harness is awaited.
CREATE TABLE regression_gate_settings (
    prompt_id             TEXT PRIMARY KEY REFERENCES prompts (id),
    mode                  TEXT NOT NULL,
    harness_timeout_secs  INTEGER
);
