//! The production store: Postgres, shared by any number of combee processes.
//! Version numbers are assigned under the prompt's row lock; label moves are
//! compare-and-set; every change is announced with `NOTIFY combee_changes` in
//! the same transaction so other processes drop their caches at commit.
//!
//! Postgres may sit behind a pooler in transaction mode (PgBouncer's
//! `pool_mode = transaction`), which hands a server connection to a client
//! only until its transaction ends: see [`Route`]. What needs a session of its
//! own (the LISTEN of the change listener, the migrations' advisory locks)
//! then goes to Postgres directly.
//!
//! This file connects and says where each method of [`Backend`] lives:
//! `trace_writes.rs` stores traces (their INSERT and the group-commit
//! writer), `claims.rs` hands out the leases of rounds and deliveries,
//! `listener.rs` carries the change feed between processes, `route.rs` says
//! how the store reaches Postgres, and `dialect.rs` how statements run there.

mod claims;
mod dialect;
mod listener;
mod route;
mod trace_writes;

use std::{str::FromStr, time::Duration};

use async_trait::async_trait;
use sqlx::{
    PgPool, Postgres, Row,
    postgres::{PgConnectOptions, PgPoolOptions},
};
use tokio::sync::broadcast;
use uuid::Uuid;

use super::backend::{Backend, SqlStore};
use super::group_commit::GroupCommit;
use super::sql::Dialect;
use super::{StoreError, StoreKind, StoreResult, migrate};
use crate::domain::{
    Feedback,
    trace::{FeedbackSource, IdempotencyKey, IdempotentIngest, ValidTrace},
};

pub use listener::Listener;
pub use route::{Route, through_pooler};
pub use trace_writes::Insert;

pub type PgStore = SqlStore<Postgres>;

impl SqlStore<Postgres> {
    pub async fn connect(
        url: &str,
        route: &Route,
        max_connections: u32,
        acquire_timeout: Duration,
    ) -> StoreResult<Self> {
        let mut options = PgConnectOptions::from_str(url).map_err(StoreError::Unavailable)?;
        if route.transaction_pooler {
            if route.direct_url.is_none() {
                return Err(StoreError::Invalid(
                    "a transaction pooler needs a direct URL to Postgres (database.direct_url) for LISTEN and \
                     the migrations' advisory locks"
                        .into(),
                ));
            }
            // Nothing cached (which is also how its connections tell their route, see
            // `route::through_pooler`), and no startup parameter PgBouncer does not know by default.
            options = options.statement_cache_capacity(0).extra_float_digits(None);
        }
        let mut pool = PgPoolOptions::new()
            .max_connections(max_connections)
            .acquire_timeout(acquire_timeout)
            // No ping before every checkout (it was 12% of server CPU on trace ingest);
            // a dead connection fails its statement instead, and the pool replaces it.
            .test_before_acquire(false);
        if !route.transaction_pooler {
            pool = pool.after_connect(route::mark_direct);
        }
        let pool = pool.connect_with(options).await.map_err(StoreError::Unavailable)?;
        let direct = match &route.direct_url {
            // The listener's connection and one for the migrations.
            Some(direct) => PgPoolOptions::new()
                .max_connections(2)
                .acquire_timeout(acquire_timeout)
                .test_before_acquire(false)
                .connect(direct)
                .await
                .map_err(StoreError::Unavailable)?,
            None => pool.clone(),
        };
        migrate::postgres(&direct).await?;
        let (changes, _) = broadcast::channel(1024);
        let listener = Listener::start(direct, changes.clone());

        let writes = trace_writes::start_writer(&pool, max_connections);
        Ok(Self { writer: pool.clone(), reader: pool, changes, watch: listener, writes })
    }

    pub fn pool(&self) -> &PgPool {
        &self.writer
    }
}

#[async_trait]
impl Backend for Postgres {
    const KIND: StoreKind = StoreKind::Postgres;
    const ANNOUNCE_LOCALLY: bool = false;
    type Watch = Listener;
    type Writes = GroupCommit<Insert>;

    async fn api_key_generation(s: &SqlStore<Self>) -> StoreResult<i64> {
        let mut c = s.writer.acquire().await?;
        let row = Postgres::fetch_optional(sqlx::query("SELECT generation FROM api_key_generation"), &mut c).await?;
        Ok(row.ok_or(StoreError::NotFound)?.try_get("generation")?)
    }

    async fn insert_traces(s: &SqlStore<Self>, traces: &[ValidTrace]) -> StoreResult<Vec<Uuid>> {
        trace_writes::insert_traces(s, traces).await
    }

    async fn add_feedback(
        s: &SqlStore<Self>,
        id: Uuid,
        feedback: Feedback,
        source: FeedbackSource,
    ) -> StoreResult<bool> {
        trace_writes::add_feedback(s, id, feedback, source).await
    }

    async fn insert_traces_idempotent(
        s: &SqlStore<Self>,
        key: IdempotencyKey<'_>,
        traces: &[ValidTrace],
    ) -> StoreResult<IdempotentIngest> {
        trace_writes::insert_traces_idempotent(s, key, traces).await
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
