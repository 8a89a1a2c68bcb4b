//! The history: prompts' rounds, LLM calls, traces, reflections and OTLP
//! spans over the days before the live period, bulk-loaded with their
//! timestamps and rolled up, and the per-table sizes the report follows.

use std::collections::BTreeMap;

use anyhow::Context;
use sqlx::{Connection, PgConnection};

use crate::{SoakArgs, log};

/// A UUIDv7 of the row's time (SQL), random below the millisecond.
const V7: &str = "(lpad(to_hex((extract(epoch FROM ts) * 1000)::bigint), 12, '0') || '7' \
     || substr(md5(g::text || ':' || p::text), 1, 3) || '8' || substr(md5(p::text || ':' || g::text), 1, 15))::uuid";

pub(crate) async fn load_history(db: &mut PgConnection, args: &SoakArgs) -> anyhow::Result<()> {
    let per_prompt = args.history_traces / args.prompts as u64;
    let span_us = args.history_days * 86_400 * 1_000_000;
    sqlx::raw_sql("SET synchronous_commit = off").execute(&mut *db).await?;
    let prompts: Vec<(uuid::Uuid, String)> =
        sqlx::query_as("SELECT id, name FROM prompts ORDER BY name").fetch_all(&mut *db).await?;
    // A round per prompt and day, with its LLM calls and group outputs.
    log("loading rounds");
    sqlx::query(&format!(
        "INSERT INTO rounds (id, prompt_id, status, trigger, method, strategy, seed, duplication, n, k, base_version,
                             attempt, detail, created_at, started_at, finished_at, updated_at, not_before)
         SELECT md5('round:' || p.id || ':' || d)::uuid, p.id, 'succeeded', 'backlog', 'combee', 'playbook', d, 2, 200, 14, 1,
                1, jsonb_build_object('group_outputs', (SELECT jsonb_agg(jsonb_build_object('group', k, 'traces', '[]'::jsonb,
                    'output', jsonb_build_object('operations', jsonb_build_array(jsonb_build_object('op', 'ADD', 'section', 'tips',
                    'content', repeat('a specific insight about the task ', 6)))))) FROM generate_series(1, 14) k),
                    'phases', '{{}}'::jsonb),
                ts, ts, ts + interval '40 seconds', ts, ts
         FROM prompts p, generate_series(0, {days} - 1) d,
              LATERAL (SELECT now() - interval '1 hour' - ({days} - d) * interval '1 day' AS ts) t",
        days = args.history_days
    ))
    .execute(&mut *db)
    .await?;
    sqlx::query(
        "INSERT INTO llm_calls (round_id, attempt, role, model, prompt_tokens, completion_tokens, cost_usd, latency_ms, retries, created_at)
         SELECT r.id, 1, CASE WHEN c < 20 THEN 'reflector' ELSE 'aggregator' END, 'sim', 900, 300, 0.0004, 800, 0, r.finished_at
         FROM rounds r, generate_series(1, 34) c",
    )
    .execute(&mut *db)
    .await?;
    // A bulk load builds the secondary indexes of the big tables once at the end (as a
    // restore would) instead of row by row: the same definitions, dropped and made again.
    let indexes: Vec<(String, String)> = sqlx::query_as(
        "SELECT indexname::text, indexdef FROM pg_indexes WHERE schemaname = 'public'
           AND tablename IN ('traces', 'otlp_spans', 'reflections', 'round_traces')
           AND indexname NOT IN (SELECT conname FROM pg_constraint)",
    )
    .fetch_all(&mut *db)
    .await?;
    for (name, _) in &indexes {
        sqlx::raw_sql(&format!("DROP INDEX {name}")).execute(&mut *db).await?;
    }
    // Traces: consumed (98 %), failed (1.5 %), quarantined (0.5 %); every tenth linked to its
    // day's round with a reflection; every tenth (another) with two OTLP spans.
    const CHUNK: u64 = 250_000;
    for (p_idx, (prompt_id, name)) in prompts.iter().enumerate() {
        log(format!("loading {per_prompt} traces of {name}"));
        let mut from = 0;
        while from < per_prompt {
            let to = (from + CHUNK).min(per_prompt);
            let mut tx = db.begin().await?;
            sqlx::query(&format!(
                "WITH s AS (
                     SELECT g, {p_idx} AS p, now() - interval '1 hour' - ({span_us} - g * {span_us} / {per_prompt}) * interval '1 microsecond' AS ts
                     FROM generate_series({from}::bigint, {to} - 1) g)
                 INSERT INTO traces (id, prompt_id, prompt_version, status, input, trajectory, output, feedback, metadata,
                                     attempts, created_at, updated_at, quarantined_at, quarantine_reason)
                 SELECT {V7}, $1, 1,
                        CASE WHEN g % 200 < 3 THEN 'failed' WHEN g % 200 = 3 THEN 'pending' ELSE 'consumed' END,
                        jsonb_build_object('question', 'How do I reset the password of account ' || g || '?'),
                        jsonb_build_array(jsonb_build_object('role', 'assistant', 'content', 'Looking up account ' || g),
                                          jsonb_build_object('role', 'tool', 'name', 'lookup', 'content', 'found ' || g)),
                        to_jsonb('Go to Settings, then Security, then Reset. Ticket ' || g),
                        jsonb_build_object('success', (g * 7919) % 10 < 6, 'score', ((g * 104729) % 11) / 10.0),
                        jsonb_build_object('task_key', 'task-' || (g % 40), 'tokens', 200 + g % 300),
                        CASE WHEN g % 200 < 3 THEN 3 ELSE 0 END, ts, ts,
                        CASE WHEN g % 200 = 3 THEN ts END, CASE WHEN g % 200 = 3 THEN 'hostile burst' END
                 FROM s"
            ))
            .bind(prompt_id)
            .execute(&mut *tx)
            .await?;
            sqlx::query(&format!(
                "WITH s AS (
                     SELECT g, {p_idx} AS p, now() - interval '1 hour' - ({span_us} - g * {span_us} / {per_prompt}) * interval '1 microsecond' AS ts
                     FROM generate_series({from}::bigint, {to} - 1) g WHERE g % 10 = 0 AND g % 200 >= 4),
                 t AS (SELECT {V7} AS id, ts, md5('round:' || $1::text || ':' || greatest(0, {days} - 1 - floor(extract(epoch FROM (now() - interval '1 hour' - ts)) / 86400)::int))::uuid AS round_id, g FROM s),
                 rt AS (INSERT INTO round_traces (round_id, trace_id, position) SELECT round_id, id, g FROM t)
                 INSERT INTO reflections (round_id, trace_id, reflection, from_trace, created_at)
                 SELECT round_id, id, jsonb_build_object('error', 'none', 'root_cause', 'the agent skipped a step',
                        'correct_approach', 'check the account first', 'key_insight', 'verify the account before resetting ' || g,
                        'bullet_tags', '[]'::jsonb), false, ts FROM t",
                days = args.history_days
            ))
            .bind(prompt_id)
            .execute(&mut *tx)
            .await?;
            sqlx::query(&format!(
                "WITH s AS (
                     SELECT g, {p_idx} AS p, now() - interval '1 hour' - ({span_us} - g * {span_us} / {per_prompt}) * interval '1 microsecond' AS ts
                     FROM generate_series({from}::bigint, {to} - 1) g WHERE g % 10 = 1)
                 INSERT INTO otlp_spans (otel_trace_id, span_id, trace_id, body, received_at)
                 SELECT md5('otel:' || $2 || ':' || g), lpad(to_hex(k), 16, '0'), {V7},
                        convert_to(repeat('gen_ai.input.messages: how do I reset the password of account ' || g || '; ', 6), 'UTF8'), ts
                 FROM s, generate_series(1, 2) k"
            ))
            .bind(prompt_id)
            .bind(name)
            .execute(&mut *tx)
            .await?;
            tx.commit().await?;
            from = to;
        }
    }
    log(format!("building {} indexes", indexes.len()));
    for (_, def) in &indexes {
        sqlx::raw_sql(def).execute(&mut *db).await?;
    }
    // Rolled up as migration 0015 does for traces already stored.
    log("rolling up the history");
    let migration = include_str!("../../../../migrations/postgres/0015_outcome_rollups.sql");
    let backfill = &migration[migration.find("INSERT INTO outcome_rollups").context("the backfill of 0015")?..];
    sqlx::raw_sql(backfill).execute(&mut *db).await?;
    log("VACUUM ANALYZE");
    sqlx::raw_sql("VACUUM ANALYZE").execute(&mut *db).await?;
    Ok(())
}

pub(crate) async fn table_sizes(db: &mut PgConnection) -> anyhow::Result<BTreeMap<String, i64>> {
    let rows: Vec<(String, i64)> = sqlx::query_as(
        "SELECT c.relname::text, pg_total_relation_size(c.oid) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE c.relkind = 'r' AND n.nspname = 'public'",
    )
    .fetch_all(&mut *db)
    .await?;
    Ok(rows.into_iter().collect())
}
