//! Outbound webhook events: the nine kinds a subscription can ask for and the
//! JSON body each one carries (`{"type", "timestamp", "data"}`). The store
//! writes these bodies into its outbox in the same transaction as the change
//! they announce; the delivery worker sends the stored bytes unchanged.

use chrono::{DateTime, SecondsFormat, Utc};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use utoipa::ToSchema;
use uuid::Uuid;

use super::{
    LabelName, MoveCause, PromptName, Version,
    regression::{CaseComparison, Gate, GateStatus},
};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, ToSchema)]
pub enum EventType {
    #[serde(rename = "version.created")]
    VersionCreated,
    #[serde(rename = "label.moved")]
    LabelMoved,
    #[serde(rename = "round.completed")]
    RoundCompleted,
    #[serde(rename = "round.failed")]
    RoundFailed,
    /// `production` went back to an earlier version: an operator's rollback or the regression guard's.
    #[serde(rename = "prompt.rolled_back")]
    PromptRolledBack,
    /// A daily spending cap holds the prompt's learning back (at most once per prompt per UTC day).
    #[serde(rename = "budget.reached")]
    BudgetReached,
    /// A learned version waits for the operator's harness to evaluate it (a prompt's gate in `harness` mode).
    #[serde(rename = "version.evaluation_requested")]
    VersionEvaluationRequested,
    /// A learned version passed its regression gate (it may now be exposed).
    #[serde(rename = "version.gate_passed")]
    VersionGatePassed,
    /// A learned version failed its regression gate: it gets no live traffic.
    #[serde(rename = "version.rejected")]
    VersionRejected,
}

impl EventType {
    pub const ALL: [EventType; 9] = [
        EventType::VersionCreated,
        EventType::LabelMoved,
        EventType::RoundCompleted,
        EventType::RoundFailed,
        EventType::PromptRolledBack,
        EventType::BudgetReached,
        EventType::VersionEvaluationRequested,
        EventType::VersionGatePassed,
        EventType::VersionRejected,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            EventType::VersionCreated => "version.created",
            EventType::LabelMoved => "label.moved",
            EventType::RoundCompleted => "round.completed",
            EventType::RoundFailed => "round.failed",
            EventType::PromptRolledBack => "prompt.rolled_back",
            EventType::BudgetReached => "budget.reached",
            EventType::VersionEvaluationRequested => "version.evaluation_requested",
            EventType::VersionGatePassed => "version.gate_passed",
            EventType::VersionRejected => "version.rejected",
        }
    }

    pub fn parse(s: &str) -> Option<EventType> {
        EventType::ALL.into_iter().find(|e| e.as_str() == s)
    }
}

/// Subscribed event types as stored: space-separated, with a leading and a
/// trailing space so `LIKE '% label.moved %'` matches whole names only.
pub fn events_to_column(events: &[EventType]) -> String {
    let mut names: Vec<&str> = events.iter().map(|e| e.as_str()).collect();
    names.sort_unstable();
    names.dedup();
    format!(" {} ", names.join(" "))
}

pub fn events_from_column(s: &str) -> Option<Vec<EventType>> {
    s.split_whitespace().map(EventType::parse).collect()
}

/// The `LIKE` pattern that finds subscriptions to `event` in that column.
pub fn events_pattern(event: EventType) -> String {
    format!("% {} %", event.as_str())
}

/// One event ready for the outbox: its id (the `webhook-id` of every attempt
/// to every subscriber) and the exact body that will be signed and sent.
#[derive(Debug, Clone, PartialEq)]
pub struct OutboxEvent {
    pub id: String,
    pub kind: EventType,
    pub body: String,
    pub created_at: DateTime<Utc>,
    /// The prompt it concerns (every event names one): whose project's subscriptions hear of it.
    pub prompt: Option<PromptName>,
}

impl OutboxEvent {
    /// `data` names the prompt by its bare name; `project` is added beside
    /// it, so a server-wide subscriber tells two projects' `support-agent` apart.
    fn new(kind: EventType, prompt: &PromptName, mut data: Value) -> Self {
        let created_at = Utc::now();
        if let Value::Object(o) = &mut data {
            o.insert("prompt".into(), prompt.as_str().into());
            o.insert("project".into(), prompt.project().into());
        }
        let prompt = Some(prompt.clone());
        let body = json!({
            "type": kind.as_str(),
            "timestamp": created_at.to_rfc3339_opts(SecondsFormat::Millis, true),
            "data": data,
        });
        Self { id: format!("msg_{}", Uuid::now_v7().simple()), kind, body: body.to_string(), created_at, prompt }
    }

    pub fn version_created(v: &Version, labels: &[&str]) -> Self {
        Self::new(
            EventType::VersionCreated,
            &v.prompt,
            json!({
                "version": v.number,
                "parent": v.parent,
                "source": v.source.as_str(),
                "round_id": v.round_id,
                "content_hash": v.content_hash,
                "message": v.message,
                "created_by": v.created_by,
                "labels": labels,
            }),
        )
    }

