//! The batch-size controller's round-time samples and last choice, and the overload meter's counts,
//! per prompt.

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;
use utoipa::ToSchema;
use uuid::Uuid;

use super::{
    StoreResult,
    backend::{Backend, SqlStore},
    sql::{Cols, json, now, sql},
};
use crate::domain::PromptName;

/// One delay sample of the batch-size controller, as stored.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ControllerSample {
    pub batch_size: u32,
    pub round_secs: f64,
    pub round_id: Uuid,
    pub created_at: DateTime<Utc>,
}

/// Controller samples a prompt keeps however old its rounds: the controller
/// reads its newest this many, and retention deletes only older ones.
pub const CONTROLLER_SAMPLES_KEPT: u32 = 500;

/// Overload-meter counts of one group-size bucket (see `learn::capacity::meter`):
/// copies marked by another covered copy of their reflection, and of them
/// those their own group covered too.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
pub struct MeterCounts {
    /// Smallest group size of the bucket (a power of two).
    pub size_min: u32,
    pub marked: u64,
    pub recaptured: u64,
    /// Rounds that contributed (1 when recording one round).
    pub rounds: u64,
}

/// What the batch-size controller and the overload meter remember per prompt.
#[async_trait]
pub trait ControllerStore: Send + Sync {
    /// The prompt's most recent samples, oldest first.
    async fn controller_samples(&self, prompt: &PromptName, limit: u32) -> StoreResult<Vec<ControllerSample>>;
    async fn save_controller_choice(&self, prompt: &PromptName, choice: &serde_json::Value) -> StoreResult<()>;
    async fn controller_choice(&self, prompt: &PromptName) -> StoreResult<Option<(serde_json::Value, DateTime<Utc>)>>;
    /// Records one round's meter counts per bucket; recording the same round
    /// again changes nothing (`rounds` of the input is ignored).
    async fn record_meter_counts(&self, prompt: &PromptName, round: Uuid, counts: &[MeterCounts]) -> StoreResult<()>;
    /// The prompt's meter: counts summed over its rounds, per bucket, smallest
    /// first (kept as running totals when rounds are recorded: O(buckets)).
    async fn meter_counts(&self, prompt: &PromptName) -> StoreResult<Vec<MeterCounts>>;
}

#[async_trait]
impl<D: Backend> ControllerStore for SqlStore<D> {
    async fn controller_samples(&self, prompt: &PromptName, limit: u32) -> StoreResult<Vec<super::ControllerSample>> {
        // Walks `controller_samples_by_prompt` back from the prompt's newest
        // sample and stops at the limit. The prompt is matched as a range of
        // one so that the ORDER BY keeps naming it: Postgres drops an ORDER BY
        // column that the WHERE pins with `=`, and then, with a prepared
        // statement's generic plan, walked the primary key back through every
        // prompt's samples instead, filtering (18,000 blocks a read after 30
        // minutes of the soak benchmark). Only the prompt's index gives this
        // order (390 blocks for 410 samples, whatever the other prompts hold).
        let mut samples = sql::<D>(
            "SELECT s.batch_size, s.round_secs, s.round_id, s.created_at FROM controller_samples s
             WHERE s.prompt_id >= (SELECT id FROM prompts WHERE name = $1 AND project = $3)
               AND s.prompt_id <= (SELECT id FROM prompts WHERE name = $1 AND project = $3)
             ORDER BY s.prompt_id DESC, s.id DESC LIMIT $2",
        )
        .bind(prompt.as_str())
        .bind(i64::from(limit))
        .bind(prompt.project())
        .map(&mut *self.reader.acquire().await?, |row| {
            let r = Cols::<D>(row);
            Ok(super::ControllerSample {
                batch_size: r.get::<i32>("batch_size")? as u32,
                round_secs: r.get("round_secs")?,
                round_id: r.get("round_id")?,
                created_at: r.get("created_at")?,
            })
        })
        .await?;
        samples.reverse();
        Ok(samples)
    }

