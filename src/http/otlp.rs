//! The OTLP/HTTP trace receiver (`POST /v1/otlp/v1/traces`): agents point an
//! OpenTelemetry exporter at `/v1/otlp` and their GenAI spans become traces
//! like those of `POST /v1/traces`, one per trace id even when its spans come
//! in several exports. Same key scope, same body limit; spans that cannot be
//! mapped are counted in `partial_success`.

use super::{
    AppState,
    error::{ApiError, ApiResult},
    extract::{Authorized, body_bytes, scope},
};
use crate::{
    domain::span::OtlpMerge,
    otlp::{
        self, DecodeError, Encoding,
        mapping::{self, Mapping, Rejection},
    },
    service::traces::{self, limits},
};
use axum::{
    extract::{Request, State},
    http::{HeaderValue, StatusCode, header},
    response::{IntoResponse, Response},
};

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
    _caller: Authorized<scope::TracesWrite>,
    req: Request,
) -> ApiResult<Response> {
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

    // Exporters retry a failed export with the same bytes, and may re-batch
    // spans: every span is stored once per (trace id, span id), so a retry
    // after any failure stores nothing twice and needs no idempotency key.
    let answer = ingest(&st, encoding, &request).await?;
    Ok(otlp_response(encoding, StatusCode::OK, answer))
}

/// Splits the export by trace id and merges each trace id's spans into its
/// pending trace (one store transaction per trace id; see
/// [`crate::store::OtlpStore::merge_otlp_spans`]), then encodes the answer.
/// A failure part-way is safe to retry: spans stored already are ignored.
async fn ingest(
    st: &AppState,
    encoding: Encoding,
    request: &opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest,
) -> ApiResult<Vec<u8>> {
    let (groups, rejected) = mapping::split_request(request);
    let max = st.settings.limits.max_traces_per_batch;
    if groups.len() > max {
        return Err(ApiError::payload_too_large(format!(
            "the export holds {} traces (trace ids); the limit is {max} (`limits.max_traces_per_batch`)",
            groups.len()
        )));
    }
    let limits = limits(st);
    let mut answer = Mapping { traces: Vec::new(), rejected };
    let mut held = Mapping::default();
    let (mut created, mut accepted_spans, mut duplicate_spans) = (0_u64, 0, 0);
    for group in groups {
        let remap = |bodies: &[&[u8]]| mapping::remap(&group.trace_id, bodies, limits);
        let trace_id = Some(group.trace_id.clone());
        // How many of the group's spans were new; the rest were stored before.
        let new = match traces::merge_spans(st, &group.trace_id, &group.spans, &remap).await? {
            OtlpMerge::Created { added, .. } => {
                created += 1;
                accepted_spans += added;
                added
            }
            OtlpMerge::Extended { added, .. } => {
                accepted_spans += added;
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
                        "its trace {trace} was already taken by a learning round; spans that arrive after that are not added"
                    ),
                });
                spans
            }
            OtlpMerge::Rejected { spans, reason } => {
                answer.rejected.push(Rejection { trace_id, spans, reason });
                spans
            }
        };
        duplicate_spans += group.spans.len().saturating_sub(new);
    }
    let rejected_spans = answer.rejected_spans();
    let held_spans = held.rejected_spans();
    metrics::counter!("combee_traces_ingested_total").increment(created);
    for (outcome, n) in [
        ("accepted", accepted_spans),
        ("rejected", rejected_spans),
        ("held", held_spans),
        ("duplicate", duplicate_spans),
    ] {
        metrics::counter!("combee_otlp_spans_total", "outcome" => outcome).increment(n as u64);
    }
    if rejected_spans > 0 {
        tracing::info!(created, rejected_spans, "OTLP export partly rejected");
    }
    // Held spans are not rejected: the answer only warns (OTLP's partial
    // success with 0 rejected spans and a message).
    let mut message = answer.error_message();
    if held_spans > 0 {
        let warning = format!(
            "{}. Held spans become a trace once the rest of their trace arrives (within `limits.idempotency_ttl_hours`)",
            held.summary("held")
        );
        message = if message.is_empty() { warning } else { format!("{message}. {warning}") };
    }
    Ok(otlp::encode_response(encoding, rejected_spans, &message))
}
