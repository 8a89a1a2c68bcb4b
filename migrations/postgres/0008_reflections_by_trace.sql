-- A re-run round over the same base version reuses the reflections earlier
-- rounds stored for its traces (Store::adopt_reflections): look them up by trace.
CREATE INDEX reflections_by_trace ON reflections (trace_id);
