//! Prompt and version operations both front ends call: create a prompt
//! (seeding the population of an `evaluated` one), find a prompt by the name
//! in a path, list prompts, resolve a selector, list and add versions (the
//! content rules live here), diff two versions, change a prompt's settings,
//! and read the live arms an `evaluated` prompt is served from.
//! Label moves and rollback are in `labels.rs`.

use std::sync::Arc;

use serde::Serialize;
use utoipa::ToSchema;

use super::{AppState, ServiceError, ServiceResult, error::plain_serde_error, population, production::Mover};
use crate::{
    cache::ServedArms,
    domain::{
        LabelName, Playbook, Promotion, Prompt, PromptName, PromptSettings, Strategy, Version, VersionContent,
        VersionSource,
        diff::{DiffLine, PlaybookDiff, playbook_diff, text_diff},
        label::{LabelMove, Resolved, Selector},
        population::ArmState,
        project::ListFilter,
        prompt::{NewPrompt, NewVersion, PromptSummary},
    },
    store::StoreError,
};

/// Longest version message or label-move reason, in characters.
pub const MAX_MESSAGE_CHARS: usize = 2000;

/// The prompt `name` (found within the caller's reach before, see
/// [`super::projects::prompt_in_reach`]).
pub async fn existing_prompt(st: &AppState, name: &PromptName) -> ServiceResult<Prompt> {
    st.store.get_prompt(name).await?.ok_or_else(|| ServiceError::not_found(format_args!("prompt {name:?}")))
}

/// A version message: `default` when none is given; longer than
/// [`MAX_MESSAGE_CHARS`] is too large.
pub fn check_message(message: Option<String>, default: &str) -> ServiceResult<String> {
    let m = message.unwrap_or_else(|| default.to_owned());
    if m.chars().count() > MAX_MESSAGE_CHARS {
        return Err(ServiceError::PayloadTooLarge(format!("`message` is longer than {MAX_MESSAGE_CHARS} characters")));
    }
    Ok(m)
}

/// A version's content as given: a non-empty base within
/// `limits.max_prompt_bytes`, a normalised playbook (playbook prompts only),
/// a rendered text at most twice the limit.
pub fn check_content(
    st: &AppState,
    strategy: Strategy,
    base: &str,
    playbook: Option<Playbook>,
) -> ServiceResult<VersionContent> {
    let limit = st.settings.limits.max_prompt_bytes;
    if base.trim().is_empty() {
        return Err(ServiceError::Unprocessable("`base` must not be empty".into()));
    }
    if base.len() > limit {
        return Err(ServiceError::PayloadTooLarge(format!(
            "`base` is {} bytes; the limit is {limit} (`limits.max_prompt_bytes`)",
            base.len()
        )));
    }
    let playbook = match (strategy, playbook) {
        (Strategy::Rewrite, Some(_)) => {
            return Err(ServiceError::Unprocessable("a prompt with strategy `rewrite` has no playbook".into()));
        }
        (_, Some(pb)) => Some(pb.normalized().map_err(|e| ServiceError::Unprocessable(format!("playbook: {e}")))?),
        (_, None) => None,
    };
    let content = VersionContent { base: base.to_owned(), playbook };
    let rendered = content.render().len();
    if rendered > limit * 2 {
        return Err(ServiceError::PayloadTooLarge(format!("the rendered prompt is {rendered} bytes; too large")));
    }
    Ok(content)
}

/// Creates a prompt with version 1 as `production`. Under `evaluated` its
/// population starts at once — version 1 as champion at the prior with all
/// the traffic — so the first GET already names the arm, also on an API-only
/// deployment where no worker's rater ever runs.
pub async fn create_prompt(st: &AppState, new: NewPrompt, first: NewVersion) -> ServiceResult<(Prompt, Version)> {
    let name = new.name.clone();
    let (prompt, version) = st.store.create_prompt(new, first).await.map_err(|e| match e {
        // Names are unique within a project: this one's own prompt holds it.
        StoreError::AlreadyExists => {
            ServiceError::Conflict(format!("a prompt named {name:?} already exists in project {}", name.project()))
        }
        other => other.into(),
    })?;
    if prompt.promotion == Promotion::Evaluated
        && let Err(e) = population::seed(st, &name, version.number).await
    {
        // The prompt exists and serves production; a rater reconciles the population later.
        tracing::warn!(prompt = %name, error = %e, "the new prompt's population was not seeded");
    }
    st.cache.invalidate(name.as_str());
    Ok((prompt, version))
}

