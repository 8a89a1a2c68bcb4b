//! Building and running the service: open the store, make sure an admin key
//! exists, bind the listener (port 0 in tests), compose the API and web UI
//! routers, serve until SIGTERM/SIGINT, and let in-flight requests finish.

use std::{net::SocketAddr, path::Path, sync::Arc, time::Duration};

use anyhow::Context;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::{
    auth,
    config::{Pooler, ProcessRole, Settings},
    delivery::Deliverer,
    domain::{
        access::Scope,
        audit::{Actor, NewAuditEntry, RequestOrigin},
    },
    http,
    llm::{LlmBackend, client::OpenAiClient},
    service::AppState,
    store::{self, Change, DynStore, Expiring},
    ui,
    worker::{Worker, guard::RegressionGuard, judge::TraceJudge, rater::PopulationRater, retention::Pruner},
};

/// The API with the web UI at `/ui`, both behind the API's middleware.
/// The API and the web UI, as served to clients.
fn api_and_ui(
    state: AppState,
) -> impl tower::Service<
    axum::extract::Request,
    Response = axum::response::Response,
    Error = std::convert::Infallible,
    Future: Send,
> + Clone
+ Send
+ 'static {
    http::serve(http::routes().nest("/ui", ui::router()), state)
}

pub const ADMIN_KEY_FILE: &str = "admin-key";

/// Without a key, OpenAI's own endpoint can only answer 401: running rounds
/// against it would just wear down the traces' attempts. Any other base URL
/// (a local server, a proxy, the simulator) counts as configured.
fn llm_configured(llm: &crate::llm::config::LlmConfig) -> bool {
    !(llm.api_key.is_empty() && llm.base_url.trim_end_matches('/') == crate::llm::config::DEFAULT_BASE_URL)
}

pub struct Application {
    listener: TcpListener,
    state: AppState,
    worker: Option<Worker>,
    deliverer: Option<Deliverer>,
    guard: Option<RegressionGuard>,
    rater: Option<PopulationRater>,
    /// Retention and rollup upkeep, wherever the learning worker may run.
    pruner: Option<Pruner>,
    /// Scores traces of prompts with evaluators, wherever the learning worker may run.
    judge: Option<TraceJudge>,
    shutdown: CancellationToken,
}

pub async fn open_store(settings: &Settings) -> anyhow::Result<DynStore> {
    let url = settings.database_url();
    let d = &settings.database;
    let route = store::postgres::Route {
        direct_url: (!d.direct_url.is_empty()).then(|| d.direct_url.expose().to_owned()),
        transaction_pooler: d.pooler == Pooler::Transaction,
    };
    store::connect_via(&url, &route, d.max_connections, Duration::from_secs(d.acquire_timeout_secs))
        .await
        .context("cannot open the store (check DATABASE_URL / database.url)")
}

/// On a fresh install (no active key) creates an admin key, prints it once
/// to stderr and writes it to `<data_dir>/admin-key` with mode 0600.
pub async fn ensure_admin_key(store: &DynStore, data_dir: &Path) -> anyhow::Result<Option<String>> {
    if store.count_active_api_keys().await? > 0 {
        return Ok(None);
    }
    let (key, secret) = auth::create_key(store, "bootstrap admin", &[Scope::Admin], None).await?;
    let created = NewAuditEntry::new(
        Actor::System,
        RequestOrigin::default(),
        "key.create",
        Some("key".into()),
        Some(key.id.to_string()),
        None,
        serde_json::to_value(&key).ok(),
    );
    crate::service::audit::record(store, &created).await;
    std::fs::create_dir_all(data_dir).with_context(|| format!("cannot create {}", data_dir.display()))?;
    let path = data_dir.join(ADMIN_KEY_FILE);
    write_private(&path, &format!("{secret}\n")).with_context(|| format!("cannot write {}", path.display()))?;
    eprintln!(
        "\n  combee: created the first admin API key ({}). It is shown once:\n\n    {secret}\n\n  \
         A copy is in {} (mode 0600). Create narrower keys with `combee keys create`.\n",
        key.prefix,
        path.display()
    );
    Ok(Some(secret))
}

fn write_private(path: &Path, contents: &str) -> std::io::Result<()> {
    use std::io::Write;
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    options.open(path)?.write_all(contents.as_bytes())
}

impl Application {
    pub async fn build(settings: Settings) -> anyhow::Result<Self> {
        let store = open_store(&settings).await?;
        Self::build_with_store(settings, store).await
    }

