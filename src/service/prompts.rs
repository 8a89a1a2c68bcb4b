//! Prompt operations both front ends call: create a prompt (seeding the
//! population of an `evaluated` one), find a prompt by its name in a path,
//! add a version, diff two versions, move a label (recording why), and roll back.

use serde::Serialize;
use utoipa::ToSchema;

use super::{AppState, ServiceError, ServiceResult};
use crate::{
    domain::{
        LabelName, MoveCause, Promotion, Prompt, PromptName, Strategy, Version, VersionSource,
        diff::{DiffLine, PlaybookDiff, playbook_diff, text_diff},
        prompt::NewVersion,
    },
    store::{Label, LabelMove, NewPrompt, Selector, StoreError},
    worker::population::{first_champion, follow_production},
};

pub const MAX_MESSAGE_CHARS: usize = 2000;

pub fn parse_name(name: &str) -> ServiceResult<PromptName> {
    PromptName::parse(name).map_err(|e| ServiceError::NotFound(format!("no such prompt: {e}")))
}

pub async fn existing_prompt(st: &AppState, name: &str) -> ServiceResult<Prompt> {
    let name = parse_name(name)?;
    st.store.get_prompt(&name).await?.ok_or_else(|| ServiceError::not_found(format_args!("prompt {name:?}")))
}

pub fn check_message(message: Option<String>, default: &str) -> ServiceResult<String> {
    let m = message.unwrap_or_else(|| default.to_owned());
    if m.chars().count() > MAX_MESSAGE_CHARS {
        return Err(ServiceError::PayloadTooLarge(format!("`message` is longer than {MAX_MESSAGE_CHARS} characters")));
    }
    Ok(m)
}

/// Creates a prompt with version 1 as `production`. Under `evaluated` its
/// population starts at once — version 1 as champion at the prior with all
/// the traffic — so the first GET already names the arm, also on an API-only
/// deployment where no worker's rater ever runs.
pub async fn create_prompt(st: &AppState, new: NewPrompt, first: NewVersion) -> ServiceResult<(Prompt, Version)> {
    let name = new.name.clone();
    let (prompt, version) = st.store.create_prompt(new, first).await.map_err(|e| match e {
        StoreError::AlreadyExists => ServiceError::Conflict(format!("a prompt named {name:?} already exists")),
        other => other.into(),
    })?;
    if prompt.promotion == Promotion::Evaluated
        && let Err(e) = st.store.save_population(&name, &[first_champion(version.number)]).await
    {
        // The prompt exists and serves production; a rater reconciles the population later.
        tracing::warn!(prompt = %name, error = %e, "the new prompt's population was not seeded");
    }
    st.cache.invalidate(name.as_str());
    Ok((prompt, version))
}

/// Stores a new version of `name` with the label moves made with it; what
/// follows labels keeps in step: the served prompts' cache and, when
/// `production` moved, the population.
pub async fn add_version(
    st: &AppState,
    name: &PromptName,
    version: NewVersion,
    moves: &[LabelMove],
) -> ServiceResult<Version> {
    let created = st.store.create_version(name, version, moves).await?;
    if moves.iter().any(|m| m.label == LabelName::production()) {
        production_moved(st, name).await; // invalidates after the population followed
    } else {
        st.cache.invalidate(name.as_str());
    }
    Ok(created)
}

/// After `production` of `name` moved by an operator's hand: the population
/// (if the prompt has one) follows at once, so the new production version is
/// what agents are served as the champion; a failure here is logged (the
/// move stands and the rater reconciles on its next tick).
async fn production_moved(st: &AppState, name: &PromptName) {
    if let Err(e) = follow_production(&st.store, name, &st.settings.population.policy()).await {
        tracing::warn!(prompt = %name, error = %e, "the population did not follow production yet");
    }
    st.cache.invalidate(name.as_str());
}

#[derive(Debug, Serialize, ToSchema)]
pub struct VersionDiff {
    pub from: i64,
    pub to: i64,
    /// A unified diff of the rendered texts.
    pub unified: String,
    pub lines: Vec<DiffLine>,
    /// Bullets added, removed and changed (playbook prompts).
    pub playbook: Option<PlaybookDiff>,
}

/// The diff of two versions, as the route and the web UI show it.
pub async fn version_diff(st: &AppState, prompt: &Prompt, from: i64, to: i64) -> ServiceResult<VersionDiff> {
    let load = |n: i64| {
        let st = st.clone();
        let name = prompt.name.clone();
        async move {
            st.store
                .resolve(&name, &Selector::Version(n))
                .await?
                .map(|r| r.version)
                .ok_or_else(|| ServiceError::not_found(format_args!("version {n} of prompt {name:?}")))
        }
    };
    let (a, b) = (load(from).await?, load(to).await?);
    let (unified, lines) =
        text_diff(&a.content.render(), &b.content.render(), &format!("v{}", a.number), &format!("v{}", b.number));
    let playbook = (prompt.strategy == Strategy::Playbook)
        .then(|| playbook_diff(a.content.playbook.as_ref(), b.content.playbook.as_ref()));
    Ok(VersionDiff { from: a.number, to: b.number, unified, lines, playbook })
}

pub fn store_move_error(e: StoreError, label: &LabelName) -> ServiceError {
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
/// the cached views; shared with the web UI.
pub async fn move_label_to(
    st: &AppState,
    name: &PromptName,
    mv: &LabelMove,
    cause: &MoveCause,
) -> ServiceResult<Label> {
    let label = st.store.move_label_because(name, mv, cause).await.map_err(|e| store_move_error(e, &mv.label))?;
    if mv.label == LabelName::production() {
        production_moved(st, name).await; // invalidates after the population followed
    } else {
        st.cache.invalidate(name.as_str());
    }
    Ok(label)
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
    let production = LabelName::production();
    let current = match expected_production {
        Some(v) => Some(v),
        None => st.store.resolve(&prompt.name, &Selector::Label(production.clone())).await?.map(|r| r.version.number),
    };
    let target = st
        .store
        .resolve(&prompt.name, &Selector::Version(to))
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
    production_moved(st, &prompt.name).await;
    Ok(created)
}
