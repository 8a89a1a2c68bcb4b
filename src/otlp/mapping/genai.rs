//! The OpenTelemetry GenAI semantic conventions, current and older: messages
//! as span attributes (`gen_ai.input.messages`, JSON strings or structured
//! values), on an event (`gen_ai.client.inference.operation.details`, as a
//! span event or a log record), the older whole-prompt and indexed attributes
//! (`gen_ai.prompt.{i}.{field}`, as traceloop's instrumentations write them),
//! the per-message events (`gen_ai.user.message`, `gen_ai.choice`, …), and
//! evaluation results (`gen_ai.evaluation.result`), which become feedback.

use opentelemetry_proto::tonic::{common::v1::KeyValue, trace::v1::Span};
use serde_json::{Map, Value, json};

use super::{
    SpanContent, attr, fill,
    values::{any_to_json, as_f64, first_structured, get, int_attr, structured},
};

/// Events that carry one input message each, and the role they imply.
const INPUT_MESSAGE_EVENTS: [(&str, &str); 4] = [
    ("gen_ai.system.message", "system"),
    ("gen_ai.user.message", "user"),
    ("gen_ai.assistant.message", "assistant"),
    ("gen_ai.tool.message", "tool"),
];
const CHOICE_EVENT: &str = "gen_ai.choice";
/// Attributes of message events that describe the emitter, not the message.
const EVENT_NOISE: [&str; 3] = ["gen_ai.system", "gen_ai.provider.name", "event.name"];

pub(super) fn read(span: &Span, c: &mut SpanContent) {
    let a = span.attributes.as_slice();
    let mut system = get(a, attr::SYSTEM_INSTRUCTIONS).map(structured);
    let mut input = get(a, attr::INPUT_MESSAGES).map(structured);
    let mut output = get(a, attr::OUTPUT_MESSAGES).map(structured);
    let mut event_inputs = Vec::new();
    let mut event_outputs = Vec::new();
    for ev in &span.events {
        let ea = ev.attributes.as_slice();
        if let Some((_, role)) = INPUT_MESSAGE_EVENTS.iter().find(|(name, _)| *name == ev.name) {
            event_inputs.push(event_message(ea, Some(role)));
        } else if ev.name == CHOICE_EVENT {
            event_outputs.push(event_message(ea, None));
        } else if ev.name == attr::EVALUATION_EVENT {
            evaluation(ea, c);
        }
        input = input.or_else(|| get(ea, attr::INPUT_MESSAGES).map(structured));
        output = output.or_else(|| get(ea, attr::OUTPUT_MESSAGES).map(structured));
        system = system.or_else(|| get(ea, attr::SYSTEM_INSTRUCTIONS).map(structured));
    }
    let input = input
        .or_else(|| get(a, attr::LEGACY_PROMPT).map(structured))
        .or_else(|| indexed_messages(a, attr::LEGACY_PROMPT))
        .or_else(|| (!event_inputs.is_empty()).then_some(Value::Array(event_inputs)));
    let output = output
        .or_else(|| get(a, attr::LEGACY_COMPLETION).map(structured))
        .or_else(|| indexed_messages(a, attr::LEGACY_COMPLETION))
        .or_else(|| (!event_outputs.is_empty()).then_some(Value::Array(event_outputs)));
    fill(&mut c.system, || system);
    fill(&mut c.input, || input);
    fill(&mut c.output, || output);
    fill(&mut c.operation, || get(a, attr::OPERATION).map(structured));
    fill(&mut c.model, || first_structured(a, &[attr::RESPONSE_MODEL, attr::REQUEST_MODEL]));
    fill(&mut c.tool, || get(a, attr::TOOL_NAME).map(structured));
    for (name, key) in
        [("id", attr::TOOL_CALL_ID), ("arguments", attr::TOOL_CALL_ARGUMENTS), ("result", attr::TOOL_CALL_RESULT)]
    {
        if let Some(v) = get(a, key) {
            c.tool_call.entry(name).or_insert_with(|| structured(v));
        }
    }
    fill(&mut c.input_tokens, || int_attr(a, attr::INPUT_TOKENS).or_else(|| int_attr(a, attr::LEGACY_INPUT_TOKENS)));
    fill(&mut c.output_tokens, || int_attr(a, attr::OUTPUT_TOKENS).or_else(|| int_attr(a, attr::LEGACY_OUTPUT_TOKENS)));
    fill(&mut c.conversation, || get(a, attr::CONVERSATION_ID).map(structured));
}