    async fn save_controller_choice(&self, prompt: &PromptName, choice: &Value) -> StoreResult<()> {
        sql::<D>(
            "INSERT INTO controller_choices (prompt_id, choice, updated_at) SELECT id, $1, $2 FROM prompts
             WHERE name = $3 AND project = $4
             ON CONFLICT (prompt_id) DO UPDATE SET choice = excluded.choice, updated_at = excluded.updated_at",
        )
        .bind(json(choice))
        .bind(now())
        .bind(prompt.as_str())
        .bind(prompt.project())
        .execute(&mut *self.writer.acquire().await?)
        .await?;
        Ok(())
    }

    async fn controller_choice(&self, prompt: &PromptName) -> StoreResult<Option<(Value, DateTime<Utc>)>> {
        let row = sql::<D>(
            "SELECT c.choice, c.updated_at FROM controller_choices c JOIN prompts p ON p.id = c.prompt_id
             WHERE p.name = $1 AND p.project = $2",
        )
        .bind(prompt.as_str())
        .bind(prompt.project())
        .fetch_optional(&mut *self.reader.acquire().await?)
        .await?;
        row.map(|row| {
            let r = Cols::<D>(&row);
            Ok((r.get("choice")?, r.get("updated_at")?))
        })
        .transpose()
    }

    async fn record_meter_counts(
        &self,
        prompt: &PromptName,
        round: Uuid,
        counts: &[super::MeterCounts],
    ) -> StoreResult<()> {
        let mut tx = self.begin_write().await?;
        for c in counts {
            let (size_min, marked, recaptured) = (
                i32::try_from(c.size_min).unwrap_or(i32::MAX),
                i64::try_from(c.marked).unwrap_or(i64::MAX),
                i64::try_from(c.recaptured).unwrap_or(i64::MAX),
            );
            let recorded = sql::<D>(
                "INSERT INTO meter_counts (round_id, prompt_id, size_min, marked, recaptured, created_at)
                 SELECT $1, id, $2, $3, $4, $5 FROM prompts WHERE name = $6 AND project = $7
                 ON CONFLICT (round_id, size_min) DO NOTHING",
            )
            .bind(round)
            .bind(size_min)
            .bind(marked)
            .bind(recaptured)
            .bind(now())
            .bind(prompt.as_str())
            .bind(prompt.project())
            .execute(&mut tx)
            .await?;
            // The totals move only with a row recorded now: a round recorded twice counts once.
            if recorded == 1 {
                sql::<D>(
                    "INSERT INTO meter_totals (prompt_id, size_min, marked, recaptured, rounds)
                     SELECT id, $1, $2, $3, 1 FROM prompts WHERE name = $4 AND project = $5
                     ON CONFLICT (prompt_id, size_min) DO UPDATE SET marked = meter_totals.marked + excluded.marked,
                        recaptured = meter_totals.recaptured + excluded.recaptured, rounds = meter_totals.rounds + 1",
                )
                .bind(size_min)
                .bind(marked)
                .bind(recaptured)
                .bind(prompt.as_str())
                .bind(prompt.project())
                .execute(&mut tx)
                .await?;
            }
        }
        tx.commit().await?;
        Ok(())
    }

    async fn meter_counts(&self, prompt: &PromptName) -> StoreResult<Vec<super::MeterCounts>> {
        // The running totals (`meter_totals`), not a sum over every round ever recorded.
        sql::<D>(
            "SELECT size_min, marked, recaptured, rounds FROM meter_totals
             WHERE prompt_id = (SELECT id FROM prompts WHERE name = $1 AND project = $2) ORDER BY size_min",
        )
        .bind(prompt.as_str())
        .bind(prompt.project())
        .map(&mut *self.reader.acquire().await?, |row| {
            let r = Cols::<D>(row);
            Ok(super::MeterCounts {
                size_min: r.get::<i32>("size_min")? as u32,
                marked: r.get::<i64>("marked")? as u64,
                recaptured: r.get::<i64>("recaptured")? as u64,
                rounds: r.get::<i64>("rounds")? as u64,
            })
        })
        .await
    }
}
