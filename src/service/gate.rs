//! The regression gate's life around the version it guards: whether a
//! prompt's learned versions are gated at all (a set, or a harness), opening
//! a version's gate when it is published (held back from traffic), recording
//! the verdict, and — once it passed — exposing the version as the prompt's
//! policy says: `production` moves to it (`auto`, an `auto-publish` move with
//! the verdict as evidence), it joins the population as a challenger
//! (`evaluated`), or it waits for the operator with the verdict beside the
//! diff (`manual`). A rejected version stays what it is, unexposed. The
//! worker runs a set through the model (`worker::gate`); a harness posts its
//! result here.

use chrono::Utc;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use utoipa::ToSchema;

use super::{AppState, ServiceError, ServiceResult, arms, production::Mover, prompts::existing_prompt};
use crate::{
    config::RegressionSettings,
    domain::{
        LabelMoveKind, LabelName, MoveCause, Promotion, Prompt, PromptName, Version,
        event::OutboxEvent,
        label::{LabelMove, Selector},
        regression::{Gate, GateMode, GateStatus},
    },
    evaluate::population::PopulationPolicy,
    store::{DynStore, GateSettings, StoreError, StoreResult},
};

/// Longest reason a harness may give, in characters.
pub const MAX_HARNESS_REASON_CHARS: usize = 2_000;
/// Largest harness result kept, as JSON, in bytes.
pub const MAX_HARNESS_RESULT_BYTES: usize = 64 * 1024;

/// How the learned versions of `prompt` are gated: by the harness (harness
/// mode), by the set (cases mode with at least one case), or not at all.
pub async fn mode_for(store: &DynStore, prompt: &PromptName) -> StoreResult<Option<GateMode>> {
    let settings = store.gate_settings(prompt).await?;
    Ok(match settings.mode {
        GateMode::Harness => Some(GateMode::Harness),
        GateMode::Cases if store.regression_cases(prompt).await?.is_empty() => None,
        GateMode::Cases => Some(GateMode::Cases),
    })
}

/// Opens the gate of a just-published `version`: pending (a worker runs the
/// set), or awaiting the harness until the deadline, with the
/// `version.evaluation_requested` event in the same transaction.
pub async fn open(
    store: &DynStore,
    settings: &RegressionSettings,
    prompt: &PromptName,
    version: &Version,
    mode: GateMode,
) -> StoreResult<()> {
    let production = super::production::production_version(store, prompt).await?;
    let now = Utc::now();
    let mut gate = Gate {
        version: version.number,
        status: GateStatus::Pending,
        mode,
        production_version: production,
        candidate_mean: None,
        production_mean: None,
        margin: settings.margin,
        reason: None,
        cases: Vec::new(),
        harness: None,
        deadline: None,
        usage: Default::default(),
        created_at: now,
        decided_at: None,
    };
    if mode == GateMode::Harness {
        let secs = store.gate_settings(prompt).await?.harness_timeout_secs.unwrap_or(settings.harness_timeout_secs);
        gate.status = GateStatus::AwaitingHarness;
        gate.deadline = Some(now + chrono::Duration::seconds(secs.min(i64::MAX as u64 / 2) as i64));
        let event = OutboxEvent::evaluation_requested(prompt, version, &version.content.render(), &gate);
        return store.open_gate(prompt, &gate, Some(&event)).await;
    }
    store.open_gate(prompt, &gate, None).await
}

/// What the gate needs to expose a version: the store, the production mover
/// (with this process's cache, if it serves agents) and the population knobs.
pub struct Exposer<'a> {
    pub store: &'a DynStore,
    pub mover: Mover<'a>,
    pub population: PopulationPolicy,
}

impl<'a> Exposer<'a> {
    pub fn of(st: &'a AppState) -> Self {
        Self { store: &st.store, mover: Mover::of(st), population: st.settings.population.policy() }
    }

    /// Records a decided gate (`Conflict` when it was decided meanwhile) with
    /// its webhook event, then exposes a version that passed.
    pub async fn decide(&self, prompt: &Prompt, gate: &Gate) -> StoreResult<()> {
        self.store.decide_gate(&prompt.name, gate, &OutboxEvent::gate_decided(&prompt.name, gate)).await?;
        metrics::counter!("combee_regression_gates_total", "status" => gate.status.as_str()).increment(1);
        tracing::info!(prompt = %prompt.name, version = gate.version, status = gate.status.as_str(),
            reason = gate.reason.as_deref().unwrap_or(""), "regression gate decided");
        if gate.status == GateStatus::Passed {
            self.expose(prompt, gate).await?;
        }
        Ok(())
    }

    async fn expose(&self, prompt: &Prompt, gate: &Gate) -> StoreResult<()> {
        match prompt.promotion {
            Promotion::Auto => {
                let mv = LabelMove {
                    label: LabelName::production(),
                    to_version: gate.version,
                    expected_current: gate.production_version,
                    check_current: gate.production_version.is_some(),
                    by: "regression-gate".into(),
                };
                // The one door adds the gate's verdict to the evidence.
                let cause = MoveCause::new(LabelMoveKind::AutoPublish, "passed its regression gate");
                match self.mover.move_production(&prompt.name, &mv, &cause).await {
                    Ok(_) => Ok(()),
                    Err(StoreError::Conflict) => {
                        tracing::warn!(prompt = %prompt.name, version = gate.version,
                            "production moved while the gate ran; the version passed but is left as candidate");
                        Ok(())
                    }
                    Err(e) => Err(e),
                }
            }
            Promotion::Evaluated => {
                let parent = self
                    .store
                    .resolve(&prompt.name, &Selector::Version(gate.version))
                    .await?
                    .and_then(|r| r.version.parent);
                arms::add_challenger(self.store, &prompt.name, gate.version, parent, &self.population).await?;
                Ok(())
            }
            // The operator decides, with the verdict beside the diff.
            Promotion::Manual => Ok(()),
        }
    }
}

