//! The UI's state-changing forms: promote a version to production and roll
//! back to a version. Both are POSTs carrying the session's CSRF token and the
//! production version the page showed, so a stale page cannot undo someone
//! else's change (it gets a 412 page instead).

use axum::{
    Form,
    extract::{Path, State},
    response::{IntoResponse, Redirect, Response},
};
use serde::Deserialize;

use super::{UiError, session::Operator};
use crate::{
    domain::LabelName,
    http::{AppState, error::ApiError, prompts},
    store::{LabelMove, Scope},
};

#[derive(Deserialize)]
pub struct VersionForm {
    #[serde(default)]
    csrf: Option<String>,
    #[serde(default)]
    version: Option<String>,
    /// The production version the page showed.
    #[serde(default)]
    expected: Option<String>,
}

fn number(v: Option<&str>, what: &str) -> Result<i64, UiError> {
    v.and_then(|s| s.trim().parse::<i64>().ok())
        .filter(|n| *n >= 1)
        .ok_or_else(|| UiError::Api(ApiError::BadRequest(format!("`{what}` must be a version number"))))
}

/// Checks, in this order: the CSRF token, the scope, the numbers.
fn checked(op: &Operator, form: &VersionForm) -> Result<(i64, i64), UiError> {
    op.check_csrf(form.csrf.as_deref())?;
    op.require(Scope::PromptsPromote)?;
    Ok((number(form.version.as_deref(), "version")?, number(form.expected.as_deref(), "expected")?))
}

fn back(name: &str, notice: &str, version: i64) -> Response {
    Redirect::to(&format!("/ui/prompts/{}?notice={notice}&v={version}", super::html::url_encode(name))).into_response()
}

pub async fn promote(
    State(st): State<AppState>,
    op: Operator,
    Path(name): Path<String>,
    Form(form): Form<VersionForm>,
) -> Result<Response, UiError> {
    let (version, expected) = checked(&op, &form)?;
    let prompt = prompts::existing_prompt(&st, &name).await?;
    let mv = LabelMove {
        label: LabelName::production(),
        to_version: version,
        expected_current: Some(expected),
        check_current: true,
        by: op.actor(),
    };
    prompts::move_label_to(&st, &prompt.name, &mv).await?;
    tracing::info!(prompt = %prompt.name, version, by = %op.actor(), "promoted from the web UI");
    Ok(back(prompt.name.as_str(), "promoted", version))
}

pub async fn rollback(
    State(st): State<AppState>,
    op: Operator,
    Path(name): Path<String>,
    Form(form): Form<VersionForm>,
) -> Result<Response, UiError> {
    let (to, expected) = checked(&op, &form)?;
    let prompt = prompts::existing_prompt(&st, &name).await?;
    let created = prompts::roll_back(&st, &prompt, to, None, Some(expected), &op.actor()).await?;
    tracing::info!(prompt = %prompt.name, to, new_version = created.number, by = %op.actor(), "rolled back from the web UI");
    Ok(back(prompt.name.as_str(), "rolled_back", created.number))
}
