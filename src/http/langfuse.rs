//! Langfuse-compatible routes: code written against a Langfuse SDK points
//! `LANGFUSE_BASE_URL` (or `base_url` / `baseUrl`) at combee and keeps
//! working — `GET /api/public/v2/prompts/{name}` answers in Langfuse's shape,
//! and the SDKs' tracing path `POST /api/public/otel/v1/traces` is the OTLP
//! span ingest under another name. The SDKs authenticate with HTTP Basic: the
//! public key is a combee key's visible prefix (`cmb_` and 8 more
//! characters), the secret key the whole combee key; `Bearer` works too.

use std::marker::PhantomData;

use axum::{
    Json,
    extract::{FromRequestParts, Request, State},
    http::request::Parts,
    response::Response,
};
use base64::Engine;
use serde::Deserialize;
use utoipa::IntoParams;

use super::{
    AppState,
    error::{ApiError, ApiResult},
    extract::{ApiQuery, Caller, RequiredScope, scope},
    otlp::handle_export,
};
use crate::{
    otlp::Signal,
    service::{
        keys,
        langfuse::{self, LangfusePrompt},
        projects::PathPrompt,
    },
};

/// The caller of a Langfuse route, authenticated by the SDK's key pair (or a
/// bearer key) and holding the scope `S`: a missing or bad pair is a 401,
/// never anonymous, a key without the scope a 403 — both before the request
/// itself is looked at.
pub struct LangfuseCaller<S: RequiredScope>(pub Caller, PhantomData<S>);

const PAIR_HELP: &str = "send the key pair as HTTP Basic auth: the public key is the combee key's prefix \
     (`cmb_` and the next 8 characters), the secret key the whole combee key";

impl<S: RequiredScope> FromRequestParts<AppState> for LangfuseCaller<S> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, Self::Rejection> {
        let caller = key_pair(parts, state).await?;
        caller.require(S::SCOPE)?;
        crate::service::projects::guard_request(state, &caller.reach(), parts).await?;
        Ok(LangfuseCaller(caller, PhantomData))
    }
}

/// The key of a Basic key pair, or of a bearer key.
async fn key_pair(parts: &mut Parts, state: &AppState) -> Result<Caller, ApiError> {
    let header = parts.headers.get(axum::http::header::AUTHORIZATION).ok_or(ApiError::Unauthorized(PAIR_HELP))?;
    let value = header.to_str().map_err(|_| ApiError::Unauthorized(PAIR_HELP))?;
    let Some(encoded) = value.strip_prefix("Basic ").or_else(|| value.strip_prefix("basic ")) else {
        return Caller::from_request_parts(parts, state).await;
    };
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(encoded.trim())
        .ok()
        .and_then(|b| String::from_utf8(b).ok())
        .ok_or(ApiError::Unauthorized(PAIR_HELP))?;
    let (public, secret) = decoded.split_once(':').ok_or(ApiError::Unauthorized(PAIR_HELP))?;
    let key = keys::authenticate(state, secret).await?.ok_or(ApiError::Unauthorized("unknown or revoked API key"))?;
    if public != key.prefix {
        return Err(ApiError::Unauthorized(
            "the public key does not match the secret key: use the combee key's prefix (`cmb_` and the next 8 characters)",
        ));
    }
    Ok(Caller(key))
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct LangfusePromptQuery {
    /// A label (`latest` is the newest version). Without `label` and
    /// `version`: `production`.
    pub label: Option<String>,
    /// A version number; with `label` too, that version only while the label points at it.
    pub version: Option<i64>,
    /// Accepted and ignored: combee prompts have no dependencies to resolve.
    pub resolve: Option<bool>,
}

/// A prompt in Langfuse's shape, for the Langfuse SDKs.
///
/// What `langfuse.get_prompt(name, label=…, version=…)` (Python) and
/// `langfuse.prompt.get(name, {label, version})` (JS) call. Without `label`
/// and `version` the `production` version is served (a Langfuse SDK sends no
/// subject, so an `evaluated` prompt's challengers are never served here).
/// `{name}` placeholders come as `{{name}}` so the SDK's `compile` fills them.
#[utoipa::path(get, path = "/api/public/v2/prompts/{name}", tag = "langfuse",
    params(("name" = String, Path, description = "the prompt's name"), LangfusePromptQuery),
    responses(
        (status = 200, body = LangfusePrompt),
        (status = 400, body = super::error::Problem, description = "a bad `label` or `version`"),
        (status = 401, body = super::error::Problem, description = "no key pair, or an unknown or revoked key"),
        (status = 403, body = super::error::Problem, description = "the key lacks `prompts:read`"),
        (status = 404, body = super::error::Problem, description = "no such prompt, label or version"),
        (status = 503, body = super::error::Problem),
    ),
    security(("basic" = ["prompts:read"]), ("bearer" = ["prompts:read"])))]
pub async fn get_prompt(
    State(st): State<AppState>,
    _caller: LangfuseCaller<scope::PromptsRead>,
    PathPrompt(name): PathPrompt,
    ApiQuery(q): ApiQuery<LangfusePromptQuery>,
) -> ApiResult<Json<LangfusePrompt>> {
    Ok(Json(langfuse::prompt(&st, &name, q.label.as_deref(), q.version).await?))
}

/// OTLP span export from a Langfuse SDK (an alias of `POST /v1/otlp/v1/traces`).
///
/// The Langfuse SDKs export their spans here with the key pair; they are
/// ingested exactly as `/v1/otlp/v1/traces` ingests spans (Langfuse's
/// `langfuse.observation.*` attributes are read, and a generation linked to a
/// prompt names the combee prompt and version).
#[utoipa::path(post, path = "/api/public/otel/v1/traces", tag = "langfuse",
    request_body(content = Vec<u8>, description = "an OTLP `ExportTraceServiceRequest`; with `Content-Encoding: gzip` or `deflate` it may be compressed",
        content(("application/x-protobuf"), ("application/json"))),
    responses(
        (status = 200, description = "an OTLP `ExportTraceServiceResponse` in the request's encoding, with `partial_success` when spans were rejected or are held"),
        (status = 400, body = super::error::Problem, description = "the body is not a valid export request (bad protobuf, JSON or gzip)"),
        (status = 401, body = super::error::Problem, description = "no key pair, or an unknown or revoked key"),
        (status = 403, body = super::error::Problem, description = "the key lacks `traces:write`"),
        (status = 413, body = super::error::Problem, description = "the body (or inflated body) exceeds `limits.max_body_bytes`, or more than `limits.max_traces_per_batch` trace ids"),
        (status = 415, body = super::error::Problem, description = "neither protobuf nor JSON, or an unsupported `Content-Encoding`"),
        (status = 503, body = super::error::Problem, description = "the store is unavailable (`Retry-After`); retrying the same export is safe"),
    ),
    security(("basic" = ["traces:write"]), ("bearer" = ["traces:write"])))]
pub async fn export_traces(
    State(st): State<AppState>,
    caller: LangfuseCaller<scope::TracesWrite>,
    req: Request,
) -> ApiResult<Response> {
    handle_export(&st, &caller.0.reach(), Signal::Traces, req).await
}
