//! Version routes: create a version by hand, list and read versions, and diff
//! two of them.

use crate::service::audit::Audit;
use axum::{
    Json,
    extract::State,
    http::StatusCode,
    response::{IntoResponse, Response},
};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::{
    AppState,
    error::{ApiError, ApiResult},
    extract::{ApiJson, ApiPath, ApiQuery, Authorized, scope},
};
use crate::service::projects::PathPrompt;
use crate::{
    domain::{
        LabelName, Playbook, Version,
        access::Scope,
        label::{Resolved, Selector},
        regression::Gate,
    },
    service::{
        gate,
        pagination::{PageParams, next_token},
        prompts::{self, VersionDiff, VersionEdit, existing_prompt, version_diff},
    },
};

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateVersion {
    /// New base text (default: the parent's).
    #[serde(default)]
    pub base: Option<String>,
    /// New playbook (default: the parent's).
    #[serde(default)]
    pub playbook: Option<Playbook>,
    #[serde(default)]
    pub message: Option<String>,
    /// The version this edit starts from (default: the latest).
    #[serde(default)]
    pub parent: Option<i64>,
    /// Labels to point at the new version (needs `prompts:promote`).
    #[serde(default)]
    pub labels: Vec<String>,
}

/// A version with its rendered text and labels.
#[derive(Debug, Serialize, ToSchema)]
pub struct VersionView {
    #[serde(flatten)]
    pub version: Version,
    pub text: String,
    #[schema(value_type = Vec<String>)]
    pub labels: Vec<LabelName>,
    /// The version's regression gate, when it was gated (learned versions of a
    /// prompt with a regression set or a harness).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gate: Option<Gate>,
}

impl From<Resolved> for VersionView {
    fn from(r: Resolved) -> Self {
        Self { text: r.version.content.render(), version: r.version, labels: r.labels, gate: None }
    }
}

#[utoipa::path(post, path = "/v1/prompts/{name}/versions", tag = "versions", params(("name" = String, Path)),
    request_body = CreateVersion, responses((status = 201, body = VersionView), (status = 422, body = super::error::Problem)),
    security(("bearer" = ["prompts:write"])))]
pub async fn create_version(
    State(st): State<AppState>,
    caller: Authorized<scope::PromptsWrite>,
    PathPrompt(name): PathPrompt,
    ApiJson(req): ApiJson<CreateVersion>,
) -> ApiResult<Response> {
    let prompt = existing_prompt(&st, &name).await?;
    let labels = req
        .labels
        .iter()
        .map(|l| LabelName::parse(l).map_err(|e| ApiError::unprocessable(e.to_string())))
        .collect::<ApiResult<Vec<_>>>()?;
    if !labels.is_empty() {
        caller.require(Scope::PromptsPromote)?;
    }
    let edit = VersionEdit { base: req.base, playbook: req.playbook, message: req.message, parent: req.parent, labels };
    let view = prompts::create_version(&st, &prompt, edit, &caller.actor()).await?;
    let audit = Audit::new("version.create", "version", format!("{}/{}", prompt.name, view.version.number));
    Ok((StatusCode::CREATED, audit, Json(VersionView::from(view))).into_response())
}

#[derive(Debug, Serialize, ToSchema)]
pub struct VersionPage {
    pub versions: Vec<Version>,
    pub next_page_token: Option<String>,
}

#[utoipa::path(get, path = "/v1/prompts/{name}/versions", tag = "versions", params(("name" = String, Path), PageParams),
    responses((status = 200, body = VersionPage)), security(("bearer" = ["prompts:read"])))]
pub async fn list_versions(
    State(st): State<AppState>,
    _caller: Authorized<scope::PromptsRead>,
    PathPrompt(name): PathPrompt,
    ApiQuery(page): ApiQuery<PageParams>,
) -> ApiResult<Json<VersionPage>> {
    let prompt = existing_prompt(&st, &name).await?;
    let before = match page.cursor()? {
        Some(c) => Some(c.parse::<i64>().map_err(|_| ApiError::bad_request("bad `page_token`".into()))?),
        None => None,
    };
    let size = page.size(st.settings.limits.max_page_size);
    let versions = prompts::list_versions(&st, &prompt.name, before, size).await?;
    let next_page_token = next_token(&versions, size, |v| v.number.to_string());
    Ok(Json(VersionPage { versions, next_page_token }))
}

#[utoipa::path(get, path = "/v1/prompts/{name}/versions/{number}", tag = "versions",
    params(("name" = String, Path), ("number" = i64, Path)),
    responses((status = 200, body = VersionView), (status = 404, body = super::error::Problem)), security(("bearer" = ["prompts:read"])))]
pub async fn get_version(
    State(st): State<AppState>,
    _caller: Authorized<scope::PromptsRead>,
    PathPrompt(name): PathPrompt,
    ApiPath((_name, number)): ApiPath<(String, i64)>,
) -> ApiResult<Json<VersionView>> {
    let prompt = existing_prompt(&st, &name).await?;
    let mut view = VersionView::from(prompts::resolved(&st, &prompt.name, &Selector::Version(number)).await?);
    view.gate = gate::version_gate(&st, &prompt.name, number).await?;
    Ok(Json(view))
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct DiffQuery {
    pub from: i64,
    pub to: i64,
}

#[utoipa::path(get, path = "/v1/prompts/{name}/diff", tag = "versions", params(("name" = String, Path), DiffQuery),
    responses((status = 200, body = VersionDiff), (status = 404, body = super::error::Problem)), security(("bearer" = ["prompts:read"])))]
pub async fn diff_versions(
    State(st): State<AppState>,
    _caller: Authorized<scope::PromptsRead>,
    PathPrompt(name): PathPrompt,
    ApiQuery(q): ApiQuery<DiffQuery>,
) -> ApiResult<Json<VersionDiff>> {
    let prompt = existing_prompt(&st, &name).await?;
    Ok(Json(version_diff(&st, &prompt, q.from, q.to).await?))
}
