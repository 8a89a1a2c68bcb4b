//! `GET /v1/prompts/{name}/export`: a prompt's traces as a JSON Lines
//! download for training pipelines, streamed as it is read from the store
//! (see `service/export.rs` for the shapes and filters).

use axum::{
    body::Body,
    extract::State,
    http::{HeaderValue, header},
    response::{IntoResponse, Response},
};

use super::{
    AppState,
    error::ApiResult,
    extract::{ApiQuery, Authorized, scope},
};
use crate::service::export::{self, ExportRequest};
use crate::service::projects::PathPrompt;

/// A prompt's traces as JSON Lines, for fine-tuning and RL.
///
/// One record per line, oldest trace first, streamed in constant memory
/// (`Content-Type: application/x-ndjson`). A trace's reward is its
/// `feedback.score`, else 1 for `success: true` and 0 for `false`; with
/// `min_reward` or `max_reward`, traces without a reward are left out
/// (filters that cannot both hold match nothing). `chat`
/// and `reward` records carry the system prompt of the version the trace
/// ran with, so traces without a version or an output are left out of them
/// (and traces without a reward out of `reward`). Quarantined traces are
/// never exported. An export that fails part-way ends the download early
/// (the last line is then missing or cut): run it again.
#[utoipa::path(get, path = "/v1/prompts/{name}/export", tag = "traces",
    params(("name" = String, Path), ExportRequest),
    responses(
        (status = 200, description = "JSON Lines, one record per line", content_type = "application/x-ndjson", body = String),
        (status = 400, body = super::error::Problem, description = "a bad filter (a malformed time, number, label or format)"),
        (status = 404, body = super::error::Problem, description = "no such prompt or label, or the label does not point at `version`"),
    ),
    security(("bearer" = ["prompts:read"])))]
pub async fn export_traces(
    State(st): State<AppState>,
    _caller: Authorized<scope::PromptsRead>,
    PathPrompt(name): PathPrompt,
    ApiQuery(req): ApiQuery<ExportRequest>,
) -> ApiResult<Response> {
    let mut exporter = export::start(&st, &name, req).await?;
    let first = exporter.next_chunk().await?;
    let mut res = Body::from_stream(exporter.into_stream(first)).into_response();
    res.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/x-ndjson"));
    Ok(res)
}
