-- The rollup tables churn by design: every trace write appends delta rows and
-- the worker folds them every few seconds (a delete and an insert per key),
-- so tens of dead rows a second are normal. Autovacuum's default trigger
-- (50 rows plus 20 % of the table) lets a million-row rollup table carry
-- hundreds of thousands of them, and every windowed read (metrics, the
-- population rater, the regression guard) walks their index entries and
-- heap pages until it runs. These two are vacuumed at 1 % instead: small,
-- frequent passes over the recently written pages (the visibility map lets
-- a pass skip the rest), so a window read costs the same an hour in as a
-- minute in. Storage parameters only: nothing is rewritten or locked long.
ALTER TABLE outcome_rollups SET (autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_threshold = 1000);
ALTER TABLE task_rollups SET (autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_threshold = 1000);
