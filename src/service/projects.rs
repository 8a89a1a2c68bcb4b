//! Projects, and the one check that keeps them apart: every request that
//! names a prompt, trace, round, webhook or project in its path goes through
//! [`guard`] before its handler runs and before anything else of the request
//! is read (the API's `Authorized` extractor and the web UI's `Operator` call
//! it), so a caller bound to one project finds everything of another project
//! absent — the same 404, with the same words, as for something that does not
//! exist, whatever the body, query or headers. A prompt is named `name` in
//! the caller's project or `project/name` ([`prompt_in_reach`]); for a
//! project's caller, another project's prompt is out of reach by its words
//! alone. Lists filter by [`crate::domain::project::list_filter`]; what names
//! a prompt in its body (ingest, bulk quarantine) asks [`prompt_in_reach`]
//! too, or reads the name in the caller's project.

use axum::{
    extract::{FromRequestParts, MatchedPath, RawPathParams},
    http::{StatusCode, request::Parts},
};
use uuid::Uuid;

use super::{AppState, ServiceError, ServiceResult, audit::AuditSlot};
use crate::{
    domain::{
        access::Reach,
        names::{DEFAULT_PROJECT, PromptName},
        project::{self, Project, ProjectSettings},
    },
    store::StoreError,
};

/// What a route's path names, read from its template and parameters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    Prompt(String),
    Trace(String),
    Round(String),
    Webhook(String),
    Project(String),
}

/// The resource a route template (`/v1/prompts/{name}/labels`, `/ui/traces/{id}`…)
/// names with its parameters (`name`, `id`); `None` for routes that name none.
pub fn target(template: &str, params: &[(String, String)]) -> Option<Target> {
    let param = |key: &str| params.iter().find(|(k, _)| k == key).map(|(_, v)| v.clone());
    let segments: Vec<&str> = template.split('/').filter(|s| !s.is_empty()).collect();
    let pairs = segments.windows(2).map(|w| (w[0], w[1]));
    for (kind, placeholder) in pairs {
        let found = match (kind, placeholder) {
            ("prompts" | "rounds", "{name}") => param("name").map(Target::Prompt),
            ("traces", "{id}") => param("id").map(Target::Trace),
            ("rounds", "{id}") => param("id").map(Target::Round),
            ("webhooks", "{id}") => param("id").map(Target::Webhook),
            ("projects", "{name}") => param("name").map(Target::Project),
            _ => None,
        };
        if found.is_some() {
            return found;
        }
    }
    None
}

/// The project of the trace, round or webhook `target` names; `None` when
/// it does not exist (or the id is not one).
async fn project_of(st: &AppState, target: &Target) -> ServiceResult<Option<String>> {
    let id = |id: &str| Uuid::parse_str(id).ok();
    Ok(match target {
        Target::Prompt(_) | Target::Project(_) => None,
        Target::Trace(t) => match id(t) {
            Some(t) => st.store.trace_project(t).await?,
            None => None,
        },
        Target::Round(r) => match id(r) {
            Some(r) => st.store.round_project(r).await?,
            None => None,
        },
        // A server-wide subscription belongs to no project: only a server-wide caller sees it.
        Target::Webhook(w) => match id(w) {
            Some(w) => st.store.get_webhook(w).await?.map(|w| w.project.unwrap_or_default()),
            None => None,
        },
    })
}

/// The answer for something absent, worded as each resource's own lookup words it.
fn absent(target: &Target) -> ServiceError {
    match target {
        Target::Prompt(name) => absent_prompt(name),
        Target::Trace(id) => ServiceError::not_found(format_args!("trace {}", shown_id(id))),
        Target::Round(id) => ServiceError::not_found(format_args!("round {}", shown_id(id))),
        Target::Webhook(id) => ServiceError::not_found(format_args!("webhook {}", shown_id(id))),
        Target::Project(name) => ServiceError::not_found(format_args!("project {name:?}")),
    }
}

/// The answer for a prompt written `written` that is absent — or out of reach.
pub fn absent_prompt(written: &str) -> ServiceError {
    match PromptName::written(written, DEFAULT_PROJECT) {
        Ok(_) => ServiceError::not_found(format_args!("prompt {written:?}")),
        Err(e) => ServiceError::NotFound(format!("no such prompt: {e}")),
    }
}

fn shown_id(id: &str) -> String {
    Uuid::parse_str(id).map(|u| u.to_string()).unwrap_or_default()
}

