-- A counter bumped by every change to an existing API key (revocation,
-- deletion), by a trigger so any writer bumps it — `combee keys revoke` in
-- another process included. A server that cannot hear other processes'
-- notifications checks it per request and trusts a cached key only while the
-- counter is the one it was read at. (Postgres servers also get NOTIFY.)

CREATE TABLE api_key_generation (
    id          boolean PRIMARY KEY DEFAULT true CHECK (id),
    generation  bigint NOT NULL
);
INSERT INTO api_key_generation (id, generation) VALUES (true, 0);

CREATE FUNCTION bump_api_key_generation() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE api_key_generation SET generation = generation + 1;
    RETURN NULL;
END
$$;

CREATE TRIGGER api_keys_changed AFTER UPDATE OR DELETE ON api_keys
    FOR EACH STATEMENT EXECUTE FUNCTION bump_api_key_generation();
