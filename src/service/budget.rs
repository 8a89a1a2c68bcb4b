//! The learning budget's rules: the store-backed [`SpendMeter`] every LLM
//! client of a worker process counts through (so the caps hold across
//! processes and restarts), a prompt's caps as the settings route changes
//! them, and what the API, the UI and `/metrics` read: spend per day and the
//! daily cap holding a prompt back. Days are UTC days of the worker's
//! [`Clock`].

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use chrono::NaiveDate;
use serde::Serialize;
use utoipa::ToSchema;
use uuid::Uuid;

use super::{AppState, ServiceError, ServiceResult};
use crate::domain::budget::{BudgetCaps, BudgetReached, DaySpend, Spent, next_day};
use crate::domain::clock::Clock;
use crate::domain::{Prompt, PromptName};
use crate::llm::meter::{CallTag, Hold, Spend, SpendMeter, SpendRefusal};
use crate::store::{DynStore, HoldOutcome, HoldRequest, Settlement};

/// Most days `GET /v1/prompts/{name}/spend` reads back.
pub const MAX_SPEND_DAYS: u32 = 366;

/// Counts every attempt in the store and refuses the ones that would pass a cap.
pub struct StoreMeter {
    store: DynStore,
    server: BudgetCaps,
    clock: Clock,
    /// How long an unsettled hold counts (its process may have died).
    hold_for: Duration,
}

impl StoreMeter {
    pub fn new(st: &AppState) -> Arc<Self> {
        let llm = &st.settings.llm;
        // An attempt may take its timeout several times over (slow backends get longer ones).
        let hold_for = Duration::from_secs_f64((llm.request_timeout_secs * 4.0).clamp(600.0, 86_400.0));
        Arc::new(Self { store: st.store.clone(), server: st.settings.budget.caps(), clock: st.clock.clone(), hold_for })
    }
}

fn spent(s: Spend) -> Spent {
    Spent { tokens: s.tokens, usd: s.usd, calls: 1 }
}

// The store's work runs in tasks of its own: a caller (the map step's
// stream of calls) may stop polling a call while it writes its journal, and
// with SQLite's one writer connection a reservation waiting in that call
// would hold the connection the journal needs.
#[async_trait]
impl SpendMeter for StoreMeter {
    async fn reserve(&self, tag: &CallTag, kind: &'static str, estimate: Spend) -> Result<Hold, SpendRefusal> {
        let now = self.clock.now();
        let (day, until) = (now.date_naive(), next_day(now));
        let (id, store, server) = (Uuid::now_v7(), self.store.clone(), self.server);
        let (prompt, round) = (tag.prompt.clone().unwrap_or_default(), tag.round);
        // The store's clock, not the worker's: a hold expires in real time.
        let expires_at = chrono::Utc::now() + self.hold_for;
        let held = tokio::spawn(async move {
            let req =
                HoldRequest { id, day, prompt: &prompt, round, estimate: spent(estimate), server, until, expires_at };
            store.hold_spend(&req).await
        })
        .await;
        match held {
            Ok(Ok(HoldOutcome::Held)) => Ok(Hold { id, day, tag: tag.clone(), kind, estimate }),
            Ok(Ok(HoldOutcome::Refused { scope, daily })) => {
                metrics::counter!("combee_llm_budget_refusals_total", "scope" => scope.clone()).increment(1);
                Err(SpendRefusal { scope, until: daily.then_some(until) })
            }
            // Fail closed: an uncounted call could pass a cap. The work waits and looks again.
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "the budget could not be checked; the call waits");
                Err(SpendRefusal { scope: "the budget could not be checked".into(), until: None })
            }
            Err(e) => {
                tracing::warn!(error = %e, "the budget check stopped; the call waits");
                Err(SpendRefusal { scope: "the budget could not be checked".into(), until: None })
            }
        }
    }

    async fn settle(&self, hold: Hold, used: Spend) {
        metrics::counter!("combee_llm_spend_tokens_total", "kind" => hold.kind).increment(used.tokens);
        let store = self.store.clone();
        // Recorded even when the caller is dropped meanwhile.
        let task = tokio::spawn(async move {
            let s = Settlement {
                hold: hold.id,
                day: hold.day,
                prompt: hold.tag.prompt.as_deref().unwrap_or(""),
                kind: hold.kind,
                round: hold.tag.round,
                used: spent(used),
            };
            for delay in [0, 200, 1000] {
                tokio::time::sleep(Duration::from_millis(delay)).await;
                match store.settle_spend(&s).await {
                    Ok(()) => return,
                    Err(e) => tracing::warn!(error = %e, "an LLM call's spend could not be recorded yet"),
                }
            }
            tracing::error!(hold = %hold.id, tokens = used.tokens, "an LLM call's spend was not recorded; its hold counts until it expires");
        });
        let _ = task.await;
    }
}

