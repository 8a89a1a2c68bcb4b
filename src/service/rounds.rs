//! Round operations both front ends call: open a round (by API key or by
//! inbound webhook) with the controller's default batch and a fresh seed,
//! list a prompt's rounds, one round as it is shown, with its traces,
//! reflections, calls and usage, and a prompt's learning state (the backoff
//! after failed rounds) with the operator's clear.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;
use uuid::Uuid;

use super::{AppState, ServiceError, ServiceResult, controller::default_batch};
use crate::{
    domain::{
        Method, PromptName, Reflection,
        backoff::{LearningState, LearningStatus},
        round::{Round, RoundTrigger, random_seed},
    },
    store::{OpenRound, RoundCall, StoreError},
};

#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TriggerRound {
    /// Most traces to take (default: the prompt's batch size, else `worker.default_batch_size`).
    #[serde(default)]
    pub batch_size: Option<u32>,
    /// `combee` (default), or the `naive` / `sequential` baselines.
    #[serde(default)]
    #[schema(value_type = Option<String>)]
    pub method: Option<Method>,
}

pub const MAX_BATCH: u32 = 10_000;

/// Opens a round an operator asked for.
pub async fn open_round(st: &AppState, name: &PromptName, req: TriggerRound) -> ServiceResult<Round> {
    let open = round_request(st, name, req, RoundTrigger::Api, None).await?;
    opened(name, st.store.open_round(&open).await)
}

/// What a signed webhook's trigger did.
#[derive(Debug)]
pub enum WebhookTrigger {
    Opened(Box<Round>),
    /// Its `webhook-id` opened a round already: nothing was started.
    Duplicate,
}

/// Opens a round for a signed webhook, once per `webhook-id`: the id is kept
/// with the round it opens, so a retried delivery finds it.
pub async fn open_round_for_webhook(
    st: &AppState,
    name: &PromptName,
    req: TriggerRound,
    webhook_id: String,
) -> ServiceResult<WebhookTrigger> {
    let open = round_request(st, name, req, RoundTrigger::Webhook, Some(webhook_id)).await?;
    match st.store.open_round(&open).await {
        Err(StoreError::Duplicate) => Ok(WebhookTrigger::Duplicate),
        result => opened(name, result).map(|r| WebhookTrigger::Opened(Box::new(r))),
    }
}

/// The store's request for a round, with the batch size checked or chosen.
async fn round_request(
    st: &AppState,
    name: &PromptName,
    req: TriggerRound,
    trigger: RoundTrigger,
    inbound_webhook_id: Option<String>,
) -> ServiceResult<OpenRound> {
    let prompt =
        st.store.get_prompt(name).await?.ok_or_else(|| ServiceError::not_found(format_args!("prompt {name:?}")))?;
    let batch = match req.batch_size {
        Some(n) => n,
        None => default_batch(st, &prompt, &st.settings.controller).await?,
    };
    if !(1..=MAX_BATCH).contains(&batch) {
        return Err(ServiceError::Unprocessable(format!("`batch_size` must be between 1 and {MAX_BATCH}")));
    }
    Ok(OpenRound {
        prompt: name.clone(),
        trigger,
        method: req.method.unwrap_or_default(),
        batch,
        min_traces: 1,
        seed: random_seed(),
        inbound_webhook_id,
        judge_wait: None,
        base_version: None,
    })
}

/// The opened round, or why none was: 409 for no pending traces or a round in flight.
fn opened(name: &PromptName, result: Result<Option<Round>, StoreError>) -> ServiceResult<Round> {
    match result {
        Ok(Some(round)) => Ok(round),
        Ok(None) => Err(ServiceError::Conflict(format!("prompt {name:?} has no pending traces to learn from"))),
        Err(StoreError::AlreadyExists) => Err(ServiceError::Conflict(format!(
            "prompt {name:?} already has a round in flight; at most one runs at a time"
        ))),
        Err(e) => Err(e.into()),
    }
}

/// The prompt's rounds, newest first, before the `before` round id.
pub async fn list_rounds(
    st: &AppState,
    prompt: &PromptName,
    before: Option<Uuid>,
    limit: u32,
) -> ServiceResult<Vec<Round>> {
    Ok(st.store.list_rounds(Some(prompt), before, limit).await?)
}

