//! Label history: the append-only record of every change of a label — which
//! kind of change, who or what made it (an operator's key, the web UI, the
//! learning worker, the regression guard), why, and the numbers behind it.
//! The store writes one entry in the same transaction as each change.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::ToSchema;

use super::LabelName;

/// What kind of change moved a label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "kebab-case")]
pub enum LabelMoveKind {
    /// The prompt was created with `production` on version 1.
    Create,
    /// An operator pointed the label at a version (API, CLI or web UI).
    Promote,
    /// An operator rolled back: an older version's content came back as a new version.
    Rollback,
    /// A learning round published a version and moved the prompt's label to it.
    AutoPublish,
    /// The regression guard moved `production` back to the previous production version.
    GuardRollback,
    /// An operator deleted the label.
    Delete,
    /// The promotion gate moved `production` to a challenger that beat the champion on live traffic.
    GatePromote,
    /// A crossover of the population's winners was labelled `candidate` (the evidence names its parents).
    Crossover,
}

impl LabelMoveKind {
    pub const ALL: [LabelMoveKind; 8] = [
        Self::Create,
        Self::Promote,
        Self::Rollback,
        Self::AutoPublish,
        Self::GuardRollback,
        Self::Delete,
        Self::GatePromote,
        Self::Crossover,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Create => "create",
            Self::Promote => "promote",
            Self::Rollback => "rollback",
            Self::AutoPublish => "auto-publish",
            Self::GuardRollback => "guard-rollback",
            Self::Delete => "delete",
            Self::GatePromote => "gate-promote",
            Self::Crossover => "crossover",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.as_str() == s)
    }

    /// Made by a person (an API key, the web UI), not by combee itself.
    pub fn by_operator(self) -> bool {
        matches!(self, Self::Promote | Self::Rollback | Self::Delete)
    }
}

/// Why a label is about to change: recorded with the change.
#[derive(Debug, Clone, PartialEq)]
pub struct MoveCause {
    pub kind: LabelMoveKind,
    /// Free text for people (an operator's reason, "round … published", the guard's verdict).
    pub reason: String,
    /// The numbers behind the move (the guard's test, …), as JSON.
    pub evidence: Option<Value>,
}

impl MoveCause {
    pub fn new(kind: LabelMoveKind, reason: impl Into<String>) -> Self {
        Self { kind, reason: reason.into(), evidence: None }
    }

    pub fn with_evidence(mut self, evidence: Value) -> Self {
        self.evidence = Some(evidence);
        self
    }
}

/// One recorded change of a label.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct LabelHistoryEntry {
    /// Increases with every recorded move (the page cursor).
    pub id: i64,
    #[schema(value_type = String)]
    pub label: LabelName,
    /// `null`: the label did not exist before.
    pub from_version: Option<i64>,
    /// `null`: the label was deleted.
    pub to_version: Option<i64>,
    pub kind: LabelMoveKind,
    /// Who or what moved it: `key:<prefix>`, `ui:<prefix>`, `worker`, `guard`, ….
    pub actor: String,
    pub reason: String,
    /// The numbers behind the move, when there are any.
    #[schema(value_type = Option<Object>)]
    pub evidence: Option<Value>,
    pub at: DateTime<Utc>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_round_trip_through_their_names() {
        for k in LabelMoveKind::ALL {
            assert_eq!(LabelMoveKind::parse(k.as_str()), Some(k));
            assert_eq!(serde_json::to_value(k).unwrap(), Value::String(k.as_str().into()));
        }
        assert_eq!(LabelMoveKind::parse("promoted"), None);
    }
}
