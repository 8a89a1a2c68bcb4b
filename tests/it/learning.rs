//! Learning end to end: the real server on port 0 with its worker, a real
//! store, and the OpenAI-compatible simulator (a simulation, not a model) as
//! the LLM. Every trace carries one distinct `INSIGHT-<token>` line; the
//! simulator carries markers through, so a test counts exactly which insights
//! reached the published prompt.

use crate::common;

use std::{
    collections::BTreeSet,
    time::{Duration, Instant},
};

use combee::simulation::llm::{CapacityModel, SimConfig};
use common::{Backend, TestApp, eventually, expect_problem, learning, round_end, spawn_app_with, spawn_sim};
use serde_json::{Value, json};

fn insight_trace(prompt: &str, i: usize) -> Value {
    json!({
        "prompt": prompt,
        "input": {"task": format!("task {i}")},
        "trajectory": [{"role": "assistant", "content": format!("worked on task {i}")}],
        "output": format!("answer {i}"),
        "feedback": {"success": !i.is_multiple_of(3), "comment": format!("INSIGHT-i{i:03}: check field {i} before answering")}
    })
}

fn insights(text: &str) -> BTreeSet<String> {
    text.split("INSIGHT-")
        .skip(1)
        .filter_map(|rest| rest.split(':').next())
        .filter(|t| !t.is_empty() && t.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-'))
        .map(str::to_owned)
        .collect()
}

/// Creates a prompt; unless the test sets one, a fixed batch size so the
/// worker's controller does not start warm-up rounds on its own.
async fn create(app: &TestApp, name: &str, strategy: &str, mut settings: Value) {
    if settings.get("batch_size").is_none() {
        settings["batch_size"] = json!(1000);
    }
    let res = app
        .post("/v1/prompts", json!({"name": name, "base": "You answer support questions. Use {customer_name}.", "strategy": strategy, "promotion": "auto", "settings": settings}))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 201, "{}", res.text().await.unwrap());
}

async fn send_traces(app: &TestApp, name: &str, n: usize) {
    send_traces_from(app, name, 0, n).await;
}

/// Sends the traces `from..to` while the prompt waits (a fixed batch it does not
/// reach, a long `max_wait_secs`), then lets the controller choose: the worker
/// sees them all at once.
async fn send_traces_at_once(app: &TestApp, name: &str, from: usize, to: usize) {
    let patch = |body: Value| {
        app.http
            .patch(app.url(&format!("/v1/prompts/{name}/settings")))
            .bearer_auth(&app.admin_key)
            .header("content-type", "application/merge-patch+json")
            .body(body.to_string())
            .send()
    };
    assert_eq!(patch(json!({"batch_size": 10000, "max_wait_secs": 3600})).await.unwrap().status(), 200);
    send_traces_from(app, name, from, to).await;
    assert_eq!(patch(json!({"batch_size": "auto", "max_wait_secs": 1})).await.unwrap().status(), 200);
}

/// Sends the traces `from..to`, each with its own insight.
async fn send_traces_from(app: &TestApp, name: &str, from: usize, to: usize) {
    let traces: Vec<Value> = (from..to).map(|i| insight_trace(name, i)).collect();
    for chunk in traces.chunks(50) {
        let res = app.post("/v1/traces", json!({"traces": chunk})).send().await.unwrap();
        assert_eq!(res.status(), 201);
    }
}

async fn trigger(app: &TestApp, name: &str, body: Value) -> Value {
    let res = app.post(&format!("/v1/prompts/{name}/rounds"), body).send().await.unwrap();
    assert_eq!(res.status(), 202, "{}", res.text().await.unwrap());
    res.json().await.unwrap()
}

async fn learn(app: &TestApp, name: &str, strategy: &str, method: &str, p: u32) -> (Value, BTreeSet<String>) {
    create(app, name, strategy, json!({"duplication": p})).await;
    send_traces(app, name, 100).await;
    let round = trigger(app, name, json!({"method": method, "batch_size": 100})).await;
    let done = round_end(app, round["id"].as_str().unwrap(), Duration::from_secs(60)).await;
    assert_eq!(done["status"], "succeeded", "{done}");
    let prompt: Value = app.get(&format!("/v1/prompts/{name}")).send().await.unwrap().json().await.unwrap();
    assert_eq!(prompt["version"], done["result_version"]);
    (done, insights(prompt["text"].as_str().unwrap()))
}

fn sim() -> SimConfig {
    // The hard capacity model: these tests count exactly which insights survive.
    SimConfig {
        seed: 7,
        capacity_model: CapacityModel::Hard,
        capacity_k: 12,
        digest_reflections: 12,
        ..SimConfig::default()
    }
}

async fn combee_keeps_what_naive_loses(b: Backend, strategy: &str) {
    let sim = spawn_sim(sim()).await;
    let app = spawn_app_with(b, |s| learning(s, &sim.url)).await;
    // p = 1: with a hard capacity of K = 12 per call, groups of n/k = 10 fit; see docs/learning.md on p.
    let (combee, kept) = learn(&app, "combee-run", strategy, "combee", 1).await;
    assert_eq!((combee["n"].as_i64(), combee["k"].as_i64()), (Some(100), Some(10)));
    let (_, naive) = learn(&app, "naive-run", strategy, "naive", 1).await;
    eprintln!(
        "simulated LLM, K = 12, n = 100, {strategy}: combee (k = 10, p = 1) kept {} / 100, naive kept {} / 100",
        kept.len(),
        naive.len()
    );
    assert!(kept.len() >= 95, "combee kept only {}", kept.len());
    assert!(naive.len() <= 12, "naive kept {}", naive.len());

    // The round records its work: every trace consumed, every call with usage, a learned version.
    let round: Value =
        app.get(&format!("/v1/rounds/{}", combee["id"].as_str().unwrap())).send().await.unwrap().json().await.unwrap();
    assert_eq!(round["trace_ids"].as_array().unwrap().len(), 100);
    assert_eq!(round["reflections"].as_array().unwrap().len(), 100);
    assert!(round["usage"]["calls"].as_u64().unwrap() >= 110, "100 reflections + 10 groups");
    assert!(round["usage"]["prompt_tokens"].as_u64().unwrap() > 0);
    assert!(round["detail"]["phases"]["map"]["elapsed_ms"].is_number());
    let pending: Value =
        app.get("/v1/traces?prompt=combee-run&status=pending").send().await.unwrap().json().await.unwrap();
    assert!(pending["traces"].as_array().unwrap().is_empty());
    let version: Value = app.get("/v1/prompts/combee-run/versions/2").send().await.unwrap().json().await.unwrap();
    assert_eq!((version["source"].as_str(), version["round_id"].as_str()), (Some("learned"), combee["id"].as_str()));
    assert!(version["text"].as_str().unwrap().contains("{customer_name}"), "placeholders survive");
}

async fn playbook_combee_keeps_what_naive_loses(b: Backend) {
    combee_keeps_what_naive_loses(b, "playbook").await;
}

async fn rewrite_combee_keeps_what_naive_loses(b: Backend) {
    combee_keeps_what_naive_loses(b, "rewrite").await;
}

async fn a_full_backlog_starts_a_round_by_itself(b: Backend) {
    let sim = spawn_sim(sim()).await;
    let app = spawn_app_with(b, |s| learning(s, &sim.url)).await;
    create(&app, "auto", "playbook", json!({"batch_size": 8})).await;
    send_traces(&app, "auto", 8).await;
    let p = eventually("a round's publication", Duration::from_secs(30), async || {
        let p: Value = app.get("/v1/prompts/auto").send().await.unwrap().json().await.unwrap();
        if p["version"] == 2 { Ok(p) } else { Err(p.to_string()) }
    })
    .await;
    assert_eq!(insights(p["text"].as_str().unwrap()).len(), 8);
    let rounds: Value = app.get("/v1/prompts/auto/rounds").send().await.unwrap().json().await.unwrap();
    assert_eq!(rounds["rounds"][0]["trigger"], "backlog");
    // Manual promotion policy: learned versions wait as `candidate`.
    let res = app
        .post(
            "/v1/prompts",
            json!({"name": "careful", "base": "Base.", "promotion": "manual", "settings": {"batch_size": 4}}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 201);
    send_traces(&app, "careful", 4).await;
    let c: Value = eventually("a candidate's publication", Duration::from_secs(30), async || {
        let res = app.get("/v1/prompts/careful?label=candidate").send().await.unwrap();
        if res.status() == 200 { Ok(res.json().await.unwrap()) } else { Err(res.status().to_string()) }
    })
    .await;
    assert_eq!(c["version"], 2);
    let prod: Value = app.get("/v1/prompts/careful").send().await.unwrap().json().await.unwrap();
    assert_eq!(prod["version"], 1, "production stays until an operator promotes");
}

/// Changes wake the worker (a version made here is a store notification each
/// time), and a wake claims at once, but the scheduler, which reads every
/// prompt's backlog and controller, runs at most once per poll interval.
async fn wakes_do_not_schedule_more_often_than_the_poll_interval(b: Backend) {
    let sim = spawn_sim(sim()).await;
    let app = spawn_app_with(b, |s| {
        learning(s, &sim.url);
        s.worker.poll_interval_ms = 1000;
    })
    .await;
    create(&app, "wakes", "playbook", json!({})).await;
    let passes = || async {
        let text = app.get("/metrics").send().await.unwrap().text().await.unwrap();
        text.lines()
            .find_map(|l| l.strip_prefix("combee_worker_schedule_passes_total "))
            .map_or(0.0, |v| v.trim().parse::<f64>().unwrap())
    };
    let before = passes().await;
    let started = Instant::now();
    for i in 0..40 {
        let res = app
            .post("/v1/prompts/wakes/versions", json!({"base": format!("You are agent {i}."), "message": "wake"}))
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 201, "{}", res.text().await.unwrap());
    }
    let secs = started.elapsed().as_secs_f64();
    let during = passes().await - before;
    // One pass per started second of the loop, one for a pass under way at the start.
    let allowed = secs.ceil() + 1.0;
    assert!(during <= allowed, "{during} scheduler passes in {secs:.2} s of 40 wakes (at most {allowed})");
    // The timer still schedules: passes go on without wakes.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert!(passes().await - before > during, "no scheduler pass after the wakes stopped");
}

