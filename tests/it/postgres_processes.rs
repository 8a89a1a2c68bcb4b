//! Postgres as the coordination point of many writers and many processes:
//! gapless version numbers under 100 concurrent API writers, and a label move
//! made through one server process seen by another within about a second,
//! and two API processes serving the same `evaluated` traffic weights (the same
//! arm for every subject) within about a second of a weight change; and rounds
//! whose worker process is killed (kill -9) during the map or during level 1 of
//! the reduce, finished by another worker process without paying twice.

use crate::common;

use std::time::{Duration, Instant};

use combee::{
    domain::{
        PromptName,
        population::{ArmState, PopulationArm},
    },
    evaluate::{assign::sticky_arm, trueskill::Rating},
};
use common::{
    Backend, eventually, eventually_by,
    processes::{Build, Process, free_port, ready, sessions_ended, tcp_ports_of},
    spawn_app,
};
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_label_move_reaches_a_second_process_within_a_second() {
    let app = spawn_app(Backend::Postgres).await;
    app.create_prompt("shared").await;
    let v2 = app.post("/v1/prompts/shared/versions", json!({"base": "second"})).send().await.unwrap();
    assert_eq!(v2.status(), 201);

    let port = free_port();
    let data = tempfile::tempdir().unwrap();
    let child = Build::this().serve("all", port, &app.url, data.path()).spawn().expect("start a second combee process");
    let _child = Process(child);
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
    let seen_after = eventually("the second process serves version 2", Duration::from_millis(1500), async || {
        let body: Value = get_other().await.unwrap().json().await.unwrap();
        if body["version"] == 2 {
            Ok(moved_at.elapsed())
        } else {
            Err(format!("it serves version {}", body["version"]))
        }
    })
    .await;
    eprintln!("label move seen by the second process after {seen_after:?}");
}

/// A `combee serve --role api` process on `db` (no worker, so no rater moves
/// the weights behind the test's back), ready to answer.
async fn api_process(http: &reqwest::Client, db: &str, data: &std::path::Path) -> (Process, String) {
    let port = free_port();
    let child = Process(Build::this().serve("api", port, db, data).spawn().expect("start an API process"));
    let base = format!("http://127.0.0.1:{port}");
    ready(http, &base).await;
    (child, base)
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
        joined_at: None,
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
    let prompt = PromptName::written("split", "default").unwrap();
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
    // Each process must serve the new weights to every subject within 1.5 s of the change.
    let deadline = changed_at + Duration::from_millis(1500);
    let follows = |base: String| {
        let (http, key, subjects, new) = (&app.http, &app.admin_key, &subjects, &new);
        async move || {
            let served = assignments(http, &base, key, subjects).await;
            let stale = served.iter().zip(new).filter(|(s, n)| s != n).count();
            if stale == 0 { Ok(changed_at.elapsed()) } else { Err(format!("{stale} subjects still get their old arm")) }
        }
    };
    let seen_a = eventually_by("process A follows the new weights", deadline, follows(base_a.clone())).await;
    let seen_b = eventually_by("process B follows the new weights", deadline, follows(base_b.clone())).await;
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

fn worker_process(db: &str, llm: &str, data: &std::path::Path) -> Process {
    worker_process_on(free_port(), db, llm, data)
}

/// A `combee serve --role worker` process whose ops endpoints listen on `port`,
/// with a short lease (2 s) so a killed process's round is claimed again soon.
fn worker_process_on(port: u16, db: &str, llm: &str, data: &std::path::Path) -> Process {
    let child = Build::this()
        .serve("worker", port, db, data)
        .env("COMBEE__LLM__BASE_URL", llm)
        .env("COMBEE__LLM__MAX_CONCURRENCY", "2")
        .env("COMBEE__WORKER__LEASE_SECS", "2")
        .env("COMBEE__WORKER__HEARTBEAT_SECS", "1")
        .env("COMBEE__WORKER__POLL_INTERVAL_MS", "50")
        .spawn()
        .expect("start a worker process");
    Process(child)
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
    let sessions = tcp_ports_of(first.0.id());
    first.0.kill().expect("kill -9 the worker running the round");
    first.0.wait().unwrap();
    // Whatever the dead process had sent the database has landed (or rolled back).
    sessions_ended(&app.url, &sessions).await;
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

/// Bullets in the playbook of the level-1 resume test's base version.
const STANDING_BULLETS: usize = 320;
/// Traces (each its own lesson) in the level-1 resume test's round.
const RESUME_TRACES: usize = 64;

/// A prompt `name` whose production version (2, made through the API) carries a
/// playbook of [`STANDING_BULLETS`] bullets, with [`RESUME_TRACES`] pending traces of
/// distinct lessons; level 2 consolidates through the model (`reduce = "llm"`).
async fn crowded_prompt(app: &common::TestApp, name: &str) {
    let settings = json!({"batch_size": 1000, "reduce": "llm"});
    let res = app
        .post("/v1/prompts", json!({"name": name, "base": "Answer the user.", "settings": settings}))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 201);
    let bullets: Vec<Value> = (0..STANDING_BULLETS)
        .map(|i| json!({"content": format!("Standing rule {i}: check case {i} of the input before answering.")}))
        .collect();
    let playbook = json!({"sections": [{"name": "strategies", "bullets": bullets}]});
    let res = app
        .post(&format!("/v1/prompts/{name}/versions"), json!({"playbook": playbook, "labels": ["production"]}))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 201, "{}", res.text().await.unwrap());
    let traces: Vec<Value> = (0..RESUME_TRACES)
        .map(|i| json!({"prompt": name, "input": i, "feedback": {"comment": format!("INSIGHT-{name}-{i:03}: lesson {i}")}}))
        .collect();
    for batch in traces.chunks(32) {
        assert_eq!(app.post("/v1/traces", json!({"traces": batch})).send().await.unwrap().status(), 201);
    }
}

