//! The HTTP API: its routes and the middleware every request passes through
//! (request id, tracing span, metrics, timeout, body limit, panics as
//! problems; one middleware for all but the body limit). One file per resource beside this one; the operations the web
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
    http::{HeaderName, HeaderValue},
    middleware::{self, Next},
    response::{IntoResponse, Response},
    routing::{get, post, put},
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
    let observer = Arc::new(Observer {
        limit: Duration::from_secs(state.settings.server.request_timeout_secs),
        ids: SequentialRequestId::default(),
    });
    routes
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(state.settings.limits.max_body_bytes))
        .layer(middleware::from_fn_with_state(observer, observe))
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

/// Request ids without a system call per request: a random process prefix
/// (drawn once) and a counter, e.g. `3f9c2a71-000000000042`.
struct SequentialRequestId {
    prefix: u32,
    next: std::sync::atomic::AtomicU64,
}

impl Default for SequentialRequestId {
    fn default() -> Self {
        Self { prefix: rand::random(), next: Default::default() }
    }
}

impl SequentialRequestId {
    fn make(&self) -> Option<HeaderValue> {
        let n = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        // Written in place: this runs on every request.
        let mut id = [b'0'; 21];
        for (i, digit) in id[..8].iter_mut().enumerate() {
            *digit = b"0123456789abcdef"[(self.prefix >> (28 - 4 * i) & 0xf) as usize];
        }
        id[8] = b'-';
        let mut rest = n % 1_000_000_000_000;
        for digit in id[9..].iter_mut().rev() {
            *digit = b'0' + (rest % 10) as u8;
            rest /= 10;
        }
        HeaderValue::from_bytes(&id).ok()
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

/// What [`observe`] needs: the request time limit and the request id maker.
struct Observer {
    limit: Duration,
    ids: SequentialRequestId,
}

/// Every request, in one middleware (each layer of its own cost about as
/// much as a cached prompt's whole answer): an `x-request-id` (the caller's,
/// or a new one) echoed in the answer; a `request` span carrying method, path
/// and id for the logs of whatever runs inside; the time limit
/// (`server.request_timeout_secs`, then 503); a panic answered as a 500
/// problem; a debug line when answered; and the count and duration in
/// `/metrics` by route.
async fn observe(State(o): State<Arc<Observer>>, mut req: Request, next: Next) -> Response {
    use futures_util::FutureExt as _;
    use tracing::Instrument as _;
    let start = std::time::Instant::now();
    let id = match req.headers().get(REQUEST_ID) {
        Some(id) => Some(id.clone()),
        None => {
            let id = o.ids.make();
            if let Some(id) = &id {
                req.headers_mut().insert(REQUEST_ID, id.clone());
            }
            id
        }
    };
    let route = req.extensions().get::<MatchedPath>().cloned();
    let method = req.method().clone();
    let span = tracing::info_span!(
        "request",
        method = %req.method(),
        path = %req.uri().path(),
        request_id = %id.as_ref().and_then(|v| v.to_str().ok()).unwrap_or("-"),
    );
    let run = std::panic::AssertUnwindSafe(tokio::time::timeout(o.limit, next.run(req))).catch_unwind();
    let mut res = match run.instrument(span.clone()).await {
        Ok(Ok(res)) => res,
        Ok(Err(_)) => ApiError::Timeout.into_response(),
        Err(_) => ApiError::internal(anyhow::anyhow!("a handler panicked")).into_response(),
    };
    if let Some(id) = id {
        res.headers_mut().insert(REQUEST_ID, id);
    }
    let elapsed = start.elapsed();
    let status = res.status().as_u16();
    span.in_scope(|| tracing::debug!(status, latency_ms = elapsed.as_secs_f64() * 1e3, "finished processing request"));
    let route = route.as_ref().map_or("unmatched", |p| p.as_str());
    let (counter, histogram) = request_metrics(route, &method, status);
    counter.increment(1);
    histogram.record(elapsed.as_secs_f64());
    res
}
