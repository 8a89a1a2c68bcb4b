//! One call of the map or the reduce, end to end: build its messages, send
//! them with the answer's schema, read the answer tolerantly and check it (one
//! corrective retry), and build it again to fit when the backend says its
//! context window was exceeded. Each call is shown the part of the playbook
//! it needs ([`super::select`]) and its answer is checked against that part.

use super::decode::{
    DecodedAnswer, SourcedOp, decode_decisions, decode_instruction, decode_operations, decode_reflection,
};
use super::fit::{char_budget, chars_of, within};
use super::messages::{
    aggregate_messages_within, consolidate_playbook_messages, merge_rewrite_messages, reflect_messages_within,
};
use super::select::View;
use super::task::{Task, answer_schema};
use crate::domain::{DeltaOp, Reflection, Strategy, Trace, VersionContent};
use crate::learn::merge::dedupe::MergedOp;
use crate::learn::merge::level2::Decision;
use crate::llm::config::LlmConfig;
use crate::llm::{ChatMessage, LlmBackend, LlmCall, LlmError, client::chat_decoded};

/// Sends `task`'s call built by `messages` (given the characters the backend's
/// context window leaves, `None` while unknown) with the task's answer schema,
/// and reads the answer with `decode` (one corrective retry). A backend that
/// answers "context length exceeded" has taught the client its window: the
/// call is built again to fit it and sent once more, never as it was.
async fn ask<T, F>(
    backend: &dyn LlmBackend,
    cfg: &LlmConfig,
    (task, current): (Task, &VersionContent),
    calls: &mut Vec<LlmCall>,
    messages: impl Fn(Option<usize>) -> Vec<ChatMessage>,
    decode: F,
) -> Result<T, LlmError>
where
    T: Send,
    F: Fn(&str) -> Result<T, String> + Send + Sync,
{
    let role = task.role();
    let schema = answer_schema(task, current);
    let request = |budget| cfg.request(role, messages(budget), true).with_schema(schema.clone());
    let budget = char_budget(backend, cfg, role);
    match chat_decoded(backend, role, request(budget), calls, &decode).await {
        Err(LlmError::ContextExceeded { window, message }) => match char_budget(backend, cfg, role) {
            Some(fitted) if budget.is_none_or(|b| fitted < b) => {
                chat_decoded(backend, role, request(Some(fitted)), calls, &decode).await
            }
            _ => Err(LlmError::ContextExceeded { window, message }),
        },
        other => other,
    }
}

/// One reflector call: build, send, read tolerantly, validate (one corrective
/// retry). The reflection may only tag bullets the call was shown.
pub async fn reflect(
    backend: &dyn LlmBackend,
    cfg: &LlmConfig,
    trace: &Trace,
    current: &VersionContent,
    strategy: Strategy,
    calls: &mut Vec<LlmCall>,
) -> Result<DecodedAnswer<Reflection>, LlmError> {
    let view = View::for_trace(current, trace);
    let shown = &view.content;
    let messages = |budget| reflect_messages_within(trace, (shown, view.outline.as_deref()), strategy, budget);
    ask(backend, cfg, (Task::Reflect, shown), calls, messages, |t| decode_reflection(t, shown)).await
}

/// One playbook aggregator call over a group of reflections. Its UPDATEs and
/// REMOVEs may only name bullets the call was shown.
pub async fn aggregate_playbook(
    backend: &dyn LlmBackend,
    cfg: &LlmConfig,
    current: &VersionContent,
    reflections: &[Reflection],
    calls: &mut Vec<LlmCall>,
) -> Result<DecodedAnswer<Vec<SourcedOp>>, LlmError> {
    let n = reflections.len();
    let task = Task::AggregatePlaybook;
    let view = View::for_reflections(current, reflections);
    let shown = &view.content;
    let messages = |budget| aggregate_messages_within(task, (shown, view.outline.as_deref()), reflections, budget);
    ask(backend, cfg, (task, shown), calls, messages, |t| decode_operations(t, shown, n)).await
}

/// One rewrite aggregator call over a group of reflections.
pub async fn aggregate_rewrite(
    backend: &dyn LlmBackend,
    cfg: &LlmConfig,
    current: &VersionContent,
    reflections: &[Reflection],
    calls: &mut Vec<LlmCall>,
) -> Result<DecodedAnswer<String>, LlmError> {
    let task = Task::AggregateRewrite;
    let messages = |budget| aggregate_messages_within(task, (current, None), reflections, budget);
    ask(backend, cfg, (task, current), calls, messages, |t| decode_instruction(t, current)).await
}

/// The level-2 merge of the groups' versions of one conflicting passage (rewrite mode).
pub async fn merge_rewrite(
    backend: &dyn LlmBackend,
    cfg: &LlmConfig,
    current: &VersionContent,
    proposals: &[String],
    calls: &mut Vec<LlmCall>,
) -> Result<String, LlmError> {
    let messages = |_| merge_rewrite_messages(current, proposals);
    Ok(ask(backend, cfg, (Task::MergeRewrite, current), calls, messages, |t| decode_instruction(t, current))
        .await?
        .value)
}

/// One level-2 consolidation call (playbook mode, `reduce = "llm"`): the
/// decisions on the numbered `ops` (see [`crate::learn::merge::level2`]), shown
/// the bullets the operations name or are related to. Within a known context
/// window the current prompt shrinks to what the operations leave.
pub async fn consolidate_playbook(
    backend: &dyn LlmBackend,
    cfg: &LlmConfig,
    current: &VersionContent,
    ops: &[MergedOp],
    calls: &mut Vec<LlmCall>,
) -> Result<Vec<Decision>, LlmError> {
    let plain: Vec<DeltaOp> = ops.iter().map(|m| m.op.clone()).collect();
    let view = View::for_ops(current, &plain);
    let (shown, outline) = (&view.content, view.outline.as_deref());
    let messages = |budget: Option<usize>| {
        let full = consolidate_playbook_messages((shown, outline), &plain);
        let prompt = shown.render().chars().count();
        match budget {
            Some(b) if chars_of(&full) > b => {
                let room = b.saturating_sub(chars_of(&full) - prompt);
                consolidate_playbook_messages((&within(shown, Some(room)), outline), &plain)
            }
            _ => full,
        }
    };
    Ok(ask(backend, cfg, (Task::ConsolidatePlaybook, shown), calls, messages, |t| decode_decisions(t, ops))
        .await?
        .value)
}
