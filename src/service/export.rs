//! Dataset export: what combee collected, as JSON Lines a training pipeline
//! reads — combee's own trace records, chat fine-tuning records (`messages`:
//! the version's system prompt, the run's turns, the answer), or reward
//! records for RL and preference tuning (`prompt`, `completion`, `reward`,
//! `version`). Filtered by version (or the version a label points at now),
//! time and reward; read from the store a page at a time and written as it is
//! read, so an export of any size streams in constant memory.
//!
//! A trace's reward is its `feedback.score`, else 1 for `success: true` and
//! 0 for `false`, else none. Chat and reward records need the version the
//! trace ran with (its system prompt) and an output; reward records need a
//! reward too: traces without them are left out of those shapes.

use std::collections::HashMap;

use axum::body::Bytes;
use chrono::{DateTime, Utc};
use futures_util::{Stream, StreamExt, stream};
use serde::Deserialize;
use serde_json::{Map, Value, json};
use utoipa::{IntoParams, ToSchema};
use uuid::Uuid;

use super::{AppState, ServiceError, ServiceResult};
use crate::{
    domain::{Feedback, LabelName, PromptName, Trace, label::Selector},
    store::ExportQuery,
};

/// Traces read from the store per page.
const PAGE: u32 = 500;
/// System prompts kept while exporting (one per version met); past this the
/// cache starts again, so memory stays bounded however many versions there are.
const MAX_CACHED_VERSIONS: usize = 64;

/// The record shape of an export.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum ExportFormat {
    /// combee's trace records, as `GET /v1/traces/{id}` returns them, with their `reward`.
    #[default]
    Combee,
    /// `{"messages": [system, …turns, assistant answer]}` for chat fine-tuning.
    Chat,
    /// `{"prompt", "completion", "reward", "success", "version", "prompt_name", "trace_id"}`.
    Reward,
}

/// What to export: the export route's query parameters, as they are.
#[derive(Debug, Clone, Default, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ExportRequest {
    /// `combee` (default): trace records with their `reward`; `chat`: `{"messages": […]}`
    /// for chat fine-tuning; `reward`: `{"prompt", "completion", "reward", …}` for RL and
    /// preference tuning.
    #[param(inline)]
    pub format: Option<ExportFormat>,
    /// Only traces that ran with this version.
    pub version: Option<i64>,
    /// Only traces that ran with the version this label points at now; with
    /// `version` too, that version only while the label points at it (else 404).
    pub label: Option<String>,
    /// Only traces received at or after this time (RFC 3339).
    pub since: Option<DateTime<Utc>>,
    /// Only traces received before this time (RFC 3339).
    pub until: Option<DateTime<Utc>>,
    /// Only traces with a reward of at least this.
    pub min_reward: Option<f64>,
    /// Only traces with a reward of at most this.
    pub max_reward: Option<f64>,
}

/// A trace's reward: its score, else its success as 1 or 0.
pub fn reward(f: &Feedback) -> Option<f64> {
    f.score.or(f.success.map(|s| if s { 1.0 } else { 0.0 }))
}

/// An export under way: [`Exporter::next_chunk`] reads the next page and
/// returns its records as JSON Lines.
pub struct Exporter {
    st: AppState,
    query: ExportQuery,
    format: ExportFormat,
    rewards: (Option<f64>, Option<f64>),
    after: Option<Uuid>,
    done: bool,
    systems: HashMap<i64, Option<String>>,
}

