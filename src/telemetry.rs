//! Logging and metrics set-up: human-readable or JSON logs, and one process-wide
//! Prometheus recorder (installed once, shared by every app in the process).

use std::sync::OnceLock;

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

pub fn metrics_handle() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let recorder = PrometheusBuilder::new().build_recorder();
            let handle = recorder.handle();
            // Fails only if another recorder is installed, in which case ours just renders nothing.
            let _ = metrics::set_global_recorder(recorder);
            handle
        })
        .clone()
}
