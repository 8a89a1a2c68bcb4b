-- The dynamic batch-size controller: one delay sample per finished Combee
-- round, and the latest choice (size, reason, fit) per prompt.

CREATE TABLE controller_samples (
    id          bigserial PRIMARY KEY,
    prompt_id   uuid NOT NULL REFERENCES prompts (id),
    round_id    uuid NOT NULL REFERENCES rounds (id),
    batch_size  integer NOT NULL CHECK (batch_size > 0),
    round_secs  double precision NOT NULL CHECK (round_secs > 0),
    created_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX controller_samples_by_prompt ON controller_samples (prompt_id, id);

CREATE TABLE controller_choices (
    prompt_id   uuid PRIMARY KEY REFERENCES prompts (id),
    choice      jsonb NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now()
);
