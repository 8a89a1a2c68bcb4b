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
    token_hash  text PRIMARY KEY,
    subject     text NOT NULL,
    name        text NOT NULL,
    email       text,
    grants      jsonb NOT NULL,
    project     text,
    role        text,
    csrf_token  text NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    expires_at  timestamptz NOT NULL
);
CREATE INDEX person_sessions_by_expiry ON person_sessions (expires_at);

-- Explicit grants: a person named by the provider's subject (`sub`) or by an
-- email address is given a role in one project (NULL: server-wide).
CREATE TABLE members (
    subject     text PRIMARY KEY,
    project     text,
    role        text NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now()
);

-- A sign-in under way: the hash of its `state`, the nonce and the PKCE
-- verifier, taken (deleted) once by the callback, so a state works once.
CREATE TABLE oidc_logins (
    state_hash  text PRIMARY KEY,
    nonce       text NOT NULL,
    verifier    text NOT NULL,
    expires_at  timestamptz NOT NULL
);
CREATE INDEX oidc_logins_by_expiry ON oidc_logins (expires_at);
