//! Request extractors whose every rejection is a problem document: JSON bodies,
//! query strings and path parameters that explain what was wrong, and the
//! bearer-key check with the route's scope and the reach check of what the
//! path names ([`Authorized`]), which run before any of them.

use std::{marker::PhantomData, sync::Arc};

use axum::{
    extract::{
        FromRequest, FromRequestParts, Path, Query, RawPathParams, Request,
        path::ErrorKind,
        rejection::{JsonRejection, PathRejection},
    },
    http::{StatusCode, request::Parts},
};
use serde::de::DeserializeOwned;

use super::{AppState, error::ApiError};
use crate::service::plain_serde_error;
use crate::{
    domain::{
        access::{ApiKey, Reach, Scope},
        audit::Actor,
    },
    service::{audit::AuditSlot, keys, projects},
};

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
    if let Some(path) = nul_at(value) {
        return Err(ApiError::unprocessable(clip(format!("`{path}` holds U+0000 (NUL), which no field accepts"))));
    }
    integral_floats_to_integers(value);
    Ok(())
}

/// Where the first string or key holding U+0000 is (Postgres keeps it in
/// neither text nor `jsonb`), as `a.b[2]`; `.` for the body itself.
fn nul_at(v: &serde_json::Value) -> Option<String> {
    crate::domain::trace::first_in_strings(v, &mut String::new(), &mut |s, at| {
        s.contains('\0').then(|| if at.is_empty() { ".".to_owned() } else { at.to_owned() })
    })
}

/// Every number of `v` written as an integral float (`3.0`) becomes that
/// integer, as JSON Schema reads it.
pub fn integral_floats_to_integers(v: &mut serde_json::Value) {
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

/// An optional JSON body: `None` when there is no body (zero bytes, or only
/// whitespace sent as something other than JSON) or JSON `null`; else it must
/// be sent as JSON (415 otherwise) and be a JSON object (400 when it is not
/// JSON, whitespace alone included; 422 when it breaks a rule).
pub async fn optional_json<T: DeserializeOwned>(req: Request) -> Result<Option<T>, ApiError> {
    let json_type = req
        .headers()
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .map(|v| v.trim().to_ascii_lowercase())
        .is_some_and(|v| v == "application/json" || (v.starts_with("application/") && v.ends_with("+json")));
    let body = body_bytes(req).await?;
    if body.is_empty() || (!json_type && body.iter().all(u8::is_ascii_whitespace)) {
        return Ok(None);
    }
    if !json_type {
        return Err(ApiError::UnsupportedMediaType(
            "send the body as JSON with `Content-Type: application/json`".into(),
        ));
    }
    optional_json_bytes(&body)
}

/// [`optional_json`] of a body already read (whatever its content type):
/// zero bytes are no body; anything else must be JSON.
pub fn optional_json_bytes<T: DeserializeOwned>(body: &[u8]) -> Result<Option<T>, ApiError> {
    if body.is_empty() {
        return Ok(None);
    }
    let mut value: serde_json::Value = serde_json::from_slice(body).map_err(|e| {
        ApiError::bad_request(clip(format!("the body is not valid JSON: {}", plain_serde_error(&e.to_string()))))
    })?;
    if value.is_null() {
        return Ok(None);
    }
    body_value(&mut value)?;
    serde_path_to_error::deserialize(value).map(Some).map_err(|e| {
        let inner = plain_serde_error(&e.inner().to_string());
        let path = e.path().to_string();
        ApiError::unprocessable(clip(if path == "." { inner } else { format!("`{path}`: {inner}") }))
    })
}

/// `axum::extract::Query` with 400 problems.
pub struct ApiQuery<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequestParts<S> for ApiQuery<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        if parts.uri.query().is_none_or(str::is_empty) {
            // Nothing to decode (the agents' GET, mostly); a failure is explained below.
            let empty = serde::de::value::MapDeserializer::<_, serde::de::value::Error>::new(std::iter::empty::<(
                &str,
                &str,
            )>());
            if let Ok(v) = T::deserialize(empty) {
                return Ok(ApiQuery(v));
            }
        }
        Query::<T>::from_request_parts(parts, state)
            .await
            .map(|Query(v)| ApiQuery(v))
            .map_err(|e| ApiError::bad_request(clip(query_problem(&e.body_text()))))
    }
}

