//! The Vercel AI SDK's own telemetry attributes (`ai.*`, written by AI SDK
//! 4–6 and by `LegacyOpenTelemetry` in 7; its current `OpenTelemetry`
//! integration writes the GenAI conventions): `ai.prompt` (`{system, prompt |
//! messages}`), `ai.prompt.messages`, `ai.response.text`,
//! `ai.response.toolCalls`, `ai.toolCall.*`, `ai.model.id` and `ai.usage.*`.
//! The combee prompt and version are named in telemetry metadata
//! (`ai.telemetry.metadata.combee.prompt`) or in the runtime context the SDK
//! passes to telemetry (`ai.settings.context.combee.prompt`).

use opentelemetry_proto::tonic::trace::v1::Span;
use serde_json::{Map, Value, json};

use super::{
    SpanContent, fill, system_messages,
    values::{first_structured, get, int_attr, structured},
};

pub(super) const METADATA_PROMPT: &str = "ai.telemetry.metadata.combee.prompt";
pub(super) const METADATA_PROMPT_VERSION: &str = "ai.telemetry.metadata.combee.prompt.version";
pub(super) const CONTEXT_PROMPT: &str = "ai.settings.context.combee.prompt";
pub(super) const CONTEXT_PROMPT_VERSION: &str = "ai.settings.context.combee.prompt.version";

const PROMPT: &str = "ai.prompt";
const PROMPT_MESSAGES: &str = "ai.prompt.messages";
const RESPONSE_TEXT: &str = "ai.response.text";
const RESPONSE_TOOL_CALLS: &str = "ai.response.toolCalls";
const MODEL_ID: &str = "ai.model.id";
const RESPONSE_MODEL: &str = "ai.response.model";

pub(super) fn read(span: &Span, c: &mut SpanContent) {
    let a = span.attributes.as_slice();
    let prompt = get(a, PROMPT_MESSAGES).or_else(|| get(a, PROMPT)).map(structured).map(prompt_messages);
    fill(&mut c.system, || system_messages(prompt.as_ref()));
    fill(&mut c.input, || prompt);
    fill(&mut c.output, || {
        let text = get(a, RESPONSE_TEXT).map(structured);
        let calls = get(a, RESPONSE_TOOL_CALLS).map(structured);
        match (text, calls) {
            (None, None) => None,
            (Some(text), None) => Some(text),
            (text, Some(calls)) => {
                let mut message = Map::new();
                message.insert("role".into(), json!("assistant"));
                if let Some(text) = text {
                    message.insert("content".into(), text);
                }
                message.insert("tool_calls".into(), calls);
                Some(Value::Array(vec![Value::Object(message)]))
            }
        }
    });
    fill(&mut c.model, || first_structured(a, &[RESPONSE_MODEL, MODEL_ID]));
    fill(&mut c.tool, || get(a, "ai.toolCall.name").map(structured));
    for (name, key) in [("id", "ai.toolCall.id"), ("arguments", "ai.toolCall.args"), ("result", "ai.toolCall.result")] {
        if let Some(v) = get(a, key) {
            c.tool_call.entry(name).or_insert_with(|| structured(v));
        }
    }
    // The top span repeats its model calls' usage; the trace's totals skip it.
    fill(&mut c.input_tokens, || int_attr(a, "ai.usage.inputTokens").or_else(|| int_attr(a, "ai.usage.promptTokens")));
    fill(&mut c.output_tokens, || {
        int_attr(a, "ai.usage.outputTokens").or_else(|| int_attr(a, "ai.usage.completionTokens"))
    });
}

/// `ai.prompt` is `{"system"?, "prompt" | "messages"}`; `ai.prompt.messages`
/// is already a message list. Both become a message list.
fn prompt_messages(v: Value) -> Value {
    let Value::Object(map) = v else { return v };
    if !(map.contains_key("prompt") || map.contains_key("messages") || map.contains_key("system")) {
        return Value::Object(map);
    }
    let mut out = Vec::new();
    if let Some(system) = map.get("system").filter(|s| !s.is_null()) {
        out.push(json!({"role": "system", "content": system}));
    }
    match map.get("messages").or_else(|| map.get("prompt")) {
        Some(Value::Array(items)) => out.extend(items.iter().cloned()),
        Some(Value::Null) | None => {}
        Some(prompt) => out.push(json!({"role": "user", "content": prompt})),
    }
    Value::Array(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::otlp::mapping::values::string_kv as s;

    #[test]
    fn prompt_and_response_become_messages() {
        let span = Span {
            name: "ai.generateText".into(),
            attributes: vec![
                s("ai.prompt", r#"{"system": "be brief", "prompt": "where is order 7?"}"#),
                s("ai.response.text", "it shipped"),
                s("ai.usage.inputTokens", "12"),
            ],
            ..Default::default()
        };
        let mut c = SpanContent::default();
        read(&span, &mut c);
        assert_eq!(
            c.input.unwrap(),
            json!([{"role": "system", "content": "be brief"}, {"role": "user", "content": "where is order 7?"}])
        );
        assert_eq!(c.output.unwrap(), json!("it shipped"));

        let call = Span {
            name: "ai.generateText.doGenerate".into(),
            attributes: vec![
                s("ai.prompt.messages", r#"[{"role": "user", "content": [{"type": "text", "text": "hi"}]}]"#),
                s("ai.response.toolCalls", r#"[{"toolCallId": "c1", "toolName": "lookup", "input": "{}"}]"#),
                s("ai.usage.inputTokens", "12"),
            ],
            ..Default::default()
        };
        let mut c = SpanContent::default();
        read(&call, &mut c);
        assert_eq!(c.input.unwrap()[0]["content"][0]["text"], "hi");
        assert_eq!(c.output.unwrap()[0]["tool_calls"][0]["toolName"], "lookup");
        assert_eq!(c.input_tokens, Some(12));
    }
}
