//! Version routes: create a version by hand, list and read versions, and diff
//! two of them.

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
    extract::{ApiJson, ApiPath, ApiQuery, Caller},
    prompts::check_content,
};
use crate::{
    domain::{LabelName, Playbook, Strategy, Version, VersionSource, prompt::NewVersion},
    service::{
        pagination::{PageParams, next_token},
        prompts::{VersionDiff, add_version, check_message, existing_prompt, version_diff},
    },
    store::{LabelMove, Resolved, Scope, Selector},
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
}

impl From<Resolved> for VersionView {
    fn from(r: Resolved) -> Self {
        Self { text: r.version.content.render(), version: r.version, labels: r.labels }
    }
}

#[utoipa::path(post, path = "/v1/prompts/{name}/versions", tag = "versions", params(("name" = String, Path)),
    request_body = CreateVersion, responses((status = 201, body = VersionView), (status = 422, body = super::error::Problem)),
    security(("bearer" = ["prompts:write"])))]
pub async fn create_version(
    State(st): State<AppState>,
    caller: Caller,
    ApiPath(name): ApiPath<String>,
    ApiJson(req): ApiJson<CreateVersion>,
) -> ApiResult<Response> {
    caller.require(Scope::PromptsWrite)?;
    let prompt = existing_prompt(&st, &name).await?;
    let labels = req
        .labels
        .iter()
        .map(|l| LabelName::parse(l).map_err(|e| ApiError::unprocessable(e.to_string())))
        .collect::<ApiResult<Vec<_>>>()?;
    if !labels.is_empty() {
        caller.require(Scope::PromptsPromote)?;
    }
    let parent_sel = req.parent.map_or(Selector::Latest, Selector::Version);
    let parent = st
        .store
        .resolve(&prompt.name, &parent_sel)
        .await?
        .ok_or_else(|| ApiError::conflict(format!("parent version {} does not exist", req.parent.unwrap_or(0))))?
        .version;
    let req_has_playbook = req.playbook.is_some();
    let base = req.base.unwrap_or_else(|| parent.content.base.clone());
    let playbook = match req.playbook {
        Some(mut pb) => {
            // Ids the parent handed out are never reissued.
            pb.next_id = pb.next_id.max(parent.content.playbook.as_ref().map_or(0, |p| p.next_id));
            Some(pb)
        }
        None => parent.content.playbook.clone(),
    };
    if prompt.strategy == Strategy::Rewrite && req_has_playbook {
        return Err(ApiError::conflict("this prompt's strategy is `rewrite`: its versions have no playbook".into()));
    }
    let content = check_content(&st, prompt.strategy, &base, playbook)?;
    let version = NewVersion {
        parent: Some(parent.number),
        source: VersionSource::Manual,
        round_id: None,
        content,
        message: check_message(req.message, "manual edit")?,
        created_by: caller.actor(),
    };
    let moves: Vec<LabelMove> = labels
        .into_iter()
        .map(|label| LabelMove {
            label,
            to_version: 0,
            expected_current: None,
            check_current: false,
            by: caller.actor(),
        })
        .collect();
    let created = add_version(&st, &prompt.name, version, &moves).await?;
    let view = st
        .store
        .resolve(&prompt.name, &Selector::Version(created.number))
        .await?
        .ok_or_else(|| ApiError::internal(anyhow::anyhow!("version vanished after insert")))?;
    Ok((StatusCode::CREATED, Json(VersionView::from(view))).into_response())
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
    caller: Caller,
    ApiPath(name): ApiPath<String>,
    ApiQuery(page): ApiQuery<PageParams>,
) -> ApiResult<Json<VersionPage>> {
    caller.require(Scope::PromptsRead)?;
    let prompt = existing_prompt(&st, &name).await?;
    let before = match page.cursor()? {
        Some(c) => Some(c.parse::<i64>().map_err(|_| ApiError::bad_request("bad `page_token`".into()))?),
        None => None,
    };
    let size = page.size(st.settings.limits.max_page_size);
    let versions = st.store.list_versions(&prompt.name, before, size).await?;
    let next_page_token = next_token(&versions, size, |v| v.number.to_string());
    Ok(Json(VersionPage { versions, next_page_token }))
}

#[utoipa::path(get, path = "/v1/prompts/{name}/versions/{number}", tag = "versions",
    params(("name" = String, Path), ("number" = i64, Path)),
    responses((status = 200, body = VersionView), (status = 404, body = super::error::Problem)), security(("bearer" = ["prompts:read"])))]
pub async fn get_version(
    State(st): State<AppState>,
    caller: Caller,
    ApiPath((name, number)): ApiPath<(String, i64)>,
) -> ApiResult<Json<VersionView>> {
    caller.require(Scope::PromptsRead)?;
    let prompt = existing_prompt(&st, &name).await?;
    let r = st
        .store
        .resolve(&prompt.name, &Selector::Version(number))
        .await?
        .ok_or_else(|| ApiError::not_found(format_args!("version {number} of prompt {:?}", prompt.name)))?;
    Ok(Json(r.into()))
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
    caller: Caller,
    ApiPath(name): ApiPath<String>,
    ApiQuery(q): ApiQuery<DiffQuery>,
) -> ApiResult<Json<VersionDiff>> {
    caller.require(Scope::PromptsRead)?;
    let prompt = existing_prompt(&st, &name).await?;
    Ok(Json(version_diff(&st, &prompt, q.from, q.to).await?))
}
