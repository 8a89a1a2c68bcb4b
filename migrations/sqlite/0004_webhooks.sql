-- Outbound webhooks: subscriptions (with the signing secret, which must stay
-- readable to sign), the transactional outbox of events (written in the same
-- transaction as the change each announces), one delivery per event and
-- matching subscription (a queue claimed with leases), and every attempt.

CREATE TABLE webhook_subscriptions (
    id              TEXT PRIMARY KEY,
    url             TEXT NOT NULL,
    events          TEXT NOT NULL,
    description     TEXT,
    secret          TEXT NOT NULL,
    enabled         INTEGER NOT NULL DEFAULT 1,
    disabled_reason TEXT,
    created_at      INTEGER NOT NULL,
    updated_at      INTEGER NOT NULL
);

CREATE TABLE webhook_events (
    id          TEXT PRIMARY KEY,
    type        TEXT NOT NULL,
    body        TEXT NOT NULL,
    created_at  INTEGER NOT NULL
);

CREATE TABLE webhook_deliveries (
    id              TEXT PRIMARY KEY,
    event_id        TEXT NOT NULL REFERENCES webhook_events (id) ON DELETE CASCADE,
    subscription_id TEXT NOT NULL REFERENCES webhook_subscriptions (id) ON DELETE CASCADE,
    status          TEXT NOT NULL CHECK (status IN ('pending', 'succeeded', 'failed')),
    attempts        INTEGER NOT NULL DEFAULT 0,
    -- Due time when pending; while an attempt runs it is the lease's expiry.
    next_attempt_at INTEGER NOT NULL,
    lease_owner     TEXT,
    last_error      TEXT,
    created_at      INTEGER NOT NULL,
    updated_at      INTEGER NOT NULL
);
CREATE INDEX webhook_deliveries_due ON webhook_deliveries (next_attempt_at) WHERE status = 'pending';
CREATE INDEX webhook_deliveries_by_subscription ON webhook_deliveries (subscription_id);

CREATE TABLE webhook_attempts (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    delivery_id     TEXT NOT NULL REFERENCES webhook_deliveries (id) ON DELETE CASCADE,
    subscription_id TEXT NOT NULL REFERENCES webhook_subscriptions (id) ON DELETE CASCADE,
    attempt         INTEGER NOT NULL,
    status_code     INTEGER,
    error           TEXT,
    latency_ms      INTEGER NOT NULL,
    next_attempt_at INTEGER,
    created_at      INTEGER NOT NULL
);
CREATE INDEX webhook_attempts_by_subscription ON webhook_attempts (subscription_id, id DESC);
