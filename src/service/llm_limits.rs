//! The store-backed memory of the concurrency limit each LLM backend earned
//! (see `llm::remember`): every worker process's client recalls it before
//! its first call and keeps what it learns, so a restart or a new process
//! starts where the last one left off.

use std::sync::Arc;

use async_trait::async_trait;

use crate::llm::remember::{BackendKey, LimitMemory};
use crate::store::DynStore;

/// Keeps limits in the store; a store error loses the memory, never a call.
pub struct StoreLimits {
    store: DynStore,
}

impl StoreLimits {
    pub fn new(store: DynStore) -> Arc<Self> {
        Arc::new(Self { store })
    }
}

#[async_trait]
impl LimitMemory for StoreLimits {
    async fn recall(&self, backend: &BackendKey) -> Option<u32> {
        match self.store.llm_limit(&backend.base_url, &backend.model).await {
            Ok(limit) => limit,
            Err(e) => {
                tracing::warn!(error = %e, "the LLM backend's concurrency limit could not be read; it starts as a new one's");
                None
            }
        }
    }

    async fn keep(&self, backend: &BackendKey, limit: u32) {
        if let Err(e) = self.store.keep_llm_limit(&backend.base_url, &backend.model, limit).await {
            tracing::warn!(error = %e, "the LLM backend's concurrency limit could not be kept");
        }
    }
}
