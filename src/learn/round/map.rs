//! The map step of a round: one reflector call per trace, all in parallel
//! under the client's concurrency limit, each reflection journaled as it
//! arrives (a resumed round does not pay twice). An agent's own reflection
//! replaces the call when the prompt's settings say to use it; a trace whose
//! reflection stays invalid is left out and charged, a transient failure fails
//! the round as retryable after what was obtained is saved.

use std::sync::atomic::{AtomicBool, Ordering};

use futures_util::StreamExt;
use futures_util::stream;
use uuid::Uuid;

use super::journal::{ReflectionSource, RoundJournal};
use super::record::{AnswerReport, MapCounts, Unreflected};
use super::spec::{RoundError, RoundSpec};
use crate::domain::{AgentReflections, Reflection, Trace, VersionContent};
use crate::learn::prompts::{calls, checks::validate_reflection, task::Task};
use crate::llm::{LlmBackend, LlmCall, LlmError, config::LlmConfig};

/// The agent's own reflection, when it parses strictly and validates against `base`.
fn own_reflection(trace: &Trace, base: &VersionContent) -> Option<Reflection> {
    let r: Reflection = serde_json::from_value(trace.reflection.clone()?).ok()?;
    validate_reflection(&r, base).ok().map(|()| r)
}

pub(super) struct Mapped {
    /// `(trace id, reflection)` in the order of the round's traces.
    pub(super) reflections: Vec<(Uuid, Reflection)>,
    pub(super) counts: MapCounts,
    pub(super) unreflected: Vec<Unreflected>,
    pub(super) answers: AnswerReport,
}

pub(super) async fn map_phase(
    backend: &dyn LlmBackend,
    llm: &LlmConfig,
    spec: &RoundSpec,
    base: &VersionContent,
    traces: &[Trace],
    journal: &dyn RoundJournal,
    calls: &mut Vec<LlmCall>,
) -> Result<Mapped, RoundError> {
    let stored = journal.stored_reflections().await?;
    let mut slots: Vec<Option<Reflection>> = vec![None; traces.len()];
    let mut counts = MapCounts::default();
    let mut todo = Vec::new();
    for (i, trace) in traces.iter().enumerate() {
        if let Some(r) = stored.get(&trace.id) {
            slots[i] = Some(r.clone());
            counts.resumed += 1;
        } else if spec.agent_reflections == AgentReflections::Use
            && let Some(r) = own_reflection(trace, base)
        {
            journal.save_reflection(trace.id, &r, ReflectionSource::Trace).await?;
            slots[i] = Some(r);
            counts.from_traces += 1;
        } else {
            if spec.agent_reflections == AgentReflections::Ignore && trace.reflection.is_some() {
                counts.ignored_from_traces += 1;
            }
            todo.push(i);
        }
    }

    // After a transient failure no new call is started: the round will be retried anyway.
    let abort = AtomicBool::new(false);
    let abort = &abort;
    // Futures collected first: a `map` closure in the stream's type trips the
    // compiler's higher-ranked `Send` check, and the worker must be able to spawn a round.
    let calls_to_make: Vec<_> = todo
        .into_iter()
        .map(|i| async move {
            if abort.load(Ordering::Relaxed) {
                return (i, None, Vec::new());
            }
            let mut calls = Vec::new();
            // An ignored agent reflection is not shown to the reflector either.
            let shown = match spec.agent_reflections {
                AgentReflections::Ignore if traces[i].reflection.is_some() => {
                    std::borrow::Cow::Owned(Trace { reflection: None, ..traces[i].clone() })
                }
                _ => std::borrow::Cow::Borrowed(&traces[i]),
            };
            let r = calls::reflect(backend, llm, &shown, base, spec.strategy, &mut calls).await;
            if r.as_ref().is_err_and(LlmError::is_retryable) {
                abort.store(true, Ordering::Relaxed);
            }
            (i, Some(r), calls)
        })
        .collect();
    let mut results = stream::iter(calls_to_make).buffer_unordered(llm.max_concurrency.max(1));

    let mut transient: Option<LlmError> = None;
    let mut unreflected = Vec::new();
    let mut answers = AnswerReport::default();
    while let Some((i, r, made)) = results.next().await {
        journal.record_calls(&made).await?;
        calls.extend(made);
        match r {
            None => {}
            Some(Ok(noted)) => {
                let r = noted.value;
                answers.note(Task::Reflect, Some(traces[i].id), None, noted.notes);
                journal.save_reflection(traces[i].id, &r, ReflectionSource::Reflector).await?;
                slots[i] = Some(r);
                counts.reflected += 1;
            }
            Some(Err(e)) if e.is_retryable() => {
                transient.get_or_insert(e);
            }
            Some(Err(e)) => {
                journal.record_unreflected(traces[i].id, &e.to_string()).await?;
                unreflected.push(Unreflected { trace_id: traces[i].id, error: e.to_string() });
            }
        }
    }
    if let Some(e) = transient {
        return Err(RoundError::Llm(e));
    }
    let reflections = traces.iter().zip(slots).filter_map(|(t, r)| r.map(|r| (t.id, r))).collect();
    Ok(Mapped { reflections, counts, unreflected, answers })
}