/// A ready worker process (its own data dir) on `db` learning through `llm`.
async fn ready_worker(http: &reqwest::Client, db: &str, llm: &str) -> (Process, tempfile::TempDir) {
    let data = tempfile::tempdir().unwrap();
    let port = free_port();
    let child = worker_process_on(port, db, llm, data.path());
    ready(http, &format!("http://127.0.0.1:{port}")).await;
    (child, data)
}

/// The level-1 groups a round's record holds journaled outputs for.
fn journaled_groups(round: &Value) -> usize {
    round["detail"]["group_outputs"].as_array().map_or(0, Vec::len)
}

/// A round's phases as `phase started_at +elapsed_ms`, for the test's figures.
fn phase_figures(round: &Value) -> String {
    let phases = round["detail"]["phases"].as_object().cloned().unwrap_or_default();
    let mut spans: Vec<(String, String)> = phases
        .iter()
        .map(|(name, span)| {
            let at = span["started_at"].as_str().unwrap_or("?").to_owned();
            (at.clone(), format!("{name} {at} +{}ms", span["elapsed_ms"]))
        })
        .collect();
    spans.sort();
    spans.into_iter().map(|(_, s)| s).collect::<Vec<_>>().join(", ")
}

/// The pid in a worker's lease owner (`host:pid:random`).
fn owner_pid(owner: &str) -> u32 {
    let mut parts = owner.rsplitn(3, ':');
    let (_tag, pid) = (parts.next(), parts.next());
    pid.and_then(|p| p.parse().ok()).unwrap_or_else(|| panic!("a lease owner names its pid: {owner:?}"))
}

