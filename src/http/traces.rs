//! Trace routes: ingestion (one trace or a batch, durable before the answer,
//! `Idempotency-Key` honoured), a filtered listing, late feedback, and the
//! operator's containment of a poisoned stream: quarantine and delete.

use crate::service::audit::{self, Audit};
use axum::{
    Json,
    extract::{Request, State},
    http::{HeaderMap, HeaderValue, StatusCode, header},
    response::{IntoResponse, Response},
};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::{IntoParams, ToSchema};
use uuid::Uuid;

use super::{
    AppState,
    error::{ApiError, ApiResult},
    extract::{ApiJson, ApiPath, ApiQuery, Authorized, body_bytes, optional_json, scope},
};
use crate::service::projects::PathPrompt;
use crate::{
    domain::{
        Feedback, NewTrace, Trace, TraceStatus,
        names::DEFAULT_PROJECT,
        trace::{ObjectOnly, TraceFilter, TraceLimits, ValidTrace},
    },
    service::{
        pagination::{PageParams, next_token},
        traces::{self, Idempotent, Ingested, limits},
    },
};

const IDEMPOTENCY_KEY: &str = "idempotency-key";

#[derive(Debug, Serialize, ToSchema)]
pub struct TracesAccepted {
    /// The ids of the stored traces, in request order.
    pub ids: Vec<Uuid>,
    pub count: usize,
}

/// `{"traces": [...]}` or a single trace object.
#[derive(Debug, Deserialize, ToSchema)]
pub struct TraceBatch {
    pub traces: Vec<NewTrace>,
}

/// Parses and validates the body; errors name the offending trace by index.
/// `home` is the project a bare prompt name is of (the caller's).
fn parse_traces(st: &AppState, body: &[u8], home: &str) -> ApiResult<Vec<ValidTrace>> {
    let (limits, max_batch) = (limits(st), st.settings.limits.max_traces_per_batch);
    // Most bodies are well formed: read them straight into typed traces. Any
    // body that is not is read again the careful way, whose errors say where.
    match parse_well_formed(body, limits, max_batch, home) {
        Some(traces) => Ok(traces),
        None => parse_with_paths(body, limits, max_batch, home),
    }
}

/// A batch as [`parse_well_formed`] reads it.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct WellFormedBatch {
    traces: Vec<ObjectOnly<NewTrace>>,
}

/// The traces of a body that [`parse_with_paths`] accepts, read without
/// building a JSON tree of the whole body and rebuilding each trace from it
/// (with a path kept for every key): the same traces, at about half the
/// allocations. `None` for anything else, [`parse_with_paths`] answers that.
fn parse_well_formed(body: &[u8], limits: TraceLimits, max_batch: usize, home: &str) -> Option<Vec<ValidTrace>> {
    let items: Vec<NewTrace> = match serde_json::from_slice::<ObjectOnly<WellFormedBatch>>(body) {
        Ok(batch) => batch.0.traces.into_iter().map(|t| t.0).collect(),
        Err(_) => vec![serde_json::from_slice::<ObjectOnly<NewTrace>>(body).ok()?.0],
    };
    if items.is_empty() || items.len() > max_batch {
        return None;
    }
    items
        .into_iter()
        .map(|mut t| {
            // What the careful reading does to every number of a trace's tree.
            let feedback = t.feedback.as_mut().and_then(|f| f.ground_truth.as_mut());
            for v in [Some(&mut t.input), t.trajectory.as_mut(), t.output.as_mut(), t.reflection.as_mut()]
                .into_iter()
                .chain([t.metadata.as_mut(), feedback])
                .flatten()
            {
                super::extract::integral_floats_to_integers(v);
            }
            t.validate(limits, home).ok()
        })
        .collect()
}

