//! The leases SQLite hands out: the oldest claimable round to a worker, due
//! webhook deliveries to a deliverer, and a round's heartbeat. One writer
//! connection serves them, so a claim cannot race another in this process.

use std::time::Duration;

use sqlx::Sqlite;
use uuid::Uuid;

use super::dialect::{now_us, uuid};
use crate::store::{StoreResult, backend::SqlStore};

fn micros(d: Duration) -> i64 {
    d.as_micros().min(i64::MAX as u128) as i64
}

/// Takes the lease of the oldest claimable round; its id.
pub(super) async fn claim_round_id(s: &SqlStore<Sqlite>, owner: &str, lease: Duration) -> StoreResult<Option<Uuid>> {
    let now = now_us();
    let id: Option<String> = sqlx::query_scalar(
        "UPDATE rounds SET status = 'running', attempt = attempt + 1, lease_owner = ?1, lease_expires_at = ?2 + ?3,
                started_at = COALESCE(started_at, ?2), updated_at = ?2
         WHERE id = (SELECT id FROM rounds
                     WHERE (status = 'queued' AND not_before <= ?2) OR (status = 'running' AND lease_expires_at < ?2)
                     ORDER BY created_at LIMIT 1)
         RETURNING id",
    )
    .bind(owner)
    .bind(now)
    .bind(micros(lease))
    .fetch_optional(&s.writer)
    .await?;
    id.as_deref().map(uuid).transpose()
}

/// Extends a running round's lease; false when the round is no longer this attempt's.
pub(super) async fn heartbeat_round(
    s: &SqlStore<Sqlite>,
    round: Uuid,
    attempt: i32,
    lease: Duration,
) -> StoreResult<bool> {
    let now = now_us();
    let n = sqlx::query(
        "UPDATE rounds SET lease_expires_at = ?, updated_at = ? WHERE id = ? AND attempt = ? AND status = 'running'",
    )
    .bind(now + micros(lease))
    .bind(now)
    .bind(round.to_string())
    .bind(attempt)
    .execute(&s.writer)
    .await?
    .rows_affected();
    Ok(n == 1)
}

/// Leases up to `limit` due deliveries to `owner`: the ids claimed.
pub(super) async fn claim_delivery_ids(
    s: &SqlStore<Sqlite>,
    owner: &str,
    lease: Duration,
    limit: u32,
) -> StoreResult<Vec<Uuid>> {
    // One writer connection: the claim cannot race another claim in this
    // process, and SQLite serves a single process. The lease is the due
    // time itself, so a crashed attempt becomes due again when it expires.
    let now = now_us();
    let ids: Vec<String> = sqlx::query_scalar(
        "UPDATE webhook_deliveries SET attempts = attempts + 1, lease_owner = ?1, next_attempt_at = ?2 + ?3,
                updated_at = ?2
         WHERE id IN (SELECT d.id FROM webhook_deliveries d
                      JOIN webhook_subscriptions s ON s.id = d.subscription_id AND s.enabled = 1
                      WHERE d.status = 'pending' AND d.next_attempt_at <= ?2
                      ORDER BY d.next_attempt_at LIMIT ?4)
         RETURNING id",
    )
    .bind(owner)
    .bind(now)
    .bind(micros(lease))
    .bind(i64::from(limit))
    .fetch_all(&s.writer)
    .await?;
    ids.iter().map(|id| uuid(id)).collect()
}
