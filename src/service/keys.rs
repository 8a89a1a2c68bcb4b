//! API keys, for the API, the web UI's sign-in and `combee keys`: the bearer
//! check (through the process's key cache), and key administration — create
//! (the secret shown once), list, revoke — with the rules for a key's name and
//! scopes in one place. A project's key administers only its project's keys
//! and mints only keys of its project; only a server-wide key mints
//! server-wide keys.

use std::sync::Arc;

use super::{AppState, ServiceError, ServiceResult};
use crate::{
    auth,
    domain::access::{ApiKey, Reach, Scope},
};

/// Longest key name, in characters.
pub const MAX_KEY_NAME_CHARS: usize = 100;

/// The unrevoked key this secret belongs to, if any.
pub async fn authenticate(st: &AppState, secret: &str) -> ServiceResult<Option<Arc<ApiKey>>> {
    Ok(st.keys.authenticate(secret).await?)
}

/// Creates a key named `name` (trimmed, 1 to 100 characters) with at least
/// one scope, of `project` (`None`: server-wide) — which must be within
/// `reach`: a project's key mints keys of its own project only (a key of
/// another project, or a server-wide one, is 404 as if the project did not
/// exist; leaving the project out means its own). The key and its secret,
/// which is never shown again.
pub async fn create(
    st: &AppState,
    reach: &Reach,
    name: &str,
    scopes: &[Scope],
    project: Option<&str>,
) -> ServiceResult<(ApiKey, String)> {
    let name = name.trim();
    if name.is_empty() || name.chars().count() > MAX_KEY_NAME_CHARS {
        return Err(ServiceError::Unprocessable(format!("`name` must be 1..={MAX_KEY_NAME_CHARS} characters")));
    }
    if scopes.is_empty() {
        return Err(ServiceError::Unprocessable("give at least one scope".into()));
    }
    let project = match (reach, project) {
        (Reach::Server, None) => None,
        (Reach::Project(own), None) => Some(own.as_str()),
        (_, Some(p)) => {
            super::projects::existing(st, reach, p).await?;
            Some(p)
        }
    };
    Ok(auth::create_key(&st.store, name, scopes, project).await?)
}

/// The keys within reach: all for a server-wide caller, a project's own else.
pub async fn list(st: &AppState, reach: &Reach) -> ServiceResult<Vec<ApiKey>> {
    let keys = st.store.list_api_keys().await?;
    Ok(keys.into_iter().filter(|k| within(reach, k)).collect())
}

/// A project's key is within reach of its project; a server-wide key only of a server-wide caller.
fn within(reach: &Reach, key: &ApiKey) -> bool {
    match &key.project {
        Some(p) => reach.allows(p),
        None => *reach == Reach::Server,
    }
}

/// Revokes the active key with this id or visible prefix (404 when none),
/// dropping this process's cached keys at once; the key as it was.
/// A key out of `reach` is answered as absent.
pub async fn revoke(st: &AppState, reach: &Reach, id_or_prefix: &str) -> ServiceResult<ApiKey> {
    let active = st.store.list_api_keys().await?.into_iter().find(|k| {
        k.revoked_at.is_none()
            && (uuid::Uuid::parse_str(id_or_prefix).ok() == Some(k.id) || k.prefix == id_or_prefix)
            && within(reach, k)
    });
    let Some(key) = active else { return Err(ServiceError::not_found("active key")) };
    if !st.store.revoke_api_key(&key.id.to_string()).await? {
        return Err(ServiceError::not_found("active key"));
    }
    st.keys.clear();
    Ok(key)
}
