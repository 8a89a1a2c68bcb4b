//! Outbound webhook subscriptions over HTTP (scope `admin`): create one (its
//! `whsec_` signing secret is shown once), list, inspect, delete, and read its
//! delivery log. Targets are checked here before anything is stored.

use axum::{Json, extract::State, http::StatusCode, response::IntoResponse};
use base64::{Engine, engine::general_purpose::STANDARD};
use rand::RngCore;
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};
use uuid::Uuid;

use super::{
    AppState,
    error::{ApiError, ApiResult},
    extract::{ApiJson, ApiPath, ApiQuery, Caller},
};
use crate::{
    delivery::target::{self, TargetError},
    domain::event::EventType,
    secret::Secret,
    service::pagination::{PageParams, next_token},
    store::{DeliveryAttempt, NewWebhook, Scope, Webhook},
    webhooks::SECRET_PREFIX,
};

const MAX_URL_BYTES: usize = 2048;
const MAX_DESCRIPTION_CHARS: usize = 500;
const MAX_SUBSCRIPTIONS: usize = 100;

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateWebhook {
    /// Where events are POSTed (http or https; public addresses only unless
    /// `webhooks.allow_private_targets`).
    pub url: String,
    /// Any of `version.created`, `label.moved`, `round.completed`, `round.failed`.
    pub events: Vec<String>,
    #[serde(default)]
    pub description: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct WebhookCreated {
    #[serde(flatten)]
    pub webhook: Webhook,
    /// The `whsec_…` signing secret. Shown once: verify deliveries with it.
    pub secret: String,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct WebhookList {
    pub webhooks: Vec<Webhook>,
}

fn parse_events(names: &[String]) -> ApiResult<Vec<EventType>> {
    if names.is_empty() {
        return Err(ApiError::unprocessable("`events` must name at least one event".into()));
    }
    names
        .iter()
        .map(|n| {
            EventType::parse(n).ok_or_else(|| {
                let known: Vec<&str> = EventType::ALL.iter().map(|e| e.as_str()).collect();
                let shown: String = n.chars().take(64).collect();
                ApiError::unprocessable(format!("unknown event {shown:?}; known events: {}", known.join(", ")))
            })
        })
        .collect()
}

fn new_secret() -> Secret {
    let mut key = [0u8; 32];
    rand::rngs::OsRng.fill_bytes(&mut key);
    Secret::new(format!("{SECRET_PREFIX}{}", STANDARD.encode(key)))
}

fn parse_id(id: &str) -> ApiResult<Uuid> {
    Uuid::parse_str(id).map_err(|_| ApiError::missing("no such webhook: ids are UUIDs".into()))
}

#[utoipa::path(post, path = "/v1/webhooks", tag = "webhooks", request_body = CreateWebhook,
    responses((status = 201, body = WebhookCreated), (status = 422, body = super::error::Problem)),
    security(("bearer" = ["admin"])))]
pub async fn create_webhook(
    State(st): State<AppState>,
    caller: Caller,
    ApiJson(req): ApiJson<CreateWebhook>,
) -> ApiResult<impl IntoResponse> {
    caller.require(Scope::Admin)?;
    if req.url.len() > MAX_URL_BYTES {
        return Err(ApiError::unprocessable(format!("`url` is longer than {MAX_URL_BYTES} bytes")));
    }
    let description = req.description.map(|d| d.trim().to_owned()).filter(|d| !d.is_empty());
    if description.as_ref().is_some_and(|d| d.chars().count() > MAX_DESCRIPTION_CHARS) {
        return Err(ApiError::unprocessable(format!(
            "`description` is longer than {MAX_DESCRIPTION_CHARS} characters"
        )));
    }
    let events = parse_events(&req.events)?;
    let url =
        target::check_url(req.url.trim(), st.settings.webhooks.allow_private_targets).await.map_err(|e| match e {
            TargetError::Unresolvable(_) | TargetError::Refused { .. } | TargetError::BadUrl(_) => {
                ApiError::unprocessable(e.to_string())
            }
        })?;
    if st.store.list_webhooks().await?.len() >= MAX_SUBSCRIPTIONS {
        return Err(ApiError::conflict(format!("at most {MAX_SUBSCRIPTIONS} subscriptions; delete one first")));
    }
    let secret = new_secret();
    let webhook = st
        .store
        .create_webhook(&NewWebhook { url: url.to_string(), events, description, secret: secret.clone() })
        .await?;
    tracing::info!(webhook = %webhook.id, events = ?webhook.events, "webhook subscription created");
    Ok((StatusCode::CREATED, Json(WebhookCreated { webhook, secret: secret.expose().to_owned() })))
}

