//! Round routes: trigger a round by API key or by a Standard Webhooks–signed
//! inbound webhook, inspect rounds (phases, reflections, every LLM call,
//! group outputs, operations, the resulting version or the error), and a
//! prompt's learning state: the backoff after failed rounds and its clear.

use crate::service::audit::Audit;
use axum::{
    Json,
    extract::{Request, State},
    http::{HeaderMap, StatusCode},
    response::{IntoResponse, Response},
};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};
use uuid::Uuid;

use super::{
    AppState,
    error::{ApiError, ApiResult},
    extract::{ApiPath, ApiQuery, Authorized, body_bytes, optional_json, optional_json_bytes, scope},
};
use crate::service::projects::PathPrompt;
use crate::{
    domain::{access::Reach, audit::Actor, backoff::LearningState, round::Round},
    llm::LlmCall,
    service::{
        pagination::{PageParams, next_token},
        projects,
        prompts::existing_prompt,
        rounds::{
            self, RoundReflection, RoundView, TriggerRound, UsageTotals, WebhookTrigger, open_round,
            open_round_for_webhook, round_view,
        },
    },
    webhooks,
};

#[utoipa::path(post, path = "/v1/prompts/{name}/rounds", tag = "rounds", params(("name" = String, Path)),
    request_body = TriggerRound, responses((status = 202, body = Round), (status = 409, body = super::error::Problem)),
    security(("bearer" = ["rounds:trigger"])))]
pub async fn trigger_round(
    State(st): State<AppState>,
    _caller: Authorized<scope::RoundsTrigger>,
    PathPrompt(name): PathPrompt,
    req: Request,
) -> ApiResult<Response> {
    // An empty body means all defaults.
    let body = optional_json::<TriggerRound>(req).await?.unwrap_or_default();
    let round = open_round(&st, &name, body).await?;
    Ok((StatusCode::ACCEPTED, Audit::new("round.trigger", "round", round.id), Json(round)).into_response())
}

#[derive(Debug, Serialize, ToSchema)]
pub struct WebhookAccepted {
    /// `queued`, or `duplicate` when this `webhook-id` already opened a round (nothing started).
    /// A trigger refused with 404 or 409 is not remembered: its retry is processed again.
    pub status: &'static str,
    pub round: Option<Round>,
}

#[utoipa::path(post, path = "/v1/hooks/rounds/{name}", tag = "rounds", params(("name" = String, Path)),
    request_body(content = TriggerRound, description = "optional; signed with Standard Webhooks (`webhook-id`, `webhook-timestamp`, `webhook-signature`)"),
    responses((status = 202, body = WebhookAccepted), (status = 200, body = WebhookAccepted), (status = 401, body = super::error::Problem),
        (status = 404, description = "no such prompt (not remembered: a retry is processed again)", body = super::error::Problem),
        (status = 409, description = "nothing pending, or a round in flight (not remembered: a retry is processed again)", body = super::error::Problem)))]
/// Inbound trigger, authenticated by its Standard Webhooks signature instead of an API key.
pub async fn webhook_round(
    State(st): State<AppState>,
    ApiPath(written): ApiPath<String>,
    req: Request,
) -> ApiResult<Response> {
    let keys: Vec<Vec<u8>> = st.settings.webhooks.inbound_secrets.iter().filter_map(webhooks::decode_secret).collect();
    if keys.is_empty() {
        return Err(ApiError::missing("inbound webhooks are not configured (`webhooks.inbound_secrets`)".into()));
    }
    let headers: HeaderMap = req.headers().clone();
    let body = body_bytes(req).await?;
    let header = |n: &str| headers.get(n).and_then(|v| v.to_str().ok());
    let msg = webhooks::Incoming {
        id: header("webhook-id"),
        timestamp: header("webhook-timestamp"),
        signature: header("webhook-signature"),
        body: &body,
    };
    webhooks::verify(&keys, &msg, chrono::Utc::now().timestamp(), st.settings.webhooks.tolerance_secs)
        .map_err(|e| ApiError::Unauthorized(webhook_reason(&e)))?;
    // The sender holds the deployment's secret: a server-wide caller. Whether
    // the prompt exists is decided before the body is read.
    let name = projects::prompt_in_reach(&st, &Reach::Server, &written).await?;
    // Signed bytes, whatever their content type; an empty body means all defaults.
    let trigger = optional_json_bytes::<TriggerRound>(&body)?.unwrap_or_default();
    let id = msg.id.unwrap_or_default();
    if id.len() > 255 {
        return Err(ApiError::bad_request("`webhook-id` is longer than 255 characters".into()));
    }
    // The id is remembered only together with the round it opens: a trigger
    // refused here (404, 409) is processed again when the sender retries it.
    match open_round_for_webhook(&st, &name, trigger, id.to_owned()).await? {
        WebhookTrigger::Opened(round) => {
            let audit = Audit::new("round.trigger", "round", round.id).by(Actor::Webhook { id: id.to_owned() });
            Ok((StatusCode::ACCEPTED, audit, Json(WebhookAccepted { status: "queued", round: Some(*round) }))
                .into_response())
        }
        // A redelivery: nothing changed, but the request is recorded like any other.
        WebhookTrigger::Duplicate => {
            let audit = Audit::new("round.trigger.duplicate", "prompt", &name).by(Actor::Webhook { id: id.to_owned() });
            Ok((StatusCode::OK, audit, Json(WebhookAccepted { status: "duplicate", round: None })).into_response())
        }
    }
}