/// Prompts ordered by name (then project), after `after`, of the projects `filter` shows.
pub async fn list_prompts(
    st: &AppState,
    filter: &ListFilter,
    after: Option<&PromptName>,
    limit: u32,
) -> ServiceResult<Vec<PromptSummary>> {
    if *filter == ListFilter::Nothing {
        return Ok(Vec::new());
    }
    Ok(st.store.list_prompts(after, filter.project(), limit).await?)
}

/// The version `selector` names, with its labels; `None` when there is none.
pub async fn resolve(st: &AppState, name: &PromptName, selector: &Selector) -> ServiceResult<Option<Resolved>> {
    Ok(st.store.resolve(name, selector).await?)
}

/// The version `selector` names; a 404 that says whether the prompt, the
/// label or the version is missing.
pub async fn resolved(st: &AppState, name: &PromptName, selector: &Selector) -> ServiceResult<Resolved> {
    if let Some(resolved) = st.store.resolve(name, selector).await? {
        return Ok(resolved);
    }
    if st.store.get_prompt(name).await?.is_none() {
        return Err(ServiceError::not_found(format_args!("prompt {name:?}")));
    }
    Err(match selector {
        Selector::Label(l) => ServiceError::not_found(format_args!("label {l:?} of prompt {name:?}")),
        Selector::Version(n) => ServiceError::not_found(format_args!("version {n} of prompt {name:?}")),
        Selector::Latest => ServiceError::not_found(format_args!("prompt {name:?}")),
    })
}

/// The number of the prompt's latest version (0 for none).
pub async fn latest_number(st: &AppState, name: &PromptName) -> ServiceResult<i64> {
    Ok(st.store.resolve(name, &Selector::Latest).await?.map_or(0, |r| r.version.number))
}

/// Versions newest first, with numbers below `before`.
pub async fn list_versions(
    st: &AppState,
    name: &PromptName,
    before: Option<i64>,
    limit: u32,
) -> ServiceResult<Vec<Version>> {
    Ok(st.store.list_versions(name, before, limit).await?)
}

/// A version made by hand: what differs from its parent.
#[derive(Debug, Default)]
pub struct VersionEdit {
    /// New base text (default: the parent's).
    pub base: Option<String>,
    /// New playbook (default: the parent's).
    pub playbook: Option<Playbook>,
    pub message: Option<String>,
    /// The version this edit starts from (default: the latest).
    pub parent: Option<i64>,
    /// Labels to point at the new version.
    pub labels: Vec<LabelName>,
}

/// Makes a version by hand from `edit` and moves `edit.labels` to it; the
/// new version with its labels.
pub async fn create_version(st: &AppState, prompt: &Prompt, edit: VersionEdit, actor: &str) -> ServiceResult<Resolved> {
    let parent_sel = edit.parent.map_or(Selector::Latest, Selector::Version);
    let parent = st
        .store
        .resolve(&prompt.name, &parent_sel)
        .await?
        .ok_or_else(|| ServiceError::Conflict(format!("parent version {} does not exist", edit.parent.unwrap_or(0))))?
        .version;
    let has_playbook = edit.playbook.is_some();
    let base = edit.base.unwrap_or_else(|| parent.content.base.clone());
    let playbook = match edit.playbook {
        Some(mut pb) => {
            // Ids the parent handed out are never reissued.
            pb.next_id = pb.next_id.max(parent.content.playbook.as_ref().map_or(0, |p| p.next_id));
            Some(pb)
        }
        None => parent.content.playbook.clone(),
    };
    if prompt.strategy == Strategy::Rewrite && has_playbook {
        return Err(ServiceError::Conflict(
            "this prompt's strategy is `rewrite`: its versions have no playbook".into(),
        ));
    }
    let content = check_content(st, prompt.strategy, &base, playbook)?;
    let version = NewVersion {
        parent: Some(parent.number),
        source: VersionSource::Manual,
        round_id: None,
        content,
        message: check_message(edit.message, "manual edit")?,
        created_by: actor.to_owned(),
    };
    let moves: Vec<LabelMove> = edit
        .labels
        .into_iter()
        .map(|label| LabelMove {
            label,
            to_version: 0,
            expected_current: None,
            check_current: false,
            by: actor.to_owned(),
        })
        .collect();
    let created = add_version(st, &prompt.name, version, &moves).await?;
    st.store
        .resolve(&prompt.name, &Selector::Version(created.number))
        .await?
        .ok_or_else(|| ServiceError::Internal(anyhow::anyhow!("version vanished after insert")))
}

