//! Test harness: real stores (a fresh Postgres database per test, a fresh
//! SQLite file per test) and the real server on port 0.
#![allow(dead_code)]

pub mod private_postgres;
pub mod processes;

use std::{net::SocketAddr, path::PathBuf, time::Duration};

use combee::{
    app::Application,
    config::Settings,
    secret::Secret,
    store::{self, DynStore},
};
use serde_json::{Value, json};
use sqlx::Connection;
use tokio_util::sync::CancellationToken;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Postgres,
    Sqlite,
}

/// The Postgres server the test command started (`scripts/test`).
pub fn pg_admin_url() -> String {
    std::env::var("COMBEE_TEST_DATABASE_URL")
        .or_else(|_| std::env::var("DATABASE_URL"))
        .expect("Postgres tests need a server: run `scripts/test` (it starts one), or set COMBEE_TEST_DATABASE_URL")
}

/// A new, empty database on the test server; returns its URL.
pub async fn fresh_pg_database() -> String {
    let admin = pg_admin_url();
    let name = format!("combee_test_{}", uuid::Uuid::new_v4().simple());
    let mut conn = sqlx::PgConnection::connect(&admin).await.expect("connect to the test Postgres");
    sqlx::query(&format!("CREATE DATABASE {name}")).execute(&mut conn).await.expect("create test database");
    let (base, _) = admin.rsplit_once('/').expect("database URL has a path");
    format!("{base}/{name}")
}

pub struct TestStore {
    pub store: DynStore,
    pub url: String,
    pub dir: tempfile::TempDir,
}

pub async fn test_store(backend: Backend) -> TestStore {
    let dir = tempfile::tempdir().expect("temp dir");
    let url = match backend {
        Backend::Postgres => fresh_pg_database().await,
        Backend::Sqlite => format!("sqlite://{}", dir.path().join("combee.db").display()),
    };
    let store = match (backend, through_pgbouncer()) {
        (Backend::Postgres, Some(bouncer)) => {
            let (base, _) = bouncer.rsplit_once('/').expect("a database URL has a path");
            let pooled = format!("{base}/{}", url.rsplit_once('/').expect("a database URL has a path").1);
            let route = store::postgres::Route { direct_url: Some(url.clone()), transaction_pooler: true };
            store::connect_via(&pooled, &route, 16, Duration::from_secs(10)).await
        }
        _ => store::connect(&url, 16, Duration::from_secs(10)).await,
    };
    TestStore { store: store.expect("open store"), url, dir }
}

/// With `COMBEE_TEST_THROUGH_PGBOUNCER=1`, the Postgres store of [`test_store`]
/// (and so of [`spawn_app`]) talks through the suite's PgBouncer in
/// transaction mode, as `database.pooler = "transaction"` does; `url` stays
/// the direct one. The address of PgBouncer, then.
fn through_pgbouncer() -> Option<String> {
    if std::env::var("COMBEE_TEST_THROUGH_PGBOUNCER").is_ok_and(|v| v == "1") {
        let url = std::env::var("COMBEE_TEST_PGBOUNCER_URL");
        Some(url.expect("COMBEE_TEST_THROUGH_PGBOUNCER=1 needs the suite's PgBouncer: run `scripts/test`"))
    } else {
        None
    }
}

pub struct TestApp {
    pub addr: SocketAddr,
    pub base: String,
    pub http: reqwest::Client,
    pub admin_key: String,
    pub store: DynStore,
    pub url: String,
    pub data_dir: PathBuf,
    pub shutdown: CancellationToken,
    pub server: tokio::task::JoinHandle<anyhow::Result<()>>,
    /// The server's state: its clock can be moved (`state.clock.advance`).
    pub state: combee::service::AppState,
    _dir: tempfile::TempDir,
}

pub fn settings_for(url: &str, data_dir: &std::path::Path) -> Settings {
    let mut s = Settings::default();
    s.server.bind = SocketAddr::from(([127, 0, 0, 1], 0));
    s.database.url = Secret::new(url);
    s.database.data_dir = data_dir.to_path_buf();
    s.limits.max_body_bytes = 256 * 1024;
    s.limits.max_traces_per_batch = 50;
    s.limits.max_trace_bytes = 32 * 1024;
    s.limits.max_field_bytes = 8 * 1024;
    s.limits.max_prompt_bytes = 16 * 1024;
    // API tests run no worker; learning tests turn it on with a simulator.
    s.server.role = combee::config::ProcessRole::Api;
    s
}

/// The OpenAI-compatible simulator (a simulation, not a model) on port 0.
pub struct Sim {
    pub url: String,
    _local: combee::simulation::llm::LocalSim,
}

pub async fn spawn_sim(cfg: combee::simulation::llm::SimConfig) -> Sim {
    let local = combee::simulation::llm::LocalSim::start(cfg).await.expect("start the simulator");
    Sim { url: local.base_url.clone(), _local: local }
}

