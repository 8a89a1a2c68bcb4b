//! Outbound webhook subscriptions and their deliveries: the outbox rows workers claim under a
//! lease, and the delivery log.

use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use uuid::Uuid;

use super::{
    StoreResult,
    backend::{Backend, SqlStore},
    sql::{Cols, Dialect, Param, corrupt, now, sql},
};
use crate::{
    domain::{
        event::{OutboxEvent, events_from_column, events_pattern, events_to_column},
        webhook::{DeliveryAttempt, NewWebhook, Webhook},
    },
    secret::Secret,
};

/// A delivery a worker holds the lease of: everything needed to send it.
#[derive(Debug, Clone)]
pub struct ClaimedDelivery {
    pub id: Uuid,
    pub subscription_id: Uuid,
    pub event_id: String,
    pub event_type: String,
    pub body: String,
    pub url: String,
    pub secret: Secret,
    /// This attempt's number (1 for the first), fencing its result.
    pub attempt: i32,
}

/// What became of one delivery attempt.
#[derive(Debug, Clone, PartialEq)]
pub enum DeliveryOutcome {
    Succeeded,
    /// Try again at `at`.
    Retry {
        at: DateTime<Utc>,
    },
    /// No more attempts.
    GiveUp,
    /// The receiver answered 410 Gone: give up and disable the subscription.
    Gone,
}

/// One attempt as recorded in the delivery log.
#[derive(Debug, Clone)]
pub struct AttemptRecord {
    pub status_code: Option<u16>,
    pub error: Option<String>,
    pub latency_ms: u64,
    pub outcome: DeliveryOutcome,
}

/// Outbound webhook subscriptions and their delivery outbox.
#[async_trait]
pub trait WebhookStore: Send + Sync {
    async fn create_webhook(&self, hook: &NewWebhook) -> StoreResult<Webhook>;
    /// Every subscription, or (given a project) that project's.
    async fn list_webhooks(&self, project: Option<&str>) -> StoreResult<Vec<Webhook>>;
    async fn get_webhook(&self, id: Uuid) -> StoreResult<Option<Webhook>>;
    /// Deletes the subscription with its pending deliveries and log; false when unknown.
    async fn delete_webhook(&self, id: Uuid) -> StoreResult<bool>;
    /// The subscription's delivery log, newest first, below the `before` cursor.
    async fn webhook_attempts(&self, id: Uuid, before: Option<i64>, limit: u32) -> StoreResult<Vec<DeliveryAttempt>>;
    /// Takes the lease of up to `limit` due deliveries (pending with
    /// `next_attempt_at` passed — an expired lease counts as due) of enabled
    /// subscriptions, bumping each one's attempt number.
    async fn claim_deliveries(&self, owner: &str, lease: Duration, limit: u32) -> StoreResult<Vec<ClaimedDelivery>>;
    /// Records an attempt and its outcome; false when the attempt no longer holds the lease.
    async fn finish_delivery(&self, d: &ClaimedDelivery, record: &AttemptRecord) -> StoreResult<bool>;
}

#[async_trait]
impl<D: Backend> WebhookStore for SqlStore<D> {
    async fn create_webhook(&self, h: &NewWebhook) -> StoreResult<Webhook> {
        let row = sql::<D>(&format!(
            "INSERT INTO webhook_subscriptions (id, url, events, description, secret, created_at, updated_at, project)
             VALUES ($1, $2, $3, $4, $5, $6, $6, $7) RETURNING {WEBHOOK_COLUMNS}"
        ))
        .bind(Uuid::now_v7())
        .bind(&h.url)
        .bind(events_to_column(&h.events))
        .bind(h.description.as_deref())
        .bind(h.secret.expose())
        .bind(now())
        .bind(h.project.as_deref())
        .fetch_one(&mut *self.writer.acquire().await?)
        .await?;
        webhook_from_row::<D>(&row)
    }

    async fn list_webhooks(&self, project: Option<&str>) -> StoreResult<Vec<Webhook>> {
        sql::<D>(&format!(
            "SELECT {WEBHOOK_COLUMNS} FROM webhook_subscriptions WHERE ($1 IS NULL OR project = $1) ORDER BY id"
        ))
        .bind(project)
        .map(&mut *self.reader.acquire().await?, webhook_from_row::<D>)
        .await
    }

