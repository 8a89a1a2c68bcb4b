//! Operational routes: liveness, readiness (the store answers) and Prometheus
//! metrics (with gauges read from the store at scrape time: outcomes, and the
//! prompts backing off after failed rounds). The OpenAPI document has its own file.

use axum::{
    Json,
    extract::State,
    http::{HeaderValue, header},
    response::{IntoResponse, Response},
};
use serde_json::json;

use super::{AppState, error::ApiError};
use crate::{
    domain::names::{DEFAULT_PROJECT, PromptName},
    service,
};

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
    text.push_str(&backoff_gauges(&st).await);
    text.push_str(&budget_gauges(&st).await);
    let mut res = text.into_response();
    res.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain; version=0.0.4"));
    res
}

/// A per-prompt series' labels: the prompt and its project.
fn series(prompt: &PromptName) -> String {
    let (name, project) = (super::outcomes::escape(prompt.as_str()), super::outcomes::escape(prompt.project()));
    format!("{{prompt=\"{name}\",project=\"{project}\"}}")
}

/// At most this many prompts in a failure streak get series, so a scrape stays cheap.
const BACKOFF_MAX_PROMPTS: u32 = 1000;

/// Prometheus text for the prompts in a failure streak: how many back off now
/// (`combee_prompts_backing_off`), and per prompt the seconds left before the
/// scheduler may open its next round (`combee_prompt_backoff_seconds`, 0 once
/// the wait is over) and the failed rounds in a row (`combee_prompt_failure_streak`).
/// A prompt whose streak ends (a success, an operator's reset) drops out.
async fn backoff_gauges(st: &AppState) -> String {
    use std::fmt::Write;
    let read = service::rounds::failing_prompts(st, BACKOFF_MAX_PROMPTS);
    let prompts = match tokio::time::timeout(std::time::Duration::from_secs(2), read).await {
        Ok(Ok(p)) => p,
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "backoff gauges left out of this scrape");
            return String::new();
        }
        Err(_) => {
            tracing::warn!("backoff gauges took too long; left out of this scrape");
            return String::new();
        }
    };
    let now = chrono::Utc::now();
    let (mut seconds, mut streak, mut backing_off) = (String::new(), String::new(), 0);
    for (name, state) in &prompts {
        let series = series(name);
        let left = state.backoff_until.map_or(0.0, |t| (t - now).num_milliseconds().max(0) as f64 / 1000.0);
        backing_off += usize::from(state.state == crate::domain::backoff::LearningStatus::BackingOff);
        let _ = writeln!(seconds, "combee_prompt_backoff_seconds{series} {left}");
        let _ = writeln!(streak, "combee_prompt_failure_streak{series} {}", state.failure_streak);
    }
    format!(
        "# HELP combee_prompts_backing_off Prompts whose next round waits out a backoff after failed rounds.\n\
         # TYPE combee_prompts_backing_off gauge\ncombee_prompts_backing_off {backing_off}\n\
         # HELP combee_prompt_backoff_seconds Seconds before the scheduler may open the prompt's next round.\n\
         # TYPE combee_prompt_backoff_seconds gauge\n{seconds}\
         # HELP combee_prompt_failure_streak Rounds of the prompt that failed in a row.\n\
         # TYPE combee_prompt_failure_streak gauge\n{streak}"
    )
}

/// Prometheus text for the daily spending caps holding learning back today:
/// per prompt held back, the seconds until its cap lifts by itself
/// (`combee_prompt_budget_reached_seconds`; the prompt drops out when the cap
/// is raised or the day ends), and whether the server's own cap holds every
/// prompt back (`combee_budget_reached`, 0 or 1).
async fn budget_gauges(st: &AppState) -> String {
    use std::fmt::Write;
    let read = service::budget::reached_all(st);
    let held = match tokio::time::timeout(std::time::Duration::from_secs(2), read).await {
        Ok(Ok(h)) => h,
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "budget gauges left out of this scrape");
            return String::new();
        }
        Err(_) => {
            tracing::warn!("budget gauges took too long; left out of this scrape");
            return String::new();
        }
    };
    let now = st.clock.now();
    let (mut seconds, mut server) = (String::new(), 0);
    for (key, reached) in &held {
        if key.is_empty() {
            server = 1;
            continue;
        }
        // The budget names a prompt by its key: `name` in `default`, `project/name` elsewhere.
        let Ok(name) = PromptName::written(key, DEFAULT_PROJECT) else { continue };
        let left = (reached.until - now).num_milliseconds().max(0) as f64 / 1000.0;
        let _ = writeln!(seconds, "combee_prompt_budget_reached_seconds{} {left}", series(&name));
    }
    format!(
        "# HELP combee_budget_reached Whether the server's daily spending cap holds all learning back (1) or not (0).\n\
         # TYPE combee_budget_reached gauge\ncombee_budget_reached {server}\n\
         # HELP combee_prompt_budget_reached_seconds Seconds until the daily spending cap holding the prompt's learning back lifts.\n\
         # TYPE combee_prompt_budget_reached_seconds gauge\n{seconds}"
    )
}
