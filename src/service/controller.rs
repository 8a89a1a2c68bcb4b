//! The batch-size controller of one prompt: what it reads from the store (the
//! round-time samples, the overload meter, its last choice) and the choices it
//! makes from them, for the worker's scheduler and a trigger's default batch;
//! and the view operators see of it — the per-size profile, the fitted round
//! time R(bs) = A·bs^(−α), the chosen batch and the bound that set it, and the
//! overload meter (the estimated per-group retention by group size, see
//! [`crate::learn::capacity::meter`]) with the group size it gives the next round. The
//! API and the web UI show the same view.

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;
use utoipa::ToSchema;

use super::{AppState, ServiceError, ServiceResult};
use crate::{
    domain::{BatchSize, Prompt, PromptName, Strategy},
    learn::{
        capacity::batch_size::{self, Choice, ControllerConfig, Quality, RoundSample, choose},
        capacity::meter::{BucketCounts, MeterBucket},
        capacity::sizing::{GroupSize, choose_group_size},
    },
    store::ControllerSample,
};

/// Samples read per prompt: enough for `window` samples at many sizes (and
/// all that retention keeps of a prompt's old rounds).
pub const SAMPLE_LIMIT: u32 = crate::store::CONTROLLER_SAMPLES_KEPT;

pub async fn samples(st: &AppState, prompt: &PromptName) -> ServiceResult<Vec<RoundSample>> {
    Ok(st
        .store
        .controller_samples(prompt, SAMPLE_LIMIT)
        .await?
        .into_iter()
        .map(|s| RoundSample { batch_size: s.batch_size, round_secs: s.round_secs })
        .collect())
}

/// The prompt's overload meter, bucket by bucket.
pub async fn meter(st: &AppState, prompt: &PromptName) -> ServiceResult<Vec<MeterBucket>> {
    Ok(st
        .store
        .meter_counts(prompt)
        .await?
        .into_iter()
        .map(|c| MeterBucket::new(c.size_min, BucketCounts { marked: c.marked, recaptured: c.recaptured }, c.rounds))
        .collect())
}

/// Whether the overload meter can measure this prompt: playbook rounds with
/// every reflection in at least two groups (p ≥ 2).
pub fn measurable(prompt: &Prompt) -> bool {
    prompt.strategy == Strategy::Playbook && prompt.settings.duplication >= 2
}

/// The level-1 group size a round of this prompt uses now, from its meter.
pub async fn group_size(st: &AppState, prompt: &Prompt, cfg: &ControllerConfig) -> ServiceResult<GroupSize> {
    Ok(choose_group_size(&meter(st, &prompt.name).await?, cfg.target_retention, measurable(prompt)))
}

/// What the meter says about quality for this prompt (see [`Quality`]).
pub async fn quality(st: &AppState, prompt: &Prompt, cfg: &ControllerConfig) -> ServiceResult<Quality> {
    Ok(Quality::of(group_size(st, prompt, cfg).await?, prompt.settings.duplication, measurable(prompt)))
}

/// The batch a round of this prompt should take now, and why.
pub async fn current(st: &AppState, prompt: &Prompt, backlog: u64, cfg: &ControllerConfig) -> ServiceResult<Choice> {
    let quality = quality(st, prompt, cfg).await?;
    Ok(choose(&samples(st, &prompt.name).await?, backlog, &quality, cfg))
}

/// The batch a trigger without an explicit size takes: the fixed size, or
/// the controller's latest bound, or its default before it has chosen.
pub async fn default_batch(st: &AppState, prompt: &Prompt, cfg: &ControllerConfig) -> ServiceResult<u32> {
    if let BatchSize::Fixed(n) = prompt.settings.batch_size {
        return Ok(n);
    }
    let stored = st.store.controller_choice(&prompt.name).await?;
    Ok(stored.and_then(|(v, _)| serde_json::from_value::<Choice>(v).ok()).map_or(cfg.default_batch, |c| c.cap.max(1)))
}

