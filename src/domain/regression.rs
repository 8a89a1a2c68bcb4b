//! Regression sets: the cases an operator knows must keep working, and the
//! gate that runs a learned version on them before it meets live traffic.
//! A case is an input (a string, chat messages or any object) and what must
//! hold of the reply: code checks (`evaluate::checks`) or a judge's rubric
//! (an LLM scores the reply, passing at `pass_score`); the gate's verdict
//! compares the version with production case by case. Pure types and rules:
//! reading the set, calling the model and moving labels happen elsewhere.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::ToSchema;
use uuid::Uuid;

use crate::evaluate::{
    checks::{self, Check, CompiledCheck},
    evaluators::MAX_RUBRIC_BYTES,
};

/// Most checks one case may carry.
pub const MAX_CHECKS_PER_CASE: usize = 20;
/// Longest case name, in characters.
pub const MAX_CASE_NAME_CHARS: usize = 200;
/// Most chat messages in one case's input.
pub const MAX_CASE_MESSAGES: usize = 50;
/// Longest reply kept in a case result, in characters.
pub const REPLY_CHARS_KEPT: usize = 2_000;

/// What a case asks of a reply (the column `kind`; the gate scores each
/// kind through this enum).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema, Default)]
#[serde(rename_all = "snake_case")]
pub enum CaseKind {
    /// Every check must pass (code checks, no model involved).
    #[default]
    Checks,
    /// An LLM judge scores the reply against the case's rubric; it passes at
    /// the case's `pass_score`.
    Judge,
}

impl CaseKind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Checks => "checks",
            Self::Judge => "judge",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        [Self::Checks, Self::Judge].into_iter().find(|k| k.as_str() == s)
    }
}

fn half() -> f64 {
    0.5
}

/// A judge-rubric case's judge: the rubric, as an LLM-judge evaluator's, and
/// the score at which the reply passes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CaseJudge {
    /// What a good reply is, in the operator's words (at most 8,192 bytes).
    #[schema(min_length = 1, max_length = 8192, pattern = r"\S")]
    pub rubric: String,
    /// The reply passes when the judge's score (0–1) is at least this; default 0.5.
    #[serde(default = "half")]
    #[schema(minimum = 0.0, maximum = 1.0)]
    pub pass_score: f64,
}

impl CaseJudge {
    pub fn validate(&self) -> Result<(), String> {
        if self.rubric.trim().is_empty() {
            return Err("`judge.rubric` must not be empty".into());
        }
        if self.rubric.len() > MAX_RUBRIC_BYTES {
            return Err(format!("`judge.rubric` is {} bytes; the limit is {MAX_RUBRIC_BYTES}", self.rubric.len()));
        }
        if !(0.0..=1.0).contains(&self.pass_score) {
            return Err("`judge.pass_score` must be between 0 and 1".into());
        }
        Ok(())
    }
}

/// Where a case came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum CaseSource {
    /// Written by hand (`POST …/regression-cases`).
    Manual,
    /// A pinned trace (`POST /v1/traces/{id}/pin`).
    Trace,
    /// A line of an imported JSON Lines file.
    Import,
}

impl CaseSource {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Manual => "manual",
            Self::Trace => "trace",
            Self::Import => "import",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        [Self::Manual, Self::Trace, Self::Import].into_iter().find(|k| k.as_str() == s)
    }
}

/// A case as it is added, before the store gives it an id.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct NewCase {
    pub name: Option<String>,
    #[schema(value_type = Object)]
    pub input: Value,
    /// Code checks (a `checks` case); empty for a judge-rubric case.
    pub checks: Vec<Check>,
    /// The judge of a judge-rubric case.
    pub judge: Option<CaseJudge>,
    pub source: CaseSource,
    pub trace_id: Option<Uuid>,
}

