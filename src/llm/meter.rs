//! The spending hook of every LLM call, at the transport layer so that any call
//! combee makes — reflection, aggregation, crossover, and whatever kind is
//! added later — is counted without its caller doing anything but say what the
//! call is for. Before each HTTP attempt the client asks a [`SpendMeter`] to
//! reserve the attempt's estimated cost (prompt tokens estimated from the
//! request, completion tokens from its `max_tokens`); a refusal means the
//! attempt is not sent ([`super::LlmError::BudgetReached`]). After the attempt
//! the reservation is replaced by what it really used, failed and retried
//! attempts included. The meter's rules (caps, days, storage) live above this
//! layer (`service::budget`); this file only holds the vocabulary and the
//! [`Tagged`] backend through which a call site names the prompt and round.

use std::sync::Arc;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use uuid::Uuid;

use super::{ChatRequest, ChatResponse, LlmBackend, LlmError, LlmRole};

/// What a call is for, as the budget counts it. Every member may be absent: a
/// call of no prompt counts toward the server's caps only.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CallTag {
    /// The prompt whose learning the call serves.
    pub prompt: Option<String>,
    /// The kind of call (`reflection`, `aggregation`, `crossover`, …); absent,
    /// the request's role names it.
    pub kind: Option<&'static str>,
    /// The round the call belongs to, and the pass of it (one claim of the
    /// round, run until it ends or waits): per-round caps count every pass of
    /// the round together.
    pub round: Option<(Uuid, i32)>,
}

impl CallTag {
    /// The calls of one pass of a learning round of `prompt`.
    pub fn round(prompt: &str, round: Uuid, pass: i32) -> Self {
        Self { prompt: Some(prompt.to_owned()), kind: None, round: Some((round, pass)) }
    }

    /// Calls of `kind` for `prompt`, outside any round.
    pub fn prompt(prompt: &str, kind: &'static str) -> Self {
        Self { prompt: Some(prompt.to_owned()), kind: Some(kind), round: None }
    }

    /// The kind this tag gives a request of `role`.
    pub fn kind_for(&self, role: LlmRole) -> &'static str {
        self.kind.unwrap_or(match role {
            LlmRole::Reflector => "reflection",
            LlmRole::Aggregator => "aggregation",
            LlmRole::Gate => "gate",
            LlmRole::Judge => "judge",
        })
    }

    /// `self`, with the members `self` leaves open taken from `outer`.
    fn under(self, outer: &CallTag) -> Self {
        Self {
            prompt: self.prompt.or_else(|| outer.prompt.clone()),
            kind: self.kind.or(outer.kind),
            round: self.round.or(outer.round),
        }
    }
}

/// Tokens and dollars.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Spend {
    pub tokens: u64,
    pub usd: f64,
}

/// A reservation the meter granted; settled once with what the attempt used.
#[derive(Debug, Clone, PartialEq)]
pub struct Hold {
    pub id: Uuid,
    /// The UTC day the reservation counts toward.
    pub day: chrono::NaiveDate,
    pub tag: CallTag,
    pub kind: &'static str,
    pub estimate: Spend,
}

/// Why an attempt was not sent: which cap, and when it lifts by itself (the
/// next UTC day for a daily cap; never for a round cap, which holds the
/// round until it is raised).
#[derive(Debug, Clone, PartialEq)]
pub struct SpendRefusal {
    pub scope: String,
    pub until: Option<DateTime<Utc>>,
}

/// Reserves each attempt's estimated cost before it is sent and settles it after.
#[async_trait]
pub trait SpendMeter: Send + Sync {
    /// Reserves `estimate` for one attempt of a call of `kind` tagged `tag`, or
    /// refuses because a cap would be passed.
    async fn reserve(&self, tag: &CallTag, kind: &'static str, estimate: Spend) -> Result<Hold, SpendRefusal>;
    /// Replaces the reservation with what the attempt used.
    async fn settle(&self, hold: Hold, used: Spend);
}

/// A backend whose calls all carry `tag` (members the request sets itself win):
/// how a call site says which prompt and round its calls are for.
pub struct Tagged {
    inner: Arc<dyn LlmBackend>,
    tag: CallTag,
}

impl Tagged {
    pub fn new(inner: Arc<dyn LlmBackend>, tag: CallTag) -> Self {
        Self { inner, tag }
    }
}

#[async_trait]
impl LlmBackend for Tagged {
    async fn chat(&self, mut req: ChatRequest) -> Result<ChatResponse, LlmError> {
        req.tag = std::mem::take(&mut req.tag).under(&self.tag);
        self.inner.chat(req).await
    }

    fn context_window(&self) -> Option<u32> {
        self.inner.context_window()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_s_own_tag_wins_over_the_call_site_s() {
        let round = CallTag::round("support", Uuid::nil(), 2);
        let own = CallTag { kind: Some("crossover"), ..Default::default() };
        let t = own.under(&round);
        assert_eq!(t.prompt.as_deref(), Some("support"));
        assert_eq!((t.kind, t.round), (Some("crossover"), Some((Uuid::nil(), 2))));
        assert_eq!(CallTag::default().kind_for(LlmRole::Reflector), "reflection");
        assert_eq!(CallTag::default().kind_for(LlmRole::Aggregator), "aggregation");
    }
}
