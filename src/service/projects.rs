//! Projects, and the one check that keeps them apart: every request that
//! names a prompt, trace, round, webhook or project in its path goes through
//! [`guard`] before its handler runs (the API's `Authorized` extractor and the
//! web UI's `Operator` call it), so a caller bound to one project finds
//! everything of another project absent — the same 404, with the same words,
//! as for something that does not exist. Lists filter by
//! [`crate::domain::project::list_filter`]; what names a prompt in its body
//! (ingest, bulk quarantine) asks [`prompt_in_reach`] or [`out_of_reach`].

use std::collections::HashMap;

use axum::{
    extract::{FromRequestParts, MatchedPath, RawPathParams},
    http::request::Parts,
};
use uuid::Uuid;

use super::{AppState, ServiceError, ServiceResult, audit::AuditSlot};
use crate::{
    domain::{
        access::Reach,
        project::{self, DEFAULT_PROJECT, Project, ProjectSettings},
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

/// The project of what `target` names; `None` when it does not exist (its
/// handler says so in its own words).
async fn project_of(st: &AppState, target: &Target) -> ServiceResult<Option<String>> {
    Ok(match target {
        Target::Prompt(name) => st.store.prompt_project(name).await?,
        Target::Trace(id) => match Uuid::parse_str(id) {
            Ok(id) => st.store.trace_project(id).await?,
            Err(_) => None,
        },
        Target::Round(id) => match Uuid::parse_str(id) {
            Ok(id) => st.store.round_project(id).await?,
            Err(_) => None,
        },
        Target::Webhook(id) => match Uuid::parse_str(id) {
            // A server-wide subscription belongs to no project: only a server-wide caller sees it.
            Ok(id) => st.store.get_webhook(id).await?.map(|w| w.project.unwrap_or_default()),
            Err(_) => None,
        },
        Target::Project(name) => st.store.get_project(name).await?.map(|p| p.name),
    })
}

/// The answer for something absent, worded as each resource's own lookup words it.
fn absent(target: &Target) -> ServiceError {
    match target {
        Target::Prompt(name) => ServiceError::not_found(format_args!("prompt {name:?}")),
        Target::Trace(id) => ServiceError::not_found(format_args!("trace {}", shown_id(id))),
        Target::Round(id) => ServiceError::not_found(format_args!("round {}", shown_id(id))),
        Target::Webhook(id) => ServiceError::not_found(format_args!("webhook {}", shown_id(id))),
        Target::Project(name) => ServiceError::not_found(format_args!("project {name:?}")),
    }
}

fn shown_id(id: &str) -> String {
    Uuid::parse_str(id).map(|u| u.to_string()).unwrap_or_default()
}

/// The one reach check: `Err` (404, as if absent) when `target` exists in a
/// project out of `reach`. Otherwise the project it belongs to when asked
/// for (`attribute`: a write, whose audit entry names it) or when the check
/// needed it; a server-wide caller that does not ask costs no store read.
pub async fn guard(st: &AppState, reach: &Reach, target: &Target, attribute: bool) -> ServiceResult<Option<String>> {
    if *reach == Reach::Server && !attribute {
        return Ok(None);
    }
    let project = project_of(st, target).await?;
    match &project {
        Some(p) if !reach.allows(p) => Err(absent(target)),
        _ => Ok(project.filter(|p| !p.is_empty())),
    }
}

/// [`guard`] for a request of a caller with `reach`, as routed: the resource
/// its path names (none: nothing to check). A write request's audit entry is
/// told the project (the caller's own when the path names nothing).
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
    let project = guard(st, reach, &target, slot.is_some()).await?;
    if let (Some(slot), Some(project)) = (slot, project) {
        slot.set_project(project);
    }
    Ok(())
}

/// The project of each named prompt that exists (for metric labels).
pub async fn projects_of(st: &AppState, names: &[String]) -> ServiceResult<HashMap<String, String>> {
    Ok(st.store.prompts_projects(names).await?.into_iter().collect())
}

/// Whether the prompt `name` is within reach: false when it is absent or in
/// another project (both read the same to the caller).
pub async fn prompt_in_reach(st: &AppState, reach: &Reach, name: &str) -> ServiceResult<bool> {
    if *reach == Reach::Server {
        return Ok(true);
    }
    Ok(st.store.prompt_project(name).await?.is_some_and(|p| reach.allows(&p)))
}

/// Of `names`, those out of reach (in another project); absent ones are not
/// named, their own check reports them.
pub async fn out_of_reach<'a>(st: &AppState, reach: &Reach, names: &[&'a str]) -> ServiceResult<Vec<&'a str>> {
    if *reach == Reach::Server {
        return Ok(Vec::new());
    }
    let mut seen: HashMap<&str, bool> = HashMap::new();
    let mut out = Vec::new();
    for &name in names {
        if let Some(outside) = seen.get(name) {
            if *outside {
                out.push(name);
            }
            continue;
        }
        let outside = st.store.prompt_project(name).await?.is_some_and(|p| !reach.allows(&p));
        seen.insert(name, outside);
        if outside {
            out.push(name);
        }
    }
    Ok(out)
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
