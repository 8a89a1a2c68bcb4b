//! API keys, for the API, the web UI's sign-in and `combee keys`: the bearer
//! check (through the process's key cache), and key administration — create
//! (the secret shown once), list, revoke — with the rules for a key's name and
//! scopes in one place.

use std::sync::Arc;

use super::{AppState, ServiceError, ServiceResult};
use crate::{
    auth,
    domain::access::{ApiKey, Scope},
};

/// Longest key name, in characters.
pub const MAX_KEY_NAME_CHARS: usize = 100;

/// The unrevoked key this secret belongs to, if any.
pub async fn authenticate(st: &AppState, secret: &str) -> ServiceResult<Option<Arc<ApiKey>>> {
    Ok(st.keys.authenticate(secret).await?)
}

/// Creates a key named `name` (trimmed, 1 to 100 characters) with at least
/// one scope; the key and its secret, which is never shown again.
pub async fn create(st: &AppState, name: &str, scopes: &[Scope]) -> ServiceResult<(ApiKey, String)> {
    let name = name.trim();
    if name.is_empty() || name.chars().count() > MAX_KEY_NAME_CHARS {
        return Err(ServiceError::Unprocessable(format!("`name` must be 1..={MAX_KEY_NAME_CHARS} characters")));
    }
    if scopes.is_empty() {
        return Err(ServiceError::Unprocessable("give at least one scope".into()));
    }
    Ok(auth::create_key(&st.store, name, scopes).await?)
}

pub async fn list(st: &AppState) -> ServiceResult<Vec<ApiKey>> {
    Ok(st.store.list_api_keys().await?)
}

/// Revokes the active key with this id or visible prefix (404 when none),
/// dropping this process's cached keys at once; the key as it was.
pub async fn revoke(st: &AppState, id_or_prefix: &str) -> ServiceResult<ApiKey> {
    let active = st.store.list_api_keys().await?.into_iter().find(|k| {
        k.revoked_at.is_none() && (uuid::Uuid::parse_str(id_or_prefix).ok() == Some(k.id) || k.prefix == id_or_prefix)
    });
    let Some(key) = active else { return Err(ServiceError::not_found("active key")) };
    if !st.store.revoke_api_key(id_or_prefix).await? {
        return Err(ServiceError::not_found("active key"));
    }
    st.keys.clear();
    Ok(key)
}
