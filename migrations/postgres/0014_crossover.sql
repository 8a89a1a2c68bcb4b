-- Crossover (the `evaluated` policy): a version can be made by crossing the
-- population's winners, source 'crossover'; and an arm records all the
-- versions it came from (a crossover child has several parents).
ALTER TABLE versions DROP CONSTRAINT versions_source_check;
ALTER TABLE versions ADD CONSTRAINT versions_source_check
    CHECK (source IN ('manual', 'learned', 'rollback', 'crossover'));

-- JSON array of version numbers; NULL for arms written before this migration
-- (their one parent is created_from).
ALTER TABLE population_arms ADD COLUMN parents jsonb;
