//! What a running round keeps as it goes: its reflections (adopted from
//! earlier rounds or newly made), every LLM call it pays for, and its progress.

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use serde_json::Value;
use uuid::Uuid;

use super::bounded;
use crate::{
    domain::Reflection,
    llm::{AnswerRead, LlmCall, OutputFormat, REFUSED_ANSWER_CHARS},
    store::{
        StoreResult,
        backend::{Backend, SqlStore},
        sql::{Cols, corrupt, enum_str, json, now, sql},
    },
};

/// One stored LLM call of a round.
#[derive(Debug, Clone)]
pub struct RoundCall {
    pub attempt: i32,
    pub call: LlmCall,
    pub created_at: DateTime<Utc>,
}

/// A running round's journal: reflections, LLM calls, progress.
#[async_trait]
pub trait RoundJournalStore: Send + Sync {
    /// Copies into `round` the reflections that earlier rounds of the same prompt
    /// stored for the round's traces against the same base version and strategy,
    /// so a re-run over the same base pays no reflector call twice. Returns how many
    /// were copied; reflections the round already has are kept.
    async fn adopt_reflections(&self, round: Uuid) -> StoreResult<u64>;
    /// Stores a reflection once (a repeat for the same trace is ignored).
    async fn save_reflection(
        &self,
        round: Uuid,
        trace: Uuid,
        reflection: &Reflection,
        from_trace: bool,
    ) -> StoreResult<()>;
    async fn round_reflections(&self, round: Uuid) -> StoreResult<Vec<(Uuid, Reflection, bool)>>;
    async fn record_llm_call(&self, round: Uuid, attempt: i32, call: &LlmCall) -> StoreResult<()>;
    async fn round_calls(&self, round: Uuid) -> StoreResult<Vec<RoundCall>>;
    /// Saves progress (k, phase timings, group outputs); false when the lease was lost.
    async fn update_round(
        &self,
        round: Uuid,
        attempt: i32,
        k: Option<i32>,
        detail: &serde_json::Value,
    ) -> StoreResult<bool>;
}

#[async_trait]
impl<D: Backend> RoundJournalStore for SqlStore<D> {
    async fn adopt_reflections(&self, round: Uuid) -> StoreResult<u64> {
        // Newest first: of several earlier reflections on a trace, the newest wins.
        sql::<D>(
            "INSERT INTO reflections (round_id, trace_id, reflection, from_trace, created_at)
             SELECT cur.id, r.trace_id, r.reflection, r.from_trace, $2
             FROM rounds cur
             JOIN round_traces rt ON rt.round_id = cur.id
             JOIN reflections r ON r.trace_id = rt.trace_id AND r.round_id <> cur.id
             JOIN rounds prev ON prev.id = r.round_id AND prev.prompt_id = cur.prompt_id
                             AND prev.base_version = cur.base_version AND prev.strategy = cur.strategy
             WHERE cur.id = $1
             ORDER BY r.trace_id, r.created_at DESC
             ON CONFLICT DO NOTHING",
        )
        .bind(round)
        .bind(now())
        .execute(&mut *self.writer.acquire().await?)
        .await
    }

    async fn save_reflection(&self, round: Uuid, trace: Uuid, r: &Reflection, from_trace: bool) -> StoreResult<()> {
        let reflection = serde_json::to_value(r).map_err(|_| corrupt("reflection"))?;
        sql::<D>(
            "INSERT INTO reflections (round_id, trace_id, reflection, from_trace, created_at) VALUES ($1, $2, $3, $4, $5)
             ON CONFLICT DO NOTHING",
        )
        .bind(round)
        .bind(trace)
        .bind(json(&reflection))
        .bind(from_trace)
        .bind(now())
        .execute(&mut *self.writer.acquire().await?)
        .await?;
        Ok(())
    }

