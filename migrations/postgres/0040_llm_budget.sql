-- The learning budget: what combee's own LLM calls spend, per UTC day, prompt
-- and kind of call (every HTTP attempt, retried ones included), per pass of
-- a round (one claim of it, run until it ends or waits), and the reservations of calls in flight; the caps a prompt was
-- given through the API; the days a cap held a prompt back (so the webhook
-- says so once a day); and which queued rounds wait for the budget. Additive
-- only: new tables and one defaulted column, which the previous release
-- ignores. A prompt is named by its name ('' for calls of no prompt); a day
-- is kept as its UTC date text (YYYY-MM-DD).
CREATE TABLE llm_spend_days (
    day     text NOT NULL,
    prompt  text NOT NULL,
    kind    text NOT NULL,
    tokens  bigint NOT NULL DEFAULT 0,
    usd     double precision NOT NULL DEFAULT 0,
    calls   bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (day, prompt, kind)
);
CREATE INDEX llm_spend_days_by_prompt ON llm_spend_days (prompt, day);

CREATE TABLE llm_spend_rounds (
    round_id uuid NOT NULL,
    pass     integer NOT NULL,
    tokens   bigint NOT NULL DEFAULT 0,
    usd      double precision NOT NULL DEFAULT 0,
    PRIMARY KEY (round_id, pass)
);

CREATE TABLE llm_spend_holds (
    id         uuid PRIMARY KEY,
    day        text NOT NULL,
    prompt     text NOT NULL,
    round_id   uuid,
    pass       integer,
    tokens     bigint NOT NULL,
    usd        double precision NOT NULL,
    expires_at timestamptz NOT NULL
);
CREATE INDEX llm_spend_holds_by_day ON llm_spend_holds (day, prompt);
CREATE INDEX llm_spend_holds_by_round ON llm_spend_holds (round_id, pass) WHERE round_id IS NOT NULL;

CREATE TABLE prompt_budgets (
    prompt           text PRIMARY KEY,
    tokens_per_day   bigint,
    usd_per_day      double precision,
    tokens_per_round bigint,
    usd_per_round    double precision,
    updated_at       timestamptz NOT NULL
);

CREATE TABLE budget_reached (
    day        text NOT NULL,
    prompt     text NOT NULL,
    scope      text NOT NULL,
    until      timestamptz NOT NULL,
    reached_at timestamptz NOT NULL,
    lifted_at  timestamptz,
    PRIMARY KEY (day, prompt)
);

ALTER TABLE rounds ADD COLUMN budget_wait boolean NOT NULL DEFAULT false;
