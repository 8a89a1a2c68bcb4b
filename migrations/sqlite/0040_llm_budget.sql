-- The learning budget: what combee's own LLM calls spend, per UTC day, prompt
-- and kind of call (every HTTP attempt, retried ones included), per pass of
-- a round (one claim of it, run until it ends or waits), and the reservations of calls in flight; the caps a prompt was
-- given through the API; the days a cap held a prompt back (so the webhook
-- says so once a day); and which queued rounds wait for the budget. Additive
-- only: new tables and one defaulted column, which the previous release
-- ignores. A prompt is named by its name ('' for calls of no prompt); a day
-- is kept as its UTC date TEXT (YYYY-MM-DD).
CREATE TABLE llm_spend_days (
    day     TEXT NOT NULL,
    prompt  TEXT NOT NULL,
    kind    TEXT NOT NULL,
    tokens  INTEGER NOT NULL DEFAULT 0,
    usd     REAL NOT NULL DEFAULT 0,
    calls   INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (day, prompt, kind)
);
CREATE INDEX llm_spend_days_by_prompt ON llm_spend_days (prompt, day);

CREATE TABLE llm_spend_rounds (
    round_id TEXT NOT NULL,
    pass     INTEGER NOT NULL,
    tokens   INTEGER NOT NULL DEFAULT 0,
    usd      REAL NOT NULL DEFAULT 0,
    PRIMARY KEY (round_id, pass)
);

CREATE TABLE llm_spend_holds (
    id         TEXT PRIMARY KEY,
    day        TEXT NOT NULL,
    prompt     TEXT NOT NULL,
    round_id   TEXT,
    pass       INTEGER,
    tokens     INTEGER NOT NULL,
    usd        REAL NOT NULL,
    expires_at INTEGER NOT NULL
);
CREATE INDEX llm_spend_holds_by_day ON llm_spend_holds (day, prompt);
CREATE INDEX llm_spend_holds_by_round ON llm_spend_holds (round_id, pass) WHERE round_id IS NOT NULL;

CREATE TABLE prompt_budgets (
    prompt           TEXT PRIMARY KEY,
    tokens_per_day   INTEGER,
    usd_per_day      REAL,
    tokens_per_round INTEGER,
    usd_per_round    REAL,
    updated_at       INTEGER NOT NULL
);

CREATE TABLE budget_reached (
    day        TEXT NOT NULL,
    prompt     TEXT NOT NULL,
    scope      TEXT NOT NULL,
    until      INTEGER NOT NULL,
    reached_at INTEGER NOT NULL,
    lifted_at  INTEGER,
    PRIMARY KEY (day, prompt)
);

ALTER TABLE rounds ADD COLUMN budget_wait INTEGER NOT NULL DEFAULT 0;
