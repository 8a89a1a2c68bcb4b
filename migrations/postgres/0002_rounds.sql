-- Learning rounds: a queue of rows claimed with leases, the traces each round
-- reserved, the reflections it stored (so a resumed round does not pay twice),
-- every LLM call, and inbound webhook ids already seen.

CREATE TABLE rounds (
    id               uuid PRIMARY KEY,
    prompt_id        uuid NOT NULL REFERENCES prompts (id),
    status           text NOT NULL CHECK (status IN ('queued', 'running', 'succeeded', 'failed')),
    trigger          text NOT NULL,
    method           text NOT NULL,
    strategy         text NOT NULL,
    seed             bigint NOT NULL,
    duplication      integer NOT NULL,
    n                integer NOT NULL,
    k                integer,
    base_version     bigint NOT NULL,
    result_version   bigint,
    attempt          integer NOT NULL DEFAULT 0,
    lease_owner      text,
    lease_expires_at timestamptz,
    not_before       timestamptz NOT NULL DEFAULT now(),
    error            text,
    detail           jsonb NOT NULL DEFAULT '{}',
    created_at       timestamptz NOT NULL DEFAULT now(),
    started_at       timestamptz,
    finished_at      timestamptz,
    updated_at       timestamptz NOT NULL DEFAULT now()
);
-- At most one round in flight per prompt.
CREATE UNIQUE INDEX rounds_one_active_per_prompt ON rounds (prompt_id) WHERE status IN ('queued', 'running');
CREATE INDEX rounds_claimable ON rounds (status, not_before) WHERE status IN ('queued', 'running');
CREATE INDEX rounds_by_prompt ON rounds (prompt_id, created_at DESC);

CREATE TABLE round_traces (
    round_id  uuid NOT NULL REFERENCES rounds (id),
    trace_id  uuid NOT NULL REFERENCES traces (id),
    position  integer NOT NULL,
    PRIMARY KEY (round_id, trace_id)
);

CREATE TABLE reflections (
    round_id    uuid NOT NULL REFERENCES rounds (id),
    trace_id    uuid NOT NULL REFERENCES traces (id),
    reflection  jsonb NOT NULL,
    from_trace  boolean NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (round_id, trace_id)
);

CREATE TABLE llm_calls (
    id                 bigserial PRIMARY KEY,
    round_id           uuid NOT NULL REFERENCES rounds (id),
    attempt            integer NOT NULL,
    role               text NOT NULL,
    model              text NOT NULL,
    prompt_tokens      bigint NOT NULL,
    completion_tokens  bigint NOT NULL,
    cost_usd           double precision NOT NULL,
    latency_ms         bigint NOT NULL,
    retries            integer NOT NULL,
    error              text,
    created_at         timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX llm_calls_by_round ON llm_calls (round_id, id);

CREATE TABLE inbound_webhooks (
    id           text PRIMARY KEY,
    received_at  timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX traces_pending_unreserved ON traces (prompt_id, id) WHERE status = 'pending' AND round_id IS NULL;
