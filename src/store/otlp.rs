//! OpenTelemetry spans: merged per trace id into one pending trace, held until their trace is
//! complete, purged when abandoned.

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use serde_json::Value;
use uuid::Uuid;

use super::{
    StoreError, StoreResult,
    backend::{Backend, SqlStore},
    rollups::{self, Counted, Sign},
    sql::{Cols, Dialect, corrupt, json, now, opt_json, sql},
    traces::prompt_reference_problem,
};
use crate::domain::{
    Feedback,
    span::{OtlpMerge, OtlpRemap, OtlpRemapFn, OtlpSpan},
};

/// OpenTelemetry spans on their way to becoming traces.
#[async_trait]
pub trait OtlpStore: Send + Sync {
    /// Adds the spans of one OpenTelemetry trace id, in one transaction
    /// serialised per trace id (a row lock on Postgres, the single writer on
    /// SQLite): spans whose id is stored already are ignored; if any are new,
    /// `remap` maps the union and the trace id's pending trace is made or
    /// re-mapped, or the spans are held. A trace already taken by a round is
    /// not changed (`Closed`).
    async fn merge_otlp_spans(
        &self,
        otel_trace_id: &str,
        spans: &[OtlpSpan],
        remap: &OtlpRemapFn<'_>,
    ) -> StoreResult<OtlpMerge>;
    /// Forgets held spans (that never became a trace) of trace ids that got
    /// nothing since `older_than`; returns how many spans.
    async fn purge_held_otlp_spans(&self, older_than: DateTime<Utc>) -> StoreResult<u64>;
}

