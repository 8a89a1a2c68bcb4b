//! `GET /v1/prompts/{name}/spend`: what combee's own LLM calls spent for a
//! prompt per UTC day, with its caps, the server's, and the daily cap holding
//! it back now. The caps are set through the settings route (`budget`).

use axum::{Json, extract::State};
use serde::Deserialize;
use utoipa::IntoParams;

use super::{
    AppState,
    error::{ApiError, ApiResult},
    extract::{ApiQuery, Authorized, scope},
};
use crate::service::projects::PathPrompt;
use crate::service::{
    budget::{self, MAX_SPEND_DAYS, SpendReport},
    prompts::existing_prompt,
};

#[derive(Debug, Default, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct SpendQuery {
    /// UTC days to read back, today included (default 7).
    #[param(minimum = 1, maximum = 366)]
    pub days: Option<u32>,
}

#[utoipa::path(get, path = "/v1/prompts/{name}/spend", tag = "prompts",
    params(("name" = String, Path), SpendQuery),
    responses(
        (status = 200, body = SpendReport),
        (status = 400, description = "`days` is not from 1 to 366", body = super::error::Problem),
        (status = 401, body = super::error::Problem),
        (status = 403, body = super::error::Problem),
        (status = 404, description = "No such prompt", body = super::error::Problem),
    ),
    security(("bearer" = ["prompts:read"])))]
/// The prompt's LLM spend per UTC day (tokens, US dollars, attempts, by kind
/// of call), its caps and the server's, and `reached` while a daily cap holds
/// its learning back.
pub async fn get_spend(
    State(st): State<AppState>,
    _caller: Authorized<scope::PromptsRead>,
    PathPrompt(name): PathPrompt,
    ApiQuery(q): ApiQuery<SpendQuery>,
) -> ApiResult<Json<SpendReport>> {
    let days = q.days.unwrap_or(7);
    if !(1..=MAX_SPEND_DAYS).contains(&days) {
        return Err(ApiError::bad_request(format!("`days` must be 1 to {MAX_SPEND_DAYS}; got {days}")));
    }
    let prompt = existing_prompt(&st, &name).await?;
    Ok(Json(budget::spend(&st, &prompt, days).await?))
}
