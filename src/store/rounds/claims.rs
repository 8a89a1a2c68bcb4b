//! Opening a round over a prompt's oldest pending traces, the scheduler's
//! backlogs, and a round's lease: claimed by a worker, kept by its heartbeat.

use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use uuid::Uuid;

use super::{
    failures::{failures_from_row, reset_failures},
    record::RoundRecordStore,
};
use crate::{
    domain::{
        Prompt, PromptName, PromptSettings, Trace, Version,
        backoff::FailureStreak,
        label::Selector,
        round::{self, Method, Round, RoundTrigger},
    },
    store::{
        Change, PromptStore, StoreError, StoreKind, StoreResult,
        backend::{Backend, SqlStore},
        prompts::prompt_from_row,
        sql::{Cols, corrupt, now, sql},
        traces::{TRACE_COLUMNS, trace_from_row},
    },
};

/// A request to open a round over a prompt's oldest pending traces.
#[derive(Debug, Clone)]
pub struct OpenRound {
    pub prompt: PromptName,
    pub trigger: RoundTrigger,
    pub method: Method,
    /// Take at most this many traces.
    pub batch: u32,
    /// Open nothing when fewer traces are pending.
    pub min_traces: u32,
    pub seed: i64,
    /// The `webhook-id` of the inbound trigger asking for this round: it is
    /// remembered in the round's transaction, so only with a round opened.
    pub inbound_webhook_id: Option<String>,
    /// When the prompt has evaluators, leave out pending traces they have not
    /// judged yet unless they arrived longer ago than this (a broken judge
    /// delays learning by this much, never stops it); `None` takes them all.
    pub judge_wait: Option<std::time::Duration>,
    /// The version the round learns on; `None` (or a version the prompt does
    /// not have): the one `production` points at.
    pub base_version: Option<i64>,
}

/// A prompt's learning backlog, for the scheduler.
#[derive(Debug, Clone, PartialEq)]
pub struct Backlog {
    pub prompt: Prompt,
    /// Pending traces not reserved by a round.
    pub pending: i64,
    pub oldest: Option<DateTime<Utc>>,
    /// A round is queued or running.
    pub active_round: bool,
    /// The prompt's failing rounds (the scheduler waits out their backoff);
    /// `last_failure` is not read here.
    pub failures: FailureStreak,
}

/// A round a worker now holds the lease of, with everything needed to run it.
#[derive(Debug, Clone)]
pub struct ClaimedRound {
    pub round: Round,
    pub prompt: Prompt,
    pub base: Version,
    pub traces: Vec<Trace>,
}

/// Opening rounds and holding their lease.
#[async_trait]
pub trait RoundClaimStore: Send + Sync {
    /// Reserves up to `batch` of the prompt's oldest pending traces for a new
    /// queued round. `None` when fewer than `min_traces` are pending;
    /// `AlreadyExists` when the prompt has a round in flight; `Duplicate` when
    /// `inbound_webhook_id` opened a round before. The id is remembered only
    /// when this call opens the round: a refused trigger can be retried.
    async fn open_round(&self, req: &OpenRound) -> StoreResult<Option<Round>>;
    /// Per prompt: unreserved pending traces, the oldest one's age, whether a round is in flight.
    async fn backlogs(&self) -> StoreResult<Vec<Backlog>>;
    /// Takes the lease of the oldest claimable round (queued and due, or
    /// running with an expired lease) and bumps its attempt number.
    async fn claim_round(&self, owner: &str, lease: std::time::Duration) -> StoreResult<Option<ClaimedRound>>;
    /// Extends the lease; false when this attempt no longer holds it.
    async fn heartbeat_round(&self, round: Uuid, attempt: i32, lease: std::time::Duration) -> StoreResult<bool>;
}

