//! Prompt routes: create and list prompts; the agents' `GET` of the current
//! text (cached, with a strong ETag); versions, diffs, labels and rollback.

use std::sync::Arc;

use axum::{
    Json,
    body::Bytes,
    extract::State,
    http::{HeaderMap, HeaderValue, StatusCode, header},
    response::{IntoResponse, Response},
};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use utoipa::{IntoParams, ToSchema};

use super::{
    AppState,
    error::{ApiError, ApiResult},
    extract::{ApiJson, ApiPath, ApiQuery, Caller},
};
use crate::{
    cache::{CachedPrompt, ServedArms},
    domain::{
        LabelMoveKind, LabelName, MoveCause, Playbook, Promotion, Prompt, PromptName, PromptSettings, Strategy,
        Version, VersionContent, VersionSource, prompt::NewVersion,
    },
    evaluate::assign::assign,
    service::{
        pagination::{PageParams, next_token},
        prompts::{
            MAX_MESSAGE_CHARS, VersionDiff, check_message, existing_prompt, move_label_to, parse_name, roll_back,
            version_diff,
        },
    },
    store::{
        ArmState, Label, LabelMove, NewPrompt, PopulationArm, PromptSummary, Resolved, Scope, Selector, StoreError,
    },
};

fn check_content(
    st: &AppState,
    strategy: Strategy,
    base: &str,
    playbook: Option<Playbook>,
) -> ApiResult<VersionContent> {
    if base.trim().is_empty() {
        return Err(ApiError::Unprocessable("`base` must not be empty".into()));
    }
    if base.len() > st.settings.limits.max_prompt_bytes {
        return Err(ApiError::PayloadTooLarge(format!(
            "`base` is {} bytes; the limit is {} (`limits.max_prompt_bytes`)",
            base.len(),
            st.settings.limits.max_prompt_bytes
        )));
    }
    let playbook = match (strategy, playbook) {
        (Strategy::Rewrite, Some(_)) => {
            return Err(ApiError::Unprocessable("a prompt with strategy `rewrite` has no playbook".into()));
        }
        (_, Some(pb)) => Some(pb.normalized().map_err(|e| ApiError::Unprocessable(format!("playbook: {e}")))?),
        (_, None) => None,
    };
    let content = VersionContent { base: base.to_owned(), playbook };
    let rendered = content.render().len();
    if rendered > st.settings.limits.max_prompt_bytes * 2 {
        return Err(ApiError::PayloadTooLarge(format!("the rendered prompt is {rendered} bytes; too large")));
    }
    Ok(content)
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreatePrompt {
    /// `[a-z0-9][a-z0-9._-]{0,63}`
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
    #[serde(default)]
    pub settings: Option<PromptSettings>,
    #[serde(default)]
    pub message: Option<String>,
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
    responses((status = 201, body = PromptCreated), (status = 409, body = super::error::Problem), (status = 422, body = super::error::Problem)),
    security(("bearer" = ["prompts:write"])))]
pub async fn create_prompt(
    State(st): State<AppState>,
    caller: Caller,
    ApiJson(req): ApiJson<CreatePrompt>,
) -> ApiResult<Response> {
    caller.require(Scope::PromptsWrite)?;
    let name = PromptName::parse(&req.name).map_err(|e| ApiError::Unprocessable(e.to_string()))?;
    let strategy = req.strategy.unwrap_or_default();
    let settings = req.settings.unwrap_or_default().validated().map_err(ApiError::Unprocessable)?;
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
    let (prompt, version) = crate::service::prompts::create_prompt(&st, new, first).await?;
    let location = HeaderValue::from_str(&format!("/v1/prompts/{name}")).ok();
    let mut res = (StatusCode::CREATED, Json(PromptCreated { prompt, version, labels: vec![LabelName::production()] }))
        .into_response();
    if let Some(l) = location {
        res.headers_mut().insert(header::LOCATION, l);
    }
    Ok(res)
}