    pub fn label_moved(prompt: &PromptName, label: &LabelName, to: i64, from: Option<i64>, by: &str) -> Self {
        Self::new(
            EventType::LabelMoved,
            prompt,
            json!({
                "label": label.as_str(), "version": to,
                "previous_version": from, "moved_by": by,
            }),
        )
    }

    /// A rollback of `label` from `from` to `to`, with the cause's kind, reason and numbers.
    pub fn rolled_back(
        prompt: &PromptName,
        label: &LabelName,
        to: i64,
        from: Option<i64>,
        by: &str,
        cause: &MoveCause,
    ) -> Self {
        Self::new(
            EventType::PromptRolledBack,
            prompt,
            json!({
                "label": label.as_str(), "version": to, "previous_version": from,
                "kind": cause.kind.as_str(), "moved_by": by, "reason": cause.reason, "evidence": cause.evidence,
            }),
        )
    }

    /// A round succeeded: with the version it published and the label that
    /// moved onto it, or with neither (`version` and `label` null, `unchanged`
    /// true) when what it learned left the prompt's content as it was.
    pub fn round_completed(prompt: &PromptName, round: Uuid, published: Option<(i64, &LabelName)>) -> Self {
        Self::new(
            EventType::RoundCompleted,
            prompt,
            json!({"round_id": round, "version": published.map(|(v, _)| v),
                   "label": published.map(|(_, l)| l.as_str()), "unchanged": published.is_none()}),
        )
    }

    /// `prompt`'s learning waits for a daily cap (`scope`) until `until`; `day` is the UTC day it counts.
    pub fn budget_reached(prompt: &PromptName, scope: &str, day: &str, until: DateTime<Utc>) -> Self {
        Self::new(
            EventType::BudgetReached,
            prompt,
            json!({"scope": scope, "day": day,
                   "until": until.to_rfc3339_opts(SecondsFormat::Secs, true)}),
        )
    }

    /// A version's gate awaits the operator's harness: what to evaluate, and
    /// where and until when to post the result.
    pub fn evaluation_requested(prompt: &PromptName, version: &Version, text: &str, gate: &Gate) -> Self {
        Self::new(
            EventType::VersionEvaluationRequested,
            prompt,
            json!({
                "version": version.number, "parent": version.parent,
                "text": text, "production_version": gate.production_version,
                "deadline": gate.deadline.map(|d| d.to_rfc3339_opts(SecondsFormat::Millis, true)),
                "result_path": format!("/v1/prompts/{}/versions/{}/evaluation", prompt.in_path(), version.number),
            }),
        )
    }

    /// A version's gate was decided: `version.gate_passed` or `version.rejected`, with the verdict.
    pub fn gate_decided(prompt: &PromptName, gate: &Gate) -> Self {
        let kind =
            if gate.status == GateStatus::Passed { EventType::VersionGatePassed } else { EventType::VersionRejected };
        let failing: Vec<&CaseComparison> = gate.cases.iter().filter(|c| c.regressed || !c.candidate.passed).collect();
        Self::new(
            kind,
            prompt,
            json!({
                "version": gate.version, "status": gate.status.as_str(),
                "mode": gate.mode.as_str(), "reason": gate.reason, "production_version": gate.production_version,
                "candidate_mean": gate.candidate_mean, "production_mean": gate.production_mean,
                "failing_cases": failing, "harness": gate.harness,
            }),
        )
    }

    pub fn round_failed(prompt: &PromptName, round: Uuid, attempt: i32, error: &str) -> Self {
        Self::new(EventType::RoundFailed, prompt, json!({"round_id": round, "attempt": attempt, "error": error}))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_names_round_trip_and_match_whole_words() {
        for e in EventType::ALL {
            assert_eq!(EventType::parse(e.as_str()), Some(e));
        }
        let col = events_to_column(&[EventType::RoundFailed, EventType::LabelMoved, EventType::LabelMoved]);
        assert_eq!(col, " label.moved round.failed ");
        assert_eq!(events_from_column(&col), Some(vec![EventType::LabelMoved, EventType::RoundFailed]));
        assert_eq!(events_pattern(EventType::LabelMoved), "% label.moved %");
        assert!(EventType::parse("label.*").is_none());
    }

    #[test]
    fn bodies_carry_type_timestamp_and_data() {
        let prompt = PromptName::new("team-a", "support").unwrap();
        let e = OutboxEvent::round_failed(&prompt, Uuid::nil(), 3, "the LLM kept timing out");
        let body: Value = serde_json::from_str(&e.body).unwrap();
        assert_eq!(body["type"], "round.failed");
        assert_eq!((&body["data"]["prompt"], &body["data"]["project"]), (&json!("support"), &json!("team-a")));
        assert!(DateTime::parse_from_rfc3339(body["timestamp"].as_str().unwrap()).is_ok());
        assert_eq!(body["data"]["error"], "the LLM kept timing out");
        assert!(e.id.starts_with("msg_"));
    }
}