/// A version's gate (none: it was not gated).
pub async fn version_gate(st: &AppState, prompt: &PromptName, version: i64) -> ServiceResult<Option<Gate>> {
    Ok(st.store.gate(prompt, version).await?)
}

/// A prompt's gate settings as the API shows and takes them.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct GateSettingsView {
    /// `cases` (default): combee runs the set; `harness`: the operator's harness is asked.
    pub mode: GateMode,
    /// How long the harness is awaited (seconds); unset: `regression.harness_timeout_secs`.
    #[serde(default)]
    pub harness_timeout_secs: Option<u64>,
}

pub async fn gate_settings(st: &AppState, name: &PromptName) -> ServiceResult<GateSettingsView> {
    let prompt = existing_prompt(st, name).await?;
    let s = st.store.gate_settings(&prompt.name).await?;
    Ok(GateSettingsView { mode: s.mode, harness_timeout_secs: s.harness_timeout_secs })
}

pub async fn set_gate_settings(
    st: &AppState,
    name: &PromptName,
    v: GateSettingsView,
) -> ServiceResult<GateSettingsView> {
    let prompt = existing_prompt(st, name).await?;
    if v.harness_timeout_secs.is_some_and(|s| s == 0 || s > 30 * 86_400) {
        return Err(ServiceError::Unprocessable("`harness_timeout_secs` must be 1 to 2592000 (30 days)".into()));
    }
    let s = GateSettings { mode: v.mode, harness_timeout_secs: v.harness_timeout_secs };
    st.store.set_gate_settings(&prompt.name, &s).await?;
    Ok(v)
}

/// What an operator's harness posts back about a version.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct EvaluationResult {
    /// Whether the version may be exposed.
    pub passed: bool,
    /// The version's score on the harness's tasks (0–1), for the record.
    #[serde(default)]
    pub score: Option<f64>,
    /// Production's score on the same tasks (0–1), for the record.
    #[serde(default)]
    pub production_score: Option<f64>,
    #[serde(default)]
    pub reason: Option<String>,
    /// Per-task details, kept as they are (at most 64 KiB).
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub details: Option<Value>,
}

/// Records a harness's result on a gate awaiting it, and exposes the version
/// if it passed. 409 when the gate is not awaiting a harness (decided, or
/// the deadline passed: no answer in time means rejected).
pub async fn post_evaluation(
    st: &AppState,
    name: &PromptName,
    version: i64,
    result: EvaluationResult,
    by: &str,
) -> ServiceResult<Gate> {
    let prompt = existing_prompt(st, name).await?;
    for (what, s) in [("score", result.score), ("production_score", result.production_score)] {
        if s.is_some_and(|s| !(0.0..=1.0).contains(&s)) {
            return Err(ServiceError::Unprocessable(format!("`{what}` must be between 0 and 1")));
        }
    }
    if result.reason.as_ref().is_some_and(|r| r.chars().count() > MAX_HARNESS_REASON_CHARS) {
        return Err(ServiceError::Unprocessable(format!(
            "`reason` is longer than {MAX_HARNESS_REASON_CHARS} characters"
        )));
    }
    let posted = serde_json::to_value(&result).map_err(|e| ServiceError::Internal(e.into()))?;
    if posted.to_string().len() > MAX_HARNESS_RESULT_BYTES {
        return Err(ServiceError::PayloadTooLarge(format!(
            "the result is larger than {MAX_HARNESS_RESULT_BYTES} bytes"
        )));
    }
    let Some(mut gate) = st.store.gate(&prompt.name, version).await? else {
        return Err(ServiceError::not_found(format!("a gate of version {version}")));
    };
    if gate.status != GateStatus::AwaitingHarness {
        return Err(ServiceError::Conflict(format!(
            "version {version}'s gate is {}, not awaiting a harness",
            gate.status.as_str()
        )));
    }
    let now = Utc::now();
    if gate.deadline.is_some_and(|d| d < now) {
        return Err(ServiceError::Conflict(format!(
            "the harness's time for version {version} ran out; it is rejected (no answer in time)"
        )));
    }
    gate.status = if result.passed { GateStatus::Passed } else { GateStatus::Rejected };
    gate.candidate_mean = result.score;
    gate.production_mean = result.production_score;
    gate.reason = Some(result.reason.clone().unwrap_or_else(|| {
        if result.passed { "the harness passed it".into() } else { "the harness rejected it".into() }
    }));
    gate.harness = Some(json!({"result": posted, "posted_by": by}));
    gate.decided_at = Some(now);
    match Exposer::of(st).decide(&prompt, &gate).await {
        Ok(()) => Ok(gate),
        Err(StoreError::Conflict) => {
            Err(ServiceError::Conflict(format!("version {version}'s gate was decided meanwhile")))
        }
        Err(e) => Err(e.into()),
    }
}

/// Rejects gates whose harness did not answer in time; how many.
pub async fn expire_overdue(exposer: &Exposer<'_>) -> StoreResult<usize> {
    let overdue = exposer.store.overdue_gates(100).await?;
    let mut n = 0;
    for open in overdue {
        let Some(prompt) = exposer.store.get_prompt(&open.prompt).await? else { continue };
        let mut gate = open.gate;
        gate.status = GateStatus::Rejected;
        gate.reason = Some("the harness did not answer in time".into());
        gate.decided_at = Some(Utc::now());
        match exposer.decide(&prompt, &gate).await {
            Ok(()) => n += 1,
            Err(StoreError::Conflict) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}
