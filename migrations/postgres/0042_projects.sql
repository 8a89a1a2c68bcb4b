-- Projects: teams sharing one deployment, each seeing only its own prompts.
-- Expand-only, so the previous release keeps running on this schema during a
-- rolling upgrade: a new table, and new columns that are nullable or carry a
-- default (a prompt the old binary creates lands in `default`; a key or a
-- webhook it creates is server-wide). Nothing is dropped, renamed or
-- re-keyed: prompt names stay unique across the server in this release.

CREATE TABLE projects (
    name        text PRIMARY KEY,                 -- the rules of a prompt name
    settings    jsonb NOT NULL DEFAULT '{}',      -- defaults for new prompts, retention
    created_at  timestamptz NOT NULL DEFAULT now()
);
INSERT INTO projects (name) VALUES ('default');

ALTER TABLE prompts ADD COLUMN project text NOT NULL DEFAULT 'default';
CREATE INDEX prompts_by_project ON prompts (project, name);
-- NULL: server-wide (every key made before projects existed).
ALTER TABLE api_keys ADD COLUMN project text;
-- NULL: server-wide, told of every project's events.
ALTER TABLE webhook_subscriptions ADD COLUMN project text;
-- The project an entry concerns, where there is one.
ALTER TABLE audit_log ADD COLUMN project text;
CREATE INDEX audit_log_by_project ON audit_log (project, id);
