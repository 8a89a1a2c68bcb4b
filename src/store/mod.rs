//! Persistence behind narrow traits, one per resource (`keys.rs`,
//! `prompts.rs`, `traces.rs`…: each holds its sub-trait and its
//! [`SqlStore`](backend::SqlStore) implementation; `rounds/` one sub-trait per
//! job of a round), combined into [`Store`], with a Postgres implementation
//! (production, many processes) and an embedded SQLite one (the default, no
//! server needed). Dispatch on the URL happens once, in [`connect`]. Every SQL
//! statement lives next to the store function that runs it. The store knows
//! nothing of HTTP: it takes and returns plain data.

mod arms;
mod audit;
mod backend;
mod budget;
mod controller_state;
mod evaluators;
mod export;
mod group_commit;
mod keys;
mod labels;
mod llm_limits;
mod migrate;
mod otlp;
mod people;
pub mod postgres;
mod projects;
mod prompts;
mod regression;
mod retention;
mod rollups;
mod rounds;
mod sessions;
mod sql;
pub mod sqlite;
mod traces;
mod versions;
mod webhooks;

use std::sync::Arc;

use async_trait::async_trait;
use serde::Serialize;
use tokio::sync::broadcast;

pub use arms::{PopulationStore, RatingSlot};
pub use audit::AuditStore;
pub use budget::{BudgetStore, HoldOutcome, HoldRequest, Settlement};
pub use controller_state::{CONTROLLER_SAMPLES_KEPT, ControllerSample, ControllerStore, MeterCounts};
pub use evaluators::{Calibrating, EvaluatorStore, JudgedFeedback, JudgedTrace, Unjudged};
pub use export::{ExportQuery, ExportStore};
pub use keys::{KeyStore, scopes_from_string, scopes_to_string};
pub use labels::{LabelMoveQuery, LabelStore};
pub use llm_limits::LlmLimitStore;
pub use otlp::OtlpStore;
pub use people::PeopleStore;
pub use projects::ProjectStore;
pub use prompts::PromptStore;
pub use regression::{GateSettings, OpenGate, RegressionStore};
pub use retention::{Expiring, Retention, TraceExpiry};
pub use rollups::{Rollups, minute_rollup_cutoff, second_rollup_cutoff};
pub use rounds::{
    Backlog, ClaimedRound, FailureStreakStore, OpenRound, RoundCall, RoundClaimStore, RoundEnd, RoundFailure,
    RoundJournalStore, RoundRecordStore, RoundStore, TraceCharges, TraceFault,
};
pub use sessions::SessionStore;
pub use traces::{TraceAction, TraceStore};
pub use webhooks::{AttemptRecord, ClaimedDelivery, DeliveryOutcome, WebhookStore};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("not found")]
    NotFound,
    /// A unique constraint (e.g. prompt name) was hit.
    #[error("already exists")]
    AlreadyExists,
    /// An optimistic-concurrency check failed; the value holds the current state.
    #[error("precondition failed")]
    Conflict,
    /// Input referenced something that does not exist (e.g. a trace for an unknown prompt).
    #[error("{0}")]
    Invalid(String),
    /// The database could not be reached in time.
    #[error("store unavailable")]
    Unavailable(#[source] sqlx::Error),
    #[error("database error")]
    Database(#[source] sqlx::Error),
    #[error("corrupt row: {0}")]
    Corrupt(String),
    #[error("migration failed: {0}")]
    Migration(String),
    /// This inbound webhook id already opened a round.
    #[error("already processed")]
    Duplicate,
}

impl From<sqlx::Error> for StoreError {
    fn from(e: sqlx::Error) -> Self {
        match &e {
            sqlx::Error::RowNotFound => StoreError::NotFound,
            sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed | sqlx::Error::Io(_) => StoreError::Unavailable(e),
            sqlx::Error::Database(db) if db.is_unique_violation() => StoreError::AlreadyExists,
            sqlx::Error::Database(db) if db.code().is_some_and(|c| is_outage_sqlstate(&c)) => {
                StoreError::Unavailable(e)
            }
            _ => StoreError::Database(e),
        }
    }
}

/// True for the SQLSTATE classes that mean the server is going away or the
/// connection broke, not that the statement was wrong: `08` (connection
/// exception) and `57` (operator intervention: `57P01` admin shutdown during
/// `pg_ctl restart -m fast`, `57P03` cannot connect now, `57014` canceled).
/// A SQLSTATE is five characters; SQLite's numeric codes never match.
fn is_outage_sqlstate(code: &str) -> bool {
    code.len() == 5 && (code.starts_with("08") || code.starts_with("57"))
}

pub type StoreResult<T> = Result<T, StoreError>;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum StoreKind {
    Postgres,
    Sqlite,
}

/// Something changed that cached readers must drop.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// Versions or labels of a prompt of this name changed, in some project.
    /// Named by the bare name, as the previous release writes and reads the
    /// payload (`prompt:NAME`), so processes of either release mid-upgrade
    /// drop what they hold of it; every project's prompt of the name is
    /// dropped, which costs only a reload.
    Prompt(String),
    /// An API key was created or revoked.
    Keys,
    /// A round was queued or re-queued: workers may wake up.
    RoundQueued,
    /// Webhook deliveries were queued: the delivery worker may wake up.
    OutboxEvent,
    /// Notifications may have been missed (listener reconnected): drop everything.
    Resync,
}

