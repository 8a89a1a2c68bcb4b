//! The leases Postgres hands out to any number of processes: the oldest
//! claimable round to a worker, due webhook deliveries to a deliverer (both
//! with `FOR UPDATE SKIP LOCKED`, so concurrent claims never wait on each
//! other), and a round's heartbeat.

use std::time::Duration;

use sqlx::{Postgres, Row};
use uuid::Uuid;

use crate::store::{StoreResult, backend::SqlStore, sql::Dialect};

/// Takes the lease of the oldest claimable round; its id.
pub(super) async fn claim_round_id(s: &SqlStore<Postgres>, owner: &str, lease: Duration) -> StoreResult<Option<Uuid>> {
    let q = sqlx::query(
        "WITH c AS (
             SELECT id FROM rounds
             WHERE (status = 'queued' AND not_before <= now()) OR (status = 'running' AND lease_expires_at < now())
             ORDER BY created_at FOR UPDATE SKIP LOCKED LIMIT 1)
         UPDATE rounds r SET status = 'running', attempt = r.attempt + 1, lease_owner = $1,
                lease_expires_at = now() + make_interval(secs => $2), started_at = COALESCE(r.started_at, now()),
                updated_at = now()
         FROM c WHERE r.id = c.id RETURNING r.id",
    );
    let row =
        Postgres::fetch_optional(q.bind(owner).bind(lease.as_secs_f64()), &mut *s.writer.acquire().await?).await?;
    Ok(row.map(|r| r.try_get("id")).transpose()?)
}

/// Extends a running round's lease; false when the round is no longer this attempt's.
pub(super) async fn heartbeat_round(
    s: &SqlStore<Postgres>,
    round: Uuid,
    attempt: i32,
    lease: Duration,
) -> StoreResult<bool> {
    let q = sqlx::query(
        "UPDATE rounds SET lease_expires_at = now() + make_interval(secs => $3), updated_at = now()
         WHERE id = $1 AND attempt = $2 AND status = 'running'",
    );
    let q = q.bind(round).bind(attempt).bind(lease.as_secs_f64());
    let n = Postgres::execute(q, &mut *s.writer.acquire().await?).await?;
    Ok(n == 1)
}

/// Leases up to `limit` due deliveries to `owner`: the ids claimed.
pub(super) async fn claim_delivery_ids(
    s: &SqlStore<Postgres>,
    owner: &str,
    lease: Duration,
    limit: u32,
) -> StoreResult<Vec<Uuid>> {
    // The lease is the due time itself: a crashed attempt becomes due again when it expires.
    let q = sqlx::query(
        "WITH c AS (
             SELECT d.id FROM webhook_deliveries d
             JOIN webhook_subscriptions s ON s.id = d.subscription_id AND s.enabled
             WHERE d.status = 'pending' AND d.next_attempt_at <= now()
             ORDER BY d.next_attempt_at FOR UPDATE OF d SKIP LOCKED LIMIT $3)
         UPDATE webhook_deliveries d SET attempts = d.attempts + 1, lease_owner = $1,
                next_attempt_at = now() + make_interval(secs => $2), updated_at = now()
         FROM c WHERE d.id = c.id RETURNING d.id",
    );
    let q = q.bind(owner).bind(lease.as_secs_f64()).bind(i64::from(limit));
    let rows = Postgres::fetch_all(q, &mut *s.writer.acquire().await?).await?;
    Ok(rows.iter().map(|r| r.try_get("id")).collect::<Result<_, _>>()?)
}