/// A round killed (kill -9 of the worker process holding its lease) while level 1
/// of the reduce has journaled some of its group outputs is finished by another of
/// several worker processes, which asks the aggregator only for the groups not yet
/// journaled and no reflection again, in less than twice the time of the same round
/// run without a crash (measured from the kill, the wait for the lease included).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_round_killed_during_level_one_is_finished_by_another_worker_without_paying_twice() {
    let sim_config = || combee::simulation::llm::SimConfig { seed: 5, fixed_ms: 150.0, ..Default::default() };
    let app = spawn_app(Backend::Postgres).await; // API only: the rounds run in the child processes
    let round_view = |id: String| {
        let req = app.get(&format!("/v1/rounds/{id}"));
        async move { req.send().await.unwrap().json::<Value>().await.unwrap() }
    };

    // The same round once without a crash: its wall time is the yardstick.
    let steady_sim = common::spawn_sim(sim_config()).await;
    crowded_prompt(&app, "steady").await;
    let (steady_worker, _steady_data) = ready_worker(&app.http, &app.url, &steady_sim.url).await;
    let started = Instant::now();
    let round: Value = app.post("/v1/prompts/steady/rounds", json!({})).send().await.unwrap().json().await.unwrap();
    let steady = common::round_end(&app, round["id"].as_str().unwrap(), Duration::from_secs(120)).await;
    let uninterrupted = started.elapsed();
    drop(steady_worker);
    assert_eq!(steady["status"], "succeeded", "{steady}");
    assert_eq!(steady["attempt"], 1);
    assert_eq!(steady["base_version"], 2, "the round learns from the version with the long playbook");
    let k = steady["k"].as_u64().expect("the round's level-1 groups");
    assert!(k >= 16, "many level-1 groups, so a crash can land between them: {k}");
    assert_eq!(steady_sim.calls("aggregate-playbook").await, k, "one aggregator call per group without a crash");

    // The same round again, on several worker processes, one of them killed during level 1.
    let sim = common::spawn_sim(sim_config()).await;
    crowded_prompt(&app, "crashy-reduce").await;
    let mut workers = Vec::new();
    for _ in 0..3 {
        workers.push(ready_worker(&app.http, &app.url, &sim.url).await);
    }
    let round: Value =
        app.post("/v1/prompts/crashy-reduce/rounds", json!({})).send().await.unwrap().json().await.unwrap();
    let id = round["id"].as_str().unwrap().to_owned();
    eventually("level 1 journals a few group outputs", Duration::from_secs(60), async || {
        let r = round_view(id.clone()).await;
        if journaled_groups(&r) >= 4 { Ok(()) } else { Err(format!("{} group outputs", journaled_groups(&r))) }
    })
    .await;
    let owner: String = {
        use sqlx::Connection;
        let mut c = sqlx::PgConnection::connect(&app.url).await.unwrap();
        sqlx::query_scalar("SELECT lease_owner FROM rounds WHERE id = $1::uuid")
            .bind(&id)
            .fetch_one(&mut c)
            .await
            .unwrap()
    };
    let pid = owner_pid(&owner);
    let holder = workers.iter().position(|(w, _)| w.0.id() == pid).expect("the lease owner is one of the workers");
    let (mut killed, _data) = workers.remove(holder);
    let sessions = tcp_ports_of(killed.0.id());
    killed.0.kill().expect("kill -9 the worker holding the round's lease");
    let (killed_at, killed_utc) = (Instant::now(), chrono::Utc::now());
    killed.0.wait().unwrap();
    // Whatever the dead process had sent the database has landed (or rolled back).
    sessions_ended(&app.url, &sessions).await;
    let before = round_view(id.clone()).await;
    let journaled_before = journaled_groups(&before) as u64;
    let aggregated_before = sim.calls("aggregate-playbook").await;
    let reflected_before = sim.calls("reflect").await;
    assert_eq!(before["status"], "running", "{before}");
    assert!(before["detail"]["phases"]["reduce1"]["finished_at"].is_null(), "the crash came during level 1: {before}");
    assert_eq!(reflected_before, RESUME_TRACES as u64, "the map was over, every reflection asked once");

    let done = common::round_end(&app, &id, Duration::from_secs(120)).await;
    let resumed = killed_at.elapsed();
    assert_eq!(done["status"], "succeeded", "{done}");
    assert_eq!(done["attempt"], 2, "claimed once by the killed process and once by another");
    assert_eq!(done["k"].as_u64(), Some(k), "the same grouping as the uninterrupted round");
    assert!(
        journaled_before > 0 && journaled_before < k,
        "some but not all groups journaled: {journaled_before} of {k}"
    );
    let aggregated_after = sim.calls("aggregate-playbook").await - aggregated_before;
    assert!(
        aggregated_after <= k - journaled_before,
        "the resumed attempt asked the aggregator {aggregated_after} times; {} groups were not journaled",
        k - journaled_before
    );
    assert_eq!(
        done["detail"]["outcome"]["resumed_groups"].as_u64(),
        Some(journaled_before),
        "every journaled group output reused"
    );
    assert_eq!(sim.calls("reflect").await, RESUME_TRACES as u64, "no reflection asked twice");
    assert_eq!(done["reflections"].as_array().unwrap().len(), RESUME_TRACES);
    let versions: Value = app.get("/v1/prompts/crashy-reduce/versions").send().await.unwrap().json().await.unwrap();
    assert_eq!(versions["versions"].as_array().unwrap().len(), 3, "one learned version, published once");
    let consolidations = sim.calls("consolidate-playbook").await;
    eprintln!(
        "uninterrupted round: {uninterrupted:?} ({k} level-1 groups, {} consolidations); kill -9 after {journaled_before} of \
         {k} group outputs were journaled ({aggregated_before} aggregator calls asked by then); the resumed attempt asked \
         {aggregated_after} aggregator calls and {consolidations} consolidations (all attempts) and finished {resumed:?} \
         after the kill ({:.2}× the uninterrupted round)",
        steady_sim.calls("consolidate-playbook").await,
        resumed.as_secs_f64() / uninterrupted.as_secs_f64()
    );
    eprintln!("uninterrupted round's phases: {}", phase_figures(&steady));
    // (count, mean latency in ms) of one attempt's calls in one role.
    let latencies = |round: &Value, attempt: i64, role: &str| -> (usize, u64) {
        let calls = round["llm_calls"].as_array().unwrap();
        let ms: Vec<u64> = calls
            .iter()
            .filter(|c| c["role"] == role && c["attempt"] == attempt)
            .filter_map(|c| c["latency_ms"].as_u64())
            .collect();
        (ms.len(), ms.iter().sum::<u64>() / ms.len().max(1) as u64)
    };
    eprintln!(
        "calls (count, mean latency ms): uninterrupted reflector {:?}, aggregator {:?}; resumed attempt reflector {:?}, \
         aggregator {:?}",
        latencies(&steady, 1, "reflector"),
        latencies(&steady, 1, "aggregator"),
        latencies(&done, 2, "reflector"),
        latencies(&done, 2, "aggregator")
    );
    eprintln!("killed at {}; the resumed attempt's phases: {}", killed_utc.to_rfc3339(), phase_figures(&done));
    assert!(
        resumed < uninterrupted * 2,
        "the resumed attempt took {resumed:?} after the kill; the uninterrupted round {uninterrupted:?}"
    );
}
