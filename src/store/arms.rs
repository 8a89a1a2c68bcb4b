//! The population of an `evaluated` prompt (its arms and their ratings) and the per-task rewards
//! its rater compares arms on.

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use serde_json::Value;

use super::{
    Change, StoreKind, StoreResult,
    backend::{Backend, SqlStore},
    sql::{Cols, Dialect, corrupt, json, now, sql},
    versions::{prompt_id, prompt_name, require_versions},
};
use crate::{
    domain::{
        PromptName,
        population::{ArmState, PopulationArm},
    },
    evaluate::rater::TaskRewards,
};

/// Arms one upsert writes (ten parameters each, well under either backend's limit).
const ARMS_PER_STATEMENT: usize = 100;

const ARM_COLUMNS: &str = "a.version, a.state, a.mu, a.sigma, a.weight, a.scored_traces, a.created_from, a.parents, \
     a.rated_until, a.created_at AS joined_at";

/// An `evaluated` prompt, and the end of the last window its population was rated in.
#[derive(Debug, Clone, PartialEq)]
pub struct RatingSlot {
    pub prompt: PromptName,
    /// The latest `rated_until` of its live arms; `None` when none was ever rated.
    pub rated_until: Option<DateTime<Utc>>,
    /// How many live arms (champion and challengers) it has: a window may
    /// close early only when there are two to compare.
    pub live_arms: i64,
}

/// The arms of a prompt's population and the rewards they are rated on.
#[async_trait]
pub trait PopulationStore: Send + Sync {
    /// One page of the `evaluated` prompts by name, after `after`, each with the
    /// end of its last rated window: what a rating tick needs to tell which
    /// windows are due, in one statement however many prompts there are.
    async fn rating_schedule(&self, after: Option<&PromptName>, limit: u32) -> StoreResult<Vec<RatingSlot>>;
    /// Per (version, `metadata.task_key`) reward sums of the prompt's rewarded,
    /// unquarantined traces created in `[from, until)` (traces without a string
    /// task key or a version are left out), so arms can be compared on matched work.
    async fn task_rewards(
        &self,
        prompt: &PromptName,
        from: DateTime<Utc>,
        until: DateTime<Utc>,
    ) -> StoreResult<Vec<TaskRewards>>;
    /// The live arms of the prompt's population (champion and challengers),
    /// and the arms of the versions in `also` whatever their state (a retired
    /// arm production moved back to, a retired parent), by version. Retired
    /// arms stay in the store as history; what the rater, the served arms and
    /// a new arm's prior need costs O(live arms), however many there are.
    async fn live_arms(&self, prompt: &PromptName, also: &[i64]) -> StoreResult<Vec<PopulationArm>>;
    /// One page of the whole population, retired arms too: up to `limit`
    /// arms with versions above `after`, by version.
    async fn population_page(
        &self,
        prompt: &PromptName,
        after: Option<i64>,
        limit: u32,
    ) -> StoreResult<Vec<PopulationArm>>;
    /// Inserts or replaces these arms (by version) in one transaction, and
    /// tells every process's cache (NOTIFY on Postgres); arms not given are
    /// left as they are. `NotFound` for an unknown prompt, `Invalid` for a
    /// version it does not have.
    async fn save_population(&self, prompt: &PromptName, arms: &[PopulationArm]) -> StoreResult<()>;
    /// [`Self::save_population`] for the rater's own ratings, whose commit
    /// does not wait for the disk (Postgres `synchronous_commit = off`; the
    /// change is visible and announced at once, and durable within a fraction
    /// of a second). A rating lost in a crash is derived data: the arms keep
    /// their last `rated_until`, so the next tick rates that window again
    /// from the durable rollups. Any later durable commit (a label move)
    /// makes it durable first, so nothing that follows it can outlive it.
    async fn save_ratings(&self, prompt: &PromptName, arms: &[PopulationArm]) -> StoreResult<()>;
}

