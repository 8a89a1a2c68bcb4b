-- An Idempotency-Key remembers the ids of the traces its request stored, not
-- an HTTP answer (the API renders its answer from them, on a replay too).
-- Keys remembered before keep replaying: their ids are read out of the answer
-- they kept (`{"ids": [...], "count": n}`). A key without an answer (left by a
-- combee older still) stays without ids and is taken over by its next request.
ALTER TABLE idempotency_keys ADD COLUMN trace_ids jsonb;
UPDATE idempotency_keys SET trace_ids = convert_from(body, 'UTF8')::jsonb -> 'ids'
 WHERE status_code IS NOT NULL AND body IS NOT NULL;
ALTER TABLE idempotency_keys DROP COLUMN status_code, DROP COLUMN body;
