-- Projects: teams sharing one deployment, each seeing only its own prompts.
-- Expand-only, so the previous release keeps running on this schema during a
-- rolling upgrade: a new table, and new columns that are nullable or carry a
-- default (a prompt the old binary creates lands in `default`; a key or a
-- webhook it creates is server-wide). Nothing is dropped, renamed or
-- re-keyed: prompt names stay unique across the server in this release.

CREATE TABLE projects (
    name        TEXT PRIMARY KEY,                 -- the rules of a prompt name
    settings    TEXT NOT NULL DEFAULT '{}',       -- JSON: defaults for new prompts, retention
    created_at  INTEGER NOT NULL                  -- microseconds since the epoch
);
INSERT INTO projects (name, created_at) VALUES ('default', CAST(strftime('%s', 'now') AS INTEGER) * 1000000);

ALTER TABLE prompts ADD COLUMN project TEXT NOT NULL DEFAULT 'default';
CREATE INDEX prompts_by_project ON prompts (project, name);
-- NULL: server-wide (every key made before projects existed).
ALTER TABLE api_keys ADD COLUMN project TEXT;
-- NULL: server-wide, told of every project's events.
ALTER TABLE webhook_subscriptions ADD COLUMN project TEXT;
-- The project an entry concerns, where there is one.
ALTER TABLE audit_log ADD COLUMN project TEXT;
CREATE INDEX audit_log_by_project ON audit_log (project, id);