/// RFC 7396 JSON merge patch: members of `patch` replace those of `target`,
/// objects merge recursively, `null` removes a member (its default applies).
fn merge_patch(target: &mut serde_json::Value, patch: &serde_json::Value) {
    let serde_json::Value::Object(patch) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = serde_json::Value::Object(Default::default());
    }
    if let serde_json::Value::Object(t) = target {
        for (k, v) in patch {
            if v.is_null() {
                t.remove(k);
            } else {
                merge_patch(t.entry(k.clone()).or_insert(serde_json::Value::Null), v);
            }
        }
    }
}

/// A JSON merge patch (RFC 7396) of a prompt's settings: the members sent
/// replace the current ones, `null` resets a member to its default.
#[derive(Debug, Deserialize)]
pub struct SettingsPatch(pub serde_json::Map<String, serde_json::Value>);

impl utoipa::PartialSchema for SettingsPatch {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        let nullable_int = |min: u64, max: Option<u64>| {
            let mut s = serde_json::json!({"type": ["integer", "null"], "minimum": min});
            if let Some(max) = max {
                s["maximum"] = max.into();
            }
            s
        };
        let schema = serde_json::json!({
            "type": "object",
            "description": "A JSON merge patch (RFC 7396) of the prompt's settings: members sent replace the current ones, `null` resets one to its default.",
            "additionalProperties": false,
            "properties": {
                "duplication": nullable_int(1, Some(8)),
                "batch_size": {"oneOf": [{"type": "string", "enum": ["auto"]}, {"type": "integer", "minimum": 1, "maximum": 10000}, {"type": "null"}]},
                "max_wait_secs": nullable_int(0, Some(crate::domain::prompt::MAX_WAIT_SECS)),
                "reduce": {"type": ["string", "null"], "enum": ["union", "llm", null]},
                "max_bullets": nullable_int(0, Some(crate::domain::prompt::MAX_BULLETS as u64)),
                "max_chars": nullable_int(0, Some(crate::domain::prompt::MAX_CHARS as u64)),
                "agent_reflections": {"type": ["string", "null"], "enum": ["ignore", "use", null]},
                "pinned_bullets": {"type": ["array", "null"], "maxItems": 1000, "items": {"type": "string", "pattern": "^b-[0-9]{1,12}$"}},
                "max_removal_share": {"type": ["number", "null"], "minimum": 0, "maximum": 1},
                "regression_guard": {"type": ["boolean", "null"]},
            },
            "example": {"agent_reflections": "ignore", "pinned_bullets": ["b-0001"], "max_removal_share": 0.25},
        });
        serde_json::from_value(schema).unwrap_or_default()
    }
}

impl ToSchema for SettingsPatch {}

/// Changes a prompt's learning settings (agent reflections, pinned bullets,
/// budgets, …). The next round uses them; versions are not touched.
#[utoipa::path(patch, path = "/v1/prompts/{name}/settings", tag = "prompts", params(("name" = String, Path)),
    request_body(content = SettingsPatch, content_type = "application/merge-patch+json"),
    responses((status = 200, body = Prompt), (status = 404, body = super::error::Problem),
        (status = 409, body = super::error::Problem), (status = 422, body = super::error::Problem)),
    security(("bearer" = ["prompts:write"])))]
pub async fn update_settings(
    State(st): State<AppState>,
    caller: Caller,
    ApiPath(name): ApiPath<String>,
    ApiJson(patch): ApiJson<SettingsPatch>,
) -> ApiResult<Json<Prompt>> {
    caller.require(Scope::PromptsWrite)?;
    // `null` removes a member before the settings are read back, so an unknown
    // name would pass unnoticed there: refuse it here.
    if let Some(unknown) = patch.0.keys().find(|k| !PromptSettings::FIELDS.contains(&k.as_str())) {
        return Err(ApiError::Unprocessable(format!(
            "`{}` is not a setting; the settings are {}",
            unknown.chars().take(64).collect::<String>(),
            PromptSettings::FIELDS.join(", ")
        )));
    }
    let patch = serde_json::Value::Object(patch.0);
    // Optimistic: re-read and re-apply when another change landed in between.
    for _ in 0..5 {
        let prompt = existing_prompt(&st, &name).await?;
        let mut doc = serde_json::to_value(&prompt.settings).map_err(|e| ApiError::Internal(e.into()))?;
        merge_patch(&mut doc, &patch);
        let new: PromptSettings = serde_path_to_error::deserialize(doc).map_err(|e| {
            let inner = super::extract::plain_serde_error(&e.inner().to_string());
            ApiError::Unprocessable(format!("`settings.{}`: {inner}", e.path()))
        })?;
        let new = new.validated().map_err(ApiError::Unprocessable)?;
        match st.store.update_prompt_settings(&prompt.name, &prompt.settings, &new).await {
            Ok(Some(updated)) => return Ok(Json(updated)),
            Ok(None) => return Err(ApiError::not_found(format_args!("prompt {:?}", prompt.name.as_str()))),
            Err(StoreError::Conflict) => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Err(ApiError::Conflict("the settings kept changing while this patch was applied; send it again".into()))
}

#[derive(Debug, Serialize, ToSchema)]
pub struct PromptPage {
    pub prompts: Vec<PromptSummary>,
    pub next_page_token: Option<String>,
}

#[utoipa::path(get, path = "/v1/prompts", tag = "prompts", params(PageParams),
    responses((status = 200, body = PromptPage)), security(("bearer" = ["prompts:read"])))]