impl Sim {
    pub async fn stats(&self) -> Value {
        reqwest::get(format!("{}/sim/stats", self.url)).await.unwrap().json().await.unwrap()
    }

    pub async fn calls(&self, task: &str) -> u64 {
        self.stats().await["calls"][task].as_u64().unwrap_or(0)
    }
}

/// Runs the worker against `llm_url` with quick polling and retries.
pub fn learning(settings: &mut Settings, llm_url: &str) {
    settings.server.role = combee::config::ProcessRole::All;
    settings.llm.base_url = llm_url.to_owned();
    settings.llm.max_retries = 6;
    settings.llm.backoff_base_ms = 5;
    settings.llm.backoff_max_ms = 50;
    settings.llm.request_timeout_secs = 10.0;
    settings.worker.poll_interval_ms = 50;
    settings.worker.retry_delay_secs = 0;
}

pub async fn spawn_app(backend: Backend) -> TestApp {
    spawn_app_with(backend, |_| {}).await
}

pub async fn spawn_app_with(backend: Backend, tweak: impl FnOnce(&mut Settings)) -> TestApp {
    let TestStore { store, url, dir } = test_store(backend).await;
    let data_dir = dir.path().join("data");
    let mut settings = settings_for(&url, &data_dir);
    tweak(&mut settings);
    let app = Application::build_with_store(settings, store.clone()).await.expect("build app");
    let addr = app.local_addr();
    let shutdown = app.shutdown_token();
    let state = app.state().clone();
    let server = tokio::spawn(app.run_until_stopped());
    let admin_key = std::fs::read_to_string(data_dir.join("admin-key")).expect("admin key file").trim().to_owned();
    TestApp {
        addr,
        base: format!("http://{addr}"),
        http: reqwest::Client::new(),
        admin_key,
        store,
        url,
        data_dir,
        shutdown,
        server,
        state,
        _dir: dir,
    }
}

/// The end of a claimed round that publishes `version` as `label` (the
/// store's `finish_round`), with no record, sample or charges: set those with
/// struct update syntax.
pub fn published(
    round: &combee::store::ClaimedRound,
    version: combee::domain::prompt::NewVersion,
    label: combee::domain::LabelName,
) -> combee::store::RoundEnd {
    combee::store::RoundEnd {
        round: round.round.id,
        attempt: round.round.attempt,
        version: Some((version, label)),
        detail: json!({}),
        k: None,
        sample_secs: None,
        charges: Default::default(),
    }
}

impl Drop for TestApp {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

impl TestApp {
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    pub fn get(&self, path: &str) -> reqwest::RequestBuilder {
        self.http.get(self.url(path)).bearer_auth(&self.admin_key)
    }

    pub fn post(&self, path: &str, body: Value) -> reqwest::RequestBuilder {
        self.http.post(self.url(path)).bearer_auth(&self.admin_key).json(&body)
    }

    pub fn put(&self, path: &str, body: Value) -> reqwest::RequestBuilder {
        self.http.put(self.url(path)).bearer_auth(&self.admin_key).json(&body)
    }

    /// A prompt under `auto` (learned versions go straight to production),
    /// which the learning tests built on this helper check.
    pub async fn create_prompt(&self, name: &str) -> Value {
        let body = json!({"name": name, "base": "You are a helpful agent.", "promotion": "auto"});
        let res = self.post("/v1/prompts", body).send().await.unwrap();
        assert_eq!(res.status(), 201, "create prompt {name}");
        res.json().await.unwrap()
    }

    /// A key with exactly these scopes.
    pub async fn key_with(&self, scopes: &[&str]) -> String {
        let res = self.post("/v1/keys", json!({"name": "test", "scopes": scopes})).send().await.unwrap();
        assert_eq!(res.status(), 201);
        res.json::<Value>().await.unwrap()["secret"].as_str().unwrap().to_owned()
    }
}

/// Asserts an RFC 9457 problem with this status and returns its body.
pub async fn expect_problem(res: reqwest::Response, status: u16) -> Value {
    assert_eq!(res.status().as_u16(), status, "status");
    assert_eq!(
        res.headers().get("content-type").and_then(|v| v.to_str().ok()),
        Some("application/problem+json"),
        "content type"
    );
    let body: Value = res.json().await.expect("problem body is JSON");
    assert_eq!(body["status"], status);
    assert!(body["type"].as_str().unwrap().starts_with("urn:combee:problem:"));
    assert!(!body["detail"].as_str().unwrap().is_empty(), "a useful detail");
    body
}

/// Generates one test per backend from an async fn taking a `Backend`.
#[macro_export]
macro_rules! on_both_stores {
    ($($name:ident),* $(,)?) => {
        mod postgres {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() { super::$name($crate::common::Backend::Postgres).await })*
        }
        mod sqlite {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() { super::$name($crate::common::Backend::Sqlite).await })*
        }
    };
}