async fn rounds_survive_injected_faults(b: Backend) {
    let sim = spawn_sim(SimConfig { rate_5xx: 0.2, rate_429: 0.1, retry_after_ms: 20, ..sim() }).await;
    let app = spawn_app_with(b, |s| learning(s, &sim.url)).await;
    create(&app, "flaky", "playbook", json!({"duplication": 1})).await;
    send_traces(&app, "flaky", 30).await;
    let round = trigger(&app, "flaky", json!({})).await;
    let done = round_end(&app, round["id"].as_str().unwrap(), Duration::from_secs(60)).await;
    assert_eq!(done["status"], "succeeded", "{done}");
    let stats = sim.stats().await;
    let faults: u64 = stats["faults"].as_object().unwrap().values().map(|v| v.as_u64().unwrap()).sum();
    assert!(faults > 0, "faults were injected: {stats}");
    let prompt: Value = app.get("/v1/prompts/flaky").send().await.unwrap().json().await.unwrap();
    assert_eq!(insights(prompt["text"].as_str().unwrap()).len(), 30);
    let retries = done["usage"]["retries"].as_u64().unwrap();
    eprintln!("simulated LLM with 20% 5xx + 10% 429: {faults} faults injected, {retries} retries, round succeeded");
}

async fn a_dead_backend_fails_cleanly_and_loses_nothing(b: Backend) {
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/v1", closed.local_addr().unwrap());
    drop(closed);
    let app = spawn_app_with(b, |s| {
        learning(s, &url);
        s.llm.max_retries = 1;
        s.worker.max_round_attempts = 2;
        s.worker.max_trace_attempts = 2;
    })
    .await;
    create(&app, "down", "playbook", json!({})).await;
    send_traces(&app, "down", 5).await;
    for attempt in 1..=2 {
        let round = trigger(&app, "down", json!({})).await;
        let done = round_end(&app, round["id"].as_str().unwrap(), Duration::from_secs(30)).await;
        assert_eq!(done["status"], "failed");
        assert_eq!(done["attempt"], 2, "retried once before giving up");
        assert!(done["error"].as_str().unwrap().contains("LLM"), "{done}");
        let traces: Value =
            app.get("/v1/traces?prompt=down&status=pending").send().await.unwrap().json().await.unwrap();
        let traces = traces["traces"].as_array().unwrap();
        // A dead backend is nobody's fault: no trace pays an attempt for it.
        assert_eq!(traces.len(), 5, "all traces pending after failed round {attempt}");
        assert!(traces.iter().all(|t| t["attempts"] == 0), "{traces:?}");
    }
    let p: Value = app.get("/v1/prompts/down").send().await.unwrap().json().await.unwrap();
    assert_eq!(p["version"], 1, "no version from a failed round");
}

/// Traces by status for a prompt.
async fn traces_with(app: &TestApp, name: &str, status: &str) -> Vec<Value> {
    let v: Value =
        app.get(&format!("/v1/traces?prompt={name}&status={status}")).send().await.unwrap().json().await.unwrap();
    v["traces"].as_array().unwrap().clone()
}

/// A trace whose lesson is too long for a reflection (the reflector's key insight
/// would exceed the 4000-character cap): its reflection is rejected every time.
fn unreflectable_trace(prompt: &str) -> Value {
    let lessons: String = (0..220).map(|j| format!("INSIGHT-x{j:03}: lesson {j:03}\n")).collect();
    json!({"prompt": prompt, "input": {"task": "long"}, "output": "o",
           "feedback": {"success": false, "comment": lessons}, "external_id": "poison"})
}

/// A round whose traces teach nothing (no lesson in any feedback: the
/// simulator's reflections carry no insight and its aggregator adds no bullet)
/// succeeds without a version: the prompt stays where it was, its traces are
/// consumed, and the round says so in the API and the web UI.
async fn a_round_that_learns_nothing_publishes_no_version(b: Backend) {
    let sim = spawn_sim(sim()).await;
    let app = spawn_app_with(b, |s| learning(s, &sim.url)).await;
    create(&app, "quiet", "playbook", json!({})).await;
    let traces: Vec<Value> = (0..4)
        .map(|i| {
            json!({"prompt": "quiet", "input": {"task": format!("task {i}")}, "output": format!("answer {i}"),
                   "feedback": {"success": true, "comment": "fine"}})
        })
        .collect();
    assert_eq!(app.post("/v1/traces", json!({"traces": traces})).send().await.unwrap().status(), 201);

    let round = trigger(&app, "quiet", json!({})).await;
    let id = round["id"].as_str().unwrap();
    let done = round_end(&app, id, Duration::from_secs(60)).await;
    assert_eq!((done["status"].as_str(), &done["result_version"]), (Some("succeeded"), &Value::Null), "{done}");
    let prompt: Value = app.get("/v1/prompts/quiet").send().await.unwrap().json().await.unwrap();
    assert_eq!(prompt["version"], 1, "{prompt}");
    let versions: Value = app.get("/v1/prompts/quiet/versions").send().await.unwrap().json().await.unwrap();
    assert_eq!(versions["versions"].as_array().map(Vec::len), Some(1), "{versions}");
    assert_eq!(traces_with(&app, "quiet", "consumed").await.len(), 4);
    let page = round_page(&app, id.parse().unwrap()).await;
    assert!(page.contains("unchanged") && page.contains("left v1 as it was"), "{page}");
}

async fn an_unreflected_trace_is_not_consumed(b: Backend) {
    let sim = spawn_sim(sim()).await;
    let app = spawn_app_with(b, |s| {
        learning(s, &sim.url);
        s.worker.max_trace_attempts = 2;
    })
    .await;
    create(&app, "u", "playbook", json!({"duplication": 1})).await;
    send_traces(&app, "u", 5).await;
    let res = app.post("/v1/traces", unreflectable_trace("u")).send().await.unwrap();
    assert_eq!(res.status(), 201);

    let round = trigger(&app, "u", json!({})).await;
    let done = round_end(&app, round["id"].as_str().unwrap(), Duration::from_secs(60)).await;
    assert_eq!(done["status"], "succeeded", "{done}");
    assert_eq!(done["detail"]["outcome"]["unreflected"].as_array().unwrap().len(), 1, "{done}");
    assert_eq!(traces_with(&app, "u", "consumed").await.len(), 5);
    // Its lesson is not silently lost: the trace is pending again, charged one attempt, with the reason.
    let pending = traces_with(&app, "u", "pending").await;
    assert_eq!(pending.len(), 1);
    assert_eq!((pending[0]["external_id"].as_str(), pending[0]["attempts"].as_i64()), (Some("poison"), Some(1)));
    assert!(pending[0]["failure_reason"].as_str().unwrap().contains("reflection failed"), "{}", pending[0]);

    // The next round has nothing else to learn from; the trace's second own failure spends its budget.
    let round = trigger(&app, "u", json!({})).await;
    let done = round_end(&app, round["id"].as_str().unwrap(), Duration::from_secs(60)).await;
    assert_eq!(done["status"], "failed", "{done}");
    let failed = traces_with(&app, "u", "failed").await;
    assert_eq!((failed.len(), failed[0]["attempts"].as_i64()), (1, Some(2)), "{failed:?}");
    assert!(traces_with(&app, "u", "pending").await.is_empty());
}

/// An OpenAI-compatible endpoint in front of the simulator that answers every
/// playbook aggregator call with prose (no JSON), as a confused model would; every
/// other call goes to the simulator. Returns its base URL.
async fn aggregator_answers_prose(sim_url: String) -> String {
    aggregator_answers(sim_url, "I would rather not change the playbook today.").await
}

/// An OpenAI-compatible endpoint in front of the simulator that answers every
/// playbook aggregator call with `recorded`; every other call goes to the
/// simulator. Returns its base URL.
async fn aggregator_answers(sim_url: String, recorded: &'static str) -> String {
    async fn relay(
        axum::extract::State((sim_url, recorded)): axum::extract::State<(String, &'static str)>,
        body: axum::body::Bytes,
    ) -> axum::response::Response {
        use axum::response::IntoResponse;
        let aggregate = String::from_utf8_lossy(&body).contains("combee-task: aggregate-playbook");
        let mut answer = simulated_answer(&sim_url, &body).await;
        if aggregate {
            answer["choices"][0]["message"]["content"] = json!(recorded);
        }
        axum::Json(answer).into_response()
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/v1", listener.local_addr().unwrap());
    let router =
        axum::Router::new().route("/v1/chat/completions", axum::routing::post(relay)).with_state((sim_url, recorded));
    tokio::spawn(async move { axum::serve(listener, router).await });
    url
}

/// What SmolLM2-135M, set up as a new user would (only the base URL and model),
/// wrote as a round's playbook on llama.cpp's server: numbers, an ellipsis, an
/// echo of the playbook's own line format, a section name that is no word.
/// Recorded as the operations of an aggregator answer.
const WEAK_PLAYBOOK: &str = r#"{"operations": [
  {"op": "ADD", "section": "Section 1", "content": "1", "reason": "r", "sources": [1]},
  {"op": "ADD", "section": "Section 1", "content": "...", "reason": "r", "sources": [1]},
  {"op": "ADD", "section": "Section 2", "content": "3", "reason": "r", "sources": [1]},
  {"op": "ADD", "section": "Section 2", "content": "[b-0001] helpful=N harmful=M", "reason": "r", "sources": [1]},
  {"op": "ADD", "section": "bullet-tagminesfurther", "content": "This is a helpful tip that will help you improve your skills on this platform. Here's a short summary of what it means: I'm going to give you a gift today, ...", "reason": "r", "sources": [1]}
]}"#;

