-- Outbound webhooks: subscriptions (with the signing secret, which must stay
-- readable to sign), the transactional outbox of events (written in the same
-- transaction as the change each announces), one delivery per event and
-- matching subscription (a queue claimed with leases), and every attempt.

CREATE TABLE webhook_subscriptions (
    id              uuid PRIMARY KEY,
    url             text NOT NULL,
    events          text NOT NULL,
    description     text,
    secret          text NOT NULL,
    enabled         boolean NOT NULL DEFAULT true,
    disabled_reason text,
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE webhook_events (
    id          text PRIMARY KEY,
    type        text NOT NULL,
    body        text NOT NULL,
    created_at  timestamptz NOT NULL
);

CREATE TABLE webhook_deliveries (
    id              uuid PRIMARY KEY,
    event_id        text NOT NULL REFERENCES webhook_events (id) ON DELETE CASCADE,
    subscription_id uuid NOT NULL REFERENCES webhook_subscriptions (id) ON DELETE CASCADE,
    status          text NOT NULL CHECK (status IN ('pending', 'succeeded', 'failed')),
    attempts        integer NOT NULL DEFAULT 0,
    -- Due time when pending; while an attempt runs it is the lease's expiry.
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    lease_owner     text,
    last_error      text,
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX webhook_deliveries_due ON webhook_deliveries (next_attempt_at) WHERE status = 'pending';
CREATE INDEX webhook_deliveries_by_subscription ON webhook_deliveries (subscription_id);

CREATE TABLE webhook_attempts (
    id              bigserial PRIMARY KEY,
    delivery_id     uuid NOT NULL REFERENCES webhook_deliveries (id) ON DELETE CASCADE,
    subscription_id uuid NOT NULL REFERENCES webhook_subscriptions (id) ON DELETE CASCADE,
    attempt         integer NOT NULL,
    status_code     integer,
    error           text,
    latency_ms      bigint NOT NULL,
    next_attempt_at timestamptz,
    created_at      timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX webhook_attempts_by_subscription ON webhook_attempts (subscription_id, id DESC);
