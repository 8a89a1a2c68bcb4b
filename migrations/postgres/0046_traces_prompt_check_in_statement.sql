-- Trace writes find their prompt themselves: every insert into `traces`
-- takes `prompt_id` from `prompts` in its own statement (or, for OTLP, its
-- own transaction), and no prompt is ever deleted. The foreign key repeated
-- that lookup once per row through a trigger, some 13 % of Postgres's CPU
-- on batched ingest, so it goes. Dropping a constraint changes the catalogue
-- only (a brief lock), and a binary from before this migration writes as it did.
ALTER TABLE traces DROP CONSTRAINT IF EXISTS traces_prompt_id_fkey;
