//! The stateful shell around the batch-size controller's pure math
//! (`learn::controller`): reads a prompt's delay samples from the store,
//! chooses, persists the choice when it changes, and exports it as metrics.

use std::{collections::HashMap, sync::Mutex};

use crate::{
    domain::{BatchSize, Prompt, PromptName},
    learn::controller::{Choice, ControllerConfig, Sample, choose},
    store::{DynStore, StoreResult},
};

/// Samples read per prompt: enough for `window` samples at every ladder size.
pub const SAMPLE_LIMIT: u32 = 500;

pub async fn samples(store: &DynStore, prompt: &PromptName) -> StoreResult<Vec<Sample>> {
    Ok(store
        .controller_samples(prompt, SAMPLE_LIMIT)
        .await?
        .into_iter()
        .map(|s| Sample { batch_size: s.batch_size, round_secs: s.round_secs })
        .collect())
}

/// The size a round of this prompt should have now, and why.
pub async fn current(
    store: &DynStore,
    prompt: &PromptName,
    backlog: u64,
    cfg: &ControllerConfig,
) -> StoreResult<Choice> {
    Ok(choose(&samples(store, prompt).await?, backlog, cfg))
}

/// Remembers the last choice written per prompt, so the store is written only on change.
#[derive(Default)]
pub struct ChoiceLog {
    last: Mutex<HashMap<String, Choice>>,
}

impl ChoiceLog {
    pub async fn record(&self, store: &DynStore, prompt: &PromptName, choice: &Choice) -> StoreResult<()> {
        let changed = {
            let last = self.last.lock().unwrap_or_else(|e| e.into_inner());
            last.get(prompt.as_str()) != Some(choice)
        };
        if !changed {
            return Ok(());
        }
        let value = serde_json::to_value(choice).unwrap_or_default();
        store.save_controller_choice(prompt, &value).await?;
        self.last.lock().unwrap_or_else(|e| e.into_inner()).insert(prompt.to_string(), choice.clone());
        export(prompt, choice);
        tracing::info!(prompt = %prompt, target = choice.target, reason = %choice.reason, "batch size chosen");
        Ok(())
    }
}

pub fn export(prompt: &PromptName, choice: &Choice) {
    let name = prompt.to_string();
    metrics::gauge!("combee_controller_batch_size", "prompt" => name.clone()).set(f64::from(choice.target));
    if let Some(fit) = choice.fit {
        metrics::gauge!("combee_controller_fit_alpha", "prompt" => name.clone()).set(fit.alpha);
        metrics::gauge!("combee_controller_fit_a", "prompt" => name.clone()).set(fit.a);
        metrics::gauge!("combee_controller_fit_r2", "prompt" => name.clone()).set(fit.r2);
    }
    if let Some(p) = choice.plateau {
        metrics::gauge!("combee_controller_plateau", "prompt" => name).set(p);
    }
}

/// The batch a trigger without an explicit size takes: the fixed size, or
/// the controller's latest target, or its default before it has chosen.
pub async fn default_batch(store: &DynStore, prompt: &Prompt, cfg: &ControllerConfig) -> StoreResult<u32> {
    if let BatchSize::Fixed(n) = prompt.settings.batch_size {
        return Ok(n);
    }
    let stored = store.controller_choice(&prompt.name).await?;
    Ok(stored
        .and_then(|(v, _)| serde_json::from_value::<Choice>(v).ok())
        .map_or(cfg.default_batch, |c| c.target.max(1)))
}
