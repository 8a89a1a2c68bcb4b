//! Projects over HTTP: list (a project's key sees its own), create (a
//! server-wide admin key), read, and change a project's settings (the
//! project's or a server-wide admin key). Another project answers 404.

use axum::{Json, extract::State, http::StatusCode, response::IntoResponse};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::{
    AppState,
    error::ApiResult,
    extract::{ApiJson, ApiPath, Authorized, scope},
};
use crate::{
    domain::project::{Project, ProjectSettings},
    service::{audit::Audit, projects},
};

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateProject {
    /// `[a-z0-9][a-z0-9._-]{0,63}`, as a prompt name.
    #[schema(pattern = "^[a-z0-9][a-z0-9._-]{0,63}$")]
    pub name: String,
    #[serde(default)]
    pub settings: Option<ProjectSettings>,
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct UpdateProject {
    /// The project's settings, replaced whole.
    pub settings: ProjectSettings,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ProjectList {
    pub projects: Vec<Project>,
}

#[utoipa::path(get, path = "/v1/projects", tag = "projects", responses((status = 200, body = ProjectList)),
    security(("bearer" = ["prompts:read"])))]
pub async fn list_projects(
    State(st): State<AppState>,
    caller: Authorized<scope::PromptsRead>,
) -> ApiResult<Json<ProjectList>> {
    Ok(Json(ProjectList { projects: projects::list(&st, &caller.reach()).await? }))
}

#[utoipa::path(post, path = "/v1/projects", tag = "projects", request_body = CreateProject,
    responses((status = 201, body = Project), (status = 409, body = super::error::Problem)),
    security(("bearer" = ["admin"])))]
pub async fn create_project(
    State(st): State<AppState>,
    caller: Authorized<scope::Admin>,
    ApiJson(req): ApiJson<CreateProject>,
) -> ApiResult<impl IntoResponse> {
    let project = projects::create(&st, &caller.reach(), &req.name, req.settings.unwrap_or_default()).await?;
    let audit = Audit::new("project.create", "project", &project.name).in_project(Some(project.name.clone()));
    Ok((StatusCode::CREATED, audit, Json(project)))
}

#[utoipa::path(get, path = "/v1/projects/{name}", tag = "projects", params(("name" = String, Path)),
    responses((status = 200, body = Project), (status = 404, body = super::error::Problem)),
    security(("bearer" = ["prompts:read"])))]
pub async fn get_project(
    State(st): State<AppState>,
    caller: Authorized<scope::PromptsRead>,
    ApiPath(name): ApiPath<String>,
) -> ApiResult<Json<Project>> {
    Ok(Json(projects::existing(&st, &caller.reach(), &name).await?))
}

#[utoipa::path(patch, path = "/v1/projects/{name}", tag = "projects", params(("name" = String, Path)),
    request_body = UpdateProject,
    responses((status = 200, body = Project), (status = 404, body = super::error::Problem)),
    security(("bearer" = ["admin"])))]
pub async fn update_project(
    State(st): State<AppState>,
    caller: Authorized<scope::Admin>,
    ApiPath(name): ApiPath<String>,
    ApiJson(req): ApiJson<UpdateProject>,
) -> ApiResult<impl IntoResponse> {
    let (before, after) = projects::update_settings(&st, &caller.reach(), &name, req.settings).await?;
    let audit = Audit::new("project.update", "project", &name).before(before).in_project(Some(name.clone()));
    Ok((audit, Json(after)))
}