/// Parses and validates any body through a JSON tree; errors name the
/// offending trace by index and the field by its path.
fn parse_with_paths(body: &[u8], limits: TraceLimits, max_batch: usize, home: &str) -> ApiResult<Vec<ValidTrace>> {
    let value: Value = serde_json::from_slice(body).map_err(|e| {
        if e.is_syntax() || e.is_eof() {
            ApiError::bad_request(format!("the body is not valid JSON: {e}"))
        } else {
            ApiError::unprocessable(crate::service::plain_serde_error(&e.to_string()))
        }
    })?;
    let (items, batch) = match value {
        Value::Object(mut map) if map.contains_key("traces") => match map.remove("traces") {
            Some(Value::Array(items)) if map.is_empty() => (items, true),
            Some(Value::Array(_)) => {
                return Err(ApiError::unprocessable("a batch is `{\"traces\": [...]}` with no other fields".into()));
            }
            _ => return Err(ApiError::unprocessable("`traces` must be an array".into())),
        },
        v @ Value::Object(_) => (vec![v], false),
        _ => return Err(ApiError::unprocessable("send one trace object or `{\"traces\": [...]}`".into())),
    };
    traces::check_batch_within(max_batch, "the batch", items.len(), "traces")?;
    if items.is_empty() {
        return Err(ApiError::unprocessable("the batch holds no traces".into()));
    }
    items
        .into_iter()
        .enumerate()
        .map(|(i, item)| {
            let at = |msg: String| if batch { format!("traces[{i}]: {msg}") } else { msg };
            let mut item = item;
            if !item.is_object() {
                return Err(ApiError::unprocessable(at("a trace must be a JSON object".into())));
            }
            // What `body_value` does, but for U+0000, which the trace's own
            // validation names by its field.
            super::extract::integral_floats_to_integers(&mut item);
            if item.get("feedback").is_some_and(|f| !(f.is_object() || f.is_null())) {
                return Err(ApiError::unprocessable(at("`feedback` must be a JSON object".into())));
            }
            let t: NewTrace = serde_path_to_error::deserialize(item).map_err(|e| {
                let path = e.path().to_string();
                let inner = crate::service::plain_serde_error(&e.inner().to_string());
                let msg = if path == "." { inner } else { format!("{path}: {inner}") };
                ApiError::unprocessable(at(msg))
            })?;
            t.validate(limits, home).map_err(|e| {
                if e.is_size() {
                    ApiError::payload_too_large(at(e.to_string()))
                } else {
                    ApiError::unprocessable(at(e.to_string()))
                }
            })
        })
        .collect()
}

fn json_response(status: StatusCode, body: Vec<u8>) -> Response {
    let mut res = (status, body).into_response();
    res.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    res
}

#[utoipa::path(post, path = "/v1/traces", tag = "traces",
    request_body(content = TraceBatch, description = "one trace object, or `{\"traces\": [...]}` with at most `limits.max_traces_per_batch` traces"),
    params(("Idempotency-Key" = Option<String>, Header, description = "a repeat replays the first answer (header `Idempotent-Replayed: true`) and stores nothing; the same key with another payload is 422. The traces and the key commit together, so a retry after a failure (503) either replays or stores, never twice")),
    responses((status = 201, body = TracesAccepted), (status = 413, body = super::error::Problem), (status = 422, body = super::error::Problem),
        (status = 503, description = "the store is unavailable; retry after `Retry-After` seconds", body = super::error::Problem)),
    security(("bearer" = ["traces:write"])))]
pub async fn post_traces(
    State(st): State<AppState>,
    caller: Authorized<scope::TracesWrite>,
    req: Request,
) -> ApiResult<Response> {
    let idem_key = idempotency_key(req.headers())?;
    let body = body_bytes(req).await?;
    let home = caller.reach().project().unwrap_or(DEFAULT_PROJECT).to_owned();
    let traces = parse_traces(&st, &body, &home)?;
    let idempotent = idem_key.as_deref().map(|key| Idempotent { caller: caller.key_id(), key, body: &body });
    Ok(match traces::ingest(&st, &caller.reach(), &traces, idempotent).await? {
        Ingested::Stored(ids) => json_response(StatusCode::CREATED, accepted_body(&ids)),
        Ingested::Replayed(ids) => {
            let mut res = json_response(StatusCode::CREATED, accepted_body(&ids));
            res.headers_mut().insert("idempotent-replayed", HeaderValue::from_static("true"));
            res
        }
    })
}

/// The answer to an accepted batch: `{"ids": [...], "count": n}`.
fn accepted_body(ids: &[Uuid]) -> Vec<u8> {
    serde_json::json!({"ids": ids, "count": ids.len()}).to_string().into_bytes()
}

