//! API key administration over HTTP (scope `admin`); the same as `combee keys`.
//! A project's admin key administers its project's keys only.

use crate::service::audit::Audit;
use axum::{Json, extract::State, http::StatusCode, response::IntoResponse};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::{
    AppState,
    error::ApiResult,
    extract::{ApiJson, ApiPath, Authorized, scope},
};
use crate::{
    domain::access::{ApiKey, Scope},
    service::keys,
};

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateKey {
    pub name: String,
    pub scopes: Vec<Scope>,
    /// The project the key acts in. Absent: the calling key's own project, or
    /// server-wide for a server-wide key (only a server-wide key mints one).
    #[serde(default)]
    pub project: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct KeyCreated {
    #[serde(flatten)]
    pub key: ApiKey,
    /// The secret. Shown once; only its hash is stored.
    pub secret: String,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct KeyList {
    pub keys: Vec<ApiKey>,
}

#[utoipa::path(post, path = "/v1/keys", tag = "keys", request_body = CreateKey,
    responses((status = 201, body = KeyCreated), (status = 404, body = super::error::Problem)), security(("bearer" = ["admin"])))]
pub async fn create_key(
    State(st): State<AppState>,
    caller: Authorized<scope::Admin>,
    ApiJson(req): ApiJson<CreateKey>,
) -> ApiResult<impl IntoResponse> {
    let (key, secret) = keys::create(&st, &caller.reach(), &req.name, &req.scopes, req.project.as_deref()).await?;
    // The key without its secret: the answer shows the secret once, the log never.
    let audit = Audit::new("key.create", "key", key.id).after(&key).in_project(key.project.clone());
    Ok((StatusCode::CREATED, audit, Json(KeyCreated { key, secret })))
}

#[utoipa::path(get, path = "/v1/keys", tag = "keys", responses((status = 200, body = KeyList)), security(("bearer" = ["admin"])))]
pub async fn list_keys(State(st): State<AppState>, caller: Authorized<scope::Admin>) -> ApiResult<Json<KeyList>> {
    Ok(Json(KeyList { keys: keys::list(&st, &caller.reach()).await? }))
}

#[utoipa::path(delete, path = "/v1/keys/{id}", tag = "keys", params(("id" = String, Path, description = "key id or visible prefix")),
    responses((status = 204), (status = 404, body = super::error::Problem)), security(("bearer" = ["admin"])))]
pub async fn revoke_key(
    State(st): State<AppState>,
    caller: Authorized<scope::Admin>,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<(StatusCode, Audit)> {
    let before = keys::revoke(&st, &caller.reach(), &id).await?;
    let project = before.project.clone();
    Ok((StatusCode::NO_CONTENT, Audit::new("key.revoke", "key", before.id).before(before).in_project(project)))
}
