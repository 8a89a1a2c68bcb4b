//! Evaluators: each prompt's list (one row, replaced whole), the pending
//! traces they have not judged yet, and their verdicts written onto a trace —
//! as its feedback only when no one else scored it, with the rollups kept
//! exact as late feedback keeps them.

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use serde_json::Value;
use uuid::Uuid;

use super::{
    StoreResult,
    backend::{Backend, SqlStore},
    rollups::{self, Counted, Sign},
    sql::{Cols, corrupt, json, now, sql},
    versions::{prompt_id, prompt_name},
};
use crate::{
    domain::{Feedback, PromptName, trace::FeedbackSource},
    evaluate::evaluators::{Evaluator, Judgement},
};

/// A pending trace the prompt's evaluators have not judged yet.
#[derive(Debug, Clone)]
pub struct Unjudged {
    pub id: Uuid,
    pub prompt: PromptName,
    pub input: Value,
    pub output: Value,
    pub metadata: Value,
    pub evaluators: Vec<Evaluator>,
}

/// The evaluators' combined verdict, written as the trace's feedback when
/// no one else scored it: `score`, `critique` (the comment) and `by` (the
/// evaluators behind it).
#[derive(Debug, Clone, PartialEq)]
pub struct JudgedFeedback {
    pub score: f64,
    pub critique: String,
    pub by: String,
}

/// One trace an agent or an operator scored, with what the evaluators said
/// of it: calibration data.
#[derive(Debug, Clone)]
pub struct Calibrating {
    pub feedback: Feedback,
    pub judgements: Vec<Judgement>,
}

/// Evaluators and their judgements.
#[async_trait]
pub trait EvaluatorStore: Send + Sync {
    /// The prompt's evaluators (empty when it has none); `NotFound` when the
    /// prompt does not exist.
    async fn evaluators(&self, prompt: &PromptName) -> StoreResult<Vec<Evaluator>>;
    /// Replaces the prompt's evaluators (an empty list removes them: its
    /// rounds stop waiting for judgements); `NotFound` when the prompt does
    /// not exist.
    async fn set_evaluators(&self, prompt: &PromptName, evaluators: &[Evaluator]) -> StoreResult<()>;
    /// Up to `limit` pending, unquarantined traces of prompts with evaluators
    /// that no evaluator has looked at yet, oldest first.
    async fn unjudged_traces(&self, limit: u32) -> StoreResult<Vec<Unjudged>>;
    /// Records the evaluators' `judgements` on trace `id` (once: false when it
    /// was judged already or is gone) and, when `feedback` is given and the
    /// trace carries no reward yet, writes it as the trace's feedback (source
    /// `judge`), the rollups taking it in as late feedback does.
    async fn save_judgement(
        &self,
        id: Uuid,
        judgements: &[Judgement],
        feedback: Option<&JudgedFeedback>,
    ) -> StoreResult<bool>;
    /// The newest `limit` traces of the prompt that were judged and carry a
    /// reward from the agent or an operator.
    async fn calibration_data(&self, prompt: &PromptName, limit: u32) -> StoreResult<Vec<Calibrating>>;
}

#[async_trait]
impl<D: Backend> EvaluatorStore for SqlStore<D> {
    async fn evaluators(&self, prompt: &PromptName) -> StoreResult<Vec<Evaluator>> {
        let mut c = self.reader.acquire().await?;
        let id = prompt_id::<D>(&mut c, prompt).await?;
        let list: Option<Value> = sql::<D>("SELECT evaluators FROM prompt_evaluators WHERE prompt_id = $1")
            .bind(id)
            .value(&mut c, "evaluators")
            .await?;
        match list {
            None => Ok(Vec::new()),
            Some(v) => serde_json::from_value(v).map_err(|_| corrupt("evaluators")),
        }
    }