/// What a path names, found within reach by [`guard_request`] before anything
/// else of the request is read; a handler takes the prompt from here.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Found {
    Prompt(PromptName),
    /// A trace, round, webhook or project, of this project (`None`: a
    /// server-wide webhook).
    In(Option<String>),
}

/// The prompt a route's path names, as [`guard_request`] found it within the
/// caller's reach before anything else of the request was read: a handler
/// takes it after `Authorized` (or the web UI's `Operator`).
pub struct PathPrompt(pub PromptName);

impl<S: Send + Sync> FromRequestParts<S> for PathPrompt {
    type Rejection = (StatusCode, &'static str);

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        match parts.extensions.remove::<Found>() {
            Some(Found::Prompt(name)) => Ok(PathPrompt(name)),
            // A handler that takes a prompt on a route no reach check ran for: a bug, not a request's fault.
            _ => Err((StatusCode::INTERNAL_SERVER_ERROR, "the route's prompt was not looked up")),
        }
    }
}

/// The one reach check: what `target` names, when it exists within `reach`;
/// otherwise 404, in the words of an absent resource. A trace, round or
/// webhook id that is not a UUID is left to its handler's 400 (no resource
/// is named).
pub async fn guard(st: &AppState, reach: &Reach, target: &Target) -> ServiceResult<Option<Found>> {
    match target {
        Target::Prompt(written) => Ok(Some(Found::Prompt(prompt_in_reach(st, reach, written).await?))),
        Target::Project(name) => Ok(Some(Found::In(Some(existing(st, reach, name).await?.name)))),
        Target::Trace(id) | Target::Round(id) | Target::Webhook(id) if Uuid::parse_str(id).is_err() => Ok(None),
        _ => match project_of(st, target).await? {
            Some(p) if reach.allows(&p) => Ok(Some(Found::In(Some(p).filter(|p| !p.is_empty())))),
            _ => Err(absent(target)),
        },
    }
}

/// [`guard`] for a request of a caller with `reach`, as routed: the resource
/// its path names (none: nothing to check), kept in the request's extensions
/// as [`Found`]. A write request's audit entry is told the project (the
/// caller's own when the path names nothing).
pub async fn guard_request(st: &AppState, reach: &Reach, parts: &mut Parts) -> ServiceResult<()> {
    let slot = parts.extensions.get::<AuditSlot>().cloned();
    if let (Some(slot), Some(own)) = (&slot, reach.project()) {
        slot.set_project(own.to_owned());
    }
    let Some(template) = parts.extensions.get::<MatchedPath>().map(|m| m.as_str().to_owned()) else {
        return Ok(());
    };
    let params: Vec<(String, String)> = match RawPathParams::from_request_parts(parts, &()).await {
        Ok(raw) => raw.iter().map(|(k, v)| (k.to_owned(), v.to_owned())).collect(),
        Err(_) => Vec::new(),
    };
    let Some(target) = target(&template, &params) else { return Ok(()) };
    let Some(found) = guard(st, reach, &target).await? else { return Ok(()) };
    let project = match &found {
        Found::Prompt(name) => Some(name.project().to_owned()),
        Found::In(project) => project.clone(),
    };
    if let (Some(slot), Some(project)) = (slot, project) {
        slot.set_project(project);
    }
    parts.extensions.insert(found);
    Ok(())
}

/// The prompt `written` names (`name`, or `project/name`) for a caller with
/// `reach`: a bare name is of the caller's project (`default` for a
/// server-wide caller). 404 when it does not exist or is of a project out of
/// reach — the same words either way, decided by the words alone for a
/// project's caller (another project is never looked at). A server-wide
/// caller told that a bare name is absent from `default` learns which
/// projects hold one.
pub async fn prompt_in_reach(st: &AppState, reach: &Reach, written: &str) -> ServiceResult<PromptName> {
    let home = reach.project().unwrap_or(DEFAULT_PROJECT);
    let name =
        PromptName::written(written, home).map_err(|e| ServiceError::NotFound(format!("no such prompt: {e}")))?;
    if !reach.allows(name.project()) {
        return Err(absent_prompt(written));
    }
    if st.cache.knows(&name) {
        return Ok(name);
    }
    let generation = st.cache.generation();
    if st.store.get_prompt(&name).await?.is_some() {
        st.cache.found(&name, generation);
        return Ok(name);
    }
    if *reach == Reach::Server && !written.contains('/') {
        let elsewhere = st.store.projects_holding(name.as_str()).await?;
        if let Some(first) = elsewhere.first() {
            return Err(ServiceError::NotFound(format!(
                "prompt {written:?} not found in project {DEFAULT_PROJECT}; a bare name means `{DEFAULT_PROJECT}`'s \
                 prompt to a server-wide key, and {} hold{} one: write it `{first}/{written}`",
                elsewhere.iter().map(|p| format!("project {p}")).collect::<Vec<_>>().join(", "),
                if elsewhere.len() == 1 { "s" } else { "" },
            )));
        }
    }
    Err(absent_prompt(written))
}

