//! The OTLP/HTTP trace receiver (`POST /v1/otlp/v1/traces`): agents point an
//! OpenTelemetry exporter at `/v1/otlp` and their GenAI spans become traces,
//! stored exactly as `POST /v1/traces` stores them. Same key scope, same body
//! limit; spans that cannot be mapped are counted in `partial_success`.

use std::collections::HashMap;

use axum::{
    extract::{Request, State},
    http::{HeaderValue, StatusCode, header},
    response::{IntoResponse, Response},
};
use sha2::{Digest, Sha256};

use super::{
    AppState,
    error::{ApiError, ApiResult, Problem},
    extract::{Caller, body_bytes},
    traces::limits,
};
use crate::{
    domain::PromptName,
    otlp::{
        self, DecodeError, Encoding,
        mapping::{self, Rejection},
    },
    store::{IdempotencyBegin, Scope, Selector},
};

fn decode_error(e: DecodeError) -> ApiError {
    if e.is_size() {
        ApiError::PayloadTooLarge(e.to_string())
    } else if e.is_media_type() {
        ApiError::UnsupportedMediaType(e.to_string())
    } else {
        ApiError::BadRequest(e.to_string())
    }
}

fn otlp_response(encoding: Encoding, status: StatusCode, body: Vec<u8>) -> Response {
    let mut res = (status, body).into_response();
    res.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static(encoding.content_type()));
    res
}

/// OTLP/HTTP export of spans (`ExportTraceServiceRequest`).
///
/// Send the body as `application/x-protobuf` or `application/json` (the OTLP
/// JSON encoding), optionally with `Content-Encoding: gzip` (or `deflate`). The answer is an
/// `ExportTraceServiceResponse` in the request's encoding; `partial_success`
/// says how many spans were rejected and why. An exporter's retry of the same
/// request is answered from the first attempt and stores nothing twice.
#[utoipa::path(post, path = "/v1/otlp/v1/traces", tag = "traces",
    request_body(content = Vec<u8>, description = "an OTLP `ExportTraceServiceRequest`",
        content(("application/x-protobuf"), ("application/json"))),
    params(("Content-Encoding" = Option<String>, Header, description = "`gzip`, `deflate` or absent; the inflated body is held to `limits.max_body_bytes` too")),
    responses(
        (status = 200, description = "an OTLP `ExportTraceServiceResponse` in the request's encoding, with `partial_success` when spans were rejected"),
        (status = 400, body = super::error::Problem, description = "the body is not a valid export request (bad protobuf, JSON or gzip)"),
        (status = 401, body = super::error::Problem), (status = 403, body = super::error::Problem),
        (status = 413, body = super::error::Problem, description = "the body (or inflated body) exceeds `limits.max_body_bytes`, or more than `limits.max_traces_per_batch` trace ids"),
        (status = 415, body = super::error::Problem, description = "neither protobuf nor JSON, or an unsupported `Content-Encoding`"),
        (status = 503, body = super::error::Problem, description = "the same export is still being processed (`Retry-After: 1`), or the store is unavailable"),
    ),
    security(("bearer" = ["traces:write"])))]
pub async fn export_traces(State(st): State<AppState>, caller: Caller, req: Request) -> ApiResult<Response> {
    caller.require(Scope::TracesWrite)?;
    let headers = req.headers();
    let encoding = Encoding::from_content_type(headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()))
        .map_err(decode_error)?;
    let content_encoding = match headers.get(header::CONTENT_ENCODING) {
        None => None,
        Some(v) => Some(
            v.to_str()
                .map_err(|_| {
                    ApiError::UnsupportedMediaType("`Content-Encoding` must be `gzip`, `deflate` or absent".into())
                })?
                .to_owned(),
        ),
    };
    let body = body_bytes(req).await?;
    let limit = st.settings.limits.max_body_bytes;
    let body = otlp::decompress(content_encoding.as_deref(), &body, limit).map_err(decode_error)?;
    let request = otlp::decode_request(encoding, &body).map_err(decode_error)?;

    // Exporters retry a failed export with the same bytes: the request's hash
    // is its idempotency key, so a retry replays the first answer.
    let hash = hex::encode(Sha256::digest(&body));
    let key = format!("otlp:{}:{hash}", encoding.as_str());
    let owner = caller.0.id;
    match st.store.idempotency_begin(owner, &key, &hash).await? {
        IdempotencyBegin::Replay { status, body } => {
            let mut res = otlp_response(encoding, StatusCode::from_u16(status).unwrap_or(StatusCode::OK), body);
            res.headers_mut().insert("idempotent-replayed", HeaderValue::from_static("true"));
            Ok(res)
        }
        IdempotencyBegin::InFlight | IdempotencyBegin::Mismatch => Ok(still_in_flight()),
        IdempotencyBegin::Started => match ingest(&st, encoding, &request).await {
            Ok(answer) => {
                st.store.idempotency_finish(owner, &key, StatusCode::OK.as_u16(), &answer).await?;
                Ok(otlp_response(encoding, StatusCode::OK, answer))
            }
            Err(e) => {
                if let Err(abort) = st.store.idempotency_abort(owner, &key).await {
                    tracing::warn!(error = %abort, "could not release an idempotency key");
                }
                Err(e)
            }
        },
    }
}

