//! The messages of every call of the map and the reduce, built from the
//! templates: untrusted content (traces, and everything derived from them) is
//! fenced and labelled as data, and each call is fitted to the backend's
//! context window ([`super::fit`]).

use serde_json::Value;

use super::fence::fence;
use super::fit::{Fit, chars_of, cut_middle, within};
use super::task::Task;
use crate::domain::{DeltaOp, Reflection, Strategy, Trace, VersionContent};
use crate::learn::merge::level2;
use crate::llm::ChatMessage;

/// Splits a template into its system and user parts and fills `{{name}}` slots in
/// one pass, so text substituted in is never scanned for further slots.
fn build(task: Task, vars: &[(&str, &str)]) -> Vec<ChatMessage> {
    let text = task.template();
    let (system, user) = text.split_once("\n--- user ---\n").unwrap_or((text, ""));
    // The header line stays with the system message: it names the template version.
    let system = system.replacen("\n--- system ---\n", "\n", 1);
    vec![ChatMessage::system(fill(&system, vars)), ChatMessage::user(fill(user, vars))]
}

pub(crate) fn fill(template: &str, vars: &[(&str, &str)]) -> String {
    let mut out = String::with_capacity(template.len());
    let mut rest = template;
    while let Some(start) = rest.find("{{") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        match after.find("}}").map(|end| (&after[..end], end)) {
            Some((name, end)) if vars.iter().any(|(k, _)| *k == name) => {
                let value = vars.iter().find(|(k, _)| *k == name).map_or("", |(_, v)| *v);
                out.push_str(value);
                rest = &after[end + 2..];
            }
            _ => {
                out.push_str("{{");
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out
}

/// The current prompt as a call is shown it: the view's rendering, then the
/// outline of what it leaves out ([`super::select`]) when it leaves something out.
fn current_prompt(current: &VersionContent, outline: Option<&str>) -> String {
    match outline {
        Some(o) => fence("current-prompt", "", &format!("{}\n\n{o}", current.render())),
        None => fence("current-prompt", "", &current.render()),
    }
}

/// A JSON value as prompt text: strings raw (with their line breaks), the rest pretty-printed.
fn show(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => "(none)".to_owned(),
        other => serde_json::to_string_pretty(other).unwrap_or_default(),
    }
}

/// The trace as fenced data, in labelled parts (`--- trajectory ---`, …).
pub fn render_trace(trace: &Trace) -> String {
    fence("untrusted-trace-data", "", &trace_body(trace))
}

fn trace_body(trace: &Trace) -> String {
    let feedback = serde_json::to_value(&trace.feedback).unwrap_or(Value::Null);
    let mut body = format!(
        "--- task input ---\n{}\n--- trajectory ---\n{}\n--- final output ---\n{}\n--- feedback ---\n{}\n",
        show(&trace.input),
        show(&trace.trajectory),
        show(&trace.output),
        show(&feedback)
    );
    if let Some(r) = &trace.reflection {
        body.push_str(&format!("--- the agent's own reflection ---\n{}\n", show(r)));
    }
    body
}

fn render_reflection(i: usize, r: &Reflection) -> String {
    let mut s = format!("[reflection {}]\n", i + 1);
    for (label, text) in [
        ("error", &r.error),
        ("root cause", &r.root_cause),
        ("correct approach", &r.correct_approach),
        ("key insight", &r.key_insight),
    ] {
        if !text.trim().is_empty() {
            s.push_str(&format!("{label}: {}\n", text.trim()));
        }
    }
    if !r.bullet_tags.is_empty() {
        let tags: Vec<String> = r
            .bullet_tags
            .iter()
            .map(|t| {
                format!(
                    "{} {}",
                    t.id,
                    serde_json::to_value(t.tag).ok().and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_default()
                )
            })
            .collect();
        s.push_str(&format!("bullet tags: {}\n", tags.join(", ")));
    }
    s
}

fn render_reflections(reflections: &[Reflection]) -> String {
    render_reflections_within(reflections, None)
}

/// The group's reflections, each cut to an equal share of `max` characters.
fn render_reflections_within(reflections: &[Reflection], max: Option<usize>) -> String {
    let each = max.map(|m| m / reflections.len().max(1));
    let body: String = reflections
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let text = render_reflection(i, r);
            each.map_or(text.clone(), |e| cut_middle(&text, e.max(80)))
        })
        .collect::<Vec<_>>()
        .join("\n");
    fence("untrusted-reflections", &format!(" count=\"{}\"", reflections.len()), &body)
}

/// Messages for one reflector call on `trace`.
pub fn reflect_messages(trace: &Trace, current: &VersionContent, strategy: Strategy) -> Vec<ChatMessage> {
    reflect_messages_within(trace, (current, None), strategy, None)
}

