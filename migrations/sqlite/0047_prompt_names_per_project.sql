-- Prompt names unique per project: two projects may each have a prompt
-- `support-agent`. The unique key on the name alone becomes one on
-- (project, name). SQLite cannot drop a column's UNIQUE, so `prompts` is
-- rebuilt inside the migration's transaction with foreign keys on, as 0013
-- did: with deferred foreign keys, dropping the old table counts the rows
-- that point at it as violations, and inserting the same ids into the new
-- table (named `prompts` by then) counts them off again before commit.
--
-- The learning budget's rows name a prompt by its key: the name in
-- `default`, `project/name` elsewhere (names hold no `/`), so those of
-- another project's prompts are renamed first.
UPDATE llm_spend_days SET prompt = (SELECT p.project || '/' || p.name FROM prompts p WHERE p.name = llm_spend_days.prompt)
 WHERE prompt IN (SELECT name FROM prompts WHERE project <> 'default');
UPDATE llm_spend_holds SET prompt = (SELECT p.project || '/' || p.name FROM prompts p WHERE p.name = llm_spend_holds.prompt)
 WHERE prompt IN (SELECT name FROM prompts WHERE project <> 'default');
UPDATE prompt_budgets SET prompt = (SELECT p.project || '/' || p.name FROM prompts p WHERE p.name = prompt_budgets.prompt)
 WHERE prompt IN (SELECT name FROM prompts WHERE project <> 'default');
UPDATE budget_reached SET prompt = (SELECT p.project || '/' || p.name FROM prompts p WHERE p.name = budget_reached.prompt)
 WHERE prompt IN (SELECT name FROM prompts WHERE project <> 'default');

PRAGMA defer_foreign_keys = ON;
CREATE TEMP TABLE prompts_copy AS SELECT * FROM prompts;
CREATE TABLE prompts_new (
    id             TEXT PRIMARY KEY,
    name           TEXT NOT NULL,
    strategy       TEXT NOT NULL CHECK (strategy IN ('playbook', 'rewrite')),
    promotion      TEXT NOT NULL CHECK (promotion IN ('auto', 'manual', 'evaluated')),
    settings       TEXT NOT NULL,
    version_count  INTEGER NOT NULL DEFAULT 0,
    created_at     INTEGER NOT NULL,
    created_by     TEXT NOT NULL,
    failure_streak INTEGER NOT NULL DEFAULT 0,
    last_failed_at INTEGER,
    last_failure   TEXT,
    project        TEXT NOT NULL DEFAULT 'default'
);
DROP TABLE prompts;
ALTER TABLE prompts_new RENAME TO prompts;
INSERT INTO prompts (id, name, strategy, promotion, settings, version_count, created_at, created_by,
                     failure_streak, last_failed_at, last_failure, project)
    SELECT id, name, strategy, promotion, settings, version_count, created_at, created_by,
           failure_streak, last_failed_at, last_failure, project FROM prompts_copy;
DROP TABLE prompts_copy;
CREATE UNIQUE INDEX prompts_by_project_name ON prompts (project, name);
CREATE INDEX prompts_by_name ON prompts (name);

-- A person's explicit grants, one per project (and one server-wide): the
-- key on the subject alone becomes one on (subject, project), so a
-- project's admin gives a person a role in its project whatever the person
-- holds elsewhere, and never learns of it. Nothing refers to `members`.
CREATE TABLE members_new (
    subject     TEXT NOT NULL,
    project     TEXT,
    role        TEXT NOT NULL,
    created_at  INTEGER NOT NULL,
    updated_at  INTEGER NOT NULL
);
INSERT INTO members_new (subject, project, role, created_at, updated_at)
    SELECT subject, project, role, created_at, updated_at FROM members;
DROP TABLE members;
ALTER TABLE members_new RENAME TO members;
CREATE UNIQUE INDEX members_by_grant ON members (subject, coalesce(project, ''));
