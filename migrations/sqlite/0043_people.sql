-- People signed in through single sign-on (OpenID Connect), beside the API-key
-- sessions of ui_sessions, and the explicit grants admins give people.
-- Additive: new tables only, which nothing older reads or writes.
--
-- person_sessions: a person's web UI session, found by the SHA-256 of its
-- cookie token. `grants` holds every grant the person signed in with (JSON
-- [{"project": null | "x", "role": "viewer" | "operator" | "admin"}]);
-- `project` and `role` are the one in use (project NULL: server-wide), and
-- `role` is NULL until a person with several grants picks one.
CREATE TABLE person_sessions (
    token_hash  TEXT PRIMARY KEY,
    subject     TEXT NOT NULL,
    name        TEXT NOT NULL,
    email       TEXT,
    grants      TEXT NOT NULL,
    project     TEXT,
    role        TEXT,
    csrf_token  TEXT NOT NULL,
    created_at  INTEGER NOT NULL,
    expires_at  INTEGER NOT NULL
);
CREATE INDEX person_sessions_by_expiry ON person_sessions (expires_at);

-- Explicit grants: a person named by the provider's subject (`sub`) or by an
-- email address is given a role in one project (NULL: server-wide).
CREATE TABLE members (
    subject     TEXT PRIMARY KEY,
    project     TEXT,
    role        TEXT NOT NULL,
    created_at  INTEGER NOT NULL,
    updated_at  INTEGER NOT NULL
);

-- A sign-in under way: the hash of its `state`, the nonce and the PKCE
-- verifier, taken (deleted) once by the callback, so a state works once.
CREATE TABLE oidc_logins (
    state_hash  TEXT PRIMARY KEY,
    nonce       TEXT NOT NULL,
    verifier    TEXT NOT NULL,
    expires_at  INTEGER NOT NULL
);
CREATE INDEX oidc_logins_by_expiry ON oidc_logins (expires_at);
