//! The concurrency limit each LLM backend earned, by base URL and model, so
//! that a new process starts from it instead of from the start of the climb.

use async_trait::async_trait;

use super::{
    StoreResult,
    backend::{Backend, SqlStore},
    sql::{now, sql},
};

/// What LLM backends earned, kept across processes.
#[async_trait]
pub trait LlmLimitStore: Send + Sync {
    /// The limit last kept for this backend, if any.
    async fn llm_limit(&self, base_url: &str, model: &str) -> StoreResult<Option<u32>>;
    /// Keeps `limit` for this backend (the last one kept wins).
    async fn keep_llm_limit(&self, base_url: &str, model: &str, limit: u32) -> StoreResult<()>;
}

#[async_trait]
impl<D: Backend> LlmLimitStore for SqlStore<D> {
    async fn llm_limit(&self, base_url: &str, model: &str) -> StoreResult<Option<u32>> {
        let limit: Option<i32> = sql::<D>("SELECT concurrency FROM llm_limits WHERE base_url = $1 AND model = $2")
            .bind(base_url)
            .bind(model)
            .value(&mut *self.reader.acquire().await?, "concurrency")
            .await?;
        Ok(limit.and_then(|l| u32::try_from(l).ok()).filter(|&l| l > 0))
    }

    async fn keep_llm_limit(&self, base_url: &str, model: &str, limit: u32) -> StoreResult<()> {
        sql::<D>(
            "INSERT INTO llm_limits (base_url, model, concurrency, updated_at) VALUES ($1, $2, $3, $4)
             ON CONFLICT (base_url, model) DO UPDATE SET concurrency = excluded.concurrency, updated_at = excluded.updated_at",
        )
        .bind(base_url)
        .bind(model)
        .bind(i32::try_from(limit).unwrap_or(i32::MAX))
        .bind(now())
        .execute(&mut *self.writer.acquire().await?)
        .await?;
        Ok(())
    }
}
