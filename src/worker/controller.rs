//! The stateful shell around the batch-size controller's pure rule
//! (`learn::controller`) and the capacity-aware group size (`learn::sizing`):
//! reads a prompt's round-time samples and overload meter from the store,
//! chooses, persists the choice when it changes, and exports it as metrics.

use std::{collections::HashMap, sync::Mutex};

use crate::{
    domain::{BatchSize, Prompt, PromptName, Strategy},
    learn::{
        controller::{Choice, ControllerConfig, Quality, Sample, choose},
        meter::{BucketCounts, MeterBucket},
        sizing::{GroupSize, choose_group_size},
    },
    store::{DynStore, StoreResult},
};

/// Samples read per prompt: enough for `window` samples at many sizes.
pub const SAMPLE_LIMIT: u32 = 500;

pub async fn samples(store: &DynStore, prompt: &PromptName) -> StoreResult<Vec<Sample>> {
    Ok(store
        .controller_samples(prompt, SAMPLE_LIMIT)
        .await?
        .into_iter()
        .map(|s| Sample { batch_size: s.batch_size, round_secs: s.round_secs })
        .collect())
}

/// The prompt's overload meter, bucket by bucket.
pub async fn meter(store: &DynStore, prompt: &PromptName) -> StoreResult<Vec<MeterBucket>> {
    Ok(store
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
pub async fn group_size(store: &DynStore, prompt: &Prompt, cfg: &ControllerConfig) -> StoreResult<GroupSize> {
    Ok(choose_group_size(&meter(store, &prompt.name).await?, cfg.target_retention, measurable(prompt)))
}

/// What the meter says about quality for this prompt (see [`Quality`]).
pub async fn quality(store: &DynStore, prompt: &Prompt, cfg: &ControllerConfig) -> StoreResult<Quality> {
    Ok(Quality::of(group_size(store, prompt, cfg).await?, prompt.settings.duplication, measurable(prompt)))
}

/// The batch a round of this prompt should take now, and why.
pub async fn current(store: &DynStore, prompt: &Prompt, backlog: u64, cfg: &ControllerConfig) -> StoreResult<Choice> {
    let quality = quality(store, prompt, cfg).await?;
    Ok(choose(&samples(store, &prompt.name).await?, backlog, &quality, cfg))
}

/// Remembers the last choice written per prompt, so the store is written only
/// when the rule or its bound changes (not on every new pending trace).
#[derive(Default)]
pub struct ChoiceLog {
    last: Mutex<HashMap<String, (u32, u32, String)>>,
}

impl ChoiceLog {
    pub async fn record(&self, store: &DynStore, prompt: &PromptName, choice: &Choice) -> StoreResult<()> {
        let rule = serde_json::to_value(&choice.reason)
            .ok()
            .and_then(|v| v.get("rule").and_then(|r| r.as_str()).map(str::to_owned))
            .unwrap_or_default();
        let key = (choice.target, choice.cap, rule);
        let changed = {
            let last = self.last.lock().unwrap_or_else(|e| e.into_inner());
            last.get(prompt.as_str()) != Some(&key)
        };
        if !changed {
            return Ok(());
        }
        let value = serde_json::to_value(choice).unwrap_or_default();
        store.save_controller_choice(prompt, &value).await?;
        self.last.lock().unwrap_or_else(|e| e.into_inner()).insert(prompt.to_string(), key);
        export(prompt, choice);
        tracing::info!(prompt = %prompt, cap = choice.cap, reason = %choice.reason, "batch size chosen");
        Ok(())
    }
}

pub fn export(prompt: &PromptName, choice: &Choice) {
    let name = prompt.to_string();
    metrics::gauge!("combee_controller_batch_size", "prompt" => name.clone()).set(f64::from(choice.cap));
    if let Some(fit) = choice.fit {
        metrics::gauge!("combee_controller_round_time_a", "prompt" => name.clone()).set(fit.a);
        metrics::gauge!("combee_controller_round_time_alpha", "prompt" => name.clone()).set(fit.alpha);
    }
}

/// The batch a trigger without an explicit size takes: the fixed size, or
/// the controller's latest bound, or its default before it has chosen.
pub async fn default_batch(store: &DynStore, prompt: &Prompt, cfg: &ControllerConfig) -> StoreResult<u32> {
    if let BatchSize::Fixed(n) = prompt.settings.batch_size {
        return Ok(n);
    }
    let stored = store.controller_choice(&prompt.name).await?;
    Ok(stored.and_then(|(v, _)| serde_json::from_value::<Choice>(v).ok()).map_or(cfg.default_batch, |c| c.cap.max(1)))
}