/// That playbook, as every aggregator's answer of a round on a prompt under
/// `auto`: nothing of it becomes a version; the round ends unchanged, its record
/// and its page in the web UI list each refused bullet with the rule and the
/// reason, and `/metrics` counts them.
async fn a_weak_models_protocol_echo_never_becomes_a_version(b: Backend) {
    let sim = spawn_sim(sim()).await;
    let llm = aggregator_answers(sim.url.clone(), WEAK_PLAYBOOK).await;
    let app = spawn_app_with(b, |s| learning(s, &llm)).await;
    create(&app, "weak", "playbook", json!({})).await;
    send_traces(&app, "weak", 6).await;
    let round = trigger(&app, "weak", json!({})).await;
    let id = round["id"].as_str().unwrap();
    let done = round_end(&app, id, Duration::from_secs(60)).await;
    assert_eq!((done["status"].as_str(), &done["result_version"]), (Some("succeeded"), &Value::Null), "{done}");
    let prompt: Value = app.get("/v1/prompts/weak").send().await.unwrap().json().await.unwrap();
    assert_eq!(prompt["version"], 1, "production still serves the base: {prompt}");
    assert!(!prompt["text"].as_str().unwrap().contains("PLAYBOOK"), "{prompt}");

    let refused = done["detail"]["outcome"]["refused"].as_array().expect("the refused changes").clone();
    let listed: Vec<(&str, &str, &str)> = refused
        .iter()
        .map(|r| {
            (r["op"]["section"].as_str().unwrap(), r["op"]["content"].as_str().unwrap(), r["rule"].as_str().unwrap())
        })
        .collect();
    assert_eq!(listed.len(), 5, "{refused:?}");
    assert!(listed.iter().all(|(_, _, rule)| *rule == "section_name"), "{listed:?}");
    for r in &refused {
        assert!(r["reason"].as_str().is_some_and(|why| why.contains("section")), "{r}");
        assert!(!r["groups"].as_array().unwrap().is_empty(), "{r}");
    }

    let page = round_page(&app, id.parse().unwrap()).await;
    assert!(page.contains("unchanged"), "{page}");
    assert!(page.contains("5 learned changes refused"), "{page}");
    for r in &refused {
        let content = r["op"]["content"].as_str().unwrap();
        let shown: String = content.chars().take(60).collect();
        let escaped = shown.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('\'', "&#39;");
        assert!(page.contains(&escaped), "{escaped} not on the page");
        let reason = r["reason"].as_str().unwrap().replace('"', "&quot;").replace('\'', "&#39;");
        assert!(page.contains(&reason), "{reason} not on the page");
    }
    let metrics = app.get("/metrics").send().await.unwrap().text().await.unwrap();
    assert!(
        metrics.lines().any(|l| l.starts_with("combee_learned_changes_refused_total{")
            && l.contains(r#"rule="section_name""#)
            && l.contains(r#"source="round""#)
            && l.ends_with(" 5")),
        "{metrics}"
    );
}

async fn a_group_failure_costs_no_trace_an_attempt_and_a_rerun_reuses_reflections(b: Backend) {
    let sim = spawn_sim(sim()).await;
    // Every group's answer stays invalid after the corrective retry: every group
    // degrades, nothing is learned, so the round fails.
    let llm = aggregator_answers_prose(sim.url.clone()).await;
    let app = spawn_app_with(b, |s| learning(s, &llm)).await;
    create(&app, "g", "playbook", json!({"duplication": 1})).await;
    send_traces(&app, "g", 9).await;

    let round = trigger(&app, "g", json!({})).await;
    let done = round_end(&app, round["id"].as_str().unwrap(), Duration::from_secs(60)).await;
    assert_eq!(done["status"], "failed", "{done}");
    assert!(done["error"].as_str().unwrap().contains("nothing learned: all"), "{done}");
    assert!(done["error"].as_str().unwrap().contains("invalid"), "{done}");
    let pending = traces_with(&app, "g", "pending").await;
    assert_eq!(pending.len(), 9, "every trace is back in the backlog");
    assert!(pending.iter().all(|t| t["attempts"] == 0), "nobody pays for the group's failure: {pending:?}");
    let reflected = sim.calls("reflect").await;
    assert_eq!(reflected, 9);

    // A re-run over the same base version pays no reflector call again.
    let rerun = trigger(&app, "g", json!({})).await;
    assert_ne!(rerun["id"], round["id"]);
    let done = round_end(&app, rerun["id"].as_str().unwrap(), Duration::from_secs(60)).await;
    assert_eq!(done["status"], "failed", "{done}");
    assert_eq!(sim.calls("reflect").await, reflected, "reflections reused, not paid twice");
    let detail: Value =
        app.get(&format!("/v1/rounds/{}", rerun["id"].as_str().unwrap())).send().await.unwrap().json().await.unwrap();
    assert_eq!(detail["reflections"].as_array().unwrap().len(), 9, "{detail}");
    assert!(traces_with(&app, "g", "pending").await.iter().all(|t| t["attempts"] == 0));
}

async fn round_triggers_are_validated(b: Backend) {
    let sim = spawn_sim(SimConfig { fixed_ms: 200.0, ..sim() }).await;
    let app = spawn_app_with(b, |s| learning(s, &sim.url)).await;
    create(&app, "t", "playbook", json!({})).await;
    let p = expect_problem(app.post("/v1/prompts/t/rounds", json!({})).send().await.unwrap(), 409).await;
    assert!(p["detail"].as_str().unwrap().contains("no pending traces"));
    send_traces(&app, "t", 3).await;
    let round = trigger(&app, "t", json!({"method": "sequential"})).await;
    assert_eq!(
        (round["method"].as_str(), round["trigger"].as_str(), round["n"].as_i64()),
        (Some("sequential"), Some("api"), Some(3))
    );
    let p = expect_problem(app.post("/v1/prompts/t/rounds", json!({})).send().await.unwrap(), 409).await;
    assert!(p["detail"].as_str().unwrap().contains("in flight"));
    expect_problem(app.post("/v1/prompts/t/rounds", json!({"method": "magic"})).send().await.unwrap(), 422).await;
    expect_problem(app.post("/v1/prompts/t/rounds", json!({"batch_size": 0})).send().await.unwrap(), 422).await;
    expect_problem(app.post("/v1/prompts/ghost/rounds", json!({})).send().await.unwrap(), 404).await;
    expect_problem(app.get("/v1/rounds/not-a-uuid").send().await.unwrap(), 404).await;
    expect_problem(app.get(&format!("/v1/rounds/{}", uuid::Uuid::now_v7())).send().await.unwrap(), 404).await;
    let reader = app.key_with(&["prompts:read"]).await;
    let res =
        app.http.post(app.url("/v1/prompts/t/rounds")).bearer_auth(&reader).json(&json!({})).send().await.unwrap();
    expect_problem(res, 403).await;
    let done = round_end(&app, round["id"].as_str().unwrap(), Duration::from_secs(30)).await;
    assert_eq!(done["status"], "succeeded");
}

/// Tolerant answers, end to end: with 10% of every realistic
/// answer shape at once (simulated), 20 rounds on the product defaults (Combee,
/// p = 2) fail none, lose at most 1% of reflections, and the round records
/// account for every shaped answer.
async fn realistic_answer_shapes_fail_no_round(b: Backend) {
    let shaped = SimConfig {
        rate_fence: 0.1,
        rate_preamble: 0.1,
        rate_extra_keys: 0.1,
        rate_think: 0.1,
        rate_unknown_ids: 0.1,
        ..sim()
    };
    let sim = spawn_sim(shaped).await;
    let app = spawn_app_with(b, |s| learning(s, &sim.url)).await;
    create(&app, "shaped", "playbook", json!({"duplication": 2})).await;
    let (rounds, per_round) = (20, 30);
    let (mut failed, mut lost, mut tolerated, mut unknown_keys, mut dropped) = (0, 0, 0, 0, 0);
    let (mut covered, mut reduced) = (0, 0);
    for r in 0..rounds {
        let traces: Vec<Value> = (0..per_round)
            .map(|i| {
                let mut t = insight_trace("shaped", i);
                t["feedback"]["comment"] = json!(format!("INSIGHT-r{r}i{i}: check field {i} of form {r}"));
                t
            })
            .collect();
        let res = app.post("/v1/traces", json!({"traces": traces})).send().await.unwrap();
        assert_eq!(res.status(), 201);
        let round = trigger(&app, "shaped", json!({"batch_size": per_round})).await;
        let done = round_end(&app, round["id"].as_str().unwrap(), Duration::from_secs(60)).await;
        if done["status"] != "succeeded" {
            failed += 1;
            eprintln!("round {r} failed: {}", done["error"]);
            continue;
        }
        let outcome = &done["detail"]["outcome"];
        let answers = &outcome["answers"];
        lost +=
            answers["reflections_lost"].as_array().unwrap().len() + outcome["unreflected"].as_array().unwrap().len();
        tolerated += answers["tolerated_answers"].as_u64().unwrap();
        unknown_keys += answers["unknown_keys"].as_u64().unwrap();
        dropped += answers["dropped_items"].as_u64().unwrap();
        // Every dropped item is listed with its reason in the record.
        let listed: usize =
            answers["calls"].as_array().unwrap().iter().map(|c| c["dropped"].as_array().map_or(0, Vec::len)).sum();
        assert_eq!(listed as u64, answers["dropped_items"].as_u64().unwrap(), "{answers}");
        covered += outcome["coverage"]["covered"].as_u64().unwrap();
        reduced += outcome["coverage"]["n"].as_u64().unwrap();
    }
    let stats = sim.stats().await;
    let shaped_answers = stats["shaped_answers"].as_u64().unwrap();
    let total = rounds * per_round;
    let prompt: Value = app.get("/v1/prompts/shaped").send().await.unwrap().json().await.unwrap();
    let kept = insights(prompt["text"].as_str().unwrap()).len();
    eprintln!(
        "simulated LLM, 10% of each answer shape (fence, preamble, extra keys, think, unknown ids), {rounds} rounds x \
         {per_round} traces, combee p = 2: failed rounds {failed}; reflections lost {lost} / {total} ({:.2}%); \
         shaped answers {shaped_answers} (shapes {}), tolerated answers recorded {tolerated}, unknown keys ignored \
         {unknown_keys}, items dropped {dropped}; provenance covered {covered} / {reduced} ({:.1}%); insights in the \
         prompt {kept} / {total}",
        100.0 * lost as f64 / total as f64,
        stats["shapes"],
        100.0 * covered as f64 / reduced.max(1) as f64,
    );
    assert_eq!(failed, 0);
    assert!(lost * 100 <= total, "lost {lost} of {total} reflections");
    assert!(shaped_answers > 0 && dropped > 0 && unknown_keys > 0);
    assert_eq!(tolerated, shaped_answers, "every shaped answer is accounted for in a round record");
    let unknown_ids = stats["shapes"]["unknown_ids"].as_u64().unwrap();
    assert!(dropped >= unknown_ids, "each unknown id shape drops at least one item: {dropped} < {unknown_ids}");
}

on_one_store!(realistic_answer_shapes_fail_no_round_on_sqlite: realistic_answer_shapes_fail_no_round(Sqlite));
on_both_stores!(
    playbook_combee_keeps_what_naive_loses,
    rewrite_combee_keeps_what_naive_loses,
    a_full_backlog_starts_a_round_by_itself,
    wakes_do_not_schedule_more_often_than_the_poll_interval,
    rounds_survive_injected_faults,
    a_dead_backend_fails_cleanly_and_loses_nothing,
    an_unreflected_trace_is_not_consumed,
    a_round_that_learns_nothing_publishes_no_version,
    a_weak_models_protocol_echo_never_becomes_a_version,
    a_group_failure_costs_no_trace_an_attempt_and_a_rerun_reuses_reflections,
    round_triggers_are_validated,
);

mod webhooks {
    use super::*;
    use base64::{Engine, engine::general_purpose::STANDARD};
    use hmac::{Hmac, Mac};

    const KEY: &[u8] = b"a test secret of thirty-two bytes";

    /// Signs as the Standard Webhooks spec says, without combee's own code.
    fn signed(app: &TestApp, id: &str, ts: i64, body: &str, key: &[u8]) -> reqwest::RequestBuilder {
        signed_to(app, "hooked", id, ts, body, key)
    }

    fn signed_to(app: &TestApp, prompt: &str, id: &str, ts: i64, body: &str, key: &[u8]) -> reqwest::RequestBuilder {
        let mut mac = Hmac::<sha2::Sha256>::new_from_slice(key).unwrap();
        mac.update(format!("{id}.{ts}.{body}").as_bytes());
        let sig = STANDARD.encode(mac.finalize().into_bytes());
        app.http
            .post(app.url(&format!("/v1/hooks/rounds/{prompt}")))
            .header("webhook-id", id)
            .header("webhook-timestamp", ts.to_string())
            .header("webhook-signature", format!("v1,{sig}"))
            .header("content-type", "application/json")
            .body(body.to_owned())
    }

    async fn inbound_webhooks_are_verified_and_deduplicated(b: Backend) {
        let sim = spawn_sim(sim()).await;
        let app = spawn_app_with(b, |s| {
            learning(s, &sim.url);
            s.webhooks.inbound_secrets = vec![combee::secret::Secret::new(format!("whsec_{}", STANDARD.encode(KEY)))];
        })
        .await;
        create(&app, "hooked", "playbook", json!({})).await;
        send_traces(&app, "hooked", 4).await;
        let now = chrono::Utc::now().timestamp();
        let rounds = || async {
            let r: Value = app.get("/v1/prompts/hooked/rounds").send().await.unwrap().json().await.unwrap();
            r["rounds"].as_array().unwrap().len()
        };

        expect_problem(signed(&app, "msg_1", now, "{}", b"wrong key").send().await.unwrap(), 401).await;
        expect_problem(signed(&app, "msg_1", now - 600, "{}", KEY).send().await.unwrap(), 401).await;
        let unsigned = app.http.post(app.url("/v1/hooks/rounds/hooked")).body("{}").send().await.unwrap();
        expect_problem(unsigned, 401).await;
        assert_eq!(rounds().await, 0, "nothing started");

        let res = signed(&app, "msg_1", now, r#"{"method": "combee"}"#, KEY).send().await.unwrap();
        assert_eq!(res.status(), 202);
        let body: Value = res.json().await.unwrap();
        assert_eq!((body["status"].as_str(), body["round"]["trigger"].as_str()), (Some("queued"), Some("webhook")));
        round_end(&app, body["round"]["id"].as_str().unwrap(), Duration::from_secs(30)).await;

        send_traces(&app, "hooked", 2).await;
        let res = signed(&app, "msg_1", now + 1, r#"{"method": "combee"}"#, KEY).send().await.unwrap();
        assert_eq!(res.status(), 200);
        assert_eq!(res.json::<Value>().await.unwrap()["status"], "duplicate");
        assert_eq!(rounds().await, 1, "a replayed webhook-id starts nothing");
        expect_problem(signed(&app, "msg_2", now, "{not json", KEY).send().await.unwrap(), 400).await;
    }

    async fn inbound_webhooks_are_off_without_secrets(b: Backend) {
        let app = common::spawn_app(b).await;
        create(&app, "hooked", "playbook", json!({})).await;
        let now = chrono::Utc::now().timestamp();
        expect_problem(signed(&app, "m", now, "{}", KEY).send().await.unwrap(), 404).await;
    }

    /// Standard Webhooks senders retry what was not answered 2xx: a refused
    /// trigger must not be remembered as seen.
    async fn a_refused_trigger_is_processed_again_when_retried(b: Backend) {
        // No worker: a queued round stays in flight.
        let app = spawn_app_with(b, |s| {
            s.webhooks.inbound_secrets = vec![combee::secret::Secret::new(format!("whsec_{}", STANDARD.encode(KEY)))];
        })
        .await;
        let now = chrono::Utc::now().timestamp();
        let send = |prompt: &'static str, id: &'static str| signed_to(&app, prompt, id, now, "{}", KEY).send();

        // 404: no such prompt. Once the prompt exists, the retry opens a round.
        expect_problem(send("later", "msg_404").await.unwrap(), 404).await;
        expect_problem(send("later", "msg_404").await.unwrap(), 404).await;
        create(&app, "later", "playbook", json!({})).await;
        send_traces(&app, "later", 2).await;
        let res = send("later", "msg_404").await.unwrap();
        assert_eq!(res.status(), 202, "the retry of a 404 is processed");
        assert_eq!(res.json::<Value>().await.unwrap()["status"], "queued");
        let res = send("later", "msg_404").await.unwrap();
        assert_eq!(
            (res.status().as_u16(), res.json::<Value>().await.unwrap()["status"].clone()),
            (200, json!("duplicate"))
        );

        // 409: nothing pending yet, then a round in flight; each retry is judged anew.
        create(&app, "hooked", "playbook", json!({})).await;
        expect_problem(send("hooked", "msg_409").await.unwrap(), 409).await;
        send_traces(&app, "hooked", 2).await;
        let first: Value = send("hooked", "msg_409").await.unwrap().json().await.unwrap();
        assert_eq!(first["status"], "queued", "the retry of a 409 opens the round: {first}");
        send_traces(&app, "hooked", 2).await;
        let busy = expect_problem(send("hooked", "msg_busy").await.unwrap(), 409).await;
        assert!(busy["detail"].as_str().unwrap().contains("in flight"), "{busy}");
        let dup = send("hooked", "msg_409").await.unwrap();
        assert_eq!(dup.status(), 200, "a repeat of the id that opened the round is a duplicate, not a 409");
        let rounds: Value = app.get("/v1/prompts/hooked/rounds").send().await.unwrap().json().await.unwrap();
        assert_eq!(rounds["rounds"].as_array().unwrap().len(), 1);
        // msg_busy was refused, so it is not remembered: its retry is judged anew, never "duplicate".
        expect_problem(send("hooked", "msg_busy").await.unwrap(), 409).await;
    }

    on_both_stores!(
        inbound_webhooks_are_verified_and_deduplicated,
        inbound_webhooks_are_off_without_secrets,
        a_refused_trigger_is_processed_again_when_retried
    );
}

mod controller {
    use super::*;
    use combee::learn::capacity::batch_size::ControllerConfig;

    /// Polls until the prompt's rounds have consumed `n` traces, all succeeded; oldest first.
    async fn rounds_until_consumed(app: &TestApp, name: &str, n: u64) -> Vec<Value> {
        eventually("learning the backlog", Duration::from_secs(120), async || {
            let list: Value = app
                .get(&format!("/v1/prompts/{name}/rounds?page_size=100"))
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            let rounds = list["rounds"].as_array().unwrap();
            let done: Vec<&Value> = rounds.iter().filter(|r| r["status"] == "succeeded").collect();
            assert!(rounds.iter().all(|r| r["status"] != "failed"), "{list}");
            if done.len() == rounds.len() && done.iter().map(|r| r["n"].as_u64().unwrap()).sum::<u64>() == n {
                let mut full = Vec::new();
                for r in done.iter().rev() {
                    let url = format!("/v1/rounds/{}", r["id"].as_str().unwrap());
                    full.push(app.get(&url).send().await.unwrap().json::<Value>().await.unwrap());
                }
                full.sort_by_key(|r| r["created_at"].as_str().unwrap().to_owned());
                return Ok(full);
            }
            let sizes: Vec<(&Value, &Value)> = rounds.iter().map(|r| (&r["n"], &r["status"])).collect();
            Err(format!("rounds (n, status): {sizes:?}"))
        })
        .await
    }

    /// The controller on product defaults (max_batch lowered to keep the test
    /// small): no round is held back to measure — the first takes the backlog
    /// up to max_batch in groups of 4 and measures overload with its own copies;
    /// the meter then vouches for groups of 4 and probes groups of 8.
    async fn the_first_round_takes_the_backlog_and_measures_itself(b: Backend) {
        let sim = spawn_sim(SimConfig { fixed_ms: 5.0, ..sim() }).await;
        let cfg = ControllerConfig { max_batch: 64, ..ControllerConfig::default() };
        let app = spawn_app_with(b, |s| {
            learning(s, &sim.url);
            s.controller = cfg.clone();
            // A remainder below min_batch is learned from once it has waited a second.
            s.worker.max_wait_secs = 1;
        })
        .await;
        // Every lesson's retention is measured: no playbook budget (the default keeps 100 bullets).
        create(
            &app,
            "auto",
            "playbook",
            json!({"batch_size": "auto", "duplication": 2, "max_bullets": 100_000, "max_chars": 10_000_000}),
        )
        .await;
        send_traces_at_once(&app, "auto", 0, 150).await;
        let rounds = rounds_until_consumed(&app, "auto", 150).await;
        let sizes: Vec<u64> = rounds.iter().map(|r| r["n"].as_u64().unwrap()).collect();
        let grouping = |r: &Value| r["detail"]["outcome"]["grouping"].clone();

        // First round: nothing measured, yet it takes max_batch (not 20) in groups of 4.
        assert_eq!(sizes[0], 64, "{sizes:?}");
        let first = grouping(&rounds[0]);
        assert_eq!(first["group_size"]["source"], "start", "{first}");
        assert!(first["largest_group"].as_u64().unwrap() <= 4, "{first}");
        let reading = &rounds[0]["detail"]["outcome"]["meter"];
        assert_eq!(reading["missing_sources"], 0, "{reading}");
        // Then (hard capacity: groups of 12 keep everything) the meter vouches for
        // groups of 4 (the bucket 4–7) and probes 8 with one copy of each reflection.
        let second = grouping(&rounds[1]);
        assert_eq!(second["group_size"]["source"], "meter", "{second}");
        assert_eq!(
            (second["group_size"]["max_group"].as_u64(), second["group_size"]["probe_group"].as_u64()),
            (Some(4), Some(8)),
            "{second}"
        );
        assert!(sizes.iter().all(|&n| n <= 64), "{sizes:?}");

        let view: Value = app.get("/v1/prompts/auto/controller").send().await.unwrap().json().await.unwrap();
        assert_eq!(view["choice"]["quality"]["state"], "meter", "{view}");
        assert_eq!(view["meter"]["group_size"]["source"]["source"], "meter", "{view}");
        assert_eq!(view["meter"]["target_retention"], 0.9);
        assert_eq!(view["choice"]["cap"], 64, "quality never holds the batch: {view}");
        let prompt: Value = app.get("/v1/prompts/auto").send().await.unwrap().json().await.unwrap();
        let kept = insights(prompt["text"].as_str().unwrap()).len();
        assert!(kept >= 147, "retention {kept}/150");
        let metrics = app.http.get(app.url("/metrics")).send().await.unwrap().text().await.unwrap();
        assert!(metrics.contains("combee_controller_batch_size{prompt=\"auto\",project=\"default\"}"), "{metrics}");
        // The LLM client's view of the backend: the simulator takes OpenAI's schema shape,
        // and the adaptive limit is shown (how far it grows depends on this machine's load).
        assert!(metrics.contains("combee_llm_output_format{format=\"json_schema\"} 1"), "{metrics}");
        let limit = metrics
            .lines()
            .find_map(|l| l.strip_prefix("combee_llm_concurrency_limit "))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .unwrap_or_default();
        assert!((1.0..=64.0).contains(&limit), "{metrics}");
    }

    /// A model that never cites its sources (many small and local models ignore
    /// the instruction): the meter reads its answers by text instead, so the
    /// controller is not stuck — batches grow past the old measuring size of 20
    /// and the group size comes from the meter, as with a citing model.
    async fn a_no_sources_run_grows_its_batches_past_the_measuring_size(b: Backend) {
        let sim = spawn_sim(SimConfig { fixed_ms: 5.0, rate_no_sources: 1.0, ..sim() }).await;
        let cfg = ControllerConfig { max_batch: 100, ..ControllerConfig::default() };
        let app = spawn_app_with(b, |s| {
            learning(s, &sim.url);
            s.controller = cfg.clone();
            s.worker.max_wait_secs = 1;
        })
        .await;
        // Every lesson's retention is measured: no playbook budget (the default keeps 100 bullets).
        create(
            &app,
            "mute",
            "playbook",
            json!({"batch_size": "auto", "duplication": 2, "max_bullets": 100_000, "max_chars": 10_000_000}),
        )
        .await;
        send_traces_at_once(&app, "mute", 0, 100).await;
        let first = rounds_until_consumed(&app, "mute", 100).await;
        send_traces_at_once(&app, "mute", 100, 200).await;
        let rounds = rounds_until_consumed(&app, "mute", 200).await;
        let sizes: Vec<u64> = rounds.iter().map(|r| r["n"].as_u64().unwrap()).collect();
        assert!(sizes.iter().all(|&n| n > 20) && sizes[0] == 100, "{sizes:?}");
        let reading = &first[0]["detail"]["outcome"]["meter"];
        assert_eq!(reading["by_sources"], 0, "no answer cites: {reading}");
        assert!(reading["missing_sources"].as_u64().unwrap() > 0, "{reading}");
        let later = &rounds.last().unwrap()["detail"]["outcome"]["grouping"]["group_size"];
        assert_eq!(later["source"], "meter", "the meter measured without citations: {later}");
        let view: Value = app.get("/v1/prompts/mute/controller").send().await.unwrap().json().await.unwrap();
        let measured: u64 =
            view["meter"]["buckets"].as_array().unwrap().iter().map(|b| b["samples"].as_u64().unwrap()).sum();
        assert!(measured >= 100, "{view}");
        let prompt: Value = app.get("/v1/prompts/mute").send().await.unwrap().json().await.unwrap();
        let kept = insights(prompt["text"].as_str().unwrap()).len();
        assert!(kept >= 196, "retention {kept}/200");
    }

    /// A model that answers level 2 in a shape combee cannot read (here the
    /// older operations shape for a consolidation, every time, the corrective
    /// retry included): the round does not fail — it publishes the deterministic
    /// union and says so in its record, on its page and in /metrics.
    async fn a_round_whose_level_2_answer_is_garbage_publishes_the_union(b: Backend) {
        let sim = spawn_sim(SimConfig { fixed_ms: 5.0, rate_unreadable_level2: 1.0, ..sim() }).await;
        let app = spawn_app_with(b, |s| learning(s, &sim.url)).await;
        create(&app, "garbled", "playbook", json!({"duplication": 2, "reduce": "llm"})).await;
        create(&app, "plain", "playbook", json!({"duplication": 2, "reduce": "union"})).await;
        send_traces(&app, "garbled", 60).await;
        send_traces(&app, "plain", 60).await;
        let mut kept = Vec::new();
        for name in ["garbled", "plain"] {
            let round = trigger(&app, name, json!({"method": "combee", "batch_size": 60})).await;
            let done = round_end(&app, round["id"].as_str().unwrap(), Duration::from_secs(60)).await;
            assert_eq!(done["status"], "succeeded", "{done}");
            let level2 = &done["detail"]["outcome"]["level2"];
            if name == "garbled" {
                assert!(sim.calls("consolidate-playbook").await >= 2, "the call and its corrective retry were made");
                assert!(!level2["degraded"].as_array().unwrap().is_empty(), "{level2}");
            } else {
                assert!(level2["degraded"].is_null(), "{level2}");
            }
            let prompt: Value = app.get(&format!("/v1/prompts/{name}")).send().await.unwrap().json().await.unwrap();
            kept.push(insights(prompt["text"].as_str().unwrap()));
        }
        assert_eq!(kept[0], kept[1], "the degraded round published exactly what the union publishes");
        assert!(kept[0].len() >= 57, "{}", kept[0].len());
        let metrics = app.http.get(app.url("/metrics")).send().await.unwrap().text().await.unwrap();
        assert!(metrics.contains("combee_level2_degraded_total 1"), "{metrics}");
    }

    /// A model that answers some level-1 aggregations in prose (the simulator's
    /// `rate_unreadable_level1`, drawn per request so the corrective retry fails
    /// the same way): those groups degrade — on record with why and what the model
    /// wrote, on the round page and in /metrics — and the round publishes what the
    /// other groups learned. When every group degrades, the round learned nothing:
    /// it fails with that reason and publishes no version.
    async fn level_1_answers_that_stay_garbage_degrade_their_groups(b: Backend) {
        let partly = spawn_sim(SimConfig { fixed_ms: 5.0, rate_unreadable_level1: 0.5, ..sim() }).await;
        let app = spawn_app_with(b, |s| learning(s, &partly.url)).await;
        create(&app, "partly", "playbook", json!({"duplication": 2})).await;
        send_traces(&app, "partly", 40).await;
        let round = trigger(&app, "partly", json!({"method": "combee", "batch_size": 40})).await;
        let id = round["id"].as_str().unwrap();
        let done = round_end(&app, id, Duration::from_secs(60)).await;
        assert_eq!(done["status"], "succeeded", "{done}");
        let outcome = &done["detail"]["outcome"];
        let k = outcome["k"].as_u64().unwrap() as usize;
        let degraded = outcome["answers"]["groups_degraded"].as_array().unwrap();
        assert!(!degraded.is_empty() && degraded.len() < k, "{} of {k}: {outcome}", degraded.len());
        for g in degraded {
            assert!(g["error"].as_str().unwrap().contains("invalid after 2 attempts"), "{g}");
            assert!(g["refused_answer"].as_str().unwrap().contains("point in many directions"), "{g}");
            assert!(!g["traces"].as_array().unwrap().is_empty(), "{g}");
        }
        assert_eq!(done["detail"]["group_outputs"].as_array().unwrap().len(), k - degraded.len());
        let prompt: Value = app.get("/v1/prompts/partly").send().await.unwrap().json().await.unwrap();
        assert_eq!(prompt["version"], 2, "{prompt}");
        let learned = insights(prompt["text"].as_str().unwrap());
        let lost = outcome["answers"]["reflections_lost"].as_array().unwrap().len();
        assert_eq!(learned.len(), 40 - lost, "every reflection that reached a group that answered was learned");
        assert!(!learned.is_empty());
        let page = round_page(&app, id.parse().unwrap()).await;
        assert!(page.contains(&format!("{} groups degraded", degraded.len())), "{page}");
        assert!(page.contains("degraded: contributed nothing"), "{page}");
        assert!(page.contains("point in many directions"), "the refused text: {page}");
        let metrics = app.http.get(app.url("/metrics")).send().await.unwrap().text().await.unwrap();
        let counted = format!("combee_level1_groups_degraded_total {}", degraded.len());
        assert!(metrics.contains(&counted), "{metrics}");

        // Every group degrades: nothing learned, the round fails and publishes nothing.
        let hopeless = spawn_sim(SimConfig { fixed_ms: 5.0, rate_unreadable_level1: 1.0, ..sim() }).await;
        let app = spawn_app_with(b, |s| learning(s, &hopeless.url)).await;
        create(&app, "hopeless", "playbook", json!({"duplication": 2})).await;
        send_traces(&app, "hopeless", 12).await;
        let round = trigger(&app, "hopeless", json!({"method": "combee", "batch_size": 12})).await;
        let done = round_end(&app, round["id"].as_str().unwrap(), Duration::from_secs(60)).await;
        assert_eq!(done["status"], "failed", "{done}");
        let error = done["error"].as_str().unwrap();
        assert!(error.contains("nothing learned: all") && error.contains("groups degraded"), "{error}");
        assert!(done["result_version"].is_null(), "{done}");
        let prompt: Value = app.get("/v1/prompts/hopeless").send().await.unwrap().json().await.unwrap();
        assert_eq!(prompt["version"], 1, "no version published: {prompt}");
        let pending = traces_with(&app, "hopeless", "pending").await;
        assert_eq!(pending.len(), 12, "every trace is back in the backlog");
        assert!(hopeless.calls("aggregate-playbook").await >= 2);
    }

    /// A round whose level 2 is an LLM call and has more group outputs than a
    /// group may hold runs a scan tree: here 48 groups, fan-in 4 → 12 → 3 → 1.
    async fn a_consolidating_round_with_many_small_groups_runs_a_three_level_tree(b: Backend) {
        let sim = spawn_sim(SimConfig { fixed_ms: 5.0, ..sim() }).await;
        let app = spawn_app_with(b, |s| learning(s, &sim.url)).await;
        // Every lesson's retention is measured: no playbook budget (the default keeps 100 bullets).
        create(
            &app,
            "tree",
            "playbook",
            json!({"duplication": 2, "reduce": "llm", "max_bullets": 100_000, "max_chars": 10_000_000}),
        )
        .await;
        let app = &app;
        let post = |from: usize, to: usize| {
            let traces: Vec<Value> = (from..to).map(|i| insight_trace("tree", i)).collect();
            async move {
                for chunk in traces.chunks(50) {
                    let res = app.post("/v1/traces", json!({"traces": chunk})).send().await.unwrap();
                    assert_eq!(res.status(), 201);
                }
            }
        };
        // Round 1 (groups of 4 to start) teaches the meter; round 2 uses it: 32
        // groups of 4 and, probing, 16 of 8 — 48 outputs, merged at fan-in 4.
        post(0, 20).await;
        let r1 = trigger(app, "tree", json!({"method": "combee", "batch_size": 20})).await;
        assert_eq!(round_end(app, r1["id"].as_str().unwrap(), Duration::from_secs(60)).await["status"], "succeeded");
        post(20, 148).await;
        let r2 = trigger(app, "tree", json!({"method": "combee", "batch_size": 128})).await;
        let done = round_end(app, r2["id"].as_str().unwrap(), Duration::from_secs(60)).await;
        assert_eq!(done["status"], "succeeded", "{done}");
        let outcome = &done["detail"]["outcome"];
        let g = &outcome["grouping"];
        assert_eq!(g["group_size"]["source"], "meter", "{g}");
        assert_eq!(g["group_size"]["probe_group"], 8, "{g}");
        assert_eq!((g["fan_in"].as_u64(), g["largest_group"].as_u64()), (Some(4), Some(8)), "{g}");
        assert_eq!(g["levels"], json!([48, 12, 3, 1]), "{g}");
        assert!(outcome["level2"]["consolidation_calls"].as_u64().unwrap() >= 5, "{outcome}");
        let prompt: Value = app.get("/v1/prompts/tree").send().await.unwrap().json().await.unwrap();
        let kept = insights(prompt["text"].as_str().unwrap()).len();
        eprintln!("three-level tree (hard capacity K = 12): {kept}/148 insights kept");
        assert!(kept >= 140, "retention {kept}/148");
    }

    async fn controller_view_for_a_fixed_prompt(b: Backend) {
        let app = common::spawn_app(b).await;
        create(&app, "fixed", "playbook", json!({"batch_size": 50})).await;
        let v: Value = app.get("/v1/prompts/fixed/controller").send().await.unwrap().json().await.unwrap();
        assert_eq!((v["mode"].as_str(), v["fixed_batch_size"].as_u64()), (Some("fixed"), Some(50)));
        assert!(v["samples"].as_array().unwrap().is_empty());
        assert!(v["curve"].as_array().unwrap().is_empty() && v["choice"]["fit"].is_null(), "{v}");
        expect_problem(app.get("/v1/prompts/ghost/controller").send().await.unwrap(), 404).await;
        let bad = app
            .post("/v1/prompts", json!({"name": "x", "base": "b", "settings": {"batch_size": "huge"}}))
            .send()
            .await
            .unwrap();
        expect_problem(bad, 422).await;
    }

    on_one_store!(a_no_sources_run_grows_its_batches_past_the_measuring_size_on_sqlite: a_no_sources_run_grows_its_batches_past_the_measuring_size(Sqlite));
    on_one_store!(a_round_whose_level_2_answer_is_garbage_publishes_the_union_on_postgres: a_round_whose_level_2_answer_is_garbage_publishes_the_union(Postgres));
    on_both_stores!(
        the_first_round_takes_the_backlog_and_measures_itself,
        level_1_answers_that_stay_garbage_degrade_their_groups,
        a_consolidating_round_with_many_small_groups_runs_a_three_level_tree,
        controller_view_for_a_fixed_prompt
    );
}

/// The overload meter against the simulator's soft capacity model: the product
/// estimates retention from the groups' cited sources alone; the test measures
/// the truth with the simulator's markers (which the product never reads).
mod meter {
    use std::collections::{BTreeMap, HashMap};

    use super::*;
    use combee::learn::capacity::meter::bucket_of;

    /// Sends `rounds` batches of `batch` traces with fresh insights and runs a Combee round on each.
    async fn run_rounds(app: &TestApp, name: &str, batch: usize, rounds: usize) -> Vec<Value> {
        create(app, name, "playbook", json!({"duplication": 2})).await;
        let mut done = Vec::new();
        for r in 0..rounds {
            let traces: Vec<Value> = (r * batch..(r + 1) * batch).map(|i| insight_trace(name, i)).collect();
            for chunk in traces.chunks(50) {
                let res = app.post("/v1/traces", json!({"traces": chunk})).send().await.unwrap();
                assert_eq!(res.status(), 201);
            }
            let round = trigger(app, name, json!({"method": "combee", "batch_size": batch})).await;
            let id = round["id"].as_str().unwrap().to_owned();
            let end = round_end(app, &id, Duration::from_secs(120)).await;
            assert_eq!(end["status"], "succeeded", "{end}");
            done.push(app.get(&format!("/v1/rounds/{id}")).send().await.unwrap().json().await.unwrap());
        }
        done
    }

    /// True retention per size bucket, from markers: insights a group's answer
    /// carries over insights its reflections held, summed over groups.
    fn true_retention(rounds: &[Value]) -> BTreeMap<u32, (usize, usize)> {
        let mut by_bucket: BTreeMap<u32, (usize, usize)> = BTreeMap::new();
        for round in rounds {
            let markers: HashMap<String, BTreeSet<String>> = round["reflections"]
                .as_array()
                .unwrap()
                .iter()
                .map(|r| (r["trace_id"].as_str().unwrap().to_owned(), insights(&r["reflection"].to_string())))
                .collect();
            for g in round["detail"]["group_outputs"].as_array().unwrap() {
                let traces = g["traces"].as_array().unwrap();
                let given: BTreeSet<String> =
                    traces.iter().flat_map(|t| markers[t.as_str().unwrap()].iter().cloned()).collect();
                let kept = insights(&g["output"].to_string());
                let e = by_bucket.entry(bucket_of(traces.len())).or_default();
                e.0 += given.intersection(&kept).count();
                e.1 += given.len();
            }
        }
        by_bucket
    }

    async fn the_meter_estimates_retention_within_ten_points(b: Backend) {
        let sim = spawn_sim(SimConfig { seed: 11, capacity_model: CapacityModel::Soft, capacity_k: 12, ..sim() }).await;
        let app = spawn_app_with(b, |s| learning(s, &sim.url)).await;
        // Each prompt's first round uses groups of 4 (bucket 4–7); the meter then moves the group
        // size to what keeps 90 % (smaller under this soft model) and probes the next size up, so
        // later rounds fill other buckets. Every well-sampled bucket is checked.
        for (name, batch, rounds) in [("meter-small", 36, 10), ("meter-large", 100, 5)] {
            let done = run_rounds(&app, name, batch, rounds).await;
            let truth = true_retention(&done);
            let view: Value =
                app.get(&format!("/v1/prompts/{name}/controller")).send().await.unwrap().json().await.unwrap();
            let mut checked = 0;
            for row in view["meter"]["buckets"].as_array().unwrap() {
                let (Some(estimate), Some(samples)) = (row["retention"].as_f64(), row["samples"].as_u64()) else {
                    continue;
                };
                let bucket = row["size_min"].as_u64().unwrap() as u32;
                let (kept, given) = truth[&bucket];
                let true_r = kept as f64 / given as f64;
                eprintln!(
                    "overload meter, soft capacity K = 12, groups of {}-{} ({name}, rounds of {batch}): \
                     estimate {:.1}% from {samples} samples, true retention (markers) {:.1}% ({kept}/{given})",
                    row["size_min"],
                    row["size_max"],
                    estimate * 100.0,
                    true_r * 100.0
                );
                if samples >= 150 {
                    assert!(
                        (estimate - true_r).abs() <= 0.10,
                        "bucket {bucket}: estimate {estimate:.3} vs {true_r:.3}"
                    );
                    checked += 1;
                }
            }
            assert!(checked >= 1, "no bucket with 150 samples: {view}");
        }
        // The UI shows the meter on the controller page.
        let signed_in = crate::ui_browser::sign_in(&app, &app.key_with(&["prompts:read"]).await).await;
        let session = crate::ui_browser::set_cookie(&signed_in, "combee_session").expect("a session");
        let page = crate::ui_browser::plain_client()
            .get(app.url("/ui/prompts/meter-large/controller"))
            .header("cookie", format!("combee_session={session}"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        assert!(page.contains(r#"id="meter""#) && page.contains("4–7"), "{page}");
    }

    on_one_store!(the_meter_estimates_retention_within_ten_points_on_postgres: the_meter_estimates_retention_within_ten_points(Postgres));
}

/// Resuming from the store-backed journal: a round whose backend went down after
/// some level-1 groups answered is claimed again (attempt + 1) and pays only
/// for the missing groups.
mod resume {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use async_trait::async_trait;
    use combee::{
        domain::{
            Promotion, PromptName, PromptSettings, ReduceMode, RoundDetail, Strategy, VersionContent, VersionSource,
            prompt::{NewPrompt, NewVersion},
            round::{Method, RoundTrigger},
            trace::{NewTrace, TraceLimits},
        },
        learn::{
            merge::budget::Budget,
            round::{RoundSpec, run_round},
        },
        llm::{ChatRequest, ChatResponse, LlmBackend, LlmError, client::OpenAiClient, config::LlmConfig},
        store::{DynStore, OpenRound, RoundFailure},
        worker::StoreJournal,
    };

    use super::*;

    /// Answers the first `ok` requests through the simulator, then is down for good.
    struct DownAfter {
        inner: OpenAiClient,
        ok: usize,
        seen: AtomicUsize,
    }

    #[async_trait]
    impl LlmBackend for DownAfter {
        async fn chat(&self, req: ChatRequest) -> Result<ChatResponse, LlmError> {
            if self.seen.fetch_add(1, Ordering::SeqCst) < self.ok {
                self.inner.chat(req).await
            } else {
                Err(LlmError::Server { status: 503, message: "down".into() })
            }
        }
    }

    async fn claim(s: &DynStore) -> combee::store::ClaimedRound {
        eventually("a claimable round", Duration::from_secs(5), async || {
            s.claim_round("resume-test", Duration::from_secs(60)).await.unwrap().ok_or_else(|| "none yet".into())
        })
        .await
    }

    fn spec_of(c: &combee::store::ClaimedRound) -> RoundSpec {
        RoundSpec {
            round_id: c.round.id,
            seed: c.round.seed as u64,
            method: c.round.method,
            strategy: c.round.strategy,
            duplication: c.round.duplication.max(1) as u32,
            reduce: ReduceMode::Union,
            budget: Budget::default(),
            agent_reflections: c.prompt.settings.agent_reflections,
            denylist: Default::default(),
            group_size: Default::default(),
        }
    }

    async fn a_resumed_round_calls_only_the_missing_groups(b: Backend) {
        const N: usize = 25; // k = 5 groups
        const ANSWERED: usize = 2;
        let sim = spawn_sim(sim()).await;
        let ts = common::test_store(b).await;
        let s = ts.store.clone();
        let name = PromptName::written("resumed", "default").unwrap();
        let settings = PromptSettings { duplication: 2, ..PromptSettings::default() };
        let prompt = NewPrompt {
            name: name.clone(),
            strategy: Strategy::Playbook,
            promotion: Promotion::Auto,
            settings,
            created_by: "test".into(),
        };
        let v1 = NewVersion {
            parent: None,
            source: VersionSource::Manual,
            round_id: None,
            content: VersionContent { base: "You answer support questions.".into(), playbook: None },
            message: "m".into(),
            created_by: "test".into(),
        };
        s.create_prompt(prompt, v1).await.unwrap();
        let traces: Vec<_> = (0..N)
            .map(|i| {
                let t: NewTrace = serde_json::from_value(insight_trace("resumed", i)).unwrap();
                t.validate(TraceLimits { max_field_bytes: 4096, max_trace_bytes: 16384 }, "default").unwrap()
            })
            .collect();
        s.insert_traces(&traces).await.unwrap();
        let open = OpenRound {
            prompt: name.clone(),
            trigger: RoundTrigger::Api,
            method: Method::Combee,
            batch: N as u32,
            min_traces: 1,
            seed: 3,
            inbound_webhook_id: None,
            judge_wait: None,
            base_version: None,
        };
        s.open_round(&open).await.unwrap().expect("a round opens");
        let llm = LlmConfig { base_url: sim.url.clone(), max_concurrency: 1, backoff_base_ms: 1, ..Default::default() };
        let client = OpenAiClient::new(llm.clone()).unwrap();

        // Attempt 1: every reflection and the first groups answer, then the backend is down.
        let first = claim(&s).await;
        let journal = StoreJournal::new(
            s.clone(),
            first.round.id,
            first.round.attempt,
            RoundDetail::read(&first.round.detail).unwrap(),
        );
        let down = DownAfter { inner: client.clone(), ok: N + ANSWERED, seen: AtomicUsize::new(0) };
        let err =
            run_round(&down, &llm, &spec_of(&first), &first.base.content, &first.traces, &journal).await.unwrap_err();
        assert!(err.is_retryable(), "{err}");
        s.fail_round(
            first.round.id,
            first.round.attempt,
            &err.to_string(),
            RoundFailure::Retry { after: Duration::ZERO },
        )
        .await
        .unwrap();

        // Attempt 2, from what the store kept: no reflection and no answered group is paid again.
        let second = claim(&s).await;
        assert_eq!((second.round.id, second.round.attempt), (first.round.id, first.round.attempt + 1));
        let journal = StoreJournal::new(
            s.clone(),
            second.round.id,
            second.round.attempt,
            RoundDetail::read(&second.round.detail).unwrap(),
        );
        let (reflect0, aggregate0) = (sim.calls("reflect").await, sim.calls("aggregate-playbook").await);
        let out =
            run_round(&client, &llm, &spec_of(&second), &second.base.content, &second.traces, &journal).await.unwrap();
        let aggregated = sim.calls("aggregate-playbook").await - aggregate0;
        eprintln!(
            "resumed round (store-backed journal, {b:?}): k = {}, {} groups reused, {aggregated} aggregator calls paid",
            out.k, out.resumed_groups
        );
        assert_eq!(sim.calls("reflect").await - reflect0, 0, "no reflection is asked for again");
        assert_eq!(out.k, 5);
        assert_eq!(out.resumed_groups, ANSWERED);
        assert_eq!(aggregated as usize, out.k - ANSWERED, "only the missing groups are called");
        assert_eq!(out.group_outputs.len(), out.k);
    }

    on_both_stores!(a_resumed_round_calls_only_the_missing_groups);
}

/// A round's record written by an earlier version (group outputs as an object by
/// group index, phases without `elapsed_ms`, an outcome from before answer
/// reports and coverage) still reads: the API passes it through unchanged and
/// the round page shows its phases, operations and group outputs.
mod stored_detail {
    use std::time::Duration;

    use super::*;

    async fn a_round_recorded_by_an_earlier_version_still_shows(b: Backend) {
        let app = crate::common::spawn_app(b).await;
        create(&app, "old-record", "playbook", json!({})).await;
        send_traces(&app, "old-record", 2).await;
        let round = trigger(&app, "old-record", json!({})).await;
        let id: uuid::Uuid = round["id"].as_str().unwrap().parse().unwrap();
        let claimed =
            app.store.claim_round("old-shape-test", Duration::from_secs(60)).await.unwrap().expect("claimable");
        assert_eq!(claimed.round.id, id);
        let (t1, t2) = (claimed.traces[0].id, claimed.traces[1].id);
        let old = json!({
            "phases": {
                "map": {"started_at": "2026-01-02T03:04:05Z", "finished_at": "2026-01-02T03:04:06.250Z"},
                "reduce1": {"started_at": "2026-01-02T03:04:06.300Z"},
            },
            "unreflected": {},
            "group_outputs": {
                "1": {"group": 1, "traces": [t2], "output": {"operations": [{"op": "ADD", "section": "s", "content": "from group one"}]}},
                "0": {"group": 0, "traces": [t1], "output": {"operations": []}},
            },
            "outcome": {
                "n": 2, "k": 2, "p": 1,
                "map": {"reflected": 2, "resumed": 0, "from_traces": 0},
                "unreflected": [],
                "applied": [{"op": {"op": "ADD", "section": "s", "content": "verify the order id first"}, "groups": [1], "bullet_id": "s-00001"}],
                "skipped": [],
                "evicted": [],
                "timings": {"map_ms": 1250, "shuffle_ms": 0, "reduce1_ms": 5, "reduce2_ms": 0},
            },
        });
        assert!(app.store.update_round(id, claimed.round.attempt, Some(2), &old).await.unwrap());

        let got: Value = app.get(&format!("/v1/rounds/{id}")).send().await.unwrap().json().await.unwrap();
        assert_eq!(got["detail"], old, "the API shows the stored record as it is");

        let page = round_page(&app, id).await;
        assert!(page.contains(r#"id="phases""#) && page.contains("<td>map</td>"), "the finished phase: {page}");
        assert!(page.contains("verify the order id first") && page.contains("s-00001"), "the applied op: {page}");
        assert!(page.contains("Group 0 · 1 reflections") && page.contains("Group 1 · 1 reflections"), "{page}");
        assert!(page.contains("from group one"), "group 1's output: {page}");
    }

    /// A refused answer's text, as the LLM client records it, reaches the round's
    /// API answer as it is and the round page escaped, beside why it was refused.
    async fn a_refused_answer_shows_its_text_in_the_api_and_the_page(b: Backend) {
        use combee::llm::{AnswerRead, LlmCall, LlmRole, OutputFormat};
        let app = crate::common::spawn_app(b).await;
        create(&app, "refused", "playbook", json!({})).await;
        send_traces(&app, "refused", 1).await;
        let round = trigger(&app, "refused", json!({})).await;
        let id: uuid::Uuid = round["id"].as_str().unwrap().parse().unwrap();
        let claimed = app.store.claim_round("refusal-test", Duration::from_secs(60)).await.unwrap().expect("claimable");
        let answer = "Sure! <script>alert(1)</script> {\"bullets\": [";
        let call = |read, refused_answer: Option<&str>, error: Option<&str>| LlmCall {
            role: LlmRole::Reflector,
            model: "smollm2-135m".into(),
            prompt_tokens: 900,
            completion_tokens: 40,
            cost_usd: 0.0,
            latency_ms: 61_000,
            retries: 0,
            error: error.map(str::to_owned),
            read: Some(read),
            refused_answer: refused_answer.map(str::to_owned),
            output_format: Some(OutputFormat::JsonObjectSchema),
            concurrency_limit: Some(1),
        };
        let why = "the reflector's answer did not parse: expected a JSON object";
        for c in [call(AnswerRead::Refused, Some(answer), Some(why)), call(AnswerRead::Repaired, None, None)] {
            app.store.record_llm_call(id, claimed.round.attempt, &c).await.unwrap();
        }

        let got: Value = app.get(&format!("/v1/rounds/{id}")).send().await.unwrap().json().await.unwrap();
        let calls = got["llm_calls"].as_array().unwrap();
        assert_eq!(
            (&calls[0]["read"], &calls[0]["refused_answer"], &calls[0]["error"]),
            (&json!("refused"), &json!(answer), &json!(why)),
            "{got}"
        );
        assert_eq!(
            (&calls[0]["output_format"], &calls[0]["concurrency_limit"]),
            (&json!("json_object_schema"), &json!(1))
        );
        assert_eq!((&calls[1]["read"], calls[1].get("refused_answer")), (&json!("repaired"), None));

        let page = round_page(&app, id).await;
        assert!(!page.contains("<script>alert(1)</script>"), "the model's text is escaped: {page}");
        assert!(page.contains("Sure! &lt;script&gt;alert(1)&lt;/script&gt;"), "the refused text: {page}");
        assert!(page.contains("The model&#39;s answer (untrusted") || page.contains("The model's answer (untrusted"));
        assert!(page.contains("expected a JSON object"), "why it was refused: {page}");
        assert!(page.contains(r#"id="answer-reads""#), "{page}");
        assert!(page.contains(r#"<strong id="answers-refused">1</strong>"#), "{page}");
        assert!(page.contains(r#"<strong id="answers-repaired">1</strong>"#), "{page}");
        assert!(page.contains("json_object_schema"), "{page}");
    }

    on_both_stores!(
        a_round_recorded_by_an_earlier_version_still_shows,
        a_refused_answer_shows_its_text_in_the_api_and_the_page
    );
}

/// A prompt whose rounds fail backs off: the scheduler waits an exponential
/// delay after each failed round, subscribers hear of a streak once, and an
/// operator or a round that publishes ends it.
mod backoff {
    use std::sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    };

    use super::*;

    /// An OpenAI-compatible endpoint in front of the simulator that, while
    /// `confused` is set, answers every call with prose (no JSON), as a small
    /// model that cannot follow the format would. Returns its base URL.
    async fn sometimes_confused(sim_url: String, confused: Arc<AtomicBool>) -> String {
        type Relay = (String, Arc<AtomicBool>);
        async fn relay(
            axum::extract::State((sim_url, confused)): axum::extract::State<Relay>,
            body: axum::body::Bytes,
        ) -> axum::response::Response {
            use axum::response::IntoResponse;
            let mut answer = simulated_answer(&sim_url, &body).await;
            if confused.load(Ordering::SeqCst) {
                answer["choices"][0]["message"]["content"] = json!("Here is what I learned: be careful.");
            }
            axum::Json(answer).into_response()
        }
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/v1", listener.local_addr().unwrap());
        let router = axum::Router::new()
            .route("/v1/chat/completions", axum::routing::post(relay))
            .with_state((sim_url, confused));
        tokio::spawn(async move { axum::serve(listener, router).await });
        url
    }

    /// A webhook receiver keeping the `round.failed` events' round ids. Returns its URL.
    async fn failed_rounds_receiver(got: Arc<Mutex<Vec<String>>>) -> String {
        async fn receive(axum::extract::State(got): axum::extract::State<Arc<Mutex<Vec<String>>>>, body: String) {
            let event: Value = serde_json::from_str(&body).unwrap();
            if event["type"] == "round.failed" {
                got.lock().unwrap().push(event["data"]["round_id"].as_str().unwrap().to_owned());
            }
        }
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/hook", listener.local_addr().unwrap());
        let router = axum::Router::new().route("/hook", axum::routing::post(receive)).with_state(got);
        tokio::spawn(async move { axum::serve(listener, router).await });
        url
    }

    /// The prompt's rounds, oldest first.
    async fn rounds_of(app: &TestApp, name: &str) -> Vec<Value> {
        let list: Value =
            app.get(&format!("/v1/prompts/{name}/rounds?page_size=100")).send().await.unwrap().json().await.unwrap();
        let mut rounds = list["rounds"].as_array().unwrap().clone();
        rounds.reverse();
        rounds
    }

    /// Polls until the prompt has `n` rounds, all ended; oldest first.
    async fn ended_rounds(app: &TestApp, name: &str, n: usize) -> Vec<Value> {
        let rounds = eventually(&format!("{n} ended rounds"), Duration::from_secs(60), async || {
            let rounds = rounds_of(app, name).await;
            let ended = rounds.iter().all(|r| r["status"] == "succeeded" || r["status"] == "failed");
            if rounds.len() >= n && ended { Ok(rounds) } else { Err(format!("{rounds:?}")) }
        })
        .await;
        assert_eq!(rounds.len(), n, "{rounds:?}");
        rounds
    }

    async fn learning_state(app: &TestApp, name: &str) -> Value {
        let res = app.get(&format!("/v1/prompts/{name}/learning")).send().await.unwrap();
        assert_eq!(res.status(), 200);
        res.json().await.unwrap()
    }

    fn at(v: &Value) -> chrono::DateTime<chrono::Utc> {
        v.as_str().unwrap().parse().unwrap()
    }

    /// The scheduler's passes so far, from `/metrics`.
    async fn schedule_passes(app: &TestApp) -> f64 {
        let text = app.get("/metrics").send().await.unwrap().text().await.unwrap();
        text.lines()
            .find_map(|l| l.strip_prefix("combee_worker_schedule_passes_total "))
            .map_or(0.0, |v| v.trim().parse::<f64>().unwrap())
    }

    const DELAY: i64 = 5;

    async fn a_failing_prompt_backs_off_until_an_operator_or_a_success_ends_it(b: Backend) {
        let sim = spawn_sim(sim()).await;
        let confused = Arc::new(AtomicBool::new(true));
        let llm = sometimes_confused(sim.url.clone(), confused.clone()).await;
        let app = spawn_app_with(b, |s| {
            learning(s, &llm);
            s.worker.failure_backoff_secs = DELAY as u64;
            s.worker.failure_backoff_max_secs = DELAY as u64;
            s.worker.max_trace_attempts = 100;
            s.webhooks.allow_private_targets = true;
            s.webhooks.poll_interval_ms = 50;
        })
        .await;
        let told = Arc::new(Mutex::new(Vec::new()));
        let hook = failed_rounds_receiver(told.clone()).await;
        let res = app.post("/v1/webhooks", json!({"url": hook, "events": ["round.failed"]})).send().await.unwrap();
        assert_eq!(res.status(), 201, "{}", res.text().await.unwrap());
        create(&app, "b", "playbook", json!({"batch_size": 2, "duplication": 1})).await;
        assert_eq!(learning_state(&app, "b").await["state"], "ok");
        send_traces(&app, "b", 2).await;

        // The scheduler's round fails: the prompt backs off, and says why.
        let first = ended_rounds(&app, "b", 1).await;
        assert_eq!((&first[0]["status"], &first[0]["trigger"]), (&json!("failed"), &json!("backlog")));
        let state = learning_state(&app, "b").await;
        assert_eq!((&state["state"], &state["failure_streak"]), (&json!("backing_off"), &json!(1)), "{state}");
        assert_eq!(state["last_failure"], first[0]["error"], "{state}");
        let until = at(&state["backoff_until"]);
        assert_eq!(until, at(&state["last_failed_at"]) + chrono::Duration::seconds(DELAY), "{state}");
        let metrics = app.get("/metrics").send().await.unwrap().text().await.unwrap();
        assert!(metrics.contains("combee_prompts_backing_off 1\n"), "{metrics}");
        assert!(metrics.contains("combee_prompt_failure_streak{prompt=\"b\",project=\"default\"} 1\n"), "{metrics}");

        // No round before the backoff ends, though the scheduler passes; then the next one, which fails too.
        let passes = schedule_passes(&app).await;
        let second = ended_rounds(&app, "b", 2).await;
        assert!(schedule_passes(&app).await - passes >= 3.0, "the scheduler kept passing while it waited");
        let waited = at(&second[1]["created_at"]) - at(&second[0]["finished_at"]);
        assert!(waited >= chrono::Duration::seconds(DELAY), "the second round came {waited} after the first failed");
        let state = learning_state(&app, "b").await;
        assert_eq!((&state["state"], &state["failure_streak"]), (&json!("backing_off"), &json!(2)), "{state}");

        // An operator's clear ends the streak: the scheduler runs a round at once (it fails: a new streak).
        let res = app.http.delete(app.url("/v1/prompts/b/backoff")).bearer_auth(&app.admin_key).send().await.unwrap();
        assert_eq!(res.status(), 200);
        let cleared: Value = res.json().await.unwrap();
        assert_eq!((&cleared["state"], &cleared["failure_streak"]), (&json!("ok"), &json!(0)), "{cleared}");
        let third = ended_rounds(&app, "b", 3).await;
        assert_eq!(third[2]["status"], "failed");
        assert_eq!(learning_state(&app, "b").await["failure_streak"], 1);

        // Subscribers heard of each streak once: its first failed round.
        eventually("two round.failed events", Duration::from_secs(30), async || {
            let told = told.lock().unwrap();
            if told.len() >= 2 { Ok(()) } else { Err(format!("{told:?}")) }
        })
        .await;
        let ids: Vec<&Value> = [&third[0]["id"], &third[2]["id"]].into();
        let heard: Vec<Value> = told.lock().unwrap().iter().map(|id| json!(id)).collect();
        assert_eq!(heard.iter().collect::<Vec<_>>(), ids, "one round.failed per streak");

        // A manual round runs at once in a backoff, and publishing ends the streak.
        confused.store(false, Ordering::SeqCst);
        assert_eq!(learning_state(&app, "b").await["state"], "backing_off");
        let round = trigger(&app, "b", json!({})).await;
        let done = round_end(&app, round["id"].as_str().unwrap(), Duration::from_secs(60)).await;
        assert_eq!(done["status"], "succeeded", "{done}");
        let state = learning_state(&app, "b").await;
        assert_eq!(
            (&state["state"], &state["failure_streak"], &state["last_failure"]),
            (&json!("ok"), &json!(0), &Value::Null),
            "{state}"
        );
        let missing = app.get("/v1/prompts/nope/learning").send().await.unwrap();
        assert_eq!(missing.status(), 404);
    }

    /// A model that never answers usably: each round charges the traces whose
    /// reflection it refused, so after `max_trace_attempts` rounds they are
    /// `failed` with the reason, and the scheduler stops (nothing is pending).
    async fn traces_refused_every_time_end_failed_and_rounds_stop(b: Backend) {
        let sim = spawn_sim(sim()).await;
        let llm = sometimes_confused(sim.url.clone(), Arc::new(AtomicBool::new(true))).await;
        let app = spawn_app_with(b, |s| {
            learning(s, &llm);
            s.worker.failure_backoff_secs = 0;
            s.worker.max_trace_attempts = 2;
        })
        .await;
        create(&app, "never", "playbook", json!({"batch_size": 3, "duplication": 1})).await;
        send_traces(&app, "never", 3).await;
        eventually("three failed traces", Duration::from_secs(60), async || {
            if traces_with(&app, "never", "failed").await.len() >= 3 {
                Ok(())
            } else {
                Err(format!("pending: {:?}", traces_with(&app, "never", "pending").await))
            }
        })
        .await;
        for t in traces_with(&app, "never", "failed").await {
            assert_eq!(t["attempts"], 2, "{t}");
            assert!(t["failure_reason"].as_str().unwrap().contains("reflection"), "{t}");
        }
        let rounds = ended_rounds(&app, "never", 2).await;
        assert!(rounds.iter().all(|r| r["status"] == "failed"), "{rounds:?}");
        // The scheduler goes on passing and opens nothing more.
        let passes = schedule_passes(&app).await;
        eventually("five more scheduler passes", Duration::from_secs(30), async || {
            let more = schedule_passes(&app).await - passes;
            if more >= 5.0 { Ok(()) } else { Err(format!("{more} passes")) }
        })
        .await;
        assert_eq!(rounds_of(&app, "never").await.len(), 2);
    }

    on_both_stores!(
        a_failing_prompt_backs_off_until_an_operator_or_a_success_ends_it,
        traces_refused_every_time_end_failed_and_rounds_stop
    );
}

/// The web UI's page of round `id`, as a reader with `prompts:read` sees it.
async fn round_page(app: &crate::common::TestApp, id: uuid::Uuid) -> String {
    let signed_in = crate::ui_browser::sign_in(app, &app.key_with(&["prompts:read"]).await).await;
    let session = crate::ui_browser::set_cookie(&signed_in, "combee_session").expect("a session");
    let res = crate::ui_browser::plain_client()
        .get(app.url(&format!("/ui/rounds/{id}")))
        .header("cookie", format!("combee_session={session}"))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    res.text().await.unwrap()
}

/// The simulator's answer to a chat request, for relays that change what it says.
async fn simulated_answer(sim_url: &str, body: &[u8]) -> Value {
    let res = reqwest::Client::new()
        .post(format!("{sim_url}/chat/completions"))
        .header("content-type", "application/json")
        .body(body.to_vec())
        .send()
        .await
        .unwrap();
    res.json().await.unwrap()
}
