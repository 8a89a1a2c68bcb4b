-- Poisoning controls (issue 10, point 6).
-- 1. New prompts ignore the `reflection` an agent sends with a trace (the
--    setting's default); prompts that exist keep today's behaviour, so their
--    stored settings say `use` explicitly.
-- 2. A pending trace can be quarantined: it stays visible (status
--    `quarantined` in the API) but no round ever reserves it. A column rather
--    than a new status value, so the CHECK on `status` needs no table rebuild.
-- (Numbered 0007: 0006 is taken by work on another branch.)
UPDATE prompts SET settings = json_set(settings, '$.agent_reflections', 'use')
WHERE json_extract(settings, '$.agent_reflections') IS NULL;

ALTER TABLE traces ADD COLUMN quarantined_at INTEGER;
ALTER TABLE traces ADD COLUMN quarantine_reason TEXT;
CREATE INDEX traces_quarantined ON traces (prompt_id, id) WHERE quarantined_at IS NOT NULL;
