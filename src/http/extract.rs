//! Request extractors whose every rejection is a problem document: JSON bodies
//! and query strings that explain what was wrong, and the bearer-key check.

use axum::{
    extract::{FromRequest, FromRequestParts, Path, Query, Request, rejection::JsonRejection},
    http::{StatusCode, request::Parts},
};
use serde::de::DeserializeOwned;

use super::{AppState, error::ApiError};
use crate::store::{ApiKey, Scope};

/// Shortens an attacker-influenced message before it goes into an answer.
fn clip(s: String) -> String {
    if s.len() <= 300 {
        return s;
    }
    let mut end = 300;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

/// `axum::Json`, with rejections as 400/413/415/422 problems.
pub struct ApiJson<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        match axum::Json::<T>::from_request(req, state).await {
            Ok(axum::Json(v)) => Ok(ApiJson(v)),
            Err(e) => Err(json_rejection(e)),
        }
    }
}

pub fn json_rejection(e: JsonRejection) -> ApiError {
    match e {
        JsonRejection::JsonDataError(e) => ApiError::Unprocessable(clip(e.body_text())),
        JsonRejection::JsonSyntaxError(e) => ApiError::BadRequest(clip(e.body_text())),
        JsonRejection::MissingJsonContentType(_) => {
            ApiError::UnsupportedMediaType("send the body as JSON with `Content-Type: application/json`".into())
        }
        JsonRejection::BytesRejection(e) if e.status() == StatusCode::PAYLOAD_TOO_LARGE => {
            ApiError::PayloadTooLarge("the request body exceeds `limits.max_body_bytes`".into())
        }
        other => ApiError::BadRequest(clip(other.body_text())),
    }
}

/// Reads a body as bytes with the size limit answered as a problem.
pub async fn body_bytes(req: Request) -> Result<axum::body::Bytes, ApiError> {
    axum::body::Bytes::from_request(req, &()).await.map_err(|e| {
        if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::PayloadTooLarge("the request body exceeds `limits.max_body_bytes`".into())
        } else {
            ApiError::BadRequest(clip(e.body_text()))
        }
    })
}

/// `axum::extract::Query` with 400 problems.
pub struct ApiQuery<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequestParts<S> for ApiQuery<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        Query::<T>::from_request_parts(parts, state)
            .await
            .map(|Query(v)| ApiQuery(v))
            .map_err(|e| ApiError::BadRequest(clip(e.body_text())))
    }
}

/// `axum::extract::Path` with 400 problems.
pub struct ApiPath<T>(pub T);

impl<T: DeserializeOwned + Send, S: Send + Sync> FromRequestParts<S> for ApiPath<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        Path::<T>::from_request_parts(parts, state)
            .await
            .map(|Path(v)| ApiPath(v))
            .map_err(|e| ApiError::BadRequest(clip(e.body_text())))
    }
}

/// The caller, authenticated by `Authorization: Bearer cmb_…`. A missing or bad
/// key is rejected with 401 — never treated as anonymous.
#[derive(Debug, Clone)]
pub struct Caller(pub std::sync::Arc<ApiKey>);

impl Caller {
    /// 403 unless the key has the scope (or `admin`).
    pub fn require(&self, scope: Scope) -> Result<(), ApiError> {
        if self.0.scopes.contains(&scope) || self.0.scopes.contains(&Scope::Admin) {
            Ok(())
        } else {
            Err(ApiError::Forbidden(scope))
        }
    }

    /// Who made a change, for version and label records.
    pub fn actor(&self) -> String {
        format!("key:{}", self.0.prefix)
    }
}

impl FromRequestParts<AppState> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, Self::Rejection> {
        let header = parts
            .headers
            .get(axum::http::header::AUTHORIZATION)
            .ok_or(ApiError::Unauthorized("send an API key as `Authorization: Bearer cmb_…`"))?;
        let token = header
            .to_str()
            .ok()
            .and_then(|h| h.strip_prefix("Bearer ").or_else(|| h.strip_prefix("bearer ")))
            .map(str::trim)
            .ok_or(ApiError::Unauthorized("the Authorization header must be `Bearer cmb_…`"))?;
        let key = state.keys.authenticate(token).await?.ok_or(ApiError::Unauthorized("unknown or revoked API key"))?;
        Ok(Caller(key))
    }
}
