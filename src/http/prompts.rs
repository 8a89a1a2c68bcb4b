//! Prompt routes: create and list prompts; the agents' `GET` of the current
//! text (cached, with a strong ETag) and the population it is served from.
//! Settings, versions and labels have their own files.

use crate::service::audit::Audit;
use std::sync::Arc;

use axum::{
    Json,
    body::Bytes,
    extract::State,
    http::{HeaderValue, StatusCode, header},
    response::{IntoResponse, Response},
};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use utoipa::{IntoParams, ToSchema};

use super::{
    AppState,
    error::{ApiError, ApiResult},
    extract::{ApiJson, ApiQuery, Authorized, scope},
};
use crate::{
    cache::CachedPrompt,
    domain::{
        LabelName, Playbook, Promotion, Prompt, PromptName, PromptSettings, Strategy, Version, VersionSource,
        label::{Resolved, Selector},
        population::ArmState,
        prompt::{NewPrompt, NewVersion, PromptSummary},
    },
    evaluate::assign::assign,
    service::{
        pagination::{PageParams, next_token},
        population::{self, PopulationArmView},
        projects::{self, PathPrompt},
        prompts::{self, check_content, check_message, existing_prompt, served_arms},
    },
};

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreatePrompt {
    /// `[a-z0-9][a-z0-9._-]{0,63}`, unique within its project.
    pub name: String,
    /// The base text, written by people.
    pub base: String,
    #[serde(default)]
    pub strategy: Option<Strategy>,
    /// What happens to learned versions: `evaluated` (the default: measured
    /// on live traffic, promoted by the gate), `auto` (straight to production)
    /// or `manual` (labelled `candidate`).
    #[serde(default)]
    pub promotion: Option<Promotion>,
    /// An initial playbook (playbook strategy only); bullet ids are assigned when absent.
    #[serde(default)]
    pub playbook: Option<Playbook>,
    /// Merged over the project's `prompt_defaults`, field by field.
    #[serde(default)]
    #[schema(value_type = Option<PromptSettings>)]
    pub settings: Option<serde_json::Map<String, serde_json::Value>>,
    #[serde(default)]
    pub message: Option<String>,
    /// The project the prompt belongs to (default: the key's own project, or
    /// `default` for a server-wide key). A project's key may name only its own
    /// project: another is answered 404, as if it did not exist.
    #[serde(default)]
    pub project: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct PromptCreated {
    #[serde(flatten)]
    pub prompt: Prompt,
    pub version: Version,
    #[schema(value_type = Vec<String>)]
    pub labels: Vec<LabelName>,
}

#[utoipa::path(post, path = "/v1/prompts", tag = "prompts", request_body = CreatePrompt,
    responses((status = 201, body = PromptCreated), (status = 404, body = super::error::Problem), (status = 409, body = super::error::Problem), (status = 422, body = super::error::Problem)),
    security(("bearer" = ["prompts:write"])))]
pub async fn create_prompt(
    State(st): State<AppState>,
    caller: Authorized<scope::PromptsWrite>,
    ApiJson(req): ApiJson<CreatePrompt>,
) -> ApiResult<Response> {
    let project = projects::for_new_prompt(&st, &caller.reach(), req.project.as_deref()).await?;
    let name = PromptName::new(&project.name, &req.name).map_err(|e| ApiError::unprocessable(e.to_string()))?;
    let strategy = req.strategy.unwrap_or_default();
    let settings = project.settings.prompt_settings(req.settings.as_ref()).map_err(ApiError::unprocessable)?;
    let content = check_content(&st, strategy, &req.base, req.playbook)?;
    let first = NewVersion {
        parent: None,
        source: VersionSource::Manual,
        round_id: None,
        content,
        message: check_message(req.message, "created")?,
        created_by: caller.actor(),
    };
    let new = NewPrompt {
        name: name.clone(),
        strategy,
        promotion: req.promotion.unwrap_or_default(),
        settings,
        created_by: caller.actor(),
    };
    let (prompt, version) = prompts::create_prompt(&st, new, first).await?;
    let location = HeaderValue::from_str(&format!("/v1/prompts/{}", name.in_path())).ok();
    let created = PromptCreated { prompt, version, labels: vec![LabelName::production()] };
    let audit = Audit::new("prompt.create", "prompt", &name).in_project(Some(project.name));
    let mut res = (StatusCode::CREATED, audit, Json(created)).into_response();
    if let Some(l) = location {
        res.headers_mut().insert(header::LOCATION, l);
    }
    Ok(res)
}

