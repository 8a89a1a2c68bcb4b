-- The `evaluated` promotion policy: a third value for prompts.promotion, and
-- each prompt's population of arms (versions measured on live traffic).
ALTER TABLE prompts DROP CONSTRAINT prompts_promotion_check;
ALTER TABLE prompts ADD CONSTRAINT prompts_promotion_check CHECK (promotion IN ('auto', 'manual', 'evaluated'));

-- One row per version that is or was an arm. `state`: champion (the version
-- production points at), challenger (gets a share of traffic), retired
-- (traffic stopped; the version itself stays). μ, σ: TrueSkill rating;
-- weight: share of subjects served this arm (0 when retired).
CREATE TABLE population_arms (
    prompt_id      uuid NOT NULL REFERENCES prompts (id),
    version        bigint NOT NULL,
    state          text NOT NULL CHECK (state IN ('champion', 'challenger', 'retired')),
    mu             double precision NOT NULL,
    sigma          double precision NOT NULL CHECK (sigma > 0),
    weight         double precision NOT NULL CHECK (weight >= 0 AND weight <= 1),
    scored_traces  bigint NOT NULL DEFAULT 0,   -- scored traces counted in rated windows
    created_from   bigint,                      -- parent version (NULL: the first champion)
    rated_until    timestamptz,                 -- end of the last rating window
    created_at     timestamptz NOT NULL DEFAULT now(),
    updated_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (prompt_id, version)
);
