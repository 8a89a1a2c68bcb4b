//! Operational routes: liveness, readiness (the store answers), Prometheus
//! metrics and the OpenAPI document generated from the handlers.

use axum::{
    Json,
    extract::State,
    http::{HeaderValue, header},
    response::{IntoResponse, Response},
};
use serde_json::json;
use utoipa::OpenApi;

use super::{AppState, error::ApiError};

#[utoipa::path(get, path = "/healthz", tag = "ops", responses((status = 200, description = "the process is alive")))]
pub async fn healthz() -> Json<serde_json::Value> {
    Json(json!({"status": "ok"}))
}

#[utoipa::path(get, path = "/readyz", tag = "ops",
    responses((status = 200, description = "the store is reachable"), (status = 503, body = super::error::Problem)))]
pub async fn readyz(State(st): State<AppState>) -> Result<Json<serde_json::Value>, ApiError> {
    match tokio::time::timeout(std::time::Duration::from_secs(2), st.store.ping()).await {
        Ok(Ok(())) => Ok(Json(json!({"status": "ready", "store": st.store.kind()}))),
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "readiness check failed");
            Err(ApiError::unavailable())
        }
        Err(_) => Err(ApiError::unavailable()),
    }
}

#[utoipa::path(get, path = "/metrics", tag = "ops", responses((status = 200, description = "Prometheus text format")))]
pub async fn metrics(State(st): State<AppState>) -> Response {
    let mut text = st.metrics.render();
    if !text.is_empty() && !text.ends_with('\n') {
        text.push('\n');
    }
    text.push_str(&super::outcomes::outcome_gauges(&st).await);
    let mut res = text.into_response();
    res.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain; version=0.0.4"));
    res
}

struct BearerAuth;

impl utoipa::Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).bearer_format("cmb_…").build()),
        );
        // The Langfuse-compatible routes: the key's prefix and the key as a Basic pair.
        components.add_security_scheme(
            "basic",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Basic).build()),
        );
    }
}

#[derive(OpenApi)]
#[openapi(
    info(title = "combee", description = "Continuous agent self-improvement: versioned system prompts learned from agent traces."),
    paths(
        healthz, readyz, metrics,
        super::prompts::create_prompt, super::prompts::list_prompts, super::prompts::get_prompt,
        super::settings::update_settings,
        super::versions::create_version, super::versions::list_versions, super::versions::get_version,
        super::versions::diff_versions, super::labels::list_labels, super::labels::move_label,
        super::labels::delete_label, super::labels::rollback, super::label_history::label_history, super::prompts::get_population,
        super::traces::post_traces, super::traces::list_traces, super::traces::get_trace, super::traces::add_feedback,
        super::otlp::export_traces, super::otlp::export_logs,
        super::traces::requeue_failed,
        super::traces::quarantine_trace, super::traces::release_trace, super::traces::delete_trace, super::traces::quarantine_traces,
        super::keys::create_key, super::keys::list_keys, super::keys::revoke_key,
        super::rounds::trigger_round, super::rounds::webhook_round, super::rounds::get_round, super::rounds::list_rounds,
        super::controller::get_controller, super::outcomes::prompt_metrics,
        super::webhooks::create_webhook, super::webhooks::list_webhooks, super::webhooks::get_webhook,
        super::webhooks::delete_webhook, super::webhooks::list_deliveries,
        super::langfuse::get_prompt, super::langfuse::export_traces, super::export::export_traces,
    ),
    modifiers(&BearerAuth)
)]
pub struct ApiDoc;

/// The document with the rules utoipa cannot state (see `openapi.rs`).
pub async fn openapi() -> Json<serde_json::Value> {
    Json(super::openapi::document().clone())
}