#[derive(Debug, Serialize, ToSchema)]
pub struct PromptPage {
    pub prompts: Vec<PromptSummary>,
    pub next_page_token: Option<String>,
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct PromptListQuery {
    /// How many items to return (default 50, at most `limits.max_page_size`).
    pub page_size: Option<u32>,
    /// The `next_page_token` of the previous page.
    pub page_token: Option<String>,
    /// Only this project's prompts (a project's key sees only its own anyway).
    pub project: Option<String>,
}

#[utoipa::path(get, path = "/v1/prompts", tag = "prompts", params(PromptListQuery),
    responses((status = 200, body = PromptPage)), security(("bearer" = ["prompts:read"])))]
pub async fn list_prompts(
    State(st): State<AppState>,
    caller: Authorized<scope::PromptsRead>,
    ApiQuery(q): ApiQuery<PromptListQuery>,
) -> ApiResult<Json<PromptPage>> {
    let page = PageParams { page_size: q.page_size, page_token: q.page_token };
    let filter = crate::domain::project::list_filter(&caller.reach(), q.project.as_deref());
    let size = page.size(st.settings.limits.max_page_size);
    // The token is the last prompt written `project/name`: names repeat across projects.
    let after = match page.cursor()? {
        Some(a) => Some(
            PromptName::written(&a, crate::domain::names::DEFAULT_PROJECT)
                .ok()
                .filter(|_| a.contains('/'))
                .ok_or_else(|| ApiError::bad_request("`page_token` is not a token this API issued".into()))?,
        ),
        None => None,
    };
    let prompts = prompts::list_prompts(&st, &filter, after.as_ref(), size).await?;
    let next_page_token =
        next_token(&prompts, size, |p| format!("{}/{}", p.prompt.name.project(), p.prompt.name.as_str()));
    Ok(Json(PromptPage { prompts, next_page_token }))
}

#[derive(Debug, Default, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct SelectorQuery {
    /// A label (default `production`; `latest` is the newest version).
    pub label: Option<String>,
    /// A version number (instead of a label).
    pub version: Option<i64>,
    /// The agent (user, session…) asking, for prompts under the `evaluated`
    /// policy when neither `label` nor `version` is given: the same subject is
    /// always served the same arm while the traffic weights stay. Overrides
    /// the `Combee-Subject` header. Without either, an arm is drawn per request.
    /// 1 to 256 characters, no control characters.
    #[param(min_length = 1, max_length = 256, pattern = r"^[^\u0000-\u001F\u007F-\u009F]+$")]
    pub subject: Option<String>,
}

/// The header an agent names its subject with (see `SelectorQuery::subject`).
pub const SUBJECT_HEADER: &str = "combee-subject";
/// Longest accepted subject, in characters.
pub const MAX_SUBJECT_CHARS: usize = 256;

impl SelectorQuery {
    fn selector(&self) -> ApiResult<Selector> {
        match (&self.label, self.version) {
            // Both: the version, and only while the label points at it (checked by the caller).
            (_, Some(v)) if v >= 1 => Ok(Selector::Version(v)),
            (_, Some(_)) => Err(ApiError::bad_request("`version` must be at least 1".into())),
            (Some(l), None) if l == LabelName::LATEST => Ok(Selector::Latest),
            (Some(l), None) => {
                LabelName::parse(l).map(Selector::Label).map_err(|e| ApiError::bad_request(e.to_string()))
            }
            (None, None) => Ok(Selector::Label(LabelName::production())),
        }
    }
}

/// What an agent receives.
#[derive(Debug, Serialize, ToSchema)]
pub struct PromptView<'a> {
    /// The prompt as any caller may write it: its name in `default`,
    /// `project/name` elsewhere; traces name their prompt so.
    pub name: &'a str,
    pub version: i64,
    #[schema(value_type = Vec<String>)]
    pub labels: &'a [LabelName],
    /// The rendered text: base, then the playbook.
    pub text: String,
    pub content_hash: &'a str,
    pub source: VersionSource,
    pub created_at: chrono::DateTime<chrono::Utc>,
}

