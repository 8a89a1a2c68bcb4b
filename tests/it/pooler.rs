//! combee behind a connection pooler: PgBouncer in transaction pooling mode
//! (`pool_mode = transaction`, started by `scripts/test` from
//! scripts/lib/pgbouncer.sh, stock settings but a small server pool) between
//! Postgres and five processes of the real `combee` binary, three API and two
//! workers, configured with `database.pooler = "transaction"` and a
//! `database.direct_url` for what needs a session (LISTEN, the migrations'
//! advisory locks). Traces are ingested through every API process, the
//! workers run a learning round against the LLM simulator, and a label move
//! made through one process is served by every API process within a second.

use crate::common;

use std::{
    collections::BTreeSet,
    str::FromStr,
    time::{Duration, Instant},
};

use combee::simulation::llm::{CapacityModel, SimConfig};
use common::{
    eventually, eventually_by, fresh_pg_database,
    processes::{Build, Process, free_port, ready},
    spawn_sim,
};
use serde_json::{Value, json};
use sqlx::{Connection, Row};

/// PgBouncer's address (the `postgres` database through it), or `None` when
/// PgBouncer is not installed, so the test says it was skipped. Installed but
/// not started is a failure: a pooler test that passes without a pooler would
/// hide that nothing ran.
fn pgbouncer_url() -> Option<String> {
    if let Ok(url) = std::env::var("COMBEE_TEST_PGBOUNCER_URL") {
        return Some(url);
    }
    let installed = ["/usr/sbin/pgbouncer", "/usr/bin/pgbouncer", "/usr/local/bin/pgbouncer"]
        .iter()
        .any(|p| std::path::Path::new(p).exists());
    assert!(
        !installed,
        "PgBouncer is installed but not started: run `scripts/test` (it starts one in transaction mode), \
         or set COMBEE_TEST_PGBOUNCER_URL"
    );
    eprintln!(
        "SKIPPED: pgbouncer is not installed and `scripts/test` could not install it (it does as root or in CI: \
         apt-get install pgbouncer)"
    );
    None
}

/// `url` with its database name replaced by `db`.
fn with_database(url: &str, db: &str) -> String {
    let (base, _) = url.rsplit_once('/').expect("a database URL has a path");
    format!("{base}/{db}")
}

/// Where the five processes find the database: the pooler, and Postgres itself.
struct Route<'a> {
    pooled: &'a str,
    direct: &'a str,
}

/// A `combee serve --role <role>` process through the pooler; its base URL.
fn combee(role: &str, route: &Route, data: &std::path::Path, env: &[(&str, &str)]) -> (Process, String) {
    let port = free_port();
    let mut cmd = Build::this().serve(role, port, route.pooled, data);
    cmd.env("COMBEE__DATABASE__POOLER", "transaction").env("COMBEE__DATABASE__DIRECT_URL", route.direct);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let child = cmd.spawn().unwrap_or_else(|e| panic!("start a combee {role} process: {e}"));
    (Process(child), format!("http://127.0.0.1:{port}"))
}

fn insight_trace(i: usize) -> Value {
    json!({
        "prompt": "pooled",
        "input": {"task": format!("task {i}")},
        "output": format!("answer {i}"),
        "feedback": {"success": !i.is_multiple_of(3), "comment": format!("INSIGHT-p{i:02}: check field {i} before answering")}
    })
}

fn insights(text: &str) -> BTreeSet<String> {
    text.split("INSIGHT-").skip(1).filter_map(|rest| rest.split(':').next()).map(str::to_owned).collect()
}

/// PgBouncer's admin console answers the simple query protocol only; its
/// rows for `db` as (column, text) pairs.
async fn show(bouncer: &str, what: &str, db: &str) -> Vec<Vec<(String, String)>> {
    let options = sqlx::postgres::PgConnectOptions::from_str(&with_database(bouncer, "pgbouncer"))
        .unwrap()
        .extra_float_digits(None);
    let mut admin = sqlx::PgConnection::connect_with(&options).await.expect("PgBouncer's admin console");
    let rows = sqlx::raw_sql(&format!("SHOW {what}")).fetch_all(&mut admin).await.expect("SHOW");
    rows.iter()
        .map(|r| {
            (0..r.len())
                .map(|i| {
                    let name = sqlx::Column::name(&r.columns()[i]).to_owned();
                    (name, r.try_get_unchecked::<Option<String>, _>(i).unwrap().unwrap_or_default())
                })
                .collect::<Vec<_>>()
        })
        .filter(|cols| cols.iter().any(|(k, v)| k == "database" && v == db))
        .collect()
}

