//! Postgres as the coordination point of many writers and many processes:
//! gapless version numbers under 100 concurrent API writers, and a label move
//! made through one server process seen by another within about a second,
//! and two API processes serving the same `evaluated` traffic weights (the same
//! arm for every subject) within about a second of a weight change.

use crate::common;

use std::{
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use combee::{
    domain::{
        PromptName,
        population::{ArmState, PopulationArm},
    },
    evaluate::{assign::sticky_arm, trueskill::Rating},
};
use common::{Backend, eventually, spawn_app};
use futures_util::{StreamExt, stream};
use serde_json::{Value, json};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hundred_concurrent_version_creations_give_versions_one_to_101() {
    let app = spawn_app(Backend::Postgres).await;
    app.create_prompt("busy").await;
    let tasks: Vec<_> = (0..100)
        .map(|i| {
            let req = app.post("/v1/prompts/busy/versions", json!({"base": format!("edit {i}")}));
            tokio::spawn(async move { req.send().await.unwrap().status().as_u16() })
        })
        .collect();
    for t in tasks {
        assert_eq!(t.await.unwrap(), 201);
    }
    let mut numbers = Vec::new();
    let mut token: Option<String> = None;
    loop {
        let path = match &token {
            Some(t) => format!("/v1/prompts/busy/versions?page_size=200&page_token={t}"),
            None => "/v1/prompts/busy/versions?page_size=200".to_owned(),
        };
        let page: Value = app.get(&path).send().await.unwrap().json().await.unwrap();
        numbers.extend(page["versions"].as_array().unwrap().iter().map(|v| v["number"].as_i64().unwrap()));
        match page["next_page_token"].as_str() {
            Some(t) => token = Some(t.to_owned()),
            None => break,
        }
    }
    numbers.sort();
    assert_eq!(numbers, (1..=101).collect::<Vec<_>>(), "exactly 1..=101, no gap, no duplicate");
}

struct ChildServer(Child);

impl Drop for ChildServer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_label_move_reaches_a_second_process_within_a_second() {
    let app = spawn_app(Backend::Postgres).await;
    app.create_prompt("shared").await;
    let v2 = app.post("/v1/prompts/shared/versions", json!({"base": "second"})).send().await.unwrap();
    assert_eq!(v2.status(), 201);

    let port = free_port();
    let data = tempfile::tempdir().unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_combee"))
        .args(["serve", "--bind", &format!("127.0.0.1:{port}")])
        .env("DATABASE_URL", &app.url)
        .env("COMBEE_CONFIG_DIR", concat!(env!("CARGO_MANIFEST_DIR"), "/config"))
        .env("COMBEE__DATABASE__DATA_DIR", data.path())
        .env("COMBEE__LOG__LEVEL", "warn")
        .stdout(Stdio::null())
        .spawn()
        .expect("start a second combee process");
    let _child = ChildServer(child);
    let other = format!("http://127.0.0.1:{port}");
    ready(&app.http, &other).await;
    let get_other = || app.http.get(format!("{other}/v1/prompts/shared")).bearer_auth(&app.admin_key).send();
    // The second process serves (and caches) version 1.
    for _ in 0..3 {
        let body: Value = get_other().await.unwrap().json().await.unwrap();
        assert_eq!(body["version"], 1);
    }
    let moved_at = Instant::now();
    let res = app.put("/v1/prompts/shared/labels/production", json!({"version": 2})).send().await.unwrap();
    assert_eq!(res.status(), 200);
    loop {
        let body: Value = get_other().await.unwrap().json().await.unwrap();
        if body["version"] == 2 {
            break;
        }
        assert!(moved_at.elapsed() < Duration::from_millis(1500), "second process still served v1 after 1.5 s");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let seen_after = moved_at.elapsed();
    eprintln!("label move seen by the second process after {seen_after:?}");
    assert!(seen_after < Duration::from_millis(1500));
}

/// A `combee serve --role api` process on `db` (no worker, so no rater moves
/// the weights behind the test's back), ready to answer.
async fn api_process(http: &reqwest::Client, db: &str, data: &std::path::Path) -> (ChildServer, String) {
    let port = free_port();
    let child = Command::new(env!("CARGO_BIN_EXE_combee"))
        .args(["serve", "--role", "api", "--bind", &format!("127.0.0.1:{port}")])
        .env("DATABASE_URL", db)
        .env("COMBEE_CONFIG_DIR", concat!(env!("CARGO_MANIFEST_DIR"), "/config"))
        .env("COMBEE__DATABASE__DATA_DIR", data)
        .env("COMBEE__LOG__LEVEL", "warn")
        .stdout(Stdio::null())
        .spawn()
        .expect("start an API process");
    let child = ChildServer(child);
    let base = format!("http://127.0.0.1:{port}");
    ready(http, &base).await;
    (child, base)
}

/// Waits for the process at `base` to answer `/readyz` with 200.
async fn ready(http: &reqwest::Client, base: &str) {
    eventually(&format!("{base} ready"), Duration::from_secs(30), async || {
        match http.get(format!("{base}/readyz")).send().await {
            Ok(r) if r.status() == 200 => Ok(()),
            Ok(r) => Err(r.status().to_string()),
            Err(e) => Err(e.to_string()),
        }
    })
    .await
}

fn arm(version: i64, state: ArmState, weight: f64) -> PopulationArm {
    PopulationArm {
        version,
        state,
        rating: Rating::default(),
        weight,
        scored_traces: 0,
        created_from: (version > 1).then_some(1),
        parents: if version > 1 { vec![1] } else { vec![] },
        rated_until: None,
    }
}

/// The version each subject is served by the process at `base`, in subject order.
async fn assignments(http: &reqwest::Client, base: &str, key: &str, subjects: &[String]) -> Vec<i64> {
    let mut served: Vec<(usize, i64)> = stream::iter(subjects.iter().enumerate())
        .map(|(i, subject)| async move {
            let res = http
                .get(format!("{base}/v1/prompts/split"))
                .bearer_auth(key)
                .header("Combee-Subject", subject)
                .send()
                .await
                .expect("GET the prompt");
            assert_eq!(res.status(), 200);
            let body: Value = res.json().await.unwrap();
            (i, body["version"].as_i64().expect("a version"))
        })
        .buffer_unordered(16)
        .collect()
        .await;
    served.sort_unstable();
    served.into_iter().map(|(_, v)| v).collect()
}

/// The evaluated policy across processes: two API processes (separate `combee` binaries, each
/// with its own cache and pool) on ONE Postgres serve the same traffic weights
/// within about a second of a change, so a subject gets the same arm whichever
/// process answers. Postgres only: `NOTIFY` is what carries the change between
/// processes (SQLite serves one process). The weights are changed in the store,
/// as the rater in a worker process does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_api_processes_serve_the_same_arms_within_a_second_of_a_weight_change() {
    let app = spawn_app(Backend::Postgres).await;
    let res =
        app.post("/v1/prompts", json!({"name": "split", "base": "v1", "promotion": "evaluated"})).send().await.unwrap();
    assert_eq!(res.status(), 201);
    for v in 2..=3 {
        let res = app.post("/v1/prompts/split/versions", json!({"base": format!("v{v}")})).send().await.unwrap();
        assert_eq!(res.status(), 201);
    }
    let prompt = PromptName::parse("split").unwrap();
    let before =
        [arm(1, ArmState::Champion, 0.8), arm(2, ArmState::Challenger, 0.1), arm(3, ArmState::Challenger, 0.1)];
    app.store.save_population(&prompt, &before).await.unwrap();

    let (data_a, data_b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (_a, base_a) = api_process(&app.http, &app.url, data_a.path()).await;
    let (_b, base_b) = api_process(&app.http, &app.url, data_b.path()).await;
    let subjects: Vec<String> = (0..300).map(|i| format!("user-{i}")).collect();
    let expected = |arms: &[PopulationArm]| -> Vec<i64> {
        let weights: Vec<(i64, f64)> = arms.iter().map(|a| (a.version, a.weight)).collect();
        subjects.iter().map(|s| weights[sticky_arm(s, "split", &weights).unwrap()].0).collect()
    };
    let after = [arm(1, ArmState::Champion, 0.2), arm(2, ArmState::Challenger, 0.5), arm(3, ArmState::Challenger, 0.3)];
    let (old, new) = (expected(&before), expected(&after));
    let moved = old.iter().zip(&new).filter(|(o, n)| o != n).count();
    assert!(moved >= subjects.len() / 3, "the change must move many subjects to mean anything; moved {moved}");

    // Both processes serve (and cache) the old weights: identical arms.
    let served_a = assignments(&app.http, &base_a, &app.admin_key, &subjects).await;
    let served_b = assignments(&app.http, &base_b, &app.admin_key, &subjects).await;
    assert_eq!(served_a, old, "process A serves the stored weights");
    assert_eq!(served_b, served_a, "both processes give every subject the same arm");

    let changed_at = Instant::now();
    app.store.save_population(&prompt, &after).await.unwrap();
    let (mut seen_a, mut seen_b) = (None, None);
    while seen_a.is_none() || seen_b.is_none() {
        for (base, seen) in [(&base_a, &mut seen_a), (&base_b, &mut seen_b)] {
            if seen.is_none() && assignments(&app.http, base, &app.admin_key, &subjects).await == new {
                *seen = Some(changed_at.elapsed());
            }
        }
        assert!(
            changed_at.elapsed() < Duration::from_millis(1500),
            "after 1.5 s process A follows the new weights: {}, process B: {}",
            seen_a.is_some(),
            seen_b.is_some()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (seen_a, seen_b) = (seen_a.unwrap(), seen_b.unwrap());
    eprintln!(
        "weight change served by both API processes for all {} subjects ({moved} moved arm): process A after {seen_a:?}, process B after {seen_b:?}",
        subjects.len()
    );
    // And they agree once more, subject by subject.
    let served_a = assignments(&app.http, &base_a, &app.admin_key, &subjects).await;
    let served_b = assignments(&app.http, &base_b, &app.admin_key, &subjects).await;
    assert_eq!(served_a, new);
    assert_eq!(served_b, served_a, "both processes give every subject the same arm after the change");
}

fn worker_process(db: &str, llm: &str, data: &std::path::Path) -> ChildServer {
    let child = Command::new(env!("CARGO_BIN_EXE_combee"))
        .args(["serve", "--role", "worker", "--bind", &format!("127.0.0.1:{}", free_port())])
        .env("DATABASE_URL", db)
        .env("COMBEE_CONFIG_DIR", concat!(env!("CARGO_MANIFEST_DIR"), "/config"))
        .env("COMBEE__DATABASE__DATA_DIR", data)
        .env("COMBEE__LOG__LEVEL", "warn")
        .env("COMBEE__LLM__BASE_URL", llm)
        .env("COMBEE__LLM__MAX_CONCURRENCY", "2")
        .env("COMBEE__WORKER__LEASE_SECS", "2")
        .env("COMBEE__WORKER__HEARTBEAT_SECS", "1")
        .env("COMBEE__WORKER__POLL_INTERVAL_MS", "50")
        .stdout(Stdio::null())
        .spawn()
        .expect("start a worker process");
    ChildServer(child)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_round_killed_mid_map_is_finished_by_another_process_without_paying_twice() {
    let sim =
        common::spawn_sim(combee::simulation::llm::SimConfig { seed: 3, fixed_ms: 120.0, ..Default::default() }).await;
    let app = spawn_app(Backend::Postgres).await; // API only: the rounds run in the child processes
    let res = app
        .post("/v1/prompts", json!({"name": "crashy", "base": "Base.", "settings": {"batch_size": 1000}}))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 201);
    let n = 30;
    let traces: Vec<Value> = (0..n)
        .map(|i| json!({"prompt": "crashy", "input": i, "feedback": {"comment": format!("INSIGHT-c{i:02}: lesson {i}")}}))
        .collect();
    assert_eq!(app.post("/v1/traces", json!({"traces": traces})).send().await.unwrap().status(), 201);
    let round: Value = app.post("/v1/prompts/crashy/rounds", json!({})).send().await.unwrap().json().await.unwrap();
    let id = round["id"].as_str().unwrap().to_owned();
    let data = tempfile::tempdir().unwrap();

    let round_view =
        || async { app.get(&format!("/v1/rounds/{id}")).send().await.unwrap().json::<Value>().await.unwrap() };
    let mut first = worker_process(&app.url, &sim.url, data.path());
    let r = eventually("six stored reflections", Duration::from_secs(30), async || {
        let r = round_view().await;
        if r["reflections"].as_array().unwrap().len() >= 6 { Ok(r) } else { Err(r.to_string()) }
    })
    .await;
    assert_eq!(r["status"], "running");
    first.0.kill().expect("kill -9 the worker running the round");
    first.0.wait().unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let stored_before = round_view().await["reflections"].as_array().unwrap().len();
    let asked_before = sim.calls("reflect").await;
    assert!(stored_before < n, "the crash happened during the map phase");

    let _second = worker_process(&app.url, &sim.url, data.path());
    let done = common::round_end(&app, &id, Duration::from_secs(60)).await;
    assert_eq!(done["status"], "succeeded", "{done}");
    assert_eq!(done["attempt"], 2, "claimed once by each process");
    let asked_after = sim.calls("reflect").await;
    assert_eq!(
        asked_after - asked_before,
        (n - stored_before) as u64,
        "the second process asked only for the reflections that were not stored"
    );
    assert_eq!(done["reflections"].as_array().unwrap().len(), n);
    // Every trace consumed exactly once, by this round.
    let consumed: Value =
        app.get("/v1/traces?prompt=crashy&status=consumed&page_size=100").send().await.unwrap().json().await.unwrap();
    let consumed = consumed["traces"].as_array().unwrap();
    assert_eq!(consumed.len(), n);
    assert!(consumed.iter().all(|t| t["round_id"] == id.as_str()));
    let pending: Value = app.get("/v1/traces?prompt=crashy&status=pending").send().await.unwrap().json().await.unwrap();
    assert!(pending["traces"].as_array().unwrap().is_empty());
    let versions: Value = app.get("/v1/prompts/crashy/versions").send().await.unwrap().json().await.unwrap();
    assert_eq!(versions["versions"].as_array().unwrap().len(), 2, "one learned version, published once");
    eprintln!(
        "kill -9 after {stored_before} of {n} reflections: the second process asked for {} more (simulated LLM)",
        asked_after - asked_before
    );
}