/// Tests on one named backend each, for long stories whose subject is not
/// the store (the UI in a browser, learning quality over many rounds): the
/// store contract suite and the API tests hold both backends to one behaviour,
/// so such a story runs once, and the stories are split between the backends.
#[macro_export]
macro_rules! on_one_store {
    ($($test:ident: $name:ident($backend:ident)),* $(,)?) => {
        $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $test() { $name($crate::common::Backend::$backend).await })*
    };
}

/// A second server on `prev`'s store (a fresh connection to the same
/// database), as after a restart; `prev` should be stopped first.
pub async fn restart_app_with(prev: &TestApp, tweak: impl FnOnce(&mut Settings)) -> TestApp {
    let store = store::connect(&prev.url, 16, Duration::from_secs(10)).await.expect("reopen store");
    let mut settings = settings_for(&prev.url, &prev.data_dir);
    tweak(&mut settings);
    let app = Application::build_with_store(settings, store.clone()).await.expect("build app");
    let addr = app.local_addr();
    let shutdown = app.shutdown_token();
    let state = app.state().clone();
    let server = tokio::spawn(app.run_until_stopped());
    TestApp {
        addr,
        base: format!("http://{addr}"),
        http: reqwest::Client::new(),
        admin_key: prev.admin_key.clone(),
        store,
        url: prev.url.clone(),
        data_dir: prev.data_dir.clone(),
        shutdown,
        server,
        state,
        _dir: tempfile::tempdir().expect("temp dir"),
    }
}

/// Makes the prompt's pending traces `failed`, as a round that gave up on
/// them would: opens a round over them, claims it and fails it with one
/// attempt allowed per trace, each charged for a failure of its own. Returns the failed traces' ids.
pub async fn fail_pending_traces(store: &DynStore, prompt: &str) -> Vec<uuid::Uuid> {
    use combee::{
        domain::{
            PromptName,
            round::{Method, RoundTrigger},
        },
        store::{OpenRound, RoundFailure, TraceCharges, TraceFault},
    };
    let open = OpenRound {
        prompt: PromptName::written(prompt, "default").unwrap(),
        trigger: RoundTrigger::Api,
        method: Method::Combee,
        batch: 10_000,
        min_traces: 1,
        seed: 1,
        inbound_webhook_id: None,
        judge_wait: None,
        base_version: None,
    };
    let round = store.open_round(&open).await.unwrap().expect("pending traces to fail");
    let claimed = store.claim_round("test", Duration::from_secs(60)).await.unwrap().expect("the round is claimable");
    assert_eq!(claimed.round.id, round.id);
    let ids: Vec<uuid::Uuid> = claimed.traces.iter().map(|t| t.id).collect();
    store
        .fail_round(
            round.id,
            claimed.round.attempt,
            "the reflector answered malformed JSON",
            RoundFailure::GiveUp {
                charges: TraceCharges {
                    faults: ids
                        .iter()
                        .map(|&trace_id| TraceFault {
                            trace_id,
                            reason: "the reflector answered malformed JSON".into(),
                        })
                        .collect(),
                    max_trace_attempts: 1,
                },
            },
        )
        .await
        .unwrap();
    ids
}

/// The suite's one deadline loop: calls `probe` every 50 ms until it answers
/// `Ok`, and returns that value. The test fails, naming `what` and the last
/// `Err` (the state it was still waiting on), when a probe that *began* after
/// `within` still answers `Err`: a probe that began in time and ended late
/// (a slow machine, a probe of many requests) proves nothing late, so there is
/// always one more.
pub async fn eventually<T>(what: &str, within: Duration, probe: impl AsyncFnMut() -> Result<T, String>) -> T {
    eventually_by(what, std::time::Instant::now() + within, probe).await
}

/// [`eventually`] against a deadline set earlier, for a second thing that must
/// follow the same change by the same time.
pub async fn eventually_by<T>(
    what: &str,
    deadline: std::time::Instant,
    probe: impl AsyncFnMut() -> Result<T, String>,
) -> T {
    eventually_every(what, deadline, Duration::from_millis(50), probe).await
}

/// [`eventually_by`], probing every `every`: a wait of minutes (a real model's
/// round) need not cost the machine a request every 50 ms.
pub async fn eventually_every<T>(
    what: &str,
    deadline: std::time::Instant,
    every: Duration,
    mut probe: impl AsyncFnMut() -> Result<T, String>,
) -> T {
    loop {
        let began = std::time::Instant::now();
        let last = match probe().await {
            Ok(value) => return value,
            Err(state) => state,
        };
        assert!(began < deadline, "{what} had not happened by its deadline: {last}");
        tokio::time::sleep(every).await;
    }
}

/// The round once it has ended (`succeeded` or `failed`): the worker runs it in
/// the background.
pub async fn round_end(app: &TestApp, id: &str, within: Duration) -> Value {
    eventually(&format!("the end of round {id}"), within, async || {
        let r: Value = app.get(&format!("/v1/rounds/{id}")).send().await.unwrap().json().await.unwrap();
        if r["status"] == "succeeded" || r["status"] == "failed" { Ok(r) } else { Err(r.to_string()) }
    })
    .await
}
