//! People in the web UI: the grants a signed-in person holds (their mapped
//! group claims and an admin's explicit grant), their sessions, the members
//! admins manage, and the sign-ins under way.

use chrono::{Duration, Utc};

use super::{AppState, ServiceError, ServiceResult};
use crate::{
    domain::{
        access::{Reach, Role},
        people::{Grant, MAX_NAME_CHARS, Member, NewPersonSession, PendingLogin, PersonSession, valid_project},
    },
    oidc::{Identity, config::GroupMapping},
};

/// How long a sign-in may take at the provider.
pub const LOGIN_MINUTES: i64 = 10;

/// The grants the mapped group claims give, in configuration order, without repeats.
pub fn mapped_grants(groups: &[String], mappings: &[GroupMapping]) -> Vec<Grant> {
    let mut out: Vec<Grant> = Vec::new();
    for m in mappings.iter().filter(|m| groups.contains(&m.claim)) {
        let g = Grant { project: m.project.clone(), role: m.role };
        if !out.contains(&g) {
            out.push(g);
        }
    }
    out
}

/// A person's grants: their mapped groups', then an admin's explicit ones.
/// Where two give a role in the same place, the higher role stands.
pub async fn grants_for(st: &AppState, who: &Identity) -> ServiceResult<Vec<Grant>> {
    let mappings = st.settings.auth.oidc.as_ref().map(|o| o.groups.as_slice()).unwrap_or_default();
    let mut grants = mapped_grants(&who.groups, mappings);
    for m in st.store.members_for(&who.subject, who.email.as_deref()).await? {
        grants.push(Grant { project: m.project, role: m.role });
    }
    let mut best: Vec<Grant> = Vec::new();
    for g in grants {
        match best.iter_mut().find(|b| b.project == g.project) {
            Some(b) => b.role = b.role.max(g.role),
            None => best.push(g),
        }
    }
    Ok(best)
}

pub async fn open_session(st: &AppState, session: &NewPersonSession) -> ServiceResult<()> {
    Ok(st.store.create_person_session(session).await?)
}

pub async fn find_session(st: &AppState, token_hash: &str) -> ServiceResult<Option<PersonSession>> {
    Ok(st.store.person_session(token_hash).await?)
}

/// Switches the session to one of the grants it holds.
pub async fn pick(st: &AppState, token_hash: &str, grant: &Grant) -> ServiceResult<()> {
    if !st.store.set_person_grant(token_hash, grant).await? {
        return Err(ServiceError::not_found("session"));
    }
    Ok(())
}

pub async fn close_session(st: &AppState, token_hash: &str) -> ServiceResult<()> {
    st.store.delete_person_session(token_hash).await?;
    Ok(())
}

/// Keeps a sign-in under way for [`LOGIN_MINUTES`].
pub async fn start_login(st: &AppState, state_hash: String, nonce: String, verifier: String) -> ServiceResult<()> {
    let login = PendingLogin { state_hash, nonce, verifier, expires_at: Utc::now() + Duration::minutes(LOGIN_MINUTES) };
    Ok(st.store.save_login(&login).await?)
}

/// Takes the sign-in with this state hash, once.
pub async fn take_login(st: &AppState, state_hash: &str) -> ServiceResult<Option<PendingLogin>> {
    Ok(st.store.take_login(state_hash).await?)
}

/// The members within reach: all for a server-wide caller; a project's
/// caller sees the members holding a role in its project only.
pub async fn list_members(st: &AppState, reach: &Reach) -> ServiceResult<Vec<Member>> {
    Ok(st.store.list_members().await?.into_iter().filter(|m| member_in_reach(reach, m)).collect())
}

fn member_in_reach(reach: &Reach, m: &Member) -> bool {
    match (&m.project, reach) {
        (_, Reach::Server) => true,
        (Some(p), Reach::Project(own)) => p == own,
        (None, Reach::Project(_)) => false,
    }
}

