//! Regression-set routes: a prompt's cases (add, list, delete, import from
//! JSON Lines), pinning a trace, the prompt's gate settings, a version's gate
//! and a harness's result on it. The rules are in `service/regression.rs` and
//! `service/gate.rs`.

use axum::{
    Json,
    body::Bytes,
    extract::State,
    http::StatusCode,
    response::{IntoResponse, Response},
};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};
use uuid::Uuid;

use super::{
    AppState,
    error::{ApiError, ApiResult},
    extract::{ApiJson, ApiPath, ApiQuery, Authorized, scope},
};
use crate::service::projects::PathPrompt;
use crate::{
    domain::regression::{Gate, RegressionCase},
    service::{
        audit::Audit,
        gate::{self, EvaluationResult, GateSettingsView},
        prompts::existing_prompt,
        regression::{self, CaseRequest, IdealStyle, PinRequest},
    },
};

#[derive(Debug, Serialize, ToSchema)]
pub struct CaseList {
    pub cases: Vec<RegressionCase>,
}

#[utoipa::path(post, path = "/v1/prompts/{name}/regression-cases", tag = "regression",
    params(("name" = String, Path)), request_body = CaseRequest,
    responses((status = 201, body = RegressionCase), (status = 404, body = super::error::Problem),
        (status = 422, body = super::error::Problem, description = "a bad case, or the set is full")),
    security(("bearer" = ["prompts:write"])))]
pub async fn add_case(
    State(st): State<AppState>,
    caller: Authorized<scope::PromptsWrite>,
    PathPrompt(name): PathPrompt,
    ApiJson(req): ApiJson<CaseRequest>,
) -> ApiResult<Response> {
    let case = regression::add_case(&st, &name, req, &caller.actor()).await?;
    let audit = Audit::new("regression_case.create", "regression_case", case.id);
    Ok((StatusCode::CREATED, audit, Json(case)).into_response())
}

/// The prompt's whole regression set, oldest first (a set holds at most
/// `regression.max_cases`, so it is one page).
#[utoipa::path(get, path = "/v1/prompts/{name}/regression-cases", tag = "regression",
    params(("name" = String, Path)),
    responses((status = 200, body = CaseList), (status = 404, body = super::error::Problem)),
    security(("bearer" = ["prompts:read"])))]
pub async fn list_cases(
    State(st): State<AppState>,
    _caller: Authorized<scope::PromptsRead>,
    PathPrompt(name): PathPrompt,
) -> ApiResult<Json<CaseList>> {
    Ok(Json(CaseList { cases: regression::list_cases(&st, &name).await? }))
}

#[utoipa::path(delete, path = "/v1/prompts/{name}/regression-cases/{id}", tag = "regression",
    params(("name" = String, Path), ("id" = Uuid, Path)),
    responses((status = 204, description = "deleted"), (status = 404, body = super::error::Problem)),
    security(("bearer" = ["prompts:write"])))]
pub async fn delete_case(
    State(st): State<AppState>,
    _caller: Authorized<scope::PromptsWrite>,
    PathPrompt(name): PathPrompt,
    ApiPath((_name, id)): ApiPath<(String, String)>,
) -> ApiResult<Response> {
    let id = Uuid::parse_str(&id).map_err(|_| ApiError::missing("no such case: ids are UUIDs".into()))?;
    // The audit entry's before-value is the one case deleted.
    let before = regression::get_case(&st, &name, id).await?;
    regression::delete_case(&st, &name, id).await?;
    let audit = Audit::new("regression_case.delete", "regression_case", id).before(before);
    Ok((StatusCode::NO_CONTENT, audit).into_response())
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ImportQuery {
    /// How an OpenAI Evals `ideal` becomes a check: `match` (default: the reply
    /// equals it) or `includes` (the reply contains it, ignoring case).
    #[param(inline)]
    pub ideal: Option<IdealStyle>,
}

/// Imports cases from JSON Lines, all or none.
///
/// Each line is a case as this API takes it (`{"name", "input", "checks"}`),
/// an OpenAI Evals sample (`{"input": messages or string, "ideal": string or
/// [strings]}`), or a record of combee's own trace export (`GET
/// /v1/prompts/{name}/export`; a successful trace, its output the example).
/// The first bad line is named by its number (422).
#[utoipa::path(post, path = "/v1/prompts/{name}/regression-cases/import", tag = "regression",
    params(("name" = String, Path), ImportQuery),
    request_body(content = String, content_type = "text/plain", description = "JSON Lines, one case per line (any content type: `application/x-ndjson`, `text/plain`)"),
    responses((status = 201, body = CaseList), (status = 404, body = super::error::Problem),
        (status = 422, body = super::error::Problem, description = "a bad line (named by its number), or the set is full")),
    security(("bearer" = ["prompts:write"])))]
pub async fn import_cases(
    State(st): State<AppState>,
    caller: Authorized<scope::PromptsWrite>,
    PathPrompt(name): PathPrompt,
    ApiQuery(q): ApiQuery<ImportQuery>,
    body: Bytes,
) -> ApiResult<Response> {
    let text = std::str::from_utf8(&body).map_err(|_| ApiError::bad_request("the body is not UTF-8 text".into()))?;
    let cases = regression::import(&st, &name, text, q.ideal.unwrap_or_default(), &caller.actor()).await?;
    let audit = Audit::new("regression_cases.import", "prompt", &name);
    Ok((StatusCode::CREATED, audit, Json(CaseList { cases })).into_response())
}

