-- One index of every trace per prompt instead of two (see docs/operations.md,
-- What each index on traces is for).
--
-- `traces_by_prompt_status` (prompt_id, status, id) and `traces_by_prompt_time`
-- (prompt_id, created_at) each took an entry for every trace stored. Ids are
-- UUIDv7, so a prompt's traces in id order are its traces in time order: one
-- index (prompt_id, id) serves the lists and the exports of a prompt, and a
-- time range becomes an id range. Lists by status and retention read settled
-- traces only (pending ones are the newest, or in `traces_backlog`), so their
-- per-prompt index holds consumed and failed traces only, the entry a trace
-- gets when a round settles it. Measured with COPY of the same rows from one
-- connection: the traces table with every index took 89,000 rows/s, with
-- this change 104,000 (a primary key alone: 167,000).
CREATE INDEX traces_by_prompt ON traces (prompt_id, id);
CREATE INDEX traces_settled_by_prompt ON traces (prompt_id, status, id) WHERE status <> 'pending';
DROP INDEX traces_by_prompt_status;
DROP INDEX traces_by_prompt_time;