/// Checks the request and prepares the export: 404 for an unknown prompt or
/// label (or a label that does not point at the `version` also given).
pub async fn start(st: &AppState, name: &PromptName, req: ExportRequest) -> ServiceResult<Exporter> {
    let name = name.clone();
    if st.store.get_prompt(&name).await?.is_none() {
        return Err(ServiceError::not_found(format_args!("prompt {name:?}")));
    }
    // Filters that cannot both hold (`min_reward` above `max_reward`, `since`
    // not before `until`) simply match nothing, as in `GET /v1/traces`.
    if [req.min_reward, req.max_reward].into_iter().flatten().any(|r| !r.is_finite()) {
        return Err(ServiceError::BadRequest("`min_reward` and `max_reward` must be finite numbers".into()));
    }
    let by_label = |label: &str| -> ServiceResult<Selector> {
        if label == LabelName::LATEST {
            return Ok(Selector::Latest);
        }
        LabelName::parse(label).map(Selector::Label).map_err(|e| ServiceError::BadRequest(e.to_string()))
    };
    let version = match (req.version, req.label.as_deref()) {
        (Some(v), _) if v < 1 => return Err(ServiceError::BadRequest("`version` must be at least 1".into())),
        (Some(v), None) => Some(v),
        (v, Some(label)) => {
            let resolved = st.store.resolve(&name, &by_label(label)?).await?;
            let at = resolved.map(|r| r.version.number);
            match (at, v) {
                (None, _) => return Err(ServiceError::not_found(format_args!("label {label:?} of prompt {name:?}"))),
                // Both: that version, only while the label points at it (as `GET /v1/prompts/{name}`).
                (Some(at), Some(v)) if at != v => {
                    return Err(ServiceError::NotFound(format!("label {label:?} does not point at version {v}")));
                }
                (Some(at), _) => Some(at),
            }
        }
        (None, None) => None,
    };
    Ok(Exporter {
        st: st.clone(),
        query: ExportQuery { prompt: name, version, since: req.since, until: req.until },
        format: req.format.unwrap_or_default(),
        rewards: (req.min_reward, req.max_reward),
        after: None,
        done: false,
        systems: HashMap::new(),
    })
}

impl Exporter {
    /// The records of the next page that has any, as JSON Lines; `None` at the end.
    pub async fn next_chunk(&mut self) -> ServiceResult<Option<Bytes>> {
        while !self.done {
            let page = self.st.store.export_page(&self.query, self.after, PAGE).await?;
            self.done = page.len() < PAGE as usize;
            let Some(last) = page.last() else { break };
            self.after = Some(last.id);
            let mut out = Vec::new();
            for trace in &page {
                if let Some(record) = self.record(trace).await? {
                    serde_json::to_writer(&mut out, &record).map_err(|e| ServiceError::Internal(e.into()))?;
                    out.push(b'\n');
                }
            }
            if !out.is_empty() {
                return Ok(Some(Bytes::from(out)));
            }
        }
        Ok(None)
    }

    /// The export as a stream of chunks, `first` (already read, so that a
    /// failure before any output is still an error answer) leading. A failure
    /// later ends the stream with an error, so the reader sees a cut-off
    /// download rather than a short file that looks complete.
    pub fn into_stream(self, first: Option<Bytes>) -> impl Stream<Item = Result<Bytes, std::io::Error>> + Send {
        let head = stream::iter(first.map(Ok));
        let rest = stream::unfold(Some(self), |state| async move {
            let mut exporter = state?;
            match exporter.next_chunk().await {
                Ok(Some(chunk)) => Some((Ok(chunk), Some(exporter))),
                Ok(None) => None,
                Err(e) => {
                    tracing::error!(error = %e, prompt = %exporter.query.prompt, "export stopped part-way");
                    Some((Err(std::io::Error::other("the export stopped part-way; run it again")), None))
                }
            }
        });
        head.chain(rest)
    }

    async fn record(&mut self, t: &Trace) -> ServiceResult<Option<Value>> {
        let reward = reward(&t.feedback);
        let (lo, hi) = self.rewards;
        if (lo.is_some() || hi.is_some())
            && !reward.is_some_and(|r| lo.is_none_or(|lo| r >= lo) && hi.is_none_or(|hi| r <= hi))
        {
            return Ok(None);
        }
        if self.format == ExportFormat::Combee {
            let mut v = serde_json::to_value(t).map_err(|e| ServiceError::Internal(e.into()))?;
            v["reward"] = json!(reward);
            return Ok(Some(v));
        }
        let Some(version) = t.prompt_version else { return Ok(None) };
        let Some(system) = self.system(version).await? else { return Ok(None) };
        Ok(match self.format {
            ExportFormat::Chat => chat_record(&system, t),
            _ => reward.and_then(|r| reward_record(&system, t, r)),
        })
    }

    /// The rendered text of a version (`None` when it is gone), cached.
    async fn system(&mut self, version: i64) -> ServiceResult<Option<String>> {
        if let Some(text) = self.systems.get(&version) {
            return Ok(text.clone());
        }
        if self.systems.len() >= MAX_CACHED_VERSIONS {
            self.systems.clear();
        }
        let resolved = self.st.store.resolve(&self.query.prompt, &Selector::Version(version)).await?;
        let text = resolved.map(|r| r.version.content.render());
        self.systems.insert(version, text.clone());
        Ok(text)
    }
}

