//! Langfuse's OpenTelemetry attributes, as its SDKs (Python 3+, JS 4+) write
//! them: `langfuse.observation.input` / `.output` (JSON strings), the prompt
//! a generation ran with (`langfuse.observation.prompt.name` / `.version`, set
//! when a prompt fetched with `get_prompt` is linked), the model, usage
//! details and the observation type. `session.id` and `user.id` are read with
//! OpenInference's, which uses the same names.

use opentelemetry_proto::tonic::common::v1::KeyValue;
use serde_json::Value;

use super::{
    SpanContent, fill, system_messages,
    values::{get, structured},
};

pub(super) const PROMPT_NAME: &str = "langfuse.observation.prompt.name";
pub(super) const PROMPT_VERSION: &str = "langfuse.observation.prompt.version";
const INPUT: &str = "langfuse.observation.input";
const OUTPUT: &str = "langfuse.observation.output";
const MODEL: &str = "langfuse.observation.model.name";
const USAGE: &str = "langfuse.observation.usage_details";
const TYPE: &str = "langfuse.observation.type";

pub(super) fn read(a: &[KeyValue], c: &mut SpanContent) {
    let input = get(a, INPUT).map(structured);
    fill(&mut c.system, || system_messages(input.as_ref()));
    fill(&mut c.input, || input);
    fill(&mut c.output, || get(a, OUTPUT).map(structured));
    fill(&mut c.model, || get(a, MODEL).map(structured));
    fill(&mut c.operation, || get(a, TYPE).map(structured));
    // `{"input": 12, "output": 3, "total": 15}` (or OpenAI's names).
    if let Some(usage) = get(a, USAGE).map(structured) {
        let count = |keys: [&str; 2]| keys.iter().find_map(|k| usage.get(k).and_then(Value::as_i64));
        fill(&mut c.input_tokens, || count(["input", "prompt_tokens"]));
        fill(&mut c.output_tokens, || count(["output", "completion_tokens"]));
    }
}