/// A strong validator over everything the body is made of: the version's
/// content and the labels that point at it.
pub(super) fn etag(resolved: &Resolved) -> String {
    let v = &resolved.version;
    let mut h = Sha256::new();
    h.update(v.content_hash.as_bytes());
    for l in &resolved.labels {
        h.update(b"\0");
        h.update(l.as_str().as_bytes());
    }
    let digest = hex::encode(h.finalize());
    format!("\"v{}-{}\"", v.number, &digest[..20])
}

pub(super) async fn fresh_view(st: &AppState, name: &PromptName, selector: &Selector) -> ApiResult<Arc<CachedPrompt>> {
    let resolved = prompts::resolved(st, name, selector).await?;
    let v = &resolved.version;
    let body = serde_json::to_vec(&PromptView {
        name: &name.qualified(),
        version: v.number,
        labels: &resolved.labels,
        text: v.content.render(),
        content_hash: &v.content_hash,
        source: v.source,
        created_at: v.created_at,
    })
    .map_err(|e| ApiError::internal(e.into()))?;
    let etag = HeaderValue::from_str(&etag(&resolved)).map_err(|e| ApiError::internal(e.into()))?;
    Ok(Arc::new(CachedPrompt::new(etag, Bytes::from(body), v.number)))
}

async fn cached_view(st: &AppState, name: &PromptName, selector: Selector) -> ApiResult<Arc<CachedPrompt>> {
    if let Some(hit) = st.cache.get(name, &selector) {
        return Ok(hit);
    }
    let generation = st.cache.generation();
    let view = fresh_view(st, name, &selector).await?;
    st.cache.insert(name, selector, generation, view.clone());
    Ok(view)
}

pub(super) fn etag_matches(header_value: Option<&HeaderValue>, etag: &HeaderValue, weak: bool) -> bool {
    let Some(v) = header_value.and_then(|v| v.to_str().ok()) else { return false };
    let ours = etag.to_str().unwrap_or_default();
    v.split(',')
        .map(str::trim)
        .any(|tag| tag == "*" || tag == ours || (weak && tag.strip_prefix("W/").is_some_and(|t| t == ours)))
}

#[utoipa::path(get, path = "/v1/prompts/{name}", tag = "prompts", params(("name" = String, Path), SelectorQuery),
    responses((status = 200, body = PromptView, headers(("ETag" = String), ("Vary" = String), ("Combee-Arm" = Option<String>, description = "`champion` or `challenger` when an `evaluated` prompt's arm was served"))), (status = 304), (status = 400, description = "a bad `subject`, `label` or `version`", body = super::error::Problem), (status = 404, body = super::error::Problem)),
    security(("bearer" = ["prompts:read"])))]
pub async fn get_prompt(
    State(st): State<AppState>,
    _caller: Authorized<scope::PromptsRead>,
    PathPrompt(name): PathPrompt,
    ApiQuery(q): ApiQuery<SelectorQuery>,
    headers: GetHeaders,
) -> ApiResult<Response> {
    if let (Some(l), Some(v)) = (&q.label, q.version) {
        let sel = SelectorQuery { label: Some(l.clone()), version: None, subject: None }.selector()?;
        let at = prompts::resolve(&st, &name, &sel).await?.map(|r| r.version.number);
        if at != Some(v) {
            return Err(ApiError::missing(format!("label {l:?} does not point at version {v}")));
        }
    }
    let subject = subject_of(&q, headers.subject.as_ref())?;
    let explicit = q.label.is_some() || q.version.is_some();
    let arm = if explicit { None } else { served_arm(&st, &name, subject).await? };
    let selector = match arm {
        Some((version, _)) => Selector::Version(version),
        None => q.selector()?,
    };
    let view = cached_view(&st, &name, selector).await?;
    let served_as = arm.map(|(_, state)| state);
    let not_modified = etag_matches(headers.if_none_match.as_ref(), &view.etag, true);
    let body = if not_modified { axum::body::Body::empty() } else { view.body_as(served_as).clone().into() };
    let mut res = Response::new(body);
    // Made once with the cached answer: type, ETag, caching, `Vary`, and the arm served.
    *res.headers_mut() = view.headers_as(served_as).clone();
    if not_modified {
        *res.status_mut() = StatusCode::NOT_MODIFIED;
        res.headers_mut().remove(header::CONTENT_TYPE);
    }
    Ok(res)
}

