-- Audit log: one row per change made through the API, the web UI or the
-- command line, and per retention run: who (the actor), when, from where (the
-- request id and the client's address), what (action, resource, route) and the
-- values before and after (JSON, secrets redacted before they get here).
-- Append-only: a trigger refuses every UPDATE, and every DELETE except the
-- retention rule's own pruning, which first sets `combee.audit_prune_before`
-- for its transaction only (`set_config(..., true)`) and may then delete the
-- rows older than that. Additive: nothing older reads or writes these tables.

CREATE TABLE audit_log (
    id             bigserial PRIMARY KEY,         -- order of the entries; the page cursor
    at             timestamptz NOT NULL DEFAULT now(),
    actor_type     text NOT NULL,                 -- key, ui, webhook, worker, cli, system
    actor_id       text,                          -- the API key's id, when a key acted
    actor_name     text NOT NULL,                 -- the key's name, the worker, the OS user
    request_id     text,
    client_addr    text,
    method         text,
    route          text,                          -- the route template, e.g. /v1/keys/{id}
    status         integer,
    action         text NOT NULL,                 -- e.g. key.create, label.move, retention.run
    resource_type  text,
    resource_id    text,
    before         jsonb,
    after          jsonb
);
CREATE INDEX audit_log_by_actor ON audit_log (actor_id, id);
CREATE INDEX audit_log_by_action ON audit_log (action, id);
CREATE INDEX audit_log_by_resource ON audit_log (resource_type, resource_id, id);
CREATE INDEX audit_log_by_age ON audit_log (at);

CREATE FUNCTION audit_log_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    prune_before text := current_setting('combee.audit_prune_before', true);
BEGIN
    IF TG_OP = 'DELETE' AND prune_before IS NOT NULL AND prune_before <> ''
       AND OLD.at < prune_before::timestamptz THEN
        RETURN OLD;
    END IF;
    RAISE EXCEPTION 'audit_log is append-only';
END;
$$;
CREATE TRIGGER audit_log_append_only BEFORE UPDATE OR DELETE ON audit_log
    FOR EACH ROW EXECUTE FUNCTION audit_log_append_only();
