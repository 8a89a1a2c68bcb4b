//! API key administration over HTTP (scope `admin`); the same as `combee keys`.

use axum::{Json, extract::State, http::StatusCode, response::IntoResponse};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::{
    AppState,
    error::{ApiError, ApiResult},
    extract::{ApiJson, ApiPath, Caller},
};
use crate::{
    auth,
    store::{ApiKey, Scope},
};

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateKey {
    pub name: String,
    pub scopes: Vec<Scope>,
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
    responses((status = 201, body = KeyCreated)), security(("bearer" = ["admin"])))]
pub async fn create_key(
    State(st): State<AppState>,
    caller: Caller,
    ApiJson(req): ApiJson<CreateKey>,
) -> ApiResult<impl IntoResponse> {
    caller.require(Scope::Admin)?;
    if req.name.trim().is_empty() || req.name.chars().count() > 100 {
        return Err(ApiError::unprocessable("`name` must be 1..=100 characters".into()));
    }
    if req.scopes.is_empty() {
        return Err(ApiError::unprocessable("give at least one scope".into()));
    }
    let (key, secret) = auth::create_key(&st.store, req.name.trim(), &req.scopes).await?;
    Ok((StatusCode::CREATED, Json(KeyCreated { key, secret })))
}

#[utoipa::path(get, path = "/v1/keys", tag = "keys", responses((status = 200, body = KeyList)), security(("bearer" = ["admin"])))]
pub async fn list_keys(State(st): State<AppState>, caller: Caller) -> ApiResult<Json<KeyList>> {
    caller.require(Scope::Admin)?;
    Ok(Json(KeyList { keys: st.store.list_api_keys().await? }))
}

#[utoipa::path(delete, path = "/v1/keys/{id}", tag = "keys", params(("id" = String, Path, description = "key id or visible prefix")),
    responses((status = 204), (status = 404, body = super::error::Problem)), security(("bearer" = ["admin"])))]
pub async fn revoke_key(
    State(st): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<StatusCode> {
    caller.require(Scope::Admin)?;
    if !st.store.revoke_api_key(&id).await? {
        return Err(ApiError::not_found("active key"));
    }
    st.keys.clear();
    Ok(StatusCode::NO_CONTENT)
}
