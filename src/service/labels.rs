//! Label operations both front ends call: list a prompt's labels, move one
//! (recording why in the label history), delete one, roll `production` back
//! to an older version's content, and read the label history. A move of
//! `production` is followed by the population and the served prompts' cache.

use super::{
    AppState, ServiceError, ServiceResult,
    production::Mover,
    prompts::{MAX_MESSAGE_CHARS, check_message, resolve},
};
use crate::{
    domain::{
        LabelHistoryEntry, LabelName, MoveCause, Prompt, PromptName, Version, VersionSource,
        label::{Label, LabelMove, Selector},
        prompt::NewVersion,
    },
    store::StoreError,
};

pub async fn list_labels(st: &AppState, prompt: &PromptName) -> ServiceResult<Vec<Label>> {
    Ok(st.store.list_labels(prompt).await?)
}

/// A version number named in a request (`what`): from 1.
pub fn check_version_number(what: &str, n: i64) -> ServiceResult<()> {
    if n < 1 {
        return Err(ServiceError::Unprocessable(format!("`{what}` must be at least 1")));
    }
    Ok(())
}

/// The rules of a requested move: a version number from 1, and a reason for
/// the label history of at most [`MAX_MESSAGE_CHARS`]; the reason to record.
pub fn check_move(version: i64, reason: Option<String>) -> ServiceResult<String> {
    check_version_number("version", version)?;
    let reason = reason.unwrap_or_default();
    // The API's schema states the bound (`maxLength`), so breaking it is invalid input (422), not a large body.
    if reason.chars().count() > MAX_MESSAGE_CHARS {
        return Err(ServiceError::Unprocessable(format!("`reason` is longer than {MAX_MESSAGE_CHARS} characters")));
    }
    Ok(reason)
}

pub(super) fn store_move_error(e: StoreError, label: &LabelName) -> ServiceError {
    match e {
        StoreError::Conflict => {
            ServiceError::PreconditionFailed(format!("label {label:?} moved meanwhile; fetch it again"))
        }
        // The version named does not exist (yet): a conflict with the prompt's state.
        StoreError::Invalid(msg) => ServiceError::Conflict(msg),
        other => other.into(),
    }
}

/// Applies a label move, recording `cause` in the label history, and drops
/// the cached views; a move of `production` goes through its one door
/// ([`Mover::move_production`]). Shared with the web UI.
pub async fn move_label_to(
    st: &AppState,
    name: &PromptName,
    mv: &LabelMove,
    cause: &MoveCause,
) -> ServiceResult<Label> {
    if mv.label == LabelName::production() {
        return Mover::of(st).move_production(name, mv, cause).await.map_err(|e| store_move_error(e, &mv.label));
    }
    let label = st.store.move_label_because(name, mv, cause).await.map_err(|e| store_move_error(e, &mv.label))?;
    st.cache.invalidate(name.as_str());
    Ok(label)
}

/// Deletes a label other than `production`, recorded in the label history.
pub async fn delete_label(st: &AppState, prompt: &Prompt, label: &LabelName, actor: &str) -> ServiceResult<()> {
    if label.as_str() == LabelName::PRODUCTION {
        return Err(ServiceError::Conflict("`production` cannot be deleted; move it instead".into()));
    }
    if !st.store.delete_label(&prompt.name, label, actor).await? {
        return Err(ServiceError::not_found(format_args!("label {label:?} of prompt {:?}", prompt.name)));
    }
    st.cache.invalidate(prompt.name.as_str());
    Ok(())
}

/// Brings version `to`'s content back as a new version made production.
/// Given `expected_production`, fails with 412 unless production still points
/// there (the API's `If-Match`, the web UI's version on the page).
pub async fn roll_back(
    st: &AppState,
    prompt: &Prompt,
    to: i64,
    message: Option<String>,
    expected_production: Option<i64>,
    actor: &str,
) -> ServiceResult<Version> {
    check_version_number("to", to)?;
    let production = LabelName::production();
    let current = match expected_production {
        Some(v) => Some(v),
        None => resolve(st, &prompt.name, &Selector::Label(production.clone())).await?.map(|r| r.version.number),
    };
    let target = resolve(st, &prompt.name, &Selector::Version(to))
        .await?
        .ok_or_else(|| ServiceError::Conflict(format!("version {to} does not exist")))?
        .version;
    let version = NewVersion {
        parent: current,
        source: VersionSource::Rollback,
        round_id: None,
        content: target.content,
        message: check_message(message, &format!("rollback to v{to}"))?,
        created_by: actor.to_owned(),
    };
    let mv = LabelMove {
        label: production.clone(),
        to_version: 0,
        expected_current: current,
        check_current: expected_production.is_some(),
        by: actor.to_owned(),
    };
    let created =
        st.store.create_version(&prompt.name, version, &[mv]).await.map_err(|e| store_move_error(e, &production))?;
    Mover::of(st).followed(&prompt.name).await;
    Ok(created)
}

/// The prompt's label history, newest first: moves with ids below `before`,
/// of `label` only when given.
pub async fn label_history(
    st: &AppState,
    prompt: &PromptName,
    label: Option<&LabelName>,
    before: Option<i64>,
    limit: u32,
) -> ServiceResult<Vec<LabelHistoryEntry>> {
    Ok(st.store.label_history(prompt, label, before, limit).await?)
}

/// The moves of `production` since `since`, newest first (at most `limit`).
pub async fn production_moves_since(
    st: &AppState,
    prompt: &PromptName,
    since: chrono::DateTime<chrono::Utc>,
    limit: u32,
) -> ServiceResult<Vec<LabelHistoryEntry>> {
    let moves = st.store.label_history(prompt, Some(&LabelName::production()), None, limit).await?;
    Ok(moves.into_iter().filter(|m| m.at >= since).collect())
}
