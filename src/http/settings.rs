//! The prompt settings route: an RFC 7396 merge patch of a prompt's settings,
//! validated as a whole before it is stored.

use axum::{Json, extract::State};
use serde::Deserialize;
use utoipa::ToSchema;

use super::{
    AppState,
    error::{ApiError, ApiResult},
    extract::{ApiJson, ApiPath, Caller},
};
use crate::{
    domain::{Prompt, PromptSettings},
    service::prompts::existing_prompt,
    store::{Scope, StoreError},
};

/// RFC 7396 JSON merge patch: members of `patch` replace those of `target`,
/// objects merge recursively, `null` removes a member (its default applies).
fn merge_patch(target: &mut serde_json::Value, patch: &serde_json::Value) {
    let serde_json::Value::Object(patch) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = serde_json::Value::Object(Default::default());
    }
    if let serde_json::Value::Object(t) = target {
        for (k, v) in patch {
            if v.is_null() {
                t.remove(k);
            } else {
                merge_patch(t.entry(k.clone()).or_insert(serde_json::Value::Null), v);
            }
        }
    }
}

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
            },
            "example": {"agent_reflections": "ignore", "pinned_bullets": ["b-0001"], "max_removal_share": 0.25},
        });
        serde_json::from_value(schema).unwrap_or_default()
    }
}

impl ToSchema for SettingsPatch {}

/// Changes a prompt's learning settings (agent reflections, pinned bullets,
/// budgets, …). The next round uses them; versions are not touched.
#[utoipa::path(patch, path = "/v1/prompts/{name}/settings", tag = "prompts", params(("name" = String, Path)),
    request_body(content = SettingsPatch, content_type = "application/merge-patch+json"),
    responses((status = 200, body = Prompt), (status = 404, body = super::error::Problem),
        (status = 409, body = super::error::Problem), (status = 422, body = super::error::Problem)),
    security(("bearer" = ["prompts:write"])))]
pub async fn update_settings(
    State(st): State<AppState>,
    caller: Caller,
    ApiPath(name): ApiPath<String>,
    ApiJson(patch): ApiJson<SettingsPatch>,
) -> ApiResult<Json<Prompt>> {
    caller.require(Scope::PromptsWrite)?;
    // `null` removes a member before the settings are read back, so an unknown
    // name would pass unnoticed there: refuse it here.
    if let Some(unknown) = patch.0.keys().find(|k| !PromptSettings::FIELDS.contains(&k.as_str())) {
        return Err(ApiError::unprocessable(format!(
            "`{}` is not a setting; the settings are {}",
            unknown.chars().take(64).collect::<String>(),
            PromptSettings::FIELDS.join(", ")
        )));
    }
    let patch = serde_json::Value::Object(patch.0);
    // Optimistic: re-read and re-apply when another change landed in between.
    for _ in 0..5 {
        let prompt = existing_prompt(&st, &name).await?;
        let mut doc = serde_json::to_value(&prompt.settings).map_err(|e| ApiError::internal(e.into()))?;
        merge_patch(&mut doc, &patch);
        let new: PromptSettings = serde_path_to_error::deserialize(doc).map_err(|e| {
            let inner = super::extract::plain_serde_error(&e.inner().to_string());
            ApiError::unprocessable(format!("`settings.{}`: {inner}", e.path()))
        })?;
        let new = new.validated().map_err(ApiError::unprocessable)?;
        match st.store.update_prompt_settings(&prompt.name, &prompt.settings, &new).await {
            Ok(Some(updated)) => return Ok(Json(updated)),
            Ok(None) => return Err(ApiError::not_found(format_args!("prompt {:?}", prompt.name.as_str()))),
            Err(StoreError::Conflict) => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Err(ApiError::conflict("the settings kept changing while this patch was applied; send it again".into()))
}