fn webhook_reason(e: &webhooks::VerifyError) -> &'static str {
    match e {
        webhooks::VerifyError::Missing(_) => {
            "missing Standard Webhooks headers (webhook-id, webhook-timestamp, webhook-signature)"
        }
        webhooks::VerifyError::BadTimestamp => "webhook-timestamp is not a Unix timestamp",
        webhooks::VerifyError::Stale(_) => "webhook-timestamp is outside the accepted window",
        webhooks::VerifyError::BadSignature => "the webhook signature does not verify",
    }
}

// A round as `GET /v1/rounds/{id}` answers it, named `RoundView` in the API
// document. No doc comment: it would become the schema's description.
#[derive(Debug, Serialize, ToSchema)]
#[schema(as = RoundView)]
pub struct RoundViewBody {
    #[serde(flatten)]
    pub round: Round,
    pub trace_ids: Vec<Uuid>,
    pub reflections: Vec<RoundReflection>,
    pub llm_calls: Vec<RoundCallBody>,
    pub usage: UsageTotals,
    /// When retention compacted the round (`retention.round_detail_days`): its
    /// group outputs and per-call records are gone, `usage` is what they added up to;
    /// reflections and trace ids go with their traces.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub compacted_at: Option<DateTime<Utc>>,
}

/// One stored LLM call of a round.
#[derive(Debug, Serialize, ToSchema)]
#[schema(as = RoundCall)]
pub struct RoundCallBody {
    pub attempt: i32,
    #[serde(flatten)]
    #[schema(value_type = Object)]
    pub call: LlmCall,
    pub created_at: DateTime<Utc>,
}

impl From<RoundView> for RoundViewBody {
    fn from(view: RoundView) -> Self {
        let RoundView { round, trace_ids, reflections, llm_calls, usage, compacted_at } = view;
        let llm_calls = llm_calls
            .into_iter()
            .map(|c| RoundCallBody { attempt: c.attempt, call: c.call, created_at: c.created_at })
            .collect();
        Self { round, trace_ids, reflections, llm_calls, usage, compacted_at }
    }
}

#[utoipa::path(get, path = "/v1/rounds/{id}", tag = "rounds", params(("id" = Uuid, Path)),
    responses((status = 200, body = RoundViewBody), (status = 404, body = super::error::Problem)), security(("bearer" = ["prompts:read"])))]
pub async fn get_round(
    State(st): State<AppState>,
    _caller: Authorized<scope::PromptsRead>,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<Json<RoundViewBody>> {
    let id = Uuid::parse_str(&id).map_err(|_| ApiError::missing("no such round: ids are UUIDs".into()))?;
    Ok(Json(round_view(&st, id).await?.into()))
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct RoundQuery {
    pub page_size: Option<u32>,
    pub page_token: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct RoundPage {
    pub rounds: Vec<Round>,
    pub next_page_token: Option<String>,
}

#[utoipa::path(get, path = "/v1/prompts/{name}/rounds", tag = "rounds", params(("name" = String, Path), RoundQuery),
    responses((status = 200, body = RoundPage)), security(("bearer" = ["prompts:read"])))]
pub async fn list_rounds(
    State(st): State<AppState>,
    _caller: Authorized<scope::PromptsRead>,
    PathPrompt(name): PathPrompt,
    ApiQuery(q): ApiQuery<RoundQuery>,
) -> ApiResult<Json<RoundPage>> {
    let name = existing_prompt(&st, &name).await?.name;
    let page = PageParams { page_size: q.page_size, page_token: q.page_token };
    let before = match page.cursor()? {
        Some(c) => Some(Uuid::parse_str(&c).map_err(|_| ApiError::bad_request("bad `page_token`".into()))?),
        None => None,
    };
    let size = page.size(st.settings.limits.max_page_size);
    let rounds = rounds::list_rounds(&st, &name, before, size).await?;
    let next_page_token = next_token(&rounds, size, |r| r.id.simple().to_string());
    Ok(Json(RoundPage { rounds, next_page_token }))
}

#[utoipa::path(get, path = "/v1/prompts/{name}/learning", tag = "rounds", params(("name" = String, Path)),
    responses((status = 200, body = LearningState), (status = 404, body = super::error::Problem)),
    security(("bearer" = ["prompts:read"])))]
/// The prompt's learning state: `backing_off` while failed rounds in a row hold
/// its next round back (`worker.failure_backoff_secs`, doubling per failure), else `ok`.
pub async fn get_learning(
    State(st): State<AppState>,
    _caller: Authorized<scope::PromptsRead>,
    PathPrompt(name): PathPrompt,
) -> ApiResult<Json<LearningState>> {
    Ok(Json(rounds::learning_state(&st, &name).await?))
}

#[utoipa::path(delete, path = "/v1/prompts/{name}/backoff", tag = "rounds", params(("name" = String, Path)),
    responses((status = 200, description = "the state after the reset", body = LearningState), (status = 404, body = super::error::Problem)),
    security(("bearer" = ["rounds:trigger"])))]
/// Ends the prompt's failure streak and its backoff: the scheduler opens a
/// round as soon as the backlog asks for one. (A manual trigger does the same.)
pub async fn clear_backoff(
    State(st): State<AppState>,
    caller: Authorized<scope::RoundsTrigger>,
    PathPrompt(name): PathPrompt,
) -> ApiResult<(Audit, Json<LearningState>)> {
    tracing::info!(prompt = %name, by = %caller.actor(), "clearing the failure backoff");
    let before = rounds::learning_state(&st, &name).await?;
    let after = rounds::clear_backoff(&st, &name).await?;
    Ok((Audit::new("prompt.backoff.clear", "prompt", &name).before(before), Json(after)))
}
