-- Postgres drops the foreign key from traces to prompts here (its per-row
-- trigger cost more than the insert it guarded). SQLite checks the key with
-- one index probe in the writer's own process and cannot drop a constraint
-- without rebuilding the table, so it keeps it. Kept so both stores share
-- one migration sequence.
SELECT 1;
