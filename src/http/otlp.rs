//! The OTLP/HTTP receivers (`POST /v1/otlp/v1/traces` and `/v1/otlp/v1/logs`):
//! agents point an OpenTelemetry exporter at `/v1/otlp` and their GenAI spans
//! and log events become traces like those of `POST /v1/traces`, one per
//! trace id even when its records come in several exports. Same key scope,
//! same body limit; records that cannot be mapped are counted in
//! `partial_success`. This file decodes the export and renders the answer;
//! the merge and its accounting are `service::traces::ingest_otlp`.

use super::{
    AppState,
    error::{ApiError, ApiResult},
    extract::{Authorized, body_bytes, scope},
};
use crate::{
    domain::access::Reach,
    otlp::{self, DecodeError, Encoding, Signal, mapping},
    service::traces,
};
use axum::{
    extract::{Request, State},
    http::{HeaderValue, StatusCode, header},
    response::{IntoResponse, Response},
};
use opentelemetry_proto::tonic::collector::{logs::v1::ExportLogsServiceRequest, trace::v1::ExportTraceServiceRequest};

fn decode_error(e: DecodeError) -> ApiError {
    if e.is_size() {
        ApiError::payload_too_large(e.to_string())
    } else if e.is_media_type() {
        ApiError::UnsupportedMediaType(e.to_string())
    } else {
        ApiError::bad_request(e.to_string())
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
/// says how many spans were rejected and why (or, with 0 rejected, warns that
/// spans are held until the rest of their trace arrives). The spans of one
/// trace id become one pending trace across exports; a span already stored is
/// ignored, so retries in any batching store nothing twice; spans arriving
/// after a round took their trace are rejected.
#[utoipa::path(post, path = "/v1/otlp/v1/traces", tag = "traces",
    request_body(content = Vec<u8>, description = "an OTLP `ExportTraceServiceRequest`; with `Content-Encoding: gzip` or `deflate` it may be compressed (the inflated body is held to `limits.max_body_bytes` too)",
        content(("application/x-protobuf"), ("application/json"))),
    responses(
        (status = 200, description = "an OTLP `ExportTraceServiceResponse` in the request's encoding, with `partial_success` when spans were rejected or are held"),
        (status = 400, body = super::error::Problem, description = "the body is not a valid export request (bad protobuf, JSON or gzip)"),
        (status = 401, body = super::error::Problem), (status = 403, body = super::error::Problem),
        (status = 413, body = super::error::Problem, description = "the body (or inflated body) exceeds `limits.max_body_bytes`, or more than `limits.max_traces_per_batch` trace ids"),
        (status = 415, body = super::error::Problem, description = "neither protobuf nor JSON, or an unsupported `Content-Encoding`"),
        (status = 503, body = super::error::Problem, description = "the store is unavailable (`Retry-After`); retrying the same export is safe"),
    ),
    security(("bearer" = ["traces:write"])))]
pub async fn export_traces(
    State(st): State<AppState>,
    caller: Authorized<scope::TracesWrite>,
    req: Request,
) -> ApiResult<Response> {
    handle_export(&st, &caller.reach(), Signal::Traces, req).await
}

/// OTLP/HTTP export of log records (`ExportLogsServiceRequest`).
///
/// GenAI events sent as log records — the content of model calls
/// (`gen_ai.client.inference.operation.details`, or the older
/// `gen_ai.*.message` and `gen_ai.choice` events) and evaluation results
/// (`gen_ai.evaluation.result`) — join their trace by trace id and their span
/// by span id, under the same merge, hold and late-arrival rules as spans.
/// Same encodings, compression, limits and key scope as the span export; log
/// records that are no GenAI events, or carry no trace id, are rejected in
/// `partial_success`. A retry of the same records stores nothing twice.
#[utoipa::path(post, path = "/v1/otlp/v1/logs", tag = "traces",
    request_body(content = Vec<u8>, description = "an OTLP `ExportLogsServiceRequest`; with `Content-Encoding: gzip` or `deflate` it may be compressed (the inflated body is held to `limits.max_body_bytes` too)",
        content(("application/x-protobuf"), ("application/json"))),
    responses(
        (status = 200, description = "an OTLP `ExportLogsServiceResponse` in the request's encoding, with `partial_success` when log records were rejected or are held"),
        (status = 400, body = super::error::Problem, description = "the body is not a valid export request (bad protobuf, JSON or gzip)"),
        (status = 401, body = super::error::Problem), (status = 403, body = super::error::Problem),
        (status = 413, body = super::error::Problem, description = "the body (or inflated body) exceeds `limits.max_body_bytes`, or more than `limits.max_traces_per_batch` trace ids"),
        (status = 415, body = super::error::Problem, description = "neither protobuf nor JSON, or an unsupported `Content-Encoding`"),
        (status = 503, body = super::error::Problem, description = "the store is unavailable (`Retry-After`); retrying the same export is safe"),
    ),
    security(("bearer" = ["traces:write"])))]
pub async fn export_logs(
    State(st): State<AppState>,
    caller: Authorized<scope::TracesWrite>,
    req: Request,
) -> ApiResult<Response> {
    handle_export(&st, &caller.reach(), Signal::Logs, req).await
}

/// Decodes an export of `signal` (the caller's key is checked already) and
/// ingests it for a caller of `reach`: shared by the OTLP routes and the Langfuse alias.
pub(super) async fn handle_export(st: &AppState, reach: &Reach, signal: Signal, req: Request) -> ApiResult<Response> {
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
    let (groups, rejected) = match signal {
        Signal::Traces => {
            let request: ExportTraceServiceRequest =
                otlp::decode_export(signal, encoding, &body).map_err(decode_error)?;
            mapping::split_request(&request)
        }
        Signal::Logs => {
            let request: ExportLogsServiceRequest =
                otlp::decode_export(signal, encoding, &body).map_err(decode_error)?;
            otlp::logs::split_request(&request)
        }
    };
    // Exporters retry a failed export with the same bytes, and may re-batch
    // records: every record is stored once per (trace id, record key), so a
    // retry after any failure stores nothing twice and needs no idempotency key.
    let answer = traces::ingest_otlp(st, reach, signal, groups, rejected).await?;
    Ok(otlp_response(encoding, StatusCode::OK, otlp::encode_answer(signal, encoding, answer.rejected, &answer.message)))
}