#[derive(Debug, Serialize, ToSchema)]
pub struct CurvePoint {
    pub batch_size: u32,
    /// Median round wall time at this size (seconds).
    pub round_secs: f64,
    /// (N/bs)·R(bs): how long the current backlog N would take at this size (seconds).
    pub delay_secs: f64,
    /// The fitted round time R at this size, when there is a fit.
    pub fitted_round_secs: Option<f64>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ControllerView {
    pub prompt: String,
    /// `auto` (the controller chooses) or `fixed`.
    pub mode: &'static str,
    pub fixed_batch_size: Option<u32>,
    /// Pending traces not yet in a round (N).
    pub backlog: i64,
    pub samples: Vec<ControllerSample>,
    /// One point per profiled size, for plotting.
    pub curve: Vec<CurvePoint>,
    /// What the controller would choose now: batch, start threshold (`target`),
    /// bound (`cap`), the rule that set it, the round-time fit and the quality state.
    #[schema(value_type = Object)]
    pub choice: Value,
    pub reason: String,
    /// The last choice the worker recorded, and when.
    #[schema(value_type = Option<Object>)]
    pub last_choice: Option<Value>,
    pub last_choice_at: Option<DateTime<Utc>>,
    #[schema(value_type = Object)]
    pub config: Value,
    /// The overload meter: estimated retention of a level-1 group by size.
    pub meter: MeterView,
}

/// The overload meter as operators see it.
#[derive(Debug, Serialize, ToSchema)]
pub struct MeterView {
    /// How the estimate is made, in one sentence.
    pub method: &'static str,
    /// One entry per group-size bucket seen so far, smallest first.
    pub buckets: Vec<MeterBucket>,
    /// The level-1 group size the next round gets from the meter, and why.
    #[schema(value_type = Object)]
    pub group_size: Value,
    /// The knob: the share of a group's insights its answer should keep.
    pub target_retention: f64,
}

/// What [`MeterView::method`] says.
pub const METER_METHOD: &str = "capture-recapture over the p >= 2 copies of each reflection: among copies whose \
reflection another copy's group cited, the share their own group cited too";

/// The controller as the route and the web UI show it.
pub async fn controller_view(st: &AppState, name: &PromptName) -> ServiceResult<ControllerView> {
    let name = name.clone();
    let backlog = st
        .store
        .backlogs()
        .await?
        .into_iter()
        .find(|b| b.prompt.name == name)
        .ok_or_else(|| ServiceError::not_found(format_args!("prompt {name:?}")))?;
    let cfg = &st.settings.controller;
    let samples = st.store.controller_samples(&name, SAMPLE_LIMIT).await?;
    let plain: Vec<RoundSample> =
        samples.iter().map(|s| RoundSample { batch_size: s.batch_size, round_secs: s.round_secs }).collect();
    let n = backlog.pending.max(0) as u64;
    let quality = quality(st, &backlog.prompt, cfg).await?;
    let choice = batch_size::choose(&plain, n, &quality, cfg);
    let curve = batch_size::profile(&plain, cfg.window)
        .into_iter()
        .map(|(bs, secs)| CurvePoint {
            batch_size: bs,
            round_secs: secs,
            delay_secs: n.max(1) as f64 / f64::from(bs) * secs,
            fitted_round_secs: choice.fit.map(|f| f.delay(f64::from(bs))),
        })
        .collect();
    let last = st.store.controller_choice(&name).await?;
    let buckets = meter(st, &name).await?;
    let group_size = choose_group_size(&buckets, cfg.target_retention, measurable(&backlog.prompt));
    let group_size = serde_json::json!({
        "max_group": group_size.max_group,
        "probe_group": group_size.probe_group,
        "source": group_size.source,
        "message": group_size.message(),
    });
    let (mode, fixed_batch_size) = match backlog.prompt.settings.batch_size {
        BatchSize::Auto => ("auto", None),
        BatchSize::Fixed(n) => ("fixed", Some(n)),
    };
    Ok(ControllerView {
        prompt: name.to_string(),
        mode,
        fixed_batch_size,
        backlog: backlog.pending,
        samples,
        curve,
        reason: choice.reason.message(),
        choice: serde_json::to_value(&choice).unwrap_or_default(),
        last_choice_at: last.as_ref().map(|(_, t)| *t),
        last_choice: last.map(|(v, _)| v),
        config: serde_json::to_value(cfg).unwrap_or_default(),
        meter: MeterView { method: METER_METHOD, buckets, group_size, target_retention: cfg.target_retention },
    })
}