/// A subject or email address as members are named: 1–256 characters, no
/// control characters, no surrounding space.
pub fn check_subject(subject: &str) -> ServiceResult<()> {
    if subject.is_empty()
        || subject.chars().count() > MAX_NAME_CHARS
        || subject.trim() != subject
        || subject.chars().any(char::is_control)
    {
        return Err(ServiceError::Unprocessable(format!(
            "a member is named by the provider's subject or an email address: 1 to {MAX_NAME_CHARS} characters, \
             no control characters or surrounding spaces"
        )));
    }
    Ok(())
}

/// Gives a member a role in a project (or server-wide), beside the roles
/// they hold elsewhere; the grant before in that place, if any. A project's
/// caller gives roles in its own project only (no project named means its
/// own; another project is 404, as if absent) and never learns of a
/// person's grants elsewhere.
pub async fn set_member(
    st: &AppState,
    reach: &Reach,
    subject: &str,
    project: Option<&str>,
    role: Role,
) -> ServiceResult<(Member, Option<Member>)> {
    check_subject(subject)?;
    if let Some(p) = project
        && !valid_project(p)
    {
        return Err(ServiceError::Unprocessable(format!(
            "project {:?} is not a project name: 1 to 64 of a-z, 0-9, `.`, `-` and `_`, starting with a letter or digit",
            p.chars().take(80).collect::<String>()
        )));
    }
    let project = match (reach, project) {
        (Reach::Server, None) => None,
        (Reach::Project(own), None) => Some(own.as_str()),
        (_, Some(p)) => {
            super::projects::existing(st, reach, p).await?;
            Some(p)
        }
    };
    let grant = Grant { project: project.map(str::to_owned), role };
    Ok(st.store.put_member(subject, &grant).await?)
}

/// Takes a member's grants away: a project's caller, the one in its project
/// (naming another project is 404, as for a member who holds none); a
/// server-wide caller, the one in `project`, else all of them. Those removed;
/// 404 when there was none. Open sessions keep their grants until they end.
pub async fn remove_member(
    st: &AppState,
    reach: &Reach,
    subject: &str,
    project: Option<&str>,
) -> ServiceResult<Vec<Member>> {
    let removed = match (reach, project) {
        (Reach::Project(own), Some(p)) if p != own => Vec::new(),
        (Reach::Project(own), _) => st.store.delete_member(subject, Some(own)).await?.into_iter().collect(),
        (Reach::Server, Some(p)) => st.store.delete_member(subject, Some(p)).await?.into_iter().collect(),
        (Reach::Server, None) => st.store.delete_members(subject).await?,
    };
    if removed.is_empty() {
        return Err(ServiceError::not_found("member"));
    }
    Ok(removed)
}

/// Takes a member's server-wide grant away (a server-wide caller's act; 404
/// for a project's caller, as for a member who holds none).
pub async fn remove_grant(st: &AppState, reach: &Reach, subject: &str) -> ServiceResult<Vec<Member>> {
    let removed = match reach {
        Reach::Server => st.store.delete_member(subject, None).await?,
        Reach::Project(_) => None,
    };
    removed.map(|m| vec![m]).ok_or_else(|| ServiceError::not_found("member"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mapped_groups_give_their_grants_once_in_configuration_order() {
        let m = |claim: &str, project: Option<&str>, role| GroupMapping {
            claim: claim.into(),
            project: project.map(Into::into),
            role,
        };
        let mappings = [
            m("team-x", Some("x"), Role::Operator),
            m("sre", None, Role::Admin),
            m("x-again", Some("x"), Role::Operator),
        ];
        let groups = vec!["x-again".to_owned(), "team-x".to_owned(), "other".to_owned()];
        assert_eq!(mapped_grants(&groups, &mappings), vec![Grant { project: Some("x".into()), role: Role::Operator }]);
        assert!(mapped_grants(&["nobody".to_owned()], &mappings).is_empty());
        assert!(check_subject("ann@example.com").is_ok());
        assert!(check_subject(" ann").is_err());
        assert!(check_subject("a\nb").is_err());
        assert!(check_subject("").is_err());
    }
}