#[utoipa::path(get, path = "/v1/webhooks", tag = "webhooks", responses((status = 200, body = WebhookList)),
    security(("bearer" = ["admin"])))]
pub async fn list_webhooks(State(st): State<AppState>, caller: Caller) -> ApiResult<Json<WebhookList>> {
    caller.require(Scope::Admin)?;
    Ok(Json(WebhookList { webhooks: st.store.list_webhooks().await? }))
}

#[utoipa::path(get, path = "/v1/webhooks/{id}", tag = "webhooks", params(("id" = Uuid, Path)),
    responses((status = 200, body = Webhook), (status = 404, body = super::error::Problem)),
    security(("bearer" = ["admin"])))]
pub async fn get_webhook(
    State(st): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<Json<Webhook>> {
    caller.require(Scope::Admin)?;
    let id = parse_id(&id)?;
    let hook = st.store.get_webhook(id).await?.ok_or_else(|| ApiError::not_found(format_args!("webhook {id}")))?;
    Ok(Json(hook))
}

#[utoipa::path(delete, path = "/v1/webhooks/{id}", tag = "webhooks", params(("id" = Uuid, Path)),
    responses((status = 204), (status = 404, body = super::error::Problem)), security(("bearer" = ["admin"])))]
pub async fn delete_webhook(
    State(st): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<StatusCode> {
    caller.require(Scope::Admin)?;
    let id = parse_id(&id)?;
    if !st.store.delete_webhook(id).await? {
        return Err(ApiError::not_found(format_args!("webhook {id}")));
    }
    tracing::info!(webhook = %id, "webhook subscription deleted");
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct DeliveryQuery {
    pub page_size: Option<u32>,
    pub page_token: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct DeliveryLog {
    /// Attempts, newest first.
    pub deliveries: Vec<DeliveryAttempt>,
    pub next_page_token: Option<String>,
}

#[utoipa::path(get, path = "/v1/webhooks/{id}/deliveries", tag = "webhooks", params(("id" = Uuid, Path), DeliveryQuery),
    responses((status = 200, body = DeliveryLog), (status = 404, body = super::error::Problem)),
    security(("bearer" = ["admin"])))]
pub async fn list_deliveries(
    State(st): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<String>,
    ApiQuery(q): ApiQuery<DeliveryQuery>,
) -> ApiResult<Json<DeliveryLog>> {
    caller.require(Scope::Admin)?;
    let id = parse_id(&id)?;
    if st.store.get_webhook(id).await?.is_none() {
        return Err(ApiError::not_found(format_args!("webhook {id}")));
    }
    let page = PageParams { page_size: q.page_size, page_token: q.page_token };
    let before = match page.cursor()? {
        Some(c) => Some(c.parse::<i64>().map_err(|_| ApiError::bad_request("bad `page_token`".into()))?),
        None => None,
    };
    let size = page.size(st.settings.limits.max_page_size);
    let deliveries = st.store.webhook_attempts(id, before, size).await?;
    let next_page_token = next_token(&deliveries, size, |a| a.seq.to_string());
    Ok(Json(DeliveryLog { deliveries, next_page_token }))
}
