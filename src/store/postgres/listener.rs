//! The change feed between processes on Postgres: every change is announced
//! with `NOTIFY combee_changes` in its transaction, and each process listens
//! on a session of its own and forwards what it hears to its caches.

use std::time::Duration;

use sqlx::{PgPool, postgres::PgListener};
use tokio::{sync::broadcast, task::JoinHandle};

use crate::store::Change;

/// The channel every change is announced on.
pub(super) const CHANNEL: &str = "combee_changes";

/// The NOTIFY listener task, stopped with the store.
pub struct Listener(JoinHandle<()>);

impl Listener {
    /// Starts listening on `pool`, a direct one (LISTEN needs a session of its own).
    pub(super) fn start(pool: PgPool, changes: broadcast::Sender<Change>) -> Self {
        Self(tokio::spawn(listen(pool, changes)))
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Forwards NOTIFY payloads to the in-process broadcast; after any gap in the
/// connection it sends `Resync`, since notifications may have been missed.
async fn listen(pool: PgPool, tx: broadcast::Sender<Change>) {
    let mut backoff = Duration::from_millis(100);
    loop {
        let mut listener = match PgListener::connect_with(&pool).await {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(error = %e, "change listener cannot connect; retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
                continue;
            }
        };
        if let Err(e) = listener.listen(CHANNEL).await {
            tracing::warn!(error = %e, "LISTEN failed; retrying");
            tokio::time::sleep(backoff).await;
            continue;
        }
        backoff = Duration::from_millis(100);
        let _ = tx.send(Change::Resync);
        loop {
            match listener.try_recv().await {
                Ok(Some(n)) => {
                    let change = match n.payload().split_once(':') {
                        Some(("prompt", name)) => Change::Prompt(name.to_owned()),
                        _ if n.payload() == "keys" => Change::Keys,
                        _ if n.payload() == "round" => Change::RoundQueued,
                        _ if n.payload() == "outbox" => Change::OutboxEvent,
                        _ => Change::Resync,
                    };
                    let _ = tx.send(change);
                }
                Ok(None) => {
                    let _ = tx.send(Change::Resync);
                }
                Err(e) => {
                    tracing::warn!(error = %e, "change listener lost its connection");
                    let _ = tx.send(Change::Resync);
                    break;
                }
            }
        }
    }
}
