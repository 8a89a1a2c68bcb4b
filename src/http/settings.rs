//! The prompt settings route: an RFC 7396 merge patch of a prompt's settings
//! (applied and validated as a whole by `service::prompts`).

use crate::service::audit::Audit;
use axum::{Json, extract::State};
use serde::Deserialize;
use utoipa::ToSchema;

use super::{
    AppState,
    error::ApiResult,
    extract::{ApiJson, Authorized, scope},
};
use crate::service::projects::PathPrompt;
use crate::{domain::Prompt, service::prompts};

/// A JSON merge patch (RFC 7396) of a prompt's settings: the members sent
/// replace the current ones, `null` resets a member to its default.
#[derive(Debug, Deserialize)]
pub struct SettingsPatch(pub serde_json::Map<String, serde_json::Value>);

impl utoipa::PartialSchema for SettingsPatch {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        let nullable_int = |min: u64, max: Option<u64>| {
            let mut s = serde_json::json!({"type": ["integer", "null"], "minimum": min});
            if let Some(max) = max {
                s["maximum"] = max.into();
            }
            s
        };
        let schema = serde_json::json!({
            "type": "object",
            "description": "A JSON merge patch (RFC 7396) of the prompt's settings: members sent replace the current ones, `null` resets one to its default.",
            "additionalProperties": false,
            "properties": {
                "duplication": nullable_int(1, Some(8)),
                "batch_size": {"oneOf": [{"type": "string", "enum": ["auto"]}, {"type": "integer", "minimum": 1, "maximum": 10000}, {"type": "null"}]},
                "max_wait_secs": nullable_int(0, Some(crate::domain::prompt::MAX_WAIT_SECS)),
                "reduce": {"type": ["string", "null"], "enum": ["union", "llm", null]},
                "max_bullets": nullable_int(0, Some(crate::domain::prompt::MAX_BULLETS as u64)),
                "max_chars": nullable_int(0, Some(crate::domain::prompt::MAX_CHARS as u64)),
                "agent_reflections": {"type": ["string", "null"], "enum": ["ignore", "use", null]},
                "pinned_bullets": {"type": ["array", "null"], "maxItems": 1000, "items": {"type": "string", "pattern": "^b-[0-9]{1,12}$"}},
                "max_removal_share": {"type": ["number", "null"], "minimum": 0, "maximum": 1},
                "regression_guard": {"type": ["boolean", "null"]},
                "retention": {
                    "type": ["object", "null"],
                    "additionalProperties": false,
                    "description": "This prompt's own trace retention in days; `null` members follow the server's `[retention]`.",
                    "properties": {
                        "consumed_days": nullable_int(1, Some(u64::from(crate::domain::prompt::MAX_RETENTION_DAYS))),
                        "failed_days": nullable_int(1, Some(u64::from(crate::domain::prompt::MAX_RETENTION_DAYS))),
                        "quarantined_days": nullable_int(1, Some(u64::from(crate::domain::prompt::MAX_RETENTION_DAYS))),
                    },
                },
                "population": {
                    "type": ["object", "null"],
                    "description": "This prompt's own population knobs (`evaluated` policy); each replaces the server's `[population]` default, `null` resets it.",
                    "additionalProperties": false,
                    "properties": {
                        "explore_share": {"type": ["number", "null"], "minimum": crate::domain::population_settings::EXPLORE_SHARE_MIN, "maximum": crate::domain::population_settings::EXPLORE_SHARE_MAX},
                        "min_traces": nullable_int(0, Some(crate::domain::population_settings::MAX_EVIDENCE)),
                        "max_arms": nullable_int(1, Some(crate::domain::population_settings::MAX_ARMS as u64)),
                        "crossover_prob": {"type": ["number", "null"], "minimum": 0, "maximum": 1},
                        "margin": {"type": ["number", "null"], "minimum": 0, "maximum": crate::domain::population_settings::MAX_MARGIN},
                        "cooldown_windows": nullable_int(0, Some(crate::domain::population_settings::MAX_EVIDENCE)),
                    },
                },
                "budget": {
                    "type": ["object", "null"],
                    "description": "This prompt's caps on what combee's LLM calls spend for it (merge patch; `null` clears one, or all): per UTC day, and per pass of a round. Kept beside the settings (the prompt's answer does not show them; `GET /v1/prompts/{name}/spend` does). A change lifts today's hold at once.",
                    "additionalProperties": false,
                    "properties": {
                        "tokens_per_day": nullable_int(0, Some(crate::domain::budget::MAX_TOKENS_CAP)),
                        "usd_per_day": {"type": ["number", "null"], "minimum": 0, "maximum": crate::domain::budget::MAX_USD_CAP},
                        "tokens_per_round": nullable_int(0, Some(crate::domain::budget::MAX_TOKENS_CAP)),
                        "usd_per_round": {"type": ["number", "null"], "minimum": 0, "maximum": crate::domain::budget::MAX_USD_CAP},
                    },
                },
            },
            "example": {"agent_reflections": "ignore", "pinned_bullets": ["b-0001"], "max_removal_share": 0.25},
        });
        serde_json::from_value(schema).unwrap_or_default()
    }
}

impl ToSchema for SettingsPatch {}

/// Changes a prompt's learning settings (agent reflections, pinned bullets,
/// playbook budgets, spending caps in `budget`, …). The next round uses them;
/// versions are not touched.
#[utoipa::path(patch, path = "/v1/prompts/{name}/settings", tag = "prompts", params(("name" = String, Path)),
    request_body(content = SettingsPatch, content_type = "application/merge-patch+json"),
    responses((status = 200, body = Prompt), (status = 404, body = super::error::Problem),
        (status = 409, body = super::error::Problem), (status = 422, body = super::error::Problem)),
    security(("bearer" = ["prompts:write"])))]
pub async fn update_settings(
    State(st): State<AppState>,
    _caller: Authorized<scope::PromptsWrite>,
    PathPrompt(name): PathPrompt,
    ApiJson(patch): ApiJson<SettingsPatch>,
) -> ApiResult<(Audit, Json<Prompt>)> {
    let before = prompts::existing_prompt(&st, &name).await?;
    let after = prompts::update_settings(&st, &name, patch.0).await?;
    let audit =
        Audit::new("prompt.settings.update", "prompt", &after.name).before(&before.settings).after(&after.settings);
    Ok((audit, Json(after)))
}
