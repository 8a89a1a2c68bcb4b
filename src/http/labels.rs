//! Label routes: list a prompt's labels, move or delete one (guarded by
//! `If-Match` on the label's current text), and roll production back.

use crate::service::audit::Audit;
use axum::{
    Json,
    extract::State,
    http::{HeaderMap, HeaderValue, StatusCode, header},
    response::{IntoResponse, Response},
};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::{
    AppState,
    error::{ApiError, ApiResult},
    extract::{ApiJson, ApiPath, Authorized, scope},
    prompts::{etag, etag_matches, fresh_view},
    versions::VersionView,
};
use crate::service::projects::PathPrompt;
use crate::{
    domain::{
        LabelMoveKind, LabelName, MoveCause, PromptName,
        label::{Label, LabelMove, Selector},
    },
    service::{
        ServiceError,
        labels::{self, check_move, check_version_number, move_label_to, roll_back},
        prompts::{self, existing_prompt},
    },
};

#[derive(Debug, Serialize, ToSchema)]
pub struct LabelList {
    pub labels: Vec<Label>,
}

#[utoipa::path(get, path = "/v1/prompts/{name}/labels", tag = "labels", params(("name" = String, Path)),
    responses((status = 200, body = LabelList)), security(("bearer" = ["prompts:read"])))]
pub async fn list_labels(
    State(st): State<AppState>,
    _caller: Authorized<scope::PromptsRead>,
    PathPrompt(name): PathPrompt,
) -> ApiResult<Json<LabelList>> {
    let prompt = existing_prompt(&st, &name).await?;
    Ok(Json(LabelList { labels: labels::list_labels(&st, &prompt.name).await? }))
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
        Err(ApiError::Service(ServiceError::NotFound(_))) => {
            return Err(ApiError::precondition_failed(format!(
                "label {label:?} does not exist, so If-Match cannot match"
            )));
        }
        Err(e) => return Err(e),
    };
    if !etag_matches(Some(if_match), &current.etag, false) {
        return Err(ApiError::precondition_failed(format!(
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
    caller: Authorized<scope::PromptsPromote>,
    PathPrompt(name): PathPrompt,
    ApiPath((_name, label)): ApiPath<(String, String)>,
    headers: HeaderMap,
    ApiJson(req): ApiJson<MoveLabel>,
) -> ApiResult<Response> {
    let prompt = existing_prompt(&st, &name).await?;
    let label = LabelName::parse(&label).map_err(|e| ApiError::unprocessable(e.to_string()))?;
    let reason = check_move(req.version, req.reason)?;
    let (expected_current, check_current) = check_if_match(&st, &prompt.name, &label, &headers).await?;
    let mv = LabelMove {
        label: label.clone(),
        to_version: req.version,
        expected_current,
        check_current,
        by: caller.actor(),
    };
    let before = label_now(&st, &prompt.name, &label).await?;
    let moved_label = move_label_to(&st, &prompt.name, &mv, &MoveCause::new(LabelMoveKind::Promote, reason)).await?;
    let audit = Audit::new("label.move", "label", format!("{}/{label}", prompt.name)).before(before);
    let mut res = moved(&st, &prompt.name, moved_label).await?;
    res.extensions_mut().insert(audit);
    Ok(res)
}

/// The label as it is now, for an audit entry's `before`.
async fn label_now(st: &AppState, prompt: &PromptName, label: &LabelName) -> ApiResult<Option<Label>> {
    Ok(labels::list_labels(st, prompt).await?.into_iter().find(|l| &l.name == label))
}

#[utoipa::path(delete, path = "/v1/prompts/{name}/labels/{label}", tag = "labels",
    params(("name" = String, Path), ("label" = String, Path)),
    responses((status = 204), (status = 404, body = super::error::Problem), (status = 409, description = "`production` cannot be deleted", body = super::error::Problem), (status = 422, body = super::error::Problem)),
    security(("bearer" = ["prompts:promote"])))]
pub async fn delete_label(
    State(st): State<AppState>,
    caller: Authorized<scope::PromptsPromote>,
    PathPrompt(name): PathPrompt,
    ApiPath((_name, label)): ApiPath<(String, String)>,
) -> ApiResult<(StatusCode, Audit)> {
    let prompt = existing_prompt(&st, &name).await?;
    let label = LabelName::parse(&label).map_err(|e| ApiError::unprocessable(e.to_string()))?;
    let before = label_now(&st, &prompt.name, &label).await?;
    labels::delete_label(&st, &prompt, &label, &caller.actor()).await?;
    Ok((StatusCode::NO_CONTENT, Audit::new("label.delete", "label", format!("{}/{label}", prompt.name)).before(before)))
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
    caller: Authorized<scope::PromptsPromote>,
    PathPrompt(name): PathPrompt,
    headers: HeaderMap,
    ApiJson(req): ApiJson<Rollback>,
) -> ApiResult<Response> {
    let prompt = existing_prompt(&st, &name).await?;
    let production = LabelName::production();
    check_version_number("to", req.to)?;
    let (expected, checked) = check_if_match(&st, &prompt.name, &production, &headers).await?;
    let before = label_now(&st, &prompt.name, &production).await?;
    let created = roll_back(&st, &prompt, req.to, req.message, expected.filter(|_| checked), &caller.actor()).await?;
    let view = prompts::resolved(&st, &prompt.name, &Selector::Version(created.number)).await?;
    // The new version is production: its ETag is the one `GET ?label=production` answers.
    let etag = HeaderValue::from_str(&etag(&view)).map_err(|e| ApiError::internal(e.into()))?;
    let audit = Audit::new("prompt.rollback", "prompt", &prompt.name).before(before);
    let mut res = (StatusCode::CREATED, audit, Json(VersionView::from(view))).into_response();
    res.headers_mut().insert(header::ETAG, etag);
    Ok(res)
}
