//! The HTTP API: its routes and the middleware every request passes through
//! (request id, tracing span, metrics, timeout, body limit, panics as
//! problems). One file per resource beside this one; the operations the web
//! UI shares are in `service/`.

pub mod controller;
pub mod error;
pub mod export;
pub mod extract;
pub mod keys;
pub mod label_history;
pub mod labels;
pub mod langfuse;
pub mod openapi;
pub mod ops;
pub mod otlp;
pub mod outcomes;
pub mod prompts;
pub mod rounds;
pub mod settings;
pub mod traces;
pub mod versions;
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
use tower::ServiceBuilder;
use tower_http::{
    catch_panic::CatchPanicLayer,
    request_id::{MakeRequestId, PropagateRequestIdLayer, RequestId, SetRequestIdLayer},
    trace::TraceLayer,
};

use error::ApiError;

pub use crate::service::{AppState, Shared};

const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// The API's routes, without state or middleware: `app.rs` adds the web UI
/// beside them and hands the whole table to [`serve`].
pub fn routes() -> Router<AppState> {
    // Flat paths rather than `.nest("/v1")`: nesting costs a second routing step per request.
    Router::new()
        .route("/healthz", get(ops::healthz))
        .route("/readyz", get(ops::readyz))
        .route("/metrics", get(ops::metrics))
        .route("/v1/prompts", post(prompts::create_prompt).get(prompts::list_prompts))
        .route("/v1/prompts/{name}", get(prompts::get_prompt))
        .route("/v1/prompts/{name}/population", get(prompts::get_population))
        .route("/v1/prompts/{name}/settings", axum::routing::patch(settings::update_settings))
        .route("/v1/prompts/{name}/versions", post(versions::create_version).get(versions::list_versions))
        .route("/v1/prompts/{name}/versions/{number}", get(versions::get_version))
        .route("/v1/prompts/{name}/diff", get(versions::diff_versions))
        .route("/v1/prompts/{name}/labels", get(labels::list_labels))
        .route("/v1/prompts/{name}/labels/history", get(label_history::label_history))
        .route("/v1/prompts/{name}/labels/{label}", put(labels::move_label).delete(labels::delete_label))
        .route("/v1/prompts/{name}/rollback", post(labels::rollback))
        .route("/v1/prompts/{name}/rounds", post(rounds::trigger_round).get(rounds::list_rounds))
        .route("/v1/rounds/{id}", get(rounds::get_round))
        .route("/v1/prompts/{name}/controller", get(controller::get_controller))
        .route("/v1/prompts/{name}/metrics", get(outcomes::prompt_metrics))
        .route("/v1/hooks/rounds/{name}", post(rounds::webhook_round))
        .route("/v1/traces", post(traces::post_traces).get(traces::list_traces))
        .route("/v1/traces/quarantine", post(traces::quarantine_traces))
        .route("/v1/traces/{id}", get(traces::get_trace).delete(traces::delete_trace))
        .route("/v1/traces/{id}/quarantine", post(traces::quarantine_trace).delete(traces::release_trace))
        .route("/v1/traces/{id}/feedback", post(traces::add_feedback))
        .route("/v1/otlp/v1/traces", post(otlp::export_traces))
        .route("/v1/otlp/v1/logs", post(otlp::export_logs))
        .route("/v1/prompts/{name}/traces/requeue", post(traces::requeue_failed))
        .route("/v1/prompts/{name}/export", get(export::export_traces))
        .route("/v1/keys", post(keys::create_key).get(keys::list_keys))
        .route("/v1/keys/{id}", axum::routing::delete(keys::revoke_key))
        .route("/v1/webhooks", post(webhooks::create_webhook).get(webhooks::list_webhooks))
        .route("/v1/webhooks/{id}", get(webhooks::get_webhook).delete(webhooks::delete_webhook))
        .route("/v1/webhooks/{id}/deliveries", get(webhooks::list_deliveries))
        .route("/v1/openapi.json", get(openapi::openapi))
        // For Langfuse SDKs pointed at combee (see http/langfuse.rs).
        .route("/api/public/v2/prompts/{name}", get(langfuse::get_prompt))
        .route("/api/public/otel/v1/traces", post(langfuse::export_traces))
}

