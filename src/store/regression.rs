//! Regression sets and version gates as rows: a prompt's cases, what each
//! version replied to each case (kept so production's runs are reused), the
//! gate of each learned version with its lease and deadline, and the prompt's
//! gate mode. The rules (what a case must hold, when a gate rejects) are in
//! `domain::regression`; the outbox event of a decided gate is written in the
//! same transaction as the decision.

use std::time::Duration;

use async_trait::async_trait;
use serde_json::Value;
use uuid::Uuid;

use super::{
    StoreError, StoreResult,
    backend::{Backend, SqlStore},
    sql::{Cols, Dialect, corrupt, json, later, now, sql},
    versions::{prompt_id, prompt_name_of},
    webhooks::record_event,
};
use crate::domain::{
    PromptName,
    event::OutboxEvent,
    regression::{CaseJudge, CaseKind, CaseRun, CaseSource, Gate, GateMode, GateStatus, NewCase, RegressionCase},
};

/// A gate some process should act on: run it (pending) or expire it (a harness past its deadline).
#[derive(Debug, Clone, PartialEq)]
pub struct OpenGate {
    pub prompt: PromptName,
    pub gate: Gate,
}

/// A prompt's gate mode and its harness's time limit (none: the server's).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct GateSettings {
    pub mode: GateMode,
    pub harness_timeout_secs: Option<u64>,
}

#[async_trait]
pub trait RegressionStore: Send + Sync {
    /// Adds cases to the prompt's set, all or none: `Invalid` when the set
    /// would hold more than `max_cases`, `NotFound` for an unknown prompt.
    async fn add_cases(
        &self,
        prompt: &PromptName,
        cases: &[NewCase],
        by: &str,
        max_cases: usize,
    ) -> StoreResult<Vec<RegressionCase>>;
    /// The prompt's whole set, oldest first (bounded by the count limit).
    async fn regression_cases(&self, prompt: &PromptName) -> StoreResult<Vec<RegressionCase>>;
    /// One case of the prompt's set (none: the prompt has no such case).
    async fn get_case(&self, prompt: &PromptName, id: Uuid) -> StoreResult<Option<RegressionCase>>;
    /// False when the prompt has no such case.
    async fn delete_case(&self, prompt: &PromptName, id: Uuid) -> StoreResult<bool>;
    /// The runs of `version` kept so far, by case.
    async fn case_runs(&self, prompt: &PromptName, version: i64) -> StoreResult<Vec<CaseRun>>;
    /// Keeps runs of `version` (a case run again replaces its run).
    async fn save_case_runs(&self, prompt: &PromptName, version: i64, runs: &[CaseRun]) -> StoreResult<()>;
    /// Opens the gate of `version` (pending, or awaiting a harness with its
    /// `event`); an existing gate of that version is left as it is.
    async fn open_gate(&self, prompt: &PromptName, gate: &Gate, event: Option<&OutboxEvent>) -> StoreResult<()>;
    async fn gate(&self, prompt: &PromptName, version: i64) -> StoreResult<Option<Gate>>;
    /// Records the decision of a gate that is still open, with its event:
    /// `Conflict` when it was decided meanwhile.
    async fn decide_gate(&self, prompt: &PromptName, gate: &Gate, event: &OutboxEvent) -> StoreResult<()>;
    /// Takes the lease of up to `limit` pending gates whose lease ran out.
    async fn claim_gates(&self, lease: Duration, limit: u32) -> StoreResult<Vec<OpenGate>>;
    /// Gates awaiting a harness past their deadline.
    async fn overdue_gates(&self, limit: u32) -> StoreResult<Vec<OpenGate>>;
    async fn gate_settings(&self, prompt: &PromptName) -> StoreResult<GateSettings>;
    async fn set_gate_settings(&self, prompt: &PromptName, settings: &GateSettings) -> StoreResult<()>;
}

const CASE_COLUMNS: &str = "id, name, kind, input, checks, source, trace_id, created_by, created_at";

/// The `checks` column: the code checks of a `checks` case, the judge
/// (`{rubric, pass_score}`) of a `judge` case.
fn what_must_hold(c: &NewCase) -> StoreResult<Value> {
    match &c.judge {
        Some(judge) => serde_json::to_value(judge).map_err(|_| corrupt("case judge")),
        None => serde_json::to_value(&c.checks).map_err(|_| corrupt("case checks")),
    }
}

