//! The learning budget's rows: spend per UTC day, prompt and kind of call,
//! spend per pass of a round (one claim, run until it ends or waits; a round
//! cap counts every pass of the round), the reservations of calls in flight, a prompt's
//! caps, and the days a cap held a prompt back. A reservation checks every cap
//! and writes its hold in one transaction that every process serializes on
//! (an advisory lock on Postgres; SQLite's one writer), so processes sharing a
//! store never pass a cap together. A hold whose process died counts until it
//! expires.

use async_trait::async_trait;
use chrono::{DateTime, NaiveDate, Utc};
use serde_json::Value;
use uuid::Uuid;

use super::{
    Change, StoreResult,
    backend::{Backend, SqlStore},
    sql::{Cols, Dialect, corrupt, now, sql},
    webhooks::record_event,
};
use crate::domain::budget::{BudgetCaps, BudgetReached, DaySpend, Spent, day_key, passes};
use crate::domain::event::OutboxEvent;
use crate::domain::names::{DEFAULT_PROJECT, PromptName};

/// A prompt as the budget's rows name it: its [`PromptName::qualified`] key
/// (`support-agent` in `default`, `team-a/support-agent` elsewhere), the
/// string the LLM calls are tagged with.
fn prompt_of_key(key: &str) -> Option<PromptName> {
    PromptName::written(key, DEFAULT_PROJECT).ok()
}

/// The budget key of a `prompts` row, in SQL (see [`prompt_of_key`]).
const PROMPT_KEY: &str = "CASE WHEN project = 'default' THEN name ELSE project || '/' || name END";

/// One attempt's reservation, as the meter asks for it.
#[derive(Debug, Clone)]
pub struct HoldRequest<'a> {
    pub id: Uuid,
    pub day: NaiveDate,
    /// The prompt's key ([`PromptName::qualified`]); `""` for a call of no prompt.
    pub prompt: &'a str,
    pub round: Option<(Uuid, i32)>,
    pub estimate: Spent,
    /// The server's caps (`[budget]`); the prompt's own are read in the same transaction.
    pub server: BudgetCaps,
    /// When a daily cap lifts by itself (the next UTC day).
    pub until: DateTime<Utc>,
    /// When the hold stops counting if it is never settled (its process died).
    pub expires_at: DateTime<Utc>,
}

/// The answer to a [`HoldRequest`].
#[derive(Debug, Clone, PartialEq)]
pub enum HoldOutcome {
    Held,
    /// A cap would be passed: `scope` names it (`prompt tokens_per_day`, `server
    /// usd_per_round`, …); `daily` says whether it lifts at `until`.
    Refused {
        scope: String,
        daily: bool,
    },
}

/// What one settled attempt used.
#[derive(Debug, Clone)]
pub struct Settlement<'a> {
    pub hold: Uuid,
    pub day: NaiveDate,
    pub prompt: &'a str,
    pub kind: &'a str,
    pub round: Option<(Uuid, i32)>,
    pub used: Spent,
}

