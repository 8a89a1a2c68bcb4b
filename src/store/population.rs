//! The population of an `evaluated` prompt (its arms and their ratings) and the per-task rewards
//! its rater compares arms on.

use async_trait::async_trait;
use chrono::{DateTime, Utc};

use super::{
    Change, StoreResult,
    backend::{Backend, SqlStore},
    sql::{Cols, arm_from_row, corrupt, json, now, prompt_id, require_version, sql},
};
use crate::domain::{PromptName, population::PopulationArm};

/// The rewards of one version on one task (traces carrying `metadata.task_key`).
#[derive(Debug, Clone, PartialEq)]
pub struct TaskRewards {
    pub version: i64,
    pub task_key: String,
    /// Rewarded traces of this version on this task.
    pub traces: u64,
    /// Sum of their rewards: 1/0 for `feedback.success`, else `feedback.score`.
    pub reward_sum: f64,
}

/// The arms of a prompt's population and the rewards they are rated on.
#[async_trait]
pub trait PopulationStore: Send + Sync {
    /// Per (version, `metadata.task_key`) reward sums of the prompt's rewarded,
    /// unquarantined traces created in `[from, until)` (traces without a string
    /// task key or a version are left out), so arms can be compared on matched work.
    async fn task_rewards(
        &self,
        prompt: &PromptName,
        from: DateTime<Utc>,
        until: DateTime<Utc>,
    ) -> StoreResult<Vec<TaskRewards>>;
    /// The prompt's population (every arm, retired ones too), by version.
    async fn population(&self, prompt: &PromptName) -> StoreResult<Vec<PopulationArm>>;
    /// Inserts or replaces these arms (by version) in one transaction, and
    /// tells every process's cache (NOTIFY on Postgres). `NotFound` for an
    /// unknown prompt, `Invalid` for a version it does not have.
    async fn save_population(&self, prompt: &PromptName, arms: &[PopulationArm]) -> StoreResult<()>;
}

#[async_trait]
impl<D: Backend> PopulationStore for SqlStore<D> {
    async fn task_rewards(
        &self,
        prompt: &PromptName,
        from: DateTime<Utc>,
        until: DateTime<Utc>,
    ) -> StoreResult<Vec<TaskRewards>> {
        let text = format!(
            "WITH r AS (
               SELECT t.prompt_version AS version, {task_key} AS task_key,
                      CASE WHEN {is_flag} THEN {flag} ELSE {score} END AS reward
               FROM traces t JOIN prompts p ON p.id = t.prompt_id
               WHERE p.name = $1 AND t.created_at >= $2 AND t.created_at < $3 AND t.quarantined_at IS NULL
                 AND t.prompt_version IS NOT NULL AND {keyed})
             SELECT version, task_key, count(reward) AS n, {total} AS total
             FROM r WHERE reward IS NOT NULL GROUP BY version, task_key ORDER BY version, task_key",
            task_key = D::json_text("t.metadata", "task_key"),
            is_flag = D::json_is("t.feedback", "success", "boolean"),
            flag = D::json_flag("t.feedback", "success"),
            score = D::json_number("t.feedback", "score"),
            keyed = D::json_is("t.metadata", "task_key", "string"),
            total = D::real("coalesce(sum(reward), 0)"),
        );
        sql::<D>(&text)
            .bind(prompt.as_str())
            .bind(from)
            .bind(until)
            .map(&mut *self.reader.acquire().await?, |row| {
                let r = Cols::<D>(row);
                Ok(TaskRewards {
                    version: r.get("version")?,
                    task_key: r.get("task_key")?,
                    traces: r.get::<i64>("n")?.max(0) as u64,
                    reward_sum: r.get("total")?,
                })
            })
            .await
    }

    async fn population(&self, prompt: &PromptName) -> StoreResult<Vec<PopulationArm>> {
        sql::<D>(
            "SELECT a.version, a.state, a.mu, a.sigma, a.weight, a.scored_traces, a.created_from, a.parents,
                    a.rated_until
             FROM population_arms a JOIN prompts p ON p.id = a.prompt_id
             WHERE p.name = $1 ORDER BY a.version",
        )
        .bind(prompt.as_str())
        .map(&mut *self.reader.acquire().await?, arm_from_row::<D>)
        .await
    }

    async fn save_population(&self, prompt: &PromptName, arms: &[PopulationArm]) -> StoreResult<()> {
        let mut tx = self.writer.begin().await?;
        let id = prompt_id::<D>(&mut tx, prompt).await?;
        for arm in arms {
            require_version::<D>(&mut tx, id, arm.version).await?;
            sql::<D>(
                "INSERT INTO population_arms (prompt_id, version, state, mu, sigma, weight, scored_traces, created_from,
                                              rated_until, created_at, updated_at, parents)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $10, $11)
                 ON CONFLICT (prompt_id, version) DO UPDATE SET
                    state = excluded.state, mu = excluded.mu, sigma = excluded.sigma, weight = excluded.weight,
                    scored_traces = excluded.scored_traces, created_from = excluded.created_from,
                    rated_until = excluded.rated_until, updated_at = excluded.updated_at, parents = excluded.parents",
            )
            .bind(id)
            .bind(arm.version)
            .bind(arm.state.as_str())
            .bind(arm.rating.mu)
            .bind(arm.rating.sigma)
            .bind(arm.weight)
            .bind(arm.scored_traces as i64)
            .bind(arm.created_from)
            .bind(arm.rated_until)
            .bind(now())
            .bind(json(&serde_json::to_value(&arm.parents).map_err(|_| corrupt("arm parents"))?))
            .execute(&mut tx)
            .await?;
        }
        self.commit(tx, Change::Prompt(prompt.to_string())).await?;
        Ok(())
    }
}