fn case_from_row<D: Dialect>(row: &D::Row) -> StoreResult<RegressionCase> {
    let r = Cols::<D>(row);
    let kind = CaseKind::parse(&r.get::<String>("kind")?).ok_or_else(|| corrupt("case kind"))?;
    let held: Value = r.get("checks")?;
    let (checks, judge) = match kind {
        CaseKind::Checks => (serde_json::from_value(held).map_err(|_| corrupt("case checks"))?, None),
        CaseKind::Judge => {
            (Vec::new(), Some(serde_json::from_value::<CaseJudge>(held).map_err(|_| corrupt("case judge"))?))
        }
    };
    Ok(RegressionCase {
        id: r.get("id")?,
        name: r.get("name")?,
        kind,
        input: r.get("input")?,
        checks,
        judge,
        source: CaseSource::parse(&r.get::<String>("source")?).ok_or_else(|| corrupt("case source"))?,
        trace_id: r.get("trace_id")?,
        created_by: r.get("created_by")?,
        created_at: r.get("created_at")?,
    })
}

const GATE_COLUMNS: &str = "p.project AS prompt_project, p.name AS prompt_name, g.version, g.status, g.mode, \
                            g.detail, g.deadline, g.created_at, g.decided_at";

fn gate_from_row<D: Dialect>(row: &D::Row) -> StoreResult<OpenGate> {
    let r = Cols::<D>(row);
    let mut gate: Gate = serde_json::from_value(r.get("detail")?).map_err(|_| corrupt("gate detail"))?;
    gate.version = r.get("version")?;
    gate.status = GateStatus::parse(&r.get::<String>("status")?).ok_or_else(|| corrupt("gate status"))?;
    gate.mode = GateMode::parse(&r.get::<String>("mode")?).ok_or_else(|| corrupt("gate mode"))?;
    gate.deadline = r.get("deadline")?;
    gate.created_at = r.get("created_at")?;
    gate.decided_at = r.get("decided_at")?;
    Ok(OpenGate { prompt: prompt_name_of(&r)?, gate })
}

fn detail(gate: &Gate) -> StoreResult<Value> {
    serde_json::to_value(gate).map_err(|_| corrupt("gate detail"))
}

#[async_trait]
impl<D: Backend> RegressionStore for SqlStore<D> {
    async fn add_cases(
        &self,
        prompt: &PromptName,
        cases: &[NewCase],
        by: &str,
        max_cases: usize,
    ) -> StoreResult<Vec<RegressionCase>> {
        let mut tx = self.begin_write().await?;
        let id = prompt_id::<D>(&mut tx, prompt).await?;
        let held: i64 = sql::<D>("SELECT COUNT(*) AS n FROM regression_cases WHERE prompt_id = $1")
            .bind(id)
            .value(&mut tx, "n")
            .await?
            .unwrap_or(0);
        if held as usize + cases.len() > max_cases {
            return Err(StoreError::Invalid(format!(
                "the regression set holds {held} cases; adding {} would pass the limit of {max_cases}",
                cases.len()
            )));
        }
        let at = now();
        let mut added = Vec::with_capacity(cases.len());
        for (i, c) in cases.iter().enumerate() {
            let checks = what_must_hold(c)?;
            // Ordered by creation time, then id: the ids of one batch keep its order.
            let case_id = Uuid::now_v7();
            let at = at + chrono::Duration::microseconds(i as i64);
            sql::<D>(&format!(
                "INSERT INTO regression_cases ({CASE_COLUMNS}, prompt_id) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)"
            ))
            .bind(case_id)
            .bind(c.name.clone())
            .bind(c.kind().as_str())
            .bind(json(&c.input))
            .bind(json(&checks))
            .bind(c.source.as_str())
            .bind(c.trace_id)
            .bind(by)
            .bind(at)
            .bind(id)
            .execute(&mut tx)
            .await?;
            added.push(RegressionCase {
                id: case_id,
                name: c.name.clone(),
                kind: c.kind(),
                input: c.input.clone(),
                checks: c.checks.clone(),
                judge: c.judge.clone(),
                source: c.source,
                trace_id: c.trace_id,
                created_by: by.to_owned(),
                created_at: at,
            });
        }
        tx.commit().await?;
        Ok(added)
    }