/// One stored case of a prompt's regression set.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct RegressionCase {
    pub id: Uuid,
    pub name: Option<String>,
    pub kind: CaseKind,
    #[schema(value_type = Object)]
    pub input: Value,
    /// Code checks (kind `checks`); empty for a judge-rubric case.
    pub checks: Vec<Check>,
    /// The rubric and pass score (kind `judge`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub judge: Option<CaseJudge>,
    pub source: CaseSource,
    /// The trace it was pinned from.
    pub trace_id: Option<Uuid>,
    pub created_by: String,
    pub created_at: DateTime<Utc>,
}

impl NewCase {
    pub fn kind(&self) -> CaseKind {
        if self.judge.is_some() { CaseKind::Judge } else { CaseKind::Checks }
    }

    /// Checks a case at the edge: the name, the input's shape and size, the
    /// checks (each one compiled) or the judge. The error says what is wrong, for a 422.
    pub fn validate(&self, max_input_bytes: usize) -> Result<(), String> {
        if let Some(name) = &self.name
            && (name.trim().is_empty() || name.chars().count() > MAX_CASE_NAME_CHARS)
        {
            return Err(format!("`name` must be 1 to {MAX_CASE_NAME_CHARS} characters"));
        }
        let size = serde_json::to_vec(&self.input).map_or(usize::MAX, |v| v.len());
        if size > max_input_bytes {
            return Err(format!("`input` is {size} bytes; the limit is {max_input_bytes}"));
        }
        input_messages(&self.input)?;
        if let Some(judge) = &self.judge {
            if !self.checks.is_empty() {
                return Err("a case has `checks` or a `judge` rubric, not both".into());
            }
            return judge.validate();
        }
        if self.checks.is_empty() {
            return Err(
                "`checks` must hold at least one check, or give a `judge` rubric: a case says what must hold".into()
            );
        }
        if self.checks.len() > MAX_CHECKS_PER_CASE {
            return Err(format!("`checks` holds {} checks; the limit is {MAX_CHECKS_PER_CASE}", self.checks.len()));
        }
        for (i, c) in self.checks.iter().enumerate() {
            c.clone().compile().map_err(|e| format!("`checks[{i}]`: {e}"))?;
        }
        Ok(())
    }
}

/// One turn of a case's conversation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CaseMessage {
    pub role: String,
    pub content: String,
}

/// The conversation a case's input stands for: a string is one user message;
/// an array of `{role, content}` (roles `system`, `user`, `assistant`) is the
/// conversation as it is; any other JSON value is one user message holding
/// that JSON. The version under test is always the first system message.
pub fn input_messages(input: &Value) -> Result<Vec<CaseMessage>, String> {
    match input {
        Value::String(s) if s.trim().is_empty() => Err("`input` must not be empty".into()),
        Value::String(s) => Ok(vec![CaseMessage { role: "user".into(), content: s.clone() }]),
        Value::Array(items) => {
            if items.is_empty() || items.len() > MAX_CASE_MESSAGES {
                return Err(format!("`input` as messages must hold 1 to {MAX_CASE_MESSAGES} messages"));
            }
            items
                .iter()
                .enumerate()
                .map(|(i, m)| {
                    let msg: CaseMessage = serde_json::from_value(m.clone())
                        .map_err(|_| format!("`input[{i}]` must be a message {{\"role\": …, \"content\": \"…\"}}"))?;
                    if !["system", "user", "assistant"].contains(&msg.role.as_str()) {
                        return Err(format!("`input[{i}].role` must be system, user or assistant"));
                    }
                    Ok(msg)
                })
                .collect()
        }
        Value::Null => Err("`input` is required".into()),
        other => Ok(vec![CaseMessage { role: "user".into(), content: other.to_string() }]),
    }
}

/// What one version's reply to one case scored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct CaseRun {
    pub case_id: Uuid,
    /// Share of the case's applicable checks passed (1 when none applied).
    pub score: f64,
    /// Every applicable check passed.
    pub passed: bool,
    #[serde(default)]
    pub critiques: Vec<String>,
    /// The reply (cut to 2,000 characters), or the call's error.
    pub reply: String,
    #[serde(default)]
    pub error: Option<String>,
    /// False when the case could not be scored this run (a judge-rubric
    /// case whose judge call failed): neither a pass nor a fail, left out of
    /// the comparison and the means.
    #[serde(default = "yes")]
    pub evaluated: bool,
}