/// The route table as served: the API's fallbacks (problem documents) and
/// the middleware every request passes through, web UI pages included.
pub fn serve(routes: Router<AppState>, state: AppState) -> Router {
    let timeout = Duration::from_secs(state.settings.server.request_timeout_secs);
    routes
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(state.settings.limits.max_body_bytes))
        .layer(middleware::from_fn_with_state(timeout, time_limit))
        .layer(middleware::from_fn(record_metrics))
        .layer(
            ServiceBuilder::new()
                .layer(SetRequestIdLayer::new(REQUEST_ID, SequentialRequestId::default()))
                .layer(TraceLayer::new_for_http().make_span_with(|req: &Request| {
                    let id = req.headers().get(REQUEST_ID).and_then(|v| v.to_str().ok()).unwrap_or("-");
                    tracing::info_span!("request", method = %req.method(), path = %req.uri().path(), request_id = %id)
                }))
                .layer(PropagateRequestIdLayer::new(REQUEST_ID))
                .layer(CatchPanicLayer::custom(|_| {
                    ApiError::internal(anyhow::anyhow!("a handler panicked")).into_response()
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
    ApiError::missing("no such route; see /v1/openapi.json".into())
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

/// Request ids without a system call per request: a random process prefix
/// (drawn once) and a counter, e.g. `3f9c2a71-000000000042`.
#[derive(Clone)]
struct SequentialRequestId {
    prefix: u32,
    next: Arc<std::sync::atomic::AtomicU64>,
}

impl Default for SequentialRequestId {
    fn default() -> Self {
        Self { prefix: rand::random(), next: Arc::default() }
    }
}

impl MakeRequestId for SequentialRequestId {
    fn make_request_id<B>(&mut self, _: &axum::http::Request<B>) -> Option<RequestId> {
        let n = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        axum::http::HeaderValue::from_str(&format!("{:08x}-{n:012}", self.prefix)).ok().map(RequestId::new)
    }
}

type Handles = (metrics::Counter, metrics::Histogram);

/// Counter and histogram handles per route, then (method, status), registered
/// once; the hot path borrows the route and builds no label strings.
fn request_metrics(route: &str, method: &axum::http::Method, status: u16) -> Handles {
    use std::{collections::HashMap, sync::RwLock};
    type Table = HashMap<String, HashMap<(axum::http::Method, u16), Handles>>;
    static HANDLES: std::sync::OnceLock<RwLock<Table>> = std::sync::OnceLock::new();
    let table = HANDLES.get_or_init(Default::default);
    if let Some(h) =
        table.read().unwrap_or_else(|e| e.into_inner()).get(route).and_then(|m| m.get(&(method.clone(), status)))
    {
        return h.clone();
    }
    let labels = [("method", method.to_string()), ("route", route.to_owned()), ("status", status.to_string())];
    let h = (
        metrics::counter!("combee_http_requests_total", &labels),
        metrics::histogram!("combee_http_request_duration_seconds", &labels),
    );
    table
        .write()
        .unwrap_or_else(|e| e.into_inner())
        .entry(route.to_owned())
        .or_default()
        .insert((method.clone(), status), h.clone());
    h
}

async fn record_metrics(req: Request, next: Next) -> Response {
    let start = std::time::Instant::now();
    let route = req.extensions().get::<MatchedPath>().cloned();
    let method = req.method().clone();
    let res = next.run(req).await;
    let route = route.as_ref().map_or("unmatched", |p| p.as_str());
    let (counter, histogram) = request_metrics(route, &method, res.status().as_u16());
    counter.increment(1);
    histogram.record(start.elapsed().as_secs_f64());
    res
}
