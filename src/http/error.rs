//! One error type for the whole API, rendered as RFC 9457
//! `application/problem+json`. Internal details are logged, never returned.

use axum::{
    http::{HeaderValue, StatusCode, header},
    response::{IntoResponse, Response},
};
use serde::Serialize;
use utoipa::ToSchema;

use crate::{domain::access::Scope, service::ServiceError};

/// What an API request can fail with: whatever the service layer says (the
/// web UI shows the same words with the same status), and what only HTTP has.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error(transparent)]
    Service(#[from] ServiceError),
    #[error("{0}")]
    Unauthorized(&'static str),
    #[error("this API key lacks the `{}` scope", .0.as_str())]
    Forbidden(Scope),
    #[error("this route does not accept that method")]
    MethodNotAllowed,
    #[error("{0}")]
    UnsupportedMediaType(String),
    #[error("the request took too long")]
    Timeout,
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
            ApiError::Service(e) => e.status(),
            ApiError::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            ApiError::Forbidden(_) => StatusCode::FORBIDDEN,
            ApiError::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::UnsupportedMediaType(_) => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ApiError::Timeout => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    fn slug(&self) -> &'static str {
        match self {
            ApiError::Service(e) => match e {
                ServiceError::BadRequest(_) => "bad-request",
                ServiceError::NotFound(_) => "not-found",
                ServiceError::Forbidden(_) => "forbidden",
                ServiceError::Conflict(_) => "conflict",
                ServiceError::PreconditionFailed(_) => "precondition-failed",
                ServiceError::PayloadTooLarge(_) => "payload-too-large",
                ServiceError::Unprocessable(_) => "unprocessable",
                ServiceError::Unavailable => "unavailable",
                ServiceError::Internal(_) => "internal",
            },
            ApiError::Unauthorized(_) => "unauthorized",
            ApiError::Forbidden(_) => "forbidden",
            ApiError::MethodNotAllowed => "method-not-allowed",
            ApiError::UnsupportedMediaType(_) => "unsupported-media-type",
            ApiError::Timeout => "timeout",
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

    /// A 404 saying "{what} not found".
    pub fn not_found(what: impl std::fmt::Display) -> Self {
        ServiceError::not_found(what).into()
    }

    /// A 404 with this message as it is.
    pub fn missing(message: String) -> Self {
        ServiceError::NotFound(message).into()
    }

    pub fn bad_request(message: String) -> Self {
        ServiceError::BadRequest(message).into()
    }

    pub fn conflict(message: String) -> Self {
        ServiceError::Conflict(message).into()
    }

    pub fn precondition_failed(message: String) -> Self {
        ServiceError::PreconditionFailed(message).into()
    }

    pub fn payload_too_large(message: String) -> Self {
        ServiceError::PayloadTooLarge(message).into()
    }

    pub fn unprocessable(message: String) -> Self {
        ServiceError::Unprocessable(message).into()
    }

    pub fn unavailable() -> Self {
        ServiceError::Unavailable.into()
    }

    /// A 500: the cause is logged, the answer says only "internal error".
    pub fn internal(cause: anyhow::Error) -> Self {
        ServiceError::Internal(cause).into()
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if let ApiError::Service(ServiceError::Internal(e)) = &self {
            tracing::error!(error = ?e, "request failed");
        }
        let problem = self.problem();
        let mut res = (self.status(), axum::Json(problem)).into_response();
        res.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/problem+json"));
        if matches!(self, ApiError::Unauthorized(_)) {
            res.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        if matches!(self, ApiError::Service(ServiceError::Unavailable) | ApiError::Timeout) {
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
        let outage = ServiceError::from(crate::store::StoreError::Unavailable(sqlx::Error::PoolTimedOut));
        let res = ApiError::from(outage).into_response();
        assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(res.headers()[header::RETRY_AFTER], "1");
        assert_eq!(res.headers()[header::CONTENT_TYPE], "application/problem+json");
        let bad_request = ApiError::bad_request("no".into()).into_response();
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
        assert_eq!(ApiError::internal(anyhow::anyhow!("secret detail")).problem().detail, "internal error");
    }
}
