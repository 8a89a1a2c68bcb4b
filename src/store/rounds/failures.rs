//! A prompt's failure streak: the rounds that failed in a row, which the
//! scheduler waits out, until a round succeeds or an operator clears it.

use async_trait::async_trait;
use uuid::Uuid;

use crate::{
    domain::{PromptName, backoff::FailureStreak},
    store::{
        StoreResult,
        backend::{Backend, SqlStore},
        sql::{Cols, sql},
        versions::prompt_name,
    },
};

/// A prompt's streak of failed rounds.
#[async_trait]
pub trait FailureStreakStore: Send + Sync {
    /// The prompt's failing rounds; `None` when there is no such prompt.
    async fn failure_streak(&self, prompt: &PromptName) -> StoreResult<Option<FailureStreak>>;
    /// Ends the prompt's failure streak (an operator's reset); false when there is no such prompt.
    async fn clear_failure_streak(&self, prompt: &PromptName) -> StoreResult<bool>;
    /// Up to `limit` prompts in a failure streak, by name.
    async fn failing_prompts(&self, limit: u32) -> StoreResult<Vec<(PromptName, FailureStreak)>>;
}

/// Resets a prompt's failure streak inside the caller's transaction.
pub(super) async fn reset_failures<D: Backend>(c: &mut D::Connection, prompt_id: Uuid) -> StoreResult<()> {
    sql::<D>(
        "UPDATE prompts SET failure_streak = 0, last_failed_at = NULL, last_failure = NULL
         WHERE id = $1 AND failure_streak <> 0",
    )
    .bind(prompt_id)
    .execute(c)
    .await?;
    Ok(())
}

pub(super) fn failures_from_row<D: Backend>(row: &D::Row, with_reason: bool) -> StoreResult<FailureStreak> {
    let r = Cols::<D>(row);
    Ok(FailureStreak {
        failures: r.get::<i32>("failure_streak")?.max(0) as u32,
        last_failed_at: r.get("last_failed_at")?,
        last_failure: if with_reason { r.get("last_failure")? } else { None },
    })
}

#[async_trait]
impl<D: Backend> FailureStreakStore for SqlStore<D> {
    async fn failure_streak(&self, prompt: &PromptName) -> StoreResult<Option<FailureStreak>> {
        sql::<D>("SELECT failure_streak, last_failed_at, last_failure FROM prompts WHERE project = $1 AND name = $2")
            .bind(prompt.project())
            .bind(prompt.as_str())
            .fetch_optional(&mut *self.reader.acquire().await?)
            .await?
            .as_ref()
            .map(|row| failures_from_row::<D>(row, true))
            .transpose()
    }

    async fn clear_failure_streak(&self, prompt: &PromptName) -> StoreResult<bool> {
        let mut tx = self.begin_write().await?;
        let id: Option<Uuid> = sql::<D>("SELECT id FROM prompts WHERE project = $1 AND name = $2")
            .bind(prompt.project())
            .bind(prompt.as_str())
            .value(&mut tx, "id")
            .await?;
        let Some(id) = id else { return Ok(false) };
        reset_failures::<D>(&mut tx, id).await?;
        tx.commit().await?;
        Ok(true)
    }

    async fn failing_prompts(&self, limit: u32) -> StoreResult<Vec<(PromptName, FailureStreak)>> {
        sql::<D>(
            "SELECT project, name, failure_streak, last_failed_at, last_failure FROM prompts WHERE failure_streak > 0
             ORDER BY name, project LIMIT $1",
        )
        .bind(i64::from(limit))
        .map(&mut *self.reader.acquire().await?, |row| {
            let r = Cols::<D>(row);
            let name = prompt_name(&r.get::<String>("project")?, &r.get::<String>("name")?)?;
            Ok((name, failures_from_row::<D>(row, true)?))
        })
        .await
    }
}