fn idempotency_key(headers: &HeaderMap) -> ApiResult<Option<String>> {
    let Some(v) = headers.get(IDEMPOTENCY_KEY) else { return Ok(None) };
    let v = v.to_str().map_err(|_| ApiError::bad_request("`Idempotency-Key` must be visible ASCII".into()))?;
    if v.is_empty() || v.len() > 255 {
        return Err(ApiError::bad_request("`Idempotency-Key` must be 1..=255 characters".into()));
    }
    Ok(Some(v.to_owned()))
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct TraceQuery {
    pub prompt: Option<String>,
    /// Only traces of this project's prompts (a project's key sees only its own anyway).
    pub project: Option<String>,
    pub status: Option<TraceStatus>,
    /// RFC 3339; traces received at or after it.
    #[serde(default, deserialize_with = "crate::http::extract::bounded_time")]
    pub since: Option<DateTime<Utc>>,
    /// RFC 3339; traces received before it.
    #[serde(default, deserialize_with = "crate::http::extract::bounded_time")]
    pub until: Option<DateTime<Utc>>,
    pub page_size: Option<u32>,
    pub page_token: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct TracePage {
    pub traces: Vec<Trace>,
    pub next_page_token: Option<String>,
}

#[utoipa::path(get, path = "/v1/traces", tag = "traces", params(TraceQuery),
    responses((status = 200, body = TracePage)), security(("bearer" = ["prompts:read"])))]
pub async fn list_traces(
    State(st): State<AppState>,
    caller: Authorized<scope::PromptsRead>,
    ApiQuery(q): ApiQuery<TraceQuery>,
) -> ApiResult<Json<TracePage>> {
    let page = PageParams { page_size: q.page_size, page_token: q.page_token };
    let before_id = match page.cursor()? {
        Some(c) => Some(Uuid::parse_str(&c).map_err(|_| ApiError::bad_request("bad `page_token`".into()))?),
        None => None,
    };
    let prompt = traces::filter_prompt(&caller.reach(), q.prompt.as_deref())?;
    let projects = crate::domain::project::list_filter(&caller.reach(), q.project.as_deref());
    let project = projects.project().map(str::to_owned);
    let filter = TraceFilter { prompt, project, status: q.status, since: q.since, until: q.until, before_id };
    let size = page.size(st.settings.limits.max_page_size);
    let traces = match projects {
        crate::domain::project::ListFilter::Nothing => Vec::new(),
        _ => traces::list_traces(&st, &filter, size).await?,
    };
    let next_page_token = next_token(&traces, size, |t| t.id.simple().to_string());
    Ok(Json(TracePage { traces, next_page_token }))
}

fn trace_id(id: &str) -> ApiResult<Uuid> {
    Uuid::parse_str(id).map_err(|_| ApiError::missing("no such trace: ids are UUIDs".into()))
}

#[utoipa::path(get, path = "/v1/traces/{id}", tag = "traces", params(("id" = Uuid, Path)),
    responses((status = 200, body = Trace), (status = 404, body = super::error::Problem)), security(("bearer" = ["prompts:read"])))]
pub async fn get_trace(
    State(st): State<AppState>,
    _caller: Authorized<scope::PromptsRead>,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<Json<Trace>> {
    Ok(Json(traces::get_trace(&st, trace_id(&id)?).await?))
}

#[utoipa::path(post, path = "/v1/traces/{id}/feedback", tag = "traces", params(("id" = Uuid, Path)), request_body = Feedback,
    responses((status = 200, body = Trace), (status = 404, body = super::error::Problem)), security(("bearer" = ["traces:write"])))]
/// Attaches late feedback: the fields given replace the earlier ones.
pub async fn add_feedback(
    State(st): State<AppState>,
    _caller: Authorized<scope::TracesWrite>,
    ApiPath(id): ApiPath<String>,
    ApiJson(feedback): ApiJson<Feedback>,
) -> ApiResult<Json<Trace>> {
    let id = trace_id(&id)?;
    Ok(Json(traces::add_feedback(&st, id, feedback).await?))
}

/// Which failed traces to put back to pending: `ids`, or `all: true`; either
/// optionally narrowed by `since`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RequeueRequest {
    /// These traces of the prompt (at most 1000); ids of traces that are not `failed` are skipped.
    #[serde(default)]
    pub ids: Option<Vec<Uuid>>,
    /// Every failed trace of the prompt (instead of `ids`).
    #[serde(default)]
    pub all: bool,
    /// RFC 3339; only traces received at or after it.
    #[serde(default, deserialize_with = "crate::http::extract::bounded_time")]
    pub since: Option<DateTime<Utc>>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Requeued {
    /// The traces now pending again, oldest first.
    pub ids: Vec<Uuid>,
    pub count: usize,
}

#[utoipa::path(post, path = "/v1/prompts/{name}/traces/requeue", tag = "traces", params(("name" = String, Path)),
    request_body = RequeueRequest,
    responses((status = 200, body = Requeued),
        (status = 400, description = "the body is not JSON", body = super::error::Problem),
        (status = 403, description = "the key lacks `traces:write`", body = super::error::Problem),
        (status = 404, description = "no such prompt", body = super::error::Problem),
        (status = 422, description = "neither `ids` nor `all: true`, both, or too many ids", body = super::error::Problem)),
    security(("bearer" = ["traces:write"])))]