/// The two request headers the agents' `GET` reads (taken alone: extracting
/// the whole `HeaderMap` would copy every header on the hottest route).
pub struct GetHeaders {
    if_none_match: Option<HeaderValue>,
    subject: Option<HeaderValue>,
}

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for GetHeaders {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut axum::http::request::Parts, _: &S) -> Result<Self, Self::Rejection> {
        Ok(Self {
            if_none_match: parts.headers.get(header::IF_NONE_MATCH).cloned(),
            subject: parts.headers.get(SUBJECT_HEADER).cloned(),
        })
    }
}

/// The subject of a request: `?subject=`, else the `Combee-Subject` header.
fn subject_of<'a>(q: &'a SelectorQuery, header: Option<&'a HeaderValue>) -> ApiResult<Option<&'a str>> {
    let raw = match (&q.subject, header) {
        (Some(s), _) => s.as_str(),
        (None, Some(h)) => {
            h.to_str().map_err(|_| ApiError::bad_request("the `Combee-Subject` header must be visible ASCII".into()))?
        }
        (None, None) => return Ok(None),
    };
    if raw.is_empty() || raw.chars().count() > MAX_SUBJECT_CHARS || raw.chars().any(char::is_control) {
        return Err(ApiError::bad_request(format!(
            "a subject must be 1 to {MAX_SUBJECT_CHARS} characters without control characters"
        )));
    }
    Ok(Some(raw))
}

/// The arm (version, state) this request is served: sticky by subject over
/// the current weights, or drawn per request without one. `None` when the
/// prompt has no population (it is served `production` as usual).
async fn served_arm(st: &AppState, name: &PromptName, subject: Option<&str>) -> ApiResult<Option<(i64, ArmState)>> {
    let served = served_arms(st, name).await?;
    let picked = assign(subject, &name.qualified(), &served.arms, &mut rand::thread_rng());
    Ok(picked.map(|i| {
        let version = served.arms[i].0;
        let state = if Some(version) == served.champion { ArmState::Champion } else { ArmState::Challenger };
        (version, state)
    }))
}

#[derive(Debug, Serialize, ToSchema)]
pub struct PopulationView {
    pub prompt: String,
    pub promotion: Promotion,
    /// The arms of this page, retired ones too, by version.
    pub arms: Vec<PopulationArmView>,
    /// More arms (newer versions) follow: pass this as `page_token`.
    pub next_page_token: Option<String>,
}

#[utoipa::path(get, path = "/v1/prompts/{name}/population", tag = "prompts", params(("name" = String, Path), PageParams),
    responses((status = 200, body = PopulationView), (status = 404, body = super::error::Problem)),
    security(("bearer" = ["prompts:read"])))]
/// The prompt's population under the `evaluated` policy, by version, one
/// page at a time: every arm with its state (champion, challenger, retired),
/// TrueSkill rating, traffic weight and scored-trace count. Empty for
/// prompts under `auto` or `manual` (they have no population until switched).
pub async fn get_population(
    State(st): State<AppState>,
    _caller: Authorized<scope::PromptsRead>,
    PathPrompt(name): PathPrompt,
    ApiQuery(page): ApiQuery<PageParams>,
) -> ApiResult<Json<PopulationView>> {
    let prompt = existing_prompt(&st, &name).await?;
    let after = match page.cursor()? {
        Some(c) => Some(c.parse::<i64>().map_err(|_| ApiError::bad_request("bad `page_token`".into()))?),
        None => None,
    };
    let size = page.size(st.settings.limits.max_page_size);
    let arms = population::population(&st, &prompt, after, size).await?;
    let next_page_token = next_token(&arms, size, |a| a.arm.version.to_string());
    Ok(Json(PopulationView { prompt: prompt.name.to_string(), promotion: prompt.promotion, arms, next_page_token }))
}