/// Spend, caps and the budget's state, per prompt and day. A prompt is
/// named by its key, [`PromptName::qualified`].
#[async_trait]
pub trait BudgetStore: Send + Sync {
    /// Checks every cap against spend, live holds and the estimate, and holds
    /// the estimate when none would be passed. A refusal by a daily cap is
    /// remembered for the day (and queues `budget.reached` the first time that
    /// day for the prompt).
    async fn hold_spend(&self, req: &HoldRequest<'_>) -> StoreResult<HoldOutcome>;
    /// Replaces a hold with what the attempt used (also when the hold expired meanwhile).
    async fn settle_spend(&self, s: &Settlement<'_>) -> StoreResult<()>;
    /// The prompt's own caps (empty when none were set).
    async fn prompt_caps(&self, prompt: &str) -> StoreResult<BudgetCaps>;
    /// Sets the prompt's caps; when `lift` (they were raised), today's
    /// refusal of the prompt stops holding it back and its rounds waiting for
    /// the budget are due at once.
    async fn set_prompt_caps(&self, prompt: &str, caps: &BudgetCaps, today: NaiveDate, lift: bool) -> StoreResult<()>;
    /// The prompt's spend per day from `from` on, newest first.
    async fn spend_by_day(&self, prompt: &str, from: NaiveDate) -> StoreResult<Vec<DaySpend>>;
    /// The daily cap holding `prompt` (or, with `""`, the whole server) back on `day`, if one does.
    async fn budget_reached(&self, prompt: &str, day: NaiveDate) -> StoreResult<Option<BudgetReached>>;
    /// Every prompt a daily cap holds back on `day` (`""`: the server's cap), by name.
    async fn budget_reached_all(&self, day: NaiveDate) -> StoreResult<Vec<(String, BudgetReached)>>;
    /// Lifts the server-wide refusals of `day` and makes every round waiting for the
    /// budget due (the server's caps may have been raised: a process started).
    async fn lift_server_budget(&self, day: NaiveDate) -> StoreResult<()>;
    /// Lifts the refusals of `day` a project's cap made and makes its prompts'
    /// rounds waiting for the budget due (its caps were changed).
    async fn lift_project_budget(&self, project: &str, day: NaiveDate) -> StoreResult<()>;
    /// Puts a running round back in the queue without charging the attempt:
    /// it waits for the budget and is due again after `after`.
    async fn wait_round(&self, round: Uuid, attempt: i32, error: &str, after: std::time::Duration)
    -> StoreResult<bool>;
}

fn spent<D: Dialect>(row: &D::Row) -> StoreResult<Spent> {
    let r = Cols::<D>(row);
    Ok(Spent { tokens: r.get::<i64>("tokens")?.max(0) as u64, usd: r.get("usd")?, calls: 0 })
}

fn to_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

fn reached<D: Dialect>(row: &D::Row) -> StoreResult<BudgetReached> {
    let r = Cols::<D>(row);
    Ok(BudgetReached::new(r.get("scope")?, r.get("until")?, r.get("reached_at")?))
}

/// Sums of spend and live holds, over the rows `filter` picks (`$1`.. as bound by the caller).
const DAY_SPEND: &str = "SELECT CAST(coalesce(sum(tokens), 0) AS BIGINT) AS tokens,
        CAST(coalesce(sum(usd), 0) AS DOUBLE PRECISION) AS usd FROM (
    SELECT tokens, usd FROM llm_spend_days WHERE day = $1 AND ($2 = '*' OR prompt = $2)
    UNION ALL
    SELECT tokens, usd FROM llm_spend_holds WHERE day = $1 AND ($2 = '*' OR prompt = $2)) s";

/// What the prompts of one project spent (and hold) on a day.
fn project_day_spend() -> String {
    format!(
        "SELECT CAST(coalesce(sum(tokens), 0) AS BIGINT) AS tokens,
                CAST(coalesce(sum(usd), 0) AS DOUBLE PRECISION) AS usd FROM (
            SELECT tokens, usd FROM llm_spend_days
             WHERE day = $1 AND prompt IN (SELECT {PROMPT_KEY} FROM prompts WHERE project = $2)
            UNION ALL
            SELECT tokens, usd FROM llm_spend_holds
             WHERE day = $1 AND prompt IN (SELECT {PROMPT_KEY} FROM prompts WHERE project = $2)) s"
    )
}

const ROUND_SPEND: &str = "SELECT CAST(coalesce(sum(tokens), 0) AS BIGINT) AS tokens,
        CAST(coalesce(sum(usd), 0) AS DOUBLE PRECISION) AS usd FROM (
    SELECT tokens, usd FROM llm_spend_rounds WHERE round_id = $1
    UNION ALL
    SELECT tokens, usd FROM llm_spend_holds WHERE round_id = $1) s";

#[async_trait]
impl<D: Backend> BudgetStore for SqlStore<D> {
    async fn hold_spend(&self, req: &HoldRequest<'_>) -> StoreResult<HoldOutcome> {
        let day = day_key(req.day);
        let at = now();
        let mut tx = self.begin_write().await?;
        D::serialize_budget(&mut tx).await?;
        sql::<D>("DELETE FROM llm_spend_holds WHERE expires_at < $1").bind(at).execute(&mut tx).await?;
        let own = read_caps::<D>(&mut tx, req.prompt).await?;
        let (project, project_caps) = project_caps::<D>(&mut tx, req.prompt).await?;
        let mut refusal: Option<(String, bool)> = None;
        if let Some((round, _)) = req.round {
            // Every pass of the round counts: a round cap bounds the round, not one claim of it.
            let row = sql::<D>(ROUND_SPEND).bind(round).fetch_one(&mut tx).await?;
            let so_far = spent::<D>(&row)?;
            for (whose, caps) in [("prompt", own), ("project", project_caps), ("server", req.server)] {
                if refusal.is_none()
                    && let Some(which) = passes(caps.tokens_per_round, caps.usd_per_round, so_far, req.estimate)
                {
                    refusal = Some((format!("{whose} {which}_per_round"), false));
                }
            }
        }
        if refusal.is_none() && !req.prompt.is_empty() {
            let row = sql::<D>(DAY_SPEND).bind(&day).bind(req.prompt).fetch_one(&mut tx).await?;
            if let Some(which) = passes(own.tokens_per_day, own.usd_per_day, spent::<D>(&row)?, req.estimate) {
                refusal = Some((format!("prompt {which}_per_day"), true));
            }
        }
        if refusal.is_none()
            && let Some(project) = &project
            && (project_caps.tokens_per_day.is_some() || project_caps.usd_per_day.is_some())
        {
            let row = sql::<D>(&project_day_spend()).bind(&day).bind(project).fetch_one(&mut tx).await?;
            let caps = project_caps;
            if let Some(which) = passes(caps.tokens_per_day, caps.usd_per_day, spent::<D>(&row)?, req.estimate) {
                refusal = Some((format!("project {which}_per_day"), true));
            }
        }
        if refusal.is_none() {
            let row = sql::<D>(DAY_SPEND).bind(&day).bind("*").fetch_one(&mut tx).await?;
            let caps = req.server;
            if let Some(which) = passes(caps.tokens_per_day, caps.usd_per_day, spent::<D>(&row)?, req.estimate) {
                refusal = Some((format!("server {which}_per_day"), true));
            }
        }
        let Some((scope, daily)) = refusal else {
            sql::<D>(
                "INSERT INTO llm_spend_holds (id, day, prompt, round_id, pass, tokens, usd, expires_at)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
            )
            .bind(req.id)
            .bind(&day)
            .bind(req.prompt)
            .bind(req.round.map(|r| r.0))
            .bind(req.round.map(|r| r.1))
            .bind(to_i64(req.estimate.tokens))
            .bind(req.estimate.usd)
            .bind(req.expires_at)
            .execute(&mut tx)
            .await?;
            tx.commit().await?;
            return Ok(HoldOutcome::Held);
        };
        let mut queued = false;
        if daily {
            let mut whom = vec![req.prompt];
            if scope.starts_with("server") && !req.prompt.is_empty() {
                whom.push("");
            }
            for prompt in whom {
                let first = sql::<D>(
                    "INSERT INTO budget_reached (day, prompt, scope, until, reached_at) VALUES ($1, $2, $3, $4, $5)
                     ON CONFLICT (day, prompt) DO NOTHING",
                )
                .bind(&day)
                .bind(prompt)
                .bind(&scope)
                .bind(req.until)
                .bind(at)
                .execute(&mut tx)
                .await?
                    == 1;
                if first {
                    if let Some(prompt) = prompt_of_key(prompt) {
                        let event = OutboxEvent::budget_reached(&prompt, &scope, &day, req.until);
                        queued |= record_event::<D>(&mut tx, &event).await?;
                    }
                } else {
                    // Held back again after a raise: the state says so, the webhook said it already.
                    sql::<D>(
                        "UPDATE budget_reached SET scope = $1, reached_at = $2, lifted_at = NULL
                         WHERE day = $3 AND prompt = $4 AND lifted_at IS NOT NULL",
                    )
                    .bind(&scope)
                    .bind(at)
                    .bind(&day)
                    .bind(prompt)
                    .execute(&mut tx)
                    .await?;
                }
            }
        }
        tx.commit().await?;
        self.announce_outbox(queued);
        Ok(HoldOutcome::Refused { scope, daily })
    }

    async fn settle_spend(&self, s: &Settlement<'_>) -> StoreResult<()> {
        let mut tx = self.begin_write().await?;
        sql::<D>("DELETE FROM llm_spend_holds WHERE id = $1").bind(s.hold).execute(&mut tx).await?;
        sql::<D>(
            "INSERT INTO llm_spend_days (day, prompt, kind, tokens, usd, calls) VALUES ($1, $2, $3, $4, $5, 1)
             ON CONFLICT (day, prompt, kind) DO UPDATE SET tokens = llm_spend_days.tokens + excluded.tokens,
                 usd = llm_spend_days.usd + excluded.usd, calls = llm_spend_days.calls + 1",
        )
        .bind(day_key(s.day))
        .bind(s.prompt)
        .bind(s.kind)
        .bind(to_i64(s.used.tokens))
        .bind(s.used.usd)
        .execute(&mut tx)
        .await?;
        if let Some((round, pass)) = s.round {
            sql::<D>(
                "INSERT INTO llm_spend_rounds (round_id, pass, tokens, usd) VALUES ($1, $2, $3, $4)
                 ON CONFLICT (round_id, pass) DO UPDATE SET tokens = llm_spend_rounds.tokens + excluded.tokens,
                     usd = llm_spend_rounds.usd + excluded.usd",
            )
            .bind(round)
            .bind(pass)
            .bind(to_i64(s.used.tokens))
            .bind(s.used.usd)
            .execute(&mut tx)
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    async fn prompt_caps(&self, prompt: &str) -> StoreResult<BudgetCaps> {
        read_caps::<D>(&mut *self.reader.acquire().await?, prompt).await
    }

    async fn set_prompt_caps(&self, prompt: &str, caps: &BudgetCaps, today: NaiveDate, lift: bool) -> StoreResult<()> {
        let at = now();
        let mut tx = self.begin_write().await?;
        D::serialize_budget(&mut tx).await?;
        if caps.is_empty() {
            sql::<D>("DELETE FROM prompt_budgets WHERE prompt = $1").bind(prompt).execute(&mut tx).await?;
        } else {
            sql::<D>(
                "INSERT INTO prompt_budgets (prompt, tokens_per_day, usd_per_day, tokens_per_round, usd_per_round,
                     updated_at) VALUES ($1, $2, $3, $4, $5, $6)
                 ON CONFLICT (prompt) DO UPDATE SET tokens_per_day = excluded.tokens_per_day,
                     usd_per_day = excluded.usd_per_day, tokens_per_round = excluded.tokens_per_round,
                     usd_per_round = excluded.usd_per_round, updated_at = excluded.updated_at",
            )
            .bind(prompt)
            .bind(caps.tokens_per_day.map(to_i64))
            .bind(caps.usd_per_day)
            .bind(caps.tokens_per_round.map(to_i64))
            .bind(caps.usd_per_round)
            .bind(at)
            .execute(&mut tx)
            .await?;
        }
        if !lift {
            tx.commit().await?;
            return Ok(());
        }
        sql::<D>("UPDATE budget_reached SET lifted_at = $1 WHERE day = $2 AND prompt = $3 AND lifted_at IS NULL")
            .bind(at)
            .bind(day_key(today))
            .bind(prompt)
            .execute(&mut tx)
            .await?;
        wake_waiting::<D>(&mut tx, Some(prompt), at).await?;
        self.commit(tx, Change::RoundQueued).await
    }

    async fn spend_by_day(&self, prompt: &str, from: NaiveDate) -> StoreResult<Vec<DaySpend>> {
        let rows = sql::<D>(
            "SELECT day, kind, tokens, usd, calls FROM llm_spend_days WHERE prompt = $1 AND day >= $2
             ORDER BY day DESC, kind",
        )
        .bind(prompt)
        .bind(day_key(from))
        .fetch_all(&mut *self.reader.acquire().await?)
        .await?;
        let mut days: Vec<DaySpend> = Vec::new();
        for row in &rows {
            let r = Cols::<D>(row);
            let day: String = r.get("day")?;
            let day = NaiveDate::parse_from_str(&day, "%Y-%m-%d").map_err(|_| super::sql::corrupt("day"))?;
            let one = Spent {
                tokens: r.get::<i64>("tokens")?.max(0) as u64,
                usd: r.get("usd")?,
                calls: r.get::<i64>("calls")?.max(0) as u64,
            };
            if days.last().is_none_or(|d| d.day != day) {
                days.push(DaySpend { day, tokens: 0, usd: 0.0, calls: 0, by_kind: Default::default() });
            }
            if let Some(d) = days.last_mut() {
                d.tokens += one.tokens;
                d.usd += one.usd;
                d.calls += one.calls;
                d.by_kind.insert(r.get("kind")?, one);
            }
        }
        Ok(days)
    }

    async fn budget_reached(&self, prompt: &str, day: NaiveDate) -> StoreResult<Option<BudgetReached>> {
        let row = sql::<D>(
            "SELECT scope, until, reached_at FROM budget_reached WHERE day = $1 AND prompt = $2 AND lifted_at IS NULL",
        )
        .bind(day_key(day))
        .bind(prompt)
        .fetch_optional(&mut *self.reader.acquire().await?)
        .await?;
        row.as_ref().map(reached::<D>).transpose()
    }

    async fn budget_reached_all(&self, day: NaiveDate) -> StoreResult<Vec<(String, BudgetReached)>> {
        let rows = sql::<D>(
            "SELECT prompt, scope, until, reached_at FROM budget_reached WHERE day = $1 AND lifted_at IS NULL
             ORDER BY prompt",
        )
        .bind(day_key(day))
        .fetch_all(&mut *self.reader.acquire().await?)
        .await?;
        rows.iter().map(|row| Ok((Cols::<D>(row).get("prompt")?, reached::<D>(row)?))).collect()
    }

    async fn lift_server_budget(&self, day: NaiveDate) -> StoreResult<()> {
        let at = now();
        let mut tx = self.begin_write().await?;
        sql::<D>(
            "UPDATE budget_reached SET lifted_at = $1 WHERE day = $2 AND scope LIKE 'server %' AND lifted_at IS NULL",
        )
        .bind(at)
        .bind(day_key(day))
        .execute(&mut tx)
        .await?;
        wake_waiting::<D>(&mut tx, None, at).await?;
        self.commit(tx, Change::RoundQueued).await
    }

    async fn lift_project_budget(&self, project: &str, day: NaiveDate) -> StoreResult<()> {
        let at = now();
        let mut tx = self.begin_write().await?;
        sql::<D>(&format!(
            "UPDATE budget_reached SET lifted_at = $1
             WHERE day = $2 AND scope LIKE 'project %' AND lifted_at IS NULL
               AND prompt IN (SELECT {PROMPT_KEY} FROM prompts WHERE project = $3)"
        ))
        .bind(at)
        .bind(day_key(day))
        .bind(project)
        .execute(&mut tx)
        .await?;
        sql::<D>(
            "UPDATE rounds SET not_before = $1, budget_wait = FALSE
             WHERE status = 'queued' AND budget_wait = TRUE
               AND prompt_id IN (SELECT id FROM prompts WHERE project = $2)",
        )
        .bind(at)
        .bind(project)
        .execute(&mut tx)
        .await?;
        self.commit(tx, Change::RoundQueued).await
    }

    async fn wait_round(
        &self,
        round: Uuid,
        attempt: i32,
        error: &str,
        after: std::time::Duration,
    ) -> StoreResult<bool> {
        let at = now();
        let mut tx = self.begin_write().await?;
        let moved = sql::<D>(
            "UPDATE rounds SET status = 'queued', attempt = attempt - 1, lease_owner = NULL, lease_expires_at = NULL,
                    error = $1, not_before = $2, budget_wait = TRUE, updated_at = $3
             WHERE id = $4 AND attempt = $5 AND status = 'running'",
        )
        .bind(error)
        .bind(super::sql::later(at, after))
        .bind(at)
        .bind(round)
        .bind(attempt)
        .execute(&mut tx)
        .await?;
        self.commit(tx, Change::RoundQueued).await?;
        Ok(moved == 1)
    }
}

async fn read_caps<D: Dialect>(c: &mut D::Connection, prompt: &str) -> StoreResult<BudgetCaps> {
    let row = sql::<D>(
        "SELECT tokens_per_day, usd_per_day, tokens_per_round, usd_per_round FROM prompt_budgets WHERE prompt = $1",
    )
    .bind(prompt)
    .fetch_optional(c)
    .await?;
    let Some(row) = row else { return Ok(BudgetCaps::default()) };
    let r = Cols::<D>(&row);
    Ok(BudgetCaps {
        tokens_per_day: r.get::<Option<i64>>("tokens_per_day")?.map(|v| v.max(0) as u64),
        usd_per_day: r.get("usd_per_day")?,
        tokens_per_round: r.get::<Option<i64>>("tokens_per_round")?.map(|v| v.max(0) as u64),
        usd_per_round: r.get("usd_per_round")?,
    })
}

/// The project of `prompt` (none for a call of no prompt) and the caps its
/// settings give (`budget`, none when unset).
async fn project_caps<D: Dialect>(c: &mut D::Connection, prompt: &str) -> StoreResult<(Option<String>, BudgetCaps)> {
    let Some(prompt) = prompt_of_key(prompt) else { return Ok((None, BudgetCaps::default())) };
    let row = sql::<D>(
        "SELECT pr.name, pr.settings FROM prompts p JOIN projects pr ON pr.name = p.project
         WHERE p.project = $1 AND p.name = $2",
    )
    .bind(prompt.project())
    .bind(prompt.as_str())
    .fetch_optional(c)
    .await?;
    let Some(row) = row else { return Ok((None, BudgetCaps::default())) };
    let r = Cols::<D>(&row);
    let settings: Value = r.get("settings")?;
    let caps = match settings.get("budget") {
        Some(b) => serde_json::from_value(b.clone()).map_err(|_| corrupt("project budget"))?,
        None => BudgetCaps::default(),
    };
    Ok((Some(r.get("name")?), caps))
}

/// Makes the rounds waiting for the budget (of `prompt`, or of every prompt) due now.
async fn wake_waiting<D: Dialect>(c: &mut D::Connection, prompt: Option<&str>, at: DateTime<Utc>) -> StoreResult<()> {
    let prompt = match prompt.map(prompt_of_key) {
        Some(None) => return Ok(()),
        Some(prompt) => prompt,
        None => None,
    };
    sql::<D>(
        "UPDATE rounds SET not_before = $1, budget_wait = FALSE
         WHERE status = 'queued' AND budget_wait = TRUE
           AND ($2 = '*' OR prompt_id = (SELECT id FROM prompts WHERE project = $2 AND name = $3))",
    )
    .bind(at)
    .bind(prompt.as_ref().map_or("*", PromptName::project))
    .bind(prompt.as_ref().map_or("*", PromptName::as_str))
    .execute(c)
    .await?;
    Ok(())
}