/// A query-string rejection in plain words, naming the parameter: axum says
/// "Failed to deserialize query string: version: invalid digit found in string";
/// this says "the query parameter `version` must be a whole number".
fn query_problem(text: &str) -> String {
    let Some(rest) = text.strip_prefix("Failed to deserialize query string: ") else {
        return plain_serde_error(text);
    };
    let Some((key, why)) = rest.split_once(": ").filter(|(k, _)| !k.is_empty() && !k.contains(' ')) else {
        return format!("the query string: {}", plain_serde_error(rest));
    };
    let why = match why {
        "invalid digit found in string" | "cannot parse integer from empty string" => "must be a whole number".into(),
        "number too large to fit in target type" => "is too large".into(),
        "number too small to fit in target type" => "is too small".into(),
        "invalid float literal" | "cannot parse float from empty string" => "must be a number".into(),
        "provided string was not `true` or `false`" => "must be true or false".into(),
        other => format!("is not valid: {}", plain_serde_error(other)),
    };
    format!("the query parameter `{key}` {why}")
}

/// `axum::extract::Path` with 400 problems that name the path parameter and
/// say, in plain words, what it must be.
pub struct ApiPath<T>(pub T);

impl<T: DeserializeOwned + Send, S: Send + Sync> FromRequestParts<S> for ApiPath<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        match Path::<T>::from_request_parts(parts, state).await {
            Ok(Path(v)) => Ok(ApiPath(v)),
            Err(e) => {
                let names: Vec<String> = match RawPathParams::from_request_parts(parts, state).await {
                    Ok(raw) => raw.iter().map(|(k, _)| k.to_owned()).collect(),
                    Err(_) => Vec::new(),
                };
                Err(ApiError::bad_request(clip(path_problem(&e, &names))))
            }
        }
    }
}

/// What a path parameter must be, for a rejection by serde: `names` are the
/// route's parameter names in order (a tuple's error has only an index).
fn path_problem(e: &PathRejection, names: &[String]) -> String {
    let PathRejection::FailedToDeserializePathParams(e) = e else {
        return plain_serde_error(&e.body_text());
    };
    let must_be = |expected: &str| {
        let plain = plain_serde_error(&format!("expected {expected}"));
        plain.strip_prefix("expected ").unwrap_or(&plain).to_owned()
    };
    let shown = |value: &str| value.chars().take(64).collect::<String>();
    match e.kind() {
        ErrorKind::ParseErrorAtKey { key, value, expected_type } => {
            format!("the path parameter `{key}` must be {}; got {:?}", must_be(expected_type), shown(value))
        }
        ErrorKind::ParseErrorAtIndex { index, value, expected_type } => {
            let name = names.get(*index).map_or_else(|| format!("number {}", index + 1), |n| format!("`{n}`"));
            format!("the path parameter {name} must be {}; got {:?}", must_be(expected_type), shown(value))
        }
        ErrorKind::ParseError { value, expected_type } => {
            let name = names.first().map_or_else(String::new, |n| format!(" `{n}`"));
            format!("the path parameter{name} must be {}; got {:?}", must_be(expected_type), shown(value))
        }
        ErrorKind::InvalidUtf8InPathParam { key } => {
            format!("the path parameter `{key}` is not UTF-8 text once percent-decoded")
        }
        _ => plain_serde_error(&e.body_text()),
    }
}

/// A scope a route needs, as a type: [`Authorized`] checks it while the
/// request is extracted, before the path, query and body are looked at, so
/// a caller without the scope learns that first (403), never what was wrong
/// with a body it may not send.
pub trait RequiredScope: Send + Sync {
    const SCOPE: Scope;
}

/// The scopes, one type each, for [`Authorized`].
pub mod scope {
    use super::{RequiredScope, Scope};

