-- Prompt names unique per project: two projects may each have a prompt
-- `support-agent`. The contract step of projects (0042 added `prompts.project`
-- and kept names unique across the server): the unique key on the name alone
-- becomes one on (project, name). The previous release keeps serving on this
-- schema: it finds prompts by name alone, which stays one prompt until a
-- second project creates a name another holds (docs/projects.md says to wait
-- for the previous release's processes to be gone), and its prompts still
-- land in `default`, unique there.
--
-- The learning budget's rows name a prompt by its key: the name in
-- `default`, `project/name` elsewhere (names hold no `/`), so those of
-- another project's prompts are renamed first. Then the keys of `prompts`,
-- last, so the table's brief exclusive lock is held for the catalogue change
-- alone.
UPDATE llm_spend_days s SET prompt = p.project || '/' || p.name
  FROM prompts p WHERE p.name = s.prompt AND p.project <> 'default';
UPDATE llm_spend_holds s SET prompt = p.project || '/' || p.name
  FROM prompts p WHERE p.name = s.prompt AND p.project <> 'default';
UPDATE prompt_budgets s SET prompt = p.project || '/' || p.name
  FROM prompts p WHERE p.name = s.prompt AND p.project <> 'default';
UPDATE budget_reached s SET prompt = p.project || '/' || p.name
  FROM prompts p WHERE p.name = s.prompt AND p.project <> 'default';

CREATE UNIQUE INDEX prompts_by_project_name ON prompts (project, name);
ALTER TABLE prompts DROP CONSTRAINT IF EXISTS prompts_name_key;
-- Replaced by the unique index, which serves the same lookups.
DROP INDEX IF EXISTS prompts_by_project;
-- A bare name's lookups (the previous release's, and which projects hold a name).
CREATE INDEX prompts_by_name ON prompts (name);

-- A person's explicit grants, one per project (and one server-wide): the
-- key on the subject alone becomes one on (subject, project), so a
-- project's admin gives a person a role in its project whatever the person
-- holds elsewhere, and never learns of it. The previous release's upsert of
-- a grant names the old key, so a member changed through its processes
-- during a rolling upgrade fails (500); change members through this
-- release's processes.
CREATE UNIQUE INDEX members_by_grant ON members (subject, (coalesce(project, '')));
ALTER TABLE members DROP CONSTRAINT IF EXISTS members_pkey;
