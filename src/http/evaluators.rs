//! Evaluator routes: read and replace a prompt's evaluators (validated by
//! `service::evaluators`), and their calibration against reported rewards.

use axum::{Json, extract::State};

use super::{
    AppState,
    error::ApiResult,
    extract::{ApiJson, Authorized, scope},
};
use crate::service::projects::PathPrompt;
use crate::service::{
    audit::Audit,
    evaluators::{self, Calibration, EvaluatorList},
};

/// The prompt's evaluators, in order (an empty list when it has none).
#[utoipa::path(get, path = "/v1/prompts/{name}/evaluators", tag = "evaluators", params(("name" = String, Path)),
    responses((status = 200, body = EvaluatorList), (status = 404, body = super::error::Problem)),
    security(("bearer" = ["prompts:read"])))]
pub async fn get_evaluators(
    State(st): State<AppState>,
    _caller: Authorized<scope::PromptsRead>,
    PathPrompt(name): PathPrompt,
) -> ApiResult<Json<EvaluatorList>> {
    Ok(Json(evaluators::get(&st, &name).await?))
}

/// Replaces the prompt's evaluators (an empty list removes them). The list
/// is checked whole: a bad regular expression or JSON Schema, an empty
/// rubric, a repeated name or more than the limits is a 422 saying which.
#[utoipa::path(put, path = "/v1/prompts/{name}/evaluators", tag = "evaluators", params(("name" = String, Path)),
    request_body = EvaluatorList,
    responses((status = 200, body = EvaluatorList), (status = 404, body = super::error::Problem),
        (status = 422, body = super::error::Problem)),
    security(("bearer" = ["prompts:write"])))]
pub async fn put_evaluators(
    State(st): State<AppState>,
    _caller: Authorized<scope::PromptsWrite>,
    PathPrompt(name): PathPrompt,
    ApiJson(list): ApiJson<EvaluatorList>,
) -> ApiResult<(Audit, Json<EvaluatorList>)> {
    let before = evaluators::get(&st, &name).await?;
    let after = evaluators::set(&st, &name, list).await?;
    Ok((Audit::new("prompt.evaluators.update", "prompt", &name).before(before), Json(after)))
}

/// Each evaluator's agreement (n, accuracy, Cohen's kappa) with the traces an
/// agent or an operator scored (pass: success, or score ≥ 0.5).
#[utoipa::path(get, path = "/v1/prompts/{name}/evaluators/calibration", tag = "evaluators",
    params(("name" = String, Path)),
    responses((status = 200, body = Calibration), (status = 404, body = super::error::Problem)),
    security(("bearer" = ["prompts:read"])))]
pub async fn get_calibration(
    State(st): State<AppState>,
    _caller: Authorized<scope::PromptsRead>,
    PathPrompt(name): PathPrompt,
) -> ApiResult<Json<Calibration>> {
    Ok(Json(evaluators::calibration(&st, &name).await?))
}
