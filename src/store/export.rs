//! The traces a dataset export reads: one prompt's traces (optionally one
//! version's, within a time range, never quarantined ones), oldest first, a
//! page at a time by keyset (the last id seen), so an export of any size holds
//! one page in memory and a trace that arrives meanwhile is simply included
//! or not, never read twice.

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use uuid::Uuid;

use super::{
    StoreResult,
    backend::{Backend, SqlStore},
    sql::sql,
    traces::{TRACE_COLUMNS, ids_made_before, ids_made_from, trace_from_row},
};
use crate::domain::{PromptName, Trace};

/// Which traces an export reads.
#[derive(Debug, Clone)]
pub struct ExportQuery {
    pub prompt: PromptName,
    /// Only traces that ran with this version.
    pub version: Option<i64>,
    /// Received at or after.
    pub since: Option<DateTime<Utc>>,
    /// Received before.
    pub until: Option<DateTime<Utc>>,
}

#[async_trait]
pub trait ExportStore: Send + Sync {
    /// Up to `limit` traces of the query with ids above `after`, by id (oldest first).
    async fn export_page(&self, query: &ExportQuery, after: Option<Uuid>, limit: u32) -> StoreResult<Vec<Trace>>;
}

#[async_trait]
impl<D: Backend> ExportStore for SqlStore<D> {
    async fn export_page(&self, q: &ExportQuery, after: Option<Uuid>, limit: u32) -> StoreResult<Vec<Trace>> {
        sql::<D>(&format!(
            "SELECT {TRACE_COLUMNS} FROM traces t JOIN prompts p ON p.id = t.prompt_id
             WHERE p.name = $1 AND p.project = $7 AND ($2 IS NULL OR t.prompt_version = $2)
               AND ($3 IS NULL OR (t.created_at >= $3 AND t.id >= $8))
               AND ($4 IS NULL OR (t.created_at < $4 AND t.id < $9))
               AND ($5 IS NULL OR t.id > $5) AND t.quarantined_at IS NULL
             ORDER BY t.id LIMIT $6"
        ))
        .bind(q.prompt.as_str())
        .bind(q.version)
        .bind(q.since)
        .bind(q.until)
        .bind(after)
        .bind(i64::from(limit))
        .bind(q.prompt.project())
        .bind(q.since.map(ids_made_from))
        .bind(q.until.map(ids_made_before))
        .map(&mut *self.reader.acquire().await?, trace_from_row::<D>)
        .await
    }
}