/// `{"messages": [system, …task turns, …trajectory turns, answer]}`, or
/// `None` without an answer.
pub fn chat_record(system: &str, t: &Trace) -> Option<Value> {
    let answer = answer(&t.output)?;
    let mut messages = vec![json!({"role": "system", "content": system})];
    messages.extend(task_turns(&t.input));
    messages.extend(trajectory_turns(&t.trajectory, &answer));
    messages.push(answer);
    Some(json!({ "messages": messages }))
}

/// A prompt (system and task turns) and its completion (the run's turns and
/// the answer) with the reward, or `None` without an answer.
pub fn reward_record(system: &str, t: &Trace, reward: f64) -> Option<Value> {
    let answer = answer(&t.output)?;
    let mut prompt = vec![json!({"role": "system", "content": system})];
    prompt.extend(task_turns(&t.input));
    let mut completion = trajectory_turns(&t.trajectory, &answer);
    completion.push(answer);
    Some(json!({
        "prompt": prompt,
        "completion": completion,
        "reward": reward,
        "success": t.feedback.success,
        "version": t.prompt_version,
        "prompt_name": t.prompt.as_str(),
        "trace_id": t.id,
    }))
}

/// The text of message content: a string as it is; the text parts of a part
/// list (`{"type": "text", "text" | "content": …}`) joined by newlines;
/// anything else as JSON.
pub fn content_text(content: &Value) -> String {
    match content {
        Value::String(s) => s.clone(),
        Value::Null => String::new(),
        Value::Array(parts) => {
            let texts: Vec<&str> = parts
                .iter()
                .filter_map(|p| match p {
                    Value::String(s) => Some(s.as_str()),
                    Value::Object(o) if o.get("type").and_then(Value::as_str).is_none_or(|t| t == "text") => {
                        o.get("text").or_else(|| o.get("content")).and_then(Value::as_str)
                    }
                    _ => None,
                })
                .collect();
            if texts.is_empty() { content.to_string() } else { texts.join("\n") }
        }
        other => other.to_string(),
    }
}

/// A chat message in the plain OpenAI shape (`role`, text `content`, and the
/// tool fields when present) from the shapes instrumentations record:
/// `content` strings or part lists, GenAI `parts`, OpenInference `contents`,
/// or a choice wrapping a `message`. `None` for anything that is no message.
pub fn message(v: &Value) -> Option<Value> {
    let o = v.as_object()?;
    if !o.contains_key("role")
        && let Some(inner) = o.get("message")
    {
        return message(inner);
    }
    let role = o.get("role")?.as_str()?;
    let content = o.get("content").or_else(|| o.get("parts")).or_else(|| o.get("contents")).unwrap_or(&Value::Null);
    let mut out = Map::new();
    out.insert("role".into(), json!(role));
    out.insert("content".into(), json!(content_text(content)));
    for key in ["tool_calls", "tool_call_id", "name"] {
        if let Some(v) = o.get(key).filter(|v| !v.is_null()) {
            out.insert(key.into(), v.clone());
        }
    }
    Some(Value::Object(out))
}

/// The task's turns without the system prompt: a message list as messages,
/// any other input as one user message (text, or JSON for structured input).
pub fn task_turns(input: &Value) -> Vec<Value> {
    if let Value::Array(items) = input {
        let messages: Vec<Value> = items.iter().filter_map(message).collect();
        if !messages.is_empty() && messages.len() == items.len() {
            return messages.into_iter().filter(|m| m["role"] != "system").collect();
        }
    }
    vec![json!({"role": "user", "content": content_text(input)})]
}

/// The run's own turns from its trajectory — the steps that are messages
/// (spans mapped from OpenTelemetry are not) — without a last one that
/// repeats the answer.
pub fn trajectory_turns(trajectory: &Value, answer: &Value) -> Vec<Value> {
    let Value::Array(items) = trajectory else { return Vec::new() };
    let mut turns: Vec<Value> = items
        .iter()
        .filter_map(message)
        .filter(|m| matches!(m["role"].as_str(), Some("assistant" | "tool" | "user")))
        .collect();
    if turns.last().is_some_and(|last| last["role"] == "assistant" && last["content"] == answer["content"]) {
        turns.pop();
    }
    turns
}

