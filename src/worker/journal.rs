//! The round journal backed by the store: reflections are written as they
//! arrive (so a resumed round does not pay for them again), every LLM call is
//! recorded, and phase timings and group outputs become the round's detail (a
//! resumed round reads its earlier group outputs back from it).

use std::{collections::HashMap, sync::Mutex};

use async_trait::async_trait;
use uuid::Uuid;

use crate::{
    domain::{GroupOutput, Reflection, RoundDetail, round_detail::PhaseSpan},
    learn::round::journal::{JournalError, Phase, PhaseEvent, ReflectionSource, RoundJournal},
    llm::LlmCall,
    store::{DynStore, TraceFault},
};

pub struct StoreJournal {
    store: DynStore,
    round: Uuid,
    attempt: i32,
    detail: Mutex<RoundDetail>,
}

fn err(e: impl std::fmt::Display) -> JournalError {
    JournalError(e.to_string())
}

/// The traces a round's detail records as unreflected, as the faults they are charged for.
pub fn unreflected_faults<O>(detail: &RoundDetail<O>) -> Vec<TraceFault> {
    detail
        .unreflected
        .iter()
        .map(|(&trace_id, reason)| TraceFault { trace_id, reason: format!("reflection failed: {reason}") })
        .collect()
}

impl StoreJournal {
    /// A journal continuing the round's record as an earlier attempt left it.
    pub fn new(store: DynStore, round: Uuid, attempt: i32, detail: RoundDetail) -> Self {
        Self { store, round, attempt, detail: Mutex::new(detail) }
    }

    pub fn detail(&self) -> RoundDetail {
        self.detail.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn edit(&self, f: impl FnOnce(&mut RoundDetail)) {
        f(&mut self.detail.lock().unwrap_or_else(|e| e.into_inner()))
    }

    async fn flush(&self) -> Result<(), JournalError> {
        let detail = self.detail().to_value();
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
        self.edit(|d| {
            d.unreflected.remove(&trace);
        });
        Ok(())
    }

    async fn record_unreflected(&self, trace: Uuid, error: &str) -> Result<(), JournalError> {
        self.edit(|d| {
            d.unreflected.insert(trace, error.to_owned());
        });
        self.flush().await
    }

    async fn record_calls(&self, calls: &[LlmCall]) -> Result<(), JournalError> {
        for call in calls {
            self.store.record_llm_call(self.round, self.attempt, call).await.map_err(err)?;
        }
        Ok(())
    }

    async fn save_group_output(&self, output: &GroupOutput) -> Result<(), JournalError> {
        self.edit(|d| d.put_group_output(output.clone()));
        self.flush().await
    }

    async fn stored_group_outputs(&self) -> Result<Vec<GroupOutput>, JournalError> {
        Ok(self.detail().group_outputs)
    }

    async fn phase(&self, phase: Phase, event: PhaseEvent) -> Result<(), JournalError> {
        let name = serde_json::to_value(phase).ok().and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_default();
        self.edit(|d| {
            let now = chrono::Utc::now();
            let span: &mut PhaseSpan = d.phases.entry(name).or_default();
            match event {
                PhaseEvent::Started => span.started_at = Some(now),
                PhaseEvent::Finished { elapsed_ms } => {
                    span.finished_at = Some(now);
                    span.elapsed_ms = Some(elapsed_ms);
                }
            }
        });
        self.flush().await
    }
}
