-- On Postgres this migration vacuums the churning rollup tables early (at 1 %
-- of their rows). SQLite has no autovacuum of dead rows to tune: a deleted
-- row's space is reused by the next insert into the table. Kept so both
-- stores share one migration sequence.
SELECT 1;