/// The final answer as an assistant message: a message (or choice) as it is,
/// the last assistant message of a list, any other output as text or JSON.
/// `None` when there is no output.
pub fn answer(output: &Value) -> Option<Value> {
    let assistant = |m: Value| (m["role"] == "assistant").then_some(m);
    match output {
        Value::Null => None,
        Value::Array(items) => items
            .iter()
            .rev()
            .find_map(|v| message(v).and_then(assistant))
            .or_else(|| Some(json!({"role": "assistant", "content": content_text(output)}))),
        Value::Object(_) => message(output)
            .and_then(assistant)
            .or_else(|| Some(json!({"role": "assistant", "content": output.to_string()}))),
        other => Some(json!({"role": "assistant", "content": content_text(other)})),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trace(input: Value, trajectory: Value, output: Value, feedback: Feedback) -> Trace {
        let mut t = Trace::pending(PromptName::new("default", "p").unwrap(), input, trajectory, output, feedback);
        t.prompt_version = Some(2);
        t
    }

    #[test]
    fn rewards_come_from_the_score_else_success() {
        assert_eq!(reward(&Feedback { score: Some(0.3), success: Some(true), ..Default::default() }), Some(0.3));
        assert_eq!(reward(&Feedback { success: Some(false), ..Default::default() }), Some(0.0));
        assert_eq!(reward(&Feedback::default()), None);
    }

    #[test]
    fn a_posted_trace_becomes_a_chat_record() {
        let t = trace(
            json!({"question": "How do I reset my password?"}),
            json!([{"role": "assistant", "content": "Go to Settings > Security."}]),
            json!("Go to Settings > Security."),
            Feedback::default(),
        );
        assert_eq!(
            chat_record("You are a support agent.", &t).unwrap(),
            json!({"messages": [
                {"role": "system", "content": "You are a support agent."},
                {"role": "user", "content": "{\"question\":\"How do I reset my password?\"}"},
                {"role": "assistant", "content": "Go to Settings > Security."},
            ]})
        );
    }

    #[test]
    fn an_otlp_trace_with_tool_turns_becomes_a_reward_record() {
        // The shapes the OTLP mapping stores: GenAI parts, OTel steps, a choice.
        let t = trace(
            json!([{"role": "user", "parts": [{"type": "text", "content": "where is order 7?"}]}]),
            json!([
                {"name": "chat", "span_id": "01", "offset_ms": 0.0},
                {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "function": {"name": "lookup"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "shipped"},
            ]),
            json!([{"index": 0, "message": {"role": "assistant", "content": "It shipped."}}]),
            Feedback { success: Some(true), ..Default::default() },
        );
        let r = reward_record("sys", &t, 1.0).unwrap();
        assert_eq!(
            r["prompt"],
            json!([{"role": "system", "content": "sys"}, {"role": "user", "content": "where is order 7?"}])
        );
        assert_eq!(
            r["completion"],
            json!([
                {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "function": {"name": "lookup"}}]},
                {"role": "tool", "content": "shipped", "tool_call_id": "c1"},
                {"role": "assistant", "content": "It shipped."},
            ])
        );
        assert_eq!(
            (r["reward"].as_f64(), r["success"].as_bool(), r["version"].as_i64()),
            (Some(1.0), Some(true), Some(2))
        );
        let no_output = trace(json!("q"), json!([]), Value::Null, Feedback::default());
        assert_eq!(chat_record("sys", &no_output), None);
    }

    #[test]
    fn answers_and_contents_read_every_recorded_shape() {
        assert_eq!(answer(&json!({"x": 1})).unwrap()["content"], "{\"x\":1}");
        assert_eq!(
            answer(&json!({"role": "assistant", "contents": [{"type": "text", "text": "hi"}]})).unwrap()["content"],
            "hi"
        );
        assert_eq!(answer(&json!([1, 2])).unwrap()["content"], "[1,2]");
        assert_eq!(content_text(&json!([{"type": "image", "url": "x"}])), "[{\"type\":\"image\",\"url\":\"x\"}]");
        assert_eq!(task_turns(&json!("q")), vec![json!({"role": "user", "content": "q"})]);
        let messages = json!([{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]);
        assert_eq!(task_turns(&messages), vec![json!({"role": "user", "content": "q"})]);
    }
}
