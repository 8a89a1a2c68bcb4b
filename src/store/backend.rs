//! One [`Store`] implementation for both SQL backends: [`SqlStore`] holds the
//! pools and the change broadcast. Each resource's methods are written once,
//! in that resource's file beside this one, over [`Dialect`](super::sql::Dialect),
//! or handed to the backend's [`Backend`] implementation (below) where their
//! SQL really differs.

use std::time::Duration;

use async_trait::async_trait;
use sqlx::{Pool, Transaction};
use tokio::sync::broadcast;
use uuid::Uuid;

use super::{
    Change, Store, StoreKind, StoreResult,
    sql::{Dialect, sql},
};
use crate::domain::{
    Feedback,
    trace::{FeedbackSource, IdempotencyKey, IdempotentIngest, ValidTrace},
};

/// A SQL store: `writer` takes every write (SQLite: one connection, so writers
/// queue in-process), `reader` the reads (on Postgres the same pool).
pub struct SqlStore<D: Backend> {
    pub(super) writer: Pool<D>,
    pub(super) reader: Pool<D>,
    pub(super) changes: broadcast::Sender<Change>,
    /// How this process learns of other processes' writes (see [`Backend::Watch`]).
    pub(super) watch: D::Watch,
    /// The lanes that commit trace writes in groups (see [`Backend::Writes`]).
    pub(super) writes: D::Writes,
}

impl<D: Backend> SqlStore<D> {
    /// Tells this process's cache readers (SQLite; Postgres hears its own NOTIFY instead).
    pub(super) fn announce(&self, change: Change) {
        if D::ANNOUNCE_LOCALLY {
            let _ = self.changes.send(change);
        }
    }

    /// Opens a write transaction on the writer (see [`Dialect::BEGIN_WRITE`]).
    pub(super) async fn begin_write(&self) -> sqlx::Result<Transaction<'static, D>> {
        self.writer.begin_with(D::BEGIN_WRITE).await
    }

    /// Commits, telling every process's cache about `change` (NOTIFY inside
    /// the transaction on Postgres, the in-process broadcast after it on SQLite).
    pub(super) async fn commit(&self, mut tx: Transaction<'_, D>, change: Change) -> StoreResult<()> {
        let payload = match &change {
            Change::Prompt(name) => format!("prompt:{name}"),
            Change::Keys => "keys".into(),
            Change::RoundQueued => "round".into(),
            Change::OutboxEvent => "outbox".into(),
            Change::Resync => "resync".into(),
        };
        D::notify(&mut tx, &payload).await?;
        tx.commit().await?;
        self.announce(change);
        Ok(())
    }

    pub(super) fn announce_outbox(&self, queued: bool) {
        if queued {
            self.announce(Change::OutboxEvent);
        }
    }
}

/// The store methods whose SQL differs between the backends.
#[async_trait]
pub trait Backend: Dialect {
    const KIND: StoreKind;
    /// True when changes are announced in-process after commit rather than by NOTIFY.
    const ANNOUNCE_LOCALLY: bool;
    /// What this backend keeps to learn of other processes' writes: on
    /// Postgres the task listening for their NOTIFY, on SQLite the cache of
    /// the API key generation, checked against the WAL index.
    type Watch: Send + Sync + 'static;
    /// The group-commit lanes of trace writes (see `group_commit.rs`).
    type Writes: Send + Sync + 'static;

    async fn api_key_generation(s: &SqlStore<Self>) -> StoreResult<i64>;
    async fn insert_traces(s: &SqlStore<Self>, traces: &[ValidTrace]) -> StoreResult<Vec<Uuid>>;
    async fn insert_traces_idempotent(
        s: &SqlStore<Self>,
        key: IdempotencyKey<'_>,
        traces: &[ValidTrace],
    ) -> StoreResult<IdempotentIngest>;
    /// Merges late feedback into a trace, durably (see
    /// [`merge_feedback`](super::traces::merge_feedback)); false when there is no such trace.
    async fn add_feedback(
        s: &SqlStore<Self>,
        id: Uuid,
        feedback: Feedback,
        source: FeedbackSource,
    ) -> StoreResult<bool>;
    /// Takes the lease of the oldest claimable round (see
    /// [`RoundClaimStore::claim_round`](super::RoundClaimStore::claim_round)); its id.
    async fn claim_round_id(s: &SqlStore<Self>, owner: &str, lease: Duration) -> StoreResult<Option<Uuid>>;
    async fn heartbeat_round(s: &SqlStore<Self>, round: Uuid, attempt: i32, lease: Duration) -> StoreResult<bool>;
    /// Leases up to `limit` due deliveries to `owner`: the ids claimed.
    async fn claim_delivery_ids(s: &SqlStore<Self>, owner: &str, lease: Duration, limit: u32)
    -> StoreResult<Vec<Uuid>>;
}

#[async_trait]
impl<D: Backend> Store for SqlStore<D> {
    fn kind(&self) -> StoreKind {
        D::KIND
    }

    fn changes(&self) -> broadcast::Receiver<Change> {
        self.changes.subscribe()
    }

    async fn ping(&self) -> StoreResult<()> {
        sql::<D>("SELECT 1 AS one").execute(&mut *self.reader.acquire().await?).await?;
        Ok(())
    }
}