    pub async fn build_with_store(settings: Settings, store: DynStore) -> anyhow::Result<Self> {
        ensure_admin_key(&store, &settings.database.data_dir).await?;
        let listener = TcpListener::bind(settings.server.bind)
            .await
            .with_context(|| format!("cannot listen on {}", settings.server.bind))?;
        let state = AppState::build(store.clone(), settings);
        let settings = state.settings.clone();
        let worker = match settings.server.role {
            ProcessRole::Api => None,
            ProcessRole::All | ProcessRole::Worker if !llm_configured(&settings.llm.clone().with_env_fallbacks()) => {
                tracing::warn!(
                    "no LLM is configured (llm.base_url is OpenAI's and no API key is set): learning rounds will \
                     wait until one is; set COMBEE__LLM__API_KEY / OPENAI_API_KEY or COMBEE__LLM__BASE_URL"
                );
                None
            }
            ProcessRole::All | ProcessRole::Worker => {
                let llm = settings.llm.clone().with_env_fallbacks();
                // Every attempt of every call this process makes counts against the learning budget.
                let meter = crate::service::budget::StoreMeter::new(&state);
                // A backend seen before starts from the concurrency limit it earned then.
                let limits = crate::service::llm_limits::StoreLimits::new(store.clone());
                let backend: Arc<dyn LlmBackend> = Arc::new(
                    OpenAiClient::new(llm.clone())
                        .context("invalid [llm] configuration")?
                        .with_meter(meter)
                        .with_limit_memory(limits),
                );
                Some(
                    Worker::new(state.clone(), backend, llm, settings.worker.clone(), settings.controller.clone())
                        .with_population(settings.population.policy()),
                )
            }
        };
        // Crossover needs the worker's LLM and its content denylist.
        let breeder = worker.as_ref().map(|w| w.llm_parts());
        // The judge runs its code checks without an LLM; its LLM judges use the worker's.
        let judge = match settings.server.role {
            ProcessRole::Api => None,
            ProcessRole::All | ProcessRole::Worker => Some(TraceJudge::new(
                store.clone(),
                breeder.as_ref().map(|(backend, llm, _)| (backend.clone(), llm.clone())),
                Duration::from_millis(settings.worker.poll_interval_ms),
                // A batch waits on the LLM judge: as long as a gate's claim.
                Duration::from_secs(settings.worker.lease_secs.saturating_mul(10)),
            )),
        };
        // Webhook deliveries go out from wherever the learning worker runs.
        let deliverer = match settings.server.role {
            ProcessRole::Api => None,
            ProcessRole::All | ProcessRole::Worker => Some(
                Deliverer::new(store.clone(), settings.webhooks.clone())
                    .context("cannot build the webhook delivery client")?,
            ),
        };
        // The regression guard runs wherever the learning worker may run, LLM or not.
        let guard = match settings.server.role {
            ProcessRole::All | ProcessRole::Worker if settings.guard.enabled => Some(
                RegressionGuard::new(store.clone(), settings.guard.clone())
                    .with_population(settings.population.policy()),
            ),
            _ => None,
        };
        // So does the population rater (ratings, weights, promotion gate of `evaluated` prompts).
        let rater = match settings.server.role {
            ProcessRole::All | ProcessRole::Worker if settings.population.enabled => {
                let rater = PopulationRater::new(store.clone(), settings.population.clone());
                Some(match breeder {
                    Some((backend, llm, denylist)) => rater.with_crossover(backend, llm, denylist),
                    None => rater,
                })
            }
            _ => None,
        };
        let pruner = match settings.server.role {
            ProcessRole::All | ProcessRole::Worker => {
                Some(Pruner::new(store.clone(), settings.retention.clone(), settings.limits.idempotency_ttl_hours))
            }
            ProcessRole::Api => None,
        };
        Ok(Self { listener, state, worker, deliverer, guard, rater, pruner, judge, shutdown: CancellationToken::new() })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.listener.local_addr().unwrap_or_else(|_| SocketAddr::from(([127, 0, 0, 1], 0)))
    }

    pub fn state(&self) -> &AppState {
        &self.state
    }

    /// Cancel it to stop the server gracefully (tests); signals do the same.
    pub fn shutdown_token(&self) -> CancellationToken {
        self.shutdown.clone()
    }