/// Whether a save's commit waits for the disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Durability {
    /// The commit returns once the change is on disk.
    Flushed,
    /// The commit returns at once; the disk follows within a fraction of a second.
    Deferred,
}

#[async_trait]
impl<D: Backend> PopulationStore for SqlStore<D> {
    async fn rating_schedule(&self, after: Option<&PromptName>, limit: u32) -> StoreResult<Vec<RatingSlot>> {
        // `state <> 'retired'` is the condition of the partial index `population_arms_live`.
        sql::<D>(
            "SELECT p.project, p.name, (SELECT max(a.rated_until) FROM population_arms a
                             WHERE a.prompt_id = p.id AND a.state <> 'retired') AS rated_until,
                            (SELECT count(*) FROM population_arms a
                             WHERE a.prompt_id = p.id AND a.state <> 'retired') AS live
             FROM prompts p WHERE p.promotion = 'evaluated' AND (p.name > $1 OR (p.name = $1 AND p.project > $3))
             ORDER BY p.name, p.project LIMIT $2",
        )
        .bind(after.map_or("", PromptName::as_str))
        .bind(i64::from(limit))
        .bind(after.map_or("", PromptName::project))
        .map(&mut *self.reader.acquire().await?, |row| {
            let r = Cols::<D>(row);
            let prompt = prompt_name(&r.get::<String>("project")?, &r.get::<String>("name")?)?;
            Ok(RatingSlot { prompt, rated_until: r.get("rated_until")?, live_arms: r.get("live")? })
        })
        .await
    }

    async fn task_rewards(
        &self,
        prompt: &PromptName,
        from: DateTime<Utc>,
        until: DateTime<Utc>,
    ) -> StoreResult<Vec<TaskRewards>> {
        super::rollups::read_task_rewards(self, prompt, from, until).await
    }

    async fn live_arms(&self, prompt: &PromptName, also: &[i64]) -> StoreResult<Vec<PopulationArm>> {
        let mut c = self.reader.acquire().await?;
        // `state <> 'retired'` is the condition of the partial index `population_arms_live`.
        let mut arms = sql::<D>(&format!(
            "SELECT {ARM_COLUMNS} FROM population_arms a
             WHERE a.prompt_id = (SELECT id FROM prompts WHERE name = $1 AND project = $2) AND a.state <> 'retired'
             ORDER BY a.version"
        ))
        .bind(prompt.as_str())
        .bind(prompt.project())
        .map(&mut *c, arm_from_row::<D>)
        .await?;
        for v in also {
            if arms.iter().any(|a| a.version == *v) {
                continue;
            }
            let arm = sql::<D>(&format!(
                "SELECT {ARM_COLUMNS} FROM population_arms a
                 WHERE a.prompt_id = (SELECT id FROM prompts WHERE name = $1 AND project = $3) AND a.version = $2"
            ))
            .bind(prompt.as_str())
            .bind(*v)
            .bind(prompt.project())
            .map(&mut *c, arm_from_row::<D>)
            .await?;
            arms.extend(arm);
        }
        arms.sort_by_key(|a| a.version);
        Ok(arms)
    }

    async fn population_page(
        &self,
        prompt: &PromptName,
        after: Option<i64>,
        limit: u32,
    ) -> StoreResult<Vec<PopulationArm>> {
        sql::<D>(&format!(
            "SELECT {ARM_COLUMNS} FROM population_arms a
             WHERE a.prompt_id = (SELECT id FROM prompts WHERE name = $1 AND project = $4) AND a.version > $2
             ORDER BY a.version LIMIT $3"
        ))
        .bind(prompt.as_str())
        .bind(after.unwrap_or(i64::MIN))
        .bind(i64::from(limit))
        .bind(prompt.project())
        .map(&mut *self.reader.acquire().await?, arm_from_row::<D>)
        .await
    }

    async fn save_population(&self, prompt: &PromptName, arms: &[PopulationArm]) -> StoreResult<()> {
        save_arms(self, prompt, arms, Durability::Flushed).await
    }

    async fn save_ratings(&self, prompt: &PromptName, arms: &[PopulationArm]) -> StoreResult<()> {
        save_arms(self, prompt, arms, Durability::Deferred).await
    }
}

