//! Operator web UI sessions: opened with a key the sign-in verified, found by
//! the hash of their cookie token, ended on sign-out — or as soon as their key
//! is revoked.

use super::{AppState, ServiceResult};
use crate::domain::access::{ApiKey, NewUiSession, UiSession};

/// Opens a session (expired ones are deleted on the way).
pub async fn open(st: &AppState, session: &NewUiSession) -> ServiceResult<()> {
    Ok(st.store.create_ui_session(session).await?)
}

/// The unexpired session with this token hash and its key; `None` when there
/// is none, or its key was revoked since sign-in (the session then ends).
pub async fn find(st: &AppState, token_hash: &str) -> ServiceResult<Option<(UiSession, ApiKey)>> {
    let Some((session, key)) = st.store.ui_session(token_hash).await? else { return Ok(None) };
    if key.revoked_at.is_some() {
        st.store.delete_ui_session(token_hash).await?;
        return Ok(None);
    }
    Ok(Some((session, key)))
}

/// Ends the session with this token hash (nothing when there is none).
pub async fn close(st: &AppState, token_hash: &str) -> ServiceResult<()> {
    st.store.delete_ui_session(token_hash).await?;
    Ok(())
}
