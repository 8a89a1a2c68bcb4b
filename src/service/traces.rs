//! Trace operations both front ends call: durable ingest (with an
//! `Idempotency-Key` when the caller sends one), reads, late feedback, the
//! requeue of failed traces, and the operator's containment of a poisoned
//! stream: quarantine (one trace, or a prompt's pending backlog in a time
//! window), release and delete. Their limits live here, once.

use chrono::{DateTime, Utc};
use sha2::{Digest, Sha256};
use uuid::Uuid;

use super::{AppState, ServiceError, ServiceResult, prompts::existing_prompt};
use crate::{
    domain::{
        Feedback, PromptName, Trace,
        span::{OtlpMerge, OtlpRemapFn, OtlpSpan},
        trace::{IdempotencyKey, IdempotentIngest, RequeueFailed, TraceFilter, TraceLimits, ValidTrace},
    },
    store::{StoreError, TraceAction},
};

/// Longest quarantine reason, in characters.
pub const MAX_REASON_CHARS: usize = 500;
/// Most trace ids one requeue may name.
pub const MAX_REQUEUE_IDS: usize = 1000;

/// The size limits a trace is checked against (`limits.*` in the settings).
pub fn limits(st: &AppState) -> TraceLimits {
    TraceLimits {
        max_field_bytes: st.settings.limits.max_field_bytes,
        max_trace_bytes: st.settings.limits.max_trace_bytes,
    }
}

/// A request sent with an `Idempotency-Key`: who sent it, the key, and the
/// raw body the key is bound to.
pub struct Idempotent<'a> {
    pub caller: Uuid,
    pub key: &'a str,
    pub body: &'a [u8],
}

/// What an ingest did.
#[derive(Debug, PartialEq)]
pub enum Ingested {
    /// The traces are stored, with these ids in request order.
    Stored(Vec<Uuid>),
    /// The same request came with this key before: its traces' ids (nothing stored now).
    Replayed(Vec<Uuid>),
}

/// Stores validated traces, all or none, durably before it returns. With an
/// `Idempotency-Key`, a repeat of the same request stores nothing and is told
/// the first one's ids; the same key with another body is refused (422).
pub async fn ingest(
    st: &AppState,
    traces: &[ValidTrace],
    idempotent: Option<Idempotent<'_>>,
) -> ServiceResult<Ingested> {
    let ingested = match idempotent {
        None => Ingested::Stored(st.store.insert_traces(traces).await?),
        Some(req) => {
            let request_hash = hex::encode(Sha256::digest(req.body));
            let key = IdempotencyKey { owner: req.caller, key: req.key, request_hash: &request_hash };
            match st.store.insert_traces_idempotent(key, traces).await? {
                IdempotentIngest::Stored { ids } => Ingested::Stored(ids),
                IdempotentIngest::Replay { ids } => Ingested::Replayed(ids),
                IdempotentIngest::Mismatch => {
                    return Err(ServiceError::Unprocessable(
                        "this Idempotency-Key was already used with a different request body".into(),
                    ));
                }
            }
        }
    };
    if let Ingested::Stored(ids) = &ingested {
        metrics::counter!("combee_traces_ingested_total").increment(ids.len() as u64);
    }
    Ok(ingested)
}

/// Adds the spans of one OpenTelemetry trace id to its pending trace (see
/// [`crate::store::OtlpStore::merge_otlp_spans`]).
pub async fn merge_spans(
    st: &AppState,
    otel_trace_id: &str,
    spans: &[OtlpSpan],
    remap: &OtlpRemapFn<'_>,
) -> ServiceResult<OtlpMerge> {
    Ok(st.store.merge_otlp_spans(otel_trace_id, spans, remap).await?)
}

/// Traces matching `filter`, newest first.
pub async fn list_traces(st: &AppState, filter: &TraceFilter, limit: u32) -> ServiceResult<Vec<Trace>> {
    Ok(st.store.list_traces(filter, limit).await?)
}

pub async fn get_trace(st: &AppState, id: Uuid) -> ServiceResult<Trace> {
    st.store.get_trace(id).await?.ok_or_else(|| ServiceError::not_found(format_args!("trace {id}")))
}

/// Attaches late feedback: the fields given replace the earlier ones.
pub async fn add_feedback(st: &AppState, id: Uuid, feedback: Feedback) -> ServiceResult<Trace> {
    let limit = st.settings.limits.max_field_bytes;
    let too_long = |s: &Option<String>| s.as_ref().is_some_and(|s| s.len() > limit);
    let gt_len = feedback.ground_truth.as_ref().map_or(0, |v| v.to_string().len());
    if too_long(&feedback.comment) || too_long(&feedback.error) || gt_len > st.settings.limits.max_trace_bytes {
        return Err(ServiceError::PayloadTooLarge(format!("a feedback field exceeds {limit} bytes")));
    }
    if feedback.score.is_some_and(|s| !s.is_finite()) {
        return Err(ServiceError::Unprocessable("`score` must be a finite number".into()));
    }
    st.store.add_feedback(id, feedback).await?.ok_or_else(|| ServiceError::not_found(format_args!("trace {id}")))
}

