-- Judging under a claim: a worker takes a batch of unjudged traces until
-- `judge_claimed_until`, so several worker processes never judge (and pay
-- for) the same trace twice; a claim whose worker died runs out and the
-- traces are claimed again. Expand only: a nullable column that an older
-- binary never reads.
ALTER TABLE traces ADD COLUMN judge_claimed_until INTEGER;