fn column(row: &[(String, String)], name: &str) -> i64 {
    row.iter().find(|(k, _)| k == name).map_or(0, |(_, v)| v.parse().unwrap_or(0))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_api_and_two_worker_processes_learn_and_agree_through_pgbouncer_in_transaction_mode() {
    let Some(bouncer) = pgbouncer_url() else { return };
    let direct = fresh_pg_database().await;
    let db = direct.rsplit_once('/').unwrap().1.to_owned();
    let pooled = with_database(&bouncer, &db);
    let route = Route { pooled: &pooled, direct: &direct };

    // The first process migrates the schema and writes the first admin key;
    // then the other four start on the same database and data directory.
    let data = tempfile::tempdir().unwrap();
    let http = reqwest::Client::new();
    let (first, base) = combee("api", &route, data.path(), &[]);
    ready(&http, &base).await;
    let key = std::fs::read_to_string(data.path().join("admin-key")).expect("the admin key file").trim().to_owned();
    let (mut processes, mut apis) = (vec![first], vec![base]);
    for _ in 1..3 {
        let (p, base) = combee("api", &route, data.path(), &[]);
        processes.push(p);
        apis.push(base);
    }
    // The hard capacity model, with room for every insight: the test counts them.
    let sim = spawn_sim(SimConfig {
        seed: 7,
        fixed_ms: 20.0,
        capacity_model: CapacityModel::Hard,
        capacity_k: 24,
        digest_reflections: 24,
        ..SimConfig::default()
    })
    .await;
    let worker_env = [
        ("COMBEE__LLM__BASE_URL", sim.url.as_str()),
        ("COMBEE__LLM__MAX_CONCURRENCY", "2"),
        ("COMBEE__WORKER__POLL_INTERVAL_MS", "50"),
        ("COMBEE__WORKER__LEASE_SECS", "4"),
        ("COMBEE__WORKER__HEARTBEAT_SECS", "1"),
    ];
    let mut workers = Vec::new();
    for _ in 0..2 {
        let (p, base) = combee("worker", &route, data.path(), &worker_env);
        processes.push(p);
        workers.push(base);
    }
    for base in apis.iter().chain(&workers) {
        ready(&http, base).await;
    }
    let post =
        |base: &str, path: &str, body: Value| http.post(format!("{base}{path}")).bearer_auth(&key).json(&body).send();
    let get = |base: &str, path: &str| http.get(format!("{base}{path}")).bearer_auth(&key).send();

    let n = 12;
    let res = post(
        &apis[0],
        "/v1/prompts",
        json!({"name": "pooled", "base": "You answer support questions.", "strategy": "playbook",
               "promotion": "auto", "settings": {"batch_size": n}}),
    )
    .await
    .unwrap();
    assert_eq!(res.status(), 201, "{}", res.text().await.unwrap());

    // Four traces through each API process, in two batches: the second under
    // an Idempotency-Key, sent twice (the replay stores nothing new).
    let mut stored = BTreeSet::new();
    for (p, base) in apis.iter().enumerate() {
        let first: Vec<Value> = (0..2).map(|j| insight_trace(p * 4 + j)).collect();
        let res = post(base, "/v1/traces", json!({"traces": first})).await.unwrap();
        assert_eq!(res.status(), 201, "{}", res.text().await.unwrap());
        let body: Value = res.json().await.unwrap();
        stored.extend(body["ids"].as_array().unwrap().iter().map(|v| v.as_str().unwrap().to_owned()));
        let second = json!({"traces": (2..4).map(|j| insight_trace(p * 4 + j)).collect::<Vec<_>>()});
        let mut answers = Vec::new();
        for _ in 0..2 {
            let res = http
                .post(format!("{base}/v1/traces"))
                .bearer_auth(&key)
                .header("idempotency-key", format!("batch-{p}"))
                .json(&second)
                .send()
                .await
                .unwrap();
            assert!(res.status().is_success(), "{}", res.status());
            answers.push(res.json::<Value>().await.unwrap()["ids"].clone());
        }
        assert_eq!(answers[0], answers[1], "the replay answers the stored ids");
        stored.extend(answers[0].as_array().unwrap().iter().map(|v| v.as_str().unwrap().to_owned()));
    }
    assert_eq!(stored.len(), n, "every trace stored once");

    // A full backlog: a worker starts the round by itself and publishes version 2.
    let started = Instant::now();
    let published = eventually("the learned version", Duration::from_secs(60), async || {
        let p: Value = get(&apis[2], "/v1/prompts/pooled").await.unwrap().json().await.unwrap();
        if p["version"] == 2 { Ok(p) } else { Err(p.to_string()) }
    })
    .await;
    eprintln!("round published through PgBouncer {:?} after the last trace", started.elapsed());
    assert_eq!(insights(published["text"].as_str().unwrap()).len(), n, "{published}");
    let rounds: Value = get(&apis[1], "/v1/prompts/pooled/rounds").await.unwrap().json().await.unwrap();
    let round = &rounds["rounds"][0];
    assert_eq!((&round["status"], &round["trigger"]), (&json!("succeeded"), &json!("backlog")), "{rounds}");
    let consumed: Value =
        get(&apis[0], "/v1/traces?prompt=pooled&status=consumed&page_size=100").await.unwrap().json().await.unwrap();
    assert_eq!(consumed["traces"].as_array().unwrap().len(), n, "every trace consumed by the round");

    // Every API process serves (and caches) version 2; a move back to 1 made
    // through one of them reaches all three within a second.
    for base in &apis {
        for _ in 0..3 {
            let p: Value = get(base, "/v1/prompts/pooled").await.unwrap().json().await.unwrap();
            assert_eq!(p["version"], 2, "{base}");
        }
    }
    let moved_at = Instant::now();
    let res = http
        .put(format!("{}/v1/prompts/pooled/labels/production", apis[1]))
        .bearer_auth(&key)
        .json(&json!({"version": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200, "{}", res.text().await.unwrap());
    let deadline = moved_at + Duration::from_secs(1);
    let mut seen = Vec::new();
    for base in &apis {
        seen.push(
            eventually_by(&format!("the API process at {base} serves v1"), deadline, async || {
                let p: Value = get(base, "/v1/prompts/pooled").await.unwrap().json().await.unwrap();
                if p["version"] == 1 { Ok(moved_at.elapsed()) } else { Err(format!("it serves {}", p["version"])) }
            })
            .await,
        );
    }
    eprintln!("label move through one process served by the three API processes after {seen:?}");

    // It all went through PgBouncer, and each process's LISTEN went to Postgres directly.
    let stats = show(&bouncer, "STATS", &db).await;
    let clients = show(&bouncer, "CLIENTS", &db).await.len();
    let servers = show(&bouncer, "SERVERS", &db).await.len();
    let transactions: i64 = stats.iter().map(|r| column(r, "total_xact_count")).sum();
    eprintln!(
        "PgBouncer for this database: {clients} client connections on {servers} server connections, \
         {transactions} transactions"
    );
    assert!(transactions > 0 && clients >= 5, "the five processes talked through PgBouncer");
    let mut pg = sqlx::PgConnection::connect(&direct).await.unwrap();
    let listeners: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND query LIKE 'LISTEN %'",
    )
    .fetch_one(&mut pg)
    .await
    .unwrap();
    assert_eq!(listeners, 5, "one direct LISTEN session per process");
    drop(processes);
}

/// Two stores in one process, one through PgBouncer in transaction mode and
/// one straight to Postgres, each run their statements by their own route:
/// the pooled one unnamed and inside transactions, safe under many clients on
/// few server connections; the direct one named and kept, as it would be
/// alone in its process, though the pooled store opened first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_through_pgbouncer_and_a_direct_one_in_one_process_each_keep_their_own_route() {
    use combee::store::{
        Store,
        postgres::{self, PgStore, through_pooler},
    };
    let Some(bouncer) = pgbouncer_url() else { return };
    let direct_url = fresh_pg_database().await;
    let db = direct_url.rsplit_once('/').unwrap().1.to_owned();
    let timeout = Duration::from_secs(10);
    let via_bouncer = postgres::Route { direct_url: Some(direct_url.clone()), transaction_pooler: true };
    let pooled = PgStore::connect(&with_database(&bouncer, &db), &via_bouncer, 8, timeout)
        .await
        .expect("the store through PgBouncer");
    // Two connections: one the change listener holds, one for everything else,
    // so the session inspected below is the one the store's statements ran on.
    let direct =
        PgStore::connect(&direct_url, &postgres::Route::default(), 2, timeout).await.expect("the direct store");
    let mut admin = sqlx::PgConnection::connect(&direct_url).await.unwrap();
    eventually("the direct store's change listener", Duration::from_secs(10), async || {
        let listening: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND query LIKE 'LISTEN %'",
        )
        .fetch_one(&mut admin)
        .await
        .unwrap();
        // The pooled store's listener is one too (through its direct URL).
        if listening == 2 { Ok(()) } else { Err(format!("{listening} sessions listen")) }
    })
    .await;

    // Many clients through the pooler at once: named statements or a statement
    // split over two server connections would fail here.
    let pings = (0..16).map(|_| {
        let pooled = &pooled;
        async move {
            for _ in 0..25 {
                pooled.ping().await?;
            }
            Ok::<_, combee::store::StoreError>(())
        }
    });
    for done in futures_util::future::join_all(pings).await {
        done.expect("the pooled store's statements through PgBouncer");
    }
    direct.ping().await.expect("the direct store");

    let c = pooled.pool().acquire().await.unwrap();
    assert!(through_pooler(&c), "a connection of the pooled store runs the pooler's way");
    assert_eq!(sqlx::Connection::cached_statements_size(&*c), 0, "the pooled store caches nothing");
    drop(c);
    let mut c = direct.pool().acquire().await.unwrap();
    assert!(!through_pooler(&c), "a connection of the direct store runs statements as written");
    let named: Vec<String> =
        sqlx::query_scalar("SELECT statement FROM pg_prepared_statements").fetch_all(&mut *c).await.unwrap();
    assert!(
        named.iter().any(|s| s == "SELECT 1 AS one"),
        "the direct store's ping ran as a named, kept statement on its session: {named:?}"
    );
}
