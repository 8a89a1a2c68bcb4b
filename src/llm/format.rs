//! What a backend accepts beyond plain chat, learned from its own answers:
//! which `response_format` shape holds an answer to its JSON schema, and how
//! many tokens its context window has.
//!
//! Structured outputs are asked for in OpenAI's shape first; a backend that
//! refuses it (llama-cpp-python's server answers "Input should be 'text' or
//! 'json_object'") is asked with `json_object` and a `schema`, then with bare
//! `json_object`, then with nothing. The first shape a backend takes is kept
//! for the life of the client and shown in `/metrics`.
//!
//! The context window is configured (`llm.context_tokens`), read from the
//! server's own description of itself (`super::slots`) or from the backend's
//! "context length exceeded" answer, which is never sent again as it was: the
//! caller fits the next request into the window. An answer saying the
//! server's *shared* context is full ([`cache_full`]) is another thing: the
//! request fits, the calls in flight together did not.

use std::sync::atomic::{AtomicU8, AtomicU32, Ordering};

use serde_json::{Value, json};

use super::{AnswerSchema, OutputFormat, SchemaLengths};

/// The output-format ladder of one backend.
#[derive(Debug)]
pub struct FormatLadder {
    /// Index into [`OutputFormat::ALL`] of the best shape not yet refused.
    rung: AtomicU8,
}

impl Default for FormatLadder {
    fn default() -> Self {
        let ladder = Self { rung: AtomicU8::new(0) };
        ladder.publish();
        ladder
    }
}

impl FormatLadder {
    /// The shape a request asks for: the best one the backend has not refused,
    /// but never more than the request needs (no schema: at most `json_object`).
    pub fn format_for(&self, schema: Option<&AnswerSchema>, json: bool) -> OutputFormat {
        let best = self.current();
        match (schema, json) {
            (Some(_), _) => best,
            (None, true) => best.max(OutputFormat::JsonObject),
            (None, false) => OutputFormat::Plain,
        }
    }

    /// The best shape the backend has not refused.
    pub fn current(&self) -> OutputFormat {
        let i = usize::from(self.rung.load(Ordering::Relaxed)).min(OutputFormat::ALL.len() - 1);
        OutputFormat::ALL[i]
    }

    /// The backend refused `used`: step below it (once, however many calls saw
    /// the refusal at the same time). Returns false when there is nothing lower.
    pub fn refused(&self, used: OutputFormat) -> bool {
        let Some(i) = OutputFormat::ALL.iter().position(|f| *f == used) else { return false };
        if i + 1 >= OutputFormat::ALL.len() {
            return false;
        }
        let next = (i + 1) as u8;
        let before = self.rung.fetch_max(next, Ordering::Relaxed);
        if before < next {
            tracing::warn!(
                refused = used.as_str(),
                now = OutputFormat::ALL[usize::from(next)].as_str(),
                "the LLM backend refused this response_format; asking in the next shape from now on"
            );
            self.publish();
        }
        true
    }

    /// Shows the current shape in `/metrics` (also after a metrics recorder
    /// was installed later than the client was built).
    pub fn publish(&self) {
        let current = self.current();
        for f in OutputFormat::ALL {
            metrics::gauge!("combee_llm_output_format", "format" => f.as_str()).set(if f == current {
                1.0
            } else {
                0.0
            });
        }
    }
}

/// The `response_format` value of a request in shape `format`, the schema's
/// length keywords kept where `lengths` says the server holds answers to them.
pub fn response_format(format: OutputFormat, schema: Option<&AnswerSchema>, lengths: SchemaLengths) -> Option<Value> {
    match (format, schema) {
        (OutputFormat::Plain, _) => None,
        (OutputFormat::JsonSchema, Some(s)) => Some(json!({
            "type": "json_schema",
            "json_schema": {"name": s.name, "schema": s.closed_schema(lengths), "strict": true},
        })),
        (OutputFormat::JsonObjectSchema, Some(s)) => Some(json!({"type": "json_object", "schema": s.schema})),
        _ => Some(json!({"type": "json_object"})),
    }
}

/// Whether an error answer refuses the `response_format` itself, not the rest
/// of the request: a 400 or 422 that names it, or a 500 that quotes the
/// validation of it (llama-cpp-python's server answers OpenAI's shape with
/// `500 … Input should be 'text' or 'json_object'`).
pub fn refuses_response_format(status: u16, message: &str) -> bool {
    let m = message.to_ascii_lowercase();
    let names = |needles: &[&str]| needles.iter().any(|needle| m.contains(needle));
    match status {
        400 | 415 | 422 | 501 => {
            names(&["response_format", "json_schema", "json_object", "'text' or", "structured output", "schema"])
        }
        500 => names(&["response_format", "json_schema", "'text' or 'json_object'"]),
        _ => false,
    }
}

