//! Operational routes: liveness, readiness (the store answers) and Prometheus
//! metrics. The OpenAPI document has its own file.

use axum::{
    Json,
    extract::State,
    http::{HeaderValue, header},
    response::{IntoResponse, Response},
};
use serde_json::json;

use super::{AppState, error::ApiError};
use crate::service;

#[utoipa::path(get, path = "/healthz", tag = "ops", responses((status = 200, description = "the process is alive")))]
pub async fn healthz() -> Json<serde_json::Value> {
    Json(json!({"status": "ok"}))
}

#[utoipa::path(get, path = "/readyz", tag = "ops",
    responses((status = 200, description = "the store is reachable"), (status = 503, body = super::error::Problem)))]
pub async fn readyz(State(st): State<AppState>) -> Result<Json<serde_json::Value>, ApiError> {
    let kind = service::readiness(&st, std::time::Duration::from_secs(2)).await?;
    Ok(Json(json!({"status": "ready", "store": kind})))
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