pub async fn list_prompts(
    State(st): State<AppState>,
    caller: Caller,
    ApiQuery(page): ApiQuery<PageParams>,
) -> ApiResult<Json<PromptPage>> {
    caller.require(Scope::PromptsRead)?;
    let size = page.size(st.settings.limits.max_page_size);
    let after = page.cursor()?;
    if after.as_deref().is_some_and(|a| !crate::domain::names::is_valid_name(a)) {
        return Err(ApiError::BadRequest("`page_token` is not a token this API issued".into()));
    }
    let prompts = st.store.list_prompts(after.as_deref(), size).await?;
    let next_page_token = next_token(&prompts, size, |p| p.prompt.name.to_string());
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
            (_, Some(_)) => Err(ApiError::BadRequest("`version` must be at least 1".into())),
            (Some(l), None) if l == LabelName::LATEST => Ok(Selector::Latest),
            (Some(l), None) => {
                LabelName::parse(l).map(Selector::Label).map_err(|e| ApiError::BadRequest(e.to_string()))
            }
            (None, None) => Ok(Selector::Label(LabelName::production())),
        }
    }
}

/// What an agent receives.
#[derive(Debug, Serialize, ToSchema)]
pub struct PromptView<'a> {
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
fn etag(resolved: &Resolved) -> String {
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

async fn fresh_view(st: &AppState, name: &PromptName, selector: &Selector) -> ApiResult<Arc<CachedPrompt>> {
    let Some(resolved) = st.store.resolve(name, selector).await? else {
        if st.store.get_prompt(name).await?.is_none() {
            return Err(ApiError::not_found(format_args!("prompt {name:?}")));
        }
        return Err(match selector {
            Selector::Label(l) => ApiError::not_found(format_args!("label {l:?} of prompt {name:?}")),
            Selector::Version(n) => ApiError::not_found(format_args!("version {n} of prompt {name:?}")),
            Selector::Latest => ApiError::not_found(format_args!("prompt {name:?}")),
        });
    };
    let v = &resolved.version;
    let body = serde_json::to_vec(&PromptView {
        name: name.as_str(),
        version: v.number,
        labels: &resolved.labels,
        text: v.content.render(),
        content_hash: &v.content_hash,
        source: v.source,
        created_at: v.created_at,
    })
    .map_err(|e| ApiError::Internal(e.into()))?;
    let etag = HeaderValue::from_str(&etag(&resolved)).map_err(|e| ApiError::Internal(e.into()))?;
    Ok(Arc::new(CachedPrompt::new(etag, Bytes::from(body), v.number)))
}

async fn cached_view(st: &AppState, name: &str, selector: Selector) -> ApiResult<Arc<CachedPrompt>> {
    if crate::domain::names::is_valid_name(name)
        && let Some(hit) = st.cache.get(name, &selector)
    {
        return Ok(hit);
    }
    let generation = st.cache.generation();
    let name = parse_name(name)?;
    let view = fresh_view(st, &name, &selector).await?;
    st.cache.insert(name.as_str(), selector, generation, view.clone());
    Ok(view)
}

fn etag_matches(header_value: Option<&HeaderValue>, etag: &HeaderValue, weak: bool) -> bool {
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
    caller: Caller,
    ApiPath(name): ApiPath<String>,
    ApiQuery(q): ApiQuery<SelectorQuery>,
    headers: HeaderMap,
) -> ApiResult<Response> {
    caller.require(Scope::PromptsRead)?;
    if let (Some(l), Some(v)) = (&q.label, q.version) {
        let sel = if l == LabelName::LATEST {
            Selector::Latest
        } else {
            Selector::Label(LabelName::parse(l).map_err(|e| ApiError::BadRequest(e.to_string()))?)
        };
        let at = st.store.resolve(&parse_name(&name)?, &sel).await?.map(|r| r.version.number);
        if at != Some(v) {
            return Err(ApiError::NotFound(format!("label {l:?} does not point at version {v}")));
        }
    }
    let subject = subject_of(&q, &headers)?;
    let explicit = q.label.is_some() || q.version.is_some();
    let arm = if explicit { None } else { served_arm(&st, &name, subject.as_deref()).await? };
    let selector = match arm {
        Some((version, _)) => Selector::Version(version),
        None => q.selector()?,
    };
    let view = cached_view(&st, &name, selector).await?;
    let mut res = if etag_matches(headers.get(header::IF_NONE_MATCH), &view.etag, true) {
        StatusCode::NOT_MODIFIED.into_response()
    } else {
        let body = match arm {
            Some((_, state)) => with_arm(&view.body, state)?,
            None => view.body.clone(),
        };
        let mut res = body.into_response();
        res.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
        res
    };
    if let Some((version, state)) = arm {
        res.headers_mut().insert("combee-arm", HeaderValue::from_static(state.as_str()));
        res.headers_mut().insert("combee-version", HeaderValue::from(version));
    }
    res.headers_mut().insert(header::ETAG, view.etag.clone());
    res.headers_mut().insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    // Without `label`/`version`, which version is served can depend on the subject.
    res.headers_mut().insert(header::VARY, HeaderValue::from_static("Combee-Subject"));
    Ok(res)
}

/// The subject of a request: `?subject=`, else the `Combee-Subject` header.
fn subject_of(q: &SelectorQuery, headers: &HeaderMap) -> ApiResult<Option<String>> {
    let raw = match (&q.subject, headers.get(SUBJECT_HEADER)) {
        (Some(s), _) => s.clone(),
        (None, Some(h)) => h
            .to_str()
            .map_err(|_| ApiError::BadRequest("the `Combee-Subject` header must be visible ASCII".into()))?
            .to_owned(),
        (None, None) => return Ok(None),
    };
    if raw.is_empty() || raw.chars().count() > MAX_SUBJECT_CHARS || raw.chars().any(char::is_control) {
        return Err(ApiError::BadRequest(format!(
            "a subject must be 1 to {MAX_SUBJECT_CHARS} characters without control characters"
        )));
    }
    Ok(Some(raw))
}

/// The live arms of an `evaluated` prompt (empty for other prompts), cached
/// like the prompt's text and dropped with it on every change.
async fn served_arms(st: &AppState, name: &str) -> ApiResult<Arc<ServedArms>> {
    if crate::domain::names::is_valid_name(name)
        && let Some(hit) = st.cache.get_arms(name)
    {
        return Ok(hit);
    }
    let generation = st.cache.generation();
    let prompt = existing_prompt(st, name).await?;
    let served = if prompt.promotion == Promotion::Evaluated {
        let population = st.store.population(&prompt.name).await?;
        let champion = population.iter().find(|a| a.state == ArmState::Champion).map(|a| a.version);
        let arms = population
            .iter()
            .filter(|a| a.state != ArmState::Retired && a.weight > 0.0)
            .map(|a| (a.version, a.weight))
            .collect();
        ServedArms::new(arms, champion)
    } else {
        ServedArms::new(Vec::new(), None)
    };
    let served = Arc::new(served);
    st.cache.insert_arms(prompt.name.as_str(), generation, served.clone());
    Ok(served)
}

/// The arm (version, state) this request is served: sticky by subject over
/// the current weights, or drawn per request without one. `None` when the
/// prompt has no population (it is served `production` as usual).
async fn served_arm(st: &AppState, name: &str, subject: Option<&str>) -> ApiResult<Option<(i64, ArmState)>> {
    let served = served_arms(st, name).await?;
    let picked = assign(subject, name, &served.arms, &mut rand::thread_rng());
    Ok(picked.map(|i| {
        let version = served.arms[i].0;
        let state = if Some(version) == served.champion { ArmState::Champion } else { ArmState::Challenger };
        (version, state)
    }))
}

/// The cached body with the arm it was served as.
fn with_arm(body: &Bytes, state: ArmState) -> ApiResult<Bytes> {
    let mut v: serde_json::Value = serde_json::from_slice(body).map_err(|e| ApiError::Internal(e.into()))?;
    v["arm"] = serde_json::Value::String(state.as_str().to_owned());
    Ok(Bytes::from(serde_json::to_vec(&v).map_err(|e| ApiError::Internal(e.into()))?))
}

#[derive(Debug, Serialize, ToSchema)]
pub struct PopulationView {
    pub prompt: String,
    pub promotion: Promotion,
    /// Every arm, retired ones too, by version.
    pub arms: Vec<PopulationArmView>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct PopulationArmView {
    #[serde(flatten)]
    pub arm: PopulationArm,
    /// μ − 2σ: what the promotion gate compares.
    pub conservative: f64,
    /// μ + 2σ: what exploration chases.
    pub optimistic: f64,
}

#[utoipa::path(get, path = "/v1/prompts/{name}/population", tag = "prompts", params(("name" = String, Path)),
    responses((status = 200, body = PopulationView), (status = 404, body = super::error::Problem)),
    security(("bearer" = ["prompts:read"])))]