/// Puts `failed` traces back to `pending`, attempts reset, so the next round
/// learns from them again (e.g. after an LLM outage or a malformed answer
/// failed their rounds).
pub async fn requeue_failed(
    State(st): State<AppState>,
    caller: Authorized<scope::TracesWrite>,
    PathPrompt(name): PathPrompt,
    ApiJson(req): ApiJson<RequeueRequest>,
) -> ApiResult<(Audit, Json<Requeued>)> {
    let ids = traces::requeue_failed(&st, &name, req.ids, req.all, req.since, &caller.actor()).await?;
    Ok((Audit::new("traces.requeue", "prompt", &name), Json(Requeued { count: ids.len(), ids })))
}

/// Why an operator holds traces back.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct QuarantineRequest {
    /// Shown with the trace; at most 500 characters.
    #[serde(default)]
    #[schema(max_length = 500)]
    pub reason: Option<String>,
}

/// Holds a pending (or failed) trace back from learning: no round will reserve
/// it; it stays visible with status `quarantined`. Repeating it changes nothing.
#[utoipa::path(post, path = "/v1/traces/{id}/quarantine", tag = "traces", params(("id" = Uuid, Path)),
    request_body(content = Option<QuarantineRequest>, description = "optional; an empty body is allowed"),
    responses((status = 200, body = Trace), (status = 404, body = super::error::Problem),
        (status = 409, description = "reserved by a round in flight, or already consumed", body = super::error::Problem)),
    security(("bearer" = ["prompts:write"])))]
pub async fn quarantine_trace(
    State(st): State<AppState>,
    caller: Authorized<scope::PromptsWrite>,
    ApiPath(id): ApiPath<String>,
    req: Request,
) -> ApiResult<(Audit, Json<Trace>)> {
    let id = trace_id(&id)?;
    let q = optional_json::<QuarantineRequest>(req).await?.unwrap_or_default();
    let before = traces::get_trace(&st, id).await?;
    let after = traces::quarantine_trace(&st, id, q.reason, &caller.actor()).await?;
    Ok((audit::trace_change("trace.quarantine", &before, Some(&after)), Json(after)))
}

/// Lifts a trace's quarantine: it is learned from again (a pending trace
/// rejoins the backlog; a failed one stays failed until requeued). Repeating
/// it, or releasing a trace that is not quarantined, changes nothing.
#[utoipa::path(delete, path = "/v1/traces/{id}/quarantine", tag = "traces", params(("id" = Uuid, Path)),
    responses((status = 200, body = Trace), (status = 404, body = super::error::Problem)),
    security(("bearer" = ["prompts:write"])))]
pub async fn release_trace(
    State(st): State<AppState>,
    caller: Authorized<scope::PromptsWrite>,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<(Audit, Json<Trace>)> {
    let before = traces::get_trace(&st, trace_id(&id)?).await?;
    let after = traces::release_trace(&st, before.id, &caller.actor()).await?;
    Ok((audit::trace_change("trace.release", &before, Some(&after)), Json(after)))
}

/// Deletes a trace no version was learned from (pending, quarantined or failed).
#[utoipa::path(delete, path = "/v1/traces/{id}", tag = "traces", params(("id" = Uuid, Path)),
    responses((status = 204, description = "deleted"), (status = 404, body = super::error::Problem),
        (status = 409, description = "reserved by a round in flight, or already consumed", body = super::error::Problem)),
    security(("bearer" = ["prompts:write"])))]
pub async fn delete_trace(
    State(st): State<AppState>,
    caller: Authorized<scope::PromptsWrite>,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<(StatusCode, Audit)> {
    let before = traces::get_trace(&st, trace_id(&id)?).await?;
    traces::delete_trace(&st, before.id, &caller.actor()).await?;
    Ok((StatusCode::NO_CONTENT, audit::trace_change("trace.delete", &before, None)))
}

/// Which traces a bulk quarantine holds back: the unreserved pending traces of
/// one prompt, optionally only those received in `[since, until)`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct BulkQuarantine {
    /// The prompt's name within the key's project, or `project/name`.
    #[schema(pattern = "^([a-z0-9][a-z0-9._-]{0,63}/)?[a-z0-9][a-z0-9._-]{0,63}$")]
    pub prompt: String,
    /// RFC 3339; traces received at or after it.
    #[serde(default, deserialize_with = "crate::http::extract::bounded_time")]
    pub since: Option<DateTime<Utc>>,
    /// RFC 3339; traces received before it.
    #[serde(default, deserialize_with = "crate::http::extract::bounded_time")]
    pub until: Option<DateTime<Utc>>,
    #[serde(default)]
    #[schema(max_length = 500)]
    pub reason: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Quarantined {
    /// How many traces were quarantined by this request.
    pub quarantined: u64,
}

/// Quarantines every unreserved pending trace of a prompt (in a time window).
#[utoipa::path(post, path = "/v1/traces/quarantine", tag = "traces", request_body = BulkQuarantine,
    responses((status = 200, body = Quarantined), (status = 404, body = super::error::Problem)),
    security(("bearer" = ["prompts:write"])))]