/// [`reflect_messages`] for the current prompt as the call is shown it (the
/// content and the outline of what it leaves out, see [`super::select`]),
/// within `budget` characters: the current prompt and the trace share what
/// the template leaves (see [`Fit`]).
pub fn reflect_messages_within(
    trace: &Trace,
    (current, outline): (&VersionContent, Option<&str>),
    strategy: Strategy,
    budget: Option<usize>,
) -> Vec<ChatMessage> {
    let full = reflect_messages_fitted(trace, (current, outline), strategy, Fit::ALL);
    let (prompt, data) = (current.render().chars().count(), render_trace(trace).chars().count());
    let fit = Fit::share(budget, chars_of(&full).saturating_sub(prompt + data), prompt, data);
    if fit == Fit::ALL { full } else { reflect_messages_fitted(trace, (current, outline), strategy, fit) }
}

fn reflect_messages_fitted(
    trace: &Trace,
    (current, outline): (&VersionContent, Option<&str>),
    strategy: Strategy,
    fit: Fit,
) -> Vec<ChatMessage> {
    let current = &within(current, fit.prompt);
    let trace_text = match fit.data {
        Some(max) => fence("untrusted-trace-data", "", &cut_middle(&trace_body(trace), max.saturating_sub(64))),
        None => render_trace(trace),
    };
    let note = match (strategy, current.playbook.as_ref().filter(|p| !p.is_empty())) {
        (Strategy::Playbook, Some(_)) => {
            "- bullet_tags: for every playbook bullet the agent used (its id such as b-0001 appears in the \
             trajectory), tag it helpful, harmful or neutral for this run. Only use ids that exist in the playbook."
        }
        _ => "- bullet_tags: use an empty list [] (this prompt has no playbook bullets).",
    };
    build(
        Task::Reflect,
        &[("strategy_note", note), ("current_prompt", &current_prompt(current, outline)), ("trace", &trace_text)],
    )
}

/// Messages for one playbook aggregator call; the answer is [`OperationsAnswer`].
pub fn aggregate_playbook_messages(current: &VersionContent, reflections: &[Reflection]) -> Vec<ChatMessage> {
    aggregate_messages_within(Task::AggregatePlaybook, (current, None), reflections, None)
}

/// Messages for one rewrite aggregator call; the answer is [`InstructionAnswer`].
pub fn aggregate_rewrite_messages(current: &VersionContent, reflections: &[Reflection]) -> Vec<ChatMessage> {
    aggregate_messages_within(Task::AggregateRewrite, (current, None), reflections, None)
}

/// An aggregator call's messages for the current prompt as the call is shown
/// it (content and outline), within `budget` characters: the current prompt
/// and the group's reflections share what the template leaves.
pub fn aggregate_messages_within(
    task: Task,
    (current, outline): (&VersionContent, Option<&str>),
    reflections: &[Reflection],
    budget: Option<usize>,
) -> Vec<ChatMessage> {
    let messages = |fit: Fit| {
        build(
            task,
            &[
                ("current_prompt", &current_prompt(&within(current, fit.prompt), outline)),
                ("reflections", &render_reflections_within(reflections, fit.data)),
            ],
        )
    };
    let full = messages(Fit::ALL);
    let (prompt, data) = (current.render().chars().count(), render_reflections(reflections).chars().count());
    let fit = Fit::share(budget, chars_of(&full).saturating_sub(prompt + data), prompt, data);
    if fit == Fit::ALL { full } else { messages(fit) }
}

/// Messages for the level-2 merge of the groups' versions of one conflicting
/// passage (`current` holds the base passage); the answer is [`InstructionAnswer`].
pub fn merge_rewrite_messages(current: &VersionContent, proposals: &[String]) -> Vec<ChatMessage> {
    let body = proposals
        .iter()
        .enumerate()
        .map(|(i, p)| format!("[proposal {}]\n{}\n", i + 1, p.trim_end()))
        .collect::<Vec<_>>()
        .join("\n");
    let proposals = fence("untrusted-proposals", &format!(" count=\"{}\"", proposals.len()), &body);
    build(Task::MergeRewrite, &[("current_prompt", &current_prompt(current, None)), ("proposals", &proposals)])
}

/// One pooled operation as a line of the consolidation prompt: `o3 | ADD | section | content`.
pub fn render_pooled_op(i: usize, op: &DeltaOp) -> String {
    let label = level2::op_label(i);
    match op {
        DeltaOp::Add { section, content, .. } => format!("{label} | ADD | {section} | {content}"),
        DeltaOp::Update { id, content, .. } => format!("{label} | UPDATE | {id} | {content}"),
        DeltaOp::Remove { id, reason } => format!("{label} | REMOVE | {id} | {reason}"),
    }
}

/// Messages for one level-2 consolidation call (`reduce = "llm"`) over pooled,
/// numbered operations, for the current prompt as the call is shown it
/// (content and outline); the answer is a [`DecisionsAnswer`].
pub fn consolidate_playbook_messages(
    (current, outline): (&VersionContent, Option<&str>),
    ops: &[DeltaOp],
) -> Vec<ChatMessage> {
    let body = ops.iter().enumerate().map(|(i, op)| render_pooled_op(i, op)).collect::<Vec<_>>().join("\n");
    let operations = fence("untrusted-operations", &format!(" count=\"{}\"", ops.len()), &body);
    build(
        Task::ConsolidatePlaybook,
        &[("current_prompt", &current_prompt(current, outline)), ("operations", &operations)],
    )
}