#[async_trait]
impl<D: Backend> OtlpStore for SqlStore<D> {
    async fn merge_otlp_spans(
        &self,
        otel_trace_id: &str,
        spans: &[OtlpSpan],
        remap: &OtlpRemapFn<'_>,
    ) -> StoreResult<OtlpMerge> {
        let mut tx = self.begin_write().await?;
        // Serialises exports of the same trace id, including the first one.
        D::serialize_otlp(&mut tx, otel_trace_id).await?;
        let stored = sql::<D>(
            "SELECT span_id, trace_id, body FROM otlp_spans WHERE otel_trace_id = $1 ORDER BY received_at, span_id",
        )
        .bind(otel_trace_id)
        .fetch_all(&mut tx)
        .await?;
        let mut seen = std::collections::HashSet::new();
        let mut linked = None;
        let mut bodies: Vec<Vec<u8>> = Vec::with_capacity(stored.len() + spans.len());
        for row in &stored {
            let r = Cols::<D>(row);
            seen.insert(r.get::<String>("span_id")?);
            linked = linked.or(r.get::<Option<Uuid>>("trace_id")?);
            bodies.push(r.get("body")?);
        }
        let new: Vec<&OtlpSpan> = spans.iter().filter(|s| seen.insert(s.span_id.clone())).collect();
        if new.is_empty() {
            // Ended explicitly: a dropped transaction would keep its locks
            // until its pooled connection is used again.
            tx.rollback().await?;
            return Ok(OtlpMerge::Duplicate);
        }
        // The linked trace's feedback, read under the lock that keeps it open.
        let mut linked_feedback: Option<Value> = None;
        if let Some(trace) = linked {
            // The row lock keeps a round from taking the trace while it changes
            // (rounds skip locked traces); a round that took it first wins.
            let text = format!(
                "SELECT feedback, CASE WHEN status = 'pending' AND round_id IS NULL THEN 1 ELSE 0 END AS open
                 FROM traces WHERE id = $1{}",
                D::lock(" FOR UPDATE")
            );
            let row = sql::<D>(&text).bind(trace).fetch_optional(&mut tx).await?;
            let open: Option<i32> = row.as_ref().map(|r| Cols::<D>(r).get("open")).transpose()?;
            if open != Some(1) {
                tx.rollback().await?;
                return Ok(OtlpMerge::Closed { trace, spans: new.len() });
            }
            linked_feedback = row.as_ref().map(|r| Cols::<D>(r).get("feedback")).transpose()?;
        }
        bodies.extend(new.iter().map(|s| s.body.clone()));
        let refs: Vec<&[u8]> = bodies.iter().map(Vec::as_slice).collect();
        let mapped = match remap(&refs) {
            OtlpRemap::Invalid(reason) => {
                tx.rollback().await?;
                return Ok(OtlpMerge::Rejected { spans: new.len(), reason });
            }
            OtlpRemap::Incomplete(reason) if linked.is_some() => {
                tx.rollback().await?;
                return Ok(OtlpMerge::Rejected { spans: new.len(), reason });
            }
            OtlpRemap::Incomplete(reason) => {
                insert_otlp_spans::<D>(&mut tx, otel_trace_id, None, &new).await?;
                tx.commit().await?;
                return Ok(OtlpMerge::Held { added: new.len(), reason });
            }
            OtlpRemap::Mapped(t) => *t,
        };
        let prompt = sql::<D>("SELECT id, version_count FROM prompts WHERE project = $1 AND name = $2")
            .bind(mapped.prompt.project())
            .bind(mapped.prompt.as_str())
            .fetch_optional(&mut tx)
            .await?;
        let count = prompt.as_ref().map(|r| Cols::<D>(r).get::<i64>("version_count")).transpose()?;
        if let Some(reason) = prompt_reference_problem(&mapped.prompt, mapped.prompt_version, count) {
            tx.rollback().await?;
            return Ok(OtlpMerge::Rejected { spans: new.len(), reason });
        }
        let prompt_id: Uuid =
            prompt.as_ref().map(|r| Cols::<D>(r).get("id")).transpose()?.ok_or_else(|| corrupt("prompt"))?;
        let now = now();
        let (trace, created) = match linked {
            Some(trace) => {
                let current = linked_feedback.take().ok_or(StoreError::NotFound)?;
                let current: Feedback = serde_json::from_value(current).map_err(|_| corrupt("feedback"))?;
                // Feedback given through the API stays unless a span says otherwise.
                let feedback =
                    serde_json::to_value(current.merged(mapped.feedback.clone())).map_err(|_| corrupt("feedback"))?;
                rollups::account::<D>(&mut tx, &[trace], Sign::Retract, Counted::Unquarantined).await?;
                sql::<D>(
                    "UPDATE traces SET prompt_id = $2, prompt_version = $3, input = $4, trajectory = $5, output = $6,
                            feedback = $7, metadata = $8, updated_at = $9 WHERE id = $1",
                )
                .bind(trace)
                .bind(prompt_id)
                .bind(mapped.prompt_version)
                .bind(json(&mapped.input))
                .bind(json(&mapped.trajectory))
                .bind(json(&mapped.output))
                .bind(json(&feedback))
                .bind(json(&mapped.metadata))
                .bind(now)
                .execute(&mut tx)
                .await?;
                rollups::account::<D>(&mut tx, &[trace], Sign::Credit, Counted::Unquarantined).await?;
                (trace, false)
            }
            None => {
                let trace = Uuid::now_v7();
                let feedback = serde_json::to_value(&mapped.feedback).map_err(|_| corrupt("feedback"))?;
                sql::<D>(
                    "INSERT INTO traces (id, prompt_id, prompt_version, input, trajectory, output, feedback, reflection,
                                         external_id, metadata, created_at, updated_at)
                     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $11)",
                )
                .bind(trace)
                .bind(prompt_id)
                .bind(mapped.prompt_version)
                .bind(json(&mapped.input))
                .bind(json(&mapped.trajectory))
                .bind(json(&mapped.output))
                .bind(json(&feedback))
                .bind(opt_json(mapped.reflection.as_ref()))
                .bind(mapped.external_id.as_deref())
                .bind(json(&mapped.metadata))
                .bind(now)
                .execute(&mut tx)
                .await?;
                sql::<D>("UPDATE otlp_spans SET trace_id = $2 WHERE otel_trace_id = $1 AND trace_id IS NULL")
                    .bind(otel_trace_id)
                    .bind(trace)
                    .execute(&mut tx)
                    .await?;
                rollups::account::<D>(&mut tx, &[trace], Sign::Credit, Counted::All).await?;
                (trace, true)
            }
        };
        insert_otlp_spans::<D>(&mut tx, otel_trace_id, Some(trace), &new).await?;
        tx.commit().await?;
        let added = new.len();
        Ok(if created { OtlpMerge::Created { trace, added } } else { OtlpMerge::Extended { trace, added } })
    }

    async fn purge_held_otlp_spans(&self, older_than: DateTime<Utc>) -> StoreResult<u64> {
        sql::<D>(
            "DELETE FROM otlp_spans WHERE trace_id IS NULL AND otel_trace_id IN (
                 SELECT otel_trace_id FROM otlp_spans WHERE trace_id IS NULL
                 GROUP BY otel_trace_id HAVING max(received_at) < $1)",
        )
        .bind(older_than)
        .execute(&mut *self.writer.acquire().await?)
        .await
    }
}

/// Stores new spans of `otel_trace_id`, attached to `trace` or held (`None`).
pub(super) async fn insert_otlp_spans<D: Dialect>(
    c: &mut D::Connection,
    otel_trace_id: &str,
    trace: Option<Uuid>,
    spans: &[&OtlpSpan],
) -> StoreResult<()> {
    let now = now();
    for span in spans {
        sql::<D>(
            "INSERT INTO otlp_spans (otel_trace_id, span_id, trace_id, body, received_at) VALUES ($1, $2, $3, $4, $5)",
        )
        .bind(otel_trace_id)
        .bind(&span.span_id)
        .bind(trace)
        .bind(span.body.as_slice())
        .bind(now)
        .execute(c)
        .await?;
    }
    Ok(())
}