/// Pins a trace into its prompt's regression set: the trace's input is the
/// case's; the checks are the caller's, or (by default, for a trace whose
/// `feedback.success` is true) that the reply equals the trace's output.
#[utoipa::path(post, path = "/v1/traces/{id}/pin", tag = "regression", params(("id" = Uuid, Path)),
    request_body = PinRequest,
    responses((status = 201, body = RegressionCase), (status = 404, body = super::error::Problem),
        (status = 422, body = super::error::Problem, description = "no checks given for a trace that did not succeed")),
    security(("bearer" = ["prompts:write"])))]
pub async fn pin_trace(
    State(st): State<AppState>,
    caller: Authorized<scope::PromptsWrite>,
    ApiPath(id): ApiPath<String>,
    ApiJson(req): ApiJson<PinRequest>,
) -> ApiResult<Response> {
    let id = Uuid::parse_str(&id).map_err(|_| ApiError::missing("no such trace: ids are UUIDs".into()))?;
    let case = regression::pin_trace(&st, id, req, &caller.actor()).await?;
    let audit = Audit::new("regression_case.pin", "regression_case", case.id);
    Ok((StatusCode::CREATED, audit, Json(case)).into_response())
}

#[utoipa::path(get, path = "/v1/prompts/{name}/gate", tag = "regression", params(("name" = String, Path)),
    responses((status = 200, body = GateSettingsView), (status = 404, body = super::error::Problem)),
    security(("bearer" = ["prompts:read"])))]
pub async fn get_gate_settings(
    State(st): State<AppState>,
    _caller: Authorized<scope::PromptsRead>,
    PathPrompt(name): PathPrompt,
) -> ApiResult<Json<GateSettingsView>> {
    Ok(Json(gate::gate_settings(&st, &name).await?))
}

/// Sets how the prompt's learned versions are gated: `cases` (combee runs the
/// set, the default) or `harness` (a `version.evaluation_requested` webhook
/// to the operator's harness, whose result is awaited until the time limit).
#[utoipa::path(put, path = "/v1/prompts/{name}/gate", tag = "regression", params(("name" = String, Path)),
    request_body = GateSettingsView,
    responses((status = 200, body = GateSettingsView), (status = 404, body = super::error::Problem)),
    security(("bearer" = ["prompts:promote"])))]
pub async fn put_gate_settings(
    State(st): State<AppState>,
    _caller: Authorized<scope::PromptsPromote>,
    PathPrompt(name): PathPrompt,
    ApiJson(req): ApiJson<GateSettingsView>,
) -> ApiResult<(Audit, Json<GateSettingsView>)> {
    let before = gate::gate_settings(&st, &name).await?;
    let after = gate::set_gate_settings(&st, &name, req).await?;
    Ok((Audit::new("prompt.gate.update", "prompt", &name).before(before), Json(after)))
}

/// A version's regression gate: its state and, once decided, the verdict
/// with every case (the version's run beside production's).
#[utoipa::path(get, path = "/v1/prompts/{name}/versions/{number}/gate", tag = "regression",
    params(("name" = String, Path), ("number" = i64, Path)),
    responses((status = 200, body = Gate), (status = 404, body = super::error::Problem, description = "no such prompt, or the version was not gated")),
    security(("bearer" = ["prompts:read"])))]
pub async fn get_version_gate(
    State(st): State<AppState>,
    _caller: Authorized<scope::PromptsRead>,
    PathPrompt(name): PathPrompt,
    ApiPath((_name, number)): ApiPath<(String, i64)>,
) -> ApiResult<Json<Gate>> {
    let prompt = existing_prompt(&st, &name).await?;
    match gate::version_gate(&st, &prompt.name, number).await? {
        Some(g) => Ok(Json(g)),
        None => Err(ApiError::missing(format!("version {number} of {} was not gated", prompt.name))),
    }
}

/// The operator's harness posts its result on a version whose gate awaits it
/// (`version.evaluation_requested`). A pass exposes the version as the
/// prompt's policy says; a fail, or no answer by the deadline, rejects it.
#[utoipa::path(post, path = "/v1/prompts/{name}/versions/{number}/evaluation", tag = "regression",
    params(("name" = String, Path), ("number" = i64, Path)), request_body = EvaluationResult,
    responses((status = 200, body = Gate), (status = 404, body = super::error::Problem),
        (status = 409, body = super::error::Problem, description = "the gate is not awaiting a harness (decided, or past its deadline)")),
    security(("bearer" = ["prompts:promote"])))]
pub async fn post_evaluation(
    State(st): State<AppState>,
    caller: Authorized<scope::PromptsPromote>,
    PathPrompt(name): PathPrompt,
    ApiPath((_name, number)): ApiPath<(String, i64)>,
    ApiJson(req): ApiJson<EvaluationResult>,
) -> ApiResult<(Audit, Json<Gate>)> {
    let prompt = existing_prompt(&st, &name).await?;
    let before = gate::version_gate(&st, &prompt.name, number).await?;
    let after = gate::post_evaluation(&st, &name, number, req, &caller.actor()).await?;
    let audit = Audit::new("version.evaluation", "version", format!("{name}/{number}")).before(before);
    Ok((audit, Json(after)))
}