    macro_rules! scopes {
        ($($name:ident),* $(,)?) => {$(
            #[doc = concat!("The `", stringify!($name), "` scope.")]
            pub struct $name;
            impl RequiredScope for $name {
                const SCOPE: Scope = Scope::$name;
            }
        )*};
    }

    scopes!(TracesWrite, PromptsRead, PromptsWrite, PromptsPromote, RoundsTrigger, Admin);
}

/// The caller, authenticated (401 otherwise) and holding the scope `S` (or
/// `admin`; 403 otherwise), and the resource the path names found within the
/// caller's reach (404 otherwise, in the words of an absent one). Put it
/// before the other extractors of a handler: axum runs them in argument
/// order, so nothing of the query, headers or body is read for a resource
/// that is absent or out of reach. The prompt it found is the handler's
/// through [`crate::service::projects::PathPrompt`].
pub struct Authorized<S: RequiredScope>(pub Caller, PhantomData<S>);

impl<S: RequiredScope> std::ops::Deref for Authorized<S> {
    type Target = Caller;
    fn deref(&self) -> &Caller {
        &self.0
    }
}

impl<S: RequiredScope> FromRequestParts<AppState> for Authorized<S> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, Self::Rejection> {
        let caller = Caller::from_request_parts(parts, state).await?;
        caller.require(S::SCOPE)?;
        // The one reach check: what the path names must be within the key's project.
        projects::guard_request(state, &caller.reach(), parts).await?;
        Ok(Authorized(caller, PhantomData))
    }
}

/// The caller, authenticated by `Authorization: Bearer cmb_…`. A missing or bad
/// key is rejected with 401 — never treated as anonymous.
#[derive(Debug, Clone)]
pub struct Caller(pub Arc<ApiKey>);

impl Caller {
    /// The key's id: what an `Idempotency-Key` is scoped to.
    pub fn key_id(&self) -> uuid::Uuid {
        self.0.id
    }

    /// 403 unless the key has the scope (or `admin`).
    pub fn require(&self, scope: Scope) -> Result<(), ApiError> {
        if self.0.scopes.contains(&scope) || self.0.scopes.contains(&Scope::Admin) {
            Ok(())
        } else {
            Err(ApiError::Forbidden(scope))
        }
    }

    /// Where the key may act: server-wide, or its one project.
    pub fn reach(&self) -> Reach {
        self.0.reach()
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
        let key =
            keys::authenticate(state, token).await?.ok_or(ApiError::Unauthorized("unknown or revoked API key"))?;
        // A write request's audit entry names the key (see `http/audit.rs`).
        if let Some(slot) = parts.extensions.get::<AuditSlot>() {
            slot.set_actor(Actor::Key { id: key.id, name: key.name.clone() });
        }
        Ok(Caller(key))
    }
}

/// `deserialize_with` for an optional RFC 3339 time a request names: years 1
/// to 9999 (what RFC 3339 writes with its four digits and every store keeps),
/// so a time further off is a 400 that says so rather than a store's refusal.
pub fn bounded_time<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<chrono::DateTime<chrono::Utc>>, D::Error> {
    use chrono::Datelike;
    use serde::Deserialize;
    match Option::<chrono::DateTime<chrono::Utc>>::deserialize(d)? {
        Some(t) if !(1..=9999).contains(&t.year()) => {
            Err(serde::de::Error::custom(format!("{t} is not a time between the years 1 and 9999")))
        }
        t => Ok(t),
    }
}

#[cfg(test)]
mod query_tests {
    use super::query_problem;

    #[test]
    fn query_rejections_name_the_parameter_in_plain_words() {
        let axum = "Failed to deserialize query string: version: invalid digit found in string";
        assert_eq!(query_problem(axum), "the query parameter `version` must be a whole number");
        let variant =
            "Failed to deserialize query string: format: unknown variant `bogus`, expected one of `combee`, `chat`";
        assert_eq!(
            query_problem(variant),
            "the query parameter `format` is not valid: unknown variant `bogus`, expected one of `combee`, `chat`"
        );
        assert_eq!(
            query_problem("Failed to deserialize query string: missing field `from`"),
            "the query string: missing field `from`"
        );
    }
}
