//! Prompts in Langfuse's shape, so code written against a Langfuse SDK
//! (`get_prompt` / `prompt.get`) fetches combee prompts unchanged: an integer
//! `version`, `type: "text"`, the text as `prompt` with combee's `{name}`
//! placeholders written as Langfuse's `{{name}}` (so the SDK's `compile`
//! fills them), `labels`, an empty `config` and `tags`, the version's message
//! as `commitMessage`.
//!
//! Which version is served follows Langfuse's rules, not combee's subject
//! rules: a Langfuse SDK sends no subject, so without `label` or `version`
//! it always gets the version labelled `production` — never an experiment's
//! challenger, whose traffic comes from clients that send a subject.

use serde::Serialize;
use utoipa::ToSchema;

use super::{AppState, ServiceError, ServiceResult};
use crate::domain::{LabelName, PromptName, label::Selector, prompt::placeholder_spans};

/// A prompt as Langfuse's API returns it (`GET /api/public/v2/prompts/{name}`).
#[derive(Debug, Serialize, ToSchema, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct LangfusePrompt {
    pub name: String,
    pub version: i64,
    /// Always `text`: a combee prompt is one system prompt.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// The rendered text, `{name}` placeholders written `{{name}}`.
    pub prompt: String,
    /// Always `{}`: combee keeps no model settings with a prompt.
    #[schema(value_type = Object)]
    pub config: serde_json::Value,
    pub labels: Vec<String>,
    /// Always empty.
    pub tags: Vec<String>,
    pub commit_message: Option<String>,
    /// Always `null`: combee prompts have no dependencies to resolve.
    #[schema(value_type = Option<Object>)]
    pub resolution_graph: Option<serde_json::Value>,
}

/// The version of `name` a Langfuse SDK asked for: `version`, `label`, both
/// (that version only while the label points at it) or neither (`production`).
/// The answer names the prompt as any caller may write it (see
/// [`PromptName::qualified`]): the SDK links the traces it sends by that name.
pub async fn prompt(
    st: &AppState,
    name: &PromptName,
    label: Option<&str>,
    version: Option<i64>,
) -> ServiceResult<LangfusePrompt> {
    let by_label = |l: &str| -> ServiceResult<Selector> {
        if l == LabelName::LATEST {
            return Ok(Selector::Latest);
        }
        LabelName::parse(l).map(Selector::Label).map_err(|e| ServiceError::BadRequest(e.to_string()))
    };
    let selector = match (label, version) {
        (_, Some(v)) if v < 1 => return Err(ServiceError::BadRequest("`version` must be at least 1".into())),
        (_, Some(v)) => Selector::Version(v),
        (Some(l), None) => by_label(l)?,
        (None, None) => Selector::Label(LabelName::production()),
    };
    let missing = || match (label, version) {
        (Some(l), Some(v)) => {
            ServiceError::NotFound(format!("label {l:?} of prompt {name:?} does not point at version {v}"))
        }
        (_, Some(v)) => ServiceError::not_found(format_args!("version {v} of prompt {name:?}")),
        (Some(l), None) => ServiceError::not_found(format_args!("label {l:?} of prompt {name:?}")),
        (None, None) => ServiceError::not_found(format_args!("the production version of prompt {name:?}")),
    };
    if let (Some(l), Some(v)) = (label, version) {
        let at = st.store.resolve(name, &by_label(l)?).await?.map(|r| r.version.number);
        if at != Some(v) {
            return Err(missing());
        }
    }
    let Some(resolved) = st.store.resolve(name, &selector).await? else {
        if st.store.get_prompt(name).await?.is_none() {
            return Err(ServiceError::not_found(format_args!("prompt {name:?}")));
        }
        return Err(missing());
    };
    let v = &resolved.version;
    Ok(LangfusePrompt {
        name: name.qualified().into_owned(),
        version: v.number,
        kind: "text",
        prompt: mustache(&v.content.render()),
        config: serde_json::json!({}),
        labels: resolved.labels.iter().map(|l| l.as_str().to_owned()).collect(),
        tags: Vec::new(),
        commit_message: Some(v.message.clone()).filter(|m| !m.is_empty()),
        resolution_graph: None,
    })
}

/// combee's `{name}` placeholders (identifier characters, not part of `{{`)
/// written as Langfuse's `{{name}}`; every other brace stays as it is.
pub fn mustache(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 8);
    let mut copied = 0;
    for span in placeholder_spans(text) {
        out.push_str(&text[copied..span.start]);
        out.push_str("{{");
        out.push_str(&text[span.start + 1..span.end - 1]);
        out.push_str("}}");
        copied = span.end;
    }
    out.push_str(&text[copied..]);
    out
}

#[cfg(test)]
mod tests {
    use super::mustache;

    #[test]
    fn placeholders_become_double_braced_and_nothing_else_changes() {
        assert_eq!(mustache("Help {customer} with {product_2}."), "Help {{customer}} with {{product_2}}.");
        assert_eq!(mustache(r#"Answer as {"answer": "…"}"#), r#"Answer as {"answer": "…"}"#);
        assert_eq!(mustache("{{kept}} { spaced } {} {a-b} {ok}"), "{{kept}} { spaced } {} {a-b} {{ok}}");
        assert_eq!(mustache("naïve {é} {x}"), "naïve {é} {{x}}");
        assert_eq!(mustache("{x}}"), "{{x}}}", "combee reads `{{x}}` there too");
    }
}
