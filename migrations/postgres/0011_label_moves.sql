-- Label history: one row per change of a label (created, moved, deleted), with
-- who or what made it, of which kind, why, and the numbers behind it. Written in
-- the same transaction as the change; rows are never updated or deleted.
-- Label moves made before this migration are not backfilled.

CREATE TABLE label_moves (
    id            bigserial PRIMARY KEY,          -- order of the moves
    prompt_id     uuid NOT NULL REFERENCES prompts (id),
    label         text NOT NULL,
    from_version  bigint,                         -- NULL: the label did not exist
    to_version    bigint,                         -- NULL: the label was deleted
    kind          text NOT NULL,
    actor         text NOT NULL,
    reason        text NOT NULL,
    evidence      jsonb,
    at            timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX label_moves_by_prompt ON label_moves (prompt_id, id);

CREATE FUNCTION label_moves_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'label_moves is append-only';
END;
$$;
CREATE TRIGGER label_moves_append_only BEFORE UPDATE OR DELETE ON label_moves
    FOR EACH ROW EXECUTE FUNCTION label_moves_append_only();