async fn save_arms<D: Backend>(
    s: &SqlStore<D>,
    prompt: &PromptName,
    arms: &[PopulationArm],
    durability: Durability,
) -> StoreResult<()> {
    let mut tx = s.begin_write().await?;
    if durability == Durability::Deferred && D::KIND == StoreKind::Postgres {
        // For this transaction only. (SQLite's single writer commits at
        // the durability its connection was opened with.)
        sql::<D>("SET LOCAL synchronous_commit = off").execute(&mut tx).await?;
    }
    let id = prompt_id::<D>(&mut tx, prompt).await?;
    // A constant number of statements per save, however many arms: the
    // rater saves every rated window, so its cost must not grow with them.
    for chunk in arms.chunks(ARMS_PER_STATEMENT) {
        require_versions::<D>(&mut tx, id, &chunk.iter().map(|a| a.version).collect::<Vec<_>>()).await?;
        let parents = chunk
            .iter()
            .map(|a| serde_json::to_value(&a.parents).map_err(|_| corrupt("arm parents")))
            .collect::<StoreResult<Vec<_>>>()?;
        let rows = (0..chunk.len())
            .map(|i| {
                // $1 the prompt, $2 now, then nine per arm in the order bound below.
                let p: Vec<String> = (0..9).map(|k| format!("${}", 3 + 9 * i + k)).collect();
                format!("($1, {}, $2, $2, {})", p[..8].join(", "), p[8])
            })
            .collect::<Vec<_>>()
            .join(", ");
        let text = format!(
            "INSERT INTO population_arms (prompt_id, version, state, mu, sigma, weight, scored_traces, created_from,
                                              rated_until, created_at, updated_at, parents)
                 VALUES {rows}
                 ON CONFLICT (prompt_id, version) DO UPDATE SET
                    state = excluded.state, mu = excluded.mu, sigma = excluded.sigma, weight = excluded.weight,
                    scored_traces = excluded.scored_traces, created_from = excluded.created_from,
                    rated_until = excluded.rated_until, updated_at = excluded.updated_at, parents = excluded.parents"
        );
        let mut q = sql::<D>(&text).bind(id).bind(now());
        for (arm, parents) in chunk.iter().zip(&parents) {
            q = q
                .bind(arm.version)
                .bind(arm.state.as_str())
                .bind(arm.rating.mu)
                .bind(arm.rating.sigma)
                .bind(arm.weight)
                .bind(arm.scored_traces as i64)
                .bind(arm.created_from)
                .bind(arm.rated_until)
                .bind(json(parents));
        }
        q.execute(&mut tx).await?;
    }
    s.commit(tx, Change::prompt(prompt)).await?;
    Ok(())
}

pub(super) fn arm_from_row<D: Dialect>(row: &D::Row) -> StoreResult<PopulationArm> {
    let r = Cols::<D>(row);
    let state: String = r.get("state")?;
    Ok(PopulationArm {
        version: r.get("version")?,
        state: ArmState::parse(&state).ok_or_else(|| corrupt("arm state"))?,
        rating: crate::evaluate::trueskill::Rating { mu: r.get("mu")?, sigma: r.get("sigma")? },
        weight: r.get("weight")?,
        scored_traces: r.get::<i64>("scored_traces")?.max(0) as u64,
        // Arms written before crossover (migration 0014) name one parent, in `created_from`.
        parents: match r.get::<Option<Value>>("parents")? {
            Some(v) => serde_json::from_value(v).map_err(|_| corrupt("arm parents"))?,
            None => r.get::<Option<i64>>("created_from")?.into_iter().collect(),
        },
        created_from: r.get("created_from")?,
        rated_until: r.get("rated_until")?,
        joined_at: r.get("joined_at")?,
    })
}