/// The prompt's population under the `evaluated` policy: every arm with its
/// state (champion, challenger, retired), TrueSkill rating, traffic weight
/// and scored-trace count. Empty for prompts under `auto` or `manual`
/// (they have no population until switched).
pub async fn get_population(
    State(st): State<AppState>,
    caller: Caller,
    ApiPath(name): ApiPath<String>,
) -> ApiResult<Json<PopulationView>> {
    caller.require(Scope::PromptsRead)?;
    let prompt = existing_prompt(&st, &name).await?;
    let arms = st
        .store
        .population(&prompt.name)
        .await?
        .into_iter()
        .map(|arm| PopulationArmView {
            conservative: arm.rating.conservative(),
            optimistic: arm.rating.optimistic(),
            arm,
        })
        .collect();
    Ok(Json(PopulationView { prompt: prompt.name.to_string(), promotion: prompt.promotion, arms }))
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateVersion {
    /// New base text (default: the parent's).
    #[serde(default)]
    pub base: Option<String>,
    /// New playbook (default: the parent's).
    #[serde(default)]
    pub playbook: Option<Playbook>,
    #[serde(default)]
    pub message: Option<String>,
    /// The version this edit starts from (default: the latest).
    #[serde(default)]
    pub parent: Option<i64>,
    /// Labels to point at the new version (needs `prompts:promote`).
    #[serde(default)]
    pub labels: Vec<String>,
}

/// A version with its rendered text and labels.
#[derive(Debug, Serialize, ToSchema)]
pub struct VersionView {
    #[serde(flatten)]
    pub version: Version,
    pub text: String,
    #[schema(value_type = Vec<String>)]
    pub labels: Vec<LabelName>,
}

impl From<Resolved> for VersionView {
    fn from(r: Resolved) -> Self {
        Self { text: r.version.content.render(), version: r.version, labels: r.labels }
    }
}

#[utoipa::path(post, path = "/v1/prompts/{name}/versions", tag = "versions", params(("name" = String, Path)),
    request_body = CreateVersion, responses((status = 201, body = VersionView), (status = 422, body = super::error::Problem)),
    security(("bearer" = ["prompts:write"])))]
