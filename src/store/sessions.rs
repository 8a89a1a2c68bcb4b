//! Operator web UI sessions, kept by the hash of their cookie token.

use async_trait::async_trait;

use super::{
    StoreResult,
    backend::{Backend, SqlStore},
    keys::key_from_row,
    sql::{Cols, now, sql},
};
use crate::domain::access::{ApiKey, NewUiSession, UiSession};

/// The operator web UI sessions.
#[async_trait]
pub trait SessionStore: Send + Sync {
    /// Opens a session, and deletes expired ones on the way.
    async fn create_ui_session(&self, session: &NewUiSession) -> StoreResult<()>;
    /// The unexpired session with this token hash and the key it was opened
    /// with — revoked or not: the caller decides what a revoked key means.
    async fn ui_session(&self, token_hash: &str) -> StoreResult<Option<(UiSession, ApiKey)>>;
    /// False when there was no such session.
    async fn delete_ui_session(&self, token_hash: &str) -> StoreResult<bool>;
}

#[async_trait]
impl<D: Backend> SessionStore for SqlStore<D> {
    async fn create_ui_session(&self, session: &NewUiSession) -> StoreResult<()> {
        let mut tx = self.begin_write().await?;
        sweep_expired::<D>(&mut tx, "ui_sessions").await?;
        sql::<D>(
            "INSERT INTO ui_sessions (token_hash, key_id, csrf_token, created_at, expires_at) VALUES ($1, $2, $3, $4, $5)",
        )
        .bind(&session.token_hash)
        .bind(session.key_id)
        .bind(&session.csrf_token)
        .bind(now())
        .bind(session.expires_at)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(())
    }

    async fn ui_session(&self, token_hash: &str) -> StoreResult<Option<(UiSession, ApiKey)>> {
        let row = sql::<D>(
            "SELECT s.key_id, s.csrf_token, s.created_at AS session_created_at, s.expires_at,
                    k.id, k.name, k.prefix, k.hash, k.scopes, k.project, k.created_at, k.revoked_at
             FROM ui_sessions s JOIN api_keys k ON k.id = s.key_id
             WHERE s.token_hash = $1 AND s.expires_at > $2",
        )
        .bind(token_hash)
        .bind(now())
        .fetch_optional(&mut *self.reader.acquire().await?)
        .await?;
        let Some(row) = row else { return Ok(None) };
        let r = Cols::<D>(&row);
        let session = UiSession {
            key_id: r.get("key_id")?,
            csrf_token: r.get("csrf_token")?,
            created_at: r.get("session_created_at")?,
            expires_at: r.get("expires_at")?,
        };
        Ok(Some((session, key_from_row::<D>(&row)?)))
    }

    async fn delete_ui_session(&self, token_hash: &str) -> StoreResult<bool> {
        delete_session(self, "ui_sessions", token_hash).await
    }
}

/// Deletes the expired rows of a session table (`ui_sessions`,
/// `person_sessions`): each opening of a session sweeps its table.
pub(super) async fn sweep_expired<D: Backend>(c: &mut D::Connection, table: &'static str) -> StoreResult<()> {
    sql::<D>(&format!("DELETE FROM {table} WHERE expires_at <= $1")).bind(now()).execute(c).await?;
    Ok(())
}

/// Ends the session of a session table with this token hash; false when there was none.
pub(super) async fn delete_session<D: Backend>(
    store: &SqlStore<D>,
    table: &'static str,
    token_hash: &str,
) -> StoreResult<bool> {
    let n = sql::<D>(&format!("DELETE FROM {table} WHERE token_hash = $1"))
        .bind(token_hash)
        .execute(&mut *store.writer.acquire().await?)
        .await?;
    Ok(n > 0)
}