/// Stores a new version of `name` with the label moves made with it; what
/// follows labels keeps in step: the served prompts' cache and, when
/// `production` moved, the population.
pub(super) async fn add_version(
    st: &AppState,
    name: &PromptName,
    version: NewVersion,
    moves: &[LabelMove],
) -> ServiceResult<Version> {
    let created = st.store.create_version(name, version, moves).await?;
    if moves.iter().any(|m| m.label == LabelName::production()) {
        Mover::of(st).followed(name).await; // invalidates after the population followed
    } else {
        st.cache.invalidate(name.as_str());
    }
    Ok(created)
}

/// The live arms of an `evaluated` prompt (empty for other prompts), cached
/// like the prompt's text and dropped with it on every change.
pub async fn served_arms(st: &AppState, name: &PromptName) -> ServiceResult<Arc<ServedArms>> {
    if let Some(hit) = st.cache.get_arms(name) {
        return Ok(hit);
    }
    let generation = st.cache.generation();
    let prompt = existing_prompt(st, name).await?;
    let served = if prompt.promotion == Promotion::Evaluated {
        let population = st.store.live_arms(&prompt.name, &[]).await?;
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
    st.cache.insert_arms(&prompt.name, generation, served.clone());
    Ok(served)
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
    let (a, b) = (
        resolved(st, &prompt.name, &Selector::Version(from)).await?.version,
        resolved(st, &prompt.name, &Selector::Version(to)).await?.version,
    );
    let (unified, lines) =
        text_diff(&a.content.render(), &b.content.render(), &format!("v{}", a.number), &format!("v{}", b.number));
    let playbook = (prompt.strategy == Strategy::Playbook)
        .then(|| playbook_diff(a.content.playbook.as_ref(), b.content.playbook.as_ref()));
    Ok(VersionDiff { from: a.number, to: b.number, unified, lines, playbook })
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

/// Applies an RFC 7396 merge patch to a prompt's settings, validated as a
/// whole; retried when another change lands in between.
pub async fn update_settings(
    st: &AppState,
    name: &PromptName,
    mut patch: serde_json::Map<String, serde_json::Value>,
) -> ServiceResult<Prompt> {
    // `null` removes a member before the settings are read back, so an unknown
    // name would pass unnoticed there: refuse it here.
    if let Some(unknown) = patch.keys().find(|k| !PromptSettings::FIELDS.contains(&k.as_str()) && *k != "budget") {
        return Err(ServiceError::Unprocessable(format!(
            "`{}` is not a setting; the settings are {}, budget",
            unknown.chars().take(64).collect::<String>(),
            PromptSettings::FIELDS.join(", ")
        )));
    }
    // The caps are kept beside the settings document (an older release reads
    // that document strictly); checked before anything is written.
    let budget = match patch.remove("budget") {
        Some(budget_patch) => {
            let prompt = existing_prompt(st, name).await?;
            let before = super::budget::caps(st, &prompt).await?;
            Some((prompt, before, super::budget::patched_caps(&before, &budget_patch)?))
        }
        None => None,
    };
    let updated = update_document(st, name, serde_json::Value::Object(patch)).await?;
    if let Some((prompt, before, caps)) = budget {
        super::budget::set_caps(st, &prompt, &before, &caps).await?;
    }
    Ok(updated)
}

/// [`update_settings`] of the settings document.
async fn update_document(st: &AppState, name: &PromptName, patch: serde_json::Value) -> ServiceResult<Prompt> {
    // Optimistic: re-read and re-apply when another change landed in between.
    for _ in 0..5 {
        let prompt = existing_prompt(st, name).await?;
        let mut doc = serde_json::to_value(&prompt.settings).map_err(|e| ServiceError::Internal(e.into()))?;
        merge_patch(&mut doc, &patch);
        let new: PromptSettings = serde_path_to_error::deserialize(doc).map_err(|e| {
            let inner = plain_serde_error(&e.inner().to_string());
            ServiceError::Unprocessable(format!("`settings.{}`: {inner}", e.path()))
        })?;
        let new = new.validated().map_err(ServiceError::Unprocessable)?;
        match st.store.update_prompt_settings(&prompt.name, &prompt.settings, &new).await {
            Ok(Some(updated)) => return Ok(updated),
            Ok(None) => return Err(ServiceError::not_found(format_args!("prompt {:?}", prompt.name.as_str()))),
            Err(StoreError::Conflict) => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Err(ServiceError::Conflict("the settings kept changing while this patch was applied; send it again".into()))
}