    pub async fn run_until_stopped(self) -> anyhow::Result<()> {
        let Application { listener, state, worker, deliverer, guard, rater, pruner, judge, shutdown } = self;
        let compactor = pruner
            .is_some()
            .then(|| tokio::spawn(crate::worker::rollups::compact_forever(state.store.clone(), shutdown.clone())));
        let pruner = pruner.map(|p| tokio::spawn(p.run(shutdown.clone())));
        let guard = guard.map(|g| tokio::spawn(g.run(shutdown.clone())));
        let rater = rater.map(|r| tokio::spawn(r.run(shutdown.clone())));
        let judge = judge.map(|j| tokio::spawn(j.run(shutdown.clone())));
        let invalidator = tokio::spawn(forward_changes(state.clone(), shutdown.clone()));
        let key_watch = tokio::spawn(state.keys.clone().watch(shutdown.clone()));
        let worker = worker.map(|w| tokio::spawn(w.run(shutdown.clone())));
        let deliverer = deliverer.map(|d| tokio::spawn(d.run(shutdown.clone())));
        let housekeeping = tokio::spawn(housekeeping(state.clone(), shutdown.clone()));
        let role = state.settings.server.role;
        tracing::info!(addr = %listener.local_addr()?, store = ?state.store.kind(), ?role, "combee is serving");
        let grace = Duration::from_secs(state.settings.server.shutdown_grace_secs);
        let signal_token = shutdown.clone();
        tokio::spawn(async move {
            wait_for_signal().await;
            signal_token.cancel();
        });
        let stopped = shutdown.clone();
        let stopped = async move {
            stopped.cancelled().await;
            tracing::info!("shutting down: finishing in-flight requests");
        };
        let server = if role == ProcessRole::Worker {
            let server = axum::serve(listener, http::ops_router(state)).with_graceful_shutdown(stopped);
            tokio::spawn(async move { server.await })
        } else {
            // The client's address reaches the audit log through `ConnectInfo`.
            let service = axum::ServiceExt::<axum::extract::Request>::into_make_service_with_connect_info::<SocketAddr>(
                api_and_ui(state),
            );
            let server = axum::serve(listener, service).with_graceful_shutdown(stopped);
            tokio::spawn(async move { server.await })
        };
        shutdown.cancelled().await;
        match tokio::time::timeout(grace, server).await {
            Ok(joined) => joined.context("server task failed")?.context("server failed")?,
            Err(_) => tracing::warn!("in-flight requests did not finish within the grace period"),
        }
        invalidator.abort();
        key_watch.abort();
        housekeeping.abort();
        for task in [compactor, pruner, judge].into_iter().flatten() {
            let _ = tokio::time::timeout(Duration::from_secs(5), task).await;
        }
        if let Some(w) = worker {
            let _ = tokio::time::timeout(Duration::from_secs(5), w).await;
        }
        if let Some(d) = deliverer {
            let _ = tokio::time::timeout(Duration::from_secs(5), d).await;
        }
        if let Some(g) = guard {
            let _ = tokio::time::timeout(Duration::from_secs(5), g).await;
        }
        if let Some(r) = rater {
            let _ = tokio::time::timeout(Duration::from_secs(5), r).await;
        }
        Ok(())
    }
}

async fn wait_for_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! { _ = ctrl_c => {}, _ = term => {} }
}

/// Drops cached prompts and keys as the store announces changes.
async fn forward_changes(state: AppState, shutdown: CancellationToken) {
    let mut rx = state.store.changes();
    loop {
        let change = tokio::select! {
            _ = shutdown.cancelled() => return,
            c = rx.recv() => c,
        };
        match change {
            Ok(Change::Prompt(name)) => state.cache.invalidate(&name),
            Ok(Change::Keys) => state.keys.clear(),
            Ok(Change::RoundQueued | Change::OutboxEvent) => {}
            Ok(Change::Resync) | Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {
                state.cache.clear();
                state.keys.clear();
            }
            Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
        }
    }
}

/// Periodic clean-up: forgets idempotency keys past their retention, and
/// OTLP spans held that long without becoming a trace.
async fn housekeeping(state: AppState, shutdown: CancellationToken) {
    let ttl = chrono::Duration::hours(state.settings.limits.idempotency_ttl_hours as i64);
    let mut tick = tokio::time::interval(Duration::from_secs(600));
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        // In batches, so no single statement holds locks on a day of keys.
        let mut purged = 0;
        loop {
            match state.store.prune(Expiring::IdempotencyKeys, chrono::Utc::now() - ttl, 1_000).await {
                Ok(n) => {
                    purged += n;
                    if n < 1_000 {
                        break;
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "idempotency purge failed");
                    break;
                }
            }
        }
        if purged > 0 {
            tracing::info!(purged, "expired idempotency keys removed");
        }
        match state.store.purge_held_otlp_spans(chrono::Utc::now() - ttl).await {
            Ok(n) if n > 0 => tracing::info!(purged = n, "held OTLP spans that never became a trace removed"),
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "held OTLP span purge failed"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::llm_configured;
    use crate::{llm::config::LlmConfig, secret::Secret};

    #[test]
    fn an_llm_counts_as_configured_with_a_key_or_another_endpoint() {
        let openai = LlmConfig { base_url: "https://api.openai.com/v1/".into(), ..LlmConfig::default() };
        assert!(!llm_configured(&openai), "OpenAI without a key can only answer 401");
        assert!(llm_configured(&LlmConfig { api_key: Secret::new("sk-x"), ..openai.clone() }));
        assert!(llm_configured(&LlmConfig { base_url: "http://127.0.0.1:8090/v1".into(), ..openai }));
    }
}
