//! Outbound webhook subscriptions and the log of their deliveries, as operators see them.

use chrono::{DateTime, Utc};
use serde::Serialize;
use utoipa::ToSchema;
use uuid::Uuid;

use super::event::EventType;
use crate::secret::Secret;

/// An outbound webhook subscription. The secret signs deliveries; it is
/// shown once when the subscription is created and never serialised.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct Webhook {
    pub id: Uuid,
    pub url: String,
    pub events: Vec<EventType>,
    pub description: Option<String>,
    /// The project whose events it receives; absent: every project's.
    pub project: Option<String>,
    /// False once the receiver answered 410 Gone.
    pub enabled: bool,
    pub disabled_reason: Option<String>,
    pub created_at: DateTime<Utc>,
    #[serde(skip)]
    #[schema(ignore)]
    pub secret: Secret,
}

#[derive(Debug, Clone)]
pub struct NewWebhook {
    pub url: String,
    pub events: Vec<EventType>,
    pub description: Option<String>,
    pub project: Option<String>,
    pub secret: Secret,
}

/// One line of a subscription's delivery log.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct DeliveryAttempt {
    /// Cursor position in the log.
    #[serde(skip)]
    pub seq: i64,
    pub delivery_id: Uuid,
    /// The event's id, sent as `webhook-id` on every attempt.
    pub event_id: String,
    pub event_type: String,
    pub attempt: i32,
    pub status_code: Option<u16>,
    pub error: Option<String>,
    pub latency_ms: u64,
    pub attempted_at: DateTime<Utc>,
    /// When the next attempt is due; absent when this one succeeded or was the last.
    pub next_attempt_at: Option<DateTime<Utc>>,
    /// The delivery's state now: `pending`, `succeeded` or `failed`.
    pub delivery_status: String,
}
