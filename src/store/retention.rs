//! Data retention in the store: finding and deleting expired rows in small
//! batches (each its own short transaction, so no lock is held for long and
//! no table is rewritten), compacting old rounds to their summary, and the
//! sizes an operator watches. What expires when is the worker's policy
//! (`worker::retention`); the label history is never touched here.

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use serde::Serialize;
use uuid::Uuid;

use super::{
    StoreKind, StoreResult,
    backend::{Backend, SqlStore},
    controller_state::CONTROLLER_SAMPLES_KEPT,
    sql::{Cols, Param, now, sql},
    traces::{TRACE_COLUMNS, ids_made_before, trace_from_row},
};
use crate::domain::{PromptName, Trace};

/// Which expired traces a pass is after.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum TraceExpiry {
    /// Learned from by a round; expire by creation time.
    Consumed,
    /// Failed too often to be learned from; expire by creation time.
    Failed,
    /// Held back by an operator (and not reserved); expire by quarantine time.
    Quarantined,
}

impl TraceExpiry {
    pub const ALL: [TraceExpiry; 3] = [Self::Consumed, Self::Failed, Self::Quarantined];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Consumed => "consumed",
            Self::Failed => "failed",
            Self::Quarantined => "quarantined",
        }
    }

    /// SQL: a trace `t` of this kind.
    fn condition(self) -> &'static str {
        match self {
            // `status <> 'pending'`: the condition of `traces_settled_by_prompt`,
            // written out so SQLite sees the partial index serves it.
            Self::Consumed => "t.status = 'consumed' AND t.status <> 'pending'",
            Self::Failed => {
                "t.status = 'failed' AND t.status <> 'pending' AND t.quarantined_at IS NULL AND t.round_id IS NULL"
            }
            Self::Quarantined => "t.quarantined_at IS NOT NULL AND t.round_id IS NULL",
        }
    }

    /// SQL: expired before `$cutoff`, with an id bound on the same time (ids
    /// are UUIDv7, so old rows come first in every index that ends in `id`).
    fn expired(self, cutoff: &str, id_bound: &str) -> String {
        match self {
            Self::Quarantined => format!("t.quarantined_at < {cutoff}"),
            _ => format!("t.created_at < {cutoff} AND t.id < {id_bound}"),
        }
    }
}

/// What a batch of expired traces took with it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct DeletedTraces {
    pub traces: u64,
    pub reflections: u64,
    pub round_links: u64,
    pub otlp_spans: u64,
}

/// Other rows that expire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Expiring {
    /// Finished rounds' group outputs and per-call LLM records (the round and
    /// its usage totals stay, in `round_summaries`), their overload-meter
    /// records (the meter's sums stay) and their batch-size controller samples
    /// beyond each prompt's newest [`CONTROLLER_SAMPLES_KEPT`].
    RoundDetails,
    /// Outbound webhook events with no delivery pending, with their deliveries and delivery log.
    Events,
    /// `Idempotency-Key`s past their TTL.
    IdempotencyKeys,
    /// Inbound webhook ids remembered to refuse replays, long past the signature tolerance.
    InboundWebhookIds,
}

impl Expiring {
    pub const ALL: [Expiring; 4] = [Self::RoundDetails, Self::Events, Self::IdempotencyKeys, Self::InboundWebhookIds];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::RoundDetails => "round_details",
            Self::Events => "webhook_events",
            Self::IdempotencyKeys => "idempotency_keys",
            Self::InboundWebhookIds => "inbound_webhook_ids",
        }
    }

    /// SQL: the ids (or keys) of the rows expired before `$1`, oldest first (no LIMIT).
    fn candidates(self) -> &'static str {
        match self {
            Self::RoundDetails => {
                // The condition of the partial index `rounds_detail_to_compact`: rounds
                // compacted before are not in it, so finding a batch costs the batch.
                "SELECT r.id FROM rounds r WHERE r.finished_at IS NOT NULL AND r.detail_compacted_at IS NULL
                   AND r.finished_at < $1 ORDER BY r.finished_at"
            }
            Self::Events => {
                "SELECT e.id FROM webhook_events e WHERE e.created_at < $1
                   AND NOT EXISTS (SELECT 1 FROM webhook_deliveries d WHERE d.event_id = e.id AND d.status = 'pending')
                 ORDER BY e.created_at"
            }
            Self::IdempotencyKeys => {
                "SELECT owner, key FROM idempotency_keys WHERE created_at < $1 ORDER BY created_at"
            }
            Self::InboundWebhookIds => "SELECT id FROM inbound_webhooks WHERE received_at < $1 ORDER BY received_at",
        }
    }
}

