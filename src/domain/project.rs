//! Projects: the teams sharing one deployment. Every prompt belongs to one
//! project (`default` unless told otherwise); a project's keys and webhooks
//! see only its prompts and what hangs off them. A project's name follows the
//! rules of a prompt name; its settings hold what its new prompts start from.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use utoipa::ToSchema;

use super::{NameError, PromptSettings, access::Reach, budget::BudgetCaps};

/// What a trace naming a prompt that is absent — or in another project — is
/// told: the same words either way.
pub fn unknown_prompt(name: &str) -> String {
    format!("unknown prompt {name:?}; create it first (POST /v1/prompts)")
}

/// A valid project name: the same rules as a prompt name.
pub fn check_name(name: &str) -> Result<(), NameError> {
    if super::names::is_valid_name(name) {
        Ok(())
    } else {
        Err(NameError::Invalid { kind: "project", got: name.chars().take(80).collect() })
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct Project {
    pub name: String,
    pub settings: ProjectSettings,
    pub created_at: DateTime<Utc>,
}

/// A project's own settings.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ProjectSettings {
    /// The settings a new prompt of this project starts from (any field of a
    /// prompt's `settings`, retention overrides included); the prompt's own
    /// `settings` replace them field by field.
    #[serde(default, skip_serializing_if = "Map::is_empty")]
    #[schema(value_type = PromptSettings)]
    pub prompt_defaults: Map<String, Value>,
    /// Caps on what learning in this project spends, all its prompts together
    /// (beside each prompt's own caps and the server's).
    #[serde(default, skip_serializing_if = "BudgetCaps::is_empty", deserialize_with = "caps_object")]
    pub budget: BudgetCaps,
}

impl ProjectSettings {
    /// The defaults are themselves valid prompt settings.
    pub fn validated(self) -> Result<Self, String> {
        self.prompt_settings(None)?;
        self.budget.validate().map_err(|e| format!("settings.{e}"))?;
        Ok(self)
    }

    /// A new prompt's settings: `given` (the request's, as sent) over the
    /// project's defaults, top-level field by field, then checked.
    pub fn prompt_settings(&self, given: Option<&Map<String, Value>>) -> Result<PromptSettings, String> {
        let mut merged = self.prompt_defaults.clone();
        if let Some(given) = given {
            merged.extend(given.iter().map(|(k, v)| (k.clone(), v.clone())));
        }
        let settings: PromptSettings = serde_path_to_error::deserialize(Value::Object(merged)).map_err(|e| {
            let path = e.path().to_string();
            let inner = e.into_inner().to_string();
            if path == "." { format!("settings: {inner}") } else { format!("settings.{path}: {inner}") }
        })?;
        settings.validated()
    }
}

/// Caps given as a JSON object (left out for none): serde would also read the
/// struct from an array, filling caps by position, which no client means.
fn caps_object<'de, D: serde::Deserializer<'de>>(d: D) -> Result<BudgetCaps, D::Error> {
    match Value::deserialize(d)? {
        v @ Value::Object(_) => serde_path_to_error::deserialize::<_, BudgetCaps>(v)
            .map_err(|e| serde::de::Error::custom(format!("`{}` {}", e.path(), e.inner()))),
        _ => Err(serde::de::Error::custom("`budget` must be an object of caps")),
    }
}

/// The project a list is filtered to: a project caller's own (a `?project=`
/// naming another finds nothing, as for a project that does not exist), or
/// what a server-wide caller asked for.
pub fn list_filter(reach: &Reach, asked: Option<&str>) -> ListFilter {
    match (reach, asked) {
        (Reach::Project(own), Some(a)) if a != own => ListFilter::Nothing,
        (Reach::Project(own), _) => ListFilter::Project(own.clone()),
        (Reach::Server, Some(a)) => ListFilter::Project(a.to_owned()),
        (Reach::Server, None) => ListFilter::All,
    }
}

/// What a list shows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ListFilter {
    All,
    Project(String),
    /// A project out of reach: an empty list.
    Nothing,
}

impl ListFilter {
    pub fn project(&self) -> Option<&str> {
        match self {
            ListFilter::Project(p) => Some(p),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_prompts_own_settings_replace_the_projects_defaults_field_by_field() {
        let defaults = json!({"max_wait_secs": 60, "retention": {"consumed_days": 7}});
        let project = ProjectSettings { prompt_defaults: defaults.as_object().unwrap().clone(), ..Default::default() };
        let none = project.prompt_settings(None).unwrap();
        assert_eq!(none.retention.consumed_days, Some(7));
        let given = json!({"retention": {"failed_days": 3}});
        let mine = project.prompt_settings(given.as_object()).unwrap();
        assert_eq!((mine.retention.consumed_days, mine.retention.failed_days), (None, Some(3)));
        assert_eq!(mine.max_wait_secs, none.max_wait_secs);
        let bad =
            ProjectSettings { prompt_defaults: json!({"nope": 1}).as_object().unwrap().clone(), ..Default::default() };
        assert!(bad.validated().is_err());
        assert!(check_name("team-a").is_ok() && check_name("Team A").is_err());
    }

    #[test]
    fn a_project_callers_lists_show_its_project_only() {
        let a = Reach::Project("a".into());
        assert_eq!(list_filter(&a, None), ListFilter::Project("a".into()));
        assert_eq!(list_filter(&a, Some("b")), ListFilter::Nothing);
        assert_eq!(list_filter(&Reach::Server, Some("b")), ListFilter::Project("b".into()));
        assert_eq!(list_filter(&Reach::Server, None), ListFilter::All);
    }
}