pub async fn create_version(
    State(st): State<AppState>,
    caller: Caller,
    ApiPath(name): ApiPath<String>,
    ApiJson(req): ApiJson<CreateVersion>,
) -> ApiResult<Response> {
    caller.require(Scope::PromptsWrite)?;
    let prompt = existing_prompt(&st, &name).await?;
    let labels = req
        .labels
        .iter()
        .map(|l| LabelName::parse(l).map_err(|e| ApiError::Unprocessable(e.to_string())))
        .collect::<ApiResult<Vec<_>>>()?;
    if !labels.is_empty() {
        caller.require(Scope::PromptsPromote)?;
    }
    let parent_sel = req.parent.map_or(Selector::Latest, Selector::Version);
    let parent = st
        .store
        .resolve(&prompt.name, &parent_sel)
        .await?
        .ok_or_else(|| ApiError::Conflict(format!("parent version {} does not exist", req.parent.unwrap_or(0))))?
        .version;
    let req_has_playbook = req.playbook.is_some();
    let base = req.base.unwrap_or_else(|| parent.content.base.clone());
    let playbook = match req.playbook {
        Some(mut pb) => {
            // Ids the parent handed out are never reissued.
            pb.next_id = pb.next_id.max(parent.content.playbook.as_ref().map_or(0, |p| p.next_id));
            Some(pb)
        }
        None => parent.content.playbook.clone(),
    };
    if prompt.strategy == Strategy::Rewrite && req_has_playbook {
        return Err(ApiError::Conflict("this prompt's strategy is `rewrite`: its versions have no playbook".into()));
    }
    let content = check_content(&st, prompt.strategy, &base, playbook)?;
    let version = NewVersion {
        parent: Some(parent.number),
        source: VersionSource::Manual,
        round_id: None,
        content,
        message: check_message(req.message, "manual edit")?,
        created_by: caller.actor(),
    };
    let moves: Vec<LabelMove> = labels
        .into_iter()
        .map(|label| LabelMove {
            label,
            to_version: 0,
            expected_current: None,
            check_current: false,
            by: caller.actor(),
        })
        .collect();
    let to_production = moves.iter().any(|m| m.label == LabelName::production());
    let created = st.store.create_version(&prompt.name, version, &moves).await?;
    st.cache.invalidate(prompt.name.as_str());
    if to_production {
        crate::service::prompts::production_moved(&st, &prompt.name).await;
    }
    let view = st
        .store
        .resolve(&prompt.name, &Selector::Version(created.number))
        .await?
        .ok_or_else(|| ApiError::Internal(anyhow::anyhow!("version vanished after insert")))?;
    Ok((StatusCode::CREATED, Json(VersionView::from(view))).into_response())
}

