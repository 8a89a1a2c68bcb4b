//! The audit log: append an entry, read entries newest first with filters,
//! and the retention rule's pruning — the one way past the triggers that keep
//! the table append-only (see the 0041 migrations): on Postgres a
//! transaction-local setting the trigger reads, on SQLite a permit row written
//! and removed inside the pruning transaction.

use async_trait::async_trait;
use chrono::{DateTime, Utc};

use super::{
    StoreKind, StoreResult,
    backend::{Backend, SqlStore},
    sql::{Cols, Param, now, opt_json, sql},
};
use crate::domain::audit::{AuditEntry, AuditQuery, NewAuditEntry};

#[async_trait]
pub trait AuditStore: Send + Sync {
    /// Appends one entry; returns its id.
    async fn append_audit(&self, entry: &NewAuditEntry) -> StoreResult<i64>;
    /// Up to `limit` entries matching `query`, newest first.
    async fn audit_entries(&self, query: &AuditQuery, limit: u32) -> StoreResult<Vec<AuditEntry>>;
    /// Deletes up to `limit` of the oldest entries made before `cutoff` (the
    /// retention rule; nothing else may delete an entry); returns how many.
    async fn prune_audit(&self, cutoff: DateTime<Utc>, limit: u32) -> StoreResult<u64>;
    /// How many entries were made before `cutoff` (what pruning would delete).
    async fn count_audit_before(&self, cutoff: DateTime<Utc>) -> StoreResult<u64>;
}

const COLUMNS: &str = "id, at, actor_type, actor_id, actor_name, request_id, client_addr, method, route, status, \
                       action, resource_type, resource_id, before, after, project";

#[async_trait]
impl<D: Backend> AuditStore for SqlStore<D> {
    async fn append_audit(&self, e: &NewAuditEntry) -> StoreResult<i64> {
        let id: Option<i64> = sql::<D>(
            "INSERT INTO audit_log (at, actor_type, actor_id, actor_name, request_id, client_addr, method, route,
                                    status, action, resource_type, resource_id, before, after, project)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15) RETURNING id",
        )
        .bind(now())
        .bind(e.actor.kind())
        .bind(e.actor.id())
        .bind(e.actor.name())
        .bind(e.origin.request_id.clone())
        .bind(e.origin.client_addr.clone())
        .bind(e.origin.method.clone())
        .bind(e.origin.route.clone())
        .bind(e.origin.status.map(i32::from))
        .bind(e.action.as_str())
        .bind(e.resource_type.clone())
        .bind(e.resource_id.clone())
        .bind(opt_json(e.before.as_ref()))
        .bind(opt_json(e.after.as_ref()))
        .bind(e.project.clone())
        .value(&mut *self.writer.acquire().await?, "id")
        .await?;
        id.ok_or_else(|| super::sql::corrupt("audit_log insert returned no id"))
    }

    async fn audit_entries(&self, q: &AuditQuery, limit: u32) -> StoreResult<Vec<AuditEntry>> {
        let mut conditions = Vec::new();
        let mut params: Vec<Param<'_>> = Vec::new();
        let mut add = |condition: &str, p: Param<'static>| {
            params.push(p);
            conditions.push(condition.replace('?', &format!("${}", params.len())));
        };
        if let Some(actor) = &q.actor {
            // One parameter used twice: `$n` names it in both places.
            add("(actor_id = ? OR actor_name = ?)", actor.clone().into());
        }
        if let Some(action) = &q.action {
            add("action = ?", action.clone().into());
        }
        if let Some(t) = &q.resource_type {
            add("resource_type = ?", t.clone().into());
        }
        if let Some(id) = &q.resource_id {
            add("resource_id = ?", id.clone().into());
        }
        if let Some(since) = q.since {
            add("at >= ?", since.into());
        }
        if let Some(until) = q.until {
            add("at < ?", until.into());
        }
        if let Some(project) = &q.project {
            add("project = ?", project.clone().into());
        }
        if let Some(before) = q.before_id {
            add("id < ?", before.into());
        }
        let filter = if conditions.is_empty() { String::new() } else { format!("WHERE {}", conditions.join(" AND ")) };
        let text = format!("SELECT {COLUMNS} FROM audit_log {filter} ORDER BY id DESC LIMIT {}", limit.max(1));
        let mut query = sql::<D>(&text);
        for p in params {
            query = query.bind(p);
        }
        query.map(&mut *self.reader.acquire().await?, entry_from_row::<D>).await
    }

    async fn prune_audit(&self, cutoff: DateTime<Utc>, limit: u32) -> StoreResult<u64> {
        let mut tx = self.begin_write().await?;
        match D::KIND {
            StoreKind::Postgres => {
                sql::<D>("SELECT set_config('combee.audit_prune_before', $1, true)")
                    .bind(cutoff.to_rfc3339())
                    .execute(&mut tx)
                    .await?;
            }
            StoreKind::Sqlite => {
                sql::<D>("INSERT INTO audit_prune_permits (cutoff) VALUES ($1)").bind(cutoff).execute(&mut tx).await?;
            }
        }
        let deleted =
            sql::<D>("DELETE FROM audit_log WHERE id IN (SELECT id FROM audit_log WHERE at < $1 ORDER BY id LIMIT $2)")
                .bind(cutoff)
                .bind(i64::from(limit))
                .execute(&mut tx)
                .await?;
        if D::KIND == StoreKind::Sqlite {
            sql::<D>("DELETE FROM audit_prune_permits").execute(&mut tx).await?;
        }
        tx.commit().await?;
        Ok(deleted)
    }

    async fn count_audit_before(&self, cutoff: DateTime<Utc>) -> StoreResult<u64> {
        let n: Option<i64> = sql::<D>("SELECT count(*) AS n FROM audit_log WHERE at < $1")
            .bind(cutoff)
            .value(&mut *self.reader.acquire().await?, "n")
            .await?;
        Ok(n.unwrap_or(0).max(0) as u64)
    }
}

fn entry_from_row<D: Backend>(row: &D::Row) -> StoreResult<AuditEntry> {
    let r = Cols::<D>(row);
    Ok(AuditEntry {
        id: r.get("id")?,
        at: r.get("at")?,
        actor_type: r.get("actor_type")?,
        actor_id: r.get("actor_id")?,
        actor_name: r.get("actor_name")?,
        request_id: r.get("request_id")?,
        client_addr: r.get("client_addr")?,
        method: r.get("method")?,
        route: r.get("route")?,
        status: r.get::<Option<i32>>("status")?.and_then(|s| u16::try_from(s).ok()),
        action: r.get("action")?,
        resource_type: r.get("resource_type")?,
        resource_id: r.get("resource_id")?,
        before: r.get("before")?,
        after: r.get("after")?,
        project: r.get("project")?,
    })
}
