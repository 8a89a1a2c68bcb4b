-- Regression sets: per prompt, the cases an operator knows must keep working,
-- and per learned version the gate that ran it on them before any live
-- traffic. Expand only: new tables, nothing existing changes, so a binary from
-- before this migration runs on the migrated schema as it did.

-- One row per case. `kind`: what the case asks of a reply (`checks` today);
-- `checks`: the code checks (JSON array); `source`: manual, trace or import.
CREATE TABLE regression_cases (
    id          uuid PRIMARY KEY,
    prompt_id   uuid NOT NULL REFERENCES prompts (id),
    name        text,
    kind        text NOT NULL DEFAULT 'checks',
    input       jsonb NOT NULL,
    checks      jsonb NOT NULL,
    source      text NOT NULL,
    trace_id    uuid,
    created_by  text NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX regression_cases_by_prompt ON regression_cases (prompt_id, created_at, id);

-- What one version replied to one case and how it scored, kept so that
-- production's runs are reused by every later gate.
CREATE TABLE regression_runs (
    prompt_id   uuid NOT NULL REFERENCES prompts (id),
    version     bigint NOT NULL,
    case_id     uuid NOT NULL,
    run         jsonb NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (prompt_id, version, case_id)
);

-- One gate per learned version. `status`: pending, awaiting_harness, passed,
-- rejected; `detail`: the verdict with its evidence (JSON); `lease_until`: a
-- worker running it holds it until then; `deadline`: a harness's answer is
-- awaited until then.
CREATE TABLE version_gates (
    prompt_id    uuid NOT NULL REFERENCES prompts (id),
    version      bigint NOT NULL,
    status       text NOT NULL,
    mode         text NOT NULL,
    detail       jsonb NOT NULL,
    deadline     timestamptz,
    lease_until  timestamptz,
    created_at   timestamptz NOT NULL DEFAULT now(),
    decided_at   timestamptz,
    PRIMARY KEY (prompt_id, version)
);
CREATE INDEX version_gates_open ON version_gates (status) WHERE status IN ('pending', 'awaiting_harness');

-- How a prompt's gate judges (`cases`, `harness`) and how long a harness is awaited.
CREATE TABLE regression_gate_settings (
    prompt_id             uuid PRIMARY KEY REFERENCES prompts (id),
    mode                  text NOT NULL,
    harness_timeout_secs  bigint
);