/// What stays of a round whose detail was compacted.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RoundSummary {
    pub calls: u64,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub cost_usd: f64,
    pub retries: u64,
    pub compacted_at: DateTime<Utc>,
}

#[async_trait]
pub trait Retention: Send + Sync {
    /// Up to `limit` ids of the prompt's traces of `kind` that expired before
    /// `cutoff`, oldest first.
    async fn expired_traces(
        &self,
        prompt: &PromptName,
        kind: TraceExpiry,
        cutoff: DateTime<Utc>,
        limit: u32,
    ) -> StoreResult<Vec<Uuid>>;
    /// How many there are (what `combee prune --dry-run` reports).
    async fn count_expired_traces(
        &self,
        prompt: &PromptName,
        kind: TraceExpiry,
        cutoff: DateTime<Utc>,
    ) -> StoreResult<u64>;
    /// These traces as stored, in id order (for the archive).
    async fn traces_by_ids(&self, ids: &[Uuid]) -> StoreResult<Vec<Trace>>;
    /// Deletes those of these traces that are still of `kind`, with their
    /// reflections, round links and OTLP spans, in one transaction. The
    /// outcome rollups keep what they counted for.
    async fn delete_expired_traces(&self, ids: &[Uuid], kind: TraceExpiry) -> StoreResult<DeletedTraces>;
    /// Deletes (or, for round details, compacts) up to `limit` rows of `what`
    /// that expired before `cutoff`, in one transaction; how many.
    async fn prune(&self, what: Expiring, cutoff: DateTime<Utc>, limit: u32) -> StoreResult<u64>;
    /// How many rows of `what` expired before `cutoff`.
    async fn count_expiring(&self, what: Expiring, cutoff: DateTime<Utc>) -> StoreResult<u64>;
    /// The usage totals kept for a round whose detail was compacted.
    async fn round_summary(&self, round: Uuid) -> StoreResult<Option<RoundSummary>>;
    /// Bytes each table takes with its indexes (Postgres), or the database
    /// file (SQLite, one entry `database`); largest first.
    async fn table_sizes(&self) -> StoreResult<Vec<(String, i64)>>;
}

#[async_trait]
impl<D: Backend> Retention for SqlStore<D> {
    async fn expired_traces(
        &self,
        prompt: &PromptName,
        kind: TraceExpiry,
        cutoff: DateTime<Utc>,
        limit: u32,
    ) -> StoreResult<Vec<Uuid>> {
        let text = format!(
            "SELECT t.id FROM traces t WHERE t.prompt_id = (SELECT id FROM prompts WHERE name = $1 AND project = $5)
               AND {} AND {}
             ORDER BY t.id LIMIT $4",
            kind.condition(),
            kind.expired("$2", "$3")
        );
        sql::<D>(&text)
            .bind(prompt.as_str())
            .bind(cutoff)
            .bind(ids_made_before(cutoff))
            .bind(i64::from(limit))
            .bind(prompt.project())
            .map(&mut *self.reader.acquire().await?, |row| Cols::<D>(row).get("id"))
            .await
    }

    async fn count_expired_traces(
        &self,
        prompt: &PromptName,
        kind: TraceExpiry,
        cutoff: DateTime<Utc>,
    ) -> StoreResult<u64> {
        let text = format!(
            "SELECT count(*) AS n FROM traces t
             WHERE t.prompt_id = (SELECT id FROM prompts WHERE name = $1 AND project = $4) AND {} AND {}",
            kind.condition(),
            kind.expired("$2", "$3")
        );
        let n: Option<i64> = sql::<D>(&text)
            .bind(prompt.as_str())
            .bind(cutoff)
            .bind(ids_made_before(cutoff))
            .bind(prompt.project())
            .value(&mut *self.reader.acquire().await?, "n")
            .await?;
        Ok(n.unwrap_or(0).max(0) as u64)
    }

