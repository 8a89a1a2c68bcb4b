//! Evaluators: each prompt's list (one row, replaced whole), the pending
//! traces they have not judged yet, and their verdicts written onto a trace —
//! as its feedback only when no one else scored it, with the rollups kept
//! exact as late feedback keeps them.

use std::time::Duration;

use async_trait::async_trait;
use serde_json::Value;
use uuid::Uuid;

use super::{
    StoreResult,
    backend::{Backend, SqlStore},
    rollups::{self, Counted, Sign},
    sql::{Cols, Param, corrupt, json, later, now, sql},
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

/// The evaluators' verdicts on one trace, to save.
#[derive(Debug, Clone, PartialEq)]
pub struct JudgedTrace {
    pub id: Uuid,
    pub judgements: Vec<Judgement>,
    pub feedback: Option<JudgedFeedback>,
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
    /// Claims, for `lease`, up to `limit` pending, unquarantined traces of
    /// prompts with evaluators that no evaluator has looked at yet and no
    /// other judge holds, each prompt's oldest first and every prompt with
    /// such traces getting a share: several worker processes judge disjoint
    /// batches, and a dead worker's batch is claimed again once its lease
    /// runs out. Reads only the traces of prompts that have evaluators.
    async fn claim_unjudged(&self, lease: Duration, limit: u32) -> StoreResult<Vec<Unjudged>>;
    /// Records the evaluators' judgements on each trace of `batch` (once:
    /// traces judged already or gone are skipped) and, when a judged
    /// feedback is given and the trace carries no reward yet, writes it as the
    /// trace's feedback (source `judge`), the rollups taking it in as late
    /// feedback does. One transaction; how many traces were recorded.
    async fn save_judgements(&self, batch: &[JudgedTrace]) -> StoreResult<u64>;
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
        let mut tx = self.begin_write().await?;
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

    async fn claim_unjudged(&self, lease: Duration, limit: u32) -> StoreResult<Vec<Unjudged>> {
        // The prompts that have evaluators first, off the writer: the traces of
        // any other prompt are never read, and with none there is nothing to claim.
        let judged: Vec<(Uuid, PromptName, Vec<Evaluator>)> = sql::<D>(
            "SELECT e.prompt_id, p.project, p.name, e.evaluators FROM prompt_evaluators e JOIN prompts p ON p.id = e.prompt_id
             ORDER BY e.prompt_id",
        )
        .map(&mut *self.reader.acquire().await?, |row| {
            let r = Cols::<D>(row);
            Ok((
                r.get("prompt_id")?,
                prompt_name(&r.get::<String>("project")?, &r.get::<String>("name")?)?,
                serde_json::from_value(r.get("evaluators")?).map_err(|_| corrupt("evaluators"))?,
            ))
        })
        .await?;
        if judged.is_empty() || limit == 0 {
            return Ok(Vec::new());
        }
        let mut tx = self.begin_write().await?;
        let at = now();
        // Each prompt's oldest unjudged traces, walked in the order of its
        // `traces_unjudged` index so a claim reads about as many rows as it
        // takes: an equal share each first, then what is left of the batch to
        // the prompts that had more, so one prompt's backlog neither starves
        // the others nor leaves the batch half empty.
        let text = format!(
            "SELECT t.id, t.input, t.output, t.metadata FROM traces t
             WHERE t.prompt_id = $1 AND t.judged_at IS NULL AND t.status = 'pending' AND t.quarantined_at IS NULL
               AND (t.judge_claimed_until IS NULL OR t.judge_claimed_until < $2)
             ORDER BY t.id LIMIT $3{}",
            D::lock(" FOR UPDATE SKIP LOCKED")
        );
        let claim_update = format!("UPDATE traces SET judge_claimed_until = $1 WHERE {}", D::any_of("id", "$2"));
        let limit = limit as usize;
        let share = limit.div_ceil(judged.len());
        let mut claimed: Vec<Unjudged> = Vec::new();
        let mut had_more: Vec<usize> = Vec::new();
        for pass in 0..2 {
            let prompts: Vec<usize> =
                if pass == 0 { (0..judged.len()).collect() } else { std::mem::take(&mut had_more) };
            for i in prompts {
                let wanted = if pass == 0 { share } else { limit }.min(limit - claimed.len());
                if wanted == 0 {
                    break;
                }
                let (prompt_id, prompt, evaluators) = &judged[i];
                let got = sql::<D>(&text)
                    .bind(*prompt_id)
                    .bind(at)
                    .bind(wanted as i64)
                    .map(&mut tx, |row| {
                        let r = Cols::<D>(row);
                        Ok(Unjudged {
                            id: r.get("id")?,
                            prompt: prompt.clone(),
                            input: r.get("input")?,
                            output: r.get("output")?,
                            metadata: r.get("metadata")?,
                            evaluators: evaluators.clone(),
                        })
                    })
                    .await?;
                if got.is_empty() {
                    continue;
                }
                if got.len() == wanted {
                    had_more.push(i);
                }
                // Marked at once, so the second pass does not read them again.
                let ids: Vec<Uuid> = got.iter().map(|t| t.id).collect();
                sql::<D>(&claim_update).bind(later(at, lease)).bind(Param::Ids(Some(&ids))).execute(&mut tx).await?;
                claimed.extend(got);
            }
        }
        tx.commit().await?;
        Ok(claimed)
    }

    async fn save_judgements(&self, batch: &[JudgedTrace]) -> StoreResult<u64> {
        if batch.is_empty() {
            return Ok(0);
        }
        let ids: Vec<Uuid> = batch.iter().map(|j| j.id).collect();
        let mut tx = self.begin_write().await?;
        // Locked in id order, so concurrent judges never wait on each other in a circle.
        let text = format!(
            "SELECT id, feedback FROM traces WHERE {} AND judged_at IS NULL ORDER BY id{}",
            D::any_of("id", "$1"),
            D::lock(" FOR UPDATE")
        );
        let open: Vec<(Uuid, Feedback)> = sql::<D>(&text)
            .bind(Param::Ids(Some(&ids)))
            .map(&mut tx, |row| {
                let r = Cols::<D>(row);
                Ok((r.get("id")?, serde_json::from_value(r.get("feedback")?).map_err(|_| corrupt("feedback"))?))
            })
            .await?;
        let fills: Vec<(&JudgedTrace, Option<Feedback>)> = open
            .into_iter()
            .filter_map(|(id, current)| {
                let j = batch.iter().find(|j| j.id == id)?;
                let filled = j.feedback.as_ref().filter(|_| !current.rewarded()).map(|f| Feedback {
                    score: Some(f.score),
                    comment: current.comment.clone().or_else(|| (!f.critique.is_empty()).then(|| f.critique.clone())),
                    ..current
                });
                Some((j, filled))
            })
            .collect();
        let filled: Vec<Uuid> = fills.iter().filter(|(_, f)| f.is_some()).map(|(j, _)| j.id).collect();
        rollups::account::<D>(&mut tx, &filled, Sign::Retract, Counted::Unquarantined).await?;
        let at = now();
        for (j, feedback) in &fills {
            let list = serde_json::to_value(&j.judgements).map_err(|_| corrupt("judgements"))?;
            match (feedback, &j.feedback) {
                (Some(feedback), Some(by)) => {
                    let feedback = serde_json::to_value(feedback).map_err(|_| corrupt("feedback"))?;
                    sql::<D>(
                        "UPDATE traces SET judged_at = $1, judgements = $2, feedback = $3, feedback_source = $4,
                                judged_by = $5, updated_at = $1 WHERE id = $6",
                    )
                    .bind(at)
                    .bind(json(&list))
                    .bind(json(&feedback))
                    .bind(FeedbackSource::Judge.column())
                    .bind(by.by.as_str())
                    .bind(j.id)
                    .execute(&mut tx)
                    .await?;
                }
                _ => {
                    sql::<D>("UPDATE traces SET judged_at = $1, judgements = $2 WHERE id = $3")
                        .bind(at)
                        .bind(json(&list))
                        .bind(j.id)
                        .execute(&mut tx)
                        .await?;
                }
            }
        }
        rollups::account::<D>(&mut tx, &filled, Sign::Credit, Counted::Unquarantined).await?;
        tx.commit().await?;
        Ok(fills.len() as u64)
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
