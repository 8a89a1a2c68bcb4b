//! Runs a version's regression gate: each case of the prompt's set through
//! the LLM backend (the version's text as the system prompt, the case's input
//! as the conversation, role `gate`, so the calls are limited and counted like
//! every other), the same for production where its runs are not kept yet,
//! then the verdict (`domain::regression::verdict`) recorded and acted on by
//! `service::gate`. A judge-rubric case's reply is then scored by the LLM
//! judge (role `judge`, `learn::judge`, the same `{score, critique}` answer
//! trace evaluators get); a judge that gives no usable answer leaves that
//! case not evaluated for the run. A reply call that fails leaves the gate
//! undecided: its lease runs out and a later claim runs it again, so an
//! outage of the model never reads as a verdict.

use std::collections::HashMap;

use futures_util::{FutureExt, StreamExt, future::BoxFuture, stream};

use crate::{
    config::RegressionSettings,
    domain::{
        Prompt,
        label::Selector,
        regression::{CaseRun, Gate, GateStatus, GateUsage, RegressionCase, input_messages, verdict},
    },
    learn::judge,
    llm::{ChatMessage, ChatRole, LlmBackend, LlmCall, LlmRole, config::LlmConfig},
    service::gate::Exposer,
    store::{DynStore, StoreError, StoreResult},
};

/// The model's reply to one case, with `system` as the system prompt, and what the call cost.
async fn reply(
    backend: &dyn LlmBackend,
    llm: &LlmConfig,
    system: &str,
    case: &RegressionCase,
) -> Result<(String, GateUsage), String> {
    let turns = input_messages(&case.input)?;
    let mut messages = vec![ChatMessage::system(system)];
    messages.extend(turns.into_iter().map(|m| ChatMessage {
        role: match m.role.as_str() {
            "system" => ChatRole::System,
            "assistant" => ChatRole::Assistant,
            _ => ChatRole::User,
        },
        content: m.content,
    }));
    let req = llm.request(LlmRole::Gate, messages, false);
    let outcome = backend.chat(req).await;
    let answered = if outcome.is_ok() { "answered" } else { "failed" };
    metrics::counter!("combee_regression_gate_calls_total", "outcome" => answered).increment(1);
    let r = outcome.map_err(|e| e.to_string())?;
    let usage = GateUsage {
        calls: 1,
        prompt_tokens: r.usage.prompt_tokens,
        completion_tokens: r.usage.completion_tokens,
        cost_usd: r.cost_usd,
    };
    Ok((r.content, usage))
}

/// Scores one reply: by the case's checks, or by the judge with its rubric
/// (not evaluated when the judge gives no usable answer), with what the
/// judge's calls cost.
async fn score(backend: &dyn LlmBackend, llm: &LlmConfig, case: &RegressionCase, text: &str) -> (CaseRun, GateUsage) {
    let Some(rubric) = &case.judge else {
        let checks: Vec<_> = case.checks.iter().filter_map(|c| c.clone().compile().ok()).collect();
        return (CaseRun::scored(case.id, &checks, text), GateUsage::default());
    };
    let mut calls: Vec<LlmCall> = Vec::new();
    let j = judge::judge(backend, llm, "case", &rubric.rubric, &case.input, text, &mut calls).await;
    let mut usage = GateUsage::default();
    for call in &calls {
        let outcome = if call.error.is_some() { "failed" } else { "ok" };
        metrics::counter!("combee_judge_llm_calls_total", "outcome" => outcome).increment(1);
        usage.add(GateUsage {
            calls: 1,
            prompt_tokens: call.prompt_tokens,
            completion_tokens: call.completion_tokens,
            cost_usd: call.cost_usd,
        });
    }
    let run = match (j.score, &j.error) {
        (Some(score), _) => {
            CaseRun::judged(case.id, text, score, j.critique.as_deref().unwrap_or(""), rubric.pass_score)
        }
        (None, why) => {
            let why = why.as_deref().unwrap_or("the judge gave no score");
            tracing::warn!(case = %case.id, error = %why, "the gate's judge failed; the case is not evaluated this run");
            CaseRun::not_evaluated(case.id, text, why)
        }
    };
    (run, usage)
}