/// A prompt's spend per day with its caps and state (`GET /v1/prompts/{name}/spend`).
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct SpendReport {
    pub prompt: String,
    /// The prompt's own caps (`settings` route, `budget`).
    pub caps: BudgetCaps,
    /// The server's caps (`[budget]`): the daily ones over all prompts together.
    pub server_caps: BudgetCaps,
    /// The daily cap holding the prompt's learning back now, if one does.
    pub reached: Option<BudgetReached>,
    /// Today first; days without spend are left out.
    pub days: Vec<DaySpend>,
}

/// The prompt's spend over the last `days` UTC days (today included).
pub async fn spend(st: &AppState, prompt: &Prompt, days: u32) -> ServiceResult<SpendReport> {
    if !(1..=MAX_SPEND_DAYS).contains(&days) {
        return Err(ServiceError::Unprocessable(format!("days must be from 1 to {MAX_SPEND_DAYS}, got {days}")));
    }
    let today = st.clock.now().date_naive();
    let from = today - chrono::Days::new(u64::from(days - 1));
    Ok(SpendReport {
        prompt: prompt.name.as_str().to_owned(),
        caps: st.store.prompt_caps(&prompt.name.qualified()).await?,
        server_caps: st.settings.budget.caps(),
        reached: reached(st, &prompt.name).await?,
        days: st.store.spend_by_day(&prompt.name.qualified(), from).await?,
    })
}

/// The daily cap holding `name` back today: its own, or the server's.
pub async fn reached(st: &AppState, name: &PromptName) -> ServiceResult<Option<BudgetReached>> {
    let today = st.clock.now().date_naive();
    if let Some(r) = st.store.budget_reached(&name.qualified(), today).await? {
        return Ok(Some(r));
    }
    // The server's own refusals are kept under the empty name.
    Ok(st.store.budget_reached("", today).await?)
}

/// Every prompt a daily cap holds back today, with `""` for the server's own cap (for the metrics).
pub async fn reached_all(st: &AppState) -> ServiceResult<Vec<(String, BudgetReached)>> {
    Ok(st.store.budget_reached_all(st.clock.now().date_naive()).await?)
}

/// The prompt's caps after the merge patch `patch` (the `budget` member of a
/// settings patch), validated; `null` clears them all.
pub fn patched_caps(current: &BudgetCaps, patch: &serde_json::Value) -> ServiceResult<BudgetCaps> {
    // RFC 7396 on a flat object: members replace, `null` removes; anything else replaces the whole.
    let mut doc = serde_json::to_value(current).map_err(|e| ServiceError::Internal(e.into()))?;
    match (doc.as_object_mut(), patch) {
        (Some(caps), serde_json::Value::Object(members)) => {
            for (k, v) in members {
                if v.is_null() {
                    caps.remove(k);
                } else {
                    caps.insert(k.clone(), v.clone());
                }
            }
        }
        (_, serde_json::Value::Null) => return Ok(BudgetCaps::default()),
        (_, serde_json::Value::Object(_)) => doc = patch.clone(),
        // A sequence would fill the caps by position: only an object names them.
        _ => return Err(ServiceError::Unprocessable("`settings.budget` must be an object or null".into())),
    }
    let caps: BudgetCaps = serde_path_to_error::deserialize(doc).map_err(|e| {
        let inner = super::plain_serde_error(&e.inner().to_string());
        ServiceError::Unprocessable(format!("`settings.budget.{}`: {inner}", e.path()))
    })?;
    caps.validate().map_err(|e| ServiceError::Unprocessable(format!("`settings.{e}`")))?;
    Ok(caps)
}

/// The prompt's current caps.
pub async fn caps(st: &AppState, prompt: &Prompt) -> ServiceResult<BudgetCaps> {
    Ok(st.store.prompt_caps(&prompt.name.qualified()).await?)
}

/// Sets the prompt's caps. A change lifts today's hold at once: the prompt's
/// rounds waiting for the budget are due and its state is `ok` (a round that
/// still meets a cap waits again without a call).
pub async fn set_caps(st: &AppState, prompt: &Prompt, before: &BudgetCaps, caps: &BudgetCaps) -> ServiceResult<()> {
    let lift = caps != before;
    let today: NaiveDate = st.clock.now().date_naive();
    st.store.set_prompt_caps(&prompt.name.qualified(), caps, today, lift).await?;
    tracing::info!(prompt = %prompt.name, ?caps, lifted = lift, "the prompt's budget changed");
    Ok(())
}