    async fn round_reflections(&self, round: Uuid) -> StoreResult<Vec<(Uuid, Reflection, bool)>> {
        sql::<D>("SELECT trace_id, reflection, from_trace FROM reflections WHERE round_id = $1 ORDER BY created_at, trace_id")
            .bind(round)
            .map(&mut *self.reader.acquire().await?, |row| {
                let r = Cols::<D>(row);
                let reflection = serde_json::from_value(r.get("reflection")?).map_err(|_| corrupt("reflection"))?;
                Ok((r.get("trace_id")?, reflection, r.get("from_trace")?))
            })
            .await
    }

    async fn record_llm_call(&self, round: Uuid, attempt: i32, call: &LlmCall) -> StoreResult<()> {
        sql::<D>(
            "INSERT INTO llm_calls (round_id, attempt, role, model, prompt_tokens, completion_tokens, cost_usd, latency_ms,
                                    retries, error, created_at, read_as, refused_answer, output_format, concurrency_limit)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15)",
        )
        .bind(round)
        .bind(attempt)
        .bind(enum_str(call.role))
        .bind(&call.model)
        .bind(call.prompt_tokens as i64)
        .bind(call.completion_tokens as i64)
        .bind(call.cost_usd)
        .bind(call.latency_ms as i64)
        .bind(call.retries as i32)
        .bind(call.error.as_deref())
        .bind(now())
        .bind(call.read.map(AnswerRead::as_str))
        // Untrusted model output: bounded here too, whatever the caller cut.
        .bind(call.refused_answer.as_deref().map(|a| bounded(a, REFUSED_ANSWER_CHARS)))
        .bind(call.output_format.map(OutputFormat::as_str))
        .bind(call.concurrency_limit.map(|n| i64::from(n.min(i32::MAX as u32)) as i32))
        .execute(&mut *self.writer.acquire().await?)
        .await?;
        Ok(())
    }

    async fn round_calls(&self, round: Uuid) -> StoreResult<Vec<RoundCall>> {
        sql::<D>(
            "SELECT attempt, role, model, prompt_tokens, completion_tokens, cost_usd, latency_ms, retries, error, created_at,
                    read_as, refused_answer, output_format, concurrency_limit
             FROM llm_calls WHERE round_id = $1 ORDER BY id",
        )
        .bind(round)
        .map(&mut *self.reader.acquire().await?, |row| {
            let r = Cols::<D>(row);
            Ok(RoundCall {
                attempt: r.get("attempt")?,
                call: LlmCall {
                    role: serde_json::from_value(Value::String(r.get("role")?)).map_err(|_| corrupt("llm role"))?,
                    model: r.get("model")?,
                    prompt_tokens: r.get::<i64>("prompt_tokens")? as u64,
                    completion_tokens: r.get::<i64>("completion_tokens")? as u64,
                    cost_usd: r.get("cost_usd")?,
                    latency_ms: r.get::<i64>("latency_ms")? as u64,
                    retries: r.get::<i32>("retries")? as u32,
                    error: r.get("error")?,
                    // A value a newer binary wrote and this one does not know reads as absent.
                    read: r.get::<Option<String>>("read_as")?.as_deref().and_then(AnswerRead::parse),
                    refused_answer: r.get("refused_answer")?,
                    output_format: r.get::<Option<String>>("output_format")?.as_deref().and_then(OutputFormat::parse),
                    concurrency_limit: r.get::<Option<i32>>("concurrency_limit")?.map(|n| n.max(0) as u32),
                },
                created_at: r.get("created_at")?,
            })
        })
        .await
    }

    async fn update_round(&self, round: Uuid, attempt: i32, k: Option<i32>, detail: &Value) -> StoreResult<bool> {
        let n = sql::<D>(
            "UPDATE rounds SET k = COALESCE($1, k), detail = $2, updated_at = $3
             WHERE id = $4 AND attempt = $5 AND status = 'running'",
        )
        .bind(k)
        .bind(json(detail))
        .bind(now())
        .bind(round)
        .bind(attempt)
        .execute(&mut *self.writer.acquire().await?)
        .await?;
        Ok(n == 1)
    }
}
