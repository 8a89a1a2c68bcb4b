//! How a Postgres store reaches its database: directly, or through a pooler
//! in transaction mode, which changes how every statement must run.

use std::sync::atomic::AtomicBool;

/// How this process reaches Postgres.
///
/// Through a transaction pooler a statement may not outlive its transaction
/// on the server connection: the pooler gives the connection to another
/// client at the next idle `ReadyForQuery`. sqlx 0.8 runs a statement with
/// parameters in two round trips (Parse and Describe, Sync; then Bind and
/// Execute, Sync), and names it (`sqlx_s_N`, per client connection) even with
/// its statement cache off. So, through a pooler, every statement is unnamed
/// (`persistent(false)`, nothing cached) and one that is not already in a
/// transaction runs inside its own `BEGIN`/`COMMIT`, which keeps both round
/// trips on one server connection. Session-scoped statements never go
/// through the pooler: the LISTEN of the change listener and the advisory
/// locks of the migrations use [`Route::direct_url`].
#[derive(Debug, Clone, Default)]
pub struct Route {
    /// Postgres itself, for what needs a session of its own; `None`: the main URL.
    pub direct_url: Option<String>,
    /// The main URL is a pooler in transaction mode.
    pub transaction_pooler: bool,
}

/// Set once a store of this process talks to Postgres through a transaction
/// pooler: from then on every statement of the process's Postgres stores runs
/// pooler-safe (see [`Route`]). A process serves one store; a test that opens
/// a direct store beside a pooled one only pays the pooled way's round trips.
pub(super) static THROUGH_POOLER: AtomicBool = AtomicBool::new(false);
