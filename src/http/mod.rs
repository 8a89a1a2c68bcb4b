//! The HTTP API: router, shared state and the middleware every request passes
//! through (request id, tracing span, metrics, timeout, body limit, panics as
//! problems). One file per resource beside this one.

pub mod controller;
pub mod error;
pub mod extract;
pub mod keys;
pub mod ops;
pub mod pagination;
pub mod prompts;
pub mod rounds;
pub mod traces;
pub mod webhooks;

use std::{sync::Arc, time::Duration};

use axum::{
    Router,
    extract::{DefaultBodyLimit, MatchedPath, Request, State},
    http::HeaderName,
    middleware::{self, Next},
    response::{IntoResponse, Response},
    routing::{get, post, put},
};
use metrics_exporter_prometheus::PrometheusHandle;
use tower::ServiceBuilder;
use tower_http::{
    catch_panic::CatchPanicLayer,
    request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer},
    trace::TraceLayer,
};

use crate::{auth::KeyCache, cache::PromptCache, config::Settings, store::DynStore};
use error::ApiError;

#[derive(Clone)]
pub struct AppState {
    pub store: DynStore,
    pub settings: Arc<Settings>,
    pub cache: Arc<PromptCache>,
    pub keys: Arc<KeyCache>,
    pub metrics: PrometheusHandle,
}

const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

pub fn router(state: AppState) -> Router {
    let api = Router::new()
        .route("/prompts", post(prompts::create_prompt).get(prompts::list_prompts))
        .route("/prompts/{name}", get(prompts::get_prompt))
        .route("/prompts/{name}/versions", post(prompts::create_version).get(prompts::list_versions))
        .route("/prompts/{name}/versions/{number}", get(prompts::get_version))
        .route("/prompts/{name}/diff", get(prompts::diff_versions))
        .route("/prompts/{name}/labels", get(prompts::list_labels))
        .route("/prompts/{name}/labels/{label}", put(prompts::move_label).delete(prompts::delete_label))
        .route("/prompts/{name}/rollback", post(prompts::rollback))
        .route("/prompts/{name}/rounds", post(rounds::trigger_round).get(rounds::list_rounds))
        .route("/rounds/{id}", get(rounds::get_round))
        .route("/prompts/{name}/controller", get(controller::get_controller))
        .route("/hooks/rounds/{name}", post(rounds::webhook_round))
        .route("/traces", post(traces::post_traces).get(traces::list_traces))
        .route("/traces/{id}", get(traces::get_trace))
        .route("/traces/{id}/feedback", post(traces::add_feedback))
        .route("/keys", post(keys::create_key).get(keys::list_keys))
        .route("/keys/{id}", axum::routing::delete(keys::revoke_key))
        .route("/webhooks", post(webhooks::create_webhook).get(webhooks::list_webhooks))
        .route("/webhooks/{id}", get(webhooks::get_webhook).delete(webhooks::delete_webhook))
        .route("/webhooks/{id}/deliveries", get(webhooks::list_deliveries))
        .route("/openapi.json", get(ops::openapi));

    let timeout = Duration::from_secs(state.settings.server.request_timeout_secs);
    Router::new()
        .route("/healthz", get(ops::healthz))
        .route("/readyz", get(ops::readyz))
        .route("/metrics", get(ops::metrics))
        .nest("/v1", api)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(state.settings.limits.max_body_bytes))
        .layer(middleware::from_fn_with_state(timeout, time_limit))
        .layer(middleware::from_fn(record_metrics))
        .layer(
            ServiceBuilder::new()
                .layer(SetRequestIdLayer::new(REQUEST_ID, MakeRequestUuid))
                .layer(TraceLayer::new_for_http().make_span_with(|req: &Request| {
                    let id = req.headers().get(REQUEST_ID).and_then(|v| v.to_str().ok()).unwrap_or("-");
                    tracing::info_span!("request", method = %req.method(), path = %req.uri().path(), request_id = %id)
                }))
                .layer(PropagateRequestIdLayer::new(REQUEST_ID))
                .layer(CatchPanicLayer::custom(|_| {
                    ApiError::Internal(anyhow::anyhow!("a handler panicked")).into_response()
                })),
        )
        .with_state(state)
}

/// A worker-only process serves just liveness, readiness and metrics.
pub fn ops_router(state: AppState) -> Router {
    Router::new()
        .route("/healthz", get(ops::healthz))
        .route("/readyz", get(ops::readyz))
        .route("/metrics", get(ops::metrics))
        .fallback(not_found)
        .with_state(state)
}

async fn not_found() -> ApiError {
    ApiError::NotFound("no such route; see /v1/openapi.json".into())
}

async fn method_not_allowed() -> ApiError {
    ApiError::MethodNotAllowed
}

async fn time_limit(State(limit): State<Duration>, req: Request, next: Next) -> Response {
    match tokio::time::timeout(limit, next.run(req)).await {
        Ok(res) => res,
        Err(_) => ApiError::Timeout.into_response(),
    }
}

async fn record_metrics(req: Request, next: Next) -> Response {
    let start = std::time::Instant::now();
    let route = req.extensions().get::<MatchedPath>().map_or_else(|| "unmatched".to_owned(), |p| p.as_str().to_owned());
    let method = req.method().to_string();
    let res = next.run(req).await;
    let status = res.status().as_u16().to_string();
    let labels = [("method", method), ("route", route), ("status", status)];
    metrics::counter!("combee_http_requests_total", &labels).increment(1);
    metrics::histogram!("combee_http_request_duration_seconds", &labels).record(start.elapsed().as_secs_f64());
    res
}
