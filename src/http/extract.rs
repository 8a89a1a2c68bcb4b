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

/// `axum::Json`, with rejections as 400/413/415/422 problems.
pub struct ApiJson<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let mut value = match axum::Json::<serde_json::Value>::from_request(req, state).await {
            Ok(axum::Json(v)) => v,
            Err(e) => return Err(json_rejection(e)),
        };
        body_value(&mut value)?;
        serde_path_to_error::deserialize(value).map(ApiJson).map_err(|e| {
            let inner = plain_serde_error(&e.inner().to_string());
            let path = e.path().to_string();
            ApiError::unprocessable(clip(if path == "." { inner } else { format!("`{path}`: {inner}") }))
        })
    }
}

/// Every request body of this API is a JSON object. serde would also read a
/// struct from an array (`[1, 2]`), which no client means; refuse it. Numbers
/// written as integral floats (`3.0`) are integers, as JSON Schema says.
pub fn body_value(value: &mut serde_json::Value) -> Result<(), ApiError> {
    if !value.is_object() {
        return Err(ApiError::unprocessable("the body must be a JSON object".into()));
    }
    integral_floats_to_integers(value);
    Ok(())
}

fn integral_floats_to_integers(v: &mut serde_json::Value) {
    use serde_json::Value;
    match v {
        Value::Number(n) if n.is_f64() => {
            if let Some(f) = n.as_f64()
                && f.fract() == 0.0
                && f.abs() < 9.0e15
            {
                *v = Value::from(f as i64);
            }
        }
        Value::Array(a) => a.iter_mut().for_each(integral_floats_to_integers),
        Value::Object(o) => o.values_mut().for_each(integral_floats_to_integers),
        _ => {}
    }
}

pub fn json_rejection(e: JsonRejection) -> ApiError {
    match e {
        JsonRejection::JsonDataError(e) => ApiError::unprocessable(clip(plain_serde_error(&e.body_text()))),
        JsonRejection::JsonSyntaxError(e) => ApiError::bad_request(clip(plain_serde_error(&e.body_text()))),
        JsonRejection::MissingJsonContentType(_) => {
            ApiError::UnsupportedMediaType("send the body as JSON with `Content-Type: application/json`".into())
        }
        JsonRejection::BytesRejection(e) if e.status() == StatusCode::PAYLOAD_TOO_LARGE => {
            ApiError::payload_too_large("the request body exceeds `limits.max_body_bytes`".into())
        }
        other => ApiError::bad_request(clip(other.body_text())),
    }
}

/// Reads a body as bytes with the size limit answered as a problem.
pub async fn body_bytes(req: Request) -> Result<axum::body::Bytes, ApiError> {
    axum::body::Bytes::from_request(req, &()).await.map_err(|e| {
        if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::payload_too_large("the request body exceeds `limits.max_body_bytes`".into())
        } else {
            ApiError::bad_request(clip(e.body_text()))
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
            .map_err(|e| ApiError::bad_request(clip(plain_serde_error(&e.body_text()))))
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
            .map_err(|e| ApiError::bad_request(clip(plain_serde_error(&e.body_text()))))
    }
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
