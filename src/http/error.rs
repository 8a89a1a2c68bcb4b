//! One error type for the whole API, rendered as RFC 9457
//! `application/problem+json`. Internal details are logged, never returned.

use axum::{
    http::{HeaderValue, StatusCode, header},
    response::{IntoResponse, Response},
};
use serde::Serialize;
use utoipa::ToSchema;

use crate::{
    service::ServiceError,
    store::{Scope, StoreError},
};

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("{0}")]
    BadRequest(String),
    #[error("{0}")]
    Unauthorized(&'static str),
    #[error("this API key lacks the `{}` scope", .0.as_str())]
    Forbidden(Scope),
    #[error("{0}")]
    NotFound(String),
    #[error("this route does not accept that method")]
    MethodNotAllowed,
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    PreconditionFailed(String),
    #[error("{0}")]
    PayloadTooLarge(String),
    #[error("{0}")]
    UnsupportedMediaType(String),
    #[error("{0}")]
    Unprocessable(String),
    #[error("the store is unavailable; retry shortly")]
    Unavailable,
    #[error("the request took too long")]
    Timeout,
    #[error("internal error")]
    Internal(#[source] anyhow::Error),
}

/// The RFC 9457 body.
#[derive(Debug, Serialize, ToSchema)]
pub struct Problem {
    /// A URI naming the kind of problem.
    #[serde(rename = "type")]
    pub kind: String,
    pub title: String,
    pub status: u16,
    pub detail: String,
}

impl ApiError {
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::BadRequest(_) => StatusCode::BAD_REQUEST,
            ApiError::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            ApiError::Forbidden(_) => StatusCode::FORBIDDEN,
            ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::Conflict(_) => StatusCode::CONFLICT,
            ApiError::PreconditionFailed(_) => StatusCode::PRECONDITION_FAILED,
            ApiError::PayloadTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::UnsupportedMediaType(_) => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ApiError::Unprocessable(_) => StatusCode::UNPROCESSABLE_ENTITY,
            ApiError::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Timeout => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    fn slug(&self) -> &'static str {
        match self {
            ApiError::BadRequest(_) => "bad-request",
            ApiError::Unauthorized(_) => "unauthorized",
            ApiError::Forbidden(_) => "forbidden",
            ApiError::NotFound(_) => "not-found",
            ApiError::MethodNotAllowed => "method-not-allowed",
            ApiError::Conflict(_) => "conflict",
            ApiError::PreconditionFailed(_) => "precondition-failed",
            ApiError::PayloadTooLarge(_) => "payload-too-large",
            ApiError::UnsupportedMediaType(_) => "unsupported-media-type",
            ApiError::Unprocessable(_) => "unprocessable",
            ApiError::Unavailable => "unavailable",
            ApiError::Timeout => "timeout",
            ApiError::Internal(_) => "internal",
        }
    }

    pub fn problem(&self) -> Problem {
        let status = self.status();
        Problem {
            kind: format!("urn:combee:problem:{}", self.slug()),
            title: status.canonical_reason().unwrap_or("Error").to_owned(),
            status: status.as_u16(),
            detail: self.to_string(),
        }
    }

    pub fn not_found(what: impl std::fmt::Display) -> Self {
        ApiError::NotFound(format!("{what} not found"))
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        ServiceError::from(e).into()
    }
}

impl From<ServiceError> for ApiError {
    fn from(e: ServiceError) -> Self {
        match e {
            ServiceError::BadRequest(m) => ApiError::BadRequest(m),
            ServiceError::NotFound(m) => ApiError::NotFound(m),
            ServiceError::Conflict(m) => ApiError::Conflict(m),
            ServiceError::PreconditionFailed(m) => ApiError::PreconditionFailed(m),
            ServiceError::PayloadTooLarge(m) => ApiError::PayloadTooLarge(m),
            ServiceError::Unprocessable(m) => ApiError::Unprocessable(m),
            ServiceError::Unavailable => ApiError::Unavailable,
            ServiceError::Internal(e) => ApiError::Internal(e),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if let ApiError::Internal(e) = &self {
            tracing::error!(error = ?e, "request failed");
        }
        let problem = self.problem();
        let mut res = (self.status(), axum::Json(problem)).into_response();
        res.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/problem+json"));
        if matches!(self, ApiError::Unauthorized(_)) {
            res.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        if matches!(self, ApiError::Unavailable | ApiError::Timeout) {
            // Outages here are store restarts and failovers: seconds, not minutes.
            res.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static(RETRY_AFTER_SECS));
        }
        res
    }
}

/// What a 503 asks the client to wait before retrying.
const RETRY_AFTER_SECS: &str = "1";

pub type ApiResult<T> = Result<T, ApiError>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_store_outage_is_503_with_retry_after() {
        let outage = StoreError::Unavailable(sqlx::Error::PoolTimedOut);
        let res = ApiError::from(outage).into_response();
        assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(res.headers()[header::RETRY_AFTER], "1");
        assert_eq!(res.headers()[header::CONTENT_TYPE], "application/problem+json");
        let bad_request = ApiError::BadRequest("no".into()).into_response();
        assert!(bad_request.headers().get(header::RETRY_AFTER).is_none());
    }

    /// The web UI shows a service failure with `ServiceError::status` and its
    /// message; the API must answer the same failure with the same status and words.
    #[test]
    fn the_api_answers_a_service_failure_as_the_ui_shows_it() {
        let failures = || {
            vec![
                ServiceError::BadRequest("bad".into()),
                ServiceError::NotFound("prompt \"x\" not found".into()),
                ServiceError::Conflict("in flight".into()),
                ServiceError::PreconditionFailed("moved".into()),
                ServiceError::PayloadTooLarge("long".into()),
                ServiceError::Unprocessable("invalid".into()),
                ServiceError::Unavailable,
                ServiceError::Internal(anyhow::anyhow!("secret detail")),
            ]
        };
        for (shown, answered) in failures().into_iter().zip(failures().into_iter().map(ApiError::from)) {
            assert_eq!(answered.status(), shown.status(), "{shown:?}");
            assert_eq!(answered.problem().detail, shown.to_string(), "{shown:?}");
        }
        assert_eq!(
            ApiError::from(ServiceError::Internal(anyhow::anyhow!("secret detail"))).problem().detail,
            "internal error"
        );
    }
}