impl Change {
    /// `prompt` changed.
    pub fn prompt(prompt: &crate::domain::PromptName) -> Self {
        Change::Prompt(prompt.as_str().to_owned())
    }
}

/// The whole store: every resource's sub-trait, and what concerns the
/// connection itself. Callers hold it as [`DynStore`].
#[async_trait]
pub trait Store:
    KeyStore
    + AuditStore
    + SessionStore
    + PeopleStore
    + PromptStore
    + ProjectStore
    + LabelStore
    + PopulationStore
    + RegressionStore
    + TraceStore
    + OtlpStore
    + RoundStore
    + WebhookStore
    + ControllerStore
    + ExportStore
    + EvaluatorStore
    + Rollups
    + Retention
    + BudgetStore
    + LlmLimitStore
    + Send
    + Sync
    + 'static
{
    fn kind(&self) -> StoreKind;
    /// Cheap reachability check for `/readyz`.
    async fn ping(&self) -> StoreResult<()>;
    /// Cache invalidations; on Postgres they arrive from every process.
    fn changes(&self) -> broadcast::Receiver<Change>;
}

pub type DynStore = Arc<dyn Store>;

/// Opens the store the URL names, creating and migrating it as needed.
pub async fn connect(url: &str, max_connections: u32, acquire_timeout: std::time::Duration) -> StoreResult<DynStore> {
    connect_via(url, &postgres::Route::default(), max_connections, acquire_timeout).await
}

/// [`connect`], with Postgres reached the way `route` says (a transaction
/// pooler in front, a direct URL for the session-scoped statements).
pub async fn connect_via(
    url: &str,
    route: &postgres::Route,
    max_connections: u32,
    acquire_timeout: std::time::Duration,
) -> StoreResult<DynStore> {
    if is_postgres(url) {
        Ok(Arc::new(postgres::PgStore::connect(url, route, max_connections, acquire_timeout).await?))
    } else if let Some(path) = url.strip_prefix("sqlite://") {
        Ok(Arc::new(sqlite::SqliteStore::open(std::path::Path::new(path), max_connections, acquire_timeout).await?))
    } else {
        Err(StoreError::Invalid("database url must start with postgres://, postgresql:// or sqlite://".into()))
    }
}

/// Whether `url` names a Postgres server (`postgres://` or `postgresql://`).
pub fn is_postgres(url: &str) -> bool {
    url.starts_with("postgres://") || url.starts_with("postgresql://")
}

#[cfg(test)]
mod tests {
    use std::borrow::Cow;

    use super::*;

    /// A database error carrying just a SQLSTATE, as a driver would report it.
    #[derive(Debug)]
    struct Coded(&'static str);

    impl std::fmt::Display for Coded {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "error {}", self.0)
        }
    }

    impl std::error::Error for Coded {}

    impl sqlx::error::DatabaseError for Coded {
        fn message(&self) -> &str {
            "simulated"
        }
        fn code(&self) -> Option<Cow<'_, str>> {
            Some(Cow::Borrowed(self.0))
        }
        fn as_error(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
            self
        }
        fn as_error_mut(&mut self) -> &mut (dyn std::error::Error + Send + Sync + 'static) {
            self
        }
        fn into_error(self: Box<Self>) -> Box<dyn std::error::Error + Send + Sync + 'static> {
            self
        }
        fn kind(&self) -> sqlx::error::ErrorKind {
            if self.0 == "23505" { sqlx::error::ErrorKind::UniqueViolation } else { sqlx::error::ErrorKind::Other }
        }
    }

    fn mapped(code: &'static str) -> StoreError {
        StoreError::from(sqlx::Error::Database(Box::new(Coded(code))))
    }

    #[test]
    fn server_shutdown_and_broken_connections_are_outages_not_bugs() {
        // 57P01 admin_shutdown is what `pg_ctl restart -m fast` sends to open sessions.
        for code in ["57P01", "57P02", "57P03", "57014", "08000", "08003", "08006", "08P01"] {
            assert!(matches!(mapped(code), StoreError::Unavailable(_)), "{code} is an outage");
        }
        assert!(matches!(mapped("23505"), StoreError::AlreadyExists));
        for code in ["42P01", "22P02", "40001", "5", "517"] {
            assert!(matches!(mapped(code), StoreError::Database(_)), "{code} is not an outage");
        }
    }
}
