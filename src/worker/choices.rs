//! The batch-size controller's choices as the worker keeps them: persists a
//! prompt's choice when it changes and exports it as metrics. What the
//! controller reads (samples, meter, the choice for a backlog) is in
//! `service::controller`, shared with the operators' view. Each series names
//! its prompt and the prompt's project.

use std::{collections::HashMap, sync::Mutex};

use crate::{
    domain::PromptName,
    learn::capacity::batch_size::Choice,
    store::{DynStore, StoreResult},
};

/// Remembers the last choice written per prompt, so the store is written only
/// when the rule or its bound changes (not on every new pending trace).
#[derive(Default)]
pub struct ChoiceLog {
    /// By the prompt's full name: two projects' prompts of one name are two entries.
    last: Mutex<HashMap<PromptName, (u32, u32, String)>>,
}

impl ChoiceLog {
    pub async fn record(
        &self,
        store: &DynStore,
        prompt: &PromptName,
        project: &str,
        choice: &Choice,
    ) -> StoreResult<()> {
        let rule = serde_json::to_value(&choice.reason)
            .ok()
            .and_then(|v| v.get("rule").and_then(|r| r.as_str()).map(str::to_owned))
            .unwrap_or_default();
        let key = (choice.target, choice.cap, rule);
        let changed = {
            let last = self.last.lock().unwrap_or_else(|e| e.into_inner());
            last.get(prompt) != Some(&key)
        };
        if !changed {
            return Ok(());
        }
        let value = serde_json::to_value(choice).unwrap_or_default();
        store.save_controller_choice(prompt, &value).await?;
        self.last.lock().unwrap_or_else(|e| e.into_inner()).insert(prompt.clone(), key);
        export(prompt, project, choice);
        tracing::info!(prompt = %prompt, cap = choice.cap, reason = %choice.reason, "batch size chosen");
        Ok(())
    }
}

pub fn export(prompt: &PromptName, project: &str, choice: &Choice) {
    let labels = [("prompt", prompt.to_string()), ("project", project.to_owned())];
    metrics::gauge!("combee_controller_batch_size", &labels).set(f64::from(choice.cap));
    if let Some(fit) = choice.fit {
        metrics::gauge!("combee_controller_round_time_a", &labels).set(fit.a);
        metrics::gauge!("combee_controller_round_time_alpha", &labels).set(fit.alpha);
    }
}
