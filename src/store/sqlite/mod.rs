//! The embedded store: SQLite in WAL mode, for a single combee process with no
//! database server. Writes go through one dedicated connection, so concurrent
//! writers queue in-process instead of failing with `SQLITE_BUSY`; reads use a
//! separate pool. Changes are announced on an in-process broadcast after commit.
//!
//! This file opens the database and says where each method of [`Backend`]
//! lives: `trace_writes.rs` stores traces (their INSERT and the group-commit
//! writer), `claims.rs` hands out the leases of rounds and deliveries,
//! `key_generation.rs` caches the API key generation, and `dialect.rs` says
//! how SQLite keeps ids, times and JSON.

mod claims;
mod dialect;
mod key_generation;
mod trace_writes;

use std::{path::Path, str::FromStr, time::Duration};

use async_trait::async_trait;
use sqlx::{
    Sqlite,
    sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous},
};
use tokio::sync::broadcast;
use uuid::Uuid;

use super::backend::{Backend, SqlStore};
use super::group_commit::GroupCommit;
use super::{StoreError, StoreKind, StoreResult, migrate};
use crate::domain::{
    Feedback,
    trace::{FeedbackSource, IdempotencyKey, IdempotentIngest, ValidTrace},
};

pub use key_generation::KeyGenerationCache;
pub use trace_writes::Write;

pub type SqliteStore = SqlStore<Sqlite>;

/// Each reading connection's own page cache, in KiB (SQLite's default is
/// 2,000): the readers' pages are also in the operating system's cache, and
/// sixteen full default caches were a quarter of the server's memory once
/// many prompts had been read.
const READER_PAGE_CACHE_KIB: u32 = 256;

impl SqlStore<Sqlite> {
    pub async fn open(path: &Path, readers: u32, acquire_timeout: Duration) -> StoreResult<Self> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)
                .map_err(|e| StoreError::Invalid(format!("cannot create data directory {}: {e}", dir.display())))?;
        }
        let options = SqliteConnectOptions::from_str(&format!("sqlite://{}", path.display()))
            .map_err(StoreError::Unavailable)?
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Full)
            .foreign_keys(true)
            .busy_timeout(Duration::from_secs(10));
        let writer = SqlitePoolOptions::new()
            .max_connections(1)
            // A file the process itself holds open does not go away between uses: checking the
            // one connection before each use cost every group of trace writes a round trip.
            .test_before_acquire(false)
            .acquire_timeout(acquire_timeout.max(Duration::from_secs(30)))
            .connect_with(options.clone())
            .await
            .map_err(StoreError::Unavailable)?;
        migrate::sqlite(&writer).await?;
        let reader = SqlitePoolOptions::new()
            .max_connections(readers.max(1))
            .acquire_timeout(acquire_timeout)
            .connect_with(options.read_only(true).pragma("cache_size", format!("-{READER_PAGE_CACHE_KIB}")))
            .await
            .map_err(StoreError::Unavailable)?;
        let (changes, _) = broadcast::channel(1024);
        let writes = trace_writes::start_writer(&writer);
        Ok(Self { writer, reader, changes, watch: KeyGenerationCache::open(path), writes })
    }
}

#[async_trait]
impl Backend for Sqlite {
    const KIND: StoreKind = StoreKind::Sqlite;
    const ANNOUNCE_LOCALLY: bool = true;
    type Watch = KeyGenerationCache;
    type Writes = GroupCommit<Write>;

    async fn api_key_generation(s: &SqlStore<Self>) -> StoreResult<i64> {
        key_generation::api_key_generation(s).await
    }

    async fn insert_traces(s: &SqlStore<Self>, traces: &[ValidTrace]) -> StoreResult<Vec<Uuid>> {
        trace_writes::insert_traces(s, traces).await
    }

    async fn insert_traces_idempotent(
        s: &SqlStore<Self>,
        key: IdempotencyKey<'_>,
        traces: &[ValidTrace],
    ) -> StoreResult<IdempotentIngest> {
        trace_writes::insert_traces_idempotent(s, key, traces).await
    }

    async fn add_feedback(
        s: &SqlStore<Self>,
        id: Uuid,
        feedback: Feedback,
        source: FeedbackSource,
    ) -> StoreResult<bool> {
        trace_writes::add_feedback(s, id, feedback, source).await
    }

    async fn claim_round_id(s: &SqlStore<Self>, owner: &str, lease: Duration) -> StoreResult<Option<Uuid>> {
        claims::claim_round_id(s, owner, lease).await
    }

    async fn heartbeat_round(s: &SqlStore<Self>, round: Uuid, attempt: i32, lease: Duration) -> StoreResult<bool> {
        claims::heartbeat_round(s, round, attempt, lease).await
    }

    async fn claim_delivery_ids(
        s: &SqlStore<Self>,
        owner: &str,
        lease: Duration,
        limit: u32,
    ) -> StoreResult<Vec<Uuid>> {
        claims::claim_delivery_ids(s, owner, lease, limit).await
    }
}
