-- Data retention: the worker deletes expired rows in small batches, so every
-- lookup it makes by age or by parent row needs an index (a cascade without
-- one scans the child table once per parent row).
CREATE INDEX round_traces_by_trace ON round_traces (trace_id);
-- Per-version outcomes read the partial minutes at a window's edges from the
-- trace rows (the whole minutes come from the rollups).
CREATE INDEX traces_by_prompt_time ON traces (prompt_id, created_at);
CREATE INDEX webhook_events_by_age ON webhook_events (created_at);
CREATE INDEX webhook_deliveries_by_event ON webhook_deliveries (event_id);
CREATE INDEX webhook_attempts_by_delivery ON webhook_attempts (delivery_id);
CREATE INDEX inbound_webhooks_by_age ON inbound_webhooks (received_at);
CREATE INDEX rounds_by_finish ON rounds (finished_at) WHERE finished_at IS NOT NULL;

-- What stays of a round whose bulky detail was compacted: its LLM usage
-- totals (the per-call rows are deleted) and when it was compacted (its
-- group outputs were dropped from `rounds.detail` then).
CREATE TABLE round_summaries (
    round_id           uuid PRIMARY KEY REFERENCES rounds (id),
    calls              bigint NOT NULL,
    prompt_tokens      bigint NOT NULL,
    completion_tokens  bigint NOT NULL,
    cost_usd           double precision NOT NULL,
    retries            bigint NOT NULL,
    compacted_at       timestamptz NOT NULL
);
