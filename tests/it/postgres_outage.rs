//! Idempotent ingest across a Postgres restart: clients keep sending batches
//! with `Idempotency-Key`s and retry every failure while the server is
//! restarted with `pg_ctl restart -m fast`. Runs its own throw-away Postgres
//! (the shared test server must not be restarted under the other tests).

use crate::common::{
    self,
    private_postgres::{PrivatePostgres, run},
};

use std::{
    collections::{HashMap, HashSet},
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use combee::{app::Application, domain::trace::TraceFilter, store};
use serde_json::{Value, json};

/// What one client saw.
#[derive(Default)]
struct Seen {
    /// Trace ids of acknowledged (201) answers, with the (client, batch) they came from.
    acknowledged: Vec<(String, (usize, usize))>,
    /// Wall time from a batch's first failed attempt to its 201.
    recoveries: Vec<Duration>,
    /// Statuses of failed attempts.
    failures: HashMap<u16, usize>,
    /// Attempts that got no HTTP answer at all.
    transport_errors: usize,
}

const BATCH: usize = 5;

async fn client(base: String, key: String, me: usize, stop: Arc<AtomicBool>, done: Arc<AtomicUsize>) -> Seen {
    let http = reqwest::Client::builder().timeout(Duration::from_secs(20)).build().unwrap();
    let mut seen = Seen::default();
    let mut batch = 0;
    while !stop.load(Ordering::Relaxed) {
        let traces: Vec<Value> = (0..BATCH)
            .map(|n| json!({"prompt": "p", "input": {"q": n}, "metadata": {"client": me, "batch": batch, "n": n}}))
            .collect();
        let body = json!({ "traces": traces });
        let idem = format!("client-{me}-batch-{batch}");
        let mut first_failure: Option<Instant> = None;
        loop {
            let res = http
                .post(format!("{base}/v1/traces"))
                .bearer_auth(&key)
                .header("idempotency-key", &idem)
                .json(&body)
                .send()
                .await;
            match res {
                Ok(r) if r.status() == 201 => {
                    let answer: Value = r.json().await.expect("a 201 has a JSON body");
                    let ids = answer["ids"].as_array().expect("ids").clone();
                    assert_eq!(ids.len(), BATCH);
                    seen.acknowledged.extend(ids.iter().map(|i| (i.as_str().unwrap().to_owned(), (me, batch))));
                    if let Some(t) = first_failure {
                        seen.recoveries.push(t.elapsed());
                    }
                    break;
                }
                Ok(r) => {
                    let status = r.status().as_u16();
                    assert!(
                        status == 503 || status >= 500,
                        "only outage answers are retried; got {status}: {}",
                        r.text().await.unwrap_or_default()
                    );
                    if status == 503 {
                        assert!(r.headers().get("retry-after").is_some(), "a 503 says when to retry");
                    }
                    *seen.failures.entry(status).or_default() += 1;
                    first_failure.get_or_insert_with(Instant::now);
                }
                Err(_) => {
                    seen.transport_errors += 1;
                    first_failure.get_or_insert_with(Instant::now);
                }
            }
            assert!(
                first_failure.is_none_or(|t| t.elapsed() < Duration::from_secs(60)),
                "client {me} batch {batch} never recovered"
            );
            // Clients back off briefly; a real one would honour Retry-After.
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        batch += 1;
        done.fetch_add(1, Ordering::Relaxed);
    }
    seen
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idempotent_ingest_survives_a_postgres_restart_exactly_once() {
    let pg = PrivatePostgres::start();
    let url = pg.url();
    let data = tempfile::tempdir().unwrap();
    // A short acquire timeout, as in production config, so requests during the
    // restart answer 503 instead of queueing.
    let store = store::connect(&url, 16, Duration::from_secs(2)).await.expect("open store");
    let settings = common::settings_for(&url, &data.path().join("data"));
    let app = Application::build_with_store(settings, store.clone()).await.expect("build app");
    let base = format!("http://{}", app.local_addr());
    let shutdown = app.shutdown_token();
    let server = tokio::spawn(app.run_until_stopped());
    let key = std::fs::read_to_string(data.path().join("data").join("admin-key")).unwrap().trim().to_owned();
    let http = reqwest::Client::new();
    let res = http
        .post(format!("{base}/v1/prompts"))
        .bearer_auth(&key)
        .json(&json!({"name": "p", "base": "You are a helpful agent."}))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 201);

    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicUsize::new(0));
    let clients: Vec<_> =
        (0..8).map(|me| tokio::spawn(client(base.clone(), key.clone(), me, stop.clone(), done.clone()))).collect();
    let wait_for = |n: usize, what: &'static str| {
        let done = done.clone();
        async move {
            common::eventually(what, Duration::from_secs(60), async || {
                let now = done.load(Ordering::Relaxed);
                if now >= n { Ok(()) } else { Err(format!("{now} requests done")) }
            })
            .await
        }
    };
    wait_for(40, "clients made no progress before the restart").await;

    let restart = Instant::now();
    let pg_ctl = tokio::task::spawn_blocking({
        let c = pg.ctl("restart");
        move || run(c, "pg_ctl restart -m fast")
    });
    pg_ctl.await.unwrap();
    let restarted_in = restart.elapsed();
    let before = done.load(Ordering::Relaxed);
    wait_for(before + 40, "clients made no progress after the restart").await;
    stop.store(true, Ordering::Relaxed);

    let mut seen = Vec::new();
    for c in clients {
        seen.push(c.await.expect("a client failed"));
    }
    let acknowledged: Vec<&(String, (usize, usize))> = seen.iter().flat_map(|s| &s.acknowledged).collect();
    let recoveries: Vec<Duration> = seen.iter().flat_map(|s| s.recoveries.iter().copied()).collect();
    let mut failures: HashMap<u16, usize> = HashMap::new();
    for s in &seen {
        for (status, n) in &s.failures {
            *failures.entry(*status).or_default() += n;
        }
    }
    let transport_errors: usize = seen.iter().map(|s| s.transport_errors).sum();
    let slowest = recoveries.iter().max().copied().unwrap_or_default();
    eprintln!(
        "pg_ctl restart -m fast took {restarted_in:?}; {} batches acknowledged; failed attempts by status {failures:?}, \
         {transport_errors} without an answer; {} batches needed retries, slowest recovery {slowest:?}",
        acknowledged.len() / BATCH,
        recoveries.len()
    );
    assert!(!recoveries.is_empty(), "the restart interrupted some requests (else this test proves nothing)");
    assert_eq!(failures.get(&500), None, "a store restart is never a 500");
    assert!(failures.keys().all(|s| *s == 503), "only 503 while the store is away: {failures:?}");
    assert!(slowest < Duration::from_secs(5), "every retried batch was acknowledged within 5 s (slowest {slowest:?})");

    // Every acknowledged trace is stored, exactly once; nothing else is stored.
    let mut stored: Vec<(String, Value)> = Vec::new();
    let mut filter = TraceFilter::default();
    loop {
        let page = store.list_traces(&filter, 1000).await.expect("store is back");
        let Some(last) = page.last() else { break };
        filter.before_id = Some(last.id);
        stored.extend(page.into_iter().map(|t| (t.id.to_string(), t.metadata)));
    }
    let stored_ids: HashSet<&str> = stored.iter().map(|(id, _)| id.as_str()).collect();
    assert_eq!(stored_ids.len(), stored.len());
    let acked_ids: HashSet<&str> = acknowledged.iter().map(|(id, _)| id.as_str()).collect();
    assert_eq!(acked_ids.len(), acknowledged.len(), "no id acknowledged twice");
    assert!(acked_ids.iter().all(|id| stored_ids.contains(id)), "an acknowledged trace is missing");
    let mut per_trace: HashMap<(u64, u64, u64), usize> = HashMap::new();
    for (_, m) in &stored {
        let k = (m["client"].as_u64().unwrap(), m["batch"].as_u64().unwrap(), m["n"].as_u64().unwrap());
        *per_trace.entry(k).or_default() += 1;
    }
    let twice: Vec<_> = per_trace.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "traces stored more than once: {twice:?}");
    assert_eq!(stored.len(), acknowledged.len(), "nothing stored that was not acknowledged");

    shutdown.cancel();
    let _ = server.await;
    drop(pg);
}
