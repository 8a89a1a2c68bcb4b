//! Outbound webhook subscriptions (scope `admin`): create one (the target is
//! checked before anything is stored; its `whsec_` signing secret is shown
//! once), list, inspect, delete, and read its delivery log.

use base64::{Engine, engine::general_purpose::STANDARD};
use rand::RngCore;
use uuid::Uuid;

use super::{AppState, ServiceError, ServiceResult};
use crate::{
    delivery::target,
    domain::{
        event::EventType,
        project::ListFilter,
        webhook::{DeliveryAttempt, NewWebhook, Webhook},
    },
    secret::Secret,
    webhooks::SECRET_PREFIX,
};

/// Longest target URL, in bytes.
pub const MAX_URL_BYTES: usize = 2048;
/// Longest description, in characters.
pub const MAX_DESCRIPTION_CHARS: usize = 500;
/// Most subscriptions one deployment keeps.
pub const MAX_SUBSCRIPTIONS: usize = 100;

fn parse_events(names: &[String]) -> ServiceResult<Vec<EventType>> {
    if names.is_empty() {
        return Err(ServiceError::Unprocessable("`events` must name at least one event".into()));
    }
    names
        .iter()
        .map(|n| {
            EventType::parse(n).ok_or_else(|| {
                let known: Vec<&str> = EventType::ALL.iter().map(|e| e.as_str()).collect();
                let shown: String = n.chars().take(64).collect();
                ServiceError::Unprocessable(format!("unknown event {shown:?}; known events: {}", known.join(", ")))
            })
        })
        .collect()
}

fn new_secret() -> Secret {
    let mut key = [0u8; 32];
    rand::rngs::OsRng.fill_bytes(&mut key);
    Secret::new(format!("{SECRET_PREFIX}{}", STANDARD.encode(key)))
}

/// Subscribes `url` to `events`; the subscription and its signing secret.
pub async fn create_webhook(
    st: &AppState,
    url: &str,
    events: &[String],
    description: Option<String>,
    project: Option<String>,
) -> ServiceResult<(Webhook, Secret)> {
    if url.len() > MAX_URL_BYTES {
        return Err(ServiceError::Unprocessable(format!("`url` is longer than {MAX_URL_BYTES} bytes")));
    }
    let description = description.map(|d| d.trim().to_owned()).filter(|d| !d.is_empty());
    if description.as_ref().is_some_and(|d| d.chars().count() > MAX_DESCRIPTION_CHARS) {
        return Err(ServiceError::Unprocessable(format!(
            "`description` is longer than {MAX_DESCRIPTION_CHARS} characters"
        )));
    }
    let events = parse_events(events)?;
    let url = target::check_url(url.trim(), st.settings.webhooks.allow_private_targets)
        .await
        .map_err(|e| ServiceError::Unprocessable(e.to_string()))?;
    if st.store.list_webhooks(None).await?.len() >= MAX_SUBSCRIPTIONS {
        return Err(ServiceError::Conflict(format!("at most {MAX_SUBSCRIPTIONS} subscriptions; delete one first")));
    }
    let secret = new_secret();
    let webhook = st
        .store
        .create_webhook(&NewWebhook { url: url.to_string(), events, description, project, secret: secret.clone() })
        .await?;
    tracing::info!(webhook = %webhook.id, events = ?webhook.events, "webhook subscription created");
    Ok((webhook, secret))
}

/// The subscriptions `filter` shows: a project's own, or (server-wide) every one.
pub async fn list_webhooks(st: &AppState, filter: &ListFilter) -> ServiceResult<Vec<Webhook>> {
    match filter {
        ListFilter::Nothing => Ok(Vec::new()),
        _ => Ok(st.store.list_webhooks(filter.project()).await?),
    }
}

pub async fn get_webhook(st: &AppState, id: Uuid) -> ServiceResult<Webhook> {
    st.store.get_webhook(id).await?.ok_or_else(|| ServiceError::not_found(format_args!("webhook {id}")))
}

/// Deletes the subscription with its pending deliveries and log.
pub async fn delete_webhook(st: &AppState, id: Uuid) -> ServiceResult<()> {
    if !st.store.delete_webhook(id).await? {
        return Err(ServiceError::not_found(format_args!("webhook {id}")));
    }
    tracing::info!(webhook = %id, "webhook subscription deleted");
    Ok(())
}

/// The subscription's delivery log, newest first, below the `before` cursor.
pub async fn deliveries(
    st: &AppState,
    id: Uuid,
    before: Option<i64>,
    limit: u32,
) -> ServiceResult<Vec<DeliveryAttempt>> {
    get_webhook(st, id).await?;
    Ok(st.store.webhook_attempts(id, before, limit).await?)
}
