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
    /// Allowed to the caller's scopes, not to its reach (a project's key asking for a server-wide act).
    #[error("{0}")]
    Forbidden(String),
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
            ServiceError::Forbidden(_) => StatusCode::FORBIDDEN,
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

/// A serde error message in words for an API user: Rust type names
/// (`u32`, `i64`, `usize`, `f64`, `struct X`, `enum Y`…) become plain ones.
pub fn plain_serde_error(msg: &str) -> String {
    const WORDS: &[(&str, &str)] = &[
        ("u8", "a whole number from 0 to 255"),
        ("u16", "a whole number from 0 to 65535"),
        ("u32", "a whole number from 0 to 4294967295"),
        ("u64", "a non-negative whole number"),
        ("usize", "a non-negative whole number"),
        ("i8", "a whole number"),
        ("i16", "a whole number"),
        ("i32", "a whole number"),
        ("i64", "a whole number"),
        ("isize", "a whole number"),
        ("f32", "a number"),
        ("f64", "a number"),
        ("bool", "true or false"),
        ("a boolean", "true or false"),
        ("char", "a single character"),
    ];
    let mut out = msg.to_owned();
    // `expected u32`, `expected struct Foo`, `expected enum Bar`, `expected a sequence`…
    for (rust, plain) in WORDS {
        for lead in ["expected ", "expected an ", "expected a "] {
            let from = format!("{lead}{rust}");
            let mut rebuilt = String::with_capacity(out.len());
            let mut rest = out.as_str();
            while let Some(at) = rest.find(&from) {
                let after = &rest[at + from.len()..];
                let boundary = after.chars().next().is_none_or(|c| !(c.is_alphanumeric() || c == '_'));
                rebuilt.push_str(&rest[..at]);
                rebuilt.push_str(if boundary { "expected " } else { &from });
                if boundary {
                    rebuilt.push_str(plain);
                }
                rest = after;
            }
            rebuilt.push_str(rest);
            out = rebuilt;
        }
    }
    for (kind, plain) in
        [("struct ", "a JSON object"), ("enum ", "one of the documented values"), ("tuple struct ", "a value")]
    {
        while let Some(at) = out.find(&format!("expected {kind}")) {
            let start = at + "expected ".len();
            let name_end = out[start + kind.len()..]
                .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
                .map_or(out.len(), |e| start + kind.len() + e);
            out.replace_range(start..name_end, plain);
        }
    }
    out = out.replace("a sequence", "a JSON array").replace("a map", "a JSON object");
    out = out
        .replace("invalid type: integer", "invalid type: number")
        .replace("invalid type: floating point", "invalid type: number");
    out
}

#[cfg(test)]
mod tests {
    use super::plain_serde_error;

    #[test]
    fn serde_errors_lose_their_rust_type_names() {
        let cases = [
            (
                "invalid type: string \"x\", expected u32 at line 1 column 5",
                "expected a whole number from 0 to 4294967295",
            ),
            ("invalid value: integer `-1`, expected usize", "expected a non-negative whole number"),
            ("invalid type: map, expected f64", "expected a number"),
            ("invalid type: string \"a\", expected i64", "expected a whole number"),
            ("invalid type: integer `3`, expected struct PromptSettings", "expected a JSON object"),
            ("invalid type: null, expected a sequence", "expected a JSON array"),
            ("expected a boolean", "expected true or false"),
        ];
        for (raw, want) in cases {
            let got = plain_serde_error(raw);
            assert!(got.contains(want), "{raw:?} became {got:?}");
            for rust in ["u32", "usize", "f64", "i64", "struct ", "PromptSettings", "sequence"] {
                assert!(!got.contains(rust), "{raw:?} became {got:?}");
            }
        }
        // Words that merely start like a type name are left alone.
        assert_eq!(plain_serde_error("expected u32x"), "expected u32x");
        assert_eq!(plain_serde_error("unknown field `x`"), "unknown field `x`");
    }
}