/// The context window an error answer names, when it says the request was too
/// long for it: `Some(None)` when it says so without a number.
pub fn context_exceeded(status: u16, message: &str) -> Option<Option<u32>> {
    if !matches!(status, 400 | 413 | 422 | 500) {
        return None;
    }
    let m = message.to_ascii_lowercase();
    let said = [
        "context window",
        "context length",
        "maximum context",
        "context_length_exceeded",
        "exceeds the context",
        "too many tokens",
        "prompt is too long",
        "n_ctx",
    ]
    .iter()
    .any(|needle| m.contains(needle));
    if !said {
        return None;
    }
    // "exceed context window of 8192", "maximum context length is 8192 tokens", "n_ctx: 8192".
    for marker in ["context window of", "maximum context length is", "context length of", "n_ctx", "context size"] {
        if let Some(at) = m.find(marker) {
            let digits: String = m[at + marker.len()..]
                .chars()
                .skip_while(|c| !c.is_ascii_digit())
                .take_while(char::is_ascii_digit)
                .collect();
            if let Ok(n) = digits.parse::<u32>()
                && n >= 256
            {
                return Some(Some(n));
            }
        }
    }
    Some(None)
}

/// Whether an error answer says the server's context (its KV cache, which its
/// slots share) filled up while it served the calls in flight: llama.cpp's
/// server answers every call it was working on `500 "Context size has been
/// exceeded."` (older builds: "failed to find free space in the KV cache"),
/// Hugging Face's TGI "Out of available cache blocks". Not a request too
/// long for the window (see [`context_exceeded`]): fewer calls at once fit.
pub fn cache_full(status: u16, message: &str) -> bool {
    if !(400..=599).contains(&status) || status == 429 {
        return false;
    }
    let m = message.to_ascii_lowercase();
    [
        "context size has been exceeded",
        "free space in the kv cache",
        "out of available cache blocks",
        "kv cache is full",
    ]
    .iter()
    .any(|needle| m.contains(needle))
}

/// The context window of one backend, in tokens; 0 while unknown.
#[derive(Debug, Default)]
pub struct ContextWindow(AtomicU32);

impl ContextWindow {
    pub fn new(configured: u32) -> Self {
        let w = Self(AtomicU32::new(configured));
        w.publish();
        w
    }

    pub fn get(&self) -> Option<u32> {
        Some(self.0.load(Ordering::Relaxed)).filter(|n| *n > 0)
    }

    /// Learns the window from an error answer; a smaller window wins.
    pub fn learn(&self, tokens: u32) {
        let old = self.0.load(Ordering::Relaxed);
        if old == 0 || tokens < old {
            self.0.store(tokens, Ordering::Relaxed);
            tracing::info!(tokens, "learned the LLM backend's context window from its answer");
            self.publish();
        }
    }

    /// Without a number in the answer: the request did not fit, so the window
    /// is below its estimated size.
    pub fn learn_below(&self, request_tokens: u64) {
        let guess = u32::try_from(request_tokens.saturating_mul(3) / 4).unwrap_or(u32::MAX).max(512);
        self.learn(guess);
    }

