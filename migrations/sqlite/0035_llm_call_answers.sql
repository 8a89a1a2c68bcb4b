-- What a round keeps of each LLM call's answer: how it was read (schema, text,
-- repaired, refused), the text of a refused answer (bounded, untrusted model
-- output), the structured-output form asked for and the backend's concurrency
-- limit when the call was sent. Expand only: nullable columns, so a binary
-- from before this migration reads and writes `llm_calls` as it did.
ALTER TABLE llm_calls ADD COLUMN read_as TEXT;
ALTER TABLE llm_calls ADD COLUMN refused_answer TEXT;
ALTER TABLE llm_calls ADD COLUMN output_format TEXT;
ALTER TABLE llm_calls ADD COLUMN concurrency_limit INTEGER;