#[derive(Debug, Serialize, ToSchema)]
pub struct VersionPage {
    pub versions: Vec<Version>,
    pub next_page_token: Option<String>,
}

#[utoipa::path(get, path = "/v1/prompts/{name}/versions", tag = "versions", params(("name" = String, Path), PageParams),
    responses((status = 200, body = VersionPage)), security(("bearer" = ["prompts:read"])))]
pub async fn list_versions(
    State(st): State<AppState>,
    caller: Caller,
    ApiPath(name): ApiPath<String>,
    ApiQuery(page): ApiQuery<PageParams>,
) -> ApiResult<Json<VersionPage>> {
    caller.require(Scope::PromptsRead)?;
    let prompt = existing_prompt(&st, &name).await?;
    let before = match page.cursor()? {
        Some(c) => Some(c.parse::<i64>().map_err(|_| ApiError::BadRequest("bad `page_token`".into()))?),
        None => None,
    };
    let size = page.size(st.settings.limits.max_page_size);
    let versions = st.store.list_versions(&prompt.name, before, size).await?;
    let next_page_token = next_token(&versions, size, |v| v.number.to_string());
    Ok(Json(VersionPage { versions, next_page_token }))
}

#[utoipa::path(get, path = "/v1/prompts/{name}/versions/{number}", tag = "versions",
    params(("name" = String, Path), ("number" = i64, Path)),
    responses((status = 200, body = VersionView), (status = 404, body = super::error::Problem)), security(("bearer" = ["prompts:read"])))]