    async fn traces_by_ids(&self, ids: &[Uuid]) -> StoreResult<Vec<Trace>> {
        let text = format!(
            "SELECT {TRACE_COLUMNS} FROM traces t JOIN prompts p ON p.id = t.prompt_id WHERE {} ORDER BY t.id",
            D::any_of("t.id", "$1")
        );
        sql::<D>(&text).bind(Param::Ids(Some(ids))).map(&mut *self.reader.acquire().await?, trace_from_row::<D>).await
    }

    async fn delete_expired_traces(&self, ids: &[Uuid], kind: TraceExpiry) -> StoreResult<DeletedTraces> {
        if ids.is_empty() {
            return Ok(DeletedTraces::default());
        }
        let mut tx = self.begin_write().await?;
        // Locked first, still of their kind: a trace requeued or released
        // meanwhile is left alone (rounds skip locked rows).
        let text = format!(
            "SELECT t.id FROM traces t WHERE {} AND {}{}",
            D::any_of("t.id", "$1"),
            kind.condition(),
            D::lock(" FOR UPDATE SKIP LOCKED")
        );
        let locked: Vec<Uuid> =
            sql::<D>(&text).bind(Param::Ids(Some(ids))).map(&mut tx, |row| Cols::<D>(row).get("id")).await?;
        if locked.is_empty() {
            tx.rollback().await?;
            return Ok(DeletedTraces::default());
        }
        let mut counts = [0u64; 4];
        for (n, (table, column)) in counts.iter_mut().zip([
            ("reflections", "trace_id"),
            ("round_traces", "trace_id"),
            ("otlp_spans", "trace_id"),
            ("traces", "id"),
        ]) {
            *n = sql::<D>(&format!("DELETE FROM {table} WHERE {}", D::any_of(column, "$1")))
                .bind(Param::Ids(Some(&locked)))
                .execute(&mut tx)
                .await?;
        }
        tx.commit().await?;
        let [reflections, round_links, otlp_spans, traces] = counts;
        Ok(DeletedTraces { traces, reflections, round_links, otlp_spans })
    }