    async fn get_webhook(&self, id: Uuid) -> StoreResult<Option<Webhook>> {
        sql::<D>(&format!("SELECT {WEBHOOK_COLUMNS} FROM webhook_subscriptions WHERE id = $1"))
            .bind(id)
            .fetch_optional(&mut *self.reader.acquire().await?)
            .await?
            .as_ref()
            .map(webhook_from_row::<D>)
            .transpose()
    }

    async fn delete_webhook(&self, id: Uuid) -> StoreResult<bool> {
        let n = sql::<D>("DELETE FROM webhook_subscriptions WHERE id = $1")
            .bind(id)
            .execute(&mut *self.writer.acquire().await?)
            .await?;
        Ok(n > 0)
    }

    async fn webhook_attempts(&self, id: Uuid, before: Option<i64>, limit: u32) -> StoreResult<Vec<DeliveryAttempt>> {
        sql::<D>(
            "SELECT a.id, a.delivery_id, d.event_id, e.type, a.attempt, a.status_code, a.error, a.latency_ms,
                    a.created_at, a.next_attempt_at, d.status
             FROM webhook_attempts a JOIN webhook_deliveries d ON d.id = a.delivery_id
             JOIN webhook_events e ON e.id = d.event_id
             WHERE a.subscription_id = $1 AND ($2 IS NULL OR a.id < $2) ORDER BY a.id DESC LIMIT $3",
        )
        .bind(id)
        .bind(before)
        .bind(i64::from(limit))
        .map(&mut *self.reader.acquire().await?, |row| {
            let r = Cols::<D>(row);
            Ok(DeliveryAttempt {
                seq: r.get("id")?,
                delivery_id: r.get("delivery_id")?,
                event_id: r.get("event_id")?,
                event_type: r.get("type")?,
                attempt: r.get("attempt")?,
                status_code: r.get::<Option<i32>>("status_code")?.map(|c| c as u16),
                error: r.get("error")?,
                latency_ms: r.get::<i64>("latency_ms")?.max(0) as u64,
                attempted_at: r.get("created_at")?,
                next_attempt_at: r.get("next_attempt_at")?,
                delivery_status: r.get("status")?,
            })
        })
        .await
    }

    async fn claim_deliveries(&self, owner: &str, lease: Duration, limit: u32) -> StoreResult<Vec<ClaimedDelivery>> {
        let ids = D::claim_delivery_ids(self, owner, lease, limit).await?;
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let text = format!(
            "SELECT d.id, d.subscription_id, d.event_id, e.type, e.body, s.url, s.secret, d.attempts
             FROM webhook_deliveries d JOIN webhook_events e ON e.id = d.event_id
             JOIN webhook_subscriptions s ON s.id = d.subscription_id
             WHERE {} ORDER BY d.next_attempt_at",
            D::any_of("d.id", "$1")
        );
        sql::<D>(&text)
            .bind(Param::Ids(Some(&ids)))
            .map(&mut *self.writer.acquire().await?, |row| {
                let r = Cols::<D>(row);
                Ok(ClaimedDelivery {
                    id: r.get("id")?,
                    subscription_id: r.get("subscription_id")?,
                    event_id: r.get("event_id")?,
                    event_type: r.get("type")?,
                    body: r.get("body")?,
                    url: r.get("url")?,
                    secret: Secret::new(r.get::<String>("secret")?),
                    attempt: r.get("attempts")?,
                })
            })
            .await
    }