/// `gen_ai.prompt.{i}.{field}` attributes gathered into `[{field: …}, …]` in index order.
fn indexed_messages(attrs: &[KeyValue], prefix: &str) -> Option<Value> {
    let mut by_index: std::collections::BTreeMap<u64, Map<String, Value>> = Default::default();
    for kv in attrs {
        let Some(rest) = kv.key.strip_prefix(prefix).and_then(|r| r.strip_prefix('.')) else { continue };
        let Some((index, field)) = rest.split_once('.') else { continue };
        let (Ok(index), Some(v)) = (index.parse::<u64>(), kv.value.as_ref().and_then(|v| v.value.as_ref())) else {
            continue;
        };
        // Message text stays text even when it happens to be JSON.
        let value = if field == "content" { any_to_json(v, 0) } else { structured(v) };
        by_index.entry(index).or_default().insert(field.to_owned(), value);
    }
    (!by_index.is_empty()).then(|| Value::Array(by_index.into_values().map(Value::Object).collect()))
}

fn event_message(attrs: &[KeyValue], role: Option<&str>) -> Value {
    let mut msg: Map<String, Value> = Map::new();
    for kv in attrs.iter().filter(|kv| !EVENT_NOISE.contains(&kv.key.as_str())) {
        if let Some(v) = kv.value.as_ref().and_then(|v| v.value.as_ref()) {
            // The first of a repeated key wins (a log record's body before its
            // attributes); message text stays text even when it is JSON.
            let value = if kv.key == "content" { any_to_json(v, 0) } else { structured(v) };
            msg.entry(kv.key.clone()).or_insert(value);
        }
    }
    if let Some(role) = role {
        msg.entry("role").or_insert_with(|| Value::String(role.to_owned()));
    }
    Value::Object(msg)
}

/// Labels that say pass or fail without doubt; any other label leaves
/// `success` unset (it is still kept with the evaluation).
fn label_success(label: &str) -> Option<bool> {
    match label.trim().to_ascii_lowercase().as_str() {
        "pass" | "passed" | "success" | "succeeded" | "correct" | "true" | "yes" | "good" => Some(true),
        "fail" | "failed" | "failure" | "incorrect" | "wrong" | "false" | "no" | "bad" => Some(false),
        _ => None,
    }
}

/// A `gen_ai.evaluation.result` event: its score, label and explanation
/// become feedback (a later evaluation replaces the fields it sets), and the
/// whole result is kept in the trace's metadata.
fn evaluation(a: &[KeyValue], c: &mut SpanContent) {
    let name = get(a, "gen_ai.evaluation.name").map(structured);
    let score = get(a, "gen_ai.evaluation.score.value").and_then(as_f64);
    let label = get(a, "gen_ai.evaluation.score.label").map(structured);
    let explanation = get(a, "gen_ai.evaluation.explanation").map(structured);
    let success = label.as_ref().and_then(Value::as_str).and_then(label_success);
    let comment = explanation.as_ref().and_then(Value::as_str).map(str::to_owned);
    c.evaluated = std::mem::take(&mut c.evaluated).merged(crate::domain::Feedback {
        score,
        success,
        comment,
        ..Default::default()
    });
    let mut kept = Map::new();
    for (k, v) in [("name", name), ("score", score.map(|s| json!(s))), ("label", label), ("explanation", explanation)] {
        if let Some(v) = v {
            kept.insert(k.into(), v);
        }
    }
    c.evaluations.push(Value::Object(kept));
}

#[cfg(test)]
mod tests {
    use super::label_success;

    #[test]
    fn only_unambiguous_labels_say_success() {
        assert_eq!(label_success("PASS"), Some(true));
        assert_eq!(label_success(" incorrect "), Some(false));
        assert_eq!(label_success("relevant"), None);
        assert_eq!(label_success("3 stars"), None);
    }
}
