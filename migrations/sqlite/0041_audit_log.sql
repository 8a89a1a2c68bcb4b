-- Audit log: one row per change made through the API, the web UI or the
-- command line, and per retention run: who (the actor), when, from where (the
-- request id and the client's address), what (action, resource, route) and the
-- values before and after (JSON, secrets redacted before they get here).
-- Append-only: triggers refuse every UPDATE, and every DELETE except the
-- retention rule's own pruning, which inserts a permit (a cutoff) into
-- `audit_prune_permits`, deletes rows older than it and deletes the permit,
-- all in one transaction. Additive: nothing older reads or writes these tables.

CREATE TABLE audit_log (
    id             INTEGER PRIMARY KEY AUTOINCREMENT, -- order of the entries; the page cursor
    at             INTEGER NOT NULL,                  -- microseconds since the epoch
    actor_type     TEXT NOT NULL,                     -- key, ui, webhook, worker, cli, system
    actor_id       TEXT,                              -- the API key's id, when a key acted
    actor_name     TEXT NOT NULL,                     -- the key's name, the worker, the OS user
    request_id     TEXT,
    client_addr    TEXT,
    method         TEXT,
    route          TEXT,                              -- the route template, e.g. /v1/keys/{id}
    status         INTEGER,
    action         TEXT NOT NULL,                     -- e.g. key.create, label.move, retention.run
    resource_type  TEXT,
    resource_id    TEXT,
    before         TEXT,                              -- JSON
    after          TEXT                               -- JSON
);
CREATE INDEX audit_log_by_actor ON audit_log (actor_id, id);
CREATE INDEX audit_log_by_action ON audit_log (action, id);
CREATE INDEX audit_log_by_resource ON audit_log (resource_type, resource_id, id);
CREATE INDEX audit_log_by_age ON audit_log (at);

-- Written and removed inside the pruning transaction only.
CREATE TABLE audit_prune_permits (
    cutoff  INTEGER NOT NULL                          -- microseconds since the epoch
);

CREATE TRIGGER audit_log_no_update BEFORE UPDATE ON audit_log
BEGIN
    SELECT RAISE(ABORT, 'audit_log is append-only');
END;
CREATE TRIGGER audit_log_no_delete BEFORE DELETE ON audit_log
WHEN NOT EXISTS (SELECT 1 FROM audit_prune_permits WHERE OLD.at < cutoff)
BEGIN
    SELECT RAISE(ABORT, 'audit_log is append-only');
END;
