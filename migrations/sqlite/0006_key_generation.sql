-- A counter bumped by every change to an existing API key (revocation,
-- deletion), by a trigger so any writer bumps it — `combee keys revoke` in
-- another process included. The server cannot hear other processes' writes,
-- so it reads this per request and trusts a cached key only while the
-- counter is the one it was read at.

CREATE TABLE api_key_generation (
    id          INTEGER PRIMARY KEY CHECK (id = 1),
    generation  INTEGER NOT NULL
);
INSERT INTO api_key_generation (id, generation) VALUES (1, 0);

CREATE TRIGGER api_keys_updated AFTER UPDATE ON api_keys
BEGIN
    UPDATE api_key_generation SET generation = generation + 1;
END;

CREATE TRIGGER api_keys_deleted AFTER DELETE ON api_keys
BEGIN
    UPDATE api_key_generation SET generation = generation + 1;
END;
