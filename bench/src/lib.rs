//! What several benchmarks share: an in-process combee on a fresh embedded
//! store, so each binary sets only what its run is about.

use std::{net::SocketAddr, path::Path, time::Duration};

use combee::{
    config::{ProcessRole, Settings},
    secret::Secret,
    store::{self, DynStore},
};

/// Settings for a combee that serves and learns in this process on a new
/// SQLite file under `dir`, against the LLM at `llm_url`, on an ephemeral
/// local port; and the store it opens. Callers adjust the settings before
/// building the application with the store.
pub async fn embedded(dir: &Path, llm_url: &str) -> anyhow::Result<(Settings, DynStore)> {
    let url = format!("sqlite://{}", dir.join("combee.db").display());
    let store = store::connect(&url, 16, Duration::from_secs(30)).await?;
    let mut s = Settings::default();
    s.server.bind = SocketAddr::from(([127, 0, 0, 1], 0));
    s.server.role = ProcessRole::All;
    s.database.url = Secret::new(&url);
    s.database.data_dir = dir.join("data");
    s.llm.base_url = llm_url.to_owned();
    Ok((s, store))
}