    async fn finish_delivery(&self, d: &ClaimedDelivery, rec: &AttemptRecord) -> StoreResult<bool> {
        let now = now();
        let (status, next_at) = match &rec.outcome {
            DeliveryOutcome::Succeeded => ("succeeded", None),
            DeliveryOutcome::Retry { at } => ("pending", Some(*at)),
            DeliveryOutcome::GiveUp | DeliveryOutcome::Gone => ("failed", None),
        };
        let mut tx = self.begin_write().await?;
        let n = sql::<D>(
            "UPDATE webhook_deliveries SET status = $3, next_attempt_at = COALESCE($4, next_attempt_at),
                    last_error = $5, lease_owner = NULL, updated_at = $6
             WHERE id = $1 AND attempts = $2 AND status = 'pending'",
        )
        .bind(d.id)
        .bind(d.attempt)
        .bind(status)
        .bind(next_at)
        .bind(rec.error.as_deref())
        .bind(now)
        .execute(&mut tx)
        .await?;
        if n == 0 {
            return Ok(false);
        }
        sql::<D>(
            "INSERT INTO webhook_attempts (delivery_id, subscription_id, attempt, status_code, error, latency_ms,
                                           next_attempt_at, created_at)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
        )
        .bind(d.id)
        .bind(d.subscription_id)
        .bind(d.attempt)
        .bind(rec.status_code.map(i32::from))
        .bind(rec.error.as_deref())
        .bind(rec.latency_ms.min(i64::MAX as u64) as i64)
        .bind(next_at)
        .bind(now)
        .execute(&mut tx)
        .await?;
        if rec.outcome == DeliveryOutcome::Gone {
            sql::<D>(
                "UPDATE webhook_subscriptions SET enabled = FALSE, updated_at = $1,
                        disabled_reason = 'the receiver answered 410 Gone' WHERE id = $2",
            )
            .bind(now)
            .bind(d.subscription_id)
            .execute(&mut tx)
            .await?;
            sql::<D>(
                "UPDATE webhook_deliveries SET status = 'failed', last_error = 'subscription disabled', updated_at = $1
                 WHERE subscription_id = $2 AND status = 'pending'",
            )
            .bind(now)
            .bind(d.subscription_id)
            .execute(&mut tx)
            .await?;
        }
        tx.commit().await?;
        Ok(true)
    }
}

pub(super) const WEBHOOK_COLUMNS: &str =
    "id, url, events, description, project, secret, enabled, disabled_reason, created_at";

pub(super) fn webhook_from_row<D: Dialect>(row: &D::Row) -> StoreResult<Webhook> {
    let r = Cols::<D>(row);
    Ok(Webhook {
        id: r.get("id")?,
        url: r.get("url")?,
        events: events_from_column(&r.get::<String>("events")?).ok_or_else(|| corrupt("webhook events"))?,
        description: r.get("description")?,
        project: r.get("project")?,
        enabled: r.get("enabled")?,
        disabled_reason: r.get("disabled_reason")?,
        created_at: r.get("created_at")?,
        secret: Secret::new(r.get::<String>("secret")?),
    })
}

/// Writes an event into the outbox and fans it out to every enabled
/// subscription that asked for its type — inside the caller's transaction, so
/// the event exists exactly when the change it announces does. True when a
/// delivery was queued (other processes are told at commit).
pub(super) async fn record_event<D: Dialect>(c: &mut D::Connection, e: &OutboxEvent) -> StoreResult<bool> {
    let now = now();
    sql::<D>("INSERT INTO webhook_events (id, type, body, created_at) VALUES ($1, $2, $3, $4)")
        .bind(&e.id)
        .bind(e.kind.as_str())
        .bind(&e.body)
        .bind(e.created_at)
        .execute(c)
        .await?;
    // A project's subscription hears only of its project's prompts; a server-wide one of all.
    let subscribers = sql::<D>(
        "SELECT id FROM webhook_subscriptions WHERE enabled = TRUE AND events LIKE $1
         AND (project IS NULL OR project = $2)",
    )
    .bind(events_pattern(e.kind))
    .bind(e.prompt.as_ref().map(|p| p.project()))
    .map(c, |row| Cols::<D>(row).get::<Uuid>("id"))
    .await?;
    for sub in &subscribers {
        sql::<D>(
            "INSERT INTO webhook_deliveries (id, event_id, subscription_id, status, next_attempt_at, created_at, updated_at)
             VALUES ($1, $2, $3, 'pending', $4, $4, $4)",
        )
        .bind(Uuid::now_v7())
        .bind(&e.id)
        .bind(*sub)
        .bind(now)
        .execute(c)
        .await?;
    }
    if !subscribers.is_empty() {
        D::notify(c, "outbox").await?;
    }
    Ok(!subscribers.is_empty())
}
