-- Operator web UI sessions. Only a hash of the session token is kept (the
-- token itself lives in the browser's HttpOnly cookie); the CSRF token is
-- per session and rendered into every state-changing form. A session belongs
-- to the API key it was opened with, so revoking the key ends it.
-- (Numbered 0005: 0004 is taken by work on another branch.)

CREATE TABLE ui_sessions (
    token_hash  TEXT PRIMARY KEY,
    key_id      TEXT NOT NULL REFERENCES api_keys (id),
    csrf_token  TEXT NOT NULL,
    created_at  INTEGER NOT NULL,
    expires_at  INTEGER NOT NULL
);
CREATE INDEX ui_sessions_by_expiry ON ui_sessions (expires_at);