pub async fn quarantine_traces(
    State(st): State<AppState>,
    caller: Authorized<scope::PromptsWrite>,
    ApiJson(q): ApiJson<BulkQuarantine>,
) -> ApiResult<(Audit, Json<Quarantined>)> {
    let quarantined =
        traces::quarantine_backlog(&st, &caller.reach(), &q.prompt, q.since, q.until, q.reason, &caller.actor())
            .await?;
    Ok((Audit::new("traces.quarantine", "prompt", &q.prompt), Json(Quarantined { quarantined })))
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: TraceLimits = TraceLimits { max_field_bytes: 64, max_trace_bytes: 400 };

    /// The quick reading of a body either gives what the careful one gives
    /// or leaves the body to it.
    #[test]
    fn well_formed_bodies_read_as_the_careful_reading_does() {
        let t = r#"{"prompt":"p","input":{"q":"a"}}"#;
        let full = r#"{"prompt":"p","prompt_version":2,"input":{"n":[1.0,2.5,{"m":-4.0}]},"trajectory":[{"s":3.0}],
            "output":"o","feedback":{"score":1.0,"success":true,"ground_truth":{"x":7.0},"comment":"c"},
            "reflection":{"r":1.0},"external_id":"e","metadata":{"tokens":12.0}}"#;
        let quick = [
            t.to_owned(),
            full.to_owned(),
            format!(r#"{{"traces":[{t},{full}]}}"#),
            format!(r#"{{"traces":[{t},{t},{t}]}}"#),
            r#"{"prompt":"p","input":1,"feedback":null,"trajectory":null}"#.to_owned(),
        ];
        let careful_only = [
            r#"{"prompt":"p","prompt_version":2.0,"input":1}"#.to_owned(),
            r#"["p", null, 1]"#.to_owned(),
            r#"{"traces":[["p", null, 1]]}"#.to_owned(),
            r#"{"prompt":"p","input":1,"feedback":[0.5, true]}"#.to_owned(),
            r#"{"traces":[]}"#.to_owned(),
            format!(r#"{{"traces":[{t},{t},{t},{t}]}}"#),
            format!(r#"{{"traces":[{t}],"extra":1}}"#),
            format!(r#"{{"traces":{t}}}"#),
            r#"{"prompt":"p","input":1,"input":2}"#.to_owned(),
            r#"{"prompt":"p","input":null}"#.to_owned(),
            r#"{"prompt":"p","input":1,"extra":1}"#.to_owned(),
            r#"{"prompt":"p","input":"a string longer than the sixty-four bytes this test allows in one field"}"#
                .to_owned(),
            r#"{"prompt":"p","input":1"#.to_owned(),
            "[]".to_owned(),
            r#"{"prompt":"p","input":{"q":"a\u0000b"}}"#.to_owned(),
            r#"{"prompt":"p","input":{"q\u0000":1}}"#.to_owned(),
            r#"{"prompt":"p","input":1,"external_id":"x\u0000"}"#.to_owned(),
            r#"{"prompt":"p","input":1,"feedback":{"comment":"\u0000"}}"#.to_owned(),
        ];
        for body in quick.iter().chain(&careful_only) {
            let careful = parse_with_paths(body.as_bytes(), LIMITS, 3, "default").ok();
            match parse_well_formed(body.as_bytes(), LIMITS, 3, "default") {
                Some(traces) => {
                    assert!(quick.contains(body), "read quickly, but meant for the careful reading: {body}");
                    assert_eq!(Some(traces), careful, "{body}");
                }
                None => assert!(careful_only.contains(body), "left to the careful reading: {body}"),
            }
        }
        let careful = parse_with_paths(full.as_bytes(), LIMITS, 3, "default").unwrap();
        assert_eq!(careful[0].input, serde_json::json!({"n": [1, 2.5, {"m": -4}]}));
        assert_eq!(careful[0].metadata, serde_json::json!({"tokens": 12}));
    }
}