/// Puts the prompt's failed traces back to pending, attempts reset: `ids`
/// (at most [`MAX_REQUEUE_IDS`]) or `all`, either narrowed by `since`. The
/// traces now pending again, oldest first.
pub async fn requeue_failed(
    st: &AppState,
    name: &str,
    ids: Option<Vec<Uuid>>,
    all: bool,
    since: Option<DateTime<Utc>>,
    actor: &str,
) -> ServiceResult<Vec<Uuid>> {
    let prompt = super::prompts::parse_name(name)?;
    let ids = match (ids, all) {
        (Some(_), true) => return Err(ServiceError::Unprocessable("give `ids` or `all: true`, not both".into())),
        (None, false) => {
            return Err(ServiceError::Unprocessable(
                "say which traces: `ids` (a list of trace ids) or `all: true` (every failed trace)".into(),
            ));
        }
        (Some(ids), false) if ids.is_empty() => return Err(ServiceError::Unprocessable("`ids` is empty".into())),
        (Some(ids), false) if ids.len() > MAX_REQUEUE_IDS => {
            return Err(ServiceError::Unprocessable(format!("at most {MAX_REQUEUE_IDS} `ids` per request")));
        }
        (ids, _) => ids,
    };
    let req = RequeueFailed { prompt, ids, since };
    let ids = match st.store.requeue_failed_traces(&req).await {
        Err(StoreError::NotFound) => return Err(ServiceError::not_found(format_args!("prompt {name:?}"))),
        other => other?,
    };
    metrics::counter!("combee_traces_requeued_total").increment(ids.len() as u64);
    tracing::info!(
        prompt = %req.prompt, count = ids.len(), by = %actor,
        asked_ids = req.ids.as_ref().map(Vec::len), since = ?req.since, "failed traces requeued"
    );
    Ok(ids)
}

/// The reason a quarantine records: the operator's, trimmed (at most
/// [`MAX_REASON_CHARS`]), or who did it.
pub fn quarantine_reason(reason: Option<String>, actor: &str) -> ServiceResult<String> {
    // As given (the API's schema states `maxLength` of the string sent), then trimmed.
    if reason.as_ref().is_some_and(|r| r.chars().count() > MAX_REASON_CHARS) {
        return Err(ServiceError::Unprocessable(format!("`reason` is longer than {MAX_REASON_CHARS} characters")));
    }
    let reason = reason.map(|r| r.trim().to_owned()).filter(|r| !r.is_empty());
    Ok(reason.unwrap_or_else(|| format!("quarantined by {actor}")))
}

fn trace_action(id: Uuid, action: TraceAction) -> ServiceResult<Trace> {
    match action {
        TraceAction::Done(t) => Ok(*t),
        TraceAction::NotFound => Err(ServiceError::not_found(format_args!("trace {id}"))),
        TraceAction::Refused(why) => Err(ServiceError::Conflict(why)),
    }
}

/// Holds a pending (or failed) trace back from learning; repeating it changes
/// nothing. Refused (409) while a round has it reserved or once consumed.
pub async fn quarantine_trace(st: &AppState, id: Uuid, reason: Option<String>, actor: &str) -> ServiceResult<Trace> {
    let reason = quarantine_reason(reason, actor)?;
    let trace = trace_action(id, st.store.quarantine_trace(id, &reason).await?)?;
    tracing::info!(trace = %id, by = %actor, "trace quarantined");
    Ok(trace)
}

/// Lifts a trace's quarantine; releasing one not quarantined changes nothing.
pub async fn release_trace(st: &AppState, id: Uuid, actor: &str) -> ServiceResult<Trace> {
    let trace = trace_action(id, st.store.release_trace(id).await?)?;
    tracing::info!(trace = %id, by = %actor, "trace released from quarantine");
    Ok(trace)
}

/// Deletes a trace no version was learned from (pending, quarantined or failed).
pub async fn delete_trace(st: &AppState, id: Uuid, actor: &str) -> ServiceResult<()> {
    trace_action(id, st.store.delete_trace(id).await?)?;
    tracing::info!(trace = %id, by = %actor, "trace deleted");
    Ok(())
}

/// Quarantines every unreserved pending trace of a prompt received in
/// `[since, until)`; how many.
pub async fn quarantine_backlog(
    st: &AppState,
    name: &str,
    since: Option<DateTime<Utc>>,
    until: Option<DateTime<Utc>>,
    reason: Option<String>,
    actor: &str,
) -> ServiceResult<u64> {
    let prompt = existing_prompt(st, name).await?;
    let reason = quarantine_reason(reason, actor)?;
    let filter = TraceFilter { prompt: Some(prompt.name.clone()), since, until, ..Default::default() };
    let quarantined = st.store.quarantine_traces(&filter, &reason).await?;
    tracing::info!(prompt = %prompt.name, quarantined, by = %actor, "traces quarantined");
    Ok(quarantined)
}

/// The prompt named in a trace filter, checked like a path's.
pub fn filter_prompt(name: Option<&str>) -> ServiceResult<Option<PromptName>> {
    name.map(super::prompts::parse_name).transpose()
}
