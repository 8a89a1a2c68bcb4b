//! The round journal backed by the store: reflections are written as they
//! arrive (so a resumed round does not pay for them again), every LLM call is
//! recorded, and phase timings and group outputs become the round's detail (a
//! resumed round reads its earlier group outputs back from it).

use std::{collections::HashMap, sync::Mutex};

use async_trait::async_trait;
use serde_json::{Value, json};
use uuid::Uuid;

use crate::{
    domain::Reflection,
    learn::journal::{JournalError, Phase, PhaseEvent, ReflectionSource, RoundJournal},
    llm::LlmCall,
    store::{DynStore, TraceFault},
};

pub struct StoreJournal {
    store: DynStore,
    round: Uuid,
    attempt: i32,
    detail: Mutex<Value>,
}

fn err(e: impl std::fmt::Display) -> JournalError {
    JournalError(e.to_string())
}

/// The traces a round's detail records as unreflected (`detail.unreflected`:
/// trace id → reason), as the faults they are charged for.
pub fn unreflected_faults(detail: &Value) -> Vec<TraceFault> {
    let Some(Value::Object(u)) = detail.get("unreflected") else { return Vec::new() };
    u.iter()
        .filter_map(|(id, reason)| {
            let trace_id = id.parse().ok()?;
            let reason = reason.as_str().unwrap_or("the reflection could not be obtained").to_owned();
            Some(TraceFault { trace_id, reason: format!("reflection failed: {reason}") })
        })
        .collect()
}

impl StoreJournal {
    pub fn new(store: DynStore, round: Uuid, attempt: i32, detail: Value) -> Self {
        let detail = if detail.is_object() { detail } else { json!({}) };
        Self { store, round, attempt, detail: Mutex::new(detail) }
    }

    pub fn detail(&self) -> Value {
        self.detail.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    async fn flush(&self) -> Result<(), JournalError> {
        let detail = self.detail();
        if self.store.update_round(self.round, self.attempt, None, &detail).await.map_err(err)? {
            Ok(())
        } else {
            Err(JournalError("the round's lease was lost".into()))
        }
    }
}

#[async_trait]
impl RoundJournal for StoreJournal {
    async fn stored_reflections(&self) -> Result<HashMap<Uuid, Reflection>, JournalError> {
        // A re-run over the same base version reuses what earlier rounds reflected.
        self.store.adopt_reflections(self.round).await.map_err(err)?;
        let rows = self.store.round_reflections(self.round).await.map_err(err)?;
        Ok(rows.into_iter().map(|(id, r, _)| (id, r)).collect())
    }

    async fn save_reflection(&self, trace: Uuid, r: &Reflection, source: ReflectionSource) -> Result<(), JournalError> {
        self.store.save_reflection(self.round, trace, r, source == ReflectionSource::Trace).await.map_err(err)?;
        let mut d = self.detail.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(Value::Object(u)) = d.get_mut("unreflected") {
            u.remove(&trace.to_string());
        }
        Ok(())
    }

    async fn record_unreflected(&self, trace: Uuid, error: &str) -> Result<(), JournalError> {
        {
            let mut d = self.detail.lock().unwrap_or_else(|e| e.into_inner());
            let map = d.as_object_mut().map(|o| o.entry("unreflected").or_insert_with(|| json!({})));
            if let Some(Value::Object(u)) = map {
                u.insert(trace.to_string(), json!(error));
            }
        }
        self.flush().await
    }

    async fn record_calls(&self, calls: &[LlmCall]) -> Result<(), JournalError> {
        for call in calls {
            self.store.record_llm_call(self.round, self.attempt, call).await.map_err(err)?;
        }
        Ok(())
    }

    async fn save_group_output(&self, group: usize, output: &Value) -> Result<(), JournalError> {
        {
            let mut d = self.detail.lock().unwrap_or_else(|e| e.into_inner());
            let groups = d.as_object_mut().map(|o| o.entry("group_outputs").or_insert_with(|| json!({})));
            if let Some(Value::Object(g)) = groups {
                g.insert(group.to_string(), output.clone());
            }
        }
        self.flush().await
    }

    async fn stored_group_outputs(&self) -> Result<Vec<Value>, JournalError> {
        // Saved one by one as an object by group index; a finished attempt leaves a list.
        let d = self.detail();
        Ok(match d.get("group_outputs") {
            Some(Value::Object(g)) => g.values().cloned().collect(),
            Some(Value::Array(g)) => g.clone(),
            _ => Vec::new(),
        })
    }

    async fn phase(&self, phase: Phase, event: PhaseEvent) -> Result<(), JournalError> {
        let name = serde_json::to_value(phase).ok().and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_default();
        {
            let mut d = self.detail.lock().unwrap_or_else(|e| e.into_inner());
            let phases = d.as_object_mut().map(|o| o.entry("phases").or_insert_with(|| json!({})));
            if let Some(Value::Object(p)) = phases {
                let now = chrono::Utc::now();
                let entry = p.entry(name).or_insert_with(|| json!({}));
                match event {
                    PhaseEvent::Started => entry["started_at"] = json!(now),
                    PhaseEvent::Finished { elapsed_ms } => {
                        entry["finished_at"] = json!(now);
                        entry["elapsed_ms"] = json!(elapsed_ms);
                    }
                }
            }
        }
        self.flush().await
    }
}
