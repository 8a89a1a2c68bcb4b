//! The HTTP API: its routes, and the middleware every request passes through
//! (`observe.rs`: request id, tracing span, metrics, timeout, panics as
//! problems; and the body limit), wrapped once around the whole route table.
//! One file per resource beside this one; the operations the web UI shares
//! are in `service/`.

pub mod audit;
pub mod budget;
pub mod controller;
pub mod error;
pub mod evaluators;
pub mod export;
pub mod extract;
pub mod keys;
pub mod label_history;
pub mod labels;
pub mod langfuse;
pub mod members;
mod observe;
pub mod openapi;
pub mod ops;
pub mod otlp;
pub mod outcomes;
pub mod projects;
pub mod prompts;
pub mod regression;
pub mod rounds;
pub mod settings;
pub mod traces;
pub mod versions;
pub mod webhooks;

use std::{convert::Infallible, time::Duration};

use axum::{
    Router,
    extract::{DefaultBodyLimit, Request},
    http::Method,
    response::Response,
    routing::{get, post, put},
};
use tower::{Layer as _, Service};

use error::ApiError;
pub use observe::{Observed, RouteTable};

use crate::service::AppState;

/// The API's routes, without state or middleware: `app.rs` adds the web UI
/// beside them and hands the whole table to [`serve`].
pub fn routes() -> RouteTable {
    // Flat paths rather than `.nest("/v1")`: nesting costs a second routing step per request.
    RouteTable::new()
        .route("/healthz", get(ops::healthz))
        .route("/readyz", get(ops::readyz))
        .route("/metrics", get(ops::metrics))
        .route("/v1/prompts", post(prompts::create_prompt).get(prompts::list_prompts))
        .route("/v1/prompts/{name}", get(prompts::get_prompt))
        .route("/v1/prompts/{name}/population", get(prompts::get_population))
        .route("/v1/prompts/{name}/settings", axum::routing::patch(settings::update_settings))
        .route("/v1/prompts/{name}/evaluators", get(evaluators::get_evaluators).put(evaluators::put_evaluators))
        .route("/v1/prompts/{name}/evaluators/calibration", get(evaluators::get_calibration))
        .route("/v1/prompts/{name}/versions", post(versions::create_version).get(versions::list_versions))
        .route("/v1/prompts/{name}/versions/{number}", get(versions::get_version))
        .route("/v1/prompts/{name}/versions/{number}/gate", get(regression::get_version_gate))
        .route("/v1/prompts/{name}/versions/{number}/evaluation", post(regression::post_evaluation))
        .route("/v1/prompts/{name}/regression-cases", post(regression::add_case).get(regression::list_cases))
        .route("/v1/prompts/{name}/regression-cases/import", post(regression::import_cases))
        .route("/v1/prompts/{name}/regression-cases/{id}", axum::routing::delete(regression::delete_case))
        .route("/v1/prompts/{name}/gate", get(regression::get_gate_settings).put(regression::put_gate_settings))
        .route("/v1/prompts/{name}/diff", get(versions::diff_versions))
        .route("/v1/prompts/{name}/labels", get(labels::list_labels))
        .route("/v1/prompts/{name}/labels/history", get(label_history::label_history))
        .route("/v1/prompts/{name}/labels/{label}", put(labels::move_label).delete(labels::delete_label))
        .route("/v1/prompts/{name}/rollback", post(labels::rollback))
        .route("/v1/prompts/{name}/rounds", post(rounds::trigger_round).get(rounds::list_rounds))
        .route("/v1/rounds/{id}", get(rounds::get_round))
        .route("/v1/prompts/{name}/learning", get(rounds::get_learning))
        .route("/v1/prompts/{name}/backoff", axum::routing::delete(rounds::clear_backoff))
        .route("/v1/prompts/{name}/controller", get(controller::get_controller))
        .route("/v1/prompts/{name}/metrics", get(outcomes::prompt_metrics))
        .route("/v1/prompts/{name}/spend", get(budget::get_spend))
        .route("/v1/hooks/rounds/{name}", post(rounds::webhook_round))
        .route("/v1/traces", post(traces::post_traces).get(traces::list_traces))
        .route("/v1/traces/quarantine", post(traces::quarantine_traces))
        .route("/v1/traces/{id}", get(traces::get_trace).delete(traces::delete_trace))
        .route("/v1/traces/{id}/quarantine", post(traces::quarantine_trace).delete(traces::release_trace))
        .route("/v1/traces/{id}/feedback", post(traces::add_feedback))
        .route("/v1/traces/{id}/pin", post(regression::pin_trace))
        .route("/v1/otlp/v1/traces", post(otlp::export_traces))
        .route("/v1/otlp/v1/logs", post(otlp::export_logs))
        .route("/v1/prompts/{name}/traces/requeue", post(traces::requeue_failed))
        .route("/v1/prompts/{name}/export", get(export::export_traces))
        .route("/v1/keys", post(keys::create_key).get(keys::list_keys))
        .route("/v1/keys/{id}", axum::routing::delete(keys::revoke_key))
        .route("/v1/members", get(members::list_members))
        .route("/v1/members/{subject}", axum::routing::put(members::set_member).delete(members::remove_member))
        .route("/v1/webhooks", post(webhooks::create_webhook).get(webhooks::list_webhooks))
        .route("/v1/webhooks/{id}", get(webhooks::get_webhook).delete(webhooks::delete_webhook))
        .route("/v1/webhooks/{id}/deliveries", get(webhooks::list_deliveries))
        .route("/v1/audit", get(audit::audit_log))
        .route("/v1/projects", post(projects::create_project).get(projects::list_projects))
        .route("/v1/projects/{name}", get(projects::get_project).patch(projects::update_project))
        .route("/v1/openapi.json", get(openapi::openapi))
        // For Langfuse SDKs pointed at combee (see http/langfuse.rs).
        .route("/api/public/v2/prompts/{name}", get(langfuse::get_prompt))
        .route("/api/public/otel/v1/traces", post(langfuse::export_traces))
        // Every other write operation appends one audit entry when it succeeds (see `observe.rs`).
        .not_audited(Method::POST, "/v1/traces", INGEST)
        .not_audited(Method::POST, "/v1/traces/{id}/feedback", INGEST)
        .not_audited(Method::POST, "/v1/otlp/v1/traces", INGEST)
        .not_audited(Method::POST, "/v1/otlp/v1/logs", INGEST)
        .not_audited(Method::POST, "/api/public/otel/v1/traces", INGEST)
}

/// Why trace ingest appends no audit entry.
const INGEST: &str = "traces and their feedback are data the agents send, at high volume, not an operator's \
                      change; what operators do to traces (quarantine, release, delete, requeue) is audited";

/// The route table as served: the API's fallbacks (problem documents), the
/// body limit, and the middleware every request passes through
/// ([`Observed`]), web UI pages included; serve it with
/// `axum::ServiceExt::into_make_service`.
pub fn serve(
    routes: RouteTable,
    state: AppState,
) -> impl Service<Request, Response = Response, Error = Infallible, Future: Send> + Clone + Send + Sync + 'static {
    let time_limit = Duration::from_secs(state.settings.server.request_timeout_secs);
    let body_limit = DefaultBodyLimit::max(state.settings.limits.max_body_bytes);
    let (router, templates, unaudited) = routes.into_parts();
    let router = router.fallback(not_found).method_not_allowed_fallback(method_not_allowed).with_state(state.clone());
    // Around the router, not on each route: the limit is a request extension read by the body extractors.
    Observed::new(body_limit.layer(router.clone()), router, (templates, unaudited), time_limit, state)
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