/// 503 with `Retry-After`: OTLP exporters retry 503 (not 409), and the retry
/// then gets the first attempt's answer — or, if that attempt failed, is
/// processed afresh — so no spans are dropped.
fn still_in_flight() -> Response {
    let problem = Problem {
        kind: "urn:combee:problem:in-flight".into(),
        title: "Service Unavailable".into(),
        status: StatusCode::SERVICE_UNAVAILABLE.as_u16(),
        detail: "the same export is still being processed; retry shortly".into(),
    };
    let mut res = (StatusCode::SERVICE_UNAVAILABLE, axum::Json(problem)).into_response();
    let h = res.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/problem+json"));
    h.insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    res
}

/// Maps, checks the prompts against the store, stores what is left in one
/// transaction, and encodes the answer.
async fn ingest(
    st: &AppState,
    encoding: Encoding,
    request: &opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest,
) -> ApiResult<Vec<u8>> {
    let mut mapping = mapping::map_request(request, limits(st));
    let max = st.settings.limits.max_traces_per_batch;
    if mapping.traces.len() > max {
        return Err(ApiError::PayloadTooLarge(format!(
            "the export holds {} traces (trace ids); the limit is {max} (`limits.max_traces_per_batch`)",
            mapping.traces.len()
        )));
    }
    // Only the store knows which prompts and versions exist.
    let mut latest: HashMap<PromptName, Option<i64>> = HashMap::new();
    for t in &mapping.traces {
        if !latest.contains_key(&t.trace.prompt) {
            let resolved = st.store.resolve(&t.trace.prompt, &Selector::Latest).await?;
            latest.insert(t.trace.prompt.clone(), resolved.map(|r| r.version.number));
        }
    }
    let mut accepted = Vec::with_capacity(mapping.traces.len());
    for t in std::mem::take(&mut mapping.traces) {
        let prompt = t.trace.prompt.as_str();
        let reason = match (latest.get(&t.trace.prompt).copied().flatten(), t.trace.prompt_version) {
            (None, _) => Some(format!("unknown prompt {prompt:?}; create it first (POST /v1/prompts)")),
            (Some(last), Some(v)) if v > last => {
                Some(format!("prompt {prompt:?} has no version {v} (the latest is {last})"))
            }
            _ => None,
        };
        match reason {
            Some(reason) => mapping.rejected.push(Rejection { trace_id: Some(t.trace_id), spans: t.spans, reason }),
            None => accepted.push(t),
        }
    }
    let accepted_spans: usize = accepted.iter().map(|t| t.spans).sum();
    let traces: Vec<_> = accepted.into_iter().map(|t| t.trace).collect();
    if !traces.is_empty() {
        st.store.insert_traces(&traces).await?;
    }
    let rejected_spans = mapping.rejected_spans();
    metrics::counter!("combee_traces_ingested_total").increment(traces.len() as u64);
    metrics::counter!("combee_otlp_spans_total", "outcome" => "accepted").increment(accepted_spans as u64);
    metrics::counter!("combee_otlp_spans_total", "outcome" => "rejected").increment(rejected_spans as u64);
    if rejected_spans > 0 {
        tracing::info!(traces = traces.len(), rejected_spans, "OTLP export partly rejected");
    }
    Ok(otlp::encode_response(encoding, rejected_spans, &mapping.error_message()))
}
