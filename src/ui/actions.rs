//! The UI's state-changing forms: promote a version to production and roll
//! back to a version. Both are POSTs carrying the session's CSRF token and the
//! production version the page showed, so a stale page cannot undo someone
//! else's change (it gets a 412 page instead). Quarantine, release and delete
//! of a trace (containing a poisoned stream), pinning it as a regression case,
//! and an operator's label of a trace (a score and a comment) are POSTs with
//! the CSRF token too.

use axum::{
    Form,
    extract::{Path, State},
    response::{IntoResponse, Redirect, Response},
};
use serde::Deserialize;

use super::{UiError, session::Operator};
use crate::{
    domain::{LabelMoveKind, LabelName, MoveCause, access::Scope, label::LabelMove},
    service::{
        AppState, ServiceError,
        audit::{Audit, trace_change},
        labels,
        projects::PathPrompt,
        prompts, regression, traces,
    },
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
        .ok_or_else(|| UiError::Service(ServiceError::BadRequest(format!("`{what}` must be a version number"))))
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
    PathPrompt(found): PathPrompt,
    Path(name): Path<String>,
    Form(form): Form<VersionForm>,
) -> Result<Response, UiError> {
    let (version, expected) = checked(&op, &form)?;
    let prompt = prompts::existing_prompt(&st, &found).await?;
    let mv = LabelMove {
        label: LabelName::production(),
        to_version: version,
        expected_current: Some(expected),
        check_current: true,
        by: op.actor(),
    };
    let cause = MoveCause::new(LabelMoveKind::Promote, "promoted in the web UI");
    let moved = labels::move_label_to(&st, &prompt.name, &mv, &cause).await?;
    tracing::info!(prompt = %prompt.name, version, by = %op.actor(), "promoted from the web UI");
    let audit = Audit::new("label.move", "label", format!("{}/production", prompt.name))
        .before(serde_json::json!({"name": "production", "version": expected}))
        .after(moved);
    Ok((audit, back(&name, "promoted", version)).into_response())
}

pub async fn rollback(
    State(st): State<AppState>,
    op: Operator,
    PathPrompt(found): PathPrompt,
    Path(name): Path<String>,
    Form(form): Form<VersionForm>,
) -> Result<Response, UiError> {
    let (to, expected) = checked(&op, &form)?;
    let prompt = prompts::existing_prompt(&st, &found).await?;
    let created = labels::roll_back(&st, &prompt, to, None, Some(expected), &op.actor()).await?;
    tracing::info!(prompt = %prompt.name, to, new_version = created.number, by = %op.actor(), "rolled back from the web UI");
    let audit = Audit::new("prompt.rollback", "prompt", &prompt.name)
        .before(serde_json::json!({"name": "production", "version": expected}))
        .after(serde_json::json!({"name": "production", "version": created.number, "content_of": to}));
    Ok((audit, back(&name, "rolled_back", created.number)).into_response())
}

#[derive(Deserialize)]
pub struct TraceForm {
    #[serde(default)]
    csrf: Option<String>,
    #[serde(default)]
    reason: Option<String>,
}

fn trace_id(id: &str) -> Result<uuid::Uuid, UiError> {
    uuid::Uuid::parse_str(id).map_err(|_| UiError::NotFound("No such trace: ids are UUIDs.".into()))
}

/// A trace button's form: the CSRF token, the scope, the trace id.
fn trace_form(op: &Operator, form: &TraceForm, id: &str) -> Result<uuid::Uuid, UiError> {
    op.check_csrf(form.csrf.as_deref())?;
    op.require(Scope::PromptsWrite)?;
    trace_id(id)
}

/// The trace page's buttons: Quarantine holds the trace back from learning
/// (with the operator's reason, if given), Release lifts that, Delete removes
/// the trace and goes back to the trace list, Pin keeps its input as a
/// regression case of its prompt.
pub async fn trace_button(
    State(st): State<AppState>,
    op: Operator,
    Path((id, button)): Path<(String, String)>,
    Form(form): Form<TraceForm>,
) -> Result<Response, UiError> {
    if !["quarantine", "release", "delete", "pin"].contains(&button.as_str()) {
        return Err(UiError::NotFound("No such page.".into()));
    }
    let id = trace_form(&op, &form, &id)?;
    // The same rules as the API's (a reason of at most 500 characters); a
    // trace that is not there is the UI's own not-found page.
    let not_found = |e: ServiceError| match e {
        ServiceError::NotFound(_) => UiError::NotFound(format!("Trace {id} not found.")),
        other => other.into(),
    };
    let before = traces::get_trace(&st, id).await.map_err(not_found)?;
    let (to, audit) = match button.as_str() {
        "quarantine" => {
            let after = traces::quarantine_trace(&st, id, form.reason, &op.actor()).await.map_err(not_found)?;
            (format!("/ui/traces/{id}?notice=quarantined"), trace_change("trace.quarantine", &before, Some(&after)))
        }
        "release" => {
            let after = traces::release_trace(&st, id, &op.actor()).await.map_err(not_found)?;
            (format!("/ui/traces/{id}?notice=released"), trace_change("trace.release", &before, Some(&after)))
        }
        "pin" => {
            let case = regression::pin_trace(&st, id, regression::PinRequest::default(), &op.actor())
                .await
                .map_err(not_found)?;
            let audit = Audit::new("regression_case.pin", "regression_case", case.id).after(&case);
            (format!("/ui/traces/{id}?notice=pinned"), audit)
        }
        _ => {
            traces::delete_trace(&st, id, &op.actor()).await.map_err(not_found)?;
            ("/ui/traces?notice=deleted".to_owned(), trace_change("trace.delete", &before, None))
        }
    };
    Ok((audit, Redirect::to(&to)).into_response())
}

#[derive(Deserialize)]
pub struct LabelForm {
    #[serde(default)]
    csrf: Option<String>,
    #[serde(default)]
    score: Option<String>,
    #[serde(default)]
    comment: Option<String>,
}

/// The trace page's label form: the operator's score (0 to 1) and comment,
/// stored as human feedback: it replaces a judged reward, and calibration
/// counts it.
pub async fn label_trace(
    State(st): State<AppState>,
    op: Operator,
    Path(id): Path<String>,
    Form(form): Form<LabelForm>,
) -> Result<Response, UiError> {
    op.check_csrf(form.csrf.as_deref())?;
    op.require(Scope::PromptsWrite)?;
    let id = trace_id(&id)?;
    let score =
        form.score.as_deref().and_then(|s| s.trim().parse::<f64>().ok()).filter(|s| s.is_finite()).ok_or_else(
            || UiError::Service(ServiceError::BadRequest("the score must be a number from 0 to 1".into())),
        )?;
    let label = serde_json::json!({"score": score, "comment": form.comment});
    traces::label_trace(&st, id, score, form.comment).await.map_err(|e| match e {
        ServiceError::NotFound(_) => UiError::NotFound(format!("Trace {id} not found.")),
        other => other.into(),
    })?;
    tracing::info!(trace = %id, score, by = %op.actor(), "labelled in the web UI");
    let audit = Audit::new("trace.label", "trace", id).after(label);
    Ok((audit, Redirect::to(&format!("/ui/traces/{id}?notice=labelled"))).into_response())
}