pub async fn get_version(
    State(st): State<AppState>,
    caller: Caller,
    ApiPath((name, number)): ApiPath<(String, i64)>,
) -> ApiResult<Json<VersionView>> {
    caller.require(Scope::PromptsRead)?;
    let prompt = existing_prompt(&st, &name).await?;
    let r = st
        .store
        .resolve(&prompt.name, &Selector::Version(number))
        .await?
        .ok_or_else(|| ApiError::not_found(format_args!("version {number} of prompt {:?}", prompt.name)))?;
    Ok(Json(r.into()))
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct DiffQuery {
    pub from: i64,
    pub to: i64,
}

#[utoipa::path(get, path = "/v1/prompts/{name}/diff", tag = "versions", params(("name" = String, Path), DiffQuery),
    responses((status = 200, body = VersionDiff), (status = 404, body = super::error::Problem)), security(("bearer" = ["prompts:read"])))]
pub async fn diff_versions(
    State(st): State<AppState>,
    caller: Caller,
    ApiPath(name): ApiPath<String>,
    ApiQuery(q): ApiQuery<DiffQuery>,
) -> ApiResult<Json<VersionDiff>> {
    caller.require(Scope::PromptsRead)?;
    let prompt = existing_prompt(&st, &name).await?;
    Ok(Json(version_diff(&st, &prompt, q.from, q.to).await?))
}

#[derive(Debug, Serialize, ToSchema)]
pub struct LabelList {
    pub labels: Vec<Label>,
}

#[utoipa::path(get, path = "/v1/prompts/{name}/labels", tag = "labels", params(("name" = String, Path)),
    responses((status = 200, body = LabelList)), security(("bearer" = ["prompts:read"])))]
pub async fn list_labels(
    State(st): State<AppState>,
    caller: Caller,
    ApiPath(name): ApiPath<String>,
) -> ApiResult<Json<LabelList>> {
    caller.require(Scope::PromptsRead)?;
    let prompt = existing_prompt(&st, &name).await?;
    Ok(Json(LabelList { labels: st.store.list_labels(&prompt.name).await? }))
}

/// Checks `If-Match` against the label's current ETag (as `GET ?label=` shows
/// it) and returns the version the label points at now, for the store's CAS.
async fn check_if_match(
    st: &AppState,
    name: &PromptName,
    label: &LabelName,
    headers: &HeaderMap,
) -> ApiResult<(Option<i64>, bool)> {
    let Some(if_match) = headers.get(header::IF_MATCH) else { return Ok((None, false)) };
    let current = match fresh_view(st, name, &Selector::Label(label.clone())).await {
        Ok(v) => v,
        Err(ApiError::NotFound(_)) => {
            return Err(ApiError::PreconditionFailed(format!(
                "label {label:?} does not exist, so If-Match cannot match"
            )));
        }
        Err(e) => return Err(e),
    };
    if !etag_matches(Some(if_match), &current.etag, false) {
        return Err(ApiError::PreconditionFailed(format!(
            "label {label:?} has moved: its current ETag is {}; fetch it again",
            current.etag.to_str().unwrap_or_default()
        )));
    }
    Ok((Some(current.version), true))
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct MoveLabel {
    pub version: i64,
    /// Why, for the label history (at most 2000 characters; longer: 422).
    #[serde(default)]
    pub reason: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct LabelMoved {
    #[serde(flatten)]
    pub label: Label,
    /// The new ETag of `GET /v1/prompts/{name}?label=…`.
    pub etag: String,
}

async fn moved(st: &AppState, name: &PromptName, label: Label) -> ApiResult<Response> {
    st.cache.invalidate(name.as_str());
    let view = fresh_view(st, name, &Selector::Label(label.name.clone())).await?;
    let etag = view.etag.to_str().unwrap_or_default().to_owned();
    let mut res = Json(LabelMoved { label, etag }).into_response();
    res.headers_mut().insert(header::ETAG, view.etag.clone());
    Ok(res)
}

#[utoipa::path(put, path = "/v1/prompts/{name}/labels/{label}", tag = "labels",
    params(("name" = String, Path), ("label" = String, Path), ("If-Match" = Option<String>, Header, description = "ETag of `GET ?label=` — the move fails with 412 if the label moved")),
    request_body = MoveLabel, responses((status = 200, body = LabelMoved), (status = 412, body = super::error::Problem)),
    security(("bearer" = ["prompts:promote"])))]