fn yes() -> bool {
    true
}

impl CaseRun {
    /// Scores `reply` against `checks` (compiled from the case's).
    pub fn scored(case_id: Uuid, checks: &[CompiledCheck], reply: &str) -> Self {
        let s = checks::score(checks, reply, &Value::Null);
        let (score, critiques) = s.map_or((1.0, Vec::new()), |s| (s.score, s.critiques));
        Self {
            case_id,
            score,
            passed: critiques.is_empty(),
            critiques,
            reply: cut(reply),
            error: None,
            evaluated: true,
        }
    }

    /// A judge's `score` of `reply`: it passes at `pass_score`.
    pub fn judged(case_id: Uuid, reply: &str, score: f64, critique: &str, pass_score: f64) -> Self {
        let critiques = if critique.trim().is_empty() { Vec::new() } else { vec![critique.to_owned()] };
        Self { case_id, score, passed: score >= pass_score, critiques, reply: cut(reply), error: None, evaluated: true }
    }

    /// The judge gave no usable answer: the case is not evaluated this run.
    pub fn not_evaluated(case_id: Uuid, reply: &str, why: &str) -> Self {
        Self {
            case_id,
            score: 0.0,
            passed: false,
            critiques: vec![format!("not evaluated: {why}")],
            reply: cut(reply),
            error: Some(cut(why)),
            evaluated: false,
        }
    }

    /// The model did not answer: the case counts as failed with score 0.
    pub fn failed(case_id: Uuid, error: &str) -> Self {
        Self {
            case_id,
            score: 0.0,
            passed: false,
            critiques: vec![format!("no reply: {error}")],
            reply: String::new(),
            error: Some(cut(error)),
            evaluated: true,
        }
    }
}

fn cut(s: &str) -> String {
    s.chars().take(REPLY_CHARS_KEPT).collect()
}

/// The state of a version's gate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum GateStatus {
    /// Waiting for a worker to run the set.
    Pending,
    /// Waiting for the operator's harness to post its result.
    AwaitingHarness,
    /// The version may be exposed (or, under `manual`, is fit for the operator's decision).
    Passed,
    /// The version is not exposed.
    Rejected,
}

impl GateStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::AwaitingHarness => "awaiting_harness",
            Self::Passed => "passed",
            Self::Rejected => "rejected",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        [Self::Pending, Self::AwaitingHarness, Self::Passed, Self::Rejected].into_iter().find(|k| k.as_str() == s)
    }

    pub fn is_decided(self) -> bool {
        matches!(self, Self::Passed | Self::Rejected)
    }
}

/// How a prompt's gate judges: combee runs the set itself, or the operator's
/// harness does (for agents combee cannot run: tools, several turns).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema, Default)]
#[serde(rename_all = "snake_case")]
pub enum GateMode {
    #[default]
    Cases,
    Harness,
}

impl GateMode {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Cases => "cases",
            Self::Harness => "harness",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        [Self::Cases, Self::Harness].into_iter().find(|k| k.as_str() == s)
    }
}

/// One case of a gate's verdict: the version's run beside production's.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct CaseComparison {
    pub case_id: Uuid,
    pub name: Option<String>,
    pub candidate: CaseRun,
    pub production: Option<CaseRun>,
    /// Production passes this case and the version does not (both evaluated).
    pub regressed: bool,
}

impl CaseComparison {
    /// The version's run, or production's, could not be scored.
    pub fn not_evaluated(&self) -> bool {
        !self.candidate.evaluated || self.production.as_ref().is_some_and(|p| !p.evaluated)
    }
}

