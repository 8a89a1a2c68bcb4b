//! Outbound webhook subscriptions over HTTP (scope `admin`): create one (its
//! `whsec_` signing secret is shown once), list, inspect, delete, and read its
//! delivery log. Targets are checked here before anything is stored.

use crate::service::audit::Audit;
use axum::{Json, extract::State, http::StatusCode, response::IntoResponse};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};
use uuid::Uuid;

use super::{
    AppState,
    error::{ApiError, ApiResult},
    extract::{ApiJson, ApiPath, ApiQuery, Authorized, scope},
};
use crate::{
    domain::webhook::{DeliveryAttempt, Webhook},
    service::{
        pagination::{PageParams, next_token},
        projects, webhooks,
    },
};

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
    /// The project whose events it receives. Absent: the calling key's own
    /// project, or every project's events for a server-wide key.
    #[serde(default)]
    pub project: Option<String>,
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

fn parse_id(id: &str) -> ApiResult<Uuid> {
    Uuid::parse_str(id).map_err(|_| ApiError::missing("no such webhook: ids are UUIDs".into()))
}

#[utoipa::path(post, path = "/v1/webhooks", tag = "webhooks", request_body = CreateWebhook,
    responses((status = 201, body = WebhookCreated), (status = 404, body = super::error::Problem), (status = 422, body = super::error::Problem)),
    security(("bearer" = ["admin"])))]
pub async fn create_webhook(
    State(st): State<AppState>,
    caller: Authorized<scope::Admin>,
    ApiJson(req): ApiJson<CreateWebhook>,
) -> ApiResult<impl IntoResponse> {
    let reach = caller.reach();
    let project = match req.project.as_deref().or(reach.project()) {
        Some(p) => Some(projects::existing(&st, &reach, p).await?.name),
        None => None,
    };
    let (webhook, secret) = webhooks::create_webhook(&st, &req.url, &req.events, req.description, project).await?;
    // The webhook without its signing secret: the answer shows it once, the log never.
    let audit = Audit::new("webhook.create", "webhook", webhook.id).after(&webhook).in_project(webhook.project.clone());
    Ok((StatusCode::CREATED, audit, Json(WebhookCreated { webhook, secret: secret.expose().to_owned() })))
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct WebhookListQuery {
    /// Only this project's subscriptions (a project's key sees only its own anyway).
    pub project: Option<String>,
}

#[utoipa::path(get, path = "/v1/webhooks", tag = "webhooks", params(WebhookListQuery),
    responses((status = 200, body = WebhookList)), security(("bearer" = ["admin"])))]
pub async fn list_webhooks(
    State(st): State<AppState>,
    caller: Authorized<scope::Admin>,
    ApiQuery(q): ApiQuery<WebhookListQuery>,
) -> ApiResult<Json<WebhookList>> {
    let filter = crate::domain::project::list_filter(&caller.reach(), q.project.as_deref());
    Ok(Json(WebhookList { webhooks: webhooks::list_webhooks(&st, &filter).await? }))
}

#[utoipa::path(get, path = "/v1/webhooks/{id}", tag = "webhooks", params(("id" = Uuid, Path)),
    responses((status = 200, body = Webhook), (status = 404, body = super::error::Problem)),
    security(("bearer" = ["admin"])))]
pub async fn get_webhook(
    State(st): State<AppState>,
    _caller: Authorized<scope::Admin>,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<Json<Webhook>> {
    Ok(Json(webhooks::get_webhook(&st, parse_id(&id)?).await?))
}

#[utoipa::path(delete, path = "/v1/webhooks/{id}", tag = "webhooks", params(("id" = Uuid, Path)),
    responses((status = 204), (status = 404, body = super::error::Problem)), security(("bearer" = ["admin"])))]
pub async fn delete_webhook(
    State(st): State<AppState>,
    _caller: Authorized<scope::Admin>,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<(StatusCode, Audit)> {
    let id = parse_id(&id)?;
    let before = webhooks::get_webhook(&st, id).await?;
    webhooks::delete_webhook(&st, id).await?;
    Ok((StatusCode::NO_CONTENT, Audit::new("webhook.delete", "webhook", id).before(before)))
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
    _caller: Authorized<scope::Admin>,
    ApiPath(id): ApiPath<String>,
    ApiQuery(q): ApiQuery<DeliveryQuery>,
) -> ApiResult<Json<DeliveryLog>> {
    let id = parse_id(&id)?;
    let page = PageParams { page_size: q.page_size, page_token: q.page_token };
    let before = match page.cursor()? {
        Some(c) => Some(c.parse::<i64>().map_err(|_| ApiError::bad_request("bad `page_token`".into()))?),
        None => None,
    };
    let size = page.size(st.settings.limits.max_page_size);
    let deliveries = webhooks::deliveries(&st, id, before, size).await?;
    let next_page_token = next_token(&deliveries, size, |a| a.seq.to_string());
    Ok(Json(DeliveryLog { deliveries, next_page_token }))
}
