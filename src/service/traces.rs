//! Trace operations both front ends call: durable ingest (with an
//! `Idempotency-Key` when the caller sends one), the OTLP ingest that merges
//! each trace id's records into its pending trace, reads, late feedback, the
//! requeue of failed traces, and the operator's containment of a poisoned
//! stream: quarantine (one trace, or a prompt's pending backlog in a time
//! window), release and delete. Their limits live here, once.

use chrono::{DateTime, Utc};
use sha2::{Digest, Sha256};
use uuid::Uuid;

use super::{AppState, ServiceError, ServiceResult, projects, prompts::existing_prompt};
use crate::{
    domain::{
        Feedback, PromptName, Trace,
        access::Reach,
        names::DEFAULT_PROJECT,
        project::unknown_prompt,
        span::{OtlpMerge, OtlpRemap},
        trace::{
            FeedbackSource, IdempotencyKey, IdempotentIngest, RequeueFailed, TraceFilter, TraceLimits, ValidTrace,
        },
    },
    otlp::{
        Signal,
        mapping::{self, Mapping, Rejection, SpanGroup},
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

/// Refuses a batch of more than `limits.max_traces_per_batch` traces (413):
/// "`what` holds `count` `unit`".
pub fn check_batch(st: &AppState, what: &str, count: usize, unit: &str) -> ServiceResult<()> {
    check_batch_within(st.settings.limits.max_traces_per_batch, what, count, unit)
}

/// [`check_batch`] against the limit `max`.
pub fn check_batch_within(max: usize, what: &str, count: usize, unit: &str) -> ServiceResult<()> {
    if count > max {
        return Err(ServiceError::PayloadTooLarge(format!(
            "{what} holds {count} {unit}; the limit is {max} (`limits.max_traces_per_batch`)"
        )));
    }
    Ok(())
}

/// Counts traces created by either ingest (`combee_traces_ingested_total`).
fn count_ingested(n: u64) {
    metrics::counter!("combee_traces_ingested_total").increment(n);
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
/// A caller bound to a project sends traces for its project's prompts only:
/// another project's prompt is refused as an unknown one.
pub async fn ingest(
    st: &AppState,
    reach: &Reach,
    traces: &[ValidTrace],
    idempotent: Option<Idempotent<'_>>,
) -> ServiceResult<Ingested> {
    // Another project's prompt reads as an unknown one, in the store's words
    // for an unknown prompt; decided by the names alone.
    if let Some((i, t)) = traces.iter().enumerate().find(|(_, t)| !reach.allows(t.prompt.project())) {
        return Err(ServiceError::Unprocessable(format!("traces[{i}]: {}", unknown_prompt(t.prompt.as_str()))));
    }
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
        count_ingested(ids.len() as u64);
    }
    Ok(ingested)
}

/// The answer to an OTLP export: how many records were rejected, and the
/// `partial_success` message (why, and which records are held).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OtlpAnswer {
    pub rejected: usize,
    pub message: String,
}

/// Merges each trace id's records of an OTLP export into its pending trace
/// (one store transaction per trace id; see
/// [`crate::store::OtlpStore::merge_otlp_spans`]), at most
/// `limits.max_traces_per_batch` trace ids; `rejected` are the records the
/// decoding could not map. Says how many records were rejected and why (or
/// which are held). A failure part-way is safe to retry: records stored
/// already are ignored.
pub async fn ingest_otlp(
    st: &AppState,
    reach: &Reach,
    signal: Signal,
    groups: Vec<SpanGroup>,
    rejected: Vec<Rejection>,
) -> ServiceResult<OtlpAnswer> {
    check_batch(st, "the export", groups.len(), "traces (trace ids)")?;
    let limits = limits(st);
    let mut answer = Mapping { traces: Vec::new(), rejected };
    let mut held = Mapping::default();
    let (mut created, mut accepted, mut duplicate) = (0_u64, 0, 0);
    // A bare name is of the caller's project (`default` for a server-wide
    // caller); another project's prompt reads as an unknown one, decided by
    // the names alone.
    let home = reach.project().unwrap_or(DEFAULT_PROJECT);
    for group in groups {
        let remap = |bodies: &[&[u8]]| match mapping::remap(&group.trace_id, bodies, limits, home) {
            OtlpRemap::Mapped(t) if !reach.allows(t.prompt.project()) => {
                OtlpRemap::Invalid(unknown_prompt(t.prompt.as_str()))
            }
            other => other,
        };
        let trace_id = Some(group.trace_id.clone());
        // How many of the group's records were new; the rest were stored before.
        let new = match st.store.merge_otlp_spans(&group.trace_id, &group.spans, &remap).await? {
            OtlpMerge::Created { added, .. } => {
                created += 1;
                accepted += added;
                added
            }
            OtlpMerge::Extended { added, .. } => {
                accepted += added;
                added
            }
            OtlpMerge::Held { added, reason } => {
                held.rejected.push(Rejection { trace_id, spans: added, reason });
                added
            }
            OtlpMerge::Duplicate => 0,
            OtlpMerge::Closed { trace, spans } => {
                answer.rejected.push(Rejection {
                    trace_id,
                    spans,
                    reason: format!(
                        "its trace {trace} was already taken by a learning round; records that arrive after that are not added"
                    ),
                });
                spans
            }
            OtlpMerge::Rejected { spans, reason } => {
                answer.rejected.push(Rejection { trace_id, spans, reason });
                spans
            }
        };
        duplicate += group.spans.len().saturating_sub(new);
    }
    let rejected = answer.rejected_spans();
    let held_count = held.rejected_spans();
    count_ingested(created);
    let counter = match signal {
        Signal::Traces => "combee_otlp_spans_total",
        Signal::Logs => "combee_otlp_log_records_total",
    };
    for (outcome, n) in [("accepted", accepted), ("rejected", rejected), ("held", held_count), ("duplicate", duplicate)]
    {
        metrics::counter!(counter, "outcome" => outcome).increment(n as u64);
    }
    if rejected > 0 {
        tracing::info!(created, rejected, signal = signal.request(), "OTLP export partly rejected");
    }
    // Held records are not rejected: the answer only warns (OTLP's partial
    // success with 0 rejected and a message).
    let unit = signal.unit();
    let mut message = answer.summary("rejected", unit);
    if held_count > 0 {
        let warning = format!(
            "{}. Held records become a trace once the rest of their trace arrives (within `limits.idempotency_ttl_hours`)",
            held.summary("held", unit)
        );
        message = if message.is_empty() { warning } else { format!("{message}. {warning}") };
    }
    Ok(OtlpAnswer { rejected, message })
}

/// Traces matching `filter`, newest first.
pub async fn list_traces(st: &AppState, filter: &TraceFilter, limit: u32) -> ServiceResult<Vec<Trace>> {
    Ok(st.store.list_traces(filter, limit).await?)
}

pub async fn get_trace(st: &AppState, id: Uuid) -> ServiceResult<Trace> {
    st.store.get_trace(id).await?.ok_or_else(|| ServiceError::not_found(format_args!("trace {id}")))
}

/// An operator's label on a trace: a score in [0, 1] and an optional
/// comment, stored as human feedback (it replaces a judged reward, and
/// calibration counts it).
pub async fn label_trace(st: &AppState, id: Uuid, score: f64, comment: Option<String>) -> ServiceResult<Trace> {
    if !(0.0..=1.0).contains(&score) {
        return Err(ServiceError::Unprocessable("the score must be a number from 0 to 1".into()));
    }
    let comment = comment.map(|c| c.trim().to_owned()).filter(|c| !c.is_empty());
    if comment.as_ref().is_some_and(|c| c.chars().count() > MAX_LABEL_COMMENT_CHARS) {
        return Err(ServiceError::PayloadTooLarge(format!(
            "the comment is longer than {MAX_LABEL_COMMENT_CHARS} characters"
        )));
    }
    let feedback = Feedback { score: Some(score), comment, ..Default::default() };
    st.store
        .add_feedback_from(id, feedback, FeedbackSource::Human)
        .await?
        .ok_or_else(|| ServiceError::not_found(format_args!("trace {id}")))
}

/// Longest comment of an operator's label, in characters.
pub const MAX_LABEL_COMMENT_CHARS: usize = 2_000;

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
    name: &PromptName,
    ids: Option<Vec<Uuid>>,
    all: bool,
    since: Option<DateTime<Utc>>,
    actor: &str,
) -> ServiceResult<Vec<Uuid>> {
    let prompt = name.clone();
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

/// Quarantines every unreserved pending trace of a prompt (written `name`
/// or `project/name`) received in `[since, until)`; how many.
pub async fn quarantine_backlog(
    st: &AppState,
    reach: &Reach,
    name: &str,
    since: Option<DateTime<Utc>>,
    until: Option<DateTime<Utc>>,
    reason: Option<String>,
    actor: &str,
) -> ServiceResult<u64> {
    let name = projects::prompt_in_reach(st, reach, name).await?;
    let prompt = existing_prompt(st, &name).await?;
    let reason = quarantine_reason(reason, actor)?;
    let filter = TraceFilter { prompt: Some(prompt.name.clone()), since, until, ..Default::default() };
    let quarantined = st.store.quarantine_traces(&filter, &reason).await?;
    tracing::info!(prompt = %prompt.name, quarantined, by = %actor, "traces quarantined");
    Ok(quarantined)
}

/// The prompt a trace filter names (`name` in the caller's project, or
/// `project/name`); a list of a prompt that is absent or out of reach is
/// empty, as the list's own project filter leaves it.
pub fn filter_prompt(reach: &Reach, name: Option<&str>) -> ServiceResult<Option<PromptName>> {
    let home = reach.project().unwrap_or(DEFAULT_PROJECT);
    name.map(|n| PromptName::written(n, home).map_err(|e| ServiceError::NotFound(format!("no such prompt: {e}"))))
        .transpose()
}