    pub fn publish(&self) {
        metrics::gauge!("combee_llm_context_tokens").set(f64::from(self.0.load(Ordering::Relaxed)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schema() -> AnswerSchema {
        AnswerSchema::new(
            "answer",
            json!({"type": "object", "properties": {"a": {"type": "string", "maxLength": 10}}, "required": ["a"]}),
        )
    }

    #[test]
    fn the_ladder_steps_down_once_per_refusal_and_stays() {
        let l = FormatLadder::default();
        let s = schema();
        assert_eq!(l.format_for(Some(&s), true), OutputFormat::JsonSchema);
        assert_eq!(l.format_for(None, true), OutputFormat::JsonObject);
        assert_eq!(l.format_for(None, false), OutputFormat::Plain);
        assert!(l.refused(OutputFormat::JsonSchema));
        // A second call that saw the same refusal at the same time does not skip a rung.
        assert!(l.refused(OutputFormat::JsonSchema));
        assert_eq!(l.format_for(Some(&s), true), OutputFormat::JsonObjectSchema);
        assert!(l.refused(OutputFormat::JsonObjectSchema));
        assert!(l.refused(OutputFormat::JsonObject));
        assert_eq!(l.format_for(Some(&s), true), OutputFormat::Plain);
        assert_eq!(l.format_for(None, true), OutputFormat::Plain);
        assert!(!l.refused(OutputFormat::Plain));
    }

    #[test]
    fn each_shape_is_what_its_backends_take() {
        let s = schema();
        let openai = response_format(OutputFormat::JsonSchema, Some(&s), SchemaLengths::Left).unwrap();
        assert_eq!(openai["type"], "json_schema");
        assert_eq!(openai["json_schema"]["name"], "answer");
        assert_eq!(openai["json_schema"]["strict"], true);
        // Strict mode wants every object closed and no length keywords.
        assert_eq!(openai["json_schema"]["schema"]["additionalProperties"], false);
        assert!(openai["json_schema"]["schema"]["properties"]["a"].get("maxLength").is_none());
        // A server known to hold answers to lengths (llama.cpp's) gets them, in the same closed shape.
        let held = response_format(OutputFormat::JsonSchema, Some(&s), SchemaLengths::Kept).unwrap();
        assert_eq!(held["json_schema"]["schema"]["properties"]["a"]["maxLength"], 10);
        assert_eq!(held["json_schema"]["schema"]["additionalProperties"], false);
        let llama = response_format(OutputFormat::JsonObjectSchema, Some(&s), SchemaLengths::Left).unwrap();
        assert_eq!(llama, json!({"type": "json_object", "schema": s.schema}));
        assert_eq!(
            response_format(OutputFormat::JsonObject, Some(&s), SchemaLengths::Left).unwrap(),
            json!({"type": "json_object"})
        );
        assert_eq!(response_format(OutputFormat::Plain, Some(&s), SchemaLengths::Left), None);
    }

    #[test]
    fn refusals_of_the_format_are_told_from_other_errors() {
        let llama = r#"{"detail":[{"type":"literal_error","loc":["body","response_format","type"],"msg":"Input should be 'text' or 'json_object'"}]}"#;
        assert!(refuses_response_format(422, llama));
        assert!(refuses_response_format(
            400,
            "Invalid parameter: 'response_format' of type 'json_schema' is not supported with this model."
        ));
        assert!(!refuses_response_format(400, "Requested tokens (9000) exceed context window of 8192"));
        assert!(!refuses_response_format(401, "response_format"));
        // llama-cpp-python 0.3.36 answers OpenAI's shape with a 500.
        let llama500 = r#"{"error":{"message":"1 validation error: {'type': 'literal_error', 'loc': ('body', 'response_format', 'type'), 'msg': "Input should be 'text' or 'json_object'"}","type":"internal_server_error"}}"#;
        assert!(refuses_response_format(500, llama500));
        assert!(!refuses_response_format(500, "CUDA out of memory while computing the schema"));
        assert!(!refuses_response_format(503, "response_format"));
        assert!(!refuses_response_format(404, "model not found"));
    }

    #[test]
    fn a_full_shared_context_is_told_from_a_request_too_long() {
        // llama.cpp's llama-server (the vendored sources of llama-cpp-python 0.3.36), to every call in flight.
        let llama = r#"{"error":{"code":500,"message":"Context size has been exceeded.","type":"server_error"}}"#;
        assert!(cache_full(500, llama));
        assert_eq!(context_exceeded(500, llama), None, "the request itself fits");
        assert!(cache_full(500, "update_slots : failed to find free space in the KV cache"));
        assert!(cache_full(
            500,
            "Request failed during generation: Server error: Out of available cache blocks: asked 107, only 4 free blocks"
        ));
        assert!(!cache_full(500, "CUDA out of memory"));
        assert!(!cache_full(429, "Context size has been exceeded."));
        assert!(!cache_full(200, "Context size has been exceeded."));
    }

    #[test]
    fn the_context_window_is_read_from_the_backends_words() {
        assert_eq!(context_exceeded(400, "Requested tokens (9000) exceed context window of 8192"), Some(Some(8192)));
        assert_eq!(
            context_exceeded(
                400,
                "This model's maximum context length is 16385 tokens. However, your messages resulted in 17000 tokens."
            ),
            Some(Some(16385))
        );
        assert_eq!(
            context_exceeded(400, r#"{"error":{"code":"context_length_exceeded","message":"too long"}}"#),
            Some(None)
        );
        assert_eq!(
            context_exceeded(400, "the request exceeds the available context size, n_ctx: 4096"),
            Some(Some(4096))
        );
        assert_eq!(context_exceeded(400, "Input should be 'text' or 'json_object'"), None);
        // llama.cpp's server, a request longer than a slot's context (its words and its shape).
        let llama = r#"{"error":{"code":400,"message":"request (9000 tokens) exceeds the available context size (8192 tokens), try increasing it","type":"exceed_context_size_error","n_prompt_tokens":9000,"n_ctx":8192}}"#;
        assert_eq!(context_exceeded(400, llama), Some(Some(8192)));
        assert!(!cache_full(400, llama), "one request too long is not a full shared cache");
        assert_eq!(context_exceeded(429, "context window of 8192"), None);
        let w = ContextWindow::new(0);
        assert_eq!(w.get(), None);
        w.learn(8192);
        w.learn(16000);
        assert_eq!(w.get(), Some(8192));
        w.learn_below(4000);
        assert_eq!(w.get(), Some(3000));
    }
}
