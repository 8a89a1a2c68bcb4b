//! The operations both front ends call — the JSON API (`http/`) and the web
//! UI (`ui/`) — and the state they share, so neither front end imports the
//! other: `app.rs` composes their routers. One file per resource.

pub mod controller;
pub mod error;
pub mod export;
pub mod langfuse;
pub mod pagination;
pub mod prompts;
pub mod rounds;

use std::sync::Arc;

use metrics_exporter_prometheus::PrometheusHandle;

use crate::{auth::KeyCache, cache::PromptCache, config::Settings, store::DynStore};

pub use error::{ServiceError, ServiceResult};

/// Shared by every request; one `Arc`, so the per-request clone axum makes
/// is a single reference-count bump.
#[derive(Clone)]
pub struct AppState(Arc<Shared>);

pub struct Shared {
    pub store: DynStore,
    pub settings: Arc<Settings>,
    pub cache: Arc<PromptCache>,
    pub keys: Arc<KeyCache>,
    pub metrics: PrometheusHandle,
}

impl AppState {
    pub fn new(shared: Shared) -> Self {
        Self(Arc::new(shared))
    }
}

impl std::ops::Deref for AppState {
    type Target = Shared;
    fn deref(&self) -> &Shared {
        &self.0
    }
}