    async fn prune(&self, what: Expiring, cutoff: DateTime<Utc>, limit: u32) -> StoreResult<u64> {
        let batch = format!("{} LIMIT $2", what.candidates());
        let mut tx = self.begin_write().await?;
        let n = match what {
            Expiring::RoundDetails => {
                let ids: Vec<Uuid> = sql::<D>(&batch)
                    .bind(cutoff)
                    .bind(i64::from(limit))
                    .map(&mut tx, |row| Cols::<D>(row).get("id"))
                    .await?;
                if ids.is_empty() {
                    tx.rollback().await?;
                    return Ok(0);
                }
                let at = now();
                sql::<D>(&format!(
                    "INSERT INTO round_summaries (round_id, calls, prompt_tokens, completion_tokens, cost_usd, retries,
                                                  compacted_at)
                     SELECT r.id, count(c.id), coalesce(sum(c.prompt_tokens), 0), coalesce(sum(c.completion_tokens), 0),
                            {}, coalesce(sum(c.retries), 0), $2
                     FROM rounds r LEFT JOIN llm_calls c ON c.round_id = r.id WHERE {} GROUP BY r.id",
                    D::real("coalesce(sum(c.cost_usd), 0)"),
                    D::any_of("r.id", "$1")
                ))
                .bind(Param::Ids(Some(&ids)))
                .bind(at)
                .execute(&mut tx)
                .await?;
                sql::<D>(&format!("DELETE FROM llm_calls WHERE {}", D::any_of("round_id", "$1")))
                    .bind(Param::Ids(Some(&ids)))
                    .execute(&mut tx)
                    .await?;
                // The overload meter's per-round record: its sums live on in
                // `meter_totals`, and a round this old is never recorded again.
                sql::<D>(&format!("DELETE FROM meter_counts WHERE {}", D::any_of("round_id", "$1")))
                    .bind(Param::Ids(Some(&ids)))
                    .execute(&mut tx)
                    .await?;
                // The batch-size controller's samples of these rounds, but for a
                // prompt's newest `CONTROLLER_SAMPLES_KEPT` (all the controller
                // reads), so a quiet prompt keeps its profile; the cut is found
                // once per prompt.
                sql::<D>(&format!(
                    "WITH cut AS (
                         SELECT p.prompt_id, (SELECT k.id FROM controller_samples k WHERE k.prompt_id = p.prompt_id
                                              ORDER BY k.id DESC LIMIT 1 OFFSET {offset}) AS below
                         FROM (SELECT DISTINCT prompt_id FROM controller_samples WHERE {these}) p)
                     DELETE FROM controller_samples WHERE {these}
                       AND id < coalesce((SELECT below FROM cut WHERE cut.prompt_id = controller_samples.prompt_id), 0)",
                    offset = CONTROLLER_SAMPLES_KEPT - 1,
                    these = D::any_of("round_id", "$1"),
                ))
                .bind(Param::Ids(Some(&ids)))
                .execute(&mut tx)
                .await?;
                let dropped = match D::KIND {
                    StoreKind::Postgres => "detail - 'group_outputs'",
                    StoreKind::Sqlite => "json_remove(detail, '$.group_outputs')",
                };
                sql::<D>(&format!(
                    "UPDATE rounds SET detail = {dropped}, detail_compacted_at = $2 WHERE {}",
                    D::any_of("id", "$1")
                ))
                .bind(Param::Ids(Some(&ids)))
                .bind(at)
                .execute(&mut tx)
                .await?
            }
            Expiring::Events | Expiring::IdempotencyKeys | Expiring::InboundWebhookIds => {
                let (table, key) = match what {
                    Expiring::Events => ("webhook_events", "id"),
                    Expiring::IdempotencyKeys => ("idempotency_keys", "(owner, key)"),
                    _ => ("inbound_webhooks", "id"),
                };
                sql::<D>(&format!("DELETE FROM {table} WHERE {key} IN ({batch})"))
                    .bind(cutoff)
                    .bind(i64::from(limit))
                    .execute(&mut tx)
                    .await?
            }
        };
        tx.commit().await?;
        Ok(n)
    }

    async fn count_expiring(&self, what: Expiring, cutoff: DateTime<Utc>) -> StoreResult<u64> {
        let n: Option<i64> = sql::<D>(&format!("SELECT count(*) AS n FROM ({}) x", what.candidates()))
            .bind(cutoff)
            .value(&mut *self.reader.acquire().await?, "n")
            .await?;
        Ok(n.unwrap_or(0).max(0) as u64)
    }

    async fn round_summary(&self, round: Uuid) -> StoreResult<Option<RoundSummary>> {
        let row = sql::<D>(
            "SELECT calls, prompt_tokens, completion_tokens, cost_usd, retries, compacted_at FROM round_summaries
             WHERE round_id = $1",
        )
        .bind(round)
        .fetch_optional(&mut *self.reader.acquire().await?)
        .await?;
        row.map(|row| {
            let r = Cols::<D>(&row);
            let count = |c: &str| -> StoreResult<u64> { Ok(r.get::<i64>(c)?.max(0) as u64) };
            Ok(RoundSummary {
                calls: count("calls")?,
                prompt_tokens: count("prompt_tokens")?,
                completion_tokens: count("completion_tokens")?,
                cost_usd: r.get("cost_usd")?,
                retries: count("retries")?,
                compacted_at: r.get("compacted_at")?,
            })
        })
        .transpose()
    }

    async fn table_sizes(&self) -> StoreResult<Vec<(String, i64)>> {
        let text = match D::KIND {
            StoreKind::Postgres => {
                "SELECT c.relname AS name, pg_total_relation_size(c.oid) AS bytes FROM pg_class c
                 JOIN pg_namespace n ON n.oid = c.relnamespace
                 WHERE c.relkind = 'r' AND n.nspname = current_schema() ORDER BY bytes DESC, name"
            }
            StoreKind::Sqlite => {
                "SELECT 'database' AS name, page_count * page_size AS bytes
                 FROM pragma_page_count(), pragma_page_size()"
            }
        };
        sql::<D>(text)
            .map(&mut *self.reader.acquire().await?, |row| {
                let r = Cols::<D>(row);
                Ok((r.get("name")?, r.get("bytes")?))
            })
            .await
    }
}
