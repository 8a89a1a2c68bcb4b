//! The batch-size controller route: one prompt's controller as operators see
//! it (`service::controller` builds the view).

use axum::{Json, extract::State};

use super::{
    AppState,
    error::ApiResult,
    extract::{Authorized, scope},
};
use crate::service::controller::{ControllerView, controller_view};
use crate::service::projects::PathPrompt;

#[utoipa::path(get, path = "/v1/prompts/{name}/controller", tag = "rounds", params(("name" = String, Path)),
    responses((status = 200, body = ControllerView), (status = 404, body = super::error::Problem)),
    security(("bearer" = ["prompts:read"])))]
pub async fn get_controller(
    State(st): State<AppState>,
    _caller: Authorized<scope::PromptsRead>,
    PathPrompt(name): PathPrompt,
) -> ApiResult<Json<ControllerView>> {
    Ok(Json(controller_view(&st, &name).await?))
}
