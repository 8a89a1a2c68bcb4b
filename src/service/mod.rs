//! The one door to the store: the operations both front ends call — the JSON
//! API (`http/`) and the web UI (`ui/`), which only parse and render and never
//! touch the store themselves — with their rules, and the state they share, so
//! neither front end imports the other: `app.rs` composes their routers. One
//! file per resource.

pub mod arms;
pub mod audit;
pub mod budget;
pub mod controller;
mod error;
pub mod evaluators;
pub mod export;
pub mod gate;
pub mod keys;
pub mod labels;
pub mod langfuse;
pub mod llm_limits;
pub mod outcomes;
pub mod pagination;
pub mod people;
pub mod population;
pub mod production;
pub mod projects;
pub mod prompts;
pub mod regression;
pub mod rounds;
pub mod sessions;
pub mod traces;
pub mod webhooks;

use std::sync::Arc;

use metrics_exporter_prometheus::PrometheusHandle;

use crate::{
    auth::KeyCache,
    cache::PromptCache,
    config::Settings,
    store::{DynStore, StoreKind},
};

pub use error::{ServiceError, ServiceResult, plain_serde_error};

/// Shared by every request; one `Arc`, so the per-request clone axum makes
/// is a single reference-count bump.
#[derive(Clone)]
pub struct AppState(Arc<AppParts>);

/// What the application state holds: the store, the settings, the served
/// prompts' and API keys' caches, and the metrics exporter.
pub struct AppParts {
    pub store: DynStore,
    pub settings: Arc<Settings>,
    pub cache: Arc<PromptCache>,
    pub keys: Arc<KeyCache>,
    pub metrics: PrometheusHandle,
    /// The time the worker and the budget read (a test moves it to end a day).
    pub clock: crate::domain::clock::Clock,
    /// The single sign-on provider's client, when `[auth.oidc]` is set.
    pub oidc: Option<Arc<crate::oidc::Client>>,
}

impl AppState {
    pub fn new(parts: AppParts) -> Self {
        Self(Arc::new(parts))
    }

    /// The state of a process on `store` with `settings`: empty caches sized
    /// by `settings.cache`, and the process's metrics exporter.
    pub fn build(store: DynStore, settings: Settings) -> Self {
        Self::new(AppParts {
            cache: Arc::new(PromptCache::new(
                std::time::Duration::from_secs(settings.cache.max_age_secs),
                settings.cache.max_prompts,
            )),
            keys: Arc::new(KeyCache::new(store.clone(), settings.cache.max_keys)),
            metrics: crate::telemetry::metrics_handle(),
            clock: Default::default(),
            oidc: settings.auth.oidc.clone().map(|o| Arc::new(crate::oidc::Client::new(o))),
            settings: Arc::new(settings),
            store,
        })
    }
}

impl std::ops::Deref for AppState {
    type Target = AppParts;
    fn deref(&self) -> &AppParts {
        &self.0
    }
}

/// Whether the store answers within `limit`, and which kind it is (`/readyz`).
pub async fn readiness(st: &AppState, limit: std::time::Duration) -> ServiceResult<StoreKind> {
    match tokio::time::timeout(limit, st.store.ping()).await {
        Ok(Ok(())) => Ok(st.store.kind()),
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "readiness check failed");
            Err(ServiceError::Unavailable)
        }
        Err(_) => Err(ServiceError::Unavailable),
    }
}