/// A version's gate: its state and, once decided, the verdict with its evidence.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Gate {
    pub version: i64,
    pub status: GateStatus,
    pub mode: GateMode,
    /// The production version it was compared with.
    pub production_version: Option<i64>,
    pub candidate_mean: Option<f64>,
    pub production_mean: Option<f64>,
    pub margin: f64,
    /// Why it passed or was rejected, in words.
    pub reason: Option<String>,
    /// Every case, the failing ones first.
    #[serde(default)]
    pub cases: Vec<CaseComparison>,
    /// What the harness posted (harness mode).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub harness: Option<Value>,
    /// Harness mode: no answer by then means rejected.
    pub deadline: Option<DateTime<Utc>>,
    /// What the gate's LLM calls cost (both versions' runs made for it).
    #[serde(default)]
    pub usage: GateUsage,
    pub created_at: DateTime<Utc>,
    pub decided_at: Option<DateTime<Utc>>,
}

impl Gate {
    /// The verdict in short, as label-history evidence: every move of
    /// `production` to a gated version carries it, whoever made the move.
    pub fn evidence(&self) -> Value {
        serde_json::json!({
            "status": self.status.as_str(), "mode": self.mode.as_str(), "reason": self.reason,
            "production_version": self.production_version, "candidate_mean": self.candidate_mean,
            "production_mean": self.production_mean, "margin": self.margin, "cases": self.cases.len(),
            "failed_cases": self.cases.iter().filter(|c| !c.candidate.passed).count(),
        })
    }
}

/// The LLM calls a gate made: how many, their tokens and cost (USD, at the configured prices).
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize, ToSchema)]
pub struct GateUsage {
    pub calls: u64,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub cost_usd: f64,
}

impl GateUsage {
    pub fn add(&mut self, other: GateUsage) {
        self.calls += other.calls;
        self.prompt_tokens += other.prompt_tokens;
        self.completion_tokens += other.completion_tokens;
        self.cost_usd += other.cost_usd;
    }
}

/// The gate's rule: a version that fails a case production passes, or whose
/// mean score is below production's by more than `margin`, is rejected.
/// `runs` pairs each case (its id and name) with the version's and
/// production's runs. A case either side could not score (its judge failed)
/// decides nothing: a version that fails another case production passes is
/// still rejected, but otherwise the answer is [`GateStatus::Pending`] (the
/// gate runs again), never a pass made up from the cases that were scored.
pub fn verdict(
    runs: Vec<(Uuid, Option<String>, CaseRun, Option<CaseRun>)>,
    margin: f64,
) -> (GateStatus, String, Vec<CaseComparison>) {
    let mut cases: Vec<CaseComparison> = runs
        .into_iter()
        .map(|(case_id, name, candidate, production)| {
            let regressed = production.as_ref().is_some_and(|p| p.evaluated && p.passed)
                && candidate.evaluated
                && !candidate.passed;
            CaseComparison { case_id, name, candidate, production, regressed }
        })
        .collect();
    cases.sort_by_key(|c| (!c.regressed, c.candidate.passed));
    let (cand, prod) = means(&cases);
    let regressed = cases.iter().filter(|c| c.regressed).count();
    if cases.is_empty() {
        return (GateStatus::Passed, "the regression set is empty".into(), cases);
    }
    if regressed > 0 {
        let names: Vec<String> = cases
            .iter()
            .filter(|c| c.regressed)
            .map(|c| c.name.clone().unwrap_or_else(|| c.case_id.to_string()))
            .collect();
        return (
            GateStatus::Rejected,
            format!("fails {regressed} case(s) production passes: {}", names.join(", ")),
            cases,
        );
    }
    let unscored: Vec<String> = cases
        .iter()
        .filter(|c| c.not_evaluated())
        .map(|c| c.name.clone().unwrap_or_else(|| c.case_id.to_string()))
        .collect();
    if !unscored.is_empty() {
        return (
            GateStatus::Pending,
            format!("{} case(s) not evaluated (the judge failed): {}", unscored.len(), unscored.join(", ")),
            cases,
        );
    }
    if let (Some(c), Some(p)) = (cand, prod)
        && c < p - margin
    {
        return (
            GateStatus::Rejected,
            format!("mean score {c:.3} is below production's {p:.3} by more than the margin {margin}"),
            cases,
        );
    }
    let how = match (cand, prod) {
        (Some(c), Some(p)) => format!("mean score {c:.3} (production {p:.3}), no case production passes is failed"),
        (Some(c), None) => format!("mean score {c:.3}; no production results to compare"),
        _ => "no case to compare".into(),
    };
    (GateStatus::Passed, how, cases)
}