/// Runs `cases` with `system` as the prompt, `concurrency` at a time; the
/// first reply call that fails fails the whole run (a judge that fails
/// leaves its case not evaluated).
async fn run_cases(
    backend: &dyn LlmBackend,
    llm: &LlmConfig,
    system: &str,
    cases: &[&RegressionCase],
    concurrency: usize,
) -> Result<(Vec<CaseRun>, GateUsage), String> {
    // Boxed: a stream of borrowing futures is otherwise not `Send` for every lifetime.
    let futures: Vec<BoxFuture<'_, Result<(CaseRun, GateUsage), String>>> = cases
        .iter()
        .map(|&case| {
            async move {
                let (text, mut usage) = reply(backend, llm, system, case).await?;
                let (run, judged) = score(backend, llm, case, &text).await;
                usage.add(judged);
                Ok((run, usage))
            }
            .boxed()
        })
        .collect();
    let runs: Vec<Result<(CaseRun, GateUsage), String>> =
        stream::iter(futures).buffer_unordered(concurrency.max(1)).collect().await;
    let mut usage = GateUsage::default();
    let mut out = Vec::with_capacity(runs.len());
    for run in runs {
        let (run, u) = run?;
        usage.add(u);
        out.push(run);
    }
    Ok((out, usage))
}

/// The text of `version` of `prompt`.
async fn text_of(store: &DynStore, prompt: &Prompt, version: i64) -> StoreResult<String> {
    let resolved = store.resolve(&prompt.name, &Selector::Version(version)).await?.ok_or(StoreError::NotFound)?;
    Ok(resolved.version.content.render())
}

/// Runs a claimed pending gate to its verdict. Returns whether it was decided.
pub async fn run(
    store: &DynStore,
    backend: &dyn LlmBackend,
    llm: &LlmConfig,
    settings: &RegressionSettings,
    exposer: &Exposer<'_>,
    prompt: &Prompt,
    mut gate: Gate,
) -> StoreResult<bool> {
    let cases = store.regression_cases(&prompt.name).await?;
    let all: Vec<&RegressionCase> = cases.iter().collect();
    // Production's runs are kept per version and reused; only new cases run.
    let mut production: HashMap<uuid::Uuid, CaseRun> = HashMap::new();
    if let Some(p) = gate.production_version {
        // A kept run its judge could not score is run again.
        production = store
            .case_runs(&prompt.name, p)
            .await?
            .into_iter()
            .filter(|r| r.evaluated)
            .map(|r| (r.case_id, r))
            .collect();
        let missing: Vec<&RegressionCase> = all.iter().copied().filter(|c| !production.contains_key(&c.id)).collect();
        if !missing.is_empty() {
            let text = text_of(store, prompt, p).await?;
            match run_cases(backend, llm, &text, &missing, settings.concurrency).await {
                Ok((runs, usage)) => {
                    gate.usage.add(usage);
                    store.save_case_runs(&prompt.name, p, &runs).await?;
                    production.extend(runs.into_iter().map(|r| (r.case_id, r)));
                }
                Err(e) => {
                    tracing::warn!(prompt = %prompt.name, version = gate.version, error = %e,
                        "the gate could not run production on its cases; it runs again after its lease");
                    return Ok(false);
                }
            }
        }
    }
    let text = text_of(store, prompt, gate.version).await?;
    let runs = match run_cases(backend, llm, &text, &all, settings.concurrency).await {
        Ok((runs, usage)) => {
            gate.usage.add(usage);
            runs
        }
        Err(e) => {
            tracing::warn!(prompt = %prompt.name, version = gate.version, error = %e,
                "the gate could not run the version on its cases; it runs again after its lease");
            return Ok(false);
        }
    };
    store.save_case_runs(&prompt.name, gate.version, &runs).await?;
    let mut by_case: HashMap<uuid::Uuid, CaseRun> = runs.into_iter().map(|r| (r.case_id, r)).collect();
    let paired = cases
        .iter()
        .filter_map(|c| by_case.remove(&c.id).map(|run| (c.id, c.name.clone(), run, production.remove(&c.id))))
        .collect();
    let (status, reason, compared) = verdict(paired, settings.margin);
    if status == GateStatus::Pending {
        // A case the judge could not score, and no other regressed: no verdict this run.
        tracing::warn!(prompt = %prompt.name, version = gate.version, reason = %reason,
            "the gate could not evaluate every case; it runs again after its lease");
        return Ok(false);
    }
    let (cand, prod) = crate::domain::regression::means(&compared);
    gate.status = status;
    gate.reason = Some(reason);
    gate.candidate_mean = cand;
    gate.production_mean = prod;
    gate.cases = compared;
    gate.margin = settings.margin;
    gate.decided_at = Some(chrono::Utc::now());
    match exposer.decide(prompt, &gate).await {
        Ok(()) => Ok(true),
        Err(StoreError::Conflict) => Ok(false),
        Err(e) => Err(e),
    }
}