pub async fn move_label(
    State(st): State<AppState>,
    caller: Caller,
    ApiPath((name, label)): ApiPath<(String, String)>,
    headers: HeaderMap,
    ApiJson(req): ApiJson<MoveLabel>,
) -> ApiResult<Response> {
    caller.require(Scope::PromptsPromote)?;
    let prompt = existing_prompt(&st, &name).await?;
    let label = LabelName::parse(&label).map_err(|e| ApiError::Unprocessable(e.to_string()))?;
    if req.version < 1 {
        return Err(ApiError::Unprocessable("`version` must be at least 1".into()));
    }
    let reason = req.reason.unwrap_or_default();
    // The schema states the bound (`maxLength`), so breaking it is invalid input (422), not a large body.
    if reason.chars().count() > MAX_MESSAGE_CHARS {
        return Err(ApiError::Unprocessable(format!("`reason` is longer than {MAX_MESSAGE_CHARS} characters")));
    }
    let (expected_current, check_current) = check_if_match(&st, &prompt.name, &label, &headers).await?;
    let mv = LabelMove {
        label: label.clone(),
        to_version: req.version,
        expected_current,
        check_current,
        by: caller.actor(),
    };
    let moved_label = move_label_to(&st, &prompt.name, &mv, &MoveCause::new(LabelMoveKind::Promote, reason)).await?;
    moved(&st, &prompt.name, moved_label).await
}

#[utoipa::path(delete, path = "/v1/prompts/{name}/labels/{label}", tag = "labels",
    params(("name" = String, Path), ("label" = String, Path)),
    responses((status = 204), (status = 404, body = super::error::Problem), (status = 409, description = "`production` cannot be deleted", body = super::error::Problem), (status = 422, body = super::error::Problem)),
    security(("bearer" = ["prompts:promote"])))]
pub async fn delete_label(
    State(st): State<AppState>,
    caller: Caller,
    ApiPath((name, label)): ApiPath<(String, String)>,
) -> ApiResult<StatusCode> {
    caller.require(Scope::PromptsPromote)?;
    let prompt = existing_prompt(&st, &name).await?;
    let label = LabelName::parse(&label).map_err(|e| ApiError::Unprocessable(e.to_string()))?;
    if label.as_str() == LabelName::PRODUCTION {
        return Err(ApiError::Conflict("`production` cannot be deleted; move it instead".into()));
    }
    if !st.store.delete_label(&prompt.name, &label, &caller.actor()).await? {
        return Err(ApiError::not_found(format_args!("label {label:?} of prompt {:?}", prompt.name)));
    }
    st.cache.invalidate(prompt.name.as_str());
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Rollback {
    /// The version whose content comes back.
    pub to: i64,
    #[serde(default)]
    pub message: Option<String>,
}

#[utoipa::path(post, path = "/v1/prompts/{name}/rollback", tag = "labels",
    params(("name" = String, Path), ("If-Match" = Option<String>, Header, description = "ETag of the production prompt")),
    request_body = Rollback, responses((status = 201, body = VersionView), (status = 412, body = super::error::Problem)),
    security(("bearer" = ["prompts:promote"])))]
/// Brings an older version's content back as a new version (source
/// `rollback`, parent = the current production version) and makes it production.
pub async fn rollback(
    State(st): State<AppState>,
    caller: Caller,
    ApiPath(name): ApiPath<String>,
    headers: HeaderMap,
    ApiJson(req): ApiJson<Rollback>,
) -> ApiResult<Response> {
    caller.require(Scope::PromptsPromote)?;
    let prompt = existing_prompt(&st, &name).await?;
    let production = LabelName::production();
    if req.to < 1 {
        return Err(ApiError::Unprocessable("`to` must be at least 1".into()));
    }
    let (expected, checked) = check_if_match(&st, &prompt.name, &production, &headers).await?;
    let created = roll_back(&st, &prompt, req.to, req.message, expected.filter(|_| checked), &caller.actor()).await?;
    let view = st
        .store
        .resolve(&prompt.name, &Selector::Version(created.number))
        .await?
        .ok_or_else(|| ApiError::Internal(anyhow::anyhow!("version vanished after insert")))?;
    let etag = fresh_view(&st, &prompt.name, &Selector::Label(production)).await?.etag.clone();
    let mut res = (StatusCode::CREATED, Json(VersionView::from(view))).into_response();
    res.headers_mut().insert(header::ETAG, etag);
    Ok(res)
}