    async fn set_evaluators(&self, prompt: &PromptName, evaluators: &[Evaluator]) -> StoreResult<()> {
        let mut tx = self.writer.begin().await?;
        let id = prompt_id::<D>(&mut tx, prompt).await?;
        sql::<D>("DELETE FROM prompt_evaluators WHERE prompt_id = $1").bind(id).execute(&mut tx).await?;
        if !evaluators.is_empty() {
            let list = serde_json::to_value(evaluators).map_err(|_| corrupt("evaluators"))?;
            sql::<D>("INSERT INTO prompt_evaluators (prompt_id, evaluators, updated_at) VALUES ($1, $2, $3)")
                .bind(id)
                .bind(json(&list))
                .bind(now())
                .execute(&mut tx)
                .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    async fn unjudged_traces(&self, limit: u32) -> StoreResult<Vec<Unjudged>> {
        sql::<D>(
            "SELECT t.id, p.name, t.input, t.output, t.metadata, e.evaluators
             FROM prompt_evaluators e JOIN traces t ON t.prompt_id = e.prompt_id JOIN prompts p ON p.id = e.prompt_id
             WHERE t.judged_at IS NULL AND t.status = 'pending' AND t.quarantined_at IS NULL
             ORDER BY t.id LIMIT $1",
        )
        .bind(i64::from(limit))
        .map(&mut *self.reader.acquire().await?, |row| {
            let r = Cols::<D>(row);
            Ok(Unjudged {
                id: r.get("id")?,
                prompt: prompt_name(&r.get::<String>("name")?)?,
                input: r.get("input")?,
                output: r.get("output")?,
                metadata: r.get("metadata")?,
                evaluators: serde_json::from_value(r.get("evaluators")?).map_err(|_| corrupt("evaluators"))?,
            })
        })
        .await
    }

    async fn save_judgement(
        &self,
        id: Uuid,
        judgements: &[Judgement],
        feedback: Option<&JudgedFeedback>,
    ) -> StoreResult<bool> {
        let mut tx = self.writer.begin().await?;
        let text = format!("SELECT feedback, judged_at FROM traces WHERE id = $1{}", D::lock(" FOR UPDATE"));
        let Some(row) = sql::<D>(&text).bind(id).fetch_optional(&mut tx).await? else { return Ok(false) };
        let r = Cols::<D>(&row);
        if r.get::<Option<DateTime<Utc>>>("judged_at")?.is_some() {
            return Ok(false);
        }
        let current: Feedback = serde_json::from_value(r.get("feedback")?).map_err(|_| corrupt("feedback"))?;
        let list = serde_json::to_value(judgements).map_err(|_| corrupt("judgements"))?;
        sql::<D>("UPDATE traces SET judged_at = $1, judgements = $2 WHERE id = $3")
            .bind(now())
            .bind(json(&list))
            .bind(id)
            .execute(&mut tx)
            .await?;
        if let Some(j) = feedback.filter(|_| !current.rewarded()) {
            let critique = (!j.critique.is_empty()).then(|| j.critique.clone());
            let merged = Feedback { score: Some(j.score), comment: current.comment.clone().or(critique), ..current };
            let merged = serde_json::to_value(merged).map_err(|_| corrupt("feedback"))?;
            rollups::account::<D>(&mut tx, &[id], Sign::Retract, Counted::Unquarantined).await?;
            sql::<D>(
                "UPDATE traces SET feedback = $1, feedback_source = $2, judged_by = $3, updated_at = $4 WHERE id = $5",
            )
            .bind(json(&merged))
            .bind(FeedbackSource::Judge.column())
            .bind(j.by.as_str())
            .bind(now())
            .bind(id)
            .execute(&mut tx)
            .await?;
            rollups::account::<D>(&mut tx, &[id], Sign::Credit, Counted::Unquarantined).await?;
        }
        tx.commit().await?;
        Ok(true)
    }

    async fn calibration_data(&self, prompt: &PromptName, limit: u32) -> StoreResult<Vec<Calibrating>> {
        let mut c = self.reader.acquire().await?;
        let id = prompt_id::<D>(&mut c, prompt).await?;
        sql::<D>(
            "SELECT feedback, judgements FROM traces
             WHERE prompt_id = $1 AND judgements IS NOT NULL AND (feedback_source IS NULL OR feedback_source = 'human')
             ORDER BY id DESC LIMIT $2",
        )
        .bind(id)
        .bind(i64::from(limit))
        .map(&mut c, |row| {
            let r = Cols::<D>(row);
            Ok(Calibrating {
                feedback: serde_json::from_value(r.get("feedback")?).map_err(|_| corrupt("feedback"))?,
                judgements: serde_json::from_value(r.get("judgements")?).map_err(|_| corrupt("judgements"))?,
            })
        })
        .await
        .map(|all| all.into_iter().filter(|t| t.feedback.rewarded()).collect())
    }
}
