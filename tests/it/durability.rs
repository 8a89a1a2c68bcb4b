//! An answer means the trace is on disk: traces the server acknowledged
//! (201) survive a `kill -9` of the server, on both stores, and on Postgres
//! an immediate (crash-like) restart of the database right after it. Writes
//! are committed in groups; this is what makes that safe.

use crate::common::{eventually, private_postgres::PrivatePostgres};

use std::{
    process::{Child, Command, Stdio},
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::Duration,
};

use serde_json::{Value, json};

/// Concurrent clients, each sending single-trace POSTs back to back.
const CLIENTS: usize = 24;

/// Acknowledged traces before the kill: enough that groups of many requests
/// are in flight when it lands.
const AT_LEAST: usize = 300;

struct Server {
    child: Child,
    base: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A `combee serve` process on `database_url` (the embedded store when
/// `None`) with its data in `data`, ready to answer.
async fn serve(database_url: Option<&str>, data: &std::path::Path) -> Server {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_combee"));
    cmd.args(["serve", "--role", "api", "--bind", &format!("127.0.0.1:{port}")])
        .env("COMBEE_CONFIG_DIR", concat!(env!("CARGO_MANIFEST_DIR"), "/config"))
        .env("COMBEE__DATABASE__DATA_DIR", data)
        .env("COMBEE__LOG__LEVEL", "warn")
        .env_remove("COMBEE_ENV")
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    match database_url {
        Some(url) => cmd.env("DATABASE_URL", url),
        None => cmd.env_remove("DATABASE_URL"),
    };
    let server = Server { child: cmd.spawn().expect("start combee"), base: format!("http://127.0.0.1:{port}") };
    let http = reqwest::Client::new();
    eventually("the server answers /readyz", Duration::from_secs(30), async || {
        match http.get(format!("{}/readyz", server.base)).send().await {
            Ok(r) if r.status() == 200 => Ok(()),
            Ok(r) => Err(r.status().to_string()),
            Err(e) => Err(e.to_string()),
        }
    })
    .await;
    server
}

/// Sends single-trace POSTs until `stop`; the ids of those answered 201,
/// each also counted in `acked` as it comes.
async fn client(base: String, key: String, me: usize, stop: Arc<AtomicBool>, acked: Arc<AtomicUsize>) -> Vec<String> {
    let http = reqwest::Client::builder().timeout(Duration::from_secs(10)).build().unwrap();
    let mut acknowledged = Vec::new();
    for n in 0.. {
        if stop.load(Ordering::Relaxed) {
            break;
        }
        let trace = json!({"prompt": "p", "input": {"client": me, "n": n}, "feedback": {"success": n % 2 == 0}});
        match http.post(format!("{base}/v1/traces")).bearer_auth(&key).json(&trace).send().await {
            Ok(r) if r.status() == 201 => {
                let body: Value = r.json().await.expect("a 201 has a JSON body");
                acknowledged.push(body["ids"][0].as_str().expect("the trace's id").to_owned());
                acked.fetch_add(1, Ordering::Relaxed);
            }
            // Anything else (the kill) ends this client: what it sent after
            // its last 201 was never promised.
            _ => break,
        }
    }
    acknowledged
}

/// Runs the clients against `server`, kills it with SIGKILL once [`AT_LEAST`]
/// traces were acknowledged, calls `after_kill`, restarts the server, and
/// checks every acknowledged trace is there.
async fn acknowledged_traces_survive(database_url: Option<String>, after_kill: impl FnOnce()) {
    let data = tempfile::tempdir().unwrap();
    let mut server = serve(database_url.as_deref(), data.path()).await;
    let key = std::fs::read_to_string(data.path().join("admin-key")).expect("the first admin key").trim().to_owned();
    let http = reqwest::Client::new();
    let res = http
        .post(format!("{}/v1/prompts", server.base))
        .bearer_auth(&key)
        .json(&json!({"name": "p", "base": "You are a helpful agent."}))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 201);

    let stop = Arc::new(AtomicBool::new(false));
    let acked = Arc::new(AtomicUsize::new(0));
    let clients: Vec<_> = (0..CLIENTS)
        .map(|me| tokio::spawn(client(server.base.clone(), key.clone(), me, stop.clone(), acked.clone())))
        .collect();
    // The load built up: groups of many requests are in flight at the kill.
    eventually("traces acknowledged before the kill", Duration::from_secs(60), async || {
        let n = acked.load(Ordering::Relaxed);
        if n >= AT_LEAST { Ok(()) } else { Err(format!("{n} acknowledged")) }
    })
    .await;
    server.child.kill().expect("kill -9 the server");
    server.child.wait().unwrap();
    stop.store(true, Ordering::Relaxed);
    let mut acknowledged = Vec::new();
    for c in clients {
        acknowledged.extend(c.await.expect("a client panicked"));
    }
    assert!(acknowledged.len() >= AT_LEAST, "only {} traces were acknowledged before the kill", acknowledged.len());
    after_kill();

    let server = serve(database_url.as_deref(), data.path()).await;
    let mut missing = Vec::new();
    for chunk in acknowledged.chunks(64) {
        let found = futures_util::future::join_all(
            chunk.iter().map(|id| http.get(format!("{}/v1/traces/{id}", server.base)).bearer_auth(&key).send()),
        )
        .await;
        for (id, res) in chunk.iter().zip(found) {
            if res.expect("the restarted server answers").status() != 200 {
                missing.push(id.clone());
            }
        }
    }
    eprintln!("{} traces acknowledged before kill -9; {} missing after the restart", acknowledged.len(), missing.len());
    assert!(missing.is_empty(), "acknowledged traces lost: {missing:?}");
    let metrics: Value = http
        .get(format!("{}/v1/prompts/p/metrics?window=1h", server.base))
        .bearer_auth(&key)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    eprintln!("metrics after the restart: {metrics}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_traces_survive_kill_9_on_the_embedded_store() {
    acknowledged_traces_survive(None, || {}).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_traces_survive_kill_9_and_a_postgres_crash_restart() {
    let pg = PrivatePostgres::start();
    acknowledged_traces_survive(Some(pg.url()), || pg.crash_restart()).await;
}
