//! How a Postgres store reaches its database: directly, or through a pooler
//! in transaction mode, which changes how every statement must run. The
//! route is each store's own: two stores of one process, one through a pooler
//! and one direct, each run their statements their own way.

use futures_util::future::BoxFuture;
use sqlx::{Connection, Executor, PgConnection, pool::PoolConnectionMetadata};

/// How a store reaches Postgres.
///
/// Through a transaction pooler a statement may not outlive its transaction
/// on the server connection: the pooler gives the connection to another
/// client at the next idle `ReadyForQuery`. sqlx 0.8 runs a statement with
/// parameters in two round trips (Parse and Describe, Sync; then Bind and
/// Execute, Sync), and names it (`sqlx_s_N`, per client connection) even with
/// its statement cache off. So, through a pooler, every statement is unnamed
/// (`persistent(false)`, nothing cached) and one that is not already in a
/// transaction runs inside its own `BEGIN`/`COMMIT`, which keeps both round
/// trips on one server connection. Each connection of the store tells which
/// way its statements run ([`through_pooler`]). Session-scoped statements
/// never go through the pooler: the LISTEN of the change listener and the
/// advisory locks of the migrations use [`Route::direct_url`].
#[derive(Debug, Clone, Default)]
pub struct Route {
    /// Postgres itself, for what needs a session of its own; `None`: the main URL.
    pub direct_url: Option<String>,
    /// The main URL is a pooler in transaction mode.
    pub transaction_pooler: bool,
}

/// Whether a statement on `c` must run the pooler's way (see [`Route`]),
/// as the connection itself tells, since the executors see nothing else of
/// the store (sqlx keeps no state of ours on a connection): by its statement
/// cache. A store through a transaction pooler turns the cache off, so its
/// connections never cache anything; a direct store's connection caches one
/// statement as it opens ([`mark_direct`]) and is never empty again (the
/// cache only evicts to make room). An empty cache is the pooler's way,
/// which is also the safe way on any connection.
pub fn through_pooler(c: &PgConnection) -> bool {
    c.cached_statements_size() == 0
}

/// The statement a direct connection caches as it opens.
const DIRECT_MARK: &str = "SELECT 'direct' AS route";

/// Marks a direct store's connection as it opens (see [`through_pooler`]):
/// one statement prepared and cached, a round trip per connection.
pub(super) fn mark_direct(c: &mut PgConnection, _: PoolConnectionMetadata) -> BoxFuture<'_, sqlx::Result<()>> {
    Box::pin(async move { c.prepare(DIRECT_MARK).await.map(drop) })
}
