//! API keys: created with a hashed secret, looked up by hash, listed, revoked; a generation counter
//! tells caches when to drop them.

use async_trait::async_trait;
use uuid::Uuid;

use super::{
    Change, StoreError, StoreResult,
    backend::{Backend, SqlStore},
    sql::{Cols, Dialect, now, sql},
};
use crate::domain::access::{ApiKey, Scope};

pub fn scopes_to_string(scopes: &[Scope]) -> String {
    scopes.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(" ")
}

pub fn scopes_from_string(s: &str) -> StoreResult<Vec<Scope>> {
    s.split_whitespace()
        .map(|x| Scope::parse(x).ok_or_else(|| StoreError::Corrupt(format!("unknown scope {x:?}"))))
        .collect()
}

/// The API keys: only their hashes are stored.
#[async_trait]
pub trait KeyStore: Send + Sync {
    /// A key of `project` (`None`: server-wide).
    async fn create_api_key(
        &self,
        name: &str,
        prefix: &str,
        hash: &str,
        scopes: &[Scope],
        project: Option<&str>,
    ) -> StoreResult<ApiKey>;
    async fn api_key_by_hash(&self, hash: &str) -> StoreResult<Option<ApiKey>>;
    async fn list_api_keys(&self) -> StoreResult<Vec<ApiKey>>;
    /// Revokes by id or by visible prefix; false when nothing matched.
    async fn revoke_api_key(&self, id_or_prefix: &str) -> StoreResult<bool>;
    async fn count_active_api_keys(&self) -> StoreResult<i64>;
    /// A counter that grows with every revocation (or deletion) of a key, by
    /// any process: one cheap read tells whether cached keys are still current.
    async fn api_key_generation(&self) -> StoreResult<i64>;
}

#[async_trait]
impl<D: Backend> KeyStore for SqlStore<D> {
    async fn create_api_key(
        &self,
        name: &str,
        prefix: &str,
        hash: &str,
        scopes: &[Scope],
        project: Option<&str>,
    ) -> StoreResult<ApiKey> {
        let mut tx = self.begin_write().await?;
        let row = sql::<D>(
            "INSERT INTO api_keys (id, name, prefix, hash, scopes, project, created_at) VALUES ($1, $2, $3, $4, $5, $6, $7)
             RETURNING id, name, prefix, hash, scopes, project, created_at, revoked_at",
        )
        .bind(Uuid::now_v7())
        .bind(name)
        .bind(prefix)
        .bind(hash)
        .bind(scopes_to_string(scopes))
        .bind(project)
        .bind(now())
        .fetch_one(&mut *tx)
        .await?;
        self.commit(tx, Change::Keys).await?;
        key_from_row::<D>(&row)
    }

    async fn api_key_by_hash(&self, hash: &str) -> StoreResult<Option<ApiKey>> {
        sql::<D>("SELECT id, name, prefix, hash, scopes, project, created_at, revoked_at FROM api_keys WHERE hash = $1")
            .bind(hash)
            .fetch_optional(&mut *self.reader.acquire().await?)
            .await?
            .as_ref()
            .map(key_from_row::<D>)
            .transpose()
    }

    async fn list_api_keys(&self) -> StoreResult<Vec<ApiKey>> {
        sql::<D>(
            "SELECT id, name, prefix, hash, scopes, project, created_at, revoked_at FROM api_keys ORDER BY created_at",
        )
        .map(&mut *self.reader.acquire().await?, key_from_row::<D>)
        .await
    }

    async fn revoke_api_key(&self, id_or_prefix: &str) -> StoreResult<bool> {
        let mut tx = self.begin_write().await?;
        let n = sql::<D>("UPDATE api_keys SET revoked_at = $3 WHERE revoked_at IS NULL AND (id = $1 OR prefix = $2)")
            .bind(Uuid::parse_str(id_or_prefix).ok())
            .bind(id_or_prefix)
            .bind(now())
            .execute(&mut *tx)
            .await?;
        self.commit(tx, Change::Keys).await?;
        Ok(n > 0)
    }

    async fn count_active_api_keys(&self) -> StoreResult<i64> {
        let n = sql::<D>("SELECT count(*) AS n FROM api_keys WHERE revoked_at IS NULL")
            .value(&mut *self.reader.acquire().await?, "n")
            .await?;
        Ok(n.unwrap_or(0))
    }

    async fn api_key_generation(&self) -> StoreResult<i64> {
        D::api_key_generation(self).await
    }
}

pub(super) fn key_from_row<D: Dialect>(row: &D::Row) -> StoreResult<ApiKey> {
    let r = Cols::<D>(row);
    Ok(ApiKey {
        id: r.get("id")?,
        name: r.get("name")?,
        prefix: r.get("prefix")?,
        hash: r.get("hash")?,
        scopes: scopes_from_string(&r.get::<String>("scopes")?)?,
        project: r.get("project")?,
        created_at: r.get("created_at")?,
        revoked_at: r.get("revoked_at")?,
    })
}