/// The project a new prompt goes to: the one named (within reach; 404 as if
/// absent otherwise), else the caller's own, else `default`.
pub async fn for_new_prompt(st: &AppState, reach: &Reach, named: Option<&str>) -> ServiceResult<Project> {
    let name = named.or(reach.project()).unwrap_or(DEFAULT_PROJECT);
    existing(st, reach, name).await
}

/// The project `name`, within reach (404 otherwise, as if it did not exist).
pub async fn existing(st: &AppState, reach: &Reach, name: &str) -> ServiceResult<Project> {
    let target = Target::Project(name.to_owned());
    if !reach.allows(name) {
        return Err(absent(&target));
    }
    st.store.get_project(name).await?.ok_or_else(|| absent(&target))
}

/// The projects within reach, by name.
pub async fn list(st: &AppState, reach: &Reach) -> ServiceResult<Vec<Project>> {
    Ok(st.store.list_projects().await?.into_iter().filter(|p| reach.allows(&p.name)).collect())
}

/// Creates a project (a server-wide caller's act: the route takes `admin`,
/// and a project's key is refused here). 409 when the name is taken.
pub async fn create(st: &AppState, reach: &Reach, name: &str, settings: ProjectSettings) -> ServiceResult<Project> {
    if *reach != Reach::Server {
        return Err(ServiceError::Forbidden("only a server-wide key creates projects".into()));
    }
    project::check_name(name).map_err(|e| ServiceError::Unprocessable(e.to_string()))?;
    let settings = settings.validated().map_err(ServiceError::Unprocessable)?;
    st.store.create_project(name, &settings).await.map_err(|e| match e {
        StoreError::AlreadyExists => ServiceError::Conflict(format!("a project named {name:?} already exists")),
        other => other.into(),
    })
}

/// Replaces a project's settings; the project before and after.
pub async fn update_settings(
    st: &AppState,
    reach: &Reach,
    name: &str,
    settings: ProjectSettings,
) -> ServiceResult<(Project, Project)> {
    let before = existing(st, reach, name).await?;
    let settings = settings.validated().map_err(ServiceError::Unprocessable)?;
    let after = st
        .store
        .update_project_settings(name, &settings)
        .await?
        .ok_or_else(|| absent(&Target::Project(name.to_owned())))?;
    if before.settings.budget != after.settings.budget {
        // Raised (or removed) caps let its waiting rounds go at once; lowered ones hold at the next call.
        st.store.lift_project_budget(name, st.clock.now().date_naive()).await?;
    }
    Ok((before, after))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
    }

    #[test]
    fn route_templates_name_their_resource() {
        let name = p(&[("name", "a"), ("number", "2")]);
        assert_eq!(target("/v1/prompts/{name}/versions/{number}", &name), Some(Target::Prompt("a".into())));
        assert_eq!(target("/v1/hooks/rounds/{name}", &name), Some(Target::Prompt("a".into())));
        assert_eq!(target("/api/public/v2/prompts/{name}", &name), Some(Target::Prompt("a".into())));
        assert_eq!(target("/ui/prompts/{name}/rounds", &name), Some(Target::Prompt("a".into())));
        let id = p(&[("id", "x")]);
        assert_eq!(target("/v1/traces/{id}/pin", &id), Some(Target::Trace("x".into())));
        assert_eq!(target("/ui/rounds/{id}", &id), Some(Target::Round("x".into())));
        assert_eq!(target("/v1/webhooks/{id}/deliveries", &id), Some(Target::Webhook("x".into())));
        assert_eq!(target("/v1/projects/{name}", &name), Some(Target::Project("a".into())));
        assert_eq!(target("/v1/keys/{id}", &id), None);
        assert_eq!(target("/v1/prompts", &[]), None);
    }
}