#[derive(Debug, Serialize, ToSchema)]
pub struct RoundReflection {
    pub trace_id: Uuid,
    /// True when the agent sent its own reflection with the trace.
    pub from_trace: bool,
    pub reflection: Reflection,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct UsageTotals {
    pub calls: usize,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub cost_usd: f64,
    pub retries: u64,
}

/// One round with its traces, reflections, LLM calls and usage: plain data the web UI renders
/// and the API answers with (in a body type of its own).
#[derive(Debug)]
pub struct RoundView {
    pub round: Round,
    pub trace_ids: Vec<Uuid>,
    pub reflections: Vec<RoundReflection>,
    pub llm_calls: Vec<RoundCall>,
    pub usage: UsageTotals,
    /// When retention compacted the round (`retention.round_detail_days`): its
    /// group outputs and per-call records are gone, `usage` is what they added up to;
    /// reflections and trace ids go with their traces.
    pub compacted_at: Option<chrono::DateTime<chrono::Utc>>,
}

/// One round with its traces, reflections, calls and usage, as the route and the web UI show it.
pub async fn round_view(st: &AppState, id: Uuid) -> ServiceResult<RoundView> {
    let round = st.store.get_round(id).await?.ok_or_else(|| ServiceError::not_found(format_args!("round {id}")))?;
    let (trace_ids, reflections, llm_calls, summary) = tokio::try_join!(
        st.store.round_trace_ids(id),
        st.store.round_reflections(id),
        st.store.round_calls(id),
        st.store.round_summary(id)
    )?;
    let usage = match &summary {
        Some(s) => UsageTotals {
            calls: s.calls as usize,
            prompt_tokens: s.prompt_tokens,
            completion_tokens: s.completion_tokens,
            cost_usd: s.cost_usd,
            retries: s.retries,
        },
        None => UsageTotals {
            calls: llm_calls.len(),
            prompt_tokens: llm_calls.iter().map(|c| c.call.prompt_tokens).sum(),
            completion_tokens: llm_calls.iter().map(|c| c.call.completion_tokens).sum(),
            cost_usd: llm_calls.iter().map(|c| c.call.cost_usd).sum(),
            retries: llm_calls.iter().map(|c| u64::from(c.call.retries)).sum(),
        },
    };
    let reflections = reflections
        .into_iter()
        .map(|(trace_id, reflection, from_trace)| RoundReflection { trace_id, from_trace, reflection })
        .collect();
    Ok(RoundView { round, trace_ids, reflections, llm_calls, usage, compacted_at: summary.map(|s| s.compacted_at) })
}

/// The prompt's learning state: whether failed rounds hold its scheduling back.
pub async fn learning_state(st: &AppState, name: &PromptName) -> ServiceResult<LearningState> {
    let streak =
        st.store.failure_streak(name).await?.ok_or_else(|| ServiceError::not_found(format_args!("prompt {name:?}")))?;
    let mut state = streak.state(&st.settings.worker.failure_backoff(), st.clock.now());
    state.budget = super::budget::reached(st, name).await?;
    if state.budget.is_some() {
        state.state = LearningStatus::BudgetReached;
    }
    Ok(state)
}

/// Ends the prompt's failure streak and its backoff (an operator's reset): the
/// scheduler opens a round as soon as the backlog asks for one.
pub async fn clear_backoff(st: &AppState, name: &PromptName) -> ServiceResult<LearningState> {
    if !st.store.clear_failure_streak(name).await? {
        return Err(ServiceError::not_found(format_args!("prompt {name:?}")));
    }
    learning_state(st, name).await
}

/// Up to `limit` prompts in a failure streak, by name, with their state (for the metrics).
pub async fn failing_prompts(st: &AppState, limit: u32) -> ServiceResult<Vec<(PromptName, LearningState)>> {
    let (policy, now) = (st.settings.worker.failure_backoff(), chrono::Utc::now());
    Ok(st.store.failing_prompts(limit).await?.into_iter().map(|(name, s)| (name, s.state(&policy, now))).collect())
}
