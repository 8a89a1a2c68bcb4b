-- OTLP spans as received, so that the spans of one OpenTelemetry trace id that
-- arrive in several exports become one trace (re-mapped from the union of its
-- spans), and a span sent twice, in any batching, is stored once.
CREATE TABLE otlp_spans (
    otel_trace_id  TEXT NOT NULL,               -- 32 lowercase hex digits
    span_id        TEXT NOT NULL,               -- 16 lowercase hex digits
    trace_id       TEXT REFERENCES traces (id), -- the combee trace; NULL while held (the spans do not map yet)
    body           BLOB NOT NULL,               -- protobuf ResourceSpans: this one span with its resource and scope
    received_at    INTEGER NOT NULL,            -- microseconds since the epoch
    PRIMARY KEY (otel_trace_id, span_id)
);
CREATE INDEX otlp_spans_held ON otlp_spans (received_at) WHERE trace_id IS NULL;
CREATE INDEX otlp_spans_by_trace ON otlp_spans (trace_id) WHERE trace_id IS NOT NULL;
