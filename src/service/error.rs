//! How an operation of the service layer fails, in words both front ends
//! show as they are: the API as a problem document (`http::error::ApiError`),
//! the web UI as an error page. Internal details are logged, never shown.

use axum::http::StatusCode;

use crate::store::StoreError;

#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    #[error("{0}")]
    BadRequest(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    PreconditionFailed(String),
    #[error("{0}")]
    PayloadTooLarge(String),
    #[error("{0}")]
    Unprocessable(String),
    #[error("the store is unavailable; retry shortly")]
    Unavailable,
    #[error("internal error")]
    Internal(#[source] anyhow::Error),
}

impl ServiceError {
    pub fn not_found(what: impl std::fmt::Display) -> Self {
        ServiceError::NotFound(format!("{what} not found"))
    }

    /// The HTTP status both front ends answer this failure with.
    pub fn status(&self) -> StatusCode {
        match self {
            ServiceError::BadRequest(_) => StatusCode::BAD_REQUEST,
            ServiceError::NotFound(_) => StatusCode::NOT_FOUND,
            ServiceError::Conflict(_) => StatusCode::CONFLICT,
            ServiceError::PreconditionFailed(_) => StatusCode::PRECONDITION_FAILED,
            ServiceError::PayloadTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ServiceError::Unprocessable(_) => StatusCode::UNPROCESSABLE_ENTITY,
            ServiceError::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            ServiceError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }
}

impl From<StoreError> for ServiceError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::NotFound => ServiceError::NotFound("not found".into()),
            StoreError::AlreadyExists => ServiceError::Conflict("it already exists".into()),
            StoreError::Conflict => ServiceError::PreconditionFailed("the resource changed; fetch it again".into()),
            StoreError::Invalid(msg) => ServiceError::Unprocessable(msg),
            StoreError::Duplicate => ServiceError::Conflict("it was already processed".into()),
            StoreError::Unavailable(e) => {
                tracing::error!(error = %e, "store unavailable");
                ServiceError::Unavailable
            }
            other => ServiceError::Internal(other.into()),
        }
    }
}

pub type ServiceResult<T> = Result<T, ServiceError>;