/// The version's and production's mean scores over the cases each scored.
pub fn means(cases: &[CaseComparison]) -> (Option<f64>, Option<f64>) {
    let mean = |xs: Vec<f64>| (!xs.is_empty()).then(|| xs.iter().sum::<f64>() / xs.len() as f64);
    let cand = mean(cases.iter().filter(|c| c.candidate.evaluated).map(|c| c.candidate.score).collect());
    let prods: Vec<f64> =
        cases.iter().filter_map(|c| c.production.as_ref().filter(|p| p.evaluated).map(|p| p.score)).collect();
    (cand, mean(prods))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn run(id: u128, score: f64) -> CaseRun {
        CaseRun {
            case_id: Uuid::from_u128(id),
            score,
            passed: score >= 1.0,
            critiques: vec![],
            reply: String::new(),
            error: None,
            evaluated: true,
        }
    }

    #[test]
    fn inputs_become_conversations_and_bad_shapes_are_refused() {
        assert_eq!(input_messages(&json!("hi")).unwrap()[0].role, "user");
        let chat =
            input_messages(&json!([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])).unwrap();
        assert_eq!(chat.len(), 2);
        assert_eq!(input_messages(&json!({"q": 1})).unwrap()[0].content, r#"{"q":1}"#);
        assert!(input_messages(&json!([{"role": "tool", "content": "x"}])).unwrap_err().contains("input[0].role"));
        assert!(input_messages(&json!([])).is_err());
        assert!(input_messages(&json!("  ")).is_err());
    }

    #[test]
    fn a_case_needs_checks_that_compile_and_an_input_within_the_limit() {
        let case = |input: Value, checks: Vec<Check>| NewCase {
            name: Some("n".into()),
            input,
            checks,
            judge: None,
            source: CaseSource::Manual,
            trace_id: None,
        };
        let ok = vec![Check::Contains { text: "x".into(), case_sensitive: false }];
        assert!(case(json!("q"), ok.clone()).validate(100).is_ok());
        assert!(case(json!("q"), vec![]).validate(100).unwrap_err().contains("at least one"));
        assert!(case(json!("q".repeat(200)), ok).validate(100).unwrap_err().contains("limit is 100"));
        let bad = vec![Check::Regex { pattern: "(".into() }];
        assert!(case(json!("q"), bad).validate(100).unwrap_err().starts_with("`checks[0]`"));
    }

    #[test]
    fn a_case_production_passes_and_the_version_fails_rejects_it() {
        let (status, reason, cases) =
            verdict(vec![(Uuid::from_u128(1), Some("refunds".into()), run(1, 0.5), Some(run(1, 1.0)))], 0.5);
        assert_eq!(status, GateStatus::Rejected);
        assert!(reason.contains("refunds"), "{reason}");
        assert!(cases[0].regressed);
    }

    #[test]
    fn a_lower_mean_beyond_the_margin_rejects_and_within_it_passes() {
        // Both fail both cases (no regression), the version scores lower on average.
        let runs = || {
            vec![
                (Uuid::from_u128(1), None, run(1, 0.5), Some(run(1, 0.9))),
                (Uuid::from_u128(2), None, run(2, 0.5), Some(run(2, 0.9))),
            ]
        };
        assert_eq!(verdict(runs(), 0.1).0, GateStatus::Rejected);
        assert_eq!(verdict(runs(), 0.5).0, GateStatus::Passed);
        // A case production fails too is no regression.
        let (status, _, cases) = verdict(vec![(Uuid::from_u128(1), None, run(1, 0.0), Some(run(1, 0.0)))], 0.0);
        assert_eq!(status, GateStatus::Passed);
        assert!(!cases[0].regressed);
        assert_eq!(verdict(vec![], 0.0).0, GateStatus::Passed);
    }

    #[test]
    fn a_run_scores_the_reply_with_the_cases_checks() {
        let checks = vec![Check::NotContains { text: "skip".into(), case_sensitive: false }.compile().unwrap()];
        assert!(CaseRun::scored(Uuid::nil(), &checks, "all checked").passed);
        let failed = CaseRun::scored(Uuid::nil(), &checks, "I skip it");
        assert_eq!((failed.passed, failed.score), (false, 0.0));
        assert!(!CaseRun::failed(Uuid::nil(), "timeout").passed);
    }

    #[test]
    fn a_judge_case_takes_a_rubric_instead_of_checks() {
        let judge = |rubric: &str, pass_score: f64| NewCase {
            name: None,
            input: json!("q"),
            checks: vec![],
            judge: Some(CaseJudge { rubric: rubric.into(), pass_score }),
            source: CaseSource::Manual,
            trace_id: None,
        };
        assert!(judge("Polite and right.", 0.5).validate(100).is_ok());
        assert_eq!(judge("Polite.", 0.5).kind(), CaseKind::Judge);
        assert!(judge("  ", 0.5).validate(100).unwrap_err().contains("rubric"));
        assert!(judge("ok", 1.5).validate(100).unwrap_err().contains("pass_score"));
        let mut both = judge("ok", 0.5);
        both.checks = vec![Check::Contains { text: "x".into(), case_sensitive: false }];
        assert!(both.validate(100).unwrap_err().contains("not both"));
        let read: CaseJudge = serde_json::from_value(json!({"rubric": "r"})).unwrap();
        assert_eq!(read.pass_score, 0.5);
        assert_eq!(CaseKind::parse("judge"), Some(CaseKind::Judge));
        let run = CaseRun::judged(Uuid::nil(), "hi", 0.6, "fine", 0.6);
        assert!(run.passed && run.evaluated);
        assert!(!CaseRun::judged(Uuid::nil(), "hi", 0.59, "", 0.6).passed);
    }

    #[test]
    fn a_case_not_evaluated_decides_nothing_unless_another_regressed() {
        let unscored = |id: u128| CaseRun { evaluated: false, ..run(id, 0.0) };
        // Production passes, the version's judge failed: no made-up verdict.
        let (status, reason, cases) =
            verdict(vec![(Uuid::from_u128(1), Some("tone".into()), unscored(1), Some(run(1, 1.0)))], 0.05);
        assert_eq!(status, GateStatus::Pending, "{reason}");
        assert!(reason.contains("not evaluated") && reason.contains("tone"), "{reason}");
        assert!(!cases[0].regressed);
        // Production's judge failed: the same.
        let (status, _, _) = verdict(vec![(Uuid::from_u128(1), None, run(1, 1.0), Some(unscored(1)))], 0.05);
        assert_eq!(status, GateStatus::Pending);
        // Another case regressed: rejected all the same.
        let (status, _, _) = verdict(
            vec![
                (Uuid::from_u128(1), None, unscored(1), Some(run(1, 1.0))),
                (Uuid::from_u128(2), None, run(2, 0.0), Some(run(2, 1.0))),
            ],
            0.05,
        );
        assert_eq!(status, GateStatus::Rejected);
        // An old run without the member reads as evaluated.
        let old: CaseRun =
            serde_json::from_value(json!({"case_id": Uuid::nil(), "score": 1.0, "passed": true, "reply": "r"}))
                .unwrap();
        assert!(old.evaluated);
    }
}