    async fn regression_cases(&self, prompt: &PromptName) -> StoreResult<Vec<RegressionCase>> {
        let c = &mut *self.reader.acquire().await?;
        let id = prompt_id::<D>(c, prompt).await?;
        sql::<D>(&format!("SELECT {CASE_COLUMNS} FROM regression_cases WHERE prompt_id = $1 ORDER BY created_at, id"))
            .bind(id)
            .map(c, case_from_row::<D>)
            .await
    }

    async fn get_case(&self, prompt: &PromptName, case: Uuid) -> StoreResult<Option<RegressionCase>> {
        let c = &mut *self.reader.acquire().await?;
        let id = prompt_id::<D>(c, prompt).await?;
        let rows = sql::<D>(&format!("SELECT {CASE_COLUMNS} FROM regression_cases WHERE prompt_id = $1 AND id = $2"))
            .bind(id)
            .bind(case)
            .map(c, case_from_row::<D>)
            .await?;
        Ok(rows.into_iter().next())
    }

    async fn delete_case(&self, prompt: &PromptName, case: Uuid) -> StoreResult<bool> {
        let c = &mut *self.writer.acquire().await?;
        let id = prompt_id::<D>(c, prompt).await?;
        let n = sql::<D>("DELETE FROM regression_cases WHERE prompt_id = $1 AND id = $2")
            .bind(id)
            .bind(case)
            .execute(c)
            .await?;
        Ok(n > 0)
    }

    async fn case_runs(&self, prompt: &PromptName, version: i64) -> StoreResult<Vec<CaseRun>> {
        let c = &mut *self.reader.acquire().await?;
        let id = prompt_id::<D>(c, prompt).await?;
        sql::<D>("SELECT run FROM regression_runs WHERE prompt_id = $1 AND version = $2")
            .bind(id)
            .bind(version)
            .map(c, |row| serde_json::from_value(Cols::<D>(row).get("run")?).map_err(|_| corrupt("case run")))
            .await
    }

