//! The OpenInference conventions (Arize Phoenix's instrumentations, such as
//! openinference-instrumentation-openai): flattened messages
//! (`llm.input_messages.{i}.message.role`, `….content`,
//! `….contents.{j}.message_content.text`, `….tool_calls.{j}.tool_call.function.name`),
//! `input.value` / `output.value` (JSON when their `*.mime_type` says so),
//! `llm.prompt_template.*`, `llm.model_name`, `llm.token_count.*`, `tool.name`,
//! `session.id` and `user.id`.

use opentelemetry_proto::tonic::common::v1::{KeyValue, any_value::Value as Any};
use serde_json::{Map, Value};

use super::{
    SpanContent, attr, fill, system_messages,
    values::{get, int_attr, parse_json_text, structured, unflatten},
};

const INPUT_MESSAGES: &str = "llm.input_messages";
const OUTPUT_MESSAGES: &str = "llm.output_messages";
const INPUT_VALUE: &str = "input.value";
const INPUT_MIME: &str = "input.mime_type";
const OUTPUT_VALUE: &str = "output.value";
const OUTPUT_MIME: &str = "output.mime_type";
const SPAN_KIND: &str = "openinference.span.kind";
const MODEL: &str = "llm.model_name";
const PROMPT_TOKENS: &str = "llm.token_count.prompt";
const COMPLETION_TOKENS: &str = "llm.token_count.completion";
const TOOL_NAME: &str = "tool.name";
const TOOL_PARAMETERS: &str = "tool.parameters";
const PROMPT_TEMPLATE: &str = "llm.prompt_template";

pub(super) fn read(a: &[KeyValue], c: &mut SpanContent) {
    let input_messages = unflatten(a, INPUT_MESSAGES).map(messages);
    fill(&mut c.system, || system_messages(input_messages.as_ref()));
    fill(&mut c.input, || input_messages.or_else(|| value(a, INPUT_VALUE, INPUT_MIME)));
    fill(&mut c.output, || unflatten(a, OUTPUT_MESSAGES).map(messages).or_else(|| value(a, OUTPUT_VALUE, OUTPUT_MIME)));
    fill(&mut c.operation, || match get(a, SPAN_KIND) {
        Some(Any::StringValue(kind)) => Some(Value::String(kind.to_ascii_lowercase())),
        _ => None,
    });
    fill(&mut c.model, || get(a, MODEL).map(structured));
    fill(&mut c.input_tokens, || int_attr(a, PROMPT_TOKENS));
    fill(&mut c.output_tokens, || int_attr(a, COMPLETION_TOKENS));
    fill(&mut c.tool, || get(a, TOOL_NAME).map(structured));
    if let Some(v) = get(a, TOOL_PARAMETERS) {
        c.tool_call.entry("parameters").or_insert_with(|| structured(v));
    }
    fill(&mut c.prompt_template, || unflatten(a, PROMPT_TEMPLATE));
    fill(&mut c.session, || get(a, attr::SESSION_ID).map(structured));
    fill(&mut c.user, || get(a, attr::USER_ID).map(structured));
}

/// `input.value` as JSON when its MIME type says so (or it looks like JSON), else text.
fn value(a: &[KeyValue], key: &str, mime_key: &str) -> Option<Value> {
    let v = get(a, key)?;
    let json = matches!(get(a, mime_key), Some(Any::StringValue(m)) if m.contains("json"));
    Some(match v {
        Any::StringValue(s) if json => serde_json::from_str(s).unwrap_or_else(|_| Value::String(s.clone())),
        Any::StringValue(s) => parse_json_text(s),
        other => structured(other),
    })
}

/// `[{"message": {…}}, …]` as plain chat messages: the `message`,
/// `tool_call` and `message_content` wrappers of the flattened form dropped.
fn messages(v: Value) -> Value {
    match v {
        Value::Array(items) => Value::Array(items.into_iter().map(unwrap).collect()),
        other => unwrap(other),
    }
}

fn unwrap(v: Value) -> Value {
    match v {
        Value::Object(map) if map.len() == 1 => {
            let (key, inner) = map.into_iter().next().unwrap_or_default();
            if matches!(key.as_str(), "message" | "tool_call" | "message_content") {
                unwrap(inner)
            } else {
                let mut one = Map::new();
                one.insert(key, unwrap(inner));
                Value::Object(one)
            }
        }
        Value::Object(map) => Value::Object(map.into_iter().map(|(k, v)| (k, unwrap(v))).collect()),
        Value::Array(items) => Value::Array(items.into_iter().map(unwrap).collect()),
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::otlp::mapping::values::string_kv as s;
    use serde_json::json;

    #[test]
    fn flattened_messages_become_chat_messages() {
        let attrs = vec![
            s("llm.input_messages.0.message.role", "system"),
            s("llm.input_messages.0.message.content", "be brief"),
            s("llm.input_messages.1.message.role", "user"),
            s("llm.input_messages.1.message.contents.0.message_content.type", "text"),
            s("llm.input_messages.1.message.contents.0.message_content.text", "where is order 7?"),
            s("llm.output_messages.0.message.role", "assistant"),
            s("llm.output_messages.0.message.tool_calls.0.tool_call.function.name", "lookup"),
            s("llm.output_messages.0.message.tool_calls.0.tool_call.function.arguments", r#"{"id": 7}"#),
            s("input.value", r#"{"messages": []}"#),
            s("input.mime_type", "application/json"),
            s("openinference.span.kind", "LLM"),
            s("session.id", "conv-1"),
        ];
        let mut c = SpanContent::default();
        read(&attrs, &mut c);
        assert_eq!(
            c.input.unwrap(),
            json!([
                {"role": "system", "content": "be brief"},
                {"role": "user", "contents": [{"type": "text", "text": "where is order 7?"}]}
            ])
        );
        assert_eq!(c.system.unwrap(), json!([{"role": "system", "content": "be brief"}]));
        assert_eq!(
            c.output.unwrap(),
            json!([{"role": "assistant", "tool_calls": [{"function": {"name": "lookup", "arguments": {"id": 7}}}]}])
        );
        assert_eq!(c.operation.unwrap(), "llm");
        assert_eq!(c.session.unwrap(), "conv-1");
    }

    #[test]
    fn values_are_json_only_when_their_mime_type_or_shape_says_so() {
        let mut c = SpanContent::default();
        read(
            &[s("input.value", "{not json"), s("input.mime_type", "application/json"), s("output.value", "42")],
            &mut c,
        );
        assert_eq!((c.input.unwrap(), c.output.unwrap()), (json!("{not json"), json!("42")));
    }
}