#[async_trait]
impl<D: Backend> RoundClaimStore for SqlStore<D> {
    async fn open_round(&self, req: &OpenRound) -> StoreResult<Option<Round>> {
        let now = now();
        let mut tx = self.begin_write().await?;
        // First, so a duplicate delivery is told so (not "a round is in flight":
        // its own round). A concurrent duplicate waits here on the primary key;
        // every refusal below rolls back, forgetting the id.
        if let Some(hook) = &req.inbound_webhook_id {
            let n = sql::<D>("INSERT INTO inbound_webhooks (id, received_at) VALUES ($1, $2) ON CONFLICT DO NOTHING")
                .bind(hook)
                .bind(now)
                .execute(&mut tx)
                .await?;
            if n == 0 {
                return Err(StoreError::Duplicate);
            }
        }
        // The prompt row lock (Postgres; the single writer on SQLite) serialises round creation per prompt.
        let text = format!(
            "SELECT id, strategy, settings, version_count FROM prompts WHERE name = $1 AND project = $2{}",
            D::lock(" FOR UPDATE")
        );
        let row = sql::<D>(&text).bind(req.prompt.as_str()).bind(req.prompt.project()).fetch_one(&mut tx).await?;
        let r = Cols::<D>(&row);
        let prompt_id: Uuid = r.get("id")?;
        let strategy: String = r.get("strategy")?;
        let settings: PromptSettings = serde_json::from_value(r.get("settings")?).map_err(|_| corrupt("settings"))?;
        let latest: i64 = r.get("version_count")?;
        let active = sql::<D>("SELECT id FROM rounds WHERE prompt_id = $1 AND status IN ('queued', 'running')")
            .bind(prompt_id)
            .fetch_optional(&mut tx)
            .await?;
        if active.is_some() {
            return Err(StoreError::AlreadyExists);
        }
        // An operator's round ends a failing prompt's backoff (rolled back with
        // the round when nothing is pending).
        if req.trigger.is_operator() {
            reset_failures::<D>(&mut tx, prompt_id).await?;
        }
        // Unjudged traces wait for the evaluators, up to `judge_wait`.
        let judged_since = match req.judge_wait {
            Some(wait) => {
                let has = sql::<D>("SELECT prompt_id FROM prompt_evaluators WHERE prompt_id = $1")
                    .bind(prompt_id)
                    .fetch_optional(&mut tx)
                    .await?;
                has.map(|_| now - chrono::Duration::from_std(wait).unwrap_or(chrono::Duration::MAX))
            }
            None => None,
        };
        let text = format!(
            "SELECT id FROM traces WHERE prompt_id = $1 AND status = 'pending' AND round_id IS NULL
               AND quarantined_at IS NULL AND ($3 IS NULL OR judged_at IS NOT NULL OR created_at < $3)
             ORDER BY id LIMIT $2{}",
            D::lock(" FOR UPDATE SKIP LOCKED")
        );
        let ids: Vec<Uuid> = sql::<D>(&text)
            .bind(prompt_id)
            .bind(i64::from(req.batch))
            .bind(judged_since)
            .map(&mut tx, |row| Cols::<D>(row).get("id"))
            .await?;
        if ids.is_empty() || (ids.len() as u32) < req.min_traces {
            return Ok(None);
        }
        let production: Option<i64> =
            sql::<D>("SELECT version FROM labels WHERE prompt_id = $1 AND name = 'production'")
                .bind(prompt_id)
                .value(&mut tx, "version")
                .await?;
        let id = Uuid::now_v7();
        sql::<D>(
            "INSERT INTO rounds (id, prompt_id, status, trigger, method, strategy, seed, duplication, n, base_version,
                                 not_before, created_at, updated_at)
             VALUES ($1, $2, 'queued', $3, $4, $5, $6, $7, $8, $9, $10, $10, $10)",
        )
        .bind(id)
        .bind(prompt_id)
        .bind(req.trigger.as_str())
        .bind(round::method_str(req.method))
        .bind(strategy)
        .bind(req.seed)
        .bind(settings.duplication as i32)
        .bind(ids.len() as i32)
        .bind(req.base_version.filter(|v| (1..=latest).contains(v)).or(production).unwrap_or(latest))
        .bind(now)
        .execute(&mut tx)
        .await?;
        D::reserve_traces(&mut tx, id, &ids, now).await?;
        self.commit(tx, Change::RoundQueued).await?;
        self.get_round(id).await
    }

    async fn backlogs(&self) -> StoreResult<Vec<Backlog>> {
        // Count and oldest in one pass over the backlog (the partial index
        // `traces_backlog`, which holds only what waits): a correlated
        // `min(created_at)` of its own walked each prompt's traces in time
        // order, history first. SQLite is told the index: without statistics
        // it would walk every pending trace, quarantined ones included.
        let hint = if D::KIND == StoreKind::Sqlite { " INDEXED BY traces_backlog" } else { "" };
        let text = format!(
            "SELECT p.id, p.name, p.project, p.strategy, p.promotion, p.settings, p.created_at, p.created_by,
                    p.failure_streak, p.last_failed_at, coalesce(b.pending, 0) AS pending, b.oldest,
                    EXISTS (SELECT 1 FROM rounds r WHERE r.prompt_id = p.id AND r.status IN ('queued', 'running')) AS active
             FROM prompts p
             LEFT JOIN (SELECT t.prompt_id, count(*) AS pending, min(t.created_at) AS oldest FROM traces t{hint}
                        WHERE t.status = 'pending' AND t.round_id IS NULL AND t.quarantined_at IS NULL
                        GROUP BY t.prompt_id) b ON b.prompt_id = p.id
             ORDER BY p.name, p.project"
        );
        sql::<D>(&text)
            .map(&mut *self.reader.acquire().await?, |row| {
                let r = Cols::<D>(row);
                Ok(Backlog {
                    prompt: prompt_from_row::<D>(row)?,
                    pending: r.get("pending")?,
                    oldest: r.get("oldest")?,
                    active_round: r.get("active")?,
                    failures: failures_from_row::<D>(row, false)?,
                })
            })
            .await
    }

    async fn claim_round(&self, owner: &str, lease: Duration) -> StoreResult<Option<ClaimedRound>> {
        let Some(id) = D::claim_round_id(self, owner, lease).await? else { return Ok(None) };
        let round = self.get_round(id).await?.ok_or(StoreError::NotFound)?;
        let prompt = self.get_prompt(&round.prompt).await?.ok_or(StoreError::NotFound)?;
        let base = self
            .resolve(&round.prompt, &Selector::Version(round.base_version))
            .await?
            .ok_or_else(|| corrupt("round base version"))?
            .version;
        let traces = sql::<D>(&format!(
            "SELECT {TRACE_COLUMNS} FROM round_traces rt JOIN traces t ON t.id = rt.trace_id
             JOIN prompts p ON p.id = t.prompt_id WHERE rt.round_id = $1 ORDER BY rt.position"
        ))
        .bind(id)
        .map(&mut *self.reader.acquire().await?, trace_from_row::<D>)
        .await?;
        Ok(Some(ClaimedRound { round, prompt, base, traces }))
    }

    async fn heartbeat_round(&self, round: Uuid, attempt: i32, lease: Duration) -> StoreResult<bool> {
        D::heartbeat_round(self, round, attempt, lease).await
    }
}
