-- On the embedded store this migration gives each rollup key one row that
-- writes add to. Postgres keeps appending delta rows that the worker folds:
-- its trace writes commit from many connections at once, and a shared row
-- per key would queue them on its lock. Kept so both stores share one
-- migration sequence.
SELECT 1;
