//! Learning rounds as records: one learning step for one prompt over a batch
//! of traces, queued, claimed by a worker under a lease, then succeeded (with
//! the version it made) or failed (with the reason).

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::ToSchema;
use uuid::Uuid;

use super::{PromptName, Strategy};

/// A fresh seed for a round's shuffle: non-negative, so it reads the same in every store.
pub fn random_seed() -> i64 {
    rand::random::<i64>() & i64::MAX
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum RoundStatus {
    Queued,
    Running,
    Succeeded,
    Failed,
}

impl RoundStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Queued => "queued",
            Self::Running => "running",
            Self::Succeeded => "succeeded",
            Self::Failed => "failed",
        }
    }
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "queued" => Self::Queued,
            "running" => Self::Running,
            "succeeded" => Self::Succeeded,
            "failed" => Self::Failed,
            _ => return None,
        })
    }
}

/// How a round groups its reflections for the reduce.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Method {
    /// Augmented shuffle, then k = ⌊√n⌋ parallel groups against the same frozen version.
    #[default]
    Combee,
    /// One aggregator call on all n reflections, no shuffle (the context-overload baseline).
    Naive,
    /// Batches of three in order, each applied before the next is aggregated.
    Sequential,
}

/// Why a round started.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum RoundTrigger {
    /// The backlog reached the batch size.
    Backlog,
    /// The oldest pending trace waited `max_wait`.
    MaxWait,
    /// `POST /v1/prompts/{name}/rounds`.
    Api,
    /// An inbound webhook.
    Webhook,
}

impl RoundTrigger {
    /// An operator asked for the round (by API key or inbound webhook): it
    /// ends a failing prompt's backoff (see [`crate::domain::backoff`]).
    pub fn is_operator(self) -> bool {
        matches!(self, Self::Api | Self::Webhook)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Backlog => "backlog",
            Self::MaxWait => "max_wait",
            Self::Api => "api",
            Self::Webhook => "webhook",
        }
    }
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "backlog" => Self::Backlog,
            "max_wait" => Self::MaxWait,
            "api" => Self::Api,
            "webhook" => Self::Webhook,
            _ => return None,
        })
    }
}

pub fn method_str(m: Method) -> &'static str {
    match m {
        Method::Combee => "combee",
        Method::Naive => "naive",
        Method::Sequential => "sequential",
    }
}

pub fn parse_method(s: &str) -> Option<Method> {
    Some(match s {
        "combee" => Method::Combee,
        "naive" => Method::Naive,
        "sequential" => Method::Sequential,
        _ => return None,
    })
}

pub fn strategy_str(s: Strategy) -> &'static str {
    match s {
        Strategy::Playbook => "playbook",
        Strategy::Rewrite => "rewrite",
    }
}

pub fn parse_strategy(s: &str) -> Option<Strategy> {
    Some(match s {
        "playbook" => Strategy::Playbook,
        "rewrite" => Strategy::Rewrite,
        _ => return None,
    })
}

#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct Round {
    pub id: Uuid,
    #[schema(value_type = String)]
    pub prompt: PromptName,
    pub status: RoundStatus,
    pub trigger: RoundTrigger,
    #[schema(value_type = String)]
    pub method: Method,
    pub strategy: Strategy,
    /// Seeds the shuffle, so a resumed round regroups identically.
    pub seed: i64,
    /// p: how many times each reflection enters the shuffle.
    pub duplication: i32,
    /// Traces in the batch.
    pub n: i32,
    /// Level-1 groups, once known.
    pub k: Option<i32>,
    /// The frozen version every group aggregated against.
    pub base_version: i64,
    pub result_version: Option<i64>,
    /// How many times a worker has claimed this round.
    pub attempt: i32,
    pub error: Option<String>,
    /// Phase timings, group outputs, operations applied and skipped: a
    /// [`super::RoundDetail`] as stored (read it with `RoundDetail::read`).
    #[schema(value_type = Object)]
    pub detail: Value,
    pub created_at: DateTime<Utc>,
    pub started_at: Option<DateTime<Utc>>,
    pub finished_at: Option<DateTime<Utc>>,
    pub updated_at: DateTime<Utc>,
}