    async fn save_case_runs(&self, prompt: &PromptName, version: i64, runs: &[CaseRun]) -> StoreResult<()> {
        let mut tx = self.begin_write().await?;
        let id = prompt_id::<D>(&mut tx, prompt).await?;
        for run in runs {
            let value = serde_json::to_value(run).map_err(|_| corrupt("case run"))?;
            sql::<D>(
                "INSERT INTO regression_runs (prompt_id, version, case_id, run, created_at) VALUES ($1, $2, $3, $4, $5)
                 ON CONFLICT (prompt_id, version, case_id) DO UPDATE SET run = excluded.run, created_at = excluded.created_at",
            )
            .bind(id)
            .bind(version)
            .bind(run.case_id)
            .bind(json(&value))
            .bind(now())
            .execute(&mut tx)
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    async fn open_gate(&self, prompt: &PromptName, gate: &Gate, event: Option<&OutboxEvent>) -> StoreResult<()> {
        let mut tx = self.begin_write().await?;
        let id = prompt_id::<D>(&mut tx, prompt).await?;
        let inserted = sql::<D>(
            "INSERT INTO version_gates (prompt_id, version, status, mode, detail, deadline, created_at)
             VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT (prompt_id, version) DO NOTHING",
        )
        .bind(id)
        .bind(gate.version)
        .bind(gate.status.as_str())
        .bind(gate.mode.as_str())
        .bind(json(&detail(gate)?))
        .bind(gate.deadline)
        .bind(gate.created_at)
        .execute(&mut tx)
        .await?;
        let queued = match event {
            Some(e) if inserted > 0 => record_event::<D>(&mut tx, e).await?,
            _ => false,
        };
        tx.commit().await?;
        self.announce_outbox(queued);
        Ok(())
    }

    async fn gate(&self, prompt: &PromptName, version: i64) -> StoreResult<Option<Gate>> {
        let row = sql::<D>(&format!(
            "SELECT {GATE_COLUMNS} FROM version_gates g JOIN prompts p ON p.id = g.prompt_id
             WHERE p.name = $1 AND g.version = $2 AND p.project = $3"
        ))
        .bind(prompt.as_str())
        .bind(version)
        .bind(prompt.project())
        .fetch_optional(&mut *self.reader.acquire().await?)
        .await?;
        row.map(|r| gate_from_row::<D>(&r).map(|g| g.gate)).transpose()
    }

    async fn decide_gate(&self, prompt: &PromptName, gate: &Gate, event: &OutboxEvent) -> StoreResult<()> {
        let mut tx = self.begin_write().await?;
        let id = prompt_id::<D>(&mut tx, prompt).await?;
        let n = sql::<D>(
            "UPDATE version_gates SET status = $3, detail = $4, decided_at = $5, lease_until = NULL
             WHERE prompt_id = $1 AND version = $2 AND status IN ('pending', 'awaiting_harness')",
        )
        .bind(id)
        .bind(gate.version)
        .bind(gate.status.as_str())
        .bind(json(&detail(gate)?))
        .bind(gate.decided_at.unwrap_or_else(now))
        .execute(&mut tx)
        .await?;
        if n == 0 {
            return Err(StoreError::Conflict);
        }
        let queued = record_event::<D>(&mut tx, event).await?;
        self.commit(tx, super::Change::prompt(prompt)).await?;
        self.announce_outbox(queued);
        Ok(())
    }

    async fn claim_gates(&self, lease: Duration, limit: u32) -> StoreResult<Vec<OpenGate>> {
        let mut tx = self.begin_write().await?;
        let at = now();
        let due = sql::<D>(&format!(
            "SELECT {GATE_COLUMNS} FROM version_gates g JOIN prompts p ON p.id = g.prompt_id
             WHERE g.status = 'pending' AND (g.lease_until IS NULL OR g.lease_until < $1)
             ORDER BY g.created_at LIMIT $2 {}",
            D::lock("FOR UPDATE OF g SKIP LOCKED")
        ))
        .bind(at)
        .bind(i64::from(limit))
        .map(&mut tx, gate_from_row::<D>)
        .await?;
        for g in &due {
            let id = prompt_id::<D>(&mut tx, &g.prompt).await?;
            sql::<D>("UPDATE version_gates SET lease_until = $3 WHERE prompt_id = $1 AND version = $2")
                .bind(id)
                .bind(g.gate.version)
                .bind(later(at, lease))
                .execute(&mut tx)
                .await?;
        }
        tx.commit().await?;
        Ok(due)
    }

    async fn overdue_gates(&self, limit: u32) -> StoreResult<Vec<OpenGate>> {
        sql::<D>(&format!(
            "SELECT {GATE_COLUMNS} FROM version_gates g JOIN prompts p ON p.id = g.prompt_id
             WHERE g.status = 'awaiting_harness' AND g.deadline < $1 ORDER BY g.deadline LIMIT $2"
        ))
        .bind(now())
        .bind(i64::from(limit))
        .map(&mut *self.reader.acquire().await?, gate_from_row::<D>)
        .await
    }

    async fn gate_settings(&self, prompt: &PromptName) -> StoreResult<GateSettings> {
        let c = &mut *self.reader.acquire().await?;
        let id = prompt_id::<D>(c, prompt).await?;
        let row = sql::<D>("SELECT mode, harness_timeout_secs FROM regression_gate_settings WHERE prompt_id = $1")
            .bind(id)
            .fetch_optional(c)
            .await?;
        let Some(row) = row else { return Ok(GateSettings::default()) };
        let r = Cols::<D>(&row);
        Ok(GateSettings {
            mode: GateMode::parse(&r.get::<String>("mode")?).ok_or_else(|| corrupt("gate mode"))?,
            harness_timeout_secs: r.get::<Option<i64>>("harness_timeout_secs")?.map(|s| s.max(0) as u64),
        })
    }

    async fn set_gate_settings(&self, prompt: &PromptName, s: &GateSettings) -> StoreResult<()> {
        let c = &mut *self.writer.acquire().await?;
        let id = prompt_id::<D>(c, prompt).await?;
        sql::<D>(
            "INSERT INTO regression_gate_settings (prompt_id, mode, harness_timeout_secs) VALUES ($1, $2, $3)
             ON CONFLICT (prompt_id) DO UPDATE SET mode = excluded.mode, harness_timeout_secs = excluded.harness_timeout_secs",
        )
        .bind(id)
        .bind(s.mode.as_str())
        .bind(s.harness_timeout_secs.map(|v| v.min(i64::MAX as u64) as i64))
        .execute(c)
        .await?;
        Ok(())
    }
}
