//! `GET /v1/prompts/{name}/labels/history`: the prompt's label history, newest
//! first — every label move with who or what made it and why (see
//! `domain::label_history`).

use axum::{Json, extract::State};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::{
    AppState,
    error::{ApiError, ApiResult},
    extract::{ApiQuery, Authorized, scope},
};
use crate::service::projects::PathPrompt;
use crate::{
    domain::{LabelHistoryEntry, LabelName},
    service::{
        labels,
        pagination::{PageParams, next_token},
        prompts::existing_prompt,
    },
};

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct HistoryFilter {
    /// Only the moves of this label.
    pub label: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct LabelHistoryPage {
    /// Newest first.
    pub moves: Vec<LabelHistoryEntry>,
    pub next_page_token: Option<String>,
}

#[utoipa::path(get, path = "/v1/prompts/{name}/labels/history", tag = "labels",
    params(("name" = String, Path), HistoryFilter, PageParams),
    responses((status = 200, body = LabelHistoryPage), (status = 404, body = super::error::Problem),
        (status = 422, description = "`label` is not a label name", body = super::error::Problem)),
    security(("bearer" = ["prompts:read"])))]
/// Every change of the prompt's labels since label history was recorded:
/// the kind (`create`, `promote`, `rollback`, `auto-publish`,
/// `guard-rollback`, `gate-promote`, `delete`), who or what made it, why, and the numbers.
pub async fn label_history(
    State(st): State<AppState>,
    _caller: Authorized<scope::PromptsRead>,
    PathPrompt(name): PathPrompt,
    ApiQuery(filter): ApiQuery<HistoryFilter>,
    ApiQuery(page): ApiQuery<PageParams>,
) -> ApiResult<Json<LabelHistoryPage>> {
    let prompt = existing_prompt(&st, &name).await?;
    let label = filter
        .label
        .as_deref()
        .map(|l| LabelName::parse(l).map_err(|e| ApiError::unprocessable(format!("`label`: {e}"))))
        .transpose()?;
    let before = match page.cursor()? {
        Some(c) => Some(c.parse::<i64>().map_err(|_| ApiError::bad_request("bad `page_token`".into()))?),
        None => None,
    };
    let size = page.size(st.settings.limits.max_page_size);
    let moves = labels::label_history(&st, &prompt.name, label.as_ref(), before, size).await?;
    let next_page_token = next_token(&moves, size, |m| m.id.to_string());
    Ok(Json(LabelHistoryPage { moves, next_page_token }))
}
