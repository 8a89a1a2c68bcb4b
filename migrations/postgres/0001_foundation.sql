-- Foundation: API keys, prompts, immutable versions, labels, traces, idempotency.

CREATE TABLE api_keys (
    id          uuid PRIMARY KEY,
    name        text NOT NULL,
    prefix      text NOT NULL,
    hash        text NOT NULL UNIQUE,
    scopes      text NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    revoked_at  timestamptz
);

CREATE TABLE prompts (
    id             uuid PRIMARY KEY,
    name           text NOT NULL UNIQUE,
    strategy       text NOT NULL CHECK (strategy IN ('playbook', 'rewrite')),
    promotion      text NOT NULL CHECK (promotion IN ('auto', 'manual')),
    settings       jsonb NOT NULL,
    -- The highest version number; bumped under the row lock so numbers never gap or repeat.
    version_count  bigint NOT NULL DEFAULT 0,
    created_at     timestamptz NOT NULL DEFAULT now(),
    created_by     text NOT NULL
);

CREATE TABLE versions (
    prompt_id     uuid NOT NULL REFERENCES prompts (id),
    number        bigint NOT NULL CHECK (number >= 1),
    parent        bigint,
    source        text NOT NULL CHECK (source IN ('manual', 'learned', 'rollback')),
    round_id      uuid,
    base          text NOT NULL,
    playbook      jsonb,
    content_hash  text NOT NULL,
    message       text NOT NULL,
    created_by    text NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (prompt_id, number)
);

CREATE TABLE labels (
    prompt_id   uuid NOT NULL,
    name        text NOT NULL,
    version     bigint NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now(),
    updated_by  text NOT NULL,
    PRIMARY KEY (prompt_id, name),
    FOREIGN KEY (prompt_id, version) REFERENCES versions (prompt_id, number)
);

CREATE TABLE traces (
    id              uuid PRIMARY KEY,  -- UUIDv7: ordered by arrival
    prompt_id       uuid NOT NULL REFERENCES prompts (id),
    prompt_version  bigint,
    status          text NOT NULL DEFAULT 'pending' CHECK (status IN ('pending', 'consumed', 'failed')),
    input           jsonb NOT NULL,
    trajectory      jsonb NOT NULL,
    output          jsonb NOT NULL,
    feedback        jsonb NOT NULL,
    reflection      jsonb,
    external_id     text,
    metadata        jsonb NOT NULL,
    attempts        integer NOT NULL DEFAULT 0,
    failure_reason  text,
    round_id        uuid,
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX traces_by_prompt_status ON traces (prompt_id, status, id);
CREATE INDEX traces_by_status ON traces (status, id);

CREATE TABLE idempotency_keys (
    owner         uuid NOT NULL,
    key           text NOT NULL,
    request_hash  text NOT NULL,
    status_code   integer,
    body          bytea,
    created_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (owner, key)
);
CREATE INDEX idempotency_keys_by_age ON idempotency_keys (created_at);
