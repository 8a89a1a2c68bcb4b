//! Logging and metrics set-up: human-readable or JSON logs, and one process-wide
//! Prometheus recorder (installed once, shared by every app in the process).

use std::sync::OnceLock;
use std::time::Duration;

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tracing_subscriber::{EnvFilter, fmt, prelude::*};

use crate::config::{LogFormat, LogSettings};

pub fn init_logging(settings: &LogSettings) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(&settings.level));
    let registry = tracing_subscriber::registry().with(filter);
    let result = match settings.format {
        LogFormat::Json => {
            registry.with(fmt::layer().json().with_current_span(true).with_writer(std::io::stderr)).try_init()
        }
        LogFormat::Text => registry.with(fmt::layer().with_writer(std::io::stderr)).try_init(),
    };
    // A second initialisation (tests) keeps the first subscriber.
    let _ = result;
}

/// How often the recorder's upkeep runs (the exporter's own default).
const UPKEEP_EVERY: Duration = Duration::from_secs(5);

/// The process-wide recorder's handle, installed on first use with its upkeep.
///
/// A recorder built this way runs no upkeep by itself: every histogram sample
/// (a request's latency, a group's commit time) waits in the recorder until
/// `/metrics` is scraped. A server nobody scrapes kept them all — 38 MB
/// after 1.6 million GETs in `scripts/bench` — so a thread drains them into the
/// summaries every [`UPKEEP_EVERY`], scraped or not.
pub fn metrics_handle() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let recorder = PrometheusBuilder::new().build_recorder();
            let handle = recorder.handle();
            // Fails only if another recorder is installed, in which case ours just renders nothing.
            let _ = metrics::set_global_recorder(recorder);
            let upkept = handle.clone();
            let started = std::thread::Builder::new().name("metrics-upkeep".into()).spawn(move || {
                loop {
                    std::thread::sleep(UPKEEP_EVERY);
                    upkept.run_upkeep();
                }
            });
            if let Err(e) = started {
                tracing::warn!(error = %e, "cannot start the metrics upkeep thread: histogram samples wait for a scrape");
            }
            handle
        })
        .clone()
}
